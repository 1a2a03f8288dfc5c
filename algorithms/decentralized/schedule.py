"""Fixed schedules: an asynchronous run's events as a seeded, deterministic replay.

AD-PSGD and Prague have no barrier: which nodes average when, and how stale each
gradient is, depend on timing. To drive them identically on every runtime (tests,
replays, comparisons), ``schedule="fixed"`` replaces timing by a list drawn from the seed:
at iteration (tick) ``t`` (1-based, as the runtimes number iterations)

* AD-PSGD: every initiator of :func:`~.adpsgd.exchange_roles` (on a bipartite graph the
  active nodes, otherwise each edge's lower end), in a seeded order, picks a uniformly
  random partner among those it may initiate with; if the partner is already in an
  averaging this tick, it sits out (as a swarm peer answered "busy"). The pairs are
  disjoint.
* Prague: a seeded permutation of all nodes cut into groups of ``group_size`` (a last
  group of one node does not average).
* both: each node's gradient is taken at its model ``s`` iterations old, ``s`` drawn
  uniformly from ``0..min(max_staleness, t − 1)``
  (:meth:`~.base.DecentralizedAlgorithm.gradient_point`).

Tick ``t``'s events come from ``random.Random`` seeded with ``(kind, seed, t)`` only, so
any runtime, any peer, at any time, draws the same events. The schedule is a
time-varying :class:`~.graph.Topology` whose mixing matrix at ``t`` averages each group
(``1/|G|`` within a group, identity elsewhere): one iteration is then the algorithm's
ordinary ``local_step`` + ``mix`` (``node_mix`` on a peer with its row), so the array
engine, the Flower router and the swarm drive it with their synchronous machinery, and
the algorithm's math stays in its object.

    algo = make_algorithm("adpsgd", schedule="fixed", max_staleness=2)
    sched = make_schedule(algo, make_topology("ring", 6), seed=0)
    sched.groups(3), sched.staleness(0, 3), sched.mixing_matrix(3)
"""

from __future__ import annotations

import random

import torch

from fedswarm.algorithms.decentralized.adpsgd import ADPSGD, exchange_roles
from fedswarm.algorithms.decentralized.base import DecentralizedAlgorithm
from fedswarm.algorithms.decentralized.graph import Topology, _from_pairs
from fedswarm.algorithms.decentralized.prague import Prague

__all__ = ["FixedSchedule", "make_schedule", "uses_fixed_schedule"]

_CACHE = 256  # ticks kept


class FixedSchedule(Topology):
    """Seeded events per tick as a time-varying graph. ``kind`` is ``"pairs"`` (AD-PSGD,
    over ``base``'s edges) or ``"groups"`` (Prague, groups of ``group_size`` among all
    nodes); ``max_staleness`` bounds the gradients' staleness."""

    time_varying = True

    def __init__(self, kind: str, base: Topology, seed: int, *, group_size: int = 2, max_staleness: int = 0):
        if kind not in ("pairs", "groups"):
            raise ValueError(f"fixed schedule kind must be 'pairs' or 'groups' (got {kind!r})")
        super().__init__(f"fixed:{kind}({base.name})", None)
        self.n, self.kind, self.base, self.seed = base.n, kind, base, int(seed)
        self.group_size = min(int(group_size), self.n)
        self.max_staleness = int(max_staleness)
        if self.kind == "groups" and self.group_size < 2:
            raise ValueError(f"a fixed schedule of groups needs group_size >= 2 and n >= 2 (n={self.n})")
        self._roles = exchange_roles(base) if kind == "pairs" else None
        self._ticks: dict[int, tuple[list[tuple[int, ...]], list[int]]] = {}
        self._A: dict[int, torch.Tensor] = {}
        self._W: dict[int, torch.Tensor] = {}

    # -- the events
    def _tick(self, t: int) -> tuple[list[tuple[int, ...]], list[int]]:
        got = self._ticks.get(t)
        if got is None:
            rng = random.Random(f"fedswarm-fixed-schedule:{self.kind}:{self.seed}:{t}")
            groups: list[tuple[int, ...]] = []
            if self.kind == "pairs":
                order = [i for i, (initiates, up) in enumerate(self._roles) if initiates and up]
                rng.shuffle(order)
                busy: set[int] = set()
                for i in order:
                    j = rng.choice(self._roles[i][1])
                    if i in busy or j in busy:
                        continue  # one of them is averaging already this tick
                    busy |= {i, j}
                    groups.append((min(i, j), max(i, j)))
            else:
                perm = list(range(self.n))
                rng.shuffle(perm)
                g = self.group_size
                groups = [tuple(sorted(perm[k : k + g])) for k in range(0, self.n, g) if len(perm[k : k + g]) >= 2]
            bound = max(0, min(self.max_staleness, t - 1))
            stale = [rng.randint(0, bound) for _ in range(self.n)]
            got = (sorted(groups), stale)
            if len(self._ticks) >= _CACHE:
                self._ticks.clear()
            self._ticks[t] = got
        return got

    def groups(self, round: int) -> list[tuple[int, ...]]:
        """The disjoint groups (pairs for AD-PSGD) that average at tick ``round``."""
        return list(self._tick(round)[0])

    def staleness(self, i: int, round: int = 0) -> int:
        """How many iterations old node ``i``'s gradient model is at tick ``round``."""
        return self._tick(round)[1][i]

    # -- as a graph
    def adjacency(self, round: int = 0) -> torch.Tensor:
        A = self._A.get(round)
        if A is None:
            A = _from_pairs(self.n, [(a, b) for g in self.groups(round) for a in g for b in g if a < b])
            if len(self._A) >= _CACHE:
                self._A.clear()
            self._A[round] = A
        return A

    def mixing_matrix(self, round: int = 0) -> torch.Tensor:
        """Identity, with a ``1/|G|`` block on each group of tick ``round`` (float64)."""
        W = self._W.get(round)
        if W is None:
            W = torch.eye(self.n, dtype=torch.float64)
            for g in self.groups(round):
                idx = torch.tensor(g)
                W[idx[:, None], idx[None, :]] = 1.0 / len(g)
            if len(self._W) >= _CACHE:
                self._W.clear()
            self._W[round] = W
        return W

    def summary(self) -> str:
        return (f"{self.name}: n={self.n}, seeded fixed schedule (seed {self.seed}), "
                f"max staleness {self.max_staleness}")


def uses_fixed_schedule(algo: DecentralizedAlgorithm) -> bool:
    """Whether ``algo`` is an asynchronous algorithm set to replay a fixed schedule."""
    return getattr(algo, "schedule", None) == "fixed"


def make_schedule(algo: DecentralizedAlgorithm, base: Topology, seed: int) -> FixedSchedule:
    """The fixed schedule of ``algo`` (AD-PSGD: pairs along ``base``'s edges; Prague:
    groups of ``algo.group_size`` among all nodes, ``base`` gives only ``n``)."""
    if not uses_fixed_schedule(algo):
        raise ValueError(f"{algo.name} is not set to a fixed schedule (schedule='fixed')")
    if isinstance(algo, ADPSGD):
        return FixedSchedule("pairs", base, seed, max_staleness=algo.max_staleness)
    if isinstance(algo, Prague):
        return FixedSchedule("groups", base, seed, group_size=algo.group_size, max_staleness=algo.max_staleness)
    raise ValueError(f"{algo.name} has no fixed schedule")  # pragma: no cover
