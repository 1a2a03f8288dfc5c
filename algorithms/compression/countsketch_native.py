"""Count Sketch's unsketch on a CPU through the C loops (``fs_cs_candidates``,
``fs_cs_top`` in :mod:`~fedswarm.algorithms.compression.native_sketch_source`): the
candidates with ``|x̂_i| >= t`` found exactly from bit rows of the table, then the top k
of them in coordinate order. :meth:`CountSketch._unsketch_sparse` calls these where the
library is built; its numpy and torch paths are the oracle the tests hold them to."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fedswarm.algorithms.compression import native

if TYPE_CHECKING:
    from fedswarm.algorithms.compression.countsketch import CountSketch

__all__ = ["candidates", "threshold", "top"]


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
    magnitude by a radix select (``fs_kth_largest``), then one pass that keeps the k and a
    radix sort by coordinate. Ties at the k-th magnitude: the first candidates (the eager path breaks
    them arbitrarily)."""
    out_idx = torch.empty(len(per_client), k, dtype=torch.int64)
    out_val = torch.empty(len(per_client), k, dtype=torch.float32)
    tmp_idx, tmp_val = torch.empty(k, dtype=torch.int64), torch.empty(k, dtype=torch.float32)
    for i, (cols, vals) in enumerate(per_client):
        m = cols.numel()
        if m < k:
            return None
        t = so.fs_kth_largest(native.ptr(vals), m, k, 1)
        got = so.fs_cs_top(native.ptr(cols), native.ptr(vals), m, k, t, native.ptr(out_idx, i * k),
                           native.ptr(out_val, i * k), native.ptr(tmp_idx), native.ptr(tmp_val))
        if got != k:  # cannot happen for finite candidates; never return garbage
            raise RuntimeError(f"count sketch top-k kept {got} of {k}")
    return out_idx, out_val
