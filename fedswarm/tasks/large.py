"""Tasks big enough for gradient sketching and 1-bit quantization to be measured.

A Count Sketch of r x c cells recovers the top k of a d-vector only when c is well above
k (the heavy hitters must not collide) and the sketch is much smaller than d; 1-bit SGD's
per-column scales only pay when columns are long. At digits-mlp's d = 4,810 neither holds
and Flower's message framing (~500 bytes a reply) dominates the bytes.

- ``digits-mlp-wide``: scikit-learn digits with a 64-512-512-10 MLP, d = 301,066 (1.2 MB
  in float32). One local epoch of 20 clients takes about a second on one core.
"""

from __future__ import annotations

from torch import nn

from fedswarm.tasks.base import Task
from fedswarm.tasks.builtin import _digits

__all__ = ["LARGE_TASKS", "wide_mlp", "digits_mlp_wide"]


def wide_mlp(inputs: int = 64, hidden: int = 512, classes: int = 10) -> nn.Module:
    """``inputs``-``hidden``-``hidden``-``classes`` MLP with ReLU."""
    return nn.Sequential(nn.Flatten(), nn.Linear(inputs, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, classes))


LARGE_TASKS: dict[str, Task] = {
    "digits-mlp-wide": Task("digits-mlp-wide", "scikit-learn digits, 64-512-512-10 MLP (d = 301,066)",
                            wide_mlp, lambda seed, tf: _digits(seed, tf, image=False)),
}


def digits_mlp_wide() -> Task:
    """The ``digits-mlp-wide`` task (also ``--task fedswarm.tasks.large:digits_mlp_wide``)."""
    return LARGE_TASKS["digits-mlp-wide"]
