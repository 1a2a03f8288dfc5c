"""Communication graphs for decentralized training and their gossip (mixing) matrices.

A :class:`Topology` says who talks to whom at a round and with what weights. Every
decentralized algorithm (D-PSGD, D², QG-DSGDm, AD-PSGD, ...) mixes with the matrix
``W = topology.mixing_matrix(round)``: symmetric, doubly stochastic and nonnegative, with
``W_ij > 0`` only for ``i == j`` or an edge ``(i, j)`` (Lian et al. 2017, §2 of
``docs/algorithms.md``). A whole synchronous gossip step is then ``W @ X`` for the
node-stacked models ``X [n, d]``.

Weights are Metropolis–Hastings, ``w_ij = 1 / (1 + max(deg_i, deg_j))`` on edges and
``w_ii = 1 − Σ_j w_ij`` (as decentralizepy does). On a regular graph this is exactly the
uniform ``1 / (deg + 1)`` (a ring gets the standard 1/3). Appending ``+lazy`` to a spec
uses ``(I + W) / 2`` instead, whose eigenvalues are all >= 0 — what D² needs on an even
ring, where ``λ_min(W) = −1/3``.

How fast gossip averages is governed by the spectral gap ``1 − max(|λ₂|, |λ_n|)`` of W:
with zero learning rate ``‖X_t − X̄‖ ≤ (1 − gap)^t ‖X_0 − X̄‖``.

Specs (``make_topology(spec, n, seed)``; ``fedswarm topologies`` lists them from
:data:`TOPOLOGIES`): ``ring``, ``torus``, ``torus:RxC``, ``exp``, ``onepeer-exp``,
``complete``, ``random:D``, ``edges:PATH``, each optionally followed by ``+lazy``.
"""

from __future__ import annotations

import json
import math
import random
from collections import deque
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch

__all__ = [
    "Topology",
    "OnePeerExponential",
    "check_mixing",
    "metropolis_hastings",
    "spectral_gap",
    "ring",
    "torus",
    "exponential",
    "one_peer_exponential",
    "complete",
    "random_regular",
    "from_edges",
    "make_topology",
    "TOPOLOGIES",
]


# --------------------------------------------------------------------------- matrices


def check_mixing(W: torch.Tensor, atol: float = 1e-8) -> None:
    """Check that ``W`` is a valid gossip matrix: square, symmetric, nonnegative and
    doubly stochastic (rows and columns sum to 1). Raise ValueError naming what fails."""
    if W.ndim != 2 or W.shape[0] != W.shape[1]:
        raise ValueError(f"mixing matrix must be square [n, n], got shape {tuple(W.shape)}")
    W = W.to(torch.float64)
    if not torch.isfinite(W).all():
        raise ValueError("mixing matrix has non-finite entries")
    asym = (W - W.T).abs().max().item() if W.numel() else 0.0
    if asym > atol:
        raise ValueError(f"mixing matrix is not symmetric: max |W_ij - W_ji| = {asym:.3g}")
    low = W.min().item() if W.numel() else 0.0
    if low < -atol:
        raise ValueError(f"mixing matrix is not nonnegative: min entry = {low:.3g}")
    for axis, what in ((1, "row"), (0, "column")):
        err = (W.sum(dim=axis) - 1.0).abs()
        if W.numel() and err.max().item() > atol:
            k = int(err.argmax())
            raise ValueError(
                f"mixing matrix is not doubly stochastic: {what} {k} sums to "
                f"{W.sum(dim=axis)[k].item():.6g}, not 1"
            )


def metropolis_hastings(adjacency: torch.Tensor) -> torch.Tensor:
    """Metropolis–Hastings weights of an undirected graph, float64 ``[n, n]``:
    ``w_ij = 1/(1 + max(deg_i, deg_j))`` on edges, the rest on the diagonal. Equals the
    uniform ``1/(deg + 1)`` on a regular graph."""
    A = adjacency.to(torch.float64)
    deg = A.sum(dim=1)
    W = A / (1.0 + torch.maximum(deg[:, None], deg[None, :]))
    return W + torch.diag(1.0 - W.sum(dim=1))


def spectral_gap(W: torch.Tensor) -> float:
    """``1 − max(|λ₂|, |λ_n|)`` of a symmetric ``W`` (1 for a single node; 0 when the graph
    is disconnected, because then λ₂ = 1)."""
    if W.shape[0] == 1:
        return 1.0
    moduli = torch.linalg.eigvalsh(W.to(torch.float64)).abs().sort(descending=True).values
    return float(1.0 - moduli[1])


# --------------------------------------------------------------------------- topology


class Topology:
    """An undirected communication graph on ``n`` nodes, possibly changing with the round.

    Parameters
    ----------
    name : str
        The spec it was made from (``"ring"``, ``"torus:4x4"``, ...), for logs.
    adjacency : torch.Tensor
        Boolean ``[n, n]``, symmetric, no self loops. Static topologies only; time-varying
        ones override :meth:`adjacency`.
    lazy : bool
        Mix with ``(I + W) / 2`` instead of ``W``.

    Attributes
    ----------
    n : int
        Number of nodes.
    time_varying : bool
        Whether the graph depends on the round.
    period : int
        The graph at round ``t`` equals the graph at ``t + period`` (1 when static).
    """

    time_varying: bool = False
    period: int = 1

    def __init__(self, name: str, adjacency: torch.Tensor | None, *, lazy: bool = False):
        self.name = name
        self.lazy = lazy
        self._adjacency = None
        if adjacency is not None:
            A = adjacency.to(torch.bool)
            if A.ndim != 2 or A.shape[0] != A.shape[1]:
                raise ValueError(f"adjacency must be [n, n], got {tuple(A.shape)}")
            if not torch.equal(A, A.T):
                raise ValueError("adjacency must be symmetric (undirected graph)")
            if A.diagonal().any():
                raise ValueError("adjacency must have no self loops")
            self._adjacency = A
            self.n = A.shape[0]
        self._W_cache: dict[int, torch.Tensor] = {}

    # -- graph
    def adjacency(self, round: int = 0) -> torch.Tensor:
        """Boolean ``[n, n]`` adjacency at ``round``."""
        return self._adjacency

    def neighbors(self, i: int, round: int = 0) -> list[int]:
        """Sorted neighbours of node ``i`` at ``round`` (never ``i`` itself)."""
        return torch.nonzero(self.adjacency(round)[i]).flatten().tolist()

    def degrees(self, round: int = 0) -> torch.Tensor:
        """Degree of every node at ``round``, int64 ``[n]``."""
        return self.adjacency(round).sum(dim=1)

    def edges(self, round: int = 0) -> list[tuple[int, int]]:
        """Undirected edges ``(i, j)`` with ``i < j`` at ``round``."""
        return [tuple(e) for e in torch.nonzero(torch.triu(self.adjacency(round), 1)).tolist()]

    def is_connected(self, round: int = 0) -> bool:
        return not _unreachable(self.adjacency(round))

    # -- weights
    def mixing_matrix(self, round: int = 0) -> torch.Tensor:
        """The gossip matrix at ``round``, float64 ``[n, n]`` (Metropolis–Hastings, lazy
        if asked). Cached; do not modify the returned tensor."""
        key = round % self.period
        W = self._W_cache.get(key)
        if W is None:
            W = metropolis_hastings(self.adjacency(round))
            if self.lazy:
                W = 0.5 * (torch.eye(self.n, dtype=torch.float64) + W)
            self._W_cache[key] = W
        return W

    def weights(self, i: int, round: int = 0) -> dict[int, float]:
        """Row ``i`` of the mixing matrix as ``{j: w_ij}`` over ``i`` and its neighbours:
        what one peer needs to mix what it received."""
        row = self.mixing_matrix(round)[i]
        return {j: float(row[j]) for j in [i, *self.neighbors(i, round)]}

    def spectral_gap(self, round: int = 0) -> float:
        """``1 − max(|λ₂(W)|, |λ_n(W)|)`` at ``round``. For a time-varying topology one
        round's graph may be disconnected (gap 0); the gossip mixes over a period."""
        return spectral_gap(self.mixing_matrix(round))

    def summary(self) -> str:
        deg = self.degrees(0)
        kind = "time-varying" if self.time_varying else "static"
        return (
            f"{self.name}: n={self.n}, {kind}, degree {int(deg.min())}..{int(deg.max())}, "
            f"spectral gap {self.spectral_gap(0):.4f}"
        )

    def __repr__(self) -> str:
        return f"Topology({self.name!r}, n={self.n}{', lazy' if self.lazy else ''})"


class OnePeerExponential(Topology):
    """Time-varying one-peer exponential graph: at round ``t`` node ``i`` talks to
    ``i ± 2^(t mod τ)`` with ``τ = ⌈log₂ n⌉`` (degree 2, or 1 when the distance is n/2).
    One round's graph is sparse and may be disconnected; a period of τ rounds reaches
    everyone (cf. Ying et al., NeurIPS 2021, here undirected so W stays symmetric)."""

    time_varying = True

    def __init__(self, n: int, *, lazy: bool = False):
        super().__init__("onepeer-exp", None, lazy=lazy)
        self.n = n
        self.period = max(1, math.ceil(math.log2(n))) if n > 1 else 1
        self._A_cache: dict[int, torch.Tensor] = {}

    def distance(self, round: int) -> int:
        """The hop distance ``2^(round mod τ)`` used at ``round``."""
        return 2 ** (round % self.period)

    def adjacency(self, round: int = 0) -> torch.Tensor:
        key = round % self.period
        A = self._A_cache.get(key)
        if A is None:
            A = _circulant(self.n, [self.distance(round)]) if self.n > 1 else _empty(self.n)
            self._A_cache[key] = A
        return A


# --------------------------------------------------------------------------- builders


def _empty(n: int) -> torch.Tensor:
    return torch.zeros(n, n, dtype=torch.bool)


def _circulant(n: int, offsets: Iterable[int]) -> torch.Tensor:
    """Adjacency with edges ``i — i ± k (mod n)`` for each offset k."""
    A = _empty(n)
    idx = torch.arange(n)
    for k in offsets:
        for j in ((idx + k) % n, (idx - k) % n):
            A[idx, j] = True
    A.fill_diagonal_(False)
    return A


def _from_pairs(n: int, pairs: Iterable[tuple[int, int]]) -> torch.Tensor:
    A = _empty(n)
    pairs = list(pairs)
    if pairs:
        p = torch.tensor(pairs, dtype=torch.long)
        A[p[:, 0], p[:, 1]] = True
        A[p[:, 1], p[:, 0]] = True
    return A


def _unreachable(A: torch.Tensor) -> list[int]:
    """Nodes not reachable from node 0 (breadth-first search)."""
    n = A.shape[0]
    if n == 0:
        return []
    nbrs = [torch.nonzero(A[i]).flatten().tolist() for i in range(n)]
    seen = [False] * n
    seen[0] = True
    queue = deque([0])
    while queue:
        i = queue.popleft()
        for j in nbrs[i]:
            if not seen[j]:
                seen[j] = True
                queue.append(j)
    return [i for i in range(n) if not seen[i]]


def _check_n(n: int, what: str, minimum: int = 1) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < minimum:
        raise ValueError(f"{what} needs n >= {minimum} nodes (got n={n!r})")


def ring(n: int, *, lazy: bool = False) -> Topology:
    """Cycle ``i — i ± 1``; weights 1/3 (λ_min = −1/3 when n is even)."""
    _check_n(n, "ring")
    return Topology("ring", _circulant(n, [1]) if n > 1 else _empty(n), lazy=lazy)


def torus(n: int, rows: int | None = None, cols: int | None = None, *, lazy: bool = False) -> Topology:
    """2-D torus (grid with wrap-around) of ``rows × cols = n`` nodes, degree 4 when both
    sides are >= 3. Node ``(a, b)`` is index ``a * cols + b``. Without sizes, the most
    square factorization of n is used."""
    _check_n(n, "torus")
    if rows is None and cols is None:
        rows = max(r for r in range(1, math.isqrt(n) + 1) if n % r == 0)
        cols = n // rows
        if rows == 1 and n > 3:
            raise ValueError(
                f"torus: n={n} has no factorization R x C with R, C >= 2; "
                f"use 'ring' or give 'torus:RxC'"
            )
    elif rows is None or cols is None:
        raise ValueError("torus needs both rows and cols, or neither")
    if rows < 1 or cols < 1:
        raise ValueError(f"torus needs R, C >= 1 (got {rows}x{cols})")
    if rows * cols != n:
        raise ValueError(f"torus:{rows}x{cols} has {rows * cols} nodes but n={n}; R*C must equal n")
    a, b = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    a, b = a.flatten(), b.flatten()
    idx = a * cols + b
    A = _empty(n)
    for j in (((a + 1) % rows) * cols + b, ((a - 1) % rows) * cols + b,
              a * cols + (b + 1) % cols, a * cols + (b - 1) % cols):
        A[idx, j] = True
    A.fill_diagonal_(False)
    return Topology(f"torus:{rows}x{cols}", A, lazy=lazy)


def exponential(n: int, *, lazy: bool = False) -> Topology:
    """Static exponential graph: ``i — i ± 2^k`` for every ``2^k < n`` (degree about
    2 log₂ n; BlueFog's ``ExponentialTwoGraph``, undirected)."""
    _check_n(n, "exp")
    offsets = [2**k for k in range(max(0, math.ceil(math.log2(n))))] if n > 1 else []
    return Topology("exp", _circulant(n, offsets), lazy=lazy)


def one_peer_exponential(n: int, *, lazy: bool = False) -> OnePeerExponential:
    """Time-varying one-peer exponential graph, see :class:`OnePeerExponential`."""
    _check_n(n, "onepeer-exp")
    return OnePeerExponential(n, lazy=lazy)


def complete(n: int, *, lazy: bool = False) -> Topology:
    """Everyone talks to everyone; ``W = 11ᵀ/n`` averages exactly in one step."""
    _check_n(n, "complete")
    A = ~torch.eye(n, dtype=torch.bool)
    return Topology("complete", A, lazy=lazy)


def random_regular(n: int, degree: int, seed: int = 0, *, lazy: bool = False,
                   max_tries: int = 200) -> Topology:
    """A connected random ``degree``-regular graph, the same for the same seed.

    Pairing model with Steger–Wormald repair (as networkx ``random_regular_graph``):
    stubs are matched at random, skipping self loops and repeated edges; a draw that gets
    stuck, or is disconnected, is redrawn. ``degree = 2`` is a ring on a random
    permutation (the only connected 2-regular graphs).
    """
    _check_n(n, "random:D", minimum=2)
    if degree < 1 or degree >= n:
        raise ValueError(f"random:D needs 1 <= D < n (got D={degree}, n={n})")
    if (n * degree) % 2:
        raise ValueError(f"random:{degree} needs n*D even (n={n}, D={degree})")
    if degree == 1 and n > 2:
        raise ValueError(f"random:1 is a perfect matching, disconnected for n={n} > 2; use D >= 2")
    rng = random.Random(seed)
    name = f"random:{degree}"
    if degree == 2:
        perm = list(range(n))
        rng.shuffle(perm)
        return Topology(name, _from_pairs(n, zip(perm, perm[1:] + perm[:1])), lazy=lazy)
    for _ in range(max_tries):
        edges = _pair_stubs(n, degree, rng)
        if edges is None:
            continue
        A = _from_pairs(n, edges)
        if not _unreachable(A):
            return Topology(name, A, lazy=lazy)
    raise ValueError(f"random:{degree}: no connected {degree}-regular graph on {n} nodes "
                     f"found in {max_tries} draws")


def _pair_stubs(n: int, d: int, rng: random.Random) -> set[tuple[int, int]] | None:
    edges: set[tuple[int, int]] = set()
    stubs = [i for i in range(n) for _ in range(d)]
    while stubs:
        left: dict[int, int] = {}
        rng.shuffle(stubs)
        for a, b in zip(stubs[::2], stubs[1::2]):
            a, b = min(a, b), max(a, b)
            if a != b and (a, b) not in edges:
                edges.add((a, b))
            else:
                left[a] = left.get(a, 0) + 1
                left[b] = left.get(b, 0) + 1
        if not left:
            return edges
        nodes = list(left)
        if not any((min(u, v), max(u, v)) not in edges
                   for k, u in enumerate(nodes) for v in nodes[k + 1:]):
            return None  # stuck: the remaining stubs can only make loops or repeats
        stubs = [i for i, c in left.items() for _ in range(c)]
    return edges


def from_edges(n: int, edges: str | Path | Sequence[tuple[int, int]], *, lazy: bool = False,
               name: str | None = None) -> Topology:
    """A user graph from a list of ``(i, j)`` pairs or a file of them.

    A file holds one pair per line (``i j`` or ``i,j``; ``#`` starts a comment), or, if it
    ends in ``.json``, a JSON list of pairs. Nodes are ``0..n-1``. Self loops, unknown
    nodes and disconnected graphs are refused.
    """
    _check_n(n, "edges")
    label = name or "edges"
    if isinstance(edges, (str, Path)):
        label = name or f"edges:{edges}"
        pairs = _read_edge_file(Path(edges))
    else:
        pairs = [tuple(p) for p in edges]
    clean = []
    for k, p in enumerate(pairs):
        if len(p) != 2:
            raise ValueError(f"edge list entry {k} is not a pair: {p!r}")
        try:
            i, j = int(p[0]), int(p[1])
        except (TypeError, ValueError):
            raise ValueError(f"edge list entry {k} is not a pair of integers: {p!r}") from None
        if not (0 <= i < n and 0 <= j < n):
            raise ValueError(f"edge list entry {k} ({i}, {j}) names a node outside 0..{n - 1}")
        if i == j:
            raise ValueError(f"edge list entry {k} is a self loop ({i}, {j})")
        clean.append((i, j))
    A = _from_pairs(n, clean)
    missing = _unreachable(A)
    if missing:
        shown = ", ".join(map(str, missing[:10])) + (", ..." if len(missing) > 10 else "")
        raise ValueError(f"edge list is disconnected: node(s) {shown} unreachable from node 0")
    return Topology(label, A, lazy=lazy)


def _read_edge_file(path: Path) -> list[tuple]:
    if not path.is_file():
        raise ValueError(f"edge list file '{path}' does not exist")
    text = path.read_text()
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"edge list file '{path}' is not valid JSON: {exc}") from None
        if not isinstance(data, list):
            raise ValueError(f"edge list file '{path}' must hold a JSON list of pairs")
        return [tuple(p) if isinstance(p, (list, tuple)) else (p,) for p in data]
    pairs = []
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.replace(",", " ").split()
        if len(parts) != 2:
            raise ValueError(f"{path}:{lineno}: expected 'i j', got {line!r}")
        pairs.append(tuple(parts))
    return pairs


# --------------------------------------------------------------------------- specs

#: name -> (constructor, description). The description starts with the spec syntax.
TOPOLOGIES: dict[str, tuple[Callable[..., Topology], str]] = {
    "ring": (ring, "ring — cycle, 2 neighbours, weights 1/3"),
    "torus": (torus, "torus[:RxC] — 2-D torus with wrap-around, 4 neighbours (R*C = n)"),
    "exp": (exponential, "exp — static exponential graph, neighbours at distance 2^k"),
    "onepeer-exp": (one_peer_exponential,
                    "onepeer-exp — time-varying: round t talks to i ± 2^(t mod log2 n)"),
    "complete": (complete, "complete — everyone averages with everyone (W = 11ᵀ/n)"),
    "random": (random_regular, "random:D — connected random D-regular graph (seeded)"),
    "edges": (from_edges, "edges:PATH — your graph: one 'i j' pair per line, or a JSON list"),
}

_NO_ARG = ("ring", "exp", "onepeer-exp", "complete")
_SYNTAX = "ring, torus[:RxC], exp, onepeer-exp, complete, random:D, edges:PATH (optionally +lazy)"


def make_topology(spec: str, n: int, seed: int = 0) -> Topology:
    """Build a topology from a spec such as ``ring``, ``torus:4x8``, ``random:4``,
    ``edges:graph.txt`` or ``ring+lazy``. Raises ValueError with a one-line reason."""
    raw = spec
    spec = spec.strip()
    lazy = spec.endswith("+lazy")
    if lazy:
        spec = spec[: -len("+lazy")]
    name, sep, arg = spec.partition(":")
    if name not in TOPOLOGIES:
        raise ValueError(f"unknown topology '{raw}' (available: {_SYNTAX})")
    if name in _NO_ARG:
        if sep:
            raise ValueError(f"topology '{name}' takes no argument (got '{raw}')")
        topo = TOPOLOGIES[name][0](n, lazy=lazy)
    elif name == "torus":
        if not sep:
            topo = torus(n, lazy=lazy)
        else:
            r, x, c = arg.lower().partition("x")
            if not (x and r.isdigit() and c.isdigit()):
                raise ValueError(f"torus needs 'torus:RxC' with integers R, C >= 1 (got '{raw}')")
            topo = torus(n, int(r), int(c), lazy=lazy)
    elif name == "random":
        if not arg.isdigit():
            raise ValueError(f"random needs an integer degree: 'random:D', e.g. random:4 (got '{raw}')")
        topo = random_regular(n, int(arg), seed, lazy=lazy)
    else:  # edges
        if not arg:
            raise ValueError(f"edges needs a file: 'edges:PATH' (got '{raw}')")
        topo = from_edges(n, arg, lazy=lazy)
    if lazy:
        topo.name += "+lazy"
    return topo
