"""Gradient codes that recover the *exact* sum of P partition updates despite s liars:
Draco's repetition code and a Solon-style communication-efficient polynomial code.

Setting (Draco, Solon). P workers, P data partitions; partition j's update ``g_j ∈ R^d``
(a gradient, or a local-SGD model change computed with a seed of its own, so every
worker that holds j computes the same vector). Worker i holds the r partitions
``A_i = {i, i+1, …, i+r−1} mod P`` (cyclic assignment, computational load r) and sends one
linear combination of them. Up to s workers send anything at all. The server wants
``Σ_j g_j`` exactly.

**Repetition code** (:class:`RepetitionCode`; Draco, Chen et al., ICML 2018, §4.1): the
P workers form P/r groups of r = 2s+1; a group holds r partitions and each member sends
their sum (d floats). Per group, the value at least s+1 members agree on is the group's
true sum (a majority of 2s+1 is honest). Needs r | P.

**Polynomial code** (:class:`PolynomialCode`; Solon's framework, a reconstruction: see
"What this is, against the paper" below). Split each update into m blocks of ℓ = ⌈d/m⌉
(zero padded), ``g_j = [g_j¹ … g_jᵐ]``, and let k = P − r + m. Give worker i a real node
θ_i and the code m extra nodes β_1…β_m. For partition j let ``Z_j`` be the P − r workers
that do *not* hold it and define, for each block u, the degree-(k−1) polynomial

    c_{j,u}(x) = Π_{z∈Z_j} (x − θ_z)/(β_u − θ_z) · Π_{v≠u} (x − β_v)/(β_u − β_v)

so that c_{j,u} vanishes on Z_j and ``c_{j,u}(β_v) = δ_{uv}``. Worker i sends

    z_i = Σ_{j∈A_i} Σ_u c_{j,u}(θ_i) · g_j^u   ∈ R^ℓ        (d/m floats, not d)

which needs only its own partitions because ``c_{j,u}(θ_i) = 0`` for j ∉ A_i. Coordinate
by coordinate, ``z_i = h(θ_i)`` for one polynomial ``h = Σ_{j,u} g_j^u c_{j,u}`` of degree
< k, and ``h(β_u) = Σ_j g_j^u``: the block sums. So the P messages are a codeword of a
real [P, k] MDS (Reed–Solomon) code, whose minimum distance P − k + 1 = r − m + 1 lets
the server correct s corrupted rows iff ``r − m ≥ 2s``, i.e.

    r >= 2s + m        (Draco is m = 1: r >= 2s + 1)

mirroring Ye & Abbe's ``r >= s + m`` for stragglers (ICML 2018), where a missing row (an
erasure) costs half what a lie costs.

Decoding (:meth:`PolynomialCode.decode`), with F the rows that arrived:

1. Projection to the code: ``R = (I − U Uᵀ) Y_F`` with U an orthonormal basis of the
   evaluation matrix V_F (Chebyshev basis, well conditioned). Liars make R nonzero on an
   error matrix that is *row-sparse with one support for every coordinate*.
2. Locate (group-sparse recovery): project the ℓ columns onto a few random directions
   (secret to the workers), then find the smallest set S of rows, |S| <= t = ⌊(|F|−k)/2⌋,
   whose removal leaves rows consistent with a degree-<k polynomial: an exhaustive ℓ0
   search over subsets, exact and unique in the MDS radius (any 2t columns of the parity
   check are independent); past 20,000 subsets a greedy removal is used instead and
   says so.
3. Decode: least squares on F \\ S, verified on *all* coordinates (the residual of the
   kept rows must be at rounding level), then ``Σ_j g_j^u = h(β_u)``.

If no set of at most t rows explains the residual, :class:`DecodeResult` says the sum
could not be decoded ("more than t workers lied") instead of returning a wrong one. With
more than s *generic* liars this is what happens; a coalition of s+1 or more that *crafts*
its messages can push the received word within distance s of another codeword and be
decoded wrongly without detection: no code of this minimum distance can prevent that.

Numerics. Nodes are P + m Chebyshev points of [−1, 1]; the m β's sit evenly among them;
workers take the rest through a stride g (θ_i = node[(g·i) mod P]) so each zero set Z_j
is spread over the interval instead of clustered. g is chosen at construction to
minimize the worst error amplification over every set of s missing rows. Messages
travel as float32; for P = 15 the decoded sum is within ~2e-6 (relative, norm) of the
exact sum (float64 in, 1e-12).

State: the code (P, r, m, nodes, the [P, P, m] coefficient table); nothing per round.
Wire: up ℓ = ⌈d/m⌉ floats per worker (4d/m bytes); down, the model.

What this is, against the paper. Solon (L. Chen, L. Chen, H. Wang, S. Davidson,
E. Dobriban, arXiv 2110.01595, 2021) is described in its abstract as: redundancy r,
compressed linear encodings, exact decoding despite s adversaries "borrowing ideas from
coding theory and sparse recovery", and a proven three-way trade-off. Its text (encoder,
decoder, theorem) could not be obtained here; this module is a principled construction
with those stated properties, not a transcription. The bound r >= 2s + m is this
construction's, and matches the trade-off's expected form; whether it is the paper's
theorem is unverified.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, field

import numpy as np
from numpy.polynomial import chebyshev as C

from fedswarm.algorithms.robust.aggregators import ToleranceError

__all__ = ["PolynomialCode", "RepetitionCode", "DecodeResult", "cyclic_assignment", "make_code"]

# Residual (relative to the received words) above which rows are not a codeword: float32
# rounding of honest messages leaves ~1e-7.
REL_TOL = 1e-5
# Past this many candidate supports, the exhaustive search gives way to a greedy one.
MAX_SUBSETS = 20_000


def cyclic_assignment(P: int, r: int) -> list[tuple[int, ...]]:
    """``A_i = (i, i+1, …, i+r−1) mod P``: each worker holds r partitions, each partition
    is held by r workers."""
    return [tuple((i + t) % P for t in range(r)) for i in range(P)]


@dataclass
class DecodeResult:
    """What the server decoded: the sum of all partitions' updates (``total``, [d] float64)
    when ``ok``, the workers found lying, and why not when not ``ok``."""

    ok: bool
    total: np.ndarray | None
    liars: tuple[int, ...] = ()
    missing: tuple[int, ...] = ()
    message: str = ""
    greedy: bool = False
    extra: dict = field(default_factory=dict)


@functools.lru_cache(maxsize=64)
def _supports(n: int, e: int) -> tuple[np.ndarray, np.ndarray]:
    """Every set of ``e`` positions out of ``n`` to drop, and the positions kept."""
    drops = np.array(list(itertools.combinations(range(n), e)), dtype=int).reshape(-1, e)
    mask = np.ones((len(drops), n), bool)
    mask[np.arange(len(drops))[:, None], drops] = False
    keeps = np.nonzero(mask)[1].reshape(len(drops), n - e)
    return drops, keeps


def _chebyshev_nodes(n: int) -> np.ndarray:
    return np.sort(np.cos(np.pi * (2 * np.arange(n) + 1) / (2 * n)))


class PolynomialCode:
    """A communication-efficient Byzantine-resilient gradient code (see the module doc).

    Parameters
    ----------
    P : int
        Workers (= partitions).
    s : int
        Liars to correct.
    m : int (default: 1)
        Communication compression: each worker sends ⌈d/m⌉ floats.
    r : int, optional
        Partitions per worker; default and minimum 2s + m, at most P.
    """

    scheme = "polynomial"

    def __init__(self, P: int, s: int, m: int = 1, r: int | None = None):
        for name, v, lo in (("P", P, 1), ("s", s, 0), ("m", m, 1)):
            if isinstance(v, bool) or int(v) != v or v < lo:
                raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
        P, s, m = int(P), int(s), int(m)
        r = 2 * s + m if r is None else int(r)
        if r < 2 * s + m:
            raise ToleranceError(f"a polynomial code with m={m} tolerates s <= (r - m)/2 liars: r={r} gives "
                                 f"s <= {(r - m) // 2}, asked for s={s} (needs r >= 2s + m = {2 * s + m})")
        if r > P:
            raise ToleranceError(f"tolerating s={s} liars with compression m={m} needs r = 2s + m = {r} partitions "
                                 f"per worker, more than the P={P} workers (needs P >= 2s + m)")
        self.P, self.s, self.m, self.r = P, s, m, r
        self.k = P - r + m
        self.assignment = cyclic_assignment(P, r)
        nodes = _chebyshev_nodes(P + m)
        bidx = np.round(np.linspace(0, P + m - 1, m + 2)[1:-1]).astype(int)
        self.beta = nodes[bidx]
        self._worker_nodes = np.delete(nodes, bidx)
        self.stride, self.theta, self.coef = self._best_stride()
        self._bases: dict = {}  # (rows, support size) -> orthonormal bases of the candidate codes

    # -- construction --------------------------------------------------------------------
    def _coefficients(self, theta: np.ndarray) -> np.ndarray:
        """``B[i, j, u] = c_{j,u}(θ_i)`` (zero unless worker i holds partition j)."""
        P, m = self.P, self.m
        B = np.zeros((P, P, m))
        holders = [[i for i in range(P) if j in self.assignment[i]] for j in range(P)]
        for j in range(P):
            zeros = theta[[i for i in range(P) if i not in holders[j]]]
            for u in range(m):
                others = np.delete(self.beta, u)
                x = theta[holders[j]]
                val = np.prod((x[:, None] - zeros[None, :]) / (self.beta[u] - zeros[None, :]), axis=1)
                val *= np.prod((x[:, None] - others[None, :]) / (self.beta[u] - others[None, :]), axis=1)
                B[holders[j], j, u] = val
        return B

    def _amplification(self, theta: np.ndarray, B: np.ndarray) -> float:
        """Worst-case growth of relative message errors into the decoded sums, over every
        set of s missing rows (sampled past 2,000 sets)."""
        scale = np.abs(B).sum(axis=(1, 2))  # |z_i| per unit input
        sets = list(itertools.combinations(range(self.P), self.s)) if math.comb(self.P, self.s) <= 2000 else [
            tuple(np.random.default_rng(i).choice(self.P, self.s, replace=False)) for i in range(2000)]
        Vb = C.chebvander(self.beta, self.k - 1)
        keep = np.array([np.setdiff1d(np.arange(self.P), drop) for drop in sets])  # [n_sets, P - s]
        D = Vb[None] @ np.linalg.pinv(C.chebvander(theta[keep], self.k - 1))  # [n_sets, m, P - s]
        return float((np.abs(D) * scale[keep][:, None, :]).sum(axis=2).max())

    def _best_stride(self) -> tuple[int, np.ndarray, np.ndarray]:
        best = None
        for g in range(1, self.P):
            if math.gcd(g, self.P) != 1:
                continue
            theta = self._worker_nodes[[(g * i) % self.P for i in range(self.P)]]
            B = self._coefficients(theta)
            amp = self._amplification(theta, B)
            if best is None or amp < best[0] - 1e-12:
                best = (amp, g, theta, B)
            if self.P > 64 and g > 16:  # enough choices for large codes
                break
        self.amplification = best[0]
        return best[1], best[2], best[3]

    # -- workers ---------------------------------------------------------------------------
    def message_size(self, d: int) -> int:
        return -(-d // self.m)

    def _blocks(self, g: np.ndarray, d: int) -> np.ndarray:
        """[..., d] -> [..., m, ℓ] (zero padded)."""
        ell = self.message_size(d)
        pad = np.zeros(g.shape[:-1] + (self.m * ell,), dtype=np.float64)
        pad[..., :d] = g
        return pad.reshape(g.shape[:-1] + (self.m, ell))

    def encode(self, worker: int, updates: np.ndarray) -> np.ndarray:
        """Worker ``worker``'s message from the updates of its partitions, ``updates
        [r, d]`` in the order of ``assignment[worker]``: ``[ℓ]`` float64."""
        updates = np.asarray(updates, dtype=np.float64)
        if updates.ndim != 2 or updates.shape[0] != self.r:
            raise ValueError(f"worker {worker} holds {self.r} partitions; got updates of shape {updates.shape}")
        blocks = self._blocks(updates, updates.shape[1])  # [r, m, ℓ]
        coef = self.coef[worker, list(self.assignment[worker]), :]  # [r, m]
        return np.einsum("ju,jul->l", coef, blocks)

    def encode_all(self, G: np.ndarray) -> np.ndarray:
        """Every worker's message at once from all partitions' updates ``G [P, d]`` (a
        simulation and test helper): ``[P, ℓ]``."""
        blocks = self._blocks(np.asarray(G, dtype=np.float64), np.asarray(G).shape[1])
        return np.einsum("iju,jul->il", self.coef, blocks)

    # -- the server ----------------------------------------------------------------------
    def decode(self, Z: np.ndarray, d: int, present: np.ndarray | None = None,
               rng: np.random.Generator | None = None) -> DecodeResult:
        """The sum of all P partitions' updates from the messages ``Z [P, ℓ]``;
        ``present`` masks the rows that arrived (missing rows are erasures). Lying rows
        are located and dropped; if more than the code can explain lie, ``ok`` is False."""
        Z = np.asarray(Z, dtype=np.float64)
        ell = self.message_size(d)
        if Z.shape != (self.P, ell):
            raise ValueError(f"expected messages of shape ({self.P}, {ell}), got {Z.shape}")
        present = np.ones(self.P, bool) if present is None else np.asarray(present, bool).copy()
        present &= np.isfinite(Z).all(axis=1)
        rows = np.flatnonzero(present)
        missing = tuple(int(i) for i in np.flatnonzero(~present))
        if rows.size < self.k:
            return DecodeResult(False, None, (), missing,
                                f"only {rows.size} of {self.P} messages usable; decoding needs {self.k}")
        t = (rows.size - self.k) // 2
        rng = rng if rng is not None else np.random.default_rng()
        Y = Z[rows]
        norm = float(np.linalg.norm(Y))
        tol = REL_TOL * max(norm, 1e-300)
        # Random directions secret to the workers: a lie is invisible in them with
        # probability 0.
        W = rng.standard_normal((ell, min(ell, 4)))
        Yp = Y @ W
        tolp = REL_TOL * max(float(np.linalg.norm(Yp)), 1e-300)
        drop, greedy = self._locate(rows, Yp, t, tolp)
        if drop is None:
            return DecodeResult(False, None, (), missing,
                                f"the messages are not a codeword within {t} corrupted rows: more than {t} "
                                f"workers lied (the code corrects s <= (r - m)/2 = {self.s}, fewer when "
                                f"{len(missing)} are missing)")
        keep = np.setdiff1d(np.arange(rows.size), drop)
        V = C.chebvander(self.theta[rows[keep]], self.k - 1)
        coef, *_ = np.linalg.lstsq(V, Y[keep], rcond=None)
        resid = float(np.linalg.norm(Y[keep] - V @ coef))
        if resid > tol:
            return DecodeResult(False, None, (), missing,
                                f"after dropping {len(drop)} rows the rest is still not a codeword "
                                f"(residual {resid / max(norm, 1e-300):.1e} of the messages): "
                                f"more than {t} workers lied")
        sums = C.chebvander(self.beta, self.k - 1) @ coef  # [m, ℓ]
        liars = tuple(int(rows[i]) for i in drop)
        return DecodeResult(True, sums.reshape(-1)[:d].copy(), liars, missing, "", greedy,
                            {"residual": resid / max(norm, 1e-300)})

    def _residuals(self, rows: np.ndarray, Yp: np.ndarray, keeps: np.ndarray, key=None) -> np.ndarray:
        """Residual of ``Yp`` on each row set of ``keeps [n_sets, n_keep]`` (positions into
        ``rows``) against the code: one orthonormal basis per candidate support (batched
        QR, cached per ``key``)."""
        q = self._bases.get(key) if key is not None else None
        if q is None:
            q, _ = np.linalg.qr(C.chebvander(self.theta[rows[keeps]], self.k - 1))  # [n_sets, n_keep, k]
            if key is not None:
                self._bases[key] = q
        y = Yp[keeps]  # [n_sets, n_keep, q]
        return np.linalg.norm(y - q @ (np.swapaxes(q, 1, 2) @ y), axis=(1, 2))

    def _locate(self, rows: np.ndarray, Yp: np.ndarray, t: int, tol: float) -> tuple[np.ndarray | None, bool]:
        """The smallest set of row positions (into ``rows``) whose removal leaves a
        codeword, or None if none of size <= t does."""
        n = rows.size
        everyone = np.arange(n)
        rkey = rows.tobytes()
        if self._residuals(rows, Yp, everyone[None], (rkey, 0))[0] <= tol:
            return np.array([], dtype=int), False
        if sum(math.comb(n, e) for e in range(1, t + 1)) <= MAX_SUBSETS:
            for e in range(1, t + 1):
                drops, keeps = _supports(n, e)
                res = self._residuals(rows, Yp, keeps, (rkey, e))
                best = int(np.argmin(res))
                if res[best] <= tol:
                    return drops[best], False
            return None, False
        # Greedy: repeatedly drop the row whose removal shrinks the residual most.
        keep = list(everyone)
        for _ in range(t):
            keeps = np.array([[i for i in keep if i != c] for c in keep])
            res = self._residuals(rows, Yp, keeps)
            best = int(np.argmin(res))
            keep.pop(best)
            if res[best] <= tol:
                return np.setdiff1d(everyone, keep), True
        return None, True

    def summary(self) -> str:
        return (f"polynomial code: P={self.P}, s={self.s}, m={self.m}, r={self.r} partitions/worker, k={self.k}, "
                f"stride {self.stride}, float32 error amplification {self.amplification:.0f}")


class RepetitionCode:
    """Draco's repetition code: groups of r = 2s+1 workers compute the same sum, the
    server takes each group's majority (see the module doc). Needs r | P."""

    scheme = "repetition"

    def __init__(self, P: int, s: int, r: int | None = None):
        r = 2 * s + 1 if r is None else int(r)
        if r < 2 * s + 1:
            raise ToleranceError(f"Draco's repetition code tolerates s <= (r - 1)/2: r={r} gives s <= {(r - 1) // 2}, "
                                 f"asked for s={s}")
        if r > P or P % r:
            raise ToleranceError(f"Draco's repetition code needs groups of r = 2s + 1 = {r} dividing the P={P} workers "
                                 f"(use the cyclic code, code=cyclic)")
        self.P, self.s, self.r, self.m, self.k = int(P), int(s), r, 1, 1
        self.groups = [tuple(range(b * r, (b + 1) * r)) for b in range(P // r)]
        self.assignment = [self.groups[i // r] for i in range(P)]

    def message_size(self, d: int) -> int:
        return d

    def encode(self, worker: int, updates: np.ndarray) -> np.ndarray:
        updates = np.asarray(updates, dtype=np.float64)
        if updates.ndim != 2 or updates.shape[0] != self.r:
            raise ValueError(f"worker {worker} holds {self.r} partitions; got updates of shape {updates.shape}")
        return updates.sum(axis=0)

    def encode_all(self, G: np.ndarray) -> np.ndarray:
        G = np.asarray(G, dtype=np.float64)
        return np.stack([G[list(self.assignment[i])].sum(axis=0) for i in range(self.P)])

    def decode(self, Z: np.ndarray, d: int, present: np.ndarray | None = None,
               rng: np.random.Generator | None = None) -> DecodeResult:
        Z = np.asarray(Z, dtype=np.float64)
        if Z.shape != (self.P, d):
            raise ValueError(f"expected messages of shape ({self.P}, {d}), got {Z.shape}")
        present = np.ones(self.P, bool) if present is None else np.asarray(present, bool).copy()
        present &= np.isfinite(Z).all(axis=1)
        missing = tuple(int(i) for i in np.flatnonzero(~present))
        total = np.zeros(d)
        liars: list[int] = []
        for b, group in enumerate(self.groups):
            members = [i for i in group if present[i]]
            value, agree = self._majority(Z, members)
            if value is None:
                return DecodeResult(False, None, (), missing,
                                    f"group {b} (workers {group[0]}..{group[-1]}) has no value that s+1 = "
                                    f"{self.s + 1} members agree on: more than {self.s} of them lied")
            total += value
            liars += [i for i in members if i not in agree]
        return DecodeResult(True, total, tuple(liars), missing)

    def _majority(self, Z: np.ndarray, members: list[int]) -> tuple[np.ndarray | None, list[int]]:
        """A value at least s+1 members agree on (to rounding), and who agrees."""
        for i in members:
            scale = max(float(np.linalg.norm(Z[i])), 1e-300)
            agree = [j for j in members if np.linalg.norm(Z[j] - Z[i]) <= REL_TOL * scale]
            if len(agree) >= self.s + 1:
                return Z[agree].mean(axis=0), agree
        return None, []

    def summary(self) -> str:
        return f"repetition code: P={self.P}, s={self.s}, groups of r={self.r}"


def make_code(scheme: str, P: int, s: int, m: int = 1) -> PolynomialCode | RepetitionCode:
    """``repetition`` (Draco), ``cyclic`` (the polynomial code with m = 1: Draco's cyclic
    code's parameters), ``solon`` (the polynomial code with compression m), or ``auto``
    (repetition when 2s+1 divides P, else cyclic)."""
    if scheme == "auto":
        scheme = "repetition" if P % (2 * s + 1) == 0 else "cyclic"
    if scheme == "repetition":
        return RepetitionCode(P, s)
    if scheme == "cyclic":
        return PolynomialCode(P, s, 1)
    if scheme == "solon":
        return PolynomialCode(P, s, m)
    raise ValueError(f"unknown code {scheme!r} (repetition, cyclic, solon, auto)")
