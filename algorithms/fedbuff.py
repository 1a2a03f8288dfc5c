"""FedBuff's math, once for every runtime (Nguyen et al., AISTATS 2022): no Flower, no sockets.

The server keeps up to ``concurrency`` nodes training. Each arriving update is the node's model
minus the model it was sent (``delta``), ``staleness`` = the server's model version now minus the
version it was sent. Updates older than ``max_staleness`` are refused; the others are weighted by
``w(staleness)`` and buffered; every ``K`` buffered updates fold into the model::

    x <- x + server_lr * (1 / K) * sum_i w(tau_i) * delta_i

(the paper's Algorithm 1 with its sign convention turned: ``delta`` is the client's step, not its
negative). :func:`staleness_weight` parses the weighting (``poly:0.5`` = ``1/sqrt(1 + tau)``, the
default; ``const``; ``hinge:a,b`` = 1 up to ``b``, then ``1/(a (tau - b) + 1)``).

:class:`AsyncSchedule` is the event order every simulated runtime shares: which idle node is
dispatched next (a seeded draw) and which in-flight update arrives next (earliest simulated
finish time, ties by dispatch order), so the in-process and batched engines see the same
arrivals for the same seed and fleet.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from fedswarm.errors import ConfigError

__all__ = ["staleness_weight", "FedBuffer", "Stale", "AsyncSchedule", "InFlight", "staleness_stats"]


def staleness_weight(spec: str) -> Callable[[int], float]:
    """``w(tau)`` from its spec: ``poly:p`` (``(1 + tau)^-p``), ``const`` or ``hinge:a,b``;
    ConfigError naming what is wrong otherwise."""
    text = str(spec).strip().lower()
    name, _, arg = text.partition(":")
    try:
        if name == "const" and not arg:
            return lambda tau: 1.0
        if name == "poly":
            p = float(arg)
            if not p >= 0 or math.isinf(p):
                raise ValueError("the exponent must be a finite number >= 0")
            return lambda tau: (1.0 + tau) ** -p
        if name == "hinge":
            a_s, b_s = arg.split(",")
            a, b = float(a_s), float(b_s)
            if not (a >= 0 and b >= 0) or math.isinf(a) or math.isinf(b):
                raise ValueError("a and b must be finite numbers >= 0")
            return lambda tau: 1.0 if tau <= b else 1.0 / (a * (tau - b) + 1.0)
    except ValueError as exc:
        raise ConfigError(f"staleness_weight '{spec}': {exc}") from None
    raise ConfigError(f"staleness_weight '{spec}' is not one of 'poly:P' (e.g. poly:0.5, the default), "
                      f"'const', 'hinge:A,B'")


class Stale(Exception):
    """An update older than ``max_staleness``: refused, the reason says how old."""


@dataclass
class FedBuffer:
    """The server's buffer of weighted updates.

    ``add(delta, staleness)`` weights and keeps one update (raises :class:`Stale` past
    ``max_staleness``); ``ready`` once ``k`` are in; ``fold(x)`` returns the new model and
    empties the buffer. ``privatize``, when given (DP-FedAvg's
    :meth:`~fedswarm.algorithms.privacy.dp_fedavg.ClientLevelDP.privatize`), replaces the plain
    mean by the noised mean of the clipped weighted updates."""

    k: int
    weight: Callable[[int], float]
    max_staleness: int | None = None
    server_lr: float = 1.0
    deltas: list[torch.Tensor] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ConfigError(f"buffer_size must be >= 1 (got {self.k})")

    def add(self, delta: torch.Tensor, staleness: int) -> float:
        if staleness < 0:
            raise ValueError(f"staleness {staleness} < 0: an update from a model version not yet made")
        if self.max_staleness is not None and staleness > self.max_staleness:
            raise Stale(f"stale: {staleness} versions old > max_staleness {self.max_staleness}")
        w = float(self.weight(staleness))
        self.deltas.append(delta.detach().to(torch.float32).reshape(-1))
        self.weights.append(w)
        self.staleness.append(int(staleness))
        return w

    @property
    def ready(self) -> bool:
        return len(self.deltas) >= self.k

    def fold(self, x: torch.Tensor, privatize: Callable[[torch.Tensor], tuple[torch.Tensor, dict]] | None = None
             ) -> tuple[torch.Tensor, dict]:
        """``(x + server_lr * mean_i(w_i delta_i), metrics)``; the mean is over the buffer's
        updates (``k`` of them when ``ready``). Metrics: ``updates`` and the staleness
        ``staleness_min/mean/max`` (plus the DP mechanism's, with ``privatize``)."""
        if not self.deltas:
            raise ValueError("FedBuffer.fold: the buffer is empty")
        stacked = torch.stack(self.deltas).to(torch.float64)
        weighted = torch.tensor(self.weights, dtype=torch.float64)[:, None] * stacked
        metrics: dict = {"updates": len(self.deltas), **staleness_stats(self.staleness)}
        if privatize is not None:
            step, dp_metrics = privatize(weighted.to(torch.float32))
            step = step.to(torch.float64)
            metrics.update(dp_metrics)
        else:
            step = weighted.sum(0) / len(self.deltas)
        new = (x.to(torch.float64) + self.server_lr * step).to(torch.float32)
        self.deltas, self.weights, self.staleness = [], [], []
        return new, metrics


def staleness_stats(staleness: Sequence[int]) -> dict[str, float]:
    if not staleness:
        return {}
    return {"staleness_min": float(min(staleness)), "staleness_mean": float(sum(staleness)) / len(staleness),
            "staleness_max": float(max(staleness))}


@dataclass(frozen=True, order=True)
class InFlight:
    """One dispatched node: its simulated finish time, dispatch number, node and model version."""

    finish: float
    seq: int
    node: int = field(compare=False)
    version: int = field(compare=False)
    start: float = field(compare=False, default=0.0)
    #: its update never arrives (the node dropped or went off mid-training): the slot frees at ``finish``,
    #: the dispatch plus the round timeout, when the server gives up on it
    lost: bool = field(compare=False, default=False)


class AsyncSchedule:
    """Which node trains next and which update arrives next, on a virtual clock.

    ``nodes``: the node ids; ``duration(node)``: its simulated seconds from dispatch to arrival
    (download, compute, upload). ``dispatch(version)`` fills the free slots up to
    ``concurrency`` with idle nodes drawn by a ``seed``-ed generator (in sorted-id order, so the
    draw depends on the ids only) and returns them; ``arrive()`` pops the earliest finish and
    moves the clock (``now``) to it. Without a time model every node takes the same time, so
    arrivals are first dispatched, first arrived.

    ``availability`` (a :class:`fedswarm.availability.Availability`, indexed by ``node - 1``, the
    fleet grid's): only nodes that are on are dispatched (when none is and nothing is in flight, the
    clock jumps to the first that comes on; free slots are filled at the next event); a dispatch that
    :meth:`~fedswarm.availability.Availability.lost` says loses its update (its node drops, drawn per
    dispatch number, or its session ends before it finishes) is ``lost``: it arrives at dispatch +
    ``timeout`` with no update."""

    def __init__(self, nodes: Sequence[int], concurrency: int, duration: Callable[[int], float] | None = None,
                 seed: int = 0, availability=None, timeout: float = 600.0):
        if concurrency < 1:
            raise ConfigError(f"concurrency must be >= 1 (got {concurrency})")
        self.idle = sorted(int(n) for n in nodes)
        if not self.idle:
            raise ConfigError("FedBuff needs at least one node")
        self.concurrency = concurrency
        self.duration = duration if duration is not None else (lambda node: 1.0)
        self.rng = random.Random(seed)
        self.now = 0.0
        self.flying: list[InFlight] = []
        self._seq = 0
        self.availability, self.timeout = availability, float(timeout)

    @property
    def in_flight(self) -> int:
        return len(self.flying)

    def dispatch(self, version: int, eligible: Callable[[int], bool] | None = None) -> list[InFlight]:
        """Fill the free slots (see the class); ``eligible(node)``: only such idle nodes are drawn."""
        av = self.availability
        idle = self.idle if eligible is None else [n for n in self.idle if eligible(n)]
        if av is not None and not self.flying and idle:
            on = av.first_on([n - 1 for n in idle], self.now)  # every idle node is off: wait
            if on is None:
                raise RuntimeError("FedBuff: no node comes on again within a year of simulated time")
            self.now = on
        out = []
        while len(self.flying) < self.concurrency and idle:
            pool = idle if av is None else [n for n in idle if av.available(n - 1, self.now)]
            if not pool:
                break
            node = pool[self.rng.randrange(len(pool))]
            self.idle.remove(node)
            if idle is not self.idle:
                idle.remove(node)
            finish = self.now + float(self.duration(node))
            lost = av is not None and av.lost(node - 1, self._seq, self.now, finish) is not None
            job = InFlight(self.now + self.timeout if lost else finish, self._seq, node, version, self.now, lost)
            self._seq += 1
            heapq.heappush(self.flying, job)
            out.append(job)
        return out

    def arrive(self) -> InFlight:
        """The next arrival (its node becomes idle again); IndexError when nothing is in flight."""
        job = heapq.heappop(self.flying)
        self.now = max(self.now, job.finish)
        self.idle.append(job.node)
        self.idle.sort()
        return job
