"""Builders of the standard communication graphs (ring, torus, exponential, one-peer
exponential, complete, random regular, a user's edge list). Each returns a
:class:`~fedswarm.algorithms.decentralized.graph.Topology`; ``make_topology`` in
:mod:`.topology` builds them from specs.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Sequence

import torch

from fedswarm.algorithms.decentralized.graph import (OnePeerExponential, Topology, _circulant, _empty,
                                                     _from_pairs, _unreachable)

__all__ = ["ring", "torus", "exponential", "one_peer_exponential", "complete", "random_regular", "from_edges"]


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
