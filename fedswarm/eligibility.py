"""Eligibility rules: which nodes may be sampled, read from the telemetry they report.

A rule set is a comma-separated list of clauses, all of which must hold, e.g.
``battery>=40,charging,temp<45``:

- ``battery OP N``: the battery level in percent (telemetry ``battery_pct``);
- ``temp OP N``: the CPU temperature in °C (``cpu_temp_c``);
- ``rss OP N``: the node process's peak resident memory in MiB (``peak_rss_mb``);
- ``charging``: on mains or USB power (``power_source == "ac"``); ``!charging``: on battery.

``OP`` is one of ``<``, ``<=``, ``>``, ``>=``, ``==``. A value the node's OS does not expose is
absent from its telemetry (:mod:`fedswarm.telemetry`), and a clause on an absent value holds: a
desktop with no battery passes ``battery>=40`` and ``charging`` (it runs on mains), a board with no
thermal zone passes ``temp<45``. A node that has reported nothing yet is eligible.

:func:`parse_rules` refuses a bad clause with a one-line :class:`~fedswarm.errors.ConfigError`
naming it; :meth:`Rules.why_not` returns why a node's telemetry fails them (None: eligible).
:func:`class_rules` (a device class's rules), :func:`ineligible_row` (the row of a node left out)
and :func:`machine_telemetry` (what a simulated node reports) are shared by every place that applies
the rules: the fleet grid, the batched engine's fleet, and FedBuff's dispatch. :func:`probe_messages`
(the telemetry probe) and :func:`node_report` (what a node's reply says about it) are shared by the two
places that read real nodes' telemetry: the fleet grid and FedBuff's dispatch in a deployment.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass
from typing import Any, Callable

from fedswarm.errors import ConfigError

__all__ = ["Rules", "Clause", "parse_rules", "FIELDS", "class_rules", "rules_by_class", "ineligible_row",
           "machine_telemetry", "probe_messages", "node_report", "rules_on", "policies_in"]

#: clause name -> the telemetry key it reads (fedswarm.telemetry.TELEMETRY_KEYS)
FIELDS = {"battery": "battery_pct", "temp": "cpu_temp_c", "rss": "peak_rss_mb"}
_OPS: dict[str, Callable[[float, float], bool]] = {
    "<=": operator.le, ">=": operator.ge, "==": operator.eq, "<": operator.lt, ">": operator.gt}
_CLAUSE = re.compile(r"^(?P<name>[a-z_]+)\s*(?P<op><=|>=|==|<|>)\s*(?P<value>[-+]?[0-9]+(\.[0-9]*)?)$")


@dataclass(frozen=True)
class Clause:
    """One condition: ``name op value`` on a telemetry number, or ``charging`` (``op`` ``is``/``not``)."""

    name: str
    op: str
    value: float | None = None

    def why_not(self, telemetry: dict[str, Any]) -> str | None:
        if self.name == "charging":
            source = telemetry.get("power_source")
            if source is None:
                return None  # no battery reported, or no supply seen: on mains as far as anyone can tell
            charging = source == "ac"
            if charging == (self.op == "is"):
                return None
            return "on battery, not charging" if self.op == "is" else "charging"
        got = telemetry.get(FIELDS[self.name])
        if not isinstance(got, (int, float)) or isinstance(got, bool):
            return None
        if _OPS[self.op](float(got), float(self.value)):  # type: ignore[arg-type]
            return None
        return f"{self.name} {got:g} fails {self}"

    def __str__(self) -> str:
        if self.name == "charging":
            return "charging" if self.op == "is" else "!charging"
        return f"{self.name}{self.op}{self.value:g}"


@dataclass(frozen=True)
class Rules:
    """Every clause must hold."""

    clauses: tuple[Clause, ...]

    def why_not(self, telemetry: dict[str, Any] | None) -> str | None:
        """Why a node reporting ``telemetry`` is not eligible (the failing clauses, '; '-joined),
        or None when it is (no telemetry yet: eligible)."""
        if not telemetry:
            return None
        reasons = [r for c in self.clauses if (r := c.why_not(telemetry)) is not None]
        return "; ".join(reasons) or None

    def __str__(self) -> str:
        return ",".join(str(c) for c in self.clauses)


def parse_rules(spec: str, *, what: str = "eligible") -> Rules:
    """``"battery>=40,charging,temp<45"`` -> :class:`Rules`; a bad clause raises a one-line
    ``ConfigError`` naming it and what is allowed."""
    clauses = []
    for raw in str(spec).split(","):
        text = raw.strip()
        if not text:
            raise ConfigError(f"{what}: empty clause in '{spec}' (write clauses separated by commas, "
                              f"e.g. battery>=40,charging,temp<45)")
        if text in ("charging", "!charging"):
            clauses.append(Clause("charging", "is" if text == "charging" else "not"))
            continue
        m = _CLAUSE.match(text)
        if m is None or m.group("name") not in FIELDS:
            raise ConfigError(f"{what}: bad clause '{text}': use NAME OP NUMBER with NAME one of "
                              f"{', '.join(FIELDS)} and OP one of <, <=, >, >=, ==, or 'charging' / '!charging'")
        clauses.append(Clause(m.group("name"), m.group("op"), float(m.group("value"))))
    return Rules(tuple(clauses))


def class_rules(policy: dict | None, rules: Rules | None) -> Rules | None:
    """The rules a node of a class whose policy is ``policy`` is held to: its ``eligible``, else the run's."""
    spec = (policy or {}).get("eligible")
    return parse_rules(spec) if spec else rules


def policies_in(train_config: Any) -> dict[str, dict]:
    """Every class's policy in a round's train config (its ``policy.<class>`` keys, the policies as they
    are now: :meth:`fedswarm.policy.PolicyBook.write`)."""
    import json

    return {str(k)[len("policy."):]: json.loads(v) for k, v in train_config.items()
            if str(k).startswith("policy.") and v}


def rules_on(policies: dict[str, dict], rules: Rules | None) -> bool:
    """Whether any rule applies: the run's ``rules`` or a class's ``eligible`` policy (``policies``: class ->
    policy, :meth:`fedswarm.policy.PolicyBook.as_dict` or :func:`policies_in`)."""
    return rules is not None or any(p.get("eligible") for p in policies.values())


def rules_by_class(train_config: Any, class_names: list[str], rules: Rules | None) -> list[Rules | None]:
    """Each of ``class_names``' rules, from the ``policy.<class>`` keys of the round's train config
    (:func:`policies_in`), else the run's ``rules``."""
    policies = policies_in(train_config)
    return [class_rules(policies.get(name), rules) for name in class_names]


def ineligible_row(node: int, rules: Rules | None, why: str, telemetry: dict | None) -> dict:
    """The row of node ``node``, left out because its ``telemetry`` fails ``rules`` (``why``; ``rules``
    None: no rules could be checked, e.g. it has reported nothing yet)."""
    which = f" ({rules})" if rules is not None else ""
    return {"node_id": str(node), "status": "ineligible", "reason": f"not eligible{which}: {why}",
            "telemetry": telemetry}


def machine_telemetry() -> dict:
    """What every simulated node reports under simulation: this machine's telemetry, as the
    ClientApp's probe answer reads it (no training speed)."""
    from fedswarm.telemetry import round_telemetry

    tel = round_telemetry(0.0, 0)
    tel.pop("train_s", None)
    return tel


def probe_messages(nodes: list[int], group_id: str) -> list:
    """The telemetry probe to each of ``nodes``: a ``query.fedswarm_telemetry`` message, no model, that
    the ClientApp answers with its telemetry, device class and partition id
    (:func:`fedswarm.client.evaluate.answer_telemetry`)."""
    from flwr.app import ConfigRecord, Message, RecordDict

    from fedswarm.protocol import TELEMETRY_ACTION

    return [Message(RecordDict({"config": ConfigRecord({})}), dst_node_id=n, message_type=f"query.{TELEMETRY_ACTION}",
                    group_id=group_id) for n in nodes]


def node_report(msg: Any) -> tuple[int, dict | None, str | None, int | None] | None:
    """What a node's reply (a probe answer or a train reply) says about it: ``(node id, telemetry,
    device class, partition id)``, each None when it says nothing of it; None for an error reply."""
    from fedswarm.protocol import TELEMETRY_RECORD

    if msg.has_error() or not msg.has_content():
        return None
    tel = msg.content.config_records.get(TELEMETRY_RECORD)
    rec = msg.content.config_records.get("node")
    cls = pid = None
    if rec is not None:
        cls = str(rec["device_class"]) if rec.get("device_class") else None
        pid = int(rec["partition-id"]) if "partition-id" in rec and int(rec["partition-id"]) >= 0 else None
    return (int(msg.metadata.src_node_id), None if tel is None else {str(k): v for k, v in tel.items()}, cls, pid)
