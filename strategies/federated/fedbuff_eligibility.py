"""``--eligible`` under FedBuff: its dispatch picks only eligible nodes, on simulated fleets.

FedBuff (:mod:`fedswarm.strategies.federated.fedbuff`) has no rounds to sample: it keeps
``concurrency`` nodes training and fills a free slot with an idle node. :class:`DispatchRules`
narrows that choice to the idle nodes whose telemetry passes their device class's rules (its
policy's ``eligible``, else ``--eligible``; :func:`fedswarm.eligibility.rules_by_class`, the fleet
grid's lookup). Under simulation every node's telemetry is this machine's (the in-process nodes
run in this process; :func:`fedswarm.eligibility.machine_telemetry`, what their probe answer
reads, ``FEDSWARM_FAKE_BATTERY`` included), so a class is eligible or not as a whole; it is read
once per aggregation, when the aggregation's first dispatch happens, with the policies the train
config carries then. The in-process strategy and the batched engine's runner
(:mod:`fedswarm.sim.batched_fedbuff`) both dispatch through this object, so they pick the same
nodes and write the same rows.

Every idle node passed over at a dispatch with a free slot gets one row in the aggregation
(status ``ineligible`` and the reason, :func:`fedswarm.eligibility.ineligible_row`) unless an
update of its own arrived in that aggregation (its row is the train row). When nothing is in
flight and no idle node is eligible, the run fails at once saying why: FedBuff does not wait for
the machine's telemetry to change.

Where the nodes are real (a deployment, each node its own telemetry) or not addressed by partition
(the flower engine: its node ids do not tell a partition, so not a class), :class:`ProbedRules` reads
each node's own telemetry and device class as the synchronous fleet grid does
(:mod:`fedswarm.server.fleet_grid`), with the telemetry probe (:func:`fedswarm.eligibility.probe_messages`,
through the nodes themselves, not metered):

- **Rules on or off at each dispatch.** Whether any rule applies is read at every dispatch from the
  policies as they are now (the train config's ``policy.<class>`` keys, which a ``policy`` control
  rewrites between aggregations: :func:`fedswarm.eligibility.rules_on`, the fleet grid's test too), so
  a class ``eligible`` policy added or changed mid-run counts from the next dispatch.
- **The first probe.** At the first dispatch under rules (the run's first, or the first after a policy
  turned them on), every idle node that did not train in the previous aggregation is probed; when no
  node is training, the answers are awaited up to ``PROBE_TIMEOUT_S``.
- **No telemetry, no model.** A node that has not said anything yet (no probe answer, no train reply)
  is never dispatched while rules apply: its class and its telemetry are not known, and a node on
  5 % battery must never get a model. Its row says ``not eligible: no telemetry yet``; it is
  dispatched at the first dispatch after its answer arrives and passes. (The synchronous fleet grid,
  which must fill a round, samples such a node.)
- **Probed again.** Each train reply's telemetry is kept. Once an aggregation, after a dispatch, the
  nodes left idle (sent no model) that sent nothing in the previous aggregation are probed again
  without waiting (FedBuff has no barrier to wait at): their answers count from the next dispatches. A
  node sent a model is not probed (the probe would run first on the node and hold its training up).
  An idle node whose last report failed its rules is probed again only once ``REPROBE_S`` seconds have
  passed since its last probe (each probe starts a ClientApp process on the node, and a phone on low
  battery should not be woken every aggregation). A node that does not answer keeps what it said last.
- **Nothing to dispatch.** When nothing is in flight and no idle node is eligible, it waits for the
  answers out and probes the idle nodes again every ``RETRY_S`` seconds up to ``round_timeout``, then
  fails saying why.

The rows of the nodes passed over are the simulated path's (:func:`fedswarm.eligibility.ineligible_row`).
"""

from __future__ import annotations

import time
from typing import Any, Callable

from fedswarm.eligibility import (Rules, ineligible_row, machine_telemetry, node_report, parse_rules, policies_in,
                                  probe_messages, rules_by_class, rules_on)
from fedswarm.policy import DEFAULT_CLASS
from fedswarm.strategies.strategy_utils import pull_replies

__all__ = ["DispatchRules", "ProbedRules", "dispatch_rules_for", "PROBE_TIMEOUT_S", "REPROBE_S", "NO_REPORT"]

PROBE_TIMEOUT_S = 10.0  # how long the first probe waits for the nodes' answers (the fleet grid's too)
RETRY_S = 5.0  # with none eligible and none training: the pause between probes
REPROBE_S = 60.0  # an idle node whose last report failed its rules: probed again at most this often
NO_REPORT = "no telemetry yet (it has not answered the telemetry probe)"  # why a silent node is not dispatched


class DispatchRules:
    """Which nodes FedBuff may dispatch to. ``classes[pid]``: the device class of partition ``pid``
    (node id ``pid + 1`` on the simulation engines); ``rules``: ``--eligible`` (None: none)."""

    def __init__(self, classes: list[str], rules: Rules | None):
        self.classes, self.rules = classes, rules
        self.names = sorted(set(classes))
        self._verdict: dict[str, tuple[Rules, str]] = {}  # class -> (its rules, why it is not eligible)
        self._telemetry: dict | None = None
        self._fresh = False  # read this aggregation
        self.passed: set[int] = set()  # nodes passed over in this aggregation

    def active(self, train_config: Any) -> bool:
        """Whether any rule applies to any class (``--eligible`` or a class's ``eligible`` policy)."""
        return any(r is not None for r in rules_by_class(train_config, self.names, self.rules))

    def learn(self, reply: Any) -> None:
        """(A reply's telemetry: every simulated node reports this machine's, read at the dispatch.)"""

    def _read(self, train_config: Any) -> None:
        rules = rules_by_class(train_config, self.names, self.rules)
        self._verdict, self._telemetry = {}, None
        if any(r is not None for r in rules):
            self._telemetry = machine_telemetry()
            for name, r in zip(self.names, rules):
                why = None if r is None else r.why_not(self._telemetry)
                if why is not None:
                    self._verdict[name] = (r, why)
        self._fresh = True

    def eligible(self, node: int) -> bool:
        return self.classes[node - 1] not in self._verdict

    def dispatch(self, sched: Any, version: int, train_config: Any) -> list:
        """``sched.dispatch(version)`` (an :class:`~fedswarm.algorithms.fedbuff.AsyncSchedule`) over the
        eligible idle nodes; the ineligible ones passed over are remembered for :meth:`rows`."""
        if not self._fresh:
            self._read(train_config)
        if not self._verdict:
            return sched.dispatch(version)
        if sched.in_flight < sched.concurrency:
            self.passed.update(n for n in sched.idle if not self.eligible(n))
        jobs = sched.dispatch(version, eligible=self.eligible)
        if not jobs and not sched.in_flight:
            reasons = "; ".join(f"{name}: {why}" for name, (_, why) in sorted(self._verdict.items()))
            raise RuntimeError(f"FedBuff: no node is eligible to train at model version {version} and none is "
                               f"training ({reasons})")
        return jobs

    def rows(self, arrived: Callable[[int], bool]) -> list[dict]:
        """The aggregation's rows of the nodes passed over (not those with an update in it, ``arrived``);
        the next dispatch reads the telemetry again."""
        out = []
        for node in sorted(self.passed):
            if not arrived(node) and self.classes[node - 1] in self._verdict:
                rules, why = self._verdict[self.classes[node - 1]]
                out.append(ineligible_row(node, rules, why, self._telemetry))
        self.passed.clear()
        self._fresh = False
        return out


class ProbedRules:
    """Which nodes FedBuff may dispatch to when each node reports its own telemetry (see the module):
    ``rules``: ``--eligible`` (None: none; a class's ``eligible`` policy still applies); ``grid``: the
    nodes themselves, for the probe; ``wait_s``: how long it probes again when nothing is eligible and
    nothing is training; ``reprobe_s``: the back-off of an ineligible idle node's probe (None:
    ``REPROBE_S``); ``clock``: the seconds the back-off is measured in."""

    def __init__(self, rules: Rules | None, grid: Any, *, wait_s: float = 600.0,
                 probe_timeout_s: float = PROBE_TIMEOUT_S, retry_s: float = RETRY_S, reprobe_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.rules, self.grid = rules, grid
        self.wait_s, self.probe_timeout_s, self.retry_s = float(wait_s), float(probe_timeout_s), float(retry_s)
        self.reprobe_s = float(REPROBE_S if reprobe_s is None else reprobe_s)  # (None: the module's, read now)
        self.clock = clock
        self.telemetry: dict[int, dict] = {}
        self.classes: dict[int, str] = {}
        self.known: set[int] = set()  # nodes that said something of themselves (a probe answer, a train reply)
        self.probed_at: dict[int, float] = {}  # node -> when its last probe was sent (clock)
        self.asked: dict[str, int] = {}  # probe message id -> node, not answered yet
        self.heard: set[int] = set()  # nodes that sent a train reply in this aggregation
        self.before: set[int] | None = None  # ... in the previous one (None: no aggregation yet)
        self.passed: dict[int, tuple[Rules | None, str]] = {}  # nodes passed over in this aggregation, and why
        self._started = False  # rules applied at a dispatch already (the first probe is done)
        self._fresh = False  # probe_left done in this aggregation
        self._probes = 0

    @staticmethod
    def active(train_config: Any, rules: Rules | None) -> bool:
        """Whether ``rules`` or any class's ``eligible`` policy (the train config's ``policy.<class>``) applies."""
        return rules_on(policies_in(train_config), rules)

    def learn(self, reply: Any) -> None:
        """What a reply (a probe answer, a train reply) says of its node: its telemetry and class."""
        report = node_report(reply)
        if report is None:
            return
        node, tel, cls, _ = report
        self.known.add(node)
        if tel is not None:
            self.telemetry[node] = tel
        if cls is not None:
            self.classes[node] = cls
        if not str(reply.metadata.message_type).startswith("query."):
            self.heard.add(node)  # it trained: not probed at the next aggregation (the fleet grid's rule)

    def why_not(self, node: int, train_config: Any) -> tuple[Rules | None, str] | None:
        """Why ``node`` may not train now (its class's rules, the failing clauses; a node that said nothing
        yet: no rules, :data:`NO_REPORT`), None: it may. Call it only while :meth:`active`."""
        if node not in self.known:
            return None, NO_REPORT
        (rules,) = rules_by_class(train_config, [self.classes.get(node, DEFAULT_CLASS)], self.rules)
        why = None if rules is None else rules.why_not(self.telemetry.get(node))
        return None if why is None else (rules, why)

    def _ask(self, nodes: list[int]) -> None:
        pending = set(self.asked.values())
        nodes = [n for n in nodes if n not in pending]
        if not nodes:
            return
        self._probes += 1
        now = self.clock()
        ids = list(self.grid.push_messages(probe_messages(nodes, f"probe-fedbuff-{self._probes}")))
        for node, mid in zip(nodes, ids):
            if mid:
                self.asked[mid] = node
                self.probed_at[node] = now

    def _read(self, replies: list) -> None:
        for reply in replies:
            if self.asked.pop(reply.metadata.reply_to_message_id, None) is not None:
                self.learn(reply)

    def _await(self, timeout: float) -> None:
        """The answers of every probe out, waited for up to ``timeout`` seconds."""
        if self.asked:
            self._read(pull_replies(self.grid, list(self.asked), timeout=timeout))

    def _due(self, node: int, train_config: Any, now: float) -> bool:
        """Whether idle ``node`` is probed at this aggregation: it sent nothing in the previous one, and
        its last report did not fail its rules less than ``reprobe_s`` seconds after its last probe."""
        if self.before is not None and node in self.before:
            return False
        if node in self.known and self.why_not(node, train_config) is not None:
            return now - self.probed_at.get(node, -float("inf")) >= self.reprobe_s
        return True

    def eligible_idle(self, idle: list[int], train_config: Any, *, busy: bool) -> list[int]:
        """The eligible nodes among ``idle`` (called at a dispatch with a free slot; the others are passed
        over, remembered for :meth:`rows`). ``busy``: some node is training; when none is and none of
        ``idle`` is eligible, it waits for the probes' answers and probes again up to ``wait_s`` seconds,
        then raises RuntimeError."""
        if not self.active(train_config, self.rules):
            return list(idle)
        if not self._started:  # the first dispatch under rules: every node that did not just train
            self._started = self._fresh = True
            self._ask([n for n in idle if self.before is None or n not in self.before])
            if not busy:
                self._await(self.probe_timeout_s)
        if self.asked:
            self._read(list(self.grid.pull_messages(list(self.asked))))
        deadline = time.monotonic() + self.wait_s
        while True:
            verdict = {n: self.why_not(n, train_config) for n in idle}
            ok = [n for n in idle if verdict[n] is None]
            if ok or busy or not idle:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                reasons = "; ".join(sorted({f"{rules or 'eligible'}: {why}" for rules, why in verdict.values()})[:3])
                raise RuntimeError(f"FedBuff: no node is eligible to train and none is training after "
                                   f"{self.wait_s:.0f} s ({reasons})")
            if not self.asked:  # every answer is in and none passes: their telemetry may change
                time.sleep(min(self.retry_s, left))
            self._ask(list(idle))  # (not those whose probe is still out)
            self._await(min(self.probe_timeout_s, max(0.0, deadline - time.monotonic())))
        for n, v in verdict.items():
            if v is None:
                self.passed.pop(n, None)
            else:
                self.passed[n] = v
        return ok

    def probe_left(self, idle: list[int], train_config: Any) -> None:
        """Once an aggregation, after its dispatch: probe the nodes left ``idle`` (sent no model) that are
        due (:meth:`_due`), without waiting. A node being sent a model now is not probed: the answer
        would come after the decision, and the probe would hold its training up (one ClientApp
        process before the train message); its train reply carries its telemetry."""
        if self._fresh or not idle or not self.active(train_config, self.rules):
            return
        self._fresh = True
        now = self.clock()
        self._ask([n for n in idle if self._due(n, train_config, now)])

    def dispatch(self, sched: Any, version: int, train_config: Any) -> list:
        """``sched.dispatch(version)`` (the virtual clock's schedule, the flower engine) over the eligible
        idle nodes, then :meth:`probe_left` on those left idle."""
        jobs = []
        if sched.in_flight < sched.concurrency and sched.idle:
            ok = set(self.eligible_idle(list(sched.idle), train_config, busy=sched.in_flight > 0))
            jobs = sched.dispatch(version, eligible=ok.__contains__)
        self.probe_left(list(sched.idle), train_config)
        return jobs

    def rows(self, arrived: Callable[[int], bool]) -> list[dict]:
        """The aggregation's rows of the nodes passed over (not those with an update in it, ``arrived``)."""
        out = [ineligible_row(node, rules, why, self.telemetry.get(node))
               for node, (rules, why) in sorted(self.passed.items()) if not arrived(node)]
        self.passed.clear()
        self.before, self.heard = self.heard, set()
        self._fresh = False
        return out


def dispatch_rules_for(cfg: Any) -> DispatchRules:
    """The run's :class:`DispatchRules`: each partition's class from ``--devices`` (else ``default``)."""
    if cfg.devices:
        from fedswarm.timemodel import parse_devices

        classes = [str(c) for c in parse_devices(cfg.devices, cfg.clients)]
    else:
        classes = [DEFAULT_CLASS] * cfg.clients
    spec = getattr(cfg, "eligible", None)
    return DispatchRules(classes, parse_rules(spec) if spec else None)
