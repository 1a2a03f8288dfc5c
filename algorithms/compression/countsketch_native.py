"""Count Sketch on a CPU through the C loops of ``csrc/countsketch.c`` (built by
:mod:`~fedswarm.algorithms.compression.native`): the sketch (``fs_sketch``), and unsketch's
threshold, its candidates with ``|x̂_i| >= t`` found exactly from bit rows of the table,
and the top k of them in coordinate order. :meth:`CountSketch.sketch` and
:meth:`CountSketch._unsketch_sparse` call these where the library is built; their numpy
and torch paths are the oracle the tests hold them to."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fedswarm.algorithms.compression import native

if TYPE_CHECKING:
    from fedswarm.algorithms.compression.countsketch import CountSketch

__all__ = ["candidates", "sketch", "sketch_args", "threshold", "top"]

_GROUP = 4  # blocks per pass of fs_sketch over the table (SKETCH_GROUP in its C source)


def sketch_args(cs: CountSketch, by_lines: bool = True) -> tuple[list, torch.Tensor]:
    """fs_sketch's hash arguments (pi, its line structure unless ``by_lines`` is False or
    c < 16, shifts, sigma < 0) and a fresh buffer for its permuted blocks (keep it alive
    through the call)."""
    lines = cs._lines_i32 if by_lines and cs._lines_i32 is not None else (None, None)
    hashes = [native.ptr(cs._pi_i32), *(native.ptr(t) if t is not None else None for t in lines),
              native.ptr(cs.shifts), native.ptr(cs._neg_u8)]
    return hashes, torch.empty(min(_GROUP, cs.blocks) * cs.cols, dtype=torch.float32)


def sketch(cs: CountSketch, so, x: torch.Tensor) -> torch.Tensor:
    """:meth:`CountSketch.sketch` of contiguous float32 ``[K, d]`` vectors in C, one client
    at a time: ``[K, r, c]`` tables, rho applied."""
    k, c = x.shape[0], cs.cols
    table = torch.zeros(k, cs.rows, c, dtype=x.dtype)
    hashes, ybuf = sketch_args(cs)
    for i in range(k):
        so.fs_sketch(native.ptr(x, i * cs.d), cs.d, c, cs.rows, cs.blocks, *hashes, native.ptr(table, i * cs.rows * c),
                     native.ptr(ybuf))
    return table.mul_(cs._rho(table.dtype))


def threshold(cs: CountSketch, so, table: torch.Tensor, cell: torch.Tensor, sign: torch.Tensor,
              rank: int) -> torch.Tensor:
    """:meth:`CountSketch._unsketch_sparse`'s thresholds in C (``fs_cs_sample_threshold``):
    per client, the rank-th largest |estimate| at the fixed sample, whose cells
    ``j * c + h_j(i)`` (``cell``, int64 ``[r, n]``) and signs (``sign``, int8 ``[r, n]``)
    are hashed once. ``[K, 1]``, as the eager path gives it."""
    n = cell.shape[1]
    est = torch.empty(cs.rows * n, dtype=torch.float32)  # the kernel's terms, row by row
    thr = [so.fs_cs_sample_threshold(native.ptr(table[i]), cs.rows, n, native.ptr(cell), native.ptr(sign), rank,
                                     native.ptr(est)) for i in range(table.shape[0])]
    return torch.tensor(thr, dtype=torch.float32).unsqueeze(1)


def candidates(cs: CountSketch, so, table: torch.Tensor, thr: torch.Tensor, k: int,
               cap: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The coordinates with ``|x̂_i| >= t``, found in C one client at a time: per client,
    ``(coordinates, estimates)`` in the order of :meth:`CountSketch._candidates_numpy`
    after its ``|x̂_i| >= t`` filter. The kernel marks each cell's sign against t, so its
    counts pick exactly those coordinates (see ``fs_cs_candidates``). ``cap``: room for
    the first try (default 4k + 1024); the kernel says when more is needed, and is run
    again with that."""
    c = cs.cols
    unsigned = (table * cs._rho(table.dtype)).contiguous()  # rho ⊙ S
    scratch = torch.empty(so.fs_cs_scratch_words(cs.rows, c), dtype=torch.int64)
    hashes = [native.ptr(t) for t in (cs.shifts, cs._neg_u8, cs._pinv_i32)]
    out = []
    cap = 4 * k + 1024 if cap is None else cap
    for client in range(table.shape[0]):
        while True:
            idx, val = torch.empty(cap, dtype=torch.int64), torch.empty(cap, dtype=torch.float32)
            n = so.fs_cs_candidates(native.ptr(unsigned[client]), cs.rows, c, cs.blocks, cs.d, *hashes,
                                    float(thr[client, 0]), native.ptr(scratch), cap, native.ptr(idx),
                                    native.ptr(val))
            if n <= cap:
                break
            cap = n
        out.append((idx[:n], val[:n]))
    return out


def top(so, per_client: list[tuple[torch.Tensor, torch.Tensor]], k: int):
    """:meth:`CountSketch._top_of_candidates` in C (``fs_cs_top``): the k-th largest
    magnitude by a radix select, one pass that keeps the k, and a radix sort by coordinate.
    Ties at the k-th magnitude: the first candidates (the eager path breaks them
    arbitrarily)."""
    out_idx = torch.empty(len(per_client), k, dtype=torch.int64)
    out_val = torch.empty(len(per_client), k, dtype=torch.float32)
    tmp_idx, tmp_val = torch.empty(k, dtype=torch.int64), torch.empty(k, dtype=torch.float32)
    for i, (cols, vals) in enumerate(per_client):
        m = cols.numel()
        if m < k:
            return None
        got = so.fs_cs_top(native.ptr(cols), native.ptr(vals), m, k, native.ptr(out_idx, i * k),
                           native.ptr(out_val, i * k), native.ptr(tmp_idx), native.ptr(tmp_val))
        if got != k:  # cannot happen for finite candidates; never return garbage
            raise RuntimeError(f"count sketch top-k kept {got} of {k}")
    return out_idx, out_val
