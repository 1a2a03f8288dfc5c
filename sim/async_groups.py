"""Prague on the virtual clock: Partial All-Reduce among groups of ready workers.

Prague (Luo et al., ASPLOS 2020; ``docs/algorithms.md`` §5), as simulated here. Each
worker loops "local SGD step, then a Partial All-Reduce (P-Reduce) with the group the
group generator (GG) gives it". Compute times and transfer times come from the time model
(``fedswarm/timemodel.py``), as in :mod:`fedswarm.sim.async_engine`.

Group generator (a reconstruction; the paper's heterogeneity policy is unknown, §5 [?]):
a worker that finishes its local step joins the GG's queue of ready workers; as soon as
``group_size`` workers are queued, the earliest ``group_size`` form a group. So a fast
worker waits only for other *ready* workers, never for one still computing, and a slow
worker is averaged with whoever is ready when it finishes. The P-Reduce is a ring
all-reduce within the group over the slowest member link, ``2(g−1)`` hops of
``4d/g`` bytes; at its end every member holds the group average (one event) and starts
its next step. ``group_size = n`` is synchronous all-reduce SGD (every step waits for
the slowest worker), the baseline Prague is compared against.

Rounds are recorded as in the AD-PSGD engine: one round every ``n`` local steps, with
``sim_time_s``, ``consensus_distance`` and the bytes each worker sent.

Availability (``--availability``, :mod:`fedswarm.availability`, on this clock's simulated
seconds): a worker that is off neither computes nor joins a group, and starts its next step when it
comes on. A step that outlasts its worker's session, or that its class's ``dropout`` cuts (drawn per
worker and step), is lost: nothing is applied and it does not join the queue (``lost_steps``). The
group all-reduce is among workers that are on: a queued worker whose session ends leaves the queue
(it starts again when it comes on), and a group needs ``min(group_size, workers on now)`` ready
workers, so the workers that are on are never held by ones that are off (one worker on alone goes
on with its next step, no reduce). A member whose session would end before the group's reduce does
refuses it: it leaves the queue and starts its next step at once, with no averaging, and the group
is formed from the others.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from fedswarm.availability import Availability
from fedswarm.config import RunConfig
from fedswarm.server.recorder import RoundListener
from fedswarm.sim.async_clock import ClockedNodes, check_clocked, check_gossip, clock_availability, run_clocked
from fedswarm.sim.simtime import model_message_nbytes
from fedswarm.store import Store
from fedswarm.strategies import registry
from fedswarm.algorithms.decentralized import GossipState, Prague
from fedswarm.timemodel import Profile, VirtualClock, compute_time_s, transfer_time_s

__all__ = ["PragueSimulation", "run_prague"]

#: gradient(node, x [d], k) -> (gradient [d], loss), k = the node's 1-based step number.
GradientFn = Callable[[int, torch.Tensor, int], tuple[torch.Tensor, float]]


@dataclass
class _Worker:
    compute_s: float
    profile: Profile
    steps: int = 0
    grad: torch.Tensor | None = None
    loss: float = 0.0
    bytes_sent: int = 0
    waited_s: float = 0.0
    stats: dict[str, float] = field(default_factory=lambda: {"steps": 0, "loss": 0.0})
    started: float = 0.0  # its current step's start
    session_end: float = math.inf  # --availability: the end of the session its step started in
    attempts: int = 0  # --availability: steps started (the dropout draw's index)


class PragueSimulation(ClockedNodes):
    """The event loop. ``x0 [n, d]`` starting models; ``profiles[i]`` worker ``i``'s device
    and link; ``gradient`` computes a worker's (pseudo-)gradient; ``samples_per_step`` sets
    one step's compute time; ``message_bytes`` is one full model's size. ``availability``: when each
    worker (by partition id) is on (the module's docstring); ``on_step(i, start, end)`` hears every step
    applied, ``on_reduce(group, start, end)`` every group all-reduce (both: checks, traces)."""

    def __init__(self, x0: torch.Tensor, profiles: list[Profile], gradient: GradientFn, *, lr: float,
                 samples_per_step: float, message_bytes: int, group_size: int = 4, weight_decay: float = 0.0,
                 availability: Availability | None = None,
                 on_step: Callable[[int, float, float], None] | None = None,
                 on_reduce: Callable[[tuple[int, ...], float, float], None] | None = None):
        n = x0.shape[0]
        if len(profiles) != n:
            raise ValueError(f"need one profile per worker ({n} workers, {len(profiles)} profiles)")
        self.group_size = min(int(group_size), n)
        if self.group_size < 2:
            raise ValueError("Prague needs at least 2 workers")
        self.algo = Prague(group_size=self.group_size, weight_decay=weight_decay)
        self.state = self.algo.init_state(x0)
        self.gradient = gradient
        self.lr = float(lr)
        self.message_bytes = int(message_bytes)
        self.clock = VirtualClock()
        self.workers = [_Worker(compute_time_s(p, samples=samples_per_step), p) for p in profiles]
        self.members = self.workers
        self.queue: list[tuple[int, float]] = []  # (worker, time it became ready)
        self.total_steps = 0
        self.averagings = 0
        self._averagings_seen = 0
        self.groups: list[tuple[int, ...]] = []  # every group formed, in order (for tests)
        self.availability, self.on_step, self.on_reduce = availability, on_step, on_reduce
        for i in range(n):
            self._start(i, 0.0)

    def reduce_time_s(self, group: tuple[int, ...]) -> float:
        """Ring all-reduce within ``group``: ``2(g−1)`` hops of ``bytes/g`` over the
        slowest member link."""
        g = len(group)
        link = min((self.workers[j].profile.link for j in group), key=lambda ln: ln.bandwidth_mbps)
        return 2 * (g - 1) * transfer_time_s(link, self.message_bytes / g)

    # -- events ---------------------------------------------------------------------------
    def _start(self, i: int, t: float) -> None:
        w = self.workers[i]
        end = w.session_end
        if not self._session(i, t):  # off: silent until it comes on
            return
        if w.session_end != end and math.isfinite(w.session_end):  # a new session: its end is an event
            self.clock.schedule(w.session_end, ("off", i))
        w.started = t
        w.grad, w.loss = self.gradient(i, self.state.x[i].clone(), w.steps + 1)
        self.clock.schedule(t + w.compute_s, ("grad", i))

    def _dispatch(self, t: float, event: tuple) -> None:
        kind = event[0]
        if kind == "grad":
            i = event[1]
            w = self.workers[i]
            if self._lost(i, t):  # it went off (or dropped) mid-step: nothing applied
                w.grad = None
                self._start(i, t)
                return
            if self.on_step is not None:
                self.on_step(i, w.started, t)
            one = GossipState(x=self.state.x[i : i + 1])
            self.algo.local_step(one, w.grad[None], self.lr)
            self.state.x[i] = one.x[0]
            w.steps += 1
            w.stats["steps"] += 1
            w.stats["loss"] += w.loss
            self.total_steps += 1
            self.queue.append((i, t))
            self._form_groups(t)
        elif kind == "reduce":
            group = event[1]
            self.algo.group_average(self.state, group)
            self.averagings += 1
            if self.on_reduce is not None:
                self.on_reduce(group, t - self.reduce_time_s(group), t)
            for j in group:
                self._start(j, t)
        elif kind == "wake":
            self._start(event[1], t)
        elif kind == "off":  # --availability: a session ended; a worker waiting in the queue leaves it
            i = event[1]
            if any(j == i for j, _ in self.queue):
                self.queue = [(j, since) for j, since in self.queue if j != i]
                self._start(i, t)  # (off now: it starts again when it comes on)
            self._form_groups(t)  # fewer workers on: the ready ones may be enough now
        else:  # pragma: no cover
            raise ValueError(f"unknown event {event!r}")

    def _needed(self, t: float) -> int:
        """How many ready workers a group needs at ``t``: ``group_size``, or (``--availability``) at
        most the workers that are on."""
        if self.availability is None:
            return self.group_size
        on = sum(self.availability.available(j, t) for j in range(len(self.workers)))
        return max(1, min(self.group_size, on))

    def _form_groups(self, t: float) -> None:
        """The group generator: the earliest ready workers form a group as soon as there are enough."""
        while self.queue and len(self.queue) >= (need := self._needed(t)):
            members, self.queue = self.queue[:need], self.queue[need:]
            group = tuple(j for j, _ in members)
            if self.availability is not None:
                end = t + self.reduce_time_s(group)
                refused = [m for m in members if self.workers[m[0]].session_end < end]
                if refused:  # they would go off mid-reduce: each goes on alone, the others wait on
                    self.queue = [m for m in members if m not in refused] + self.queue
                    for j, _ in refused:
                        self._start(j, t)
                    continue
                if len(group) == 1:  # the only worker on: its next step, no reduce
                    self._start(group[0], t)
                    continue
            for j, since in members:
                self.workers[j].waited_s += t - since
                self.workers[j].bytes_sent += int(round(2 * (len(group) - 1) / len(group) * self.message_bytes))
            self.groups.append(group)
            self.clock.schedule(t + self.reduce_time_s(group), ("reduce", group))


def check_config(cfg: RunConfig) -> None:
    """Prague on the virtual clock: timed by the clock, valid parameters (its groups are drawn
    each averaging: no gossip topology to check)."""
    check_gossip(cfg, topology=False)


def run_prague(cfg: RunConfig, *, store: Store, run_id: str, listeners: list[RoundListener] | None = None) -> str:
    """Run ``cfg`` (strategy ``prague``) on the virtual clock, recording ``cfg.rounds``
    rounds of ``cfg.clients`` local steps each into ``store``; return the final status."""
    params = registry.resolve_params(cfg.strategy, cfg.params)
    check_clocked(cfg.strategy, params)

    def make(x: torch.Tensor, profiles: list[Profile], gradient: Callable, steps: int) -> PragueSimulation:
        return PragueSimulation(x, profiles, gradient, lr=cfg.lr, samples_per_step=steps * cfg.batch_size,
                                message_bytes=model_message_nbytes(cfg), group_size=params["group_size"],
                                weight_decay=params["weight_decay"], availability=clock_availability(cfg, profiles))

    return run_clocked(cfg, store, run_id, listeners, make)
