"""AD-PSGD on a virtual clock: an event-driven simulation where stragglers are real.

Each node's compute time and each message's transfer time come from the time model
(``fedswarm/timemodel.py``), so staleness and stragglers happen in simulated time exactly as
they would on those devices, while the models are trained for real on the task.

AD-PSGD (Lian et al., ICML 2018; ``docs/algorithms.md`` §3), as simulated here.
The graph is split into active and passive nodes (``bipartite_split``); only active nodes
initiate an averaging, and only with a passive neighbour, so requests never form a cycle.
Every node loops; iteration ``k`` of node ``i`` starting at time ``t``:

- snapshot ``x̂ = x_i`` and compute ``g = ∇F_i(x̂; ξ_k)``, done at ``t + compute_i``;
- an active node at the same time (Algorithm 1 runs steps 2 and 3 in parallel) sends
  ``x_i`` to a uniformly random passive neighbour ``j``: it arrives after ``i``'s uplink
  transfer; ``j`` serves requests one at a time (it holds its lock), and the exchange
  completes after ``j``'s reply transfer. At that instant ``x_i, x_j ← (x_i + x_j)/2``
  as one event, so an averaging is never half-applied;
- when both are done, ``x_i ← x_i − η g`` with the (possibly stale) ``g``, and the next
  iteration starts. A passive node locked by an exchange applies its gradient when the
  lock is released.

Rounds. Nothing here is synchronous, so a recorded "round" is a unit of work: every time
the nodes have taken ``n`` local steps between them (one synchronous round's worth). Each
recorded round has the node-average model's test accuracy, ``consensus_distance``,
``sim_time_s`` (simulated seconds that round's work took, labeled as simulated) and the
peer-to-peer bytes (two full models per averaging, measured on a serialized message).

Availability (``--availability``: an on/off process per device class or a trace,
:mod:`fedswarm.availability`, on this clock's simulated seconds). A node starts an iteration
only while it is on; off, it neither computes nor gossips and starts again when it comes on. An
active node picks its peer uniformly among its passive neighbours that are on at that instant
(it skips the others; none on: it takes its step alone, with no averaging). A peer that cannot
finish the exchange inside its session (it is off when the request arrives, or goes off before
its reply would be sent), or an initiator that would go off before the exchange ends, refuses
it: the initiator applies its gradient alone at the request's arrival. An iteration that outlasts
its node's session, or that its class's ``dropout`` cuts (drawn per node and iteration), loses
its step: the gradient is discarded, nothing is applied, and the node starts again when it is on.
The rounds count the steps lost (``lost_steps``).

Federated evaluation is counted in the same unit: every ``eval_every``-th recorded round,
every node scores its own model, as it stands at that instant of simulated time, on its
validation split (:func:`own_models_eval`, the array engine's too); with ``central_eval`` off
the task's test set is not loaded. With ``client_data`` node ``i`` trains on the train split of
the ``i``-th client's own dataset (:func:`~fedswarm.train.trainer_for`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from fedswarm.algorithms.decentralized import ADPSGD, GossipState, bipartite_split
from fedswarm.algorithms.decentralized.topology import Topology, make_topology
from fedswarm.availability import Availability
from fedswarm.config import RunConfig
from fedswarm.errors import ConfigError
from fedswarm.server.recorder import RoundListener
from fedswarm.sim.async_clock import (DEFAULT_PROFILE, ClockedNodes, check_clocked, check_gossip, clock_availability,
                                      own_models_eval, run_clocked)
from fedswarm.sim.async_groups import check_config as check_prague
from fedswarm.sim.async_groups import run_prague
from fedswarm.sim.async_leaders import check_config as check_lsgd
from fedswarm.sim.async_leaders import run_lsgd_async
from fedswarm.sim.simtime import model_message_nbytes
from fedswarm.store import Store
from fedswarm.strategies import registry
from fedswarm.timemodel import Profile, VirtualClock, compute_time_s, transfer_time_s

# DEFAULT_PROFILE, check_clocked and own_models_eval live in fedswarm.sim.async_clock; named here too,
# where the virtual-clock engine's callers have always found them.
__all__ = ["ADPSGDSimulation", "run_async", "check_clocked", "check_config", "own_models_eval", "DEFAULT_PROFILE"]

#: gradient(node, x̂ [d], k) -> (gradient [d], loss), k = the node's 1-based step number.
GradientFn = Callable[[int, torch.Tensor, int], tuple[torch.Tensor, float]]


@dataclass
class _Node:
    active: bool
    compute_s: float
    send_s: float  # one full model over this node's uplink
    steps: int = 0
    grad: torch.Tensor | None = None
    loss: float = 0.0
    grad_done: bool = False
    averaging: bool = False
    free_at: float = 0.0  # passive: end of the last exchange it has accepted
    locks: list[tuple[float, float]] = field(default_factory=list)  # passive: exchange windows
    bytes_sent: int = 0
    stats: dict[str, float] = field(default_factory=lambda: {"steps": 0, "loss": 0.0})
    session_end: float = math.inf  # --availability: the end of the session its iteration started in
    attempts: int = 0  # --availability: iterations started (the dropout draw's index)


class ADPSGDSimulation(ClockedNodes):
    """The event loop. ``x0 [n, d]`` starting models; ``profiles[i]`` node ``i``'s device
    and link; ``gradient`` computes a node's (pseudo-)gradient; ``samples_per_step`` sets
    the compute time of one step; ``message_bytes`` is one model message's size. ``availability``:
    when each node (by partition id) is on (the module's docstring); ``on_step(i, start, end)`` hears
    every step applied, ``on_average(i, j, start, end)`` every exchange (both: checks, traces)."""

    def __init__(self, x0: torch.Tensor, topology: Topology, profiles: list[Profile], gradient: GradientFn, *,
                 lr: float, samples_per_step: float, message_bytes: int, weight_decay: float = 0.0, seed: int = 0,
                 availability: Availability | None = None,
                 on_step: Callable[[int, float, float], None] | None = None,
                 on_average: Callable[[int, int, float, float], None] | None = None):
        if len(profiles) != topology.n or x0.shape[0] != topology.n:
            raise ValueError(f"need one profile and one model per node ({topology.n} nodes)")
        self.algo = ADPSGD(weight_decay=weight_decay)
        self.algo.check_topology(topology)
        self.topology = topology
        self.active = bipartite_split(topology)
        self.state = self.algo.init_state(x0)
        self.gradient = gradient
        self.lr = float(lr)
        self.message_bytes = int(message_bytes)
        self.clock = VirtualClock()
        self.generator = torch.Generator().manual_seed(seed)
        self.nodes = [
            _Node(bool(self.active[i]), compute_time_s(p, samples=samples_per_step),
                  transfer_time_s(p.link, self.message_bytes))
            for i, p in enumerate(profiles)
        ]
        self.members = self.nodes
        self.total_steps = 0
        self.averagings = 0
        self._averagings_seen = 0
        self.availability, self.on_step, self.on_average = availability, on_step, on_average
        self._started = [0.0] * topology.n  # each node's current iteration's start
        for i in range(topology.n):
            self._start(i, 0.0)

    # -- events ---------------------------------------------------------------------------
    def _start(self, i: int, t: float) -> None:
        if not self._session(i, t):  # off: silent until it comes on
            return
        node = self.nodes[i]
        self._started[i] = t
        snapshot = self.state.x[i].clone()
        node.grad, node.loss = self.gradient(i, snapshot, node.steps + 1)
        node.grad_done = False
        self.clock.schedule(t + node.compute_s, ("grad", i))
        if node.active:
            j = self._peer(i, t)
            if j is None:  # no passive neighbour on: a step alone
                return
            node.averaging = True
            node.bytes_sent += self.message_bytes
            self.clock.schedule(t + node.send_s, ("arrive", i, j))

    def _peer(self, i: int, t: float) -> int | None:
        """Active node ``i``'s peer: uniformly random among its passive neighbours (that are on)."""
        if self.availability is None:
            return self.algo.choose_peer(i, self.topology, self.active, self.generator)
        peers = [j for j in self.topology.neighbors(i, 0) if not bool(self.active[j])
                 and self.availability.available(j, t)]
        return peers[int(torch.randint(len(peers), (1,), generator=self.generator))] if peers else None

    def _dispatch(self, t: float, event: tuple) -> None:
        kind = event[0]
        if kind == "wake":
            self._start(event[1], t)
        elif kind == "grad":
            i = event[1]
            end = self._locked_until(i, t)
            if end is not None:  # x_i is locked by an exchange: apply when it is released
                self.clock.schedule(end, event)
                return
            self.nodes[i].grad_done = True
            self._maybe_finish(i, t)
        elif kind == "arrive":
            i, j = event[1], event[2]
            peer = self.nodes[j]
            start = max(t, peer.free_at)
            end = start + peer.send_s
            if self.availability is not None and not self._can_exchange(i, j, start, end):
                self.nodes[i].averaging = False  # refused: i's step alone
                self._maybe_finish(i, t)
                return
            peer.free_at = end
            peer.locks.append((start, end))
            peer.bytes_sent += self.message_bytes
            self.clock.schedule(end, ("average", i, j))
        elif kind == "average":
            i, j = event[1], event[2]
            self.algo.average_pairs(self.state, [(i, j)])  # both endpoints, one event
            self.averagings += 1
            if self.on_average is not None:
                self.on_average(i, j, t - self.nodes[j].send_s, t)
            self.nodes[i].averaging = False
            self._maybe_finish(i, t)
        else:  # pragma: no cover
            raise ValueError(f"unknown event {event!r}")

    def _locked_until(self, i: int, t: float) -> float | None:
        node = self.nodes[i]
        node.locks = [(s, e) for s, e in node.locks if e > t]
        for s, e in node.locks:
            if s <= t:
                return e
        return None

    def _can_exchange(self, i: int, j: int, start: float, end: float) -> bool:
        """Whether passive ``j`` serves ``i``'s request from ``start`` to ``end``: both on throughout."""
        j_end = self.availability.session_end(j, start)
        return j_end is not None and end <= j_end and end <= self.nodes[i].session_end

    def _maybe_finish(self, i: int, t: float) -> None:
        node = self.nodes[i]
        if not node.grad_done or node.averaging:
            return
        if self._lost(i, t):  # it went off (or dropped) mid-iteration: the step is lost
            node.grad = None
            self._start(i, t)
            return
        if self.on_step is not None:
            self.on_step(i, self._started[i], t)
        one = GossipState(x=self.state.x[i : i + 1])
        self.algo.local_step(one, node.grad[None], self.lr)
        self.algo.node_mix(one, 0, {}, {0: 1.0})  # the averaging was its own event: apply the step alone
        self.state.x[i] = one.x[0]
        node.steps += 1
        node.stats["steps"] += 1
        node.stats["loss"] += node.loss
        self.total_steps += 1
        self._start(i, t)


# --------------------------------------------------------------------------- run

#: The virtual clock's runners, which a strategy's registry entry names (its ``clock``): name ->
#: (run function, check function). ``gossip``: AD-PSGD's pairwise gossip here; ``groups``:
#: Prague's group averaging (:mod:`fedswarm.sim.async_groups`); ``leaders``: LSGD's asynchronous
#: mode (:mod:`fedswarm.sim.async_leaders`). Filled in below, once ``run_adpsgd`` is defined.
CLOCK_RUNNERS: dict[str, tuple[Callable, Callable]] = {}


def _clock_runner(cfg: RunConfig, part: int) -> Callable:
    entry = registry.get(cfg.strategy)
    if entry.clock is None:
        served = [e for e in registry.entries(registered=True) if e.clock is not None]
        names = [e.name for e in served if e.kind == "async"] + [e.name for e in served if e.kind != "async"]
        modes = ", ".join(e.name for e in served if e.kind != "async")
        raise ConfigError(f"invalid value for 'engine': the virtual clock runs {', '.join(names[:-1])} and "
                          f"{names[-1]}" + (f" ({modes}: --set mode=async)" if modes else "")
                          + f", not '{cfg.strategy}'")
    return CLOCK_RUNNERS[entry.clock][part]


def run_async(cfg: RunConfig, *, store: Store, run_id: str, listeners: list[RoundListener] | None = None) -> str:
    """Run ``cfg`` on the virtual clock with its strategy's runner (:data:`CLOCK_RUNNERS`),
    recording ``cfg.rounds`` rounds of ``cfg.clients`` local steps each into ``store``; return the
    final status."""
    return _clock_runner(cfg, 0)(cfg, store=store, run_id=run_id, listeners=listeners)


def run_adpsgd(cfg: RunConfig, *, store: Store, run_id: str, listeners: list[RoundListener] | None = None) -> str:
    """Run ``cfg`` (AD-PSGD's pairwise gossip) on the virtual clock; return the final status."""
    params = registry.resolve_params(cfg.strategy, cfg.params)
    check_clocked(cfg.strategy, params)

    def make(x: torch.Tensor, profiles: list[Profile], gradient: Callable, steps: int) -> ADPSGDSimulation:
        return ADPSGDSimulation(x, make_topology(cfg.topology, cfg.clients, cfg.seed), profiles, gradient,
                                lr=cfg.lr, samples_per_step=steps * cfg.batch_size,
                                message_bytes=model_message_nbytes(cfg), weight_decay=params["weight_decay"],
                                seed=cfg.seed, availability=clock_availability(cfg, profiles))

    return run_clocked(cfg, store, run_id, listeners, make)


def check_config(cfg: RunConfig) -> None:
    """Raise :class:`~fedswarm.errors.ConfigError` (one line) unless the virtual clock can run
    ``cfg``: a strategy with a clock runner (its registry entry's ``clock``), checked by it."""
    _clock_runner(cfg, 1)(cfg)


CLOCK_RUNNERS.update({
    "gossip": (run_adpsgd, check_gossip),
    "groups": (run_prague, check_prague),
    "leaders": (run_lsgd_async, check_lsgd),
})
