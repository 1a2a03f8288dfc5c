"""Hypothesis strategies shared by the fuzz targets: awkward JSON values, and mutations of a
valid dict, byte string or frame list (one field changed, truncated, oversized, reordered,
duplicated)."""

from __future__ import annotations

import json
import struct
from typing import Any

from hypothesis import strategies as st

__all__ = ["awkward_ints", "awkward_values", "deep_json", "dumps_loose", "json_values", "mutate_bytes", "mutate_dict",
           "mutate_frames", "random_batch"]

#: Integers at and past every boundary a parser may assume: 0, -1, 2^31, 2^32, 2^63, 2^64, 10^400.
awkward_ints = st.one_of(
    st.sampled_from([0, 1, -1, 2, 7, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64, -(2**63),
                     10**18, 10**400, -(10**400)]),
    st.integers(-1000, 1000),
)
_scalars = st.one_of(
    st.none(), st.booleans(), awkward_ints,
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([1e308, -0.0, 5e-324, 0.5, 1.0, 1e400]),
    st.text(max_size=12), st.sampled_from(["", "float32", "int64", "none", "topk", "dense", "x" * 300]),
)
#: The values that break size and type checks most often, drawn far more often than chance would.
awkward_values = st.sampled_from([float("inf"), float("-inf"), float("nan"), 1e400, -1, 0, 2**32, 2**63, 2**64, 10**400,
                                  -(10**400), 1.5, 3.0, "3", "", True, False, None, [], {}, [2**32, 2**32], [-1], [0]])
json_values = st.one_of(awkward_values, st.recursive(
    _scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                      st.dictionaries(st.text(max_size=6), inner, max_size=4)), max_leaves=8))


@st.composite
def random_batch(draw, k: int, d: int):
    """A ``[k, d]`` float32 tensor of finite values from a drawn seed and scale (cheaper for
    Hypothesis than drawing every value; the mutations add the awkward ones)."""
    import numpy as np
    import torch

    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    scale = draw(st.sampled_from([1.0, 1.0, 1e-30, 1e30, 0.0]))
    return torch.from_numpy((rng.standard_normal((k, d)) * scale).astype(np.float32))


def dumps_loose(obj: Any) -> bytes:
    """JSON the way a hostile sender may write it: NaN and Infinity allowed, 10^400 as digits."""
    return json.dumps(obj, allow_nan=True, separators=(",", ":")).encode()


def deep_json(depth: int) -> str:
    """A JSON array nested ``depth`` deep (parsers that recurse may overflow their stack)."""
    return "[" * depth + "]" * depth


@st.composite
def mutate_dict(draw, d: dict, keys: list[str] | None = None, values=json_values) -> dict:
    """``d`` with one to three of its keys deleted, replaced by an awkward value, or a key added."""
    out = dict(d)
    names = list(keys if keys is not None else d) or ["x"]
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["set", "set", "set", "delete", "add"]))
        key = draw(st.sampled_from(names))
        if op == "delete":
            out.pop(key, None)
        elif op == "set":
            out[key] = draw(values)
        else:
            out[draw(st.text(min_size=1, max_size=8))] = draw(values)
    return out


@st.composite
def mutate_bytes(draw, data: bytes, max_ops: int = 3) -> bytes:
    """``data`` with one to ``max_ops`` byte-level edits: flip, truncate, insert, duplicate, overwrite."""
    b = bytearray(data)
    for _ in range(draw(st.integers(1, max_ops))):
        op = draw(st.sampled_from(["flip", "flip", "truncate", "insert", "duplicate", "overwrite", "zero"]))
        n = len(b)
        pos = draw(st.integers(0, max(0, n - 1)))
        if op == "flip" and n:
            b[pos] ^= draw(st.integers(1, 255))
        elif op == "truncate":
            del b[pos:]
        elif op == "insert":
            b[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        elif op == "duplicate" and n:
            end = draw(st.integers(pos, min(n, pos + 64)))
            b[pos:pos] = b[pos:end]
        elif op == "overwrite" and n:
            chunk = draw(st.binary(min_size=1, max_size=8))
            b[pos:pos + len(chunk)] = chunk
        elif op == "zero" and n:
            end = draw(st.integers(pos, min(n, pos + 32)))
            b[pos:end] = bytes(end - pos)
    return bytes(b)


_LEN = struct.Struct(">I")
_awkward_lengths = st.one_of(st.sampled_from([0, 1, 15, 16, 17, 63, 64, 65, 2**16, 2**31 - 1, 2**31, 2**32 - 1,
                                              10 << 30 & 0xFFFFFFFF]), st.integers(0, 2**32 - 1))


@st.composite
def mutate_frames(draw, frames: list[bytes]) -> list[bytes]:
    """Length-prefixed ``frames`` with one to three frame-level edits: a length field set to an
    awkward value, a frame dropped, duplicated, swapped with another, cut short, one of its
    bytes flipped, or a random frame inserted."""
    out = list(frames)
    for _ in range(draw(st.integers(1, 3))):
        if not out:
            out.append(draw(st.binary(max_size=32)))
            continue
        i = draw(st.integers(0, len(out) - 1))
        op = draw(st.sampled_from(["length", "length", "drop", "dup", "swap", "cut", "flip", "insert"]))
        f = out[i]
        if op == "length" and len(f) >= 4:
            out[i] = _LEN.pack(draw(_awkward_lengths)) + f[4:]
        elif op == "drop":
            del out[i]
        elif op == "dup":
            out.insert(i, f)
        elif op == "swap":
            j = draw(st.integers(0, len(out) - 1))
            out[i], out[j] = out[j], out[i]
        elif op == "cut":
            out[i] = f[: draw(st.integers(0, max(0, len(f) - 1)))]
        elif op == "flip" and f:
            pos = draw(st.integers(0, len(f) - 1))
            out[i] = f[:pos] + bytes([f[pos] ^ draw(st.integers(1, 255))]) + f[pos + 1:]
        elif op == "insert":
            body = draw(st.binary(max_size=40))
            out.insert(i, _LEN.pack(len(body)) + body)
    return out
