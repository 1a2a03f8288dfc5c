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

Federated evaluation is counted in the same unit: every ``eval_every``-th recorded round,
every node scores its own model, as it stands at that instant of simulated time, on its
validation split (:func:`own_models_eval`, the array engine's too); with ``central_eval`` off
the task's test set is not loaded. With ``client_data`` node ``i`` trains on the train split of
the ``i``-th client's own dataset (:func:`~fedswarm.train.trainer_for`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from flwr.app import ArrayRecord

from fedswarm.config import RunConfig
from fedswarm.local import round_seed
from fedswarm.params import get_flat
from fedswarm.server.fed_eval import NodeEval, cohort_on_partitions
from fedswarm.server.metered_grid import Traffic
from fedswarm.server.recorder import RoundListener, RoundRecorder, run_recorded

from fedswarm.sim.simtime import model_message_nbytes, node_profiles
from fedswarm.timemodel import BUILTIN_PROFILES, Profile, VirtualClock, compute_time_s, transfer_time_s
from fedswarm.store import Store
from fedswarm.strategies import registry
from fedswarm.strategies.decentralized.node import local_gradient
from fedswarm.algorithms.decentralized import ADPSGD, GossipState, bipartite_split, consensus_distance
from fedswarm.algorithms.decentralized.topology import Topology, make_topology
from fedswarm.tasks import get_task
from fedswarm.train import evaluate_flat, node_validation, resolve_device, task_data, trainer_for
from fedswarm.wire import arrayrecord_to_vector, vector_to_arrayrecord

__all__ = ["ADPSGDSimulation", "run_async", "check_clocked", "check_config", "own_models_eval", "DEFAULT_PROFILE"]

#: Every node's profile when the run names no devices.
DEFAULT_PROFILE = "datacenter"

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


class ClockedNodes:
    """What every virtual-clock simulation exposes to the recorder loop. Subclasses hold
    ``clock``, ``state`` (a GossipState), ``averagings``, ``total_steps``, their per-node
    records in ``members`` (each with ``steps``, ``stats`` and ``bytes_sent``) and handle
    events in ``_dispatch(t, event)``."""

    members: list
    _averagings_seen: int = 0

    @property
    def now(self) -> float:
        return self.clock.now

    @property
    def x(self) -> torch.Tensor:
        """The node models ``[n, d]`` (a view: do not modify)."""
        return self.state.x

    def steps(self) -> list[int]:
        return [m.steps for m in self.members]

    def advance(self, steps: int) -> None:
        """Process events until the nodes have taken ``steps`` more local steps (between
        them: ``total_steps``, counted by the subclass's ``_dispatch``)."""
        target = self.total_steps + steps
        while self.total_steps < target:
            self._dispatch(*self.clock.pop())

    def advance_to(self, t: float) -> None:
        """Process every event up to simulated time ``t``."""
        while (nxt := self.clock.peek_time()) is not None and nxt <= t:
            self._dispatch(*self.clock.pop())

    def take_averagings(self) -> int:
        """Averaging events (pairwise averagings, group reduces) completed since the last call."""
        k, self._averagings_seen = self.averagings - self._averagings_seen, self.averagings
        return k

    def take_stats(self) -> list[dict[str, float]]:
        """Per-node local steps, mean loss and bytes sent since the last call."""
        out = []
        for m in self.members:
            st = m.stats
            out.append({"steps": int(st["steps"]), "loss": st["loss"] / st["steps"] if st["steps"] else None,
                        "bytes_sent": m.bytes_sent})
            m.stats, m.bytes_sent = {"steps": 0, "loss": 0.0}, 0
        return out


class ADPSGDSimulation(ClockedNodes):
    """The event loop. ``x0 [n, d]`` starting models; ``profiles[i]`` node ``i``'s device
    and link; ``gradient`` computes a node's (pseudo-)gradient; ``samples_per_step`` sets
    the compute time of one step; ``message_bytes`` is one model message's size."""

    def __init__(self, x0: torch.Tensor, topology: Topology, profiles: list[Profile], gradient: GradientFn, *,
                 lr: float, samples_per_step: float, message_bytes: int, weight_decay: float = 0.0, seed: int = 0):
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
        for i in range(topology.n):
            self._start(i, 0.0)

    # -- events ---------------------------------------------------------------------------
    def _start(self, i: int, t: float) -> None:
        node = self.nodes[i]
        snapshot = self.state.x[i].clone()
        node.grad, node.loss = self.gradient(i, snapshot, node.steps + 1)
        node.grad_done = False
        self.clock.schedule(t + node.compute_s, ("grad", i))
        if node.active:
            j = self.algo.choose_peer(i, self.topology, self.active, self.generator)
            node.averaging = True
            node.bytes_sent += self.message_bytes
            self.clock.schedule(t + node.send_s, ("arrive", i, j))

    def _dispatch(self, t: float, event: tuple) -> None:
        kind = event[0]
        if kind == "grad":
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
            peer.free_at = end
            peer.locks.append((start, end))
            peer.bytes_sent += self.message_bytes
            self.clock.schedule(end, ("average", i, j))
        elif kind == "average":
            i, j = event[1], event[2]
            self.algo.average_pairs(self.state, [(i, j)])  # both endpoints, one event
            self.averagings += 1
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

    def _maybe_finish(self, i: int, t: float) -> None:
        node = self.nodes[i]
        if not node.grad_done or node.averaging:
            return
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


class _P2PGrid:
    """What the recorder reads as a round's traffic: the peer-to-peer bytes."""

    def __init__(self):
        self.pending = Traffic()

    def take(self) -> Traffic:
        t, self.pending = self.pending, Traffic()
        return t


def own_models_eval(cfg: RunConfig, models: Callable[[], torch.Tensor]
                    ) -> Callable[[int, object, list[int]], dict[str, NodeEval]]:
    """Federated evaluation for engines whose nodes are the rows of ``models() [n, d]`` (array,
    virtual clock): node ``i`` (row and partition ``i - 1``) scores its own model on its
    validation split with its own trainer, as its ClientApp's evaluate handler does
    (:func:`fedswarm.client.evaluate.evaluate_on_node`); a ``fed_eval`` for
    :meth:`~fedswarm.server.recorder.RoundRecorder.federated`."""
    n = cfg.clients

    def fed_eval(rnd: int, _arrays: object, cohort: list[int]) -> dict[str, NodeEval]:
        x = models()

        def on_partition(pid: int) -> tuple[float, float, int]:
            val_x, val_y = node_validation(cfg, pid, n)
            return (*trainer_for(cfg, pid, n).evaluate(x[pid], val_x, val_y), int(val_x.shape[0]))

        return cohort_on_partitions(cohort, on_partition)

    return fed_eval


#: The virtual clock's runners, which a strategy's registry entry names (its ``clock``): name ->
#: (module of fedswarm.sim, run function, check function). ``gossip``: AD-PSGD's pairwise gossip
#: here; ``groups``: Prague's group averaging (:mod:`fedswarm.sim.async_groups`); ``leaders``:
#: LSGD's asynchronous mode (:mod:`fedswarm.sim.async_leaders`). Imported when a run needs them
#: (they import this module).
CLOCK_RUNNERS: dict[str, tuple[str, str, str]] = {
    "gossip": ("async_engine", "run_adpsgd", "check_gossip"),
    "groups": ("async_groups", "run_prague", "check_config"),
    "leaders": ("async_leaders", "run_lsgd_async", "check_config"),
}


def _clock_runner(cfg: RunConfig, part: int) -> Callable:
    import importlib

    from fedswarm.errors import ConfigError

    entry = registry.get(cfg.strategy)
    if entry.clock is None:
        served = [e for e in registry.entries(registered=True) if e.clock is not None]
        names = [e.name for e in served if e.kind == "async"] + [e.name for e in served if e.kind != "async"]
        modes = ", ".join(e.name for e in served if e.kind != "async")
        raise ConfigError(f"invalid value for 'engine': the virtual clock runs {', '.join(names[:-1])} and "
                          f"{names[-1]}" + (f" ({modes}: --set mode=async)" if modes else "")
                          + f", not '{cfg.strategy}'")
    spec = CLOCK_RUNNERS[entry.clock]
    return getattr(importlib.import_module(f"fedswarm.sim.{spec[0]}"), spec[part])


def run_async(cfg: RunConfig, *, store: Store, run_id: str, listeners: list[RoundListener] | None = None) -> str:
    """Run ``cfg`` on the virtual clock with its strategy's runner (:data:`CLOCK_RUNNERS`),
    recording ``cfg.rounds`` rounds of ``cfg.clients`` local steps each into ``store``; return the
    final status."""
    return _clock_runner(cfg, 1)(cfg, store=store, run_id=run_id, listeners=listeners)


def run_adpsgd(cfg: RunConfig, *, store: Store, run_id: str, listeners: list[RoundListener] | None = None) -> str:
    """Run ``cfg`` (AD-PSGD's pairwise gossip) on the virtual clock; return the final status."""
    params = registry.resolve_params(cfg.strategy, cfg.params)
    check_clocked(cfg.strategy, params)

    def make(x: torch.Tensor, profiles: list[Profile], gradient: Callable, steps: int) -> ADPSGDSimulation:
        return ADPSGDSimulation(x, make_topology(cfg.topology, cfg.clients, cfg.seed), profiles, gradient,
                                lr=cfg.lr, samples_per_step=steps * cfg.batch_size,
                                message_bytes=model_message_nbytes(cfg), weight_decay=params["weight_decay"],
                                seed=cfg.seed)

    return run_clocked(cfg, store, run_id, listeners, make)


def check_clocked(name: str, params: dict) -> None:
    """Refuse a fixed schedule: the virtual clock times the events itself."""
    if params.get("schedule", "clock") != "clock":
        raise ValueError(f"{name} with schedule='fixed' replays a seeded schedule: it runs on the array engine "
                         f"(--engine array), the router (--engine inprocess) or the swarm, not on the virtual clock")


def check_config(cfg: RunConfig) -> None:
    """Raise :class:`~fedswarm.errors.ConfigError` (one line) unless the virtual clock can run
    ``cfg``: a strategy with a clock runner (its registry entry's ``clock``), checked by it."""
    _clock_runner(cfg, 2)(cfg)


def check_gossip(cfg: RunConfig, *, topology: bool = True) -> None:
    """The gossip runners' check: timed by the clock, valid parameters, and (``topology``) a
    topology the algorithm accepts (AD-PSGD: a bipartite graph)."""
    from fedswarm.algorithms.decentralized import make_algorithm
    from fedswarm.errors import ConfigError

    try:
        params = registry.resolve_params(cfg.strategy, cfg.params)
        check_clocked(cfg.strategy, params)
        algo = make_algorithm(cfg.strategy, **{k: v for k, v in params.items() if k != "report_every"})
        if topology:
            algo.check_topology(make_topology(cfg.topology, cfg.clients, cfg.seed))
    except ValueError as exc:
        raise ConfigError(f"invalid value for 'topology' or 'params': {exc}") from None


def run_clocked(cfg: RunConfig, store: Store, run_id: str, listeners: list[RoundListener] | None,
                make_sim: Callable[[torch.Tensor, list[Profile], Callable, int], ClockedNodes]) -> str:
    """The recording loop every virtual-clock algorithm shares: build the nodes' data,
    gradients and profiles, let ``make_sim(x0 [n, d], profiles, gradient, steps)`` build the
    simulation, then record ``cfg.rounds`` rounds of ``cfg.clients`` local steps each
    (controls obeyed between rounds); return the final status."""
    torch.manual_seed(cfg.seed)
    n = cfg.clients
    task = get_task(cfg.task)
    device = resolve_device(cfg.device)
    model = task.model(cfg.seed).to(device)
    x0 = get_flat(model).cpu()
    profiles = node_profiles(cfg) or [BUILTIN_PROFILES[DEFAULT_PROFILE]] * n
    steps = cfg.local_steps or 1

    def gradient(i: int, x: torch.Tensor, k: int) -> tuple[torch.Tensor, float]:
        return local_gradient(trainer_for(cfg, i, n), x, steps=steps, batch_size=cfg.batch_size, lr=cfg.lr,
                              seed=round_seed(cfg.seed, k, i))

    evaluate = None
    if cfg.central_eval:  # off: no server test set, the task's data is not loaded
        data = task_data(cfg)

        def evaluate(arrays: ArrayRecord) -> tuple[float, float]:
            return evaluate_flat(task, model, arrayrecord_to_vector(arrays), data.test_x, data.test_y, device)

    grid = _P2PGrid()
    recorder = RoundRecorder(store, run_id, grid, evaluate, listeners=listeners)  # type: ignore[arg-type]
    recorder.eval_every = cfg.eval_every

    def loop() -> None:
        sim = make_sim(x0.repeat(n, 1), profiles, gradient, steps)
        fed_eval = own_models_eval(cfg, lambda: sim.x)
        recorder(0, vector_to_arrayrecord(x0))
        rnd, total, last_t = 0, cfg.rounds, 0.0
        while rnd < total:
            rnd += 1
            recorder.reset_clock()
            sim.advance(n)
            _record(recorder, rnd, sim, profiles, grid, last_t, samples=steps * cfg.batch_size,
                    fed_eval=fed_eval if recorder.eval_due(rnd) else None)
            last_t = sim.now
            total, recorder.extra_rounds = total + recorder.extra_rounds, 0

    return run_recorded(store, run_id, loop)


def _record(recorder: RoundRecorder, rnd: int, sim: ClockedNodes,
            profiles: list[Profile], grid: _P2PGrid, last_t: float, samples: int,
            fed_eval: Callable[[int, object, list[int]], dict[str, NodeEval]] | None = None) -> None:
    """Round ``rnd``'s rows; ``fed_eval``: the round's federated evaluation by every node."""
    stats = sim.take_stats()
    sent = sum(s["bytes_sent"] for s in stats)
    grid.pending = Traffic(bytes_up=sent, bytes_down=sent)  # every byte sent is received once
    losses = [(s["loss"], s["steps"]) for s in stats if s["loss"] is not None]
    n_steps = sum(k for _, k in losses)
    # node ids as on the in-process engine: partition id + 1
    rows = [{"node_id": str(i + 1), "bytes_up": s["bytes_sent"], "num_examples": s["steps"] * samples,
             "train_loss": s["loss"], "device_class": profiles[i].name} for i, s in enumerate(stats)]
    fed = recorder.federated(rnd, None, list(range(1, len(rows) + 1)), rows, fed_eval) if fed_eval else {}
    recorder.node_rows(rows)
    recorder.note(
        train_loss=sum(loss * k for loss, k in losses) / n_steps if n_steps else None,
        sim_time_s=sim.now - last_t,
        sim_clock_s=sim.now,
        consensus_distance=consensus_distance(sim.x),
        p2p_bytes=sent,
        num_clients=len(stats),
        averagings=sim.take_averagings(),
        **fed,
    )
    recorder(rnd, vector_to_arrayrecord(sim.x.mean(dim=0)))
