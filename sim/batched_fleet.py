"""Quorum rounds, over-selection, eligibility and availability on the batched engine.

The batched engine's rounds with ``--quorum``, ``--over-select``, ``--eligible`` or ``--availability``:
FedAvg's (``weighted_mean``), every ``codec`` strategy's (compressed_fedavg with every codec, onebit,
the robust rules, signum; ``--byzantine`` too), gtopk's, the Count-Sketch strategies' (FetchSGD,
Sketched-SGD, gs-SGD), PVT's and ProgFed's (:func:`check_batched_fleet` refuses the rest in one line,
saying why):
:class:`BatchedFleet` does what the in-process engine's
:class:`~fedswarm.server.fleet_grid.FleetGrid` does, on the same seed to the same result, as
arrays over the population and the cohort:

- **Sampling.** A node is offered when it is *available* at the round's simulated start (its
  on/off process or trace, :mod:`fedswarm.availability`, the same windows: they are drawn per
  partition from the seed) and *eligible*. Under simulation every node's telemetry is this
  machine's (the in-process engine's nodes run in this process, and the probe and the train
  replies read its battery, power supply, temperature and memory, ``FEDSWARM_FAKE_BATTERY``
  included): here it is read once a round, and each device class's rules (its policy's
  ``eligible``, else ``--eligible``) are checked on it once, so a class is eligible or not as a
  whole. The strategy then samples ``max(int(offered · fraction · F), 1)`` of them with
  :func:`~fedswarm.algorithms.selection.cohort.sample_positions` (the in-process sampling's
  draw); too few on: the round waits, in simulated time, for the next node to come on; none
  eligible: it reads the telemetry again every few seconds up to ``round_timeout``, then fails
  saying why.
- **A round's replies.** Each sampled node's simulated seconds (download + compute + upload on
  its profile, :func:`fedswarm.timemodel.sync_round_time_s`'s terms, from the real messages'
  measured sizes) are known before anything trains. A node that drops (its class's ``dropout``)
  or whose session ends before its part of the round does loses its update (``dropped``); of the
  others, the quorum keeps the K that finish first (equal times: the earlier sampled), the rest
  are ``late``. Under FedAvg only the kept nodes train (its nodes keep no state, so what the others
  would have computed changes nothing); under the other runners every sampled node trains and runs
  its client step, since a late or dropped in-process node did, and its client state moved (an
  error-feedback residual, a gTop-k accumulator, a sketch strategy's memory):
  :meth:`BatchedFleet.kept_replies` (the compressed runners' replies) or
  :meth:`BatchedFleet.kept_messages` (PVT's and ProgFed's real replies) then hands the strategy the
  kept replies, the strategy sampling from the round's pool, :meth:`BatchedFleet.get_node_ids`, with
  ``fraction_train`` scaled as the fleet grid scales it (:func:`fleet_of`). Under ``--byzantine`` the
  attack rewrites every sampled node's reply (a late or dropped one's too) before the quorum keeps its K,
  in the sampled order, as in-process, where the fleet grid sits over the attacking grid and pulls the
  replies in the order sent. The bytes sent to every sampled node are counted. The round's
  simulated time is the slowest kept node's (``round_timeout`` when it waited for a dropped node
  it needed), plus the time it waited for nodes to come on; it moves the clock and is recorded.
- **A second exchange within the round** (Sketched-SGD's and gs-SGD's exact values, asked of the
  nodes whose sketches the strategy accepted): the strategy sends it through the grid it sampled
  from, :meth:`BatchedFleet.send_and_receive`, to the runner's grid, and :meth:`BatchedFleet.again`
  holds its replies as the fleet grid holds every train exchange: the same dropout draw (a node kept
  once is not dropped by it) and its session against this exchange's own simulated seconds from the
  round's start, a quorum of ``min(K, asked)``, the rows of those left out, the kept replies first to
  finish first. Every asked client answers (its memory of the candidates moves, as in-process). The
  round's simulated time then reads every kept reply of both exchanges with its node's bytes of the
  whole round (the in-process meter's per-node totals), and a stall of the first exchange stays.

Without ``--devices`` (a quorum or over-selection on real time) the quorum keeps the first K
sampled, where the in-process engine keeps the first K its grid hands back.

Rows for the nodes left out (``ineligible``, ``unavailable``, ``late``, ``dropped``) are written as
the fleet grid writes them (its row functions) when a round leaves out at most
:data:`~fedswarm.sim.batched_round.NODE_ROWS_MAX` nodes; past that the round's row counts them
instead (``fleet_ineligible``, ``fleet_unavailable``, ``fleet_late``, ``fleet_dropped``).

Cost: the checks are arrays over the population, the availability windows too: :class:`Presence`
asks :meth:`Availability.at <fedswarm.availability.Availability.at>` for all the nodes whose
state it does not know at once, which draws their periods as arrays (the same windows the
other engines draw node by node); later rounds ask again only for the nodes whose session ended
since.
"""

from __future__ import annotations

import math
import time
from typing import Callable

import numpy as np
import torch

from fedswarm.algorithms.selection.cohort import sample_positions
from fedswarm.availability import Availability, availability_for
from fedswarm.config import RunConfig
from fedswarm.eligibility import Rules, ineligible_row, machine_telemetry, parse_rules, rules_by_class
from fedswarm.errors import ConfigError
from fedswarm.server.fleet_grid import (drop_reason, late_row, none_on_again, take_sampling, too_few_eligible,
                                        unavailable_row)
from fedswarm.sim.batched_round import NODE_ROWS_MAX, ByteCounter, _device_classes, cohort_schedule
from fedswarm.wire import vector_to_arrayrecord

__all__ = ["BatchedFleet", "check_batched_fleet", "Presence", "machine_telemetry", "FLEET_RUNNER", "FLEET_ALL_TRAIN",
           "fleet_of"]

FLEET_RUNNER = "weighted_mean"  # the batched round runner the fleet options run with (FedAvg's) ...
#: ... and the runners whose clients all train before the fleet keeps the quorum's replies (a late or dropped
#: in-process node has trained, and its client state moved): CompressedRounds.round (sim/batched_compressed.py,
#: BatchedFleet.kept_replies) with every strategy of the codec runner (compressed_fedavg, onebit, the robust rules,
#: signum), gtopk's and the Count-Sketch strategies' (Sketched-SGD's and gs-SGD's second exchange held to the fleet
#: again: BatchedFleet.again); PVT's and ProgFed's rounds (BatchedFleet.kept_messages)
FLEET_ALL_TRAIN = ("codec", "global_topk", "sketch", "variable_subsets", "stages")
RETRY_S = 5.0  # no eligible node: how often the telemetry is read again (the fleet grid's probe interval)
LOOKAHEAD_S = 365 * 86_400.0  # how far an off node's next session is looked for (Availability.next_on's)

Train = Callable[[list[int]], "tuple[torch.Tensor, dict, list[dict]]"]

#: why a runner the batched engine has keeps refusing the fleet options (one line each)
REFUSED: dict[str, str] = {}


def check_batched_fleet(cfg: RunConfig, runner: object) -> None:
    """Refuse, in one line, fleet options the batched engine does not run with ``cfg``."""
    used = cfg.fleet_options()
    if not used or (runner == "fedbuff" and set(used) <= {"--eligible", "--availability"}):
        # fedbuff's dispatch and schedule honour these two itself (batched_fedbuff.py)
        return
    if runner == FLEET_RUNNER or runner in FLEET_ALL_TRAIN:
        if cfg.byzantine and runner == FLEET_RUNNER:  # (the batched FedAvg round runs no attack at all)
            raise ConfigError(f"{', '.join(used)} with --byzantine on the batched engine: with the codec runner's "
                              f"strategies and gtopk, not '{cfg.strategy}'; use --engine inprocess")
        return
    why = REFUSED.get(str(runner), f"not with the '{runner}' round")
    raise ConfigError(f"{', '.join(used)} on the batched engine: not with '{cfg.strategy}' ({why}); use "
                      "--engine inprocess")


def fleet_of(run, strategy) -> "BatchedFleet | None":
    """The run's :class:`BatchedFleet` for a round runner whose ``strategy`` object samples itself (it
    then samples from the round's pool, :meth:`BatchedFleet.take_sampling`); None without the fleet options."""
    if not run.cfg.fleet_options():
        return None
    fleet = BatchedFleet(run.cfg, run.train_config, run.n_examples, None, run.meter)
    fleet.take_sampling(strategy)
    return fleet


class Presence:
    """Which of ``n`` partitions are on at a simulated time, as a boolean array: each partition's
    state is known on an interval ``[lo, hi)`` and asked of ``availability`` again only when the
    time leaves it (the clock only moves on, and sessions last many rounds)."""

    def __init__(self, availability: Availability, n: int):
        self.availability = availability
        self.lo = np.full(n, np.inf)
        self.hi = np.full(n, -np.inf)
        self.on = np.zeros(n, dtype=bool)

    def at(self, t: float) -> np.ndarray:
        stale = np.flatnonzero(~((self.lo <= t) & (t < self.hi)))
        if len(stale):
            on, change = self.availability.at(stale, t, limit=LOOKAHEAD_S)  # (inf: off for all that span)
            self.on[stale] = on
            self.hi[stale] = np.where(on | np.isfinite(change), change, t + LOOKAHEAD_S)
            self.lo[stale] = t
        return self.on


class BatchedFleet:
    """See the module's docstring. ``train(kept)``: the round of the kept node ids (the engine's
    FedAvg round), returning ``(model, row, node_rows)``."""

    def __init__(self, cfg: RunConfig, train_config, n_examples: np.ndarray, counter: ByteCounter, meter):
        from fedswarm.sim.simtime import node_profiles

        self.cfg, self.train_config, self.n_examples, self.counter = cfg, train_config, n_examples, counter
        self.meter = meter  # the engine's Meter: the round's traffic, the bytes sent to the nodes not kept added
        n = cfg.clients
        self.rules: Rules | None = parse_rules(cfg.eligible) if cfg.eligible else None
        if cfg.devices:
            self.class_names, self.class_code = _device_classes(cfg.devices, n)
        else:
            self.class_names, self.class_code = ["default"], np.zeros(n, dtype=np.int32)
        self.availability = None
        if cfg.availability is not None:
            classes = np.asarray(self.class_names, dtype=object)[self.class_code].tolist()
            self.availability = availability_for(cfg.availability, classes, cfg.seed)
            self.presence = Presence(self.availability, n)
        profiles = node_profiles(cfg)
        self.timed = profiles is not None
        if profiles is not None:  # each partition's link and speed, for its simulated seconds
            self.latency_s = np.array([p.link.latency_ms for p in profiles]) / 1e3
            self.bandwidth = np.array([p.link.bandwidth_mbps for p in profiles]) * 1e6
            self.speed = np.array([p.device.speed for p in profiles], dtype=np.float64)
        self.wait_s = float(cfg.round_timeout)
        self.clock = 0.0
        self.idle = 0.0  # simulated seconds this round waited for nodes to come on
        self._pool: list[int] = []  # this round's pool (start)
        self._stalled, self._slowest = False, None  # this round's (keep)
        self._round = 0  # this round's number (start)
        # a further exchange within the round (again): the kept first replies' (node ids, bytes down, bytes up,
        # examples), its bytes per node and what it computed on, its rows
        self._kept_parts: tuple[np.ndarray, ...] | None = None
        self._more: tuple[dict[int, list[int]], list[tuple[int, float]]] | None = None
        self._more_rows: list[dict] = []

    # -- sampling ------------------------------------------------------------------------------
    def _class_rules(self) -> list[Rules | None]:
        """Each device class's rules, from the policies the round's messages carry."""
        return rules_by_class(self.train_config, self.class_names, self.rules)

    def _eligible(self, offered: np.ndarray) -> tuple[np.ndarray, Callable[[np.ndarray], list[dict]]]:
        """The offered nodes' eligibility (a mask), and the rows of the given ineligible ones."""
        rules = self._class_rules()
        if all(r is None for r in rules):
            return np.ones(len(offered), dtype=bool), lambda nodes: []
        tel = machine_telemetry()
        why = [None if r is None else r.why_not(tel) for r in rules]
        bad = np.array([w is not None for w in why])[self.class_code[offered - 1]]

        def rows(nodes: np.ndarray) -> list[dict]:
            codes = self.class_code[nodes - 1].tolist()
            return [ineligible_row(node, rules[c], why[c], tel) for node, c in zip(nodes.tolist(), codes)]

        return ~bad, rows

    def _offer(self, server_round: int) -> tuple[list[int], Callable[[int], list[dict]], dict]:
        """The round's pool (node ids, sorted); ``rows(limit)``, the rows of (up to ``limit`` of)
        the nodes left out, unavailable ones first; how many of each were left out."""
        ids = np.arange(1, self.cfg.clients + 1, dtype=np.int64)
        deadline = time.monotonic() + self.wait_s
        while True:
            offered, off = ids, ids[:0]
            if self.availability is not None:
                on = self.presence.at(self.clock)
                off, offered = ids[~on], ids[on]
            ok, ineligible_rows = self._eligible(offered)
            bad, clock = offered[~ok], self.clock

            def rows(limit: int, off=off, bad=bad, ineligible_rows=ineligible_rows, clock=clock) -> list[dict]:
                out = [unavailable_row(self.availability, node, node - 1, clock) for node in off[:limit].tolist()]
                return out + ineligible_rows(bad[:max(0, limit - len(out))])

            pool = offered[ok]
            if len(pool) >= 1:
                return pool.tolist(), rows, {"fleet_unavailable": len(off), "fleet_ineligible": len(bad)}
            if self.availability is not None:  # simulated time: wait for the next node to come on
                after = math.nextafter(self.clock, math.inf)
                on, change = self.availability.at(ids - 1, after)  # each node's next_on(after), all at once
                times = np.where(on, after, change)
                times = times[np.isfinite(times) & (times > self.clock)]
                if not len(times):
                    raise none_on_again(server_round, 1, self.clock)
                self.idle += float(times.min()) - self.clock
                self.clock = float(times.min())
                continue
            if time.monotonic() > deadline:
                raise too_few_eligible(server_round, 0, 1, self.wait_s, rows(NODE_ROWS_MAX))
            time.sleep(min(RETRY_S, max(0.0, deadline - time.monotonic())))  # the machine's telemetry may change

    # -- a round --------------------------------------------------------------------------------
    def _times(self, model: torch.Tensor, sample: list[int], server_round: int) -> tuple[np.ndarray, np.ndarray]:
        """Each sampled node's simulated seconds of the round (None without devices: zeros) and the
        bytes sent to it, from the real messages' sizes (:meth:`ByteCounter.cohort_sizes`)."""
        cfg = self.cfg
        ids = np.asarray(sample, dtype=np.int64)
        cohort = cohort_schedule(cfg, ids, self.train_config, self.n_examples, server_round)
        n_all = self.n_examples[cohort.sched.partitions.numpy()]
        steps = cohort.sched.steps.numpy()
        down, up = self.counter.cohort_sizes(vector_to_arrayrecord(model), model, ids, n_all, steps, cohort,
                                             server_round)
        return self.seconds(ids, down, up, steps), down

    def seconds(self, ids: np.ndarray, down: np.ndarray, up: np.ndarray, steps: np.ndarray | None,
                samples: np.ndarray | None = None) -> np.ndarray:
        """Nodes ``ids``' simulated seconds of the round (zeros without devices): ``down`` and ``up``
        bytes on their links, ``steps`` batches (or ``samples`` examples) on their devices (the time
        model's node time)."""
        if not self.timed:
            return np.zeros(len(ids))
        pids = np.asarray(ids, dtype=np.int64) - 1
        down, up = np.asarray(down, dtype=np.float64), np.asarray(up, dtype=np.float64)
        lat, bw = self.latency_s[pids], self.bandwidth[pids]
        # transfer_time_s's terms (nothing sent: no time), then compute_time_s's, summed in its order
        t_down = np.where(down == 0, 0.0, lat + down * 8.0 / bw)
        t_up = np.where(up == 0, 0.0, lat + up * 8.0 / bw)
        if samples is None:  # what the reply's steps say it computed on
            samples = np.asarray(steps, dtype=np.float64) * self.cfg.batch_size
        samples = np.asarray(samples, dtype=np.float64)
        return t_down + samples / self.speed[pids] + t_up

    def start(self, server_round: int) -> tuple[list[int], Callable[[int], list[dict]], dict]:
        """A round's start: the pool the strategy samples from (:meth:`get_node_ids` hands it out
        until the next start), the rows of the nodes left out, how many of each."""
        self.idle = 0.0
        pool, left_out, counts = self._offer(server_round)
        self._pool, self._round = pool, server_round
        self._kept_parts, self._more, self._more_rows = None, None, []
        return pool, left_out, counts

    def get_node_ids(self) -> list[int]:
        """The round's pool, as the fleet grid hands it to a strategy that samples itself."""
        return list(self._pool)

    def keep(self, sample: list[int], t: np.ndarray, down: np.ndarray, server_round: int, needed: int,
             counts: dict, sent: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[dict]]:
        """Of the sampled nodes that replied (``sample``; ``t`` their simulated seconds, ``down`` the
        bytes sent to them; ``sent``: the messages sent, ``len(sample)`` by default), those dropped
        mid-round and, of the others, those the quorum keeps (the first ``K`` to finish; equal times:
        the earlier sampled) and those late: (kept positions in sampling order, late positions,
        dropped mask, the left-out rows); ``counts`` gets how many were late and dropped."""
        k = self._k(needed, len(sample) if sent is None else sent)
        kept, late, dropped, lost = self._hold(sample, t, down, server_round, k)
        counts.update(fleet_late=len(late), fleet_dropped=int(dropped.sum()))
        self._stalled = self.timed and bool(dropped.any()) and (k is None or len(kept) < k)
        self._slowest = float(t[kept].max()) if self.timed and len(kept) else None
        return np.sort(kept), late, dropped, lost

    def _k(self, needed: int, sent: int) -> int | None:
        """The replies a train exchange of ``sent`` messages closes on (None: all of them)."""
        cfg = self.cfg
        k = cfg.quorum if cfg.quorum is not None else (needed if cfg.over_select > 1.0 else None)
        return None if k is None else min(k, sent)

    def _hold(self, sample: list[int], t: np.ndarray, down: np.ndarray, server_round: int, k: int | None
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[dict]]:
        """:meth:`keep`'s rule: (kept positions, first to finish first; late positions; dropped mask; rows)."""
        dropped = np.zeros(len(sample), dtype=bool)
        lost: list[dict] = []
        if self.availability is not None:
            for i, node in enumerate(sample):
                why = drop_reason(self.availability, node - 1, server_round, self.clock,
                                  float(t[i]) if self.timed else None)
                if why is not None:
                    dropped[i] = True
                    lost.append({"node_id": str(node), "status": "dropped", "reason": why,
                                 "bytes_down": int(down[i])})
        good = np.flatnonzero(~dropped)
        if self.timed:
            good = good[np.argsort(t[good], kind="stable")]  # the first to finish; equal: the earlier sampled
        kept = good if k is None else good[:k]
        late = good[len(kept):]
        lost += [late_row(sample[i], k, float(t[i]) if self.timed else math.inf, int(down[i])) for i in late.tolist()]
        return kept, late, dropped, lost

    def take_sampling(self, strategy) -> None:
        """A strategy object that samples itself samples from the round's pool (:meth:`get_node_ids`),
        its ``fraction_train`` scaled by ``--over-select``, as the fleet grid's strategy does."""
        self.sampling = take_sampling(self.cfg, strategy)  # (fraction, min train nodes, min connected nodes)

    def kept_messages(self, replies: list, down: list[int], up: list[int], server_round: int,
                      counts: dict) -> tuple[list[int], list[dict], int]:
        """:meth:`keep` on a round's real train replies (``replies``, in sampling order; ``down`` and ``up``:
        their bytes), every one of whose clients trained (a strategy object's round whose replies are
        messages: PVT's, ProgFed's): the kept positions (sampling order), the rows of those left out,
        the bytes sent to them. :meth:`take_sampling` first."""
        ids = np.array([int(r.metadata.src_node_id) for r in replies], dtype=np.int64)
        steps = np.array([int(r.content.metric_records["metrics"].get("steps", 0)) for r in replies])
        d = np.asarray(down, dtype=np.int64)
        t = self.seconds(ids, d, np.asarray(up, dtype=np.int64), steps)
        kept, late, dropped, lost = self.keep(ids.tolist(), t, d, server_round, self._needed(), counts)
        return kept.tolist(), lost, int(d[late].sum() + d[dropped].sum())

    def _needed(self) -> int:
        """The nodes the strategy needs of this round's pool (its sampling before :meth:`take_sampling`)."""
        fraction, min_train, _ = self.sampling
        return max(int(len(self._pool) * fraction), min_train)

    def kept_replies(self, replies: list, server_round: int, counts: dict) -> tuple[list, list[dict], int]:
        """:meth:`keep` on a codec round's replies (:mod:`fedswarm.sim.batched_compressed`'s, each with
        ``k``, ``node_id``, ``down``, ``up``, ``steps``, ``error``), all of whose clients trained (their
        error-feedback residuals moved, as the in-process nodes' whose replies the fleet grid discards):
        the replies the strategy gets (the kept ones and the error replies, in sampling order), the rows
        of those left out, and the bytes sent to them."""
        good = [r for r in replies if r.error is None]
        ids = np.array([r.node_id for r in good], dtype=np.int64)
        down = np.array([r.down for r in good], dtype=np.int64)
        up, steps = np.array([r.up for r in good], dtype=np.int64), np.array([r.steps for r in good])
        t = self.seconds(ids, down, up, steps)
        kept, late, dropped, lost = self.keep(ids.tolist(), t, down, server_round, self._needed(), counts,
                                              sent=len(replies))
        # (a further exchange within the round adds to the kept nodes' bytes: _slowest_with_more)
        self._kept_parts = (ids[kept], down[kept], up[kept], steps[kept].astype(np.float64) * self.cfg.batch_size)
        out = [good[i] for i in kept.tolist()] + [r for r in replies if r.error is not None]
        return sorted(out, key=lambda r: r.k), lost, int(down[late].sum() + down[dropped].sum())

    #: the runner's grid that answers a further exchange within the round (:meth:`send_and_receive`)
    exchange = None

    def send_and_receive(self, messages, *, timeout=None) -> list:
        """A further exchange within the round that the strategy sends through the grid it sampled from
        (Sketched-SGD's and gs-SGD's exact values): answered by the runner's :attr:`exchange`, which holds
        its replies to the fleet with :meth:`again`."""
        if self.exchange is None:
            raise RuntimeError("this batched round runner answers no further exchange within a round")
        return self.exchange.send_and_receive(messages, timeout=timeout)

    def again(self, sent: list[int], replies: list, down: list[int], up: list[int]) -> list[int]:
        """A further train exchange within the round (the strategy asks nodes again: Sketched-SGD's and
        gs-SGD's exact values), held to the fleet as the fleet grid holds every train exchange. ``replies``:
        one from each node of ``sent``, in the order sent (``down``, ``up``: their bytes). A node that
        drops (the round's dropout draw, its session against this exchange's own seconds from the round's
        start) loses its reply; of the others the quorum keeps the first ``min(K, sent)`` to finish; each
        left out gets its row, and a drop that leaves the exchange short stalls the round. Returns the
        positions of the replies the strategy gets, in the fleet grid's order: the kept ones first to
        finish first (equal times: as sent), then the error replies. The bytes sent and the kept replies'
        count towards the round's simulated time (:meth:`close`)."""
        from fedswarm.sim.simtime import samples_of  # the examples a reply says it computed on (the time model's)

        ok = [i for i, r in enumerate(replies) if not r.has_error()]
        samples = [samples_of(self.cfg, r) if not r.has_error() else 0.0 for r in replies]
        nodes = [int(sent[i]) for i in ok]
        d = np.asarray([down[i] for i in ok], dtype=np.int64)
        t = self.seconds(np.asarray(nodes, dtype=np.int64), d, np.asarray([up[i] for i in ok], dtype=np.int64),
                         None, np.asarray([samples[i] for i in ok], dtype=np.float64))
        k = self._k(self._needed(), len(replies))
        kept, _, dropped, lost = self._hold(nodes, t, d, self._round, k)
        self._more_rows += lost
        self._stalled = self._stalled or (self.timed and bool(dropped.any()) and (k is None or len(kept) < k))
        more, computed = self._more if self._more is not None else ({}, [])
        for node, nbytes in zip(sent, down):
            more.setdefault(int(node), [0, 0])[0] += int(nbytes)
        for j in kept.tolist():
            more[nodes[j]][1] += int(up[ok[j]])
            computed.append((nodes[j], float(samples[ok[j]])))
        self._more = (more, computed)
        return [ok[j] for j in kept.tolist()] + [i for i, r in enumerate(replies) if r.has_error()]

    def _slowest_with_more(self) -> float | None:
        """The round's slowest node, as the time model reads the round's kept replies of every exchange:
        each with its node's bytes of the whole round and the examples the reply says it computed on."""
        if not self.timed:
            return None
        more, computed = self._more
        ids, down, up, samples = self._kept_parts if self._kept_parts is not None else ((np.zeros(0),) * 4)
        node = ids.tolist() + [n for n, _ in computed]
        first = {n: (int(dn), int(u)) for n, dn, u in zip(ids.tolist(), down.tolist(), up.tolist())}
        tot_d = [first.get(n, (0, 0))[0] + more.get(n, [0, 0])[0] for n in node]
        tot_u = [first.get(n, (0, 0))[1] + more.get(n, [0, 0])[1] for n in node]
        t = self.seconds(np.asarray(node, dtype=np.int64), np.asarray(tot_d), np.asarray(tot_u), None,
                         np.concatenate([np.asarray(samples, dtype=np.float64), [s for _, s in computed]]))
        return float(t.max()) if len(t) else None

    def close(self, row: dict, node_rows: list[dict], left_out: Callable[[int], list[dict]], counts: dict,
              lost: list[dict]) -> list[dict]:
        """The round's end: its simulated seconds on ``row`` (the clock moved on by them), the rows of
        the nodes left out added to ``node_rows`` (or, past ``NODE_ROWS_MAX``, counted on ``row``)."""
        if self._more is not None:  # a further exchange within the round: its bytes and its own replies' time
            self._slowest = self._slowest_with_more()
        row["sim_time_s"] = self._advance(self._slowest, self._stalled)
        lost = lost + self._more_rows
        for status in ("late", "dropped"):
            counts[f"fleet_{status}"] = counts.get(f"fleet_{status}", 0) + sum(
                r["status"] == status for r in self._more_rows)
        if sum(counts.values()) <= NODE_ROWS_MAX:
            return node_rows + left_out(NODE_ROWS_MAX) + lost
        row.update({key: n for key, n in counts.items() if n})  # too many for rows: the round counts them
        return node_rows

    def round(self, model: torch.Tensor, server_round: int, train: Train) -> tuple[torch.Tensor, dict, list[dict]]:
        """One round under the fleet options: sample, decide who is kept, train them (``train``)."""
        cfg = self.cfg
        pool, left_out, counts = self.start(server_round)
        fraction = min(1.0, cfg.fraction * cfg.over_select) if cfg.over_select > 1.0 else cfg.fraction
        # the in-process strategy's draw (strategy_utils.sample_train_nodes)
        sample = [pool[i] for i in sample_positions(len(pool), max(int(len(pool) * fraction), 1)).tolist()]
        t, down = self._times(model, sample, server_round)
        kept, late, dropped, lost = self.keep(sample, t, down, server_round, max(int(len(pool) * cfg.fraction), 1),
                                              counts)
        kept_ids = [sample[i] for i in kept.tolist()]  # trained in sampling order, as the engine's round
        if kept_ids:
            model, row, node_rows = train(kept_ids)
        else:  # nothing to aggregate: the model stays
            from fedswarm.server.metered_grid import Traffic

            row, node_rows, self.meter.traffic = {"train_loss": None, "num_clients": 0}, [], Traffic()
        # sent, never answered in time: their bytes down count (not their nodes: no evaluation asks them)
        self.meter.traffic.bytes_down += int(down[late].sum() + down[dropped].sum())
        return model, row, self.close(row, node_rows, left_out, counts, lost)

    def _advance(self, t: float | None, stalled: bool) -> float | None:
        """The round's simulated seconds (``t``: the slowest kept node's), the clock moved on by them:
        :meth:`FleetGrid.timed`'s arithmetic."""
        if stalled and t is not None:  # the server waited for a dropped node until it gave up
            t = max(t, self.wait_s)
        total = None if t is None and not self.idle else (t or 0.0) + self.idle
        self.clock += total or 0.0
        return total
