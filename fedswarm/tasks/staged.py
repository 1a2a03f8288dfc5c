"""Staged models for progressive training (ProgFed, ``docs/algorithms.md`` §12).

A :class:`StagedModel` is ``M = G_S ∘ E_S ∘ … ∘ E_1``: ``blocks`` ``E_1..E_S`` then the
``classifier`` ``G_S``. Its parameters are ordered blocks first, classifier last, so the
blocks of stage ``s`` are a *prefix* of the model's flat vector
(:meth:`StagedModel.prefix_numel`). Stage ``s < S`` trains
``G_s ∘ E_s ∘ … ∘ E_1`` with a small local head ``G_s`` (:meth:`make_head`: adaptive
average pooling, flatten, linear, as in the official ProgFed ResNet code); the last stage
is the full model, whose head is the real classifier. Heads are never parameters of the
model itself: the task's model (what FedAvg trains and the server evaluates) is the full
model and nothing else.

Tasks (to be merged into ``fedswarm.tasks.TASKS``; before that, reachable as
``fedswarm.tasks.staged:digits_cnn4``):

- ``digits-cnn4``: scikit-learn digits (1x8x8), four conv blocks 8-16-32-64;
- ``mnist-resnet``, ``cifar10-resnet``, ``femnist-resnet``: the Hugging Face image tasks
  with a four-stage ResNet-style model (GroupNorm, no buffers: only trainable parameters
  travel, see ``fedswarm.params``).

:func:`step_flops` counts the FLOPs of one training step (forward and backward) with
``torch.utils.flop_counter.FlopCounterMode``; ProgFed reports it beside bytes.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from fedswarm.tasks.base import Task
from fedswarm.tasks.builtin import DIGITS_IMAGES, _digits
from fedswarm.tasks.hf import HF_SPECS, HFImageSpec, load_hf_images

__all__ = [
    "StagedModel",
    "StageModel",
    "pooled_head",
    "cnn4",
    "resnet_staged",
    "step_flops",
    "digits_cnn4",
    "digits_cnn4_wide",
    "STAGED_TASKS",
]


def pooled_head(channels: int, num_classes: int) -> nn.Module:
    """ProgFed's head: adaptive average pooling, flatten, linear."""
    return nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, num_classes))


class StageModel(nn.Module):
    """``head ∘ blocks[-1] ∘ … ∘ blocks[0]``: the sub-model of one stage. The blocks are
    the full model's own modules (shared, not copied); parameters are ordered blocks
    first, head last, like the full model's."""

    def __init__(self, blocks: Sequence[nn.Module], head: nn.Module):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class StagedModel(nn.Module):
    """A model split into ``S`` blocks plus a classifier, for progressive training.

    Parameters
    ----------
    blocks : sequence of nn.Module
        ``E_1..E_S``; block ``s`` maps the output of block ``s - 1`` onward.
    widths : sequence of int
        Output channels of each block (the input size of its local head).
    num_classes : int
        Classes of the task.
    classifier : nn.Module, optional
        ``G_S``; a pooled linear head on the last block by default.
    """

    def __init__(self, blocks: Sequence[nn.Module], widths: Sequence[int], num_classes: int,
                 classifier: nn.Module | None = None):
        super().__init__()
        if len(blocks) != len(widths) or not blocks:
            raise ValueError("a staged model needs one width per block and at least one block")
        self.blocks = nn.ModuleList(blocks)
        self.widths = tuple(int(w) for w in widths)
        self.num_classes = int(num_classes)
        self.classifier = classifier if classifier is not None else pooled_head(self.widths[-1], num_classes)

    @property
    def num_stages(self) -> int:
        return len(self.blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.classifier(x)

    def _check(self, stage: int) -> None:
        if not 1 <= stage <= self.num_stages:
            raise ValueError(f"stage must be in 1..{self.num_stages}, got {stage}")

    def make_head(self, stage: int) -> nn.Module:
        """A fresh local head ``G_s`` for stage ``s < S`` (initialized from torch's global
        RNG); for ``s = S`` the model's own classifier."""
        self._check(stage)
        if stage == self.num_stages:
            return self.classifier
        return pooled_head(self.widths[stage - 1], self.num_classes)

    def stage_model(self, stage: int, head: nn.Module | None = None) -> StageModel:
        """The sub-model of ``stage``: blocks ``1..stage`` (shared with this model) and
        ``head`` (a fresh :meth:`make_head` if None)."""
        self._check(stage)
        return StageModel(list(self.blocks[:stage]), head if head is not None else self.make_head(stage))

    def prefix_numel(self, stage: int) -> int:
        """Parameters of blocks ``1..stage``: the length of their prefix of the flat vector."""
        self._check(stage)
        return sum(p.numel() for b in self.blocks[:stage] for p in b.parameters() if p.requires_grad)

    def head_numel(self, stage: int) -> int:
        """Parameters of the head of ``stage`` (the classifier for the last stage)."""
        with torch.random.fork_rng(devices=[]):  # a throwaway head must not move the global RNG
            head = self.make_head(stage)
        return sum(p.numel() for p in head.parameters() if p.requires_grad)


# -- models ---------------------------------------------------------------------------


def _kaiming(model: nn.Module) -> nn.Module:
    """He initialization of every convolution (ReLU gain, zero bias): with PyTorch's
    default, a narrow four-block CNN sits near chance for its first hundred steps."""
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
    return model


def cnn4(in_channels: int, num_classes: int, widths: Sequence[int] = (8, 16, 32, 64)) -> StagedModel:
    """Four 3x3 conv blocks (conv, GroupNorm, ReLU; blocks 2-4 end with 2x2 max-pooling),
    then a pooled linear classifier. Sized for 8x8 digits: the last block outputs 1x1."""
    blocks, c = [], in_channels
    for i, w in enumerate(widths):
        layers: list[nn.Module] = [nn.Conv2d(c, w, 3, padding=1), nn.GroupNorm(min(4, w), w), nn.ReLU()]
        if i > 0:
            layers.append(nn.MaxPool2d(2))
        blocks.append(nn.Sequential(*layers))
        c = w
    return _kaiming(StagedModel(blocks, widths, num_classes))


def _norm(channels: int) -> nn.Module:
    # GroupNorm, not BatchNorm: no running statistics, which no strategy communicates.
    return nn.GroupNorm(min(8, channels), channels)


class BasicBlock(nn.Module):
    """ResNet's basic block (two 3x3 convs and a shortcut) with GroupNorm."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.n1 = _norm(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.n2 = _norm(cout)
        self.shortcut = (nn.Identity() if stride == 1 and cin == cout
                         else nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), _norm(cout)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.n1(self.conv1(x)))
        return torch.relu(self.n2(self.conv2(out)) + self.shortcut(x))


def resnet_staged(in_channels: int, num_classes: int, width: int = 16) -> StagedModel:
    """A ResNet-10-style model in ProgFed's four stages ([stem + layer1], layer2, layer3,
    layer4; one basic block per layer, widths w, 2w, 4w, 8w, strides 1, 2, 2, 2)."""
    w = width
    stem = nn.Sequential(nn.Conv2d(in_channels, w, 3, 1, 1, bias=False), _norm(w), nn.ReLU())
    blocks = [nn.Sequential(stem, BasicBlock(w, w)), BasicBlock(w, 2 * w, 2), BasicBlock(2 * w, 4 * w, 2),
              BasicBlock(4 * w, 8 * w, 2)]
    return _kaiming(StagedModel(blocks, (w, 2 * w, 4 * w, 8 * w), num_classes))


# -- compute --------------------------------------------------------------------------


def step_flops(model: nn.Module, objective: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor],
               x: torch.Tensor, y: torch.Tensor) -> int:
    """FLOPs of one training step on the minibatch ``(x, y)``: forward, loss and the
    backward pass to every trainable parameter, as counted by
    ``torch.utils.flop_counter.FlopCounterMode`` (matmuls and convolutions; elementwise
    ops count zero). Leaves no ``.grad`` behind."""
    from torch.utils.flop_counter import FlopCounterMode

    params = [p for p in model.parameters() if p.requires_grad]
    with FlopCounterMode(display=False) as counter:
        loss = objective(model, x, y)
        if params:
            torch.autograd.grad(loss, params)
    return int(counter.get_total_flops())


# -- tasks ----------------------------------------------------------------------------


def digits_cnn4() -> Task:
    """The ``digits-cnn4`` task (also usable as ``--task fedswarm.tasks.staged:digits_cnn4``)."""
    return STAGED_TASKS["digits-cnn4"]


def digits_cnn4_wide() -> Task:
    """``digits-cnn4`` at 8x the width (64-128-256-512, 1.55M parameters): the same data
    and architecture at a size where a client's training state is megabytes (memory
    benchmarks: ``fedswarm bench edge``)."""
    return Task("digits-cnn4-wide", "scikit-learn digits, four-block CNN 64-128-256-512 (staged)",
                lambda: cnn4(1, 10, (64, 128, 256, 512)), lambda seed, tf: _digits(seed, tf, image=True))


def _hf_resnet(name: str, spec: HFImageSpec) -> Task:
    return Task(
        name,
        f"{spec.dataset} from the Hugging Face hub via flwr-datasets (needs the network), "
        "four-stage ResNet-style model (ProgFed)",
        lambda: resnet_staged(spec.channels, spec.num_classes),
        lambda seed, tf: load_hf_images(spec, seed, tf),
    )


STAGED_TASKS: dict[str, Task] = {
    "digits-cnn4": Task(
        "digits-cnn4",
        "scikit-learn digits as 1x8x8 images, four-block CNN (staged, for ProgFed)",
        lambda: cnn4(1, 10),
        lambda seed, tf: _digits(seed, tf, image=True),
        examples=DIGITS_IMAGES,
    ),
    **{f"{name}-resnet": _hf_resnet(f"{name}-resnet", spec) for name, spec in HF_SPECS.items()},
}
