"""What a task is: a model, its data, and its objective."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["Task", "TaskData", "ExampleSpec", "cross_entropy", "accuracy_multiclass"]


@dataclass
class TaskData:
    """A task's data: the training pool (split across clients by a partitioner) and the
    held-out global test set. ``train`` is a Hugging Face ``datasets.Dataset`` with columns
    ``x`` (features) and ``label`` when partitioning goes through flwr-datasets; tensors
    ``train_x``/``train_y`` are the same data as torch tensors, row for row."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    num_classes: int
    meta: dict[str, Any] = field(default_factory=dict)


def cross_entropy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y)


def accuracy_multiclass(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    return (model(x).argmax(dim=1) == y).float().mean().item()


@dataclass(frozen=True)
class ExampleSpec:
    """What one example of a task looks like, so a node's own data can be read and checked
    (:mod:`fedswarm.tasks.localdata`).

    ``shape`` is the model's input for one example; an example stored in any shape of
    ``accepts`` (same number of values) is reshaped to it. Feature values must lie in
    ``value_range`` on the model's scale; 8-bit data (image files, ``uint8`` arrays) is first
    divided by ``pixel_scale``. ``image_size`` (height, width) and ``image_mode`` (Pillow's
    ``L`` grey or ``RGB``) say how an image file becomes a tensor; labels are integers in
    ``0..num_classes-1`` (an ImageFolder's subfolder is the class number or one of
    ``class_names``). ``reader(path, label_column) -> (x, y)`` replaces the built-in readers
    for a user's task (its arrays are then checked like any other)."""

    shape: tuple[int, ...]
    num_classes: int
    accepts: tuple[tuple[int, ...], ...] = ()
    value_range: tuple[float, float] = (0.0, 1.0)
    pixel_scale: float = 255.0
    image_size: tuple[int, int] | None = None
    image_mode: str = "L"
    class_names: tuple[str, ...] = ()
    reader: Callable[[Any, str], tuple[Any, Any]] | None = None


@dataclass
class Task:
    """Model + data + objective.

    ``build_model(seed)`` returns a freshly initialised model (deterministic in the seed);
    ``load_data(seed, test_fraction)`` returns :class:`TaskData`; ``objective(model, x, y)``
    is the training loss on a batch and ``accuracy(model, x, y)`` the test metric.
    ``examples`` says what one example looks like, for nodes that bring their own data
    (``fedswarm client --data``); a task without it trains only on its own ``load_data``.
    """

    name: str
    description: str
    build_model: Callable[[], nn.Module]
    load_data: Callable[[int, float], TaskData]
    objective: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy
    accuracy: Callable[[nn.Module, torch.Tensor, torch.Tensor], float] = accuracy_multiclass
    extra: dict[str, Any] = field(default_factory=dict)
    examples: ExampleSpec | None = None

    def model(self, seed: int) -> nn.Module:
        """The initial model: the same weights on every engine and node for one seed."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return self.build_model()
