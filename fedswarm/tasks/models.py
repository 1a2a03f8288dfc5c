"""The models of the built-in tasks. Small on purpose: they train in seconds on a CPU."""

from __future__ import annotations

from torch import nn


def mlp(in_features: int, num_classes: int, hidden: int = 64) -> nn.Module:
    """A two-layer perceptron: ``in -> hidden -> ReLU -> classes``."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(in_features, hidden),
        nn.ReLU(),
        nn.Linear(hidden, num_classes),
    )


def small_cnn(in_channels: int, side: int, num_classes: int, width: int = 16) -> nn.Module:
    """Two 3x3 conv blocks (conv, ReLU, 2x2 max-pool) then a linear classifier."""
    after = side // 4
    return nn.Sequential(
        nn.Conv2d(in_channels, width, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(width, 2 * width, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(2 * width * after * after, num_classes),
    )


def logistic(in_features: int) -> nn.Module:
    """Binary logistic regression: one linear unit, the logit."""
    return nn.Linear(in_features, 1)
