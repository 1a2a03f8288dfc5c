"""Model payloads on the swarm wire, validated before anything touches a model.

A model travels as its raw float32 bytes (little-endian) with ``meta = {"dtype":
"float32", "d": d}``; a codec's :class:`~fedswarm.payload.Payload` travels as its arrays
concatenated, indexed in ``meta["arrays"]``, with its scalar meta in ``meta["codec_meta"]``.
Both readers check dtype, length and finiteness (codecs then check their own invariants in
``decode``) and raise :class:`~fedswarm.swarm.net.envelope.Dropped` ``("invalid_payload")``.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import numpy as np
import torch

from fedswarm.payload import Payload
from fedswarm.params import all_finite
from fedswarm.swarm.net.envelope import Dropped

__all__ = ["payload_body", "read_payload", "read_vector", "vector_body"]

_LITTLE = sys.byteorder == "little"
_DTYPES = {"float32": np.float32, "float16": np.float16, "int32": np.int32, "int64": np.int64,
           "uint8": np.uint8, "int8": np.int8, "int16": np.int16, "bool": np.bool_}


def vector_body(x: torch.Tensor) -> tuple[dict[str, Any], memoryview]:
    """``(meta, body)`` for a flat float32 vector; the body is a view of its storage."""
    arr = x.detach().reshape(-1).to(torch.float32).contiguous().cpu().numpy()
    if not _LITTLE:  # pragma: no cover
        arr = arr.astype("<f4")
    return {"dtype": "float32", "d": int(arr.size)}, memoryview(arr).cast("B")


def read_vector(meta: dict, body: bytearray, d: int, *, finite: bool | None = None) -> torch.Tensor:
    """The ``[d]`` float32 vector in ``body``; Dropped("invalid_payload") unless the dtype
    is float32, the length is ``d`` and every value is finite. Shares ``body``'s memory.
    ``finite``: the receive path's verdict on this very buffer (``Message.finite``, scanned
    chunk by chunk as it arrived), which saves the pass over it; None scans it here."""
    if meta.get("dtype") != "float32":
        raise Dropped("invalid_payload", f"model dtype is {meta.get('dtype')!r}, expected float32")
    if meta.get("d") != d or len(body) != 4 * d:
        raise Dropped("invalid_payload", f"model has {len(body) // 4} values, expected {d}")
    x = torch.frombuffer(body, dtype=torch.float32) if len(body) else torch.zeros(0)
    if not (all_finite(x) if finite is None else finite):
        raise Dropped("invalid_payload", "model has non-finite values")
    return x


def _is_size(n: Any) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 0


def payload_body(payload: Payload) -> tuple[dict[str, Any], bytes]:
    """``(meta, body)`` for a codec :class:`~fedswarm.payload.Payload`."""
    index, parts, off = {}, [], 0
    for name, arr in payload.arrays.items():
        a = arr.detach().cpu().numpy() if isinstance(arr, torch.Tensor) else np.asarray(arr)
        a = np.ascontiguousarray(a)
        raw = a.tobytes()
        index[name] = {"dtype": a.dtype.name, "shape": list(a.shape), "offset": off, "nbytes": len(raw)}
        parts.append(raw)
        off += len(raw)
    meta = {k: (v.item() if hasattr(v, "item") else v) for k, v in payload.meta.items()}
    return {"arrays": index, "codec_meta": meta}, b"".join(parts)


def read_payload(meta: dict, body: bytearray) -> Payload:
    """The codec Payload in ``body`` (arrays checked for dtype, extent and finiteness;
    the codec's ``decode`` checks the rest)."""
    index, cmeta = meta.get("arrays"), meta.get("codec_meta")
    if not isinstance(index, dict) or not isinstance(cmeta, dict):
        raise Dropped("invalid_payload", "payload has no array index or codec meta")
    arrays, end = {}, 0
    specs = {}
    for name, spec in index.items():
        try:
            dt = np.dtype(_DTYPES[spec["dtype"]])
            shape, off, nbytes = spec["shape"], spec["offset"], spec["nbytes"]
        except (KeyError, TypeError):
            raise Dropped("invalid_payload", f"array {name!r} has a bad index entry") from None
        # JSON integers only (a float such as 1e400 or NaN, a string, a bool is no size), never negative
        if not isinstance(shape, list) or not all(_is_size(n) for n in (*shape, off, nbytes)):
            raise Dropped("invalid_payload", f"array {name!r} has a bad index entry")
        specs[name] = (dt, tuple(shape), off, nbytes)
    for name, (dt, shape, off, nbytes) in sorted(specs.items(), key=lambda kv: kv[1][2]):  # in body order
        count = math.prod(shape)  # exact: a product past 2**63 cannot wrap round to a size that fits
        if nbytes != count * dt.itemsize or off != end or off + nbytes > len(body):
            raise Dropped("invalid_payload", f"array {name!r} does not fit the body")
        a = np.frombuffer(body, dtype=dt, count=count, offset=off).reshape(shape)
        if dt.kind == "f" and not np.isfinite(a).all():
            raise Dropped("invalid_payload", f"array {name!r} has non-finite values")
        arrays[name] = a
        end = off + nbytes
    if end != len(body):
        raise Dropped("invalid_payload", "payload body has trailing bytes")
    return Payload(arrays=arrays, meta=cmeta)
