"""LSGD's asynchronous mode on the virtual clock: leader servers, no barrier, real stragglers.

LSGD (Teng et al., NeurIPS 2019; ``docs/algorithms.md`` §9), ``mode="async"``, as simulated
here. Compute and transfer times come from the time model (``fedswarm/timemodel.py``), as
in :mod:`fedswarm.sim.async_engine`. Each worker ``i`` loops with no barrier:

- compute its gradient at its model (``t + compute_i``) and take the local step
  (``LSGD.local_step`` on its one-node state, with its minibatch loss);
- if a pull is due after its ``k``-th step (``LSGD.due(k, i)``: the same staggered
  schedule as the array engine's and the swarm's async LSGD, counted in the worker's own
  steps), it reports its loss estimate and model to its group's leader server, then (if
  due) the global one: the report arrives after its uplink transfer, the server applies
  :func:`~fedswarm.algorithms.decentralized.leader_server_update` *at that instant*
  (whatever other workers reported before, so the leader a worker pulls towards may be a
  stale copy of a worker that has moved on), and the leader copy comes back after the
  downlink transfer; the worker pulls ``x_i ← (1 − c) x_i + c x̃`` (``LSGD.node_pull``)
  and ends its step (``LSGD.end_node_step``), then starts the next one.

Servers sit off the workers' links (a worker's link is the bottleneck both ways). Fast
workers take more steps and report more often; a straggler reports stale models rarely.
The math is the one LSGD object; this module only times it.

Rounds as in the other virtual-clock engines: one recorded round every ``n`` local steps,
with ``sim_time_s``, ``consensus_distance`` and the bytes each worker's exchanges moved
(its reports, model + 12 bytes of loss, and the leader copies it received, 4d each).
``averagings`` counts server exchanges.

Availability (``--availability``, :mod:`fedswarm.availability`, on this clock's simulated
seconds): a worker that is off neither computes nor reports, and starts its next step when it comes
on; the servers are always on. A step that outlasts its worker's session, or that its class's
``dropout`` cuts (drawn per worker and step), is lost: nothing is applied, no report goes out
(``lost_steps``). A worker reports only while it is on, so only a worker that is on can take a
server's lead; the leader copy a server holds stays when its worker goes off (it is the server's
copy of a model, the worker's loss at its report), and the others go on pulling towards it. An
exchange with a server that would outlast the worker's session (report up, copy down) is refused:
the worker ends its step without that pull and any later one (it did not report, so its loss
estimate runs on), then starts its next step if it is still on.

    fedswarm sim --engine clock --strategy lsgd --set mode=async --devices phone:2,laptop:2
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from fedswarm.algorithms.decentralized import GossipState, leader_server_update, make_algorithm
from fedswarm.algorithms.decentralized.leader import LSGD, contiguous_groups
from fedswarm.availability import Availability
from fedswarm.config import RunConfig
from fedswarm.server.recorder import RoundListener
from fedswarm.sim.async_clock import ClockedNodes, clock_availability, run_clocked
from fedswarm.sim.simtime import model_message_nbytes
from fedswarm.store import Store
from fedswarm.strategies import registry
from fedswarm.timemodel import Profile, VirtualClock, compute_time_s, transfer_time_s

__all__ = ["LSGDSimulation", "check_config", "run_lsgd_async"]

#: gradient(node, x [d], k) -> (gradient [d], loss), k = the node's 1-based step number.
GradientFn = Callable[[int, torch.Tensor, int], tuple[torch.Tensor, float]]

_REPORT = 12  # bytes of a loss report besides the model (float64 loss + int32 step)


@dataclass
class _Worker:
    compute_s: float
    send_s: float  # one model plus a report over this worker's link
    state: GossipState
    steps: int = 0
    grad: torch.Tensor | None = None
    loss: float = 0.0
    pending: list[tuple[str, float]] = field(default_factory=list)  # servers still to visit this step
    reported: bool = False  # this step reported to a server: the loss estimate starts afresh after it
    bytes_sent: int = 0
    stats: dict[str, float] = field(default_factory=lambda: {"steps": 0, "loss": 0.0})
    started: float = 0.0  # its current step's start
    session_end: float = math.inf  # --availability: the end of the session its step started in
    attempts: int = 0  # --availability: steps started (the dropout draw's index)


class LSGDSimulation(ClockedNodes):
    """The event loop. ``x0 [n, d]`` starting models; ``profiles[i]`` worker ``i``'s device
    and link; ``gradient`` its minibatch gradient and loss; ``algo`` an :class:`LSGD` in
    ``mode="async"``; ``message_bytes`` one model message's size. ``availability``: when each worker
    (by partition id) is on (the module's docstring); ``on_step(i, start, end)`` hears every step
    applied, ``on_exchange(i, server, start, end)`` every exchange with a server (both: checks, traces)."""

    def __init__(self, x0: torch.Tensor, profiles: list[Profile], gradient: GradientFn, algo: LSGD, *,
                 lr: float, samples_per_step: float, message_bytes: int, availability: Availability | None = None,
                 on_step: Callable[[int, float, float], None] | None = None,
                 on_exchange: Callable[[int, str, float, float], None] | None = None):
        n = x0.shape[0]
        if len(profiles) != n:
            raise ValueError(f"need one profile per worker ({n} workers, {len(profiles)} profiles)")
        if not isinstance(algo, LSGD) or algo.mode != "async":
            raise ValueError("the virtual clock runs LSGD's asynchronous mode (mode='async'); "
                             "'multi' and 'single' run on the array engine")
        self.algo, self.gradient, self.lr = algo, gradient, float(lr)
        self.message_bytes = int(message_bytes)
        self.clock = VirtualClock()
        self.workers = []
        for i, p in enumerate(profiles):
            st = algo.init_state(x0[i : i + 1])
            st.index0 = i
            self.workers.append(_Worker(compute_time_s(p, samples=samples_per_step),
                                        transfer_time_s(p.link, self.message_bytes + _REPORT), st))
        self.members = self.workers
        self.groups = contiguous_groups(n, algo.groups)
        # server -> [leader copy, its loss]; empty servers: the first report becomes the leader
        self.servers: dict[str, list] = {"global": [x0[0].clone(), float("inf")]}
        for g, members in enumerate(self.groups):
            self.servers[f"local{g}"] = [x0[members[0]].clone(), float("inf")]
        self.leaders: list[tuple[str, int]] = []  # (server, worker) each time a report took over
        self.total_steps = 0
        self.averagings = 0
        self._averagings_seen = 0
        self.availability, self.on_step, self.on_exchange = availability, on_step, on_exchange
        for i in range(n):
            self._start(i, 0.0)

    @property
    def x(self) -> torch.Tensor:
        return torch.cat([w.state.x for w in self.workers])

    def _server_of(self, i: int) -> str:
        return next(f"local{g}" for g, members in enumerate(self.groups) if i in members)

    # -- events ---------------------------------------------------------------------------
    def _start(self, i: int, t: float) -> None:
        if not self._session(i, t):  # off: silent until it comes on
            return
        w = self.workers[i]
        w.started = t
        w.grad, w.loss = self.gradient(i, w.state.x[0].clone(), w.steps + 1)
        self.clock.schedule(t + w.compute_s, ("grad", i))

    def _dispatch(self, t: float, event: tuple) -> None:
        kind, i = event[0], event[1]
        w = self.workers[i]
        if kind == "wake":
            self._start(i, t)
        elif kind == "grad":
            if self._lost(i, t):  # it went off (or dropped) mid-step: nothing applied, nothing reported
                w.grad = None
                self._start(i, t)
                return
            if self.on_step is not None:
                self.on_step(i, w.started, t)
            self.algo.local_step(w.state, w.grad[None], self.lr, losses=[w.loss])
            w.stats["steps"] += 1
            w.stats["loss"] += w.loss
            self.total_steps += 1
            local, glob = self.algo.due(w.state.step, i)
            w.pending = ([(self._server_of(i), self.algo.c1)] if local else []) + (
                [("global", self.algo.c2)] if glob else [])
            w.reported = False
            self._next_exchange(i, t)
        elif kind == "serve":  # the report reaches the server now
            server, report_x, report_f = event[2], event[3], event[4]
            lead = self.servers[server]
            lead[0], lead[1], took = leader_server_update(lead[0], lead[1], report_x, report_f)
            if took:
                self.leaders.append((server, i))
            self.clock.schedule(t + w.send_s, ("pull", i, lead[0].clone()))
        elif kind == "pull":  # the leader copy is back
            server, c = w.pending.pop(0)
            self.algo.node_pull(w.state, event[2], c)
            self.averagings += 1
            if self.on_exchange is not None:
                self.on_exchange(i, server, t - 2 * w.send_s, t)
            self._next_exchange(i, t)
        else:  # pragma: no cover
            raise ValueError(f"unknown event {event!r}")

    def _next_exchange(self, i: int, t: float) -> None:
        w = self.workers[i]
        if w.pending and self.availability is not None and t + 2 * w.send_s > w.session_end:
            w.pending = []  # the exchange would outlast its session: refused, the step ends without it
        if w.pending:
            server = w.pending[0][0]
            w.reported = True
            w.bytes_sent += 2 * self.message_bytes + _REPORT  # report up, leader copy down
            self.clock.schedule(t + w.send_s, ("serve", i, server, w.state.x[0].clone(),
                                               self.algo.loss_estimate(w.state)))
            return
        self.algo.end_node_step(w.state, w.reported)
        w.steps += 1
        self._start(i, t)


def _algorithm(cfg: RunConfig) -> LSGD:
    algo = make_algorithm(cfg.strategy, **registry.resolve_params(cfg.strategy, cfg.params))
    if not isinstance(algo, LSGD):
        raise ValueError(f"the virtual clock's leaders runner runs LSGD, not '{cfg.strategy}'")
    if algo.mode != "async":
        raise ValueError(f"the virtual clock runs LSGD's asynchronous mode (--set mode=async), not '{algo.mode}': "
                         f"'multi' and 'single' run on the array engine (--engine array)")
    return algo


def check_config(cfg: RunConfig) -> None:
    """Raise :class:`~fedswarm.errors.ConfigError` (one line) unless ``cfg`` is LSGD's
    asynchronous mode with valid parameters."""
    from fedswarm.errors import ConfigError

    try:
        algo = _algorithm(cfg)
        contiguous_groups(cfg.clients, algo.groups)
    except ValueError as exc:
        raise ConfigError(f"invalid value for 'params': {exc}") from None


def run_lsgd_async(cfg: RunConfig, *, store: Store, run_id: str, listeners: list[RoundListener] | None = None) -> str:
    """Run ``cfg`` (strategy ``lsgd``, ``mode=async``) on the virtual clock, recording
    ``cfg.rounds`` rounds of ``cfg.clients`` local steps each; return the final status."""
    algo = _algorithm(cfg)

    def make(x: torch.Tensor, profiles: list[Profile], gradient: Callable, steps: int) -> LSGDSimulation:
        return LSGDSimulation(x, profiles, gradient, algo, lr=cfg.lr, samples_per_step=steps * cfg.batch_size,
                              message_bytes=model_message_nbytes(cfg), availability=clock_availability(cfg, profiles))

    return run_clocked(cfg, store, run_id, listeners, make)
