"""A task with many variables: partial variable training's kind of model, on digits.

PVT (Yang et al. 2022, ``docs/algorithms.md`` §11) trains a random subset of a model's
*variables* (whole tensors) per client and round; its uplink falls by at most V/k for k of
V tensors. ``digits-cnn4`` has V = 18, so one tensor a client caps the expected ratio at
18x; the paper's speech Conformers (and the ResNets/VGGs of later work) have hundreds.

- ``digits-resnet14``: scikit-learn digits (1x8x8) with a CIFAR-style ResNet-14 (6n + 2,
  n = 2): a 3x3 stem, three layers of two basic blocks (widths 8, 16, 32; strides 1, 2,
  2; 1x1 projection shortcuts where the shape changes), GroupNorm (no buffers), then a
  pooled linear classifier. V = 47 tensors (the 1x1 projections and norms included),
  d = 44,226; a client round of 10 steps of batch 16 takes a few tens of milliseconds on a core.
- ``digits-resnet14-wide`` (``fedswarm.tasks.deep:digits_resnet14_wide``): the same at 8x
  the width (2.8M parameters) for measuring training memory, where the 45k model's state
  is below what resident memory resolves.
"""

from __future__ import annotations

from torch import nn

from fedswarm.tasks.base import Task
from fedswarm.tasks.builtin import _digits
from fedswarm.tasks.staged import BasicBlock, _kaiming, _norm, pooled_head

__all__ = ["resnet_deep", "digits_resnet14", "digits_resnet14_wide", "DEEP_TASKS"]


def resnet_deep(in_channels: int, num_classes: int, width: int = 8, blocks_per_layer: int = 2) -> nn.Module:
    """A CIFAR-style ResNet (He et al. 2016, depth 6n + 2 with n = ``blocks_per_layer``):
    stem conv + norm + ReLU, three layers of n basic blocks at widths w, 2w, 4w (the first
    block of layers 2 and 3 has stride 2 and a 1x1 projection shortcut), pooled linear head."""
    if width < 1 or blocks_per_layer < 1:
        raise ValueError(f"resnet_deep needs width >= 1 and blocks_per_layer >= 1, got {width}, {blocks_per_layer}")
    w = width
    layers: list[nn.Module] = [nn.Conv2d(in_channels, w, 3, 1, 1, bias=False), _norm(w), nn.ReLU()]
    cin = w
    for i, cout in enumerate((w, 2 * w, 4 * w)):
        for b in range(blocks_per_layer):
            layers.append(BasicBlock(cin, cout, 2 if (i > 0 and b == 0) else 1))
            cin = cout
    layers.append(pooled_head(cin, num_classes))
    return _kaiming(nn.Sequential(*layers))


DEEP_TASKS: dict[str, Task] = {
    "digits-resnet14": Task(
        "digits-resnet14",
        "scikit-learn digits as 1x8x8 images, ResNet-14 with GroupNorm (47 variables, d = 44,226; for PVT)",
        lambda: resnet_deep(1, 10),
        lambda seed, tf: _digits(seed, tf, image=True),
    ),
}


def digits_resnet14() -> Task:
    """The ``digits-resnet14`` task (also ``--task fedswarm.tasks.deep:digits_resnet14``)."""
    return DEEP_TASKS["digits-resnet14"]


def digits_resnet14_wide() -> Task:
    """``digits-resnet14`` at 8x the width (64-128-256): the same data and architecture at a
    size where a client's training state is megabytes (memory probes of the PVT claim)."""
    return Task("digits-resnet14-wide", "scikit-learn digits, ResNet-14 at widths 64-128-256",
                lambda: resnet_deep(1, 10, width=64), lambda seed, tf: _digits(seed, tf, image=True))
