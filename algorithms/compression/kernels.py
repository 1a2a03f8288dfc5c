"""Tensor kernels the codecs share: output buffers, bit packing, top-k selection by
magnitude, random coordinate subsets from a seed, and the median over a small axis.

Pure functions of tensors, vectorized over a leading client axis ``[K, n]``, computed on
whatever device their input is on. On a CPU the hot loops are the C loops of
:mod:`~fedswarm.algorithms.compression.native` when they are built, else numpy where it
is faster than torch's eager kernels (packbits, take, flatnonzero, huge-page buffers);
the eager versions are the tests' oracle, and the torch ones (``pack_bits``,
``unpack_bits``) serve other devices. Anything derived from a seed (random subsets, sample
positions) is drawn on the CPU with torch's Mersenne Twister and then moved, so an encoder
on a GPU and a decoder on a CPU regenerate the same coordinates.
"""

from __future__ import annotations

import functools
import math
import sys

import numpy as np
import torch
import torch.nn.functional as F

from fedswarm.algorithms.compression import native

__all__ = [
    "new_empty",
    "new_zeros",
    "out_buffer",
    "sign_bits",
    "unpack_bool",
    "pack_bits",
    "unpack_bits",
    "lut_decode",
    "bit_lut",
    "topk_abs_indices",
    "sample_positions",
    "random_subset",
    "median_small",
]

if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for
    raise ImportError("fedswarm's bit packing assumes a little-endian host")


# -- output buffers --------------------------------------------------------------------


def new_empty(k: int, n: int, device: torch.device | str) -> torch.Tensor:
    """An uninitialized ``[K, n]`` float32 tensor. On a CPU its memory comes from numpy,
    which asks the kernel for transparent huge pages for large arrays: a decoder's fresh
    40 MB output then costs ~20 page faults instead of ~10,000 (torch's allocator uses
    4 KB pages, which makes filling a fresh tensor several times slower than copying
    into a warm one)."""
    device = torch.device(device)
    if device.type != "cpu":
        return torch.empty(k, n, dtype=torch.float32, device=device)
    return torch.from_numpy(np.empty((k, n), np.float32))


def new_zeros(k: int, n: int, device: torch.device | str) -> torch.Tensor:
    """A ``[K, n]`` float32 tensor of zeros. On a CPU from numpy's calloc: the kernel
    maps zero pages lazily, so a sparse decoder pays only for the pages it writes."""
    device = torch.device(device)
    if device.type != "cpu":
        return torch.zeros(k, n, dtype=torch.float32, device=device)
    return torch.from_numpy(np.zeros((k, n), np.float32))


def out_buffer(out: torch.Tensor | None, k: int, n: int, device: torch.device | str, *,
               zero: bool = False) -> torch.Tensor:
    """Where a decoder writes its ``[K, n]`` float32 result: the caller's ``out`` (checked
    by :meth:`Codec.decode`; zeroed first when ``zero``), else a fresh :func:`new_empty` /
    :func:`new_zeros` tensor."""
    if out is None:
        return new_zeros(k, n, device) if zero else new_empty(k, n, device)
    return out.zero_() if zero else out


# -- bit packing -------------------------------------------------------------------------


def sign_bits(x: torch.Tensor) -> torch.Tensor:
    """``pack_bits(x >= 0)`` for a ``[K, n]`` float tensor; on a CPU through numpy's
    packbits (C loops, no int64 temporaries), elsewhere through :func:`pack_bits`."""
    if x.device.type != "cpu":
        return pack_bits(x >= 0)
    xn = x.detach().contiguous().numpy()
    return torch.from_numpy(np.packbits(np.greater_equal(xn, 0), axis=1, bitorder="little"))


def unpack_bool(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of :func:`sign_bits` / :func:`pack_bits`: ``[K, nbytes]`` uint8 ->
    ``[K, n]`` bool (numpy's unpackbits on a CPU)."""
    if packed.device.type != "cpu":
        return unpack_bits(packed, n, bit_lut(0.0, 1.0, packed.device)).bool()
    bits = np.unpackbits(packed.contiguous().numpy(), axis=1, count=n, bitorder="little")
    return torch.from_numpy(bits).view(torch.bool)


def lut_decode(packed: torch.Tensor, n: int, lut: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`unpack_bits` into a contiguous ``[K, n]`` float32 tensor (``out``, or a fresh
    one); on a CPU one pass of 8 table values per byte per client: the C loop of
    :mod:`~fedswarm.algorithms.compression.native` when it is built, else numpy's ``take``
    into a :func:`new_empty` buffer."""
    if packed.device.type != "cpu":
        res = unpack_bits(packed, n, lut)
        return res.contiguous() if out is None else out.copy_(res)
    k, nbytes = packed.shape
    out = out_buffer(out, k, n, "cpu")
    src = packed.contiguous()
    tables = lut.reshape(-1, 256, 8).expand(k, 256, 8).contiguous()
    so = native.lib() if tables.dtype == torch.float32 and out.dtype == torch.float32 else None
    if so is not None:
        for i in range(k):
            so.fs_lut_decode(native.ptr(src, i * nbytes), n, native.ptr(tables, i * 2048), native.ptr(out, i * n))
        return out
    full = n // 8
    src, tables, dst = src.numpy(), tables.numpy(), out.numpy()
    for i in range(k):
        if full:
            np.take(tables[i], src[i, :full], axis=0, out=dst[i, : 8 * full].reshape(full, 8), mode="clip")
        if n > 8 * full:
            dst[i, 8 * full :] = tables[i][src[i, full], : n - 8 * full]
    return out


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
    if zero.dim() != 0 or one.dim() != 0:
        zero, one = zero.reshape(-1, 1, 1), one.reshape(-1, 1, 1)
    span = one - zero
    if not bool(torch.isfinite(span).all()):  # finite ends a float32-max apart (a client's scale ~3e38): pick, not
        return torch.where(lut > 0, one, zero)  # interpolate, or inf - inf gives NaN
    return zero + lut * span


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


def sample_positions(n: int, device: torch.device | str = "cpu") -> torch.Tensor | None:
    """The fixed sample of coordinates (16k, with repeats) that top-k thresholds are
    estimated from, or None when ``n < 4 * 16k`` (too few coordinates for sampling to
    pay). Do not modify the result: it is cached."""
    return None if n < 4 * _SAMPLE else _sample_positions(n, torch.device(device))


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
    if n < 4 * _SAMPLE or 8 * k > n:
        return x.abs().topk(k, dim=1, sorted=False).indices.sort(dim=1).values
    expected = _SAMPLE * k / n
    rank = min(_SAMPLE, math.ceil(1.25 * expected + 4.0 * math.sqrt(expected) + 8))
    sample = x.index_select(1, _sample_positions(n, x.device)).abs_()
    thr = sample.topk(rank, dim=1).values[:, -1:]  # [K, 1]
    so = native.lib() if x.device.type == "cpu" and x.dtype == torch.float32 else None
    if so is not None:
        picked = _topk_native(so, x, thr, k)
        return x.abs().topk(k, dim=1, sorted=False).indices.sort(dim=1).values if picked is None else picked
    if x.device.type == "cpu":
        rows, cols = _at_least_cpu(x, thr)
    else:
        rows, cols = (x.abs() >= thr).nonzero(as_tuple=True)  # row-major, so cols ascend within a row
    counts = torch.bincount(rows, minlength=kk)  # (a bool sum over [K, n] is much slower)
    if bool((counts < k).any()):
        return x.abs().topk(k, dim=1, sorted=False).indices.sort(dim=1).values
    width = int(counts.max())
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.arange(rows.numel(), device=x.device) - starts[rows]
    cand = torch.full((kk, width), -1.0, dtype=x.dtype, device=x.device)  # -1 < any |x|
    cand[rows, slot] = x[rows, cols].abs()
    pos = torch.zeros((kk, width), dtype=torch.int64, device=x.device)
    pos[rows, slot] = cols
    pick = cand.topk(k, dim=1, sorted=False).indices.sort(dim=1).values
    return pos.gather(1, pick)  # slots are in column order, so sorted slots give sorted cols


def _topk_native(so, x: torch.Tensor, thr: torch.Tensor, k: int) -> torch.Tensor | None:
    """The exact top-k of each row of a CPU ``x`` from its candidates ``|x| >= thr``, or
    None if a row has fewer than k: one C pass collects each row's candidates (ascending)
    with their magnitudes, then a second C call finds the k-th largest magnitude t by a
    radix select and keeps the candidates above t and the first ones equal to t, in column
    order (ties broken by position). No sort, no d-long temporary."""
    out = torch.empty(x.shape[0], k, dtype=torch.int64)
    for i, (cols, mags) in enumerate(_collect(so, x, thr, with_values=True)):
        m = cols.numel()
        if m < k:
            return None
        got = so.fs_select_top(native.ptr(mags), native.ptr(cols), m, k, native.ptr(out, i * k))
        if got != k:  # cannot happen for finite candidates; never return garbage
            raise RuntimeError(f"top-k selection kept {got} of {k}")
    return out


def _collect(so, x: torch.Tensor, thr: torch.Tensor, with_values: bool = False):
    """Per row of a CPU ``x``: the positions with ``|x| >= thr[i]`` (ascending int64) and,
    if asked, their magnitudes; one C pass per row (repeated if the first guess of the
    count was too small)."""
    xc = x.detach().contiguous()
    t = thr.reshape(-1).to(torch.float32).tolist()
    kk, n = xc.shape
    for i in range(kk):
        cap = min(n, 4096 + n // 16)
        while True:
            hit = torch.empty(cap, dtype=torch.int64)
            mags = torch.empty(cap if with_values else 0, dtype=torch.float32)
            m = so.fs_collect_abs_ge(native.ptr(xc, i * n), n, t[i], native.ptr(hit),
                                     native.ptr(mags) if with_values else None, cap)
            if m <= cap:
                break
            cap = m
        yield hit[:m], mags[:m]


_CHUNK = 1 << 16  # coordinates per step of the CPU candidate scan (256 KB: stays in cache)


def _at_least_cpu(x: torch.Tensor, thr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(|x| >= thr).nonzero(as_tuple=True)`` for a CPU ``[K, n]`` x and ``[K, 1]`` thr, without
    a d-long |x| or mask: one C pass per client that writes only the hits (see
    :mod:`~fedswarm.algorithms.compression.native`), else numpy in cache-sized chunks
    (flatnonzero is several times faster than torch's nonzero)."""
    xc = x.detach().contiguous()
    t = thr.reshape(-1).to(torch.float32)
    kk, n = xc.shape
    so = native.lib() if xc.dtype == torch.float32 else None
    if so is not None:
        rows, cols = [], []
        for i, (hit, _) in enumerate(_collect(so, xc, t)):
            cols.append(hit)
            rows.append(torch.full((hit.numel(),), i, dtype=torch.int64))
        return torch.cat(rows), torch.cat(cols)
    xn, t = xc.numpy(), t.numpy()
    buf = np.empty(min(n, _CHUNK), xn.dtype)
    mask = np.empty(buf.shape, np.bool_)
    rows, cols = [], []
    for i in range(kk):
        for lo in range(0, n, _CHUNK):
            m = min(_CHUNK, n - lo)
            np.abs(xn[i, lo : lo + m], out=buf[:m])
            np.greater_equal(buf[:m], t[i], out=mask[:m])
            hit = np.flatnonzero(mask[:m])
            cols.append(hit + lo)
            rows.append(np.full(hit.shape, i))
    return torch.from_numpy(np.concatenate(rows)), torch.from_numpy(np.concatenate(cols))


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
    if r == 3:  # 4 ops
        a, b, c = parts
        return torch.maximum(torch.minimum(a, b), torch.minimum(torch.maximum(a, b), c))
    if r == 5:  # 10 ops: med3(e, max(min(a, b), min(c, d)), min(max(a, b), max(c, d)))
        a, b, c, d, e = parts
        f = torch.maximum(torch.minimum(a, b), torch.minimum(c, d))
        g = torch.minimum(torch.maximum(a, b), torch.maximum(c, d))
        return torch.maximum(torch.minimum(e, f), torch.minimum(torch.maximum(e, f), g))
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
