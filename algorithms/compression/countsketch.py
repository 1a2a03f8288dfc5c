"""Count Sketch: a linear r x c summary of a d-vector that recovers its heavy coordinates.

For rows j = 1..r, a bucket hash h_j: [d] -> [c] and a sign hash s_j: [d] -> {+1, -1}::

    S[j, h_j(i)] += s_j(i) · x_i                 (sketch; linear: S(a) + S(b) = S(a + b))
    x̂_i = median_j s_j(i) · S[j, h_j(i)]         (estimate)
    ||x||_2 ≈ sqrt(median_j sum_c S[j, c]^2)      (l2 estimate)

h_j is 2-wise independent, ((a·i + b) mod p) mod c, and s_j 4-wise independent, the
parity of a cubic polynomial mod p, with p = 2^31 - 1. Every product of two residues is
below 2^62, so the int64 arithmetic never overflows (csvec uses p = 2^61 - 1, whose
cubic overflows int64). The coefficients come from ``torch.Generator().manual_seed(seed)``
on the CPU, so every party with the same seed, on any device, shares the hashes.

With c = O(k/eps) columns and r = O(log d) rows the top-k of the estimate finds the
l2 heavy hitters (Charikar, Chen, Farach-Colton, ICALP 2002), which is how Sketched-SGD
(Ivkin et al., NeurIPS 2019) and FetchSGD (Rothchild et al., ICML 2020) compress
gradients. Wire: 4·r·c bytes per client, independent of d.

Memory: the hashes are kept as an int64 table index and an int8 sign per row and
coordinate, 9·r·d bytes (450 MB for d = 10^7, r = 5).
"""

from __future__ import annotations

import torch

from fedswarm.algorithms.compression.kernels import median_small, topk_abs_indices

__all__ = ["CountSketch", "PRIME", "poly_mod_prime"]

PRIME = 2**31 - 1
_BLOCK = 1 << 22  # elements of a [K, block] temporary on a CPU (16 MB)
_BLOCK_GPU = 1 << 24


def poly_mod_prime(i: torch.Tensor, coefficients: tuple[int, ...]) -> torch.Tensor:
    """``(c_n·i^n + ... + c_1·i + c_0) mod p`` for int64 ``i`` in [0, p), coefficients
    highest first, in [0, p). Horner's rule with a reduction after every step keeps each
    intermediate below 2^62 + 2^31, so int64 never overflows."""
    h = torch.full_like(i, coefficients[0] % PRIME)
    for c in coefficients[1:]:
        h = h.mul_(i).add_(c).remainder_(PRIME)
    return h


class CountSketch:
    """Count Sketch of d-vectors with ``rows`` x ``cols`` cells and hashes from ``seed``.

    Parameters
    ----------
    d : int
        Length of the sketched vectors, 1 <= d < 2^31 - 1.
    rows, cols : int
        Table shape r x c. More rows make the median estimate more reliable, more columns
        make collisions rarer.
    seed : int
        Seeds the hash coefficients; parties that share it share the hashes.
    device : torch.device or str
        Where the hash tables live; inputs must be on it.

    Methods take ``[K, d]`` vectors and ``[K, r, c]`` tables (a leading client axis);
    ``[d]`` and ``[r, c]`` are accepted as K = 1 and give results without the K axis.
    """

    def __init__(self, d: int, rows: int, cols: int, seed: int = 0, device: torch.device | str = "cpu"):
        if not 1 <= d < PRIME:
            raise ValueError(f"d must be in [1, {PRIME - 1}], got {d}")
        if rows < 1 or cols < 1:
            raise ValueError(f"rows and cols must be >= 1, got {rows} x {cols}")
        self.d, self.rows, self.cols, self.seed = int(d), int(rows), int(cols), int(seed)
        self.device = torch.device(device)
        g = torch.Generator().manual_seed(self.seed)
        coef = torch.randint(0, PRIME, (rows, 6), generator=g, dtype=torch.int64)
        coef[:, 0] = coef[:, 0] % (PRIME - 1) + 1  # the bucket hash's slope a must be nonzero
        self.coefficients = coef  # per row: a, b (bucket), c3, c2, c1, c0 (sign), on the CPU
        i = torch.arange(d, dtype=torch.int64, device=self.device)
        self.index = torch.empty(rows, d, dtype=torch.int64, device=self.device)
        self.signs = torch.empty(rows, d, dtype=torch.int8, device=self.device)
        for j in range(rows):  # one row at a time keeps the int64 temporaries to O(d)
            a, b, c3, c2, c1, c0 = (int(v) for v in coef[j])
            bucket = poly_mod_prime(i, (a, b)).remainder_(cols)
            self.index[j] = bucket.add_(j * cols)  # position in the flattened r*c table
            self.signs[j] = 1 - 2 * (poly_mod_prime(i, (c3, c2, c1, c0)) & 1)

    def __repr__(self) -> str:
        return f"CountSketch(d={self.d}, rows={self.rows}, cols={self.cols}, seed={self.seed})"

    def buckets(self) -> torch.Tensor:
        """h_j(i) as an ``[r, d]`` int64 tensor."""
        return self.index - torch.arange(self.rows, device=self.device).unsqueeze(1) * self.cols

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

    def _step(self, k: int) -> int:
        # Work in blocks of coordinates so the r [K, block] temporaries stay ~16 MB: on
        # 256 MB temporaries (K = 64, d = 10^6) a CPU spends more time faulting in fresh
        # pages than computing, while much smaller blocks multiply per-op overheads (which
        # are large on a loaded machine). A GPU wants the largest blocks.
        block = _BLOCK if self.device.type == "cpu" else _BLOCK_GPU
        return max(1, block // k)

    # -- operations ------------------------------------------------------------------------
    def sketch(self, x: torch.Tensor) -> torch.Tensor:
        """``[K, d]`` -> ``[K, r, c]`` tables (float dtype of x). Linear in x."""
        x, squeeze = self._vectors(x)
        k = x.shape[0]
        table = torch.zeros(k, self.rows * self.cols, dtype=x.dtype, device=x.device)
        step = self._step(k)
        for start in range(0, self.d, step):  # cache-sized blocks of coordinates
            sl = slice(start, min(self.d, start + step))
            for j in range(self.rows):
                table.index_add_(1, self.index[j, sl], x[:, sl] * self.signs[j, sl])
        table = table.view(k, self.rows, self.cols)
        return table[0] if squeeze else table

    def estimate(self, table: torch.Tensor) -> torch.Tensor:
        """``[K, r, c]`` -> ``[K, d]``: x̂_i = median_j s_j(i)·S[j, h_j(i)] (lower median for
        even r, as torch.median)."""
        table, squeeze = self._tables(table)
        k = table.shape[0]
        flat = table.reshape(k, -1)
        out = torch.empty(k, self.d, dtype=table.dtype, device=table.device)
        step = self._step(k)
        for start in range(0, self.d, step):  # cache-sized blocks of coordinates
            sl = slice(start, min(self.d, start + step))
            n = sl.stop - sl.start
            # gather with an expanded (stride-0) index beats index_select along dim 1
            parts = [flat.gather(1, self.index[j, sl].expand(k, n)) * self.signs[j, sl] for j in range(self.rows)]
            out[:, sl] = median_small(parts)
        return out[0] if squeeze else out

    def unsketch(self, table: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Heavy hitters: the ``k`` coordinates with the largest ``|x̂_i|``, as
        ``(indices [K, k] int64 ascending, values [K, k])``."""
        table, squeeze = self._tables(table)
        est = self.estimate(table)
        idx = topk_abs_indices(est, min(int(k), self.d))
        vals = est.gather(1, idx)
        return (idx[0], vals[0]) if squeeze else (idx, vals)

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
        if indices.dim() == 1:
            flat[:, self.index[:, indices].reshape(-1)] = 0
        else:
            cells = self.index[:, indices]  # [r, K, m]
            flat.scatter_(1, cells.permute(1, 0, 2).reshape(t.shape[0], -1), 0.0)
        return table
