"""Tensor kernels the codecs share: bit packing, top-k selection by magnitude, random
coordinate subsets from a seed, and the median over a small axis.

Pure functions of tensors, vectorized over a leading client axis ``[K, n]``, computed on
whatever device their input is on. Anything derived from a seed (random subsets, sample
positions) is drawn on the CPU with torch's Mersenne Twister and then moved, so an encoder
on a GPU and a decoder on a CPU regenerate the same coordinates.
"""

from __future__ import annotations

import functools
import math
import sys

import torch
import torch.nn.functional as F

__all__ = [
    "pack_bits",
    "unpack_bits",
    "bit_lut",
    "topk_abs_indices",
    "random_subset",
    "median_small",
]

if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for
    raise ImportError("fedswarm's bit packing assumes a little-endian host")


# -- bit packing -------------------------------------------------------------------------


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """``[K, n]`` bool -> ``[K, ceil(n / 8)]`` uint8, little bit order: element ``j`` is bit
    ``j % 8`` of byte ``j // 8`` (``numpy.packbits(..., bitorder="little")``); the unused
    high bits of the last byte are zero.

    torch has no packbits: eight bool bytes are read as one int64 word and folded into its
    low byte with three shift-or steps (no multiplication, so nothing overflows).
    """
    if bits.dim() != 2 or bits.dtype != torch.bool:
        raise ValueError(f"pack_bits needs a [K, n] bool tensor, got {tuple(bits.shape)} {bits.dtype}")
    k, n = bits.shape
    nbytes = (n + 7) // 8
    b = bits.contiguous().view(torch.uint8)
    if 8 * nbytes != n:
        b = F.pad(b, (0, 8 * nbytes - n))
    if nbytes == 0:
        return torch.zeros(k, 0, dtype=torch.uint8, device=bits.device)
    u = b.view(torch.int64)  # [K, nbytes]; byte i of each word is 0/1 at bit 8i
    w = u >> 7
    w |= u  # bits 0..1 of each byte: b_i, b_{i+1}
    w |= w >> 14  # bits 0..3
    w |= w >> 28  # bits 0..7 in the low byte
    w &= 0xFF
    return w.to(torch.uint8)


@functools.lru_cache(maxsize=16)
def _lut01(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    byte = torch.arange(256, dtype=torch.int64).unsqueeze(1)
    bit = torch.arange(8, dtype=torch.int64).unsqueeze(0)
    return ((byte >> bit) & 1).to(dtype=dtype, device=device)  # [256, 8]


def bit_lut(zero: torch.Tensor | float, one: torch.Tensor | float, device, dtype=torch.float32) -> torch.Tensor:
    """A lookup table from a byte to the 8 values its bits stand for: ``[256, 8]``, or
    ``[K, 256, 8]`` when ``zero``/``one`` are ``[K]`` tensors (one table per client)."""
    lut = _lut01(dtype, torch.device(device))
    zero = torch.as_tensor(zero, dtype=dtype, device=device)
    one = torch.as_tensor(one, dtype=dtype, device=device)
    if zero.dim() == 0 and one.dim() == 0:
        return zero + lut * (one - zero)
    zero, one = zero.reshape(-1, 1, 1), one.reshape(-1, 1, 1)
    return zero + lut * (one - zero)


def unpack_bits(packed: torch.Tensor, n: int, lut: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_bits` through a lookup table (see :func:`bit_lut`):
    ``[K, nbytes]`` uint8 -> ``[K, n]`` values, one table gather per byte. A ``[K, 256, 8]``
    table gives each client its own two values (a scale folded in at no extra pass).
    The result may be a non-contiguous view when ``n`` is not a multiple of 8."""
    k, nbytes = packed.shape
    idx = packed.to(torch.int32)
    if lut.dim() == 3:
        idx = idx + torch.arange(k, dtype=torch.int32, device=packed.device).unsqueeze(1) * 256
        lut = lut.reshape(-1, 8)
    out = lut.index_select(0, idx.reshape(-1)).view(k, nbytes * 8)
    return out if nbytes * 8 == n else out[:, :n]


# -- top-k by magnitude ------------------------------------------------------------------

_SAMPLE = 1 << 14  # coordinates sampled to estimate the top-k threshold


@functools.lru_cache(maxsize=8)
def _sample_positions(n: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(0x5EED)
    return torch.randint(0, n, (_SAMPLE,), generator=g).to(device)


def topk_abs_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest ``|x|`` in each row of ``[K, n]``, as ``[K, k]`` int64
    sorted ascending (ties broken arbitrarily).

    ``torch.topk`` over all n coordinates is slow on CPUs for large k, so for k << n a
    threshold is estimated from a fixed sample of 16k coordinates (deliberately low: the
    1.25x + 4 sigma quantile of the sample), every coordinate at or above it becomes a
    candidate, and the exact top-k is taken among the candidates. If some row has fewer
    than k candidates, the exact full ``torch.topk`` is used instead, so the answer never
    depends on the sample (as in DGC's sampled threshold, Lin et al. 2018, made exact).
    """
    kk, n = x.shape
    if not 0 < k <= n:
        raise ValueError(f"k must be in [1, {n}], got {k}")
    if k == n:
        return torch.arange(n, device=x.device).expand(kk, n).contiguous()
    a = x.abs()
    if n < 4 * _SAMPLE or 8 * k > n:
        return a.topk(k, dim=1, sorted=False).indices.sort(dim=1).values
    expected = _SAMPLE * k / n
    rank = min(_SAMPLE, math.ceil(1.25 * expected + 4.0 * math.sqrt(expected) + 8))
    sample = a.index_select(1, _sample_positions(n, x.device))
    thr = sample.topk(rank, dim=1).values[:, -1:]  # [K, 1]
    rows, cols = (a >= thr).nonzero(as_tuple=True)  # row-major, so cols ascend within a row
    counts = torch.bincount(rows, minlength=kk)  # (a bool sum over [K, n] is much slower)
    if bool((counts < k).any()):
        return a.topk(k, dim=1, sorted=False).indices.sort(dim=1).values
    width = int(counts.max())
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.arange(rows.numel(), device=x.device) - starts[rows]
    cand = torch.full((kk, width), -1.0, dtype=a.dtype, device=x.device)  # -1 < any |x|
    cand[rows, slot] = a[rows, cols]
    pos = torch.zeros((kk, width), dtype=torch.int64, device=x.device)
    pos[rows, slot] = cols
    pick = cand.topk(k, dim=1, sorted=False).indices.sort(dim=1).values
    return pos.gather(1, pick)  # slots are in column order, so sorted slots give sorted cols


# -- random subsets ----------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def _random_subset_cpu(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if 3 * k > n:
        return torch.randperm(n, generator=g)[:k].sort().values
    # Draw with replacement until k distinct values are seen, then keep a random k of
    # them: by exchangeability the result is a uniform k-subset, at O(k log k) instead of
    # the O(n) of randperm.
    seen = torch.empty(0, dtype=torch.int64)
    while seen.numel() < k:
        m = k - seen.numel()
        extra = m + int(4 * m * m / n) + 16  # room for the expected collisions
        seen = torch.cat([seen, torch.randint(0, n, (extra,), generator=g)]).unique()
    keep = torch.randperm(seen.numel(), generator=g)[:k]
    return seen[keep].sort().values


def random_subset(n: int, k: int, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``k`` distinct coordinates of ``range(n)``, uniformly at random from ``seed``, as a
    sorted int64 ``[k]`` tensor on ``device``; the same on every device and process."""
    if not 0 < k <= n:
        raise ValueError(f"k must be in [1, {n}], got {k}")
    return _random_subset_cpu(n, k, int(seed)).to(device, copy=True)  # the cache stays private


# -- median over a small axis --------------------------------------------------------------


@functools.lru_cache(maxsize=32)
def _median_plan(r: int) -> tuple[tuple[int, bool, bool], ...]:
    """The compare-exchanges of an odd-even transposition sort of r wires that the lower
    median depends on, each as (wire, keep min, keep max): a backward liveness pass drops
    the rest, so only about half the min/max ops remain."""
    exchanges = [(s, i) for s in range(r) for i in range(s % 2, r - 1, 2)]
    need, plan = {(r - 1) // 2}, []
    for _, i in reversed(exchanges):
        lo, hi = i in need, (i + 1) in need
        if lo or hi:
            plan.append((i, lo, hi))
            need |= {i, i + 1}
    return tuple(reversed(plan))


def median_small(parts: list[torch.Tensor]) -> torch.Tensor:
    """Elementwise lower median of ``r`` same-shaped tensors (``torch.median`` semantics).

    ``torch.median`` over a short axis sorts each little column and is ~10x slower on a CPU
    than a min/max network; for r > 15 the network grows as r^2 and median is used."""
    r = len(parts)
    if r == 1:
        return parts[0]
    if r > 15:
        return torch.stack(parts, 0).median(dim=0).values
    w = list(parts)
    for i, lo, hi in _median_plan(r):
        a, b = w[i], w[i + 1]
        if lo:
            w[i] = torch.minimum(a, b)
        if hi:
            w[i + 1] = torch.maximum(a, b)
    return w[(r - 1) // 2]
