"""What every virtual-clock simulation shares: the nodes' interface to the recording loop
(:class:`ClockedNodes`), the loop itself (:func:`run_clocked`: data, gradients, device profiles,
one recorded round every ``n`` local steps between the nodes), the peer-to-peer byte meter and
the nodes' own-model federated evaluation (:func:`own_models_eval`, the array engine's too).

The algorithms on the clock build on it: AD-PSGD (:mod:`fedswarm.sim.async_engine`, which also
picks the algorithm of a run), Prague (:mod:`fedswarm.sim.async_groups`) and LSGD
(:mod:`fedswarm.sim.async_leaders`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from flwr.app import ArrayRecord

from fedswarm.algorithms.decentralized import consensus_distance, make_algorithm
from fedswarm.algorithms.decentralized.topology import make_topology
from fedswarm.availability import Availability
from fedswarm.config import RunConfig
from fedswarm.errors import ConfigError
from fedswarm.local import round_seed
from fedswarm.params import get_flat
from fedswarm.server.fed_eval import NodeEval, cohort_on_partitions
from fedswarm.server.metered_grid import Traffic
from fedswarm.server.recorder import RoundListener, RoundRecorder, run_recorded
from fedswarm.sim.simtime import node_profiles
from fedswarm.store import Store
from fedswarm.strategies import registry
from fedswarm.strategies.decentralized.node import local_gradient
from fedswarm.tasks import get_task
from fedswarm.timemodel import BUILTIN_PROFILES, Profile
from fedswarm.train import evaluate_flat, node_validation, resolve_device, task_data, trainer_for
from fedswarm.wire import arrayrecord_to_vector, vector_to_arrayrecord

__all__ = ["ClockedNodes", "run_clocked", "check_clocked", "check_gossip", "clock_availability", "own_models_eval",
           "DEFAULT_PROFILE"]

#: Every node's profile when the run names no devices.
DEFAULT_PROFILE = "datacenter"


class ClockedNodes:
    """What every virtual-clock simulation exposes to the recorder loop. Subclasses hold
    ``clock``, ``state`` (a GossipState), ``averagings``, ``total_steps``, their per-node
    records in ``members`` (each with ``steps``, ``stats`` and ``bytes_sent``) and handle
    events in ``_dispatch(t, event)``."""

    members: list
    _averagings_seen: int = 0
    lost_steps: int = 0
    _lost_seen: int = 0
    availability: Availability | None = None  # --availability (None: every node always on)

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
            if not self.clock:  # (--availability: every node off for good)
                raise RuntimeError(f"t={self.now:.0f} s (simulated): no node is on again to take the round's steps "
                                   f"(availability trace ended?)")
            self._dispatch(*self.clock.pop())

    def advance_to(self, t: float) -> None:
        """Process every event up to simulated time ``t``."""
        while (nxt := self.clock.peek_time()) is not None and nxt <= t:
            self._dispatch(*self.clock.pop())

    def take_averagings(self) -> int:
        """Averaging events (pairwise averagings, group reduces) completed since the last call."""
        k, self._averagings_seen = self.averagings - self._averagings_seen, self.averagings
        return k

    def take_lost_steps(self) -> int:
        """Steps lost since the last call (``--availability``: nodes that went off or dropped mid-iteration)."""
        k, self._lost_seen = self.lost_steps - self._lost_seen, self.lost_steps
        return k

    # -- --availability: what every algorithm on the clock shares (its members carry ``session_end`` and
    #    ``attempts``; the algorithm's own rules, who averages with whom, are its own) --------------------
    def _session(self, i: int, t: float) -> bool:
        """Whether node ``i`` is on at ``t`` to start an iteration (then its session's end and the
        iteration's number are kept on its member for :meth:`_lost`); off, it is silent: a
        ``("wake", i)`` event at its next on (none: off for good), and False. Always True without
        ``--availability``."""
        if self.availability is None:
            return True
        m = self.members[i]
        end = self.availability.session_end(i, t)
        if end is None:
            nxt = self.availability.next_on(i, t)
            if nxt is not None:
                self.clock.schedule(nxt, ("wake", i))
            return False
        m.session_end, m.attempts = end, m.attempts + 1
        return True

    def _lost(self, i: int, t: float) -> bool:
        """Whether node ``i``'s iteration, done computing at ``t``, loses its step: it outlasted the
        session it started in, or its class's ``dropout`` cut it (drawn per node and iteration).
        Counted in ``lost_steps``."""
        if self.availability is None:
            return False
        m = self.members[i]
        if t > m.session_end or self.availability.drops(i, m.attempts):
            self.lost_steps += 1
            return True
        return False

    def take_stats(self) -> list[dict[str, float]]:
        """Per-node local steps, mean loss and bytes sent since the last call."""
        out = []
        for m in self.members:
            st = m.stats
            out.append({"steps": int(st["steps"]), "loss": st["loss"] / st["steps"] if st["steps"] else None,
                        "bytes_sent": m.bytes_sent})
            m.stats, m.bytes_sent = {"steps": 0, "loss": 0.0}, 0
        return out


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


def check_clocked(name: str, params: dict) -> None:
    """Refuse a fixed schedule: the virtual clock times the events itself."""
    if params.get("schedule", "clock") != "clock":
        raise ValueError(f"{name} with schedule='fixed' replays a seeded schedule: it runs on the array engine "
                         f"(--engine array), the router (--engine inprocess) or the swarm, not on the virtual clock")


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
        **({"lost_steps": sim.take_lost_steps()} if getattr(sim, "availability", None) is not None else {}),
        **fed,
    )
    recorder(rnd, vector_to_arrayrecord(sim.x.mean(dim=0)))


def clock_availability(cfg: RunConfig, profiles: list[Profile]) -> Availability | None:
    """``cfg``'s ``--availability`` over the clock's nodes (each node's class: its profile's name, as
    ``--devices`` names it), None without it."""
    if cfg.availability is None:
        return None
    from fedswarm.availability import availability_for

    return availability_for(cfg.availability, [p.name for p in profiles], cfg.seed)


def check_gossip(cfg: RunConfig, *, topology: bool = True) -> None:
    """The gossip runners' check: timed by the clock, valid parameters, and (``topology``) a
    topology the algorithm accepts (AD-PSGD: a bipartite graph)."""
    try:
        params = registry.resolve_params(cfg.strategy, cfg.params)
        check_clocked(cfg.strategy, params)
        algo = make_algorithm(cfg.strategy, **{k: v for k, v in params.items() if k != "report_every"})
        if topology:
            algo.check_topology(make_topology(cfg.topology, cfg.clients, cfg.seed))
    except ValueError as exc:
        raise ConfigError(f"invalid value for 'topology' or 'params': {exc}") from None
