"""What a task is: a model, its data, and its objective."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["Task", "TaskData", "cross_entropy", "accuracy_multiclass"]


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


@dataclass
class Task:
    """Model + data + objective.

    ``build_model(seed)`` returns a freshly initialised model (deterministic in the seed);
    ``load_data(seed, test_fraction)`` returns :class:`TaskData`; ``objective(model, x, y)``
    is the training loss on a batch and ``accuracy(model, x, y)`` the test metric.
    """

    name: str
    description: str
    build_model: Callable[[], nn.Module]
    load_data: Callable[[int, float], TaskData]
    objective: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy
    accuracy: Callable[[nn.Module, torch.Tensor, torch.Tensor], float] = accuracy_multiclass
    extra: dict[str, Any] = field(default_factory=dict)

    def model(self, seed: int) -> nn.Module:
        """The initial model: the same weights on every engine and node for one seed."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return self.build_model()
