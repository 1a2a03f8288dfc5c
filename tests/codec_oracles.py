"""Shared by the codec tests: a small layout, round-trip helpers and the numpy oracles
(naive re-derivations, written without looking at the torch code)."""

from __future__ import annotations

import math

import numpy as np
import torch

from fedswarm.params import ParamLayout
from fedswarm.algorithms.compression.codecs import make_codec
from fedswarm.payload import Payload



# A layout with matrices, a conv kernel, a scalar and biases; d = 106, not a multiple of 8.
LAYOUT = ParamLayout.from_shapes(
    [
        ("fc1.weight", (6, 5)),
        ("fc1.bias", (6,)),
        ("conv.weight", (4, 3, 2, 2)),
        ("scale", ()),
        ("fc2.weight", (3, 6)),
        ("fc2.bias", (3,)),
    ]
)
D = LAYOUT.d
# small-d settings that keep every codec non-trivial at d = 106
SMALL = {"topk": {"ratio": 0.05}, "randk": {"ratio": 0.1}, "qsgd": {"levels": 4, "bucket": 32},
         "countsketch": {"k_ratio": 0.1}}
PER_ROW_SEED = {"qsgd"}  # codecs whose row i uses seed + i; the rest share the seed


def randn(k: int, d: int = D, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((k, d)).astype(np.float32)


def codec_for(name: str, **extra):
    return make_codec(name, **{**SMALL.get(name, {}), **extra})


def roundtrip(codec, x: np.ndarray, layout=LAYOUT, seed: int = 0) -> tuple[Payload, np.ndarray]:
    payload = codec.encode(torch.from_numpy(x), layout, seed=seed)
    return payload, codec.decode(payload, layout).numpy()


def columns(layout):
    """(offset, rows, cols) of each tensor seen as a matrix."""
    for s in layout.specs:
        rows = s.shape[0] if s.shape else 1
        yield s.offset, rows, s.numel // rows


def np_onebit(x: np.ndarray, layout) -> np.ndarray:
    out = np.empty_like(x)
    for k in range(x.shape[0]):
        for off, rows, cols in columns(layout):
            m = x[k, off : off + rows * cols].reshape(rows, cols)
            q = np.empty_like(m)
            for j in range(cols):
                col = m[:, j].astype(np.float64)
                neg, pos = col[col < 0], col[col >= 0]
                a0 = neg.mean() if neg.size else 0.0
                a1 = pos.mean() if pos.size else 0.0
                for i in range(rows):
                    q[i, j] = a1 if col[i] >= 0 else a0
            out[k, off : off + rows * cols] = q.reshape(-1)
    return out


def np_sign(x: np.ndarray) -> np.ndarray:
    scale = np.abs(x.astype(np.float64)).sum(axis=1, keepdims=True) / x.shape[1]
    return np.where(x >= 0, scale, -scale).astype(np.float32)


def np_topk(x: np.ndarray, ratio: float) -> np.ndarray:
    k = math.ceil(ratio * x.shape[1] - 1e-9)
    out = np.zeros_like(x)
    for r in range(x.shape[0]):
        keep = np.argsort(-np.abs(x[r]), kind="stable")[:k]
        out[r, keep] = x[r, keep]
    return out


def np_fp16(x: np.ndarray) -> np.ndarray:
    return np.clip(x, -65504, 65504).astype(np.float16).astype(np.float32)


def np_qsgd_levels(x: np.ndarray, s: int, bucket: int) -> tuple[np.ndarray, np.ndarray]:
    """y = s·x/||bucket|| (float64) and the per-value norm."""
    y, norm = np.zeros(x.shape), np.zeros(x.shape)
    b = bucket or x.shape[1]
    for r in range(x.shape[0]):
        for start in range(0, x.shape[1], b):
            seg = x[r, start : start + b].astype(np.float64)
            n = np.sqrt((seg**2).sum())
            norm[r, start : start + b] = n
            y[r, start : start + b] = s * seg / n if n > 0 else 0.0
    return y, norm


def np_countsketch_hashes(d: int, cs) -> tuple[np.ndarray, np.ndarray]:
    """Bucket and sign of every coordinate from the sketch's drawn parameters, by the
    block-shift definition, one coordinate at a time in Python ints."""
    shifts, sigma, rho, perm = cs.shifts.tolist(), cs.block_signs.tolist(), cs.bucket_signs.tolist(), cs.perm.tolist()
    c = cs.cols
    buckets, signs = np.zeros((cs.rows, d), np.int64), np.zeros((cs.rows, d), np.int64)
    for j in range(cs.rows):
        for i in range(d):
            block, pos = i // c, i % c
            buckets[j, i] = (perm[pos] + shifts[j][block]) % c
            signs[j, i] = sigma[j][block] * rho[j][buckets[j, i]]
    return buckets, signs


def np_countsketch_decode(x: np.ndarray, buckets, signs, cols: int, k: int) -> np.ndarray:
    rows, d = buckets.shape
    out = np.zeros_like(x)
    for r in range(x.shape[0]):
        table = np.zeros((rows, cols))
        for j in range(rows):
            for i in range(d):
                table[j, buckets[j, i]] += signs[j, i] * float(x[r, i])
        est = np.array([np.sort([signs[j, i] * table[j, buckets[j, i]] for j in range(rows)])[(rows - 1) // 2]
                        for i in range(d)])
        keep = np.argsort(-np.abs(est), kind="stable")[:k]
        out[r, keep] = est[keep]
    return out
