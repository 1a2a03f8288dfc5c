"""AD-PSGD's primitives: pairwise model averaging and the active/passive split.

AD-PSGD (Lian, Zhang, Zhang, Liu, ICML 2018; docs/algorithms.md §3) has no global barrier:
each worker loops on "snapshot, gradient, average with one random neighbour, apply the
gradient". The event loop that drives it runs on the simulator's virtual clock or in the
swarm peers; this module has only the math every runtime shares.

Deadlock avoidance (the paper's bipartite trick): if averaging requests could form a
cycle (A waits for B, B for C, C for A), every worker in it would block. So the graph is
2-coloured into *active* and *passive* nodes; only active nodes initiate an averaging,
and only with passive neighbours; passive nodes just serve requests (and still compute
gradients). A ring with an even number of nodes is bipartite; an odd ring is not, and
:func:`bipartite_split` refuses it.

Runtimes with real concurrency (the swarm) also run on graphs that are not bipartite, with
:func:`exchange_roles`: every edge gets exactly one initiator, the lower-indexed end. The
"who initiates with whom" relation is then acyclic, so no cycle of waits can form, and the
highest-indexed requested node never initiates itself, so among simultaneous requests one
always finds its partner free (no livelock of mutual "busy" answers).
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

import torch

from fedswarm.algorithms.decentralized.base import DecentralizedAlgorithm, GossipState
from fedswarm.algorithms.decentralized.topology import Topology

__all__ = ["ADPSGD", "SCHEDULES", "check_schedule", "pairwise_average", "pair_mixing_matrix", "bipartite_split",
           "exchange_roles"]


def pair_mixing_matrix(n: int, i: int, j: int) -> torch.Tensor:
    """``W_k = I − (e_i − e_j)(e_i − e_j)ᵀ / 2``, float64 ``[n, n]``: the averaging of
    ``i`` and ``j`` as a gossip matrix (symmetric and doubly stochastic)."""
    if i == j:
        raise ValueError(f"a node cannot average with itself (i = j = {i})")
    e = torch.zeros(n, dtype=torch.float64)
    e[i], e[j] = 1.0, -1.0
    return torch.eye(n, dtype=torch.float64) - 0.5 * torch.outer(e, e)


def _as_pairs(pairs: torch.Tensor | Sequence[tuple[int, int]], n: int) -> torch.Tensor:
    p = torch.as_tensor(pairs, dtype=torch.long).reshape(-1, 2)
    if p.numel() and (p.min() < 0 or p.max() >= n):
        raise ValueError(f"pairs name nodes outside 0..{n - 1}")
    if (p[:, 0] == p[:, 1]).any():
        raise ValueError("a node cannot average with itself")
    flat = p.flatten()
    if flat.unique().numel() != flat.numel():
        raise ValueError("pairs must be disjoint: a node can be in one averaging at a time")
    return p


def pairwise_average(x: torch.Tensor, pairs: torch.Tensor | Sequence[tuple[int, int]]) -> torch.Tensor:
    """Average each disjoint pair ``(i, j)``: ``x_i, x_j ← (x_i + x_j) / 2``, for all pairs
    at once. Returns a new ``[n, d]`` tensor; the column sums (so the mean) are kept."""
    p = _as_pairs(pairs, x.shape[0])
    out = x.clone()
    if p.numel():
        avg = 0.5 * (x[p[:, 0]] + x[p[:, 1]])
        out[p[:, 0]] = avg
        out[p[:, 1]] = avg
    return out


def bipartite_split(topology: Topology, round: int = 0) -> torch.Tensor:
    """2-colour the graph: bool ``[n]``, True for active nodes (each component's lowest
    node is active). Raises ValueError if the graph has an odd cycle."""
    A = topology.adjacency(round)
    n = topology.n
    nbrs = [torch.nonzero(A[i]).flatten().tolist() for i in range(n)]
    colour = [-1] * n
    for start in range(n):
        if colour[start] >= 0:
            continue
        colour[start] = 1
        queue = deque([start])
        while queue:
            i = queue.popleft()
            for j in nbrs[i]:
                if colour[j] < 0:
                    colour[j] = 1 - colour[i]
                    queue.append(j)
                elif colour[j] == colour[i]:
                    raise ValueError(
                        f"AD-PSGD needs a bipartite graph to split active/passive nodes, but "
                        f"'{topology.name}' (n={n}) has an odd cycle through nodes {i} and {j} "
                        f"(an odd ring does); use an even ring or a bipartite edge list"
                    )
    return torch.tensor(colour, dtype=torch.bool)


def exchange_roles(topology: Topology, round: int = 0) -> list[tuple[bool, list[int]]]:
    """For each node, ``(initiates?, the neighbours it initiates averagings with)``.

    Bipartite graphs get the paper's split (:func:`bipartite_split`): active nodes initiate
    with all their (passive) neighbours. Other graphs get the orientation by index: node
    ``i`` initiates with its neighbours ``j > i``. Either way every edge has exactly one
    initiator, and the initiation relation has no cycle (see the module docstring)."""
    n = topology.n
    try:
        active = bipartite_split(topology, round)
    except ValueError:
        return [(bool(up := [j for j in topology.neighbors(i, round) if j > i]), up) for i in range(n)]
    return [(bool(active[i]), [j for j in topology.neighbors(i, round) if not bool(active[j])] if active[i] else [])
            for i in range(n)]


class ADPSGD(DecentralizedAlgorithm):
    """AD-PSGD, asynchronous decentralized parallel SGD (Lian et al., ICML 2018; §3).

    Each worker loops, with no barrier::

        x̂ ← x_i;  g ← ∇F_i(x̂; ξ)                   # snapshot may go stale meanwhile
        j ← uniform passive neighbour (i active)     # see choose_peer
        x_i, x_j ← (x_i + x_j) / 2                   # average_pairs / node_average
        x_i ← x_i − η g                              # local_step, with the stale g

    In matrix form ``X ← W_k X − η G(X̂)`` with ``W_k = pair_mixing_matrix(n, i, j)``:
    :meth:`local_step` keeps ``−η g`` pending (as D-PSGD's "cta" order) and the mix
    applies it after the averaging, so the generic ``local_step`` + :meth:`mix` (or
    :meth:`node_mix`) is one AD-PSGD iteration with the averagings given as a matrix.
    That is how the runtimes drive a fixed schedule (``schedule="fixed"``,
    :mod:`.schedule`): a seeded list of which pairs average at tick ``t`` and how stale
    each gradient is (up to ``max_staleness`` iterations). Event-driven runtimes (the
    virtual clock, the swarm's timing mode) average pairs as separate events and finish
    a local step with a mix that has no neighbour (``node_mix(state, i, {}, {i: 1})``).

    State: ``x``, the pending update, ``max_staleness`` earlier models (the runtime
    guards ``x`` with a lock while averaging). ``step`` counts local steps. Wire: one
    averaging moves a full model each way, 4d bytes sent and 4d received by each
    endpoint; about one averaging per active local step.
    """

    name = "adpsgd"

    def __init__(self, schedule: str = "clock", max_staleness: int = 0, weight_decay: float = 0.0):
        super().__init__(weight_decay)
        self.schedule, self.max_staleness = check_schedule(self.name, schedule, max_staleness)

    def _init_buffers(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"update": torch.zeros_like(x), **self._snapshot_buffers(x)}

    def local_step(self, state: GossipState, grads: torch.Tensor, lr: float) -> None:
        """Compute ``−η g`` and keep it pending; the next mix applies it after averaging."""
        self._remember(state)
        state.buffers["update"] = -lr * self._grad(state, grads)
        state.step += 1

    def _finish(self, state: GossipState, mixed: torch.Tensor) -> None:
        # an averaging is not an iteration: step counts local steps
        update = state.buffers.get("update")
        state.x = mixed if update is None else mixed + update
        if update is not None:
            state.buffers["update"] = torch.zeros_like(mixed)

    def average_pairs(self, state: GossipState, pairs: torch.Tensor | Sequence[tuple[int, int]]) -> None:
        """Apply disjoint averaging events at once (a batch of concurrent events)."""
        state.x = pairwise_average(state.x, pairs)

    def node_average(self, state: GossipState, received: torch.Tensor) -> None:
        """One endpoint's view: ``x ← (x + x_peer) / 2`` with the peer's model ``[d]``.
        Both the initiator and the served node call it with the other's model."""
        if state.n != 1 or received.numel() != state.d:
            raise ValueError(f"node_average needs a one-node state and a [{state.d}] model")
        state.x = 0.5 * (state.x + received.reshape(1, -1).to(state.x.dtype))

    def choose_peer(self, i: int, topology: Topology, active: torch.Tensor,
                    generator: torch.Generator | None = None, round: int = 0) -> int:
        """A uniformly random passive neighbour for active node ``i``."""
        if not bool(active[i]):
            raise ValueError(f"node {i} is passive: only active nodes initiate an averaging")
        peers = [j for j in topology.neighbors(i, round) if not bool(active[j])]
        if not peers:
            raise ValueError(f"active node {i} has no passive neighbour")
        k = int(torch.randint(len(peers), (1,), generator=generator))
        return peers[k]

    def check_topology(self, topology: Topology) -> None:
        """Timed by a clock: the graph must be bipartite (active/passive split). A fixed
        schedule pairs along any graph (each edge's initiator from :func:`exchange_roles`)."""
        super().check_topology(topology)
        if self.schedule == "clock":
            for r in range(topology.period):
                bipartite_split(topology, r)

    def wire_bytes(self, d: int, degree: int) -> int:
        """Bytes an endpoint sends per averaging event (4d), whatever its degree."""
        return 4 * d

    def hyperparams(self) -> dict:
        return {"schedule": self.schedule, "max_staleness": self.max_staleness, **super().hyperparams()}


#: How an asynchronous algorithm's events are timed: by the runtime's clock or messages
#: (``clock``), or replayed from a seeded fixed schedule, the same on every runtime (``fixed``).
SCHEDULES = ("clock", "fixed")


def check_schedule(name: str, schedule: str, max_staleness: int) -> tuple[str, int]:
    """Validate an asynchronous algorithm's ``schedule`` / ``max_staleness``."""
    if schedule not in SCHEDULES:
        raise ValueError(f"{name}: schedule must be one of {', '.join(SCHEDULES)} (got {schedule!r})")
    if int(max_staleness) < 0:
        raise ValueError(f"{name}: max_staleness must be >= 0 (got {max_staleness})")
    if schedule == "clock" and int(max_staleness):
        raise ValueError(f"{name}: max_staleness applies to schedule='fixed' (the clock makes its own staleness)")
    return schedule, int(max_staleness)
