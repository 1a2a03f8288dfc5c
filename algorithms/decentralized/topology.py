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

This module is the import point: it re-exports the matrices (:mod:`.mixing`), the
:class:`Topology` object (:mod:`.graph`) and the builders (:mod:`.graphs`), and turns
specs into topologies.

Specs (``make_topology(spec, n, seed)``; ``fedswarm topologies`` lists them from
:data:`TOPOLOGIES`): ``ring``, ``torus``, ``torus:RxC``, ``exp``, ``onepeer-exp``,
``complete``, ``random:D``, ``edges:PATH``, each optionally followed by ``+lazy``.
"""

from __future__ import annotations

from typing import Callable

from fedswarm.algorithms.decentralized.graph import OnePeerExponential, Topology
from fedswarm.algorithms.decentralized.graphs import (complete, exponential, from_edges, one_peer_exponential,
                                                      random_regular, ring, torus)
from fedswarm.algorithms.decentralized.mixing import check_mixing, metropolis_hastings, spectral_gap

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
