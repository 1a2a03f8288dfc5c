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

In a deployment (real nodes, each its own telemetry) FedBuff's push/pull does not probe the nodes
yet: :meth:`DispatchRules.check_simulated` refuses it in one line.
"""

from __future__ import annotations

from typing import Any, Callable

from fedswarm.eligibility import Rules, ineligible_row, machine_telemetry, parse_rules, rules_by_class
from fedswarm.errors import ConfigError
from fedswarm.policy import DEFAULT_CLASS

__all__ = ["DispatchRules", "dispatch_rules_for"]


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

    def check_simulated(self, simulated: bool, train_config: Any) -> None:
        """Refuse eligibility rules when FedBuff's nodes are not simulated ones (a deployment)."""
        if not simulated and self.active(train_config):
            raise ConfigError("fedbuff --eligible (or a class's eligible policy): on the simulation engines "
                              "(inprocess, batched) only; in a deployment its dispatch does not probe the nodes yet")

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


def dispatch_rules_for(cfg: Any) -> DispatchRules:
    """The run's :class:`DispatchRules`: each partition's class from ``--devices`` (else ``default``)."""
    if cfg.devices:
        from fedswarm.timemodel import parse_devices

        classes = [str(c) for c in parse_devices(cfg.devices, cfg.clients)]
    else:
        classes = [DEFAULT_CLASS] * cfg.clients
    spec = getattr(cfg, "eligible", None)
    return DispatchRules(classes, parse_rules(spec) if spec else None)
