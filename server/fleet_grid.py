"""Fleets of devices that sleep: quorum rounds, over-selection, eligibility and availability.

:class:`FleetGrid` is a Grid over the engine's (or the SuperLink's) grid, under the meter, that
every synchronous federated strategy samples and trains through (:func:`fleet_grid_for` builds it
when the run asks for one of these; otherwise nothing changes):

- **Sampling** (``get_node_ids``, what a strategy samples from): it waits for the nodes the
  strategy waited for, then offers only the nodes that are *eligible* (their last telemetry
  passes ``--eligible`` or their device class's ``eligible`` policy, :mod:`fedswarm.eligibility`)
  and *available* (``--availability``, :mod:`fedswarm.availability`, at the round's simulated
  start). Every node left out gets a row for the round: status ``ineligible`` or ``unavailable``
  and the reason (the dashboard's Nodes page shows it). A node's eligibility comes from the last
  telemetry it sent: each round, before sampling, the nodes that did not report in the previous
  round (all of them in the first; with ``--availability`` on an engine whose node ids are not
  partition ids, every node not yet placed, waiting up to ``round_timeout``) get the *probe*, a
  ``query.fedswarm_telemetry`` message
  answered with the node's telemetry and nothing else (no model either way, a few hundred bytes,
  not counted in the round's bytes); a node that does not answer it within ``PROBE_TIMEOUT_S``
  keeps what it said last (a node that never said anything is eligible). When too few nodes are
  on, a simulated round waits (simulated time) for the next to come on; when none is eligible,
  the round probes again every few seconds up to ``round_timeout``, then fails saying why. A node
  that did not train in the previous round is probed every round.
- **Over-selection** (``--over-select F``): the strategy's ``fraction_train`` is scaled by F (at
  most 1), so it samples F times the nodes it needs (with ``--fraction 1`` there is nothing more to
  sample: over-selection needs a fraction below 1/F to matter).
- **Quorum** (``--quorum K``; with ``--over-select`` K defaults to the nodes the strategy needs,
  ``max(int(fraction · offered), min_train_nodes)``): a train round returns once K replies are in.
  On real time (a deployment, or a simulation without ``--devices``) that is the first K to
  arrive; on simulated time (``--devices``) all replies are computed and the K that finish first
  in the time model are kept (equal finish times: the earlier sampled first), so the round's
  simulated time is the K-th finish. The other replies
  are discarded, never carried into the next round (no strategy here takes a stale update; the
  ``fedbuff`` strategy is the one that does), and recorded: status ``late`` and the reason.
- **Mid-round drops** (``--availability``): a node that drops (its class's ``dropout``) or
  whose session ends before its own part of the round is over loses its update: its reply is
  discarded and its row says ``dropped`` and why. Its own state (an error-feedback residual) keeps
  what it computed: the simulated node got that far. A round that waits for such a node (no quorum,
  or a quorum the drops left short) takes ``round_timeout`` simulated seconds: the server waited
  for it until it gave up.
- **A second exchange within the round** (a train message to nodes already asked: Sketched-SGD's and
  gs-SGD's exact values) goes through the same rules: the round's dropout draw again, the node's
  session against that exchange's own simulated seconds, a quorum of at most the nodes asked. A wait
  for a dropped node in either exchange makes the round take ``round_timeout``.

Rows for nodes that sent no usable reply go to the recorder through ``on_rows``
(:meth:`~fedswarm.server.recorder.RoundRecorder.node_rows`).

A round's replies are asked for in the order the messages were sent (the strategy's sampled order,
never a ``set``'s): the in-process grid runs the nodes and hands their replies back in that order. Under
``--byzantine`` the attacking grid sits below this one: it rewrites the replies before the quorum and the
drops are decided, reading them in the order sent (:mod:`fedswarm.server.byzantine`), so the batched
engine, which attacks its replies in the sampled order, gives the same model.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from typing import Any

from flwr.app import Message

from fedswarm.availability import Availability, run_availability
from fedswarm.config import RunConfig
from fedswarm.eligibility import (Rules, class_rules, ineligible_row, node_report, parse_rules, probe_messages,
                                  rules_on)
from fedswarm.errors import ConfigError
from fedswarm.store.rows import NOT_PICKED  # the statuses of a node left out at sampling
from fedswarm.policy import DEFAULT_CLASS, PolicyBook
from fedswarm.server.metered_grid import WrappingGrid, serialized_size
from fedswarm.server.prompt_grid import pull_replies
from fedswarm.strategies.strategy_utils import wait_for_nodes

__all__ = ["FleetGrid", "fleet_grid_for", "take_sampling", "check_fleet", "uses_fleet", "PROBE_TIMEOUT_S", "NOT_PICKED"]

PROBE_TIMEOUT_S = 10.0  # how long the eligibility probe waits for the nodes' answers
NodeTime = Callable[[Message, int, int], "float | None"]


def uses_fleet(cfg: RunConfig) -> bool:
    """Whether the run asks for any of quorum, over-selection, eligibility or availability."""
    return bool(cfg.fleet_options())


def check_fleet(cfg: RunConfig, kind: str, strategy: Any) -> None:
    """Refuse, in one line, a fleet option the run's strategy cannot take."""
    if not uses_fleet(cfg):
        return
    if kind != "federated":
        raise ConfigError(f"{', '.join(cfg.fleet_options())}: for synchronous federated strategies; "
                          f"'{cfg.strategy}' is {kind}")
    if cfg.over_select > 1.0 and not (hasattr(strategy, "fraction_train") and hasattr(strategy, "min_train_nodes")):
        raise ConfigError(f"--over-select: strategy '{cfg.strategy}' chooses its own nodes (it has no "
                          f"fraction_train to scale); use --quorum alone")


# -- what a node left out of a round is told (the batched engine's rounds write the same: sim/batched_fleet.py;
#    a class's rules and the ineligible row: fedswarm.eligibility) --
def unavailable_row(availability: Availability, node: int, pid: int, clock: float) -> dict:
    """The row of node ``node`` (partition ``pid``), off at simulated time ``clock``."""
    nxt = availability.next_on(pid, clock)
    when = f"; on again at t={nxt:.0f} s" if nxt is not None else "; not on again in the trace"
    return {"node_id": str(node), "status": "unavailable", "reason": f"offline at t={clock:.0f} s (simulated){when}"}


def late_row(node: int, k: int | None, t: float, bytes_down: int) -> dict:
    """The row of a reply left out by a quorum of ``k`` (``t``: its simulated finish, inf: not known)."""
    when = f" (it finished at {t:.1f} s simulated)" if math.isfinite(t) else ""
    return {"node_id": str(node), "status": "late", "bytes_down": bytes_down,
            "reason": f"late: the round closed on a quorum of {k} replies{when}; update discarded"}


def drop_reason(availability: Availability, pid: int, server_round: int, clock: float, t: float | None) -> str | None:
    """Why partition ``pid``'s update of round ``server_round`` (started at simulated ``clock``, its part
    ``t`` seconds long) is lost mid-round, or None (:meth:`Availability.lost`)."""
    return availability.lost(pid, server_round, clock, None if t is None else clock + t)


def too_few_eligible(server_round: int, got: int, least: int, wait_s: float, rows: list[dict]) -> RuntimeError:
    reasons = "; ".join(sorted({r["reason"] for r in rows})[:3])
    return RuntimeError(f"round {server_round}: {got} eligible node(s), the strategy needs {least}, "
                        f"for {wait_s:.0f} s ({reasons})")


def none_on_again(server_round: int, least: int, clock: float) -> RuntimeError:
    return RuntimeError(f"round {server_round}: fewer than {least} node(s) available at t={clock:.0f} s and none "
                        f"comes on again (availability trace ended?)")


class FleetGrid(WrappingGrid):
    """See the module's docstring. ``probe_grid``: the grid the probe goes through (the nodes
    themselves, no attack); ``node_time(reply, bytes_down, bytes_up)``: a node's simulated seconds
    of the round (None: real time); ``partition_of(node_id)``: a node's partition id (availability)."""

    def __init__(self, inner, *, quorum: int | None = None, over_select: float = 1.0, fraction: float = 1.0,
                 min_train_nodes: int = 1, min_connected: int = 1, wait_s: float = 600.0,
                 rules: Rules | None = None, policies: PolicyBook | None = None, probe_grid=None,
                 availability: Availability | None = None, node_time: NodeTime | None = None,
                 partition_of: Callable[[int], int | None] | None = None, probe_timeout_s: float = PROBE_TIMEOUT_S):
        super().__init__(inner)
        self.quorum, self.over_select = quorum, float(over_select)
        self.fraction, self.min_train_nodes = float(fraction), int(min_train_nodes)
        self.min_connected, self.wait_s = int(min_connected), float(wait_s)
        self.rules, self.policies = rules, policies if policies is not None else PolicyBook()
        self.probe_grid = probe_grid if probe_grid is not None else inner
        self.availability, self.node_time, self.partition_of = availability, node_time, partition_of
        self.probe_timeout_s = float(probe_timeout_s)
        self.round = 1  # the round being run (end_round moves it on)
        self.clock = 0.0  # simulated seconds at the round's start
        self.idle = 0.0  # simulated seconds the round waited for nodes to come on
        self.stalled = False  # this round waited for a reply that never came: it took round_timeout
        self.telemetry: dict[int, dict[str, Any]] = {}
        self.classes: dict[int, str] = {}
        self.partitions: dict[int, int] = {}
        self.trained: dict[int, int] = {}  # node -> the last round it sent a train reply in
        self.on_rows: Callable[[list[dict]], None] = lambda rows: None
        self.needed: int | None = None  # this round: the nodes the strategy needs of those offered
        self._pool: tuple[int, list[int]] | None = None

    # -- what nodes said ------------------------------------------------------------------
    def _learn(self, msg: Message, *, trained: bool = False) -> None:
        report = node_report(msg)
        if report is None:
            return
        node, tel, cls, pid = report
        if trained:
            self.trained[node] = self.round
        if tel is not None:
            self.telemetry[node] = tel
        if cls is not None:
            self.classes[node] = cls
        if pid is not None:
            self.partitions[node] = pid

    def rules_for(self, node: int) -> Rules | None:
        """The rules a node is held to: its device class's ``eligible`` policy, else the run's."""
        return class_rules(self.policies.as_dict().get(self.classes.get(node, DEFAULT_CLASS)), self.rules)

    def _eligibility_on(self) -> bool:
        return rules_on(self.policies.as_dict(), self.rules)

    def probe(self, nodes: list[int], timeout_s: float | None = None) -> None:
        """Ask ``nodes`` for their telemetry (the ClientApp's ``query.fedswarm_telemetry``), waiting
        ``timeout_s`` (default ``probe_timeout_s``) for the answers."""
        if not nodes:
            return
        waiting = [mid for mid in self.probe_grid.push_messages(probe_messages(nodes, f"probe-{self.round}")) if mid]
        timeout = self.probe_timeout_s if timeout_s is None else timeout_s
        for reply in pull_replies(self.probe_grid, waiting, timeout=timeout):
            self._learn(reply)

    # -- sampling ---------------------------------------------------------------------------
    def _pid(self, node: int) -> int | None:
        if node in self.partitions:
            return self.partitions[node]
        return self.partition_of(node) if self.partition_of is not None else None

    def _offer(self, ids: list[int]) -> tuple[list[int], list[dict]]:
        pool, rows = [], []
        for node in ids:
            why = None
            if self.availability is not None:
                pid = self._pid(node)
                if pid is None:
                    rows.append({"node_id": str(node), "status": "unavailable",
                                 "reason": "its partition id is not known (it did not answer the probe), so "
                                           "neither is its availability"})
                    continue
                if not self.availability.available(pid, self.clock):
                    rows.append(unavailable_row(self.availability, node, pid, self.clock))
                    continue
            rules = self.rules_for(node)
            if rules is not None:
                why = rules.why_not(self.telemetry.get(node))
            if why is not None:
                rows.append(ineligible_row(node, rules, why, self.telemetry.get(node)))
                continue
            pool.append(node)
        return pool, rows

    def _next_on(self, ids: list[int]) -> float | None:
        pids = [pid for node in ids if (pid := self._pid(node)) is not None]
        return self.availability.first_on(pids, math.nextafter(self.clock, math.inf))

    def _ask(self, ids: list[int]) -> None:
        """Probe the nodes whose answer sampling needs: those not placed yet (``--availability``; they
        must say their partition, so up to ``round_timeout``), then, with eligibility rules, those that
        did not train in the previous round."""
        unplaced = [n for n in ids if self._pid(n) is None] if self.availability is not None else []
        if unplaced:
            self.probe(unplaced, timeout_s=self.wait_s)
        if self._eligibility_on():
            self.probe([n for n in ids if self.trained.get(n, -1) < self.round - 1 and n not in unplaced])

    def get_node_ids(self) -> Iterable[int]:
        if self._pool is not None and self._pool[0] == self.round:
            return list(self._pool[1])
        ids = wait_for_nodes(self.inner, self.min_connected, self.wait_s)
        least = max(1, self.min_train_nodes)
        deadline = time.monotonic() + self.wait_s
        self._ask(ids)
        while True:
            pool, rows = self._offer(ids)
            if len(pool) >= least:
                break
            if self.availability is not None:  # simulated time: wait for the next node to come on
                nxt = self._next_on(ids)
                if nxt is None:
                    raise none_on_again(self.round, least, self.clock)
                self.idle += nxt - self.clock
                self.clock = nxt
                continue
            if time.monotonic() > deadline:
                raise too_few_eligible(self.round, len(pool), least, self.wait_s, rows)
            time.sleep(min(5.0, max(0.0, deadline - time.monotonic())))  # the nodes' telemetry may change
            ids = sorted(int(n) for n in self.inner.get_node_ids())
            self._ask(ids)
        self.on_rows(rows)
        self._pool = (self.round, pool)
        self.needed = max(int(len(pool) * self.fraction), self.min_train_nodes)
        return list(pool)

    def end_round(self, server_round: int, *_: Any) -> None:
        """The recorder's listener: round ``server_round`` is recorded; the next one starts."""
        self.round = int(server_round) + 1
        self._pool = None

    def resume_at(self, server_round: int, round_times: list[float | None]) -> None:
        """A resumed run: round ``server_round`` was the last recorded, its rounds took ``round_times``
        simulated seconds (the clock goes on from their sum). What nodes reported before is not kept:
        the next round probes every node again."""
        self.end_round(server_round)
        self.clock = float(sum(t or 0.0 for t in round_times))

    def timed(self, sim_time: Callable[[int, Any], float | None] | None) -> Callable[[int, Any], float | None]:
        """``sim_time`` with the simulated time the round waited for nodes added; moves the clock on."""
        def round_time(rnd: int, traffic: Any) -> float | None:
            t = sim_time(rnd, traffic) if sim_time is not None else None
            if self.stalled and t is not None:  # the server waited for a dropped node until it gave up
                t = max(t, self.wait_s)
            total = None if t is None and not self.idle else (t or 0.0) + self.idle
            self.clock += total or 0.0
            self.idle, self.stalled = 0.0, False
            return total

        return round_time

    # -- a round's replies ------------------------------------------------------------------
    def _k(self, sent: int) -> int | None:
        k = self.quorum if self.quorum is not None else (self.needed if self.over_select > 1.0 else None)
        return None if k is None else min(k, sent)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        msgs = list(messages)
        training = any(str(m.metadata.message_type).startswith("train") for m in msgs)
        k = self._k(len(msgs)) if training else None
        if not training or (k is None and self.availability is None):
            replies = list(self.inner.send_and_receive(msgs, timeout=timeout))
            for r in replies:
                self._learn(r, trained=training)
            return replies
        cache: dict[int, int] = {}
        # as the meter above counts them: before the grid gives them ids
        down = {int(m.metadata.dst_node_id): serialized_size(m, cache) for m in msgs}
        ids = list(self.inner.push_messages(msgs))
        to_node = {mid: int(m.metadata.dst_node_id) for m, mid in zip(msgs, ids, strict=False) if mid}
        simulated = self.node_time is not None

        def enough(got: list[Message]) -> bool:  # real time: the first K good replies close the round
            return not simulated and k is not None and sum(not r.has_error() for r in got) >= k

        # asked for in the order sent (the sampled order), so a grid that answers in the order asked (the
        # in-process engine's) runs the nodes and hands their replies to the attack below in that order
        replies = pull_replies(self.inner, list(to_node), timeout=timeout, enough=enough)
        sent = {node: i for i, node in enumerate(to_node.values())}  # equal finish times: the sampling order decides
        rows: list[dict] = []
        good, out = [], []
        for r in replies:
            self._learn(r, trained=True)
            node = to_node.get(r.metadata.reply_to_message_id, int(r.metadata.src_node_id))
            if r.has_error():
                out.append(r)
                continue
            t = self.node_time(r, down.get(node, 0), serialized_size(r)) if simulated else None
            drop = self._dropped(node, t)
            if drop is not None:
                rows.append({"node_id": str(node), "status": "dropped", "reason": drop,
                             "bytes_down": down.get(node, 0)})
                continue
            good.append((math.inf if t is None else t, sent.get(node, len(sent)) if simulated else len(good), node, r))
        if simulated:
            good.sort(key=lambda g: (g[0], g[1]))
        kept = good if k is None else good[:k]
        # a simulated node that dropped never replies: without a quorum, or with one it left short, the
        # server waits for it until round_timeout (the round's simulated time says so, :meth:`timed`); a later
        # exchange of the round (Sketched-SGD's exact values) does not undo that wait
        self.stalled = self.stalled or (simulated and any(r["status"] == "dropped" for r in rows)
                                        and (k is None or len(kept) < k))
        for t, _, node, _r in good[len(kept):]:
            rows.append(late_row(node, k, t, down.get(node, 0)))
        answered = {r.metadata.reply_to_message_id for r in replies}
        for mid, node in to_node.items():
            if mid not in answered:
                rows.append({"node_id": str(node), "status": "late", "bytes_down": down.get(node, 0),
                             "reason": f"late: no reply yet when the round closed on a quorum of {k} replies"})
        self.on_rows(rows)
        return [g[3] for g in kept] + out

    def _dropped(self, node: int, t: float | None) -> str | None:
        if self.availability is None:
            return None
        pid = self._pid(node)
        return None if pid is None else drop_reason(self.availability, pid, self.round, self.clock, t)


def take_sampling(cfg: RunConfig, strategy: Any) -> tuple[float, int, int]:
    """Take over ``strategy``'s sampling for the fleet options: its ``fraction_train`` scaled by
    ``--over-select``, its wait for nodes left to the fleet (it then samples from the eligible ones it
    is offered). Returns what it asked before: (fraction, min train nodes, min connected nodes)."""
    fraction = float(getattr(strategy, "fraction_train", cfg.fraction))
    min_train = int(getattr(strategy, "min_train_nodes", 1))
    min_connected = int(getattr(strategy, "min_available_nodes", cfg.clients))
    if cfg.over_select > 1.0:
        strategy.fraction_train = min(1.0, fraction * cfg.over_select)
    if hasattr(strategy, "min_available_nodes"):
        strategy.min_available_nodes = 1  # the fleet grid waits for them, then offers the eligible ones
    return fraction, min_train, min_connected


def fleet_grid_for(cfg: RunConfig, grid, strategy: Any, *, policies: PolicyBook, probe_grid=None,
                   node_time: NodeTime | None = None, partition_of: Callable[[int], int | None] | None = None
                   ) -> FleetGrid | None:
    """The run's :class:`FleetGrid` over ``grid`` (None when the run uses none of its options), with
    ``strategy``'s sampling scaled for ``--over-select`` and its wait for nodes taken over."""
    if not uses_fleet(cfg) or getattr(strategy, "schedules_own_fleet", False):
        return None  # (FedBuff dispatches on the simulated fleet's availability and eligibility itself)
    if cfg.availability is not None and node_time is None:
        raise ConfigError("--availability is simulated: it runs on a simulation engine with --devices, "
                          "not in a deployment")
    availability = run_availability(cfg)
    fraction, min_train, min_connected = take_sampling(cfg, strategy)
    return FleetGrid(grid, quorum=cfg.quorum, over_select=cfg.over_select, fraction=fraction,
                     min_train_nodes=min_train, min_connected=min_connected, wait_s=float(cfg.round_timeout),
                     rules=parse_rules(cfg.eligible) if cfg.eligible else None, policies=policies,
                     probe_grid=probe_grid, availability=availability, node_time=node_time,
                     partition_of=partition_of)
