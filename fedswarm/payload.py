"""The message an algorithm sends: a :class:`Payload` of named arrays and scalar metadata.

A codec's ``encode`` returns one, a decentralized algorithm's message is one, and every
runtime carries it: Flower turns it into records (:mod:`fedswarm.wire`), the swarm frames
its raw bytes (:mod:`fedswarm.swarm.net.payload`). This module is the Flower-free half,
so the algorithm layer (``fedswarm.algorithms``) can use it; the checks every runtime
applies to arrays that came off a network live here too (:func:`check_array`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

__all__ = ["Payload", "PayloadError", "ALLOWED_DTYPES", "check_array"]

#: dtypes a payload array may have once it came off the wire.
ALLOWED_DTYPES = frozenset(
    np.dtype(t) for t in ("float16", "float32", "float64", "int8", "uint8", "int16", "int32", "int64", "bool")
)


class PayloadError(ValueError):
    """A payload that is malformed: wrong keys, shapes, dtypes, non-finite values or too big."""


@dataclass
class Payload:
    """A codec's message: named arrays (numpy, or torch tensors on any device: they are
    moved to host memory when serialized) and scalar metadata (codec name, shapes, seeds)."""

    arrays: dict[str, np.ndarray | torch.Tensor]
    meta: dict[str, Any] = field(default_factory=dict)


def check_array(name: str, arr: np.ndarray) -> np.ndarray:
    """``arr`` if its dtype is allowed and, for floating point, every value is finite;
    :class:`PayloadError` naming the array otherwise."""
    if arr.dtype not in ALLOWED_DTYPES:
        raise PayloadError(f"payload array '{name}' has dtype {arr.dtype}, not allowed")
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
        raise PayloadError(f"payload array '{name}' has non-finite values")
    return arr
