"""Count Sketch: a linear r x c summary of a d-vector that recovers its heavy coordinates.

For rows j = 1..r, a bucket hash h_j: [d] -> [c] and a sign hash s_j: [d] -> {+1, -1}::

    S[j, h_j(i)] += s_j(i) · x_i                 (sketch; linear: S(a) + S(b) = S(a + b))
    x̂_i = median_j s_j(i) · S[j, h_j(i)]         (estimate)
    ||x||_2 ≈ sqrt(median_j sum_c S[j, c]^2)      (l2 estimate)

**Hash family (block-shift).** The d coordinates are cut into B = ceil(d / c) blocks of c
(the last one may be shorter); coordinate i = b·c + p (block b, position p) goes, in row j,
to bucket and sign::

    h_j(i) = (pi[p] + shift_j[b]) mod c      shift_j[b] uniform in [0, c), independent
    s_j(i) = sigma_j[b] · rho_j[h_j(i)]      sigma_j[b], rho_j[m] uniform in {+1, -1}

with pi a random permutation of [c], one for all rows and blocks, that breaks up contiguous
structure of a model's vector (e.g. a layer whose gradient lives in a band, which shifts
alone would map onto contiguous buckets). pi has line structure: the c // 16 lines of 16
consecutive positions go to the c // 16 lines of slots in a uniformly random order, the 16
positions inside every line shuffled by one random permutation tau of [16] (the last
c % 16 positions are permuted among themselves). So a band is cut into lines sent to
random places, and the sketch moves whole 64-byte lines of x instead of single floats
(at d = 10^7, c = 10^5, one core: the encode in ~6.5 ms, against ~8.5 moving single
floats as a uniformly random pi would need). The price: two coordinates at the same
place of two lines (same p mod 16) that share a bucket have their line-mates sharing
buckets too, so collisions come in runs of up to 16 where a uniformly random pi would
scatter them; each coordinate's collision probabilities, and the analysis below, are
unchanged (it only uses that p -> pi[p] + shift is a bijection). Measured on the
strategies' short runs (digits-mlp, 4 clients, 4 rounds, seeds 1-24), the two kinds of pi
learn alike: final accuracy 0.742 / 0.745 (gs-SGD, line / uniform), 0.828 / 0.824
(FetchSGD), 0.835 / 0.843 (Sketched-SGD).

Shifts, signs and pi are all drawn from ``torch.Generator().manual_seed(seed)`` on the
CPU (so every party with the same seed, on any device, shares the hashes; nothing but
the seed travels). This is what the Count Sketch analysis (Charikar, Chen,
Farach-Colton, ICALP 2002) uses, row by row:

* collisions: two coordinates of one block never share a bucket (p -> pi[p] + shift is
  a bijection of [c]); two of different blocks share one with probability exactly 1/c
  (two independent uniform shifts). So P[h_j(i) = h_j(i')] <= 1/c for i != i'.
* signs: for i, i' in different blocks, s_j(i)·s_j(i') carries sigma_j[b]·sigma_j[b'],
  independent of the shifts and of rho, so E[s_j(i) s_j(i') | h_j] = 0; same-block pairs
  never collide, so the terms they would add never appear.
* hence E[s_j(i)·S[j, h_j(i)]] = x_i and Var <= ||x_{-i}||^2 / c (cross terms of two
  colliding coordinates come from two different blocks and vanish the same way), and the
  median over r independent rows gives the usual (eps, delta) guarantee. The l2
  estimate is unbiased the same way; its variance is at most (2 + 1)·||x||^4 / c (the
  extra ||x||^4 / c, by Cauchy-Schwarz, is from pairs of blocks whose shifts agree).

The structure makes the kernels vectorizable (no d-long index tensors, no scatter): with
y the vector permuted by pi within each block (one gather pass), a sketch row is
``rho ⊙ sum_b sigma[b] · roll(y_b, shift[b])``, one contiguous slice-add per block, and an
estimate row for block b is a contiguous window of the doubled table.

With c = O(k/eps) columns and r = O(log d) rows the top-k of the estimate finds the l2
heavy hitters, which is how Sketched-SGD (Ivkin et al., NeurIPS 2019) and FetchSGD
(Rothchild et al., ICML 2020) compress gradients. Wire: 4·r·c bytes per client,
independent of d. Memory: r·(B + c) hash values (no per-coordinate tables).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from fedswarm.algorithms.compression import countsketch_native, native
from fedswarm.algorithms.compression.kernels import median_small, sample_positions, topk_abs_indices

__all__ = ["CountSketch"]

_BLOCK = 1 << 20  # coordinates per chunk of the dense estimate on a CPU (4 MB per [block] part)
_BLOCK_GPU = 1 << 24
_CHUNK_CPU = 1 << 18  # values of y and accumulators per client chunk of the many-blocks sketch (1 MB)
_LOOP_COLS = 2048  # c at least this (or at most 64 blocks): a Python loop over blocks, slices only


_LINE = 16  # slots per line of pi (16 float32: one 64-byte cache line, one AVX-512 register)


def _line_permutation(c: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """pi, a random permutation of [c] with line structure (see the module docstring):
    ``(pi [c], lines [c // 16], tau_inv [16])``, pi[16·P + l] = 16·lines[P] + tau[l]
    for the c // 16 whole lines (``lines`` a random permutation of them, ``tau`` one of
    [16] shared by every line), the last c % 16 positions permuted among themselves.
    ``lines`` (position line -> slot line) and ``tau_inv`` = tau^-1 are what fs_sketch
    reads: y[16·lines[P] + l] = x[16·P + tau_inv[l]], line by line in the order of x."""
    n = c // _LINE
    lines = torch.randperm(n, generator=g)
    tau = torch.randperm(_LINE, generator=g)
    tail = torch.randperm(c - _LINE * n, generator=g) + _LINE * n
    p = torch.arange(_LINE * n)
    perm = torch.cat([_LINE * lines[p // _LINE] + tau[p % _LINE], tail])
    return perm, lines, torch.argsort(tau)


class CountSketch:
    """Count Sketch of d-vectors with ``rows`` x ``cols`` cells and hashes from ``seed``.

    Parameters
    ----------
    d : int
        Length of the sketched vectors, d >= 1.
    rows, cols : int
        Table shape r x c. More rows make the median estimate more reliable, more columns
        make collisions rarer.
    seed : int
        Seeds the hashes; parties that share it share the hashes.
    device : torch.device or str
        Where the hash parameters live; inputs must be on it.

    Methods take ``[K, d]`` vectors and ``[K, r, c]`` tables (a leading client axis);
    ``[d]`` and ``[r, c]`` are accepted as K = 1 and give results without the K axis.
    """

    def __init__(self, d: int, rows: int, cols: int, seed: int = 0, device: torch.device | str = "cpu"):
        if not 1 <= d < 2**62:
            raise ValueError(f"d must be in [1, 2^62), got {d}")
        if rows < 1 or cols < 1:
            raise ValueError(f"rows and cols must be >= 1, got {rows} x {cols}")
        self.d, self.rows, self.cols, self.seed = int(d), int(rows), int(cols), int(seed)
        self.device = torch.device(device)
        self.blocks = -(-self.d // self.cols)
        self._span = self.blocks * self.cols  # length of the permuted, zero-padded vector y
        g = torch.Generator().manual_seed(self.seed)
        shifts = torch.randint(0, cols, (rows, self.blocks), generator=g, dtype=torch.int64)
        block_signs = 1 - 2 * torch.randint(0, 2, (rows, self.blocks), generator=g, dtype=torch.int64)
        bucket_signs = 1 - 2 * torch.randint(0, 2, (rows, cols), generator=g, dtype=torch.int64)
        perm, lines, tau_inv = _line_permutation(cols, g)
        self.perm = perm.to(self.device)  # pi: position p of a block -> slot pi[p]
        self._perm_inv = torch.argsort(perm).to(self.device)  # slot u -> position
        self.shifts = shifts.to(self.device)  # [r, B] int64
        self.block_signs = block_signs.to(torch.int8).to(self.device)  # [r, B] sigma
        self.bucket_signs = bucket_signs.to(torch.int8).to(self.device)  # [r, c] rho
        self._shift_list = shifts.tolist()
        self._neg_list = (block_signs < 0).tolist()
        # where block b's estimate terms start in the signed rows (see _signed_rows)
        window_rows = shifts + 2 * cols * (block_signs < 0)
        self._window_rows = window_rows.to(self.device)  # [r, B]
        self._window_list = window_rows.tolist()
        self._loop = self.cols >= _LOOP_COLS or self.blocks <= 64
        # for the C kernels (CPU only: a GPU sketch never calls them, so it does not hold them):
        # sigma < 0 as bytes, pi and pi^-1 as int32 where c allows
        cpu = self.device.type == "cpu"
        self._neg_u8 = (self.block_signs < 0).to(torch.uint8).contiguous() if cpu else None
        self._pinv_i32 = self._perm_inv.to(torch.int32).contiguous() if cpu and cols < 2**31 else None
        self._pi_i32 = self.perm.to(torch.int32).contiguous() if cpu and cols < 2**31 else None
        self._lines_i32 = (lines.to(torch.int32).contiguous(), tau_inv.to(torch.int32).contiguous()) \
            if cpu and cols >= _LINE else None  # pi's line structure, for fs_sketch
        self._sample_hashes: tuple | None = None  # (sample, h, s, cells) of unsketch's fixed sample, hashed once
        self._rho_cache: dict[torch.dtype, torch.Tensor] = {}

    def __repr__(self) -> str:
        return f"CountSketch(d={self.d}, rows={self.rows}, cols={self.cols}, seed={self.seed})"

    def _rho(self, dtype: torch.dtype) -> torch.Tensor:
        """The bucket signs rho ``[r, c]`` in ``dtype`` (converted once per dtype)."""
        if dtype not in self._rho_cache:
            self._rho_cache[dtype] = self.bucket_signs.to(dtype)
        return self._rho_cache[dtype]

    # -- the hash functions ----------------------------------------------------------------
    def hashes(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(h, s)`` for coordinates ``indices`` (any shape, int): buckets ``[r, *shape]``
        int64 and signs ``[r, *shape]`` int8, exactly as defined in the module docstring."""
        i = indices.to(device=self.device, dtype=torch.int64)
        block, pos = torch.div(i, self.cols, rounding_mode="floor"), torch.remainder(i, self.cols)
        flat_b = block.reshape(-1)
        h = (self.shifts[:, flat_b] + self.perm[pos.reshape(-1)]).remainder_(self.cols)  # [r, n]
        rows = torch.arange(self.rows, device=self.device).unsqueeze(1)
        s = self.block_signs[:, flat_b] * self.bucket_signs[rows, h]
        shape = (self.rows, *i.shape)
        return h.view(shape), s.view(shape)

    def buckets(self) -> torch.Tensor:
        """h_j(i) for every coordinate, as an ``[r, d]`` int64 tensor (O(r·d) memory: for
        tests and small d)."""
        return self.hashes(torch.arange(self.d, device=self.device))[0]

    @property
    def signs(self) -> torch.Tensor:
        """s_j(i) for every coordinate, as an ``[r, d]`` int8 tensor (for tests and small d)."""
        return self.hashes(torch.arange(self.d, device=self.device))[1]

    # -- helpers ---------------------------------------------------------------------------
    def _vectors(self, x: torch.Tensor) -> tuple[torch.Tensor, bool]:
        squeeze = x.dim() == 1
        x = x.unsqueeze(0) if squeeze else x
        if x.dim() != 2 or x.shape[1] != self.d:
            raise ValueError(f"expected [K, {self.d}] vectors, got {tuple(x.shape)}")
        if x.device != self.device:
            raise ValueError(f"vectors are on {x.device}, the sketch on {self.device}")
        return x, squeeze

    def _tables(self, table: torch.Tensor) -> tuple[torch.Tensor, bool]:
        squeeze = table.dim() == 2
        table = table.unsqueeze(0) if squeeze else table
        if table.dim() != 3 or tuple(table.shape[1:]) != (self.rows, self.cols):
            raise ValueError(f"expected [K, {self.rows}, {self.cols}] tables, got {tuple(table.shape)}")
        if table.device != self.device:
            raise ValueError(f"tables are on {table.device}, the sketch on {self.device}")
        return table, squeeze

    def _signed_rows(self, table: torch.Tensor) -> list[torch.Tensor]:
        """Per row j, the ``[K, 4c]`` buffer [T, T, -T, -T] of T = rho ⊙ S[:, j]: its window
        ``[u, u + c)`` with u = shift + 2c·[sigma < 0] holds row j's estimate term
        s_j(i)·S[j, h_j(i)] for the c positions of a block, in order."""
        unsigned = table * self._rho(table.dtype)
        return [torch.cat([u, u, -u, -u], 1) for u in unsigned.unbind(1)]

    def _windows(self, bufs: list[torch.Tensor], signed: bool):
        """Yield ``(lo, hi, parts)``, coordinates lo..hi in order, with ``parts[j]`` ``[K, hi - lo]``
        row j's value at h_j(i) for each of them, read from ``bufs[j]``: a doubled row
        ``[K, 2c]`` (``signed=False``) or the signed rows of :meth:`_signed_rows`. A block at
        a time (slices, no copies) when blocks are long, else chunks of blocks gathered
        through computed indices."""
        k, c, d = bufs[0].shape[0], self.cols, self._span
        if self._loop:
            offsets = self._window_list if signed else self._shift_list
            for b in range(self.blocks):
                lo, n = b * c, min(c, d - b * c)
                yield lo, lo + n, [bufs[j][:, w[b] : w[b] + n] for j, w in enumerate(offsets)]
            return
        offsets = self._window_rows if signed else self.shifts
        step = max(1, (_BLOCK if self.device.type == "cpu" else _BLOCK_GPU) // (k * c))  # blocks per chunk
        pos = torch.arange(c, device=self.device)
        for b0 in range(0, self.blocks, step):
            b1 = min(self.blocks, b0 + step)
            lo, hi = b0 * c, min(b1 * c, d)
            idx = [(offsets[j, b0:b1, None] + pos).view(-1)[: hi - lo] for j in range(self.rows)]
            yield lo, hi, [bufs[j].index_select(1, idx[j]) for j in range(self.rows)]

    # -- operations ------------------------------------------------------------------------
    def sketch(self, x: torch.Tensor) -> torch.Tensor:
        """``[K, d]`` -> ``[K, r, c]`` tables (float dtype of x). Linear in x."""
        x, squeeze = self._vectors(x)
        k, c = x.shape[0], self.cols
        so = native.lib() if x.device.type == "cpu" and x.dtype == torch.float32 else None
        if so is None and not self._loop and x.device.type == "cpu":
            # the many-blocks path below touches every client's accumulator once per block:
            # a few clients at a time keep y and the accumulators in cache (1000 clients at
            # once were 3x slower than one at a time)
            step = max(1, _CHUNK_CPU // (self._span + self.rows * (2 * c + 1)))
            if k > step:
                table = torch.cat([self.sketch(x[i : i + step]) for i in range(0, k, step)])
                return table[0] if squeeze else table
        if so is not None and c < 2**31:  # the block loop below, in C, into rows of c cells (no fold)
            table = countsketch_native.sketch(self, so, x.contiguous())
            return table[0] if squeeze else table
        # accumulate sigma·y_b at offset shift_b of a doubled row, then fold: 2c + 1 cells
        acc = torch.zeros(k, self.rows, 2 * c + 1, dtype=x.dtype, device=x.device)
        if self._loop:  # block by block: y_b = x_b permuted by pi stays in cache for the r adds
            y = torch.empty(k, c, dtype=x.dtype, device=x.device)
            for b in range(self.blocks):
                self._permuted_block(x, b, y)
                for j in range(self.rows):
                    s = self._shift_list[j][b]
                    acc[:, j, s : s + c].add_(y, alpha=-1 if self._neg_list[j][b] else 1)
        else:
            y = self._permuted(x)
            for j in range(self.rows):
                self._sketch_row_batched(acc[:, j], y, j, self._span // c)
        table = acc[:, :, :c] + acc[:, :, c : 2 * c]
        table.mul_(self._rho(table.dtype))
        return table[0] if squeeze else table

    def _permuted_block(self, x: torch.Tensor, b: int, out: torch.Tensor) -> None:
        """Block b of y (see :meth:`_permuted`) into ``out`` ``[K, c]``."""
        c, lo = self.cols, b * self.cols
        n = min(c, self.d - lo)
        if n == c:
            torch.index_select(x[:, lo : lo + c], 1, self._perm_inv, out=out)
        else:
            out.zero_()
            out[:, self.perm[:n]] = x[:, lo : lo + n]

    def _permuted(self, x: torch.Tensor) -> torch.Tensor:
        """y ``[K, B·c]``: y[b·c + pi[p]] = x[b·c + p], zeros where the short last block ends."""
        k, c, d = x.shape[0], self.cols, self.d
        full = d // c
        y = torch.empty(k, self._span, dtype=x.dtype, device=x.device)
        if full:
            src = x[:, : full * c].reshape(k, full, c)
            for i in range(k):  # index_select with out= needs a contiguous destination
                torch.index_select(src[i], 1, self._perm_inv, out=y[i, : full * c].view(full, c))
        if full < self.blocks:
            last = y[:, full * c :]
            last.zero_()
            last[:, self.perm[: d - full * c]] = x[:, full * c :]
        return y

    def _sketch_row_batched(self, row: torch.Tensor, x: torch.Tensor, j: int, full: int) -> None:
        """Many blocks: one index_add_ per sign into overlapping length-c windows of the
        doubled row (index_add_ adds the source rows one after another, so overlapping
        windows accumulate; on CUDA it adds atomically)."""
        k, c, d = x.shape[0], self.cols, self._span
        shifts, neg = self.shifts[j, :full], self.block_signs[j, :full] < 0
        windows = row.as_strided((k, c + 1, c), (row.stride(0), 1, 1))
        xb = x[:, : full * c].reshape(k, full, c)
        for sel, alpha in ((~neg, 1), (neg, -1)):
            where = sel.nonzero().squeeze(1)
            if where.numel():
                windows.index_add_(1, shifts[where], xb.index_select(1, where), alpha=alpha)
        if full < self.blocks:  # the short last block
            n, s = d - full * c, self._shift_list[j][full]
            row[:, s : s + n].add_(x[:, full * c :], alpha=-1 if self._neg_list[j][full] else 1)

    def estimate(self, table: torch.Tensor) -> torch.Tensor:
        """``[K, r, c]`` -> ``[K, d]``: x̂_i = median_j s_j(i)·S[j, h_j(i)] (lower median for
        even r, as torch.median)."""
        table, squeeze = self._tables(table)
        k, c = table.shape[0], self.cols
        y = torch.empty(k, self._span, dtype=table.dtype, device=table.device)
        for lo, hi, parts in self._windows(self._signed_rows(table), signed=True):
            y[:, lo:hi] = median_small(parts)
        out = y.view(k, self.blocks, c).index_select(2, self.perm).view(k, -1)[:, : self.d]  # back from pi
        out = out.contiguous()
        return out[0] if squeeze else out

    def estimate_at(self, table: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """The estimate of the coordinates ``indices`` ``[n]`` only: ``[K, r, c]`` ->
        ``[K, n]``, equal to ``estimate(table)[:, indices]``."""
        table, squeeze = self._tables(table)
        out = self._estimate_at(table, *self.hashes(indices.reshape(-1)))
        return out[0] if squeeze else out

    def _estimate_at(self, table: torch.Tensor, h: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """``[K, r, c]`` tables and hashes ``[r, n]`` -> estimates ``[K, n]``."""
        cells = (h + self.cols * torch.arange(self.rows, device=self.device).unsqueeze(1)).view(-1)
        parts = table.reshape(table.shape[0], -1).index_select(1, cells).view(table.shape[0], self.rows, -1)
        return median_small(list(parts.mul_(s.to(table.dtype)).unbind(1)))

    def unsketch(self, table: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Heavy hitters: the ``k`` coordinates with the largest ``|x̂_i|``, as
        ``(indices [K, k] int64 ascending, values [K, k])``; ties at the k-th magnitude
        are broken arbitrarily.

        The d-long estimate is never stored: a threshold t per client is taken from the
        estimates at a fixed sample of coordinates (deliberately low, as in
        :func:`~fedswarm.algorithms.compression.kernels.topk_abs_indices`), the estimate is
        computed a block at a time and only coordinates with |x̂_i| >= t are kept, and
        the exact top-k is taken among those. If some client keeps fewer than k, the
        dense estimate and an exact top-k are used instead, so the answer never depends
        on the sample."""
        table, squeeze = self._tables(table)
        k = min(int(k), self.d)
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        picked = self._unsketch_sparse(table, k)
        if picked is None:
            est = self.estimate(table)
            idx = topk_abs_indices(est, k)
            picked = idx, est.gather(1, idx)
        idx, vals = picked
        return (idx[0], vals[0]) if squeeze else (idx, vals)

    def _unsketch_sparse(self, table: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """unsketch through thresholded candidates, or None (then the dense way is used)."""
        sample = sample_positions(self.d, self.device)
        if sample is None or 8 * k > self.d:
            return None
        kk = table.shape[0]
        expected = sample.numel() * k / self.d
        rank = math.ceil(1.25 * expected + 4.0 * math.sqrt(expected) + 8)
        if rank > sample.numel():
            return None
        if self._sample_hashes is None or self._sample_hashes[0] is not sample:
            h, s = self.hashes(sample)
            cell = (h + self.cols * torch.arange(self.rows, device=self.device).unsqueeze(1)).contiguous()
            self._sample_hashes = (sample, h, s.contiguous(), cell)
        so = native.lib() if self.device.type == "cpu" and table.dtype == torch.float32 and self.rows <= 64 \
            and self._pinv_i32 is not None else None
        if so is not None:  # the same threshold in C (see countsketch_native)
            thr = countsketch_native.threshold(self, so, table.contiguous(), self._sample_hashes[3],
                                               self._sample_hashes[2], rank)
        else:
            thr = self._estimate_at(table, *self._sample_hashes[1:3]).abs().topk(rank, dim=1).values[:, -1:]  # [K, 1]
        if not bool((thr > 0).all()):  # a sparse vector: t = 0 would make every coordinate a candidate
            return None
        # |x̂_i| >= t needs |S[j, h_j(i)]| >= t in q rows or more (q = min(r - p, p + 1), p =
        # (r - 1) // 2 the lower median's rank): count such rows per coordinate in uint8,
        # then estimate only the coordinates that pass
        p = (self.rows - 1) // 2
        q = min(self.rows - p, p + 1)
        if so is not None:  # exact counts in C: only coordinates with |x̂_i| >= t (see countsketch_native)
            return countsketch_native.top(so, countsketch_native.candidates(self, so, table, thr, k), k)
        if self.device.type == "cpu" and self._loop:
            rows, cols, vals = self._candidates_numpy(table, self._heavy_masks(table, thr), q)
        else:
            rows, cols = [], []
            masks = self._heavy_masks(table, thr)
            for lo, _, parts in self._windows(masks, signed=False):
                r, i = (_sum_into(parts) >= q).nonzero(as_tuple=True)
                rows.append(r)
                cols.append(i + lo)
            rows, cols = self._from_span(torch.cat(rows), torch.cat(cols))
            h, sgn = self.hashes(cols)  # [r, n]
            at = table[rows.unsqueeze(0), torch.arange(self.rows, device=self.device).unsqueeze(1), h] * sgn
            vals = median_small(list(at.unbind(0)))
        keep = vals.abs() >= thr[rows, 0]
        rows, cols, vals = rows[keep], cols[keep], vals[keep]
        return self._top_of_candidates([(cols[rows == i], vals[rows == i]) for i in range(kk)], k)

    @staticmethod
    def _top_of_candidates(per_client: list[tuple[torch.Tensor, torch.Tensor]], k: int):
        """Each client's k candidates ``(coordinates, estimates)`` of largest magnitude, as
        unsketch returns them (coordinates ascending), or None if a client has fewer than k."""
        out_idx, out_val = [], []
        for c_idx, c_val in per_client:
            if c_idx.numel() < k:
                return None
            pick = c_val.abs().topk(k, sorted=False).indices
            c_idx, order = c_idx[pick].sort()
            out_idx.append(c_idx)
            out_val.append(c_val[pick][order])
        return torch.stack(out_idx), torch.stack(out_val)

    @staticmethod
    def _heavy_masks(table: torch.Tensor, thr: torch.Tensor) -> list[torch.Tensor]:
        """Per row j, the doubled ``[K, 2c]`` uint8 mask of ``|S[j, m]| >= t``."""
        heavy = (table.abs() >= thr.unsqueeze(2)).to(torch.uint8)  # [K, r, c]
        return [torch.cat([m, m], 1) for m in heavy.unbind(1)]

    def _candidates_numpy(self, table: torch.Tensor, masks: list[torch.Tensor], q: int):
        """The CPU loop of :meth:`_unsketch_sparse` over blocks in numpy (a fraction of
        torch's per-call cost on slices this small): ``(client, coordinate, estimate)`` of
        every coordinate counted heavy in >= q rows, estimates read from the signed rows."""
        c, d = self.cols, self._span
        masks = [m.numpy() for m in masks]
        signed = [b.numpy() for b in self._signed_rows(table)]
        rows, cols, vals = [], [], [[] for _ in range(self.rows)]
        for b in range(self.blocks):
            lo, n = b * c, min(c, d - b * c)
            count = _sum_into([m[:, s[b] : s[b] + n] for m, s in zip(masks, self._shift_list, strict=True)])
            r, i = np.divmod(np.flatnonzero(count >= q), n)  # (2-d np.nonzero is ~10x slower)
            rows.append(r)
            cols.append(i + lo)
            for j, w in enumerate(self._window_list):
                vals[j].append(signed[j][r, i + w[b]])
        parts = [torch.from_numpy(np.concatenate(v)) for v in vals]
        rows, cols = torch.from_numpy(np.concatenate(rows)), torch.from_numpy(np.concatenate(cols))
        est = median_small(parts)
        real = self._perm_inv[cols % c] + cols // c * c < self.d  # not the padding of the last block
        rows, cols = self._from_span(rows[real], cols[real])
        return rows, cols, est[real]

    def _from_span(self, rows: torch.Tensor, ycols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions in y (block, slot) to coordinates (block, pi^-1[slot]); padding dropped."""
        c = self.cols
        cols = ycols // c * c + self._perm_inv[ycols % c]
        real = cols < self.d
        return rows[real], cols[real]

    def l2_estimate(self, table: torch.Tensor) -> torch.Tensor:
        """``[K, r, c]`` -> ``[K]``: sqrt of the median over rows of the row's squared sum."""
        table, squeeze = self._tables(table)
        per_row = table.pow(2).sum(dim=2)  # [K, r]
        est = per_row.median(dim=1).values.sqrt()
        return est[0] if squeeze else est

    def zero_cells(self, table: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """Set to zero, in place, every cell that coordinates ``indices`` hash to (in all r
        rows): FetchSGD's reset of momentum and error after extracting the top-k. ``indices``
        is ``[m]`` (the same for every client) or ``[K, m]``. Returns ``table``."""
        t, _ = self._tables(table)
        if not t.is_contiguous():
            raise ValueError("zero_cells works in place and needs a contiguous table")
        flat = t.view(t.shape[0], -1)
        indices = indices.to(device=self.device, dtype=torch.int64)
        if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= self.d):
            raise ValueError(f"indices must lie in [0, {self.d})")
        offset = (torch.arange(self.rows, device=self.device) * self.cols).view(-1, *([1] * indices.dim()))
        cells = self.hashes(indices)[0] + offset  # [r, m] or [r, K, m]
        if indices.dim() == 1:
            flat[:, cells.reshape(-1)] = 0
        else:
            flat.scatter_(1, cells.permute(1, 0, 2).reshape(t.shape[0], -1), 0.0)
        return table


def _sum_into(parts: list):
    """Elementwise sum of uint8 arrays/tensors (a fresh result; counts of at most 64 rows)."""
    if isinstance(parts[0], np.ndarray):
        out = parts[0].copy()
        for m in parts[1:]:
            np.add(out, m, out=out)
        return out
    out = parts[0].clone()
    for m in parts[1:]:
        out.add_(m)
    return out
