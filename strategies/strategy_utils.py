"""Helpers shared by fedswarm's Flower strategies and their client halves.

In the spirit of Flower's own ``flwr.serverapp.strategy.strategy_utils``: what more than
one strategy needs lives here once, rather than being copied between strategy modules.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import torch
from flwr.app import RecordDict

from fedswarm.payload import PayloadError
from fedswarm.wire import arrayrecord_to_vector, vector_to_arrayrecord

__all__ = ["load_vector", "save_vector"]


def load_vector(state: RecordDict, key: str, d: int) -> torch.Tensor:
    """A ``[d]`` float32 vector kept in a node's ``Context.state`` under ``key`` (an
    error-feedback residual, a momentum buffer...); zeros if there is none, or if what is
    stored has the wrong size, dtype or non-finite values: a model change or a corrupted
    state must not poison the update."""
    rec = state.array_records.get(key)
    if rec is not None:
        try:
            return arrayrecord_to_vector(rec, d)
        except PayloadError:
            pass
    return torch.zeros(d, dtype=torch.float32)


def save_vector(state: RecordDict | MutableMapping[str, Any], key: str, x: torch.Tensor) -> None:
    """Store one node's ``[d]`` (or ``[1, d]``) vector under ``key`` as an ArrayRecord, the
    inverse of :func:`load_vector`."""
    if x.dim() == 2 and x.shape[0] == 1:
        x = x[0]
    if x.dim() != 1:
        raise ValueError(f"save one node's vector, [d] or [1, d]; got {tuple(x.shape)}")
    state[key] = vector_to_arrayrecord(x)
