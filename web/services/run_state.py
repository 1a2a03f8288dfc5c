"""What state a run is really in, and which actions make sense in it.

The store's status is what the run's process last wrote. The dashboard shows more honest
states on top of it:

* ``lost``: the store says the run is live, but its process is gone, or a run that reports
  through ingest has sent nothing for longer than its timeout (shown on the page); the rule is
  :func:`fedswarm.store.liveness.lost_reason`, which ``fedswarm runs`` applies too.
* ``degraded``: the run finished, but in most rounds that recorded nodes, most nodes failed
  or had their update rejected; ``failed`` when every node failed in every such round. A run
  that trained on almost nobody is not a green "finished".

:func:`allowed_actions` is the one rule for which buttons are enabled: the pages, the live
updates and the API's 409 answers all use it.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedswarm.store import Run
from fedswarm.store.liveness import LIVE_STATUSES, REPORT_TIMEOUT_S, is_remote, lost_reason, timeout_of

__all__ = ["LIVE_STATUSES", "Health", "display_status", "shown_status", "lost_reason", "allowed_actions", "ACTIONS",
           "is_remote", "timeout_of"]

ACTIONS = ("pause", "resume", "stop", "kill", "add_rounds", "policy", "restart")


@dataclass(frozen=True)
class Health:
    """Node failures of a run, counted per round from the rounds' counters."""

    rounds_with_nodes: int = 0
    bad_rounds: int = 0  # rounds where more than half the nodes failed or were rejected
    dead_rounds: int = 0  # rounds where every node failed
    node_rounds: int = 0
    failed_node_rounds: int = 0

    @property
    def degraded(self) -> bool:
        return self.rounds_with_nodes > 0 and 2 * self.bad_rounds > self.rounds_with_nodes

    @property
    def all_failed(self) -> bool:
        return self.rounds_with_nodes > 0 and self.dead_rounds == self.rounds_with_nodes


def display_status(run: Run, default_timeout_s: float = REPORT_TIMEOUT_S, health: Health | None = None) -> str:
    """The status a viewer sees (reads the process's liveness)."""
    return shown_status(run, lost_reason(run, default_timeout_s), health)


def shown_status(run: Run, why_lost: str | None, health: Health | None = None) -> str:
    """:func:`display_status` given the run's :func:`lost_reason`, read by the caller: an
    answer that also shows the reason must read liveness once, or a process that dies
    between two reads shows as lost with no reason (or as running with one)."""
    if why_lost is not None:
        return "lost"
    if run.status == "finished" and health is not None:
        if health.all_failed:
            return "failed"
        if health.degraded:
            return "degraded"
    return run.status


def allowed_actions(run: Run, shown: str, pending: set[str] | frozenset[str] = frozenset(),
                    can_restart: bool = False) -> dict[str, str | None]:
    """Each action -> None when it is valid now, else why not (the button's tooltip)."""
    live = shown in LIVE_STATUSES
    out: dict[str, str | None] = {}
    out["pause"] = (None if shown in ("running", "pending") and "pause" not in pending
                    else "a pause is already waiting to be applied" if "pause" in pending
                    else f"the run is {shown}")
    out["resume"] = (None if (shown == "paused" or "pause" in pending) and "resume" not in pending
                     else "a resume is already waiting to be applied" if "resume" in pending
                     else f"the run is {shown}, not paused")
    out["stop"] = (None if (live or shown == "lost") and "stop" not in pending
                   else "a stop is already waiting to be applied" if "stop" in pending
                   else f"the run is {shown}")
    out["kill"] = None if live and run.pid else ("the run has no local process" if live else f"the run is {shown}")
    out["add_rounds"] = None if live else f"the run is {shown}; rounds can be added to a live run only"
    out["policy"] = None if live else f"the run is {shown}; policies apply to a live run only"
    if shown in ("failed", "lost", "stopped", "degraded"):
        out["restart"] = None if can_restart else ("resuming from a checkpoint needs `fedswarm resume` and a "
                                                   "checkpoint of this run; neither is available")
    else:
        out["restart"] = f"the run is {shown}; only a failed, lost or stopped run can be resumed from a checkpoint"
    return out
