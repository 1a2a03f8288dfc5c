"""The rule for whether a node is online, as SQL, for counts over many nodes (``/metrics``)
and for noticing nodes that went offline (webhooks).

A fleet node (:data:`fedswarm.web.services.fleet.FLEET_KINDS`) is online when it was heard
from within :data:`fedswarm.web.services.fleet.ONLINE_WINDOW_S` (the Nodes page's window) and
did not report itself offline or failed; otherwise offline. A simulated node (kind ``sim``)
counts only while its run is live, by the same rule. Both users go through
:func:`online_clause`, so changing the rule here changes it for both.
"""

from __future__ import annotations

import datetime as dt

from sqlalchemy import and_, case, func, or_, select
from sqlalchemy.orm import Session

from fedswarm.store import Node, Run
from fedswarm.web.services.fleet import FLEET_KINDS, ONLINE_WINDOW_S
from fedswarm.web.services.run_state import LIVE_STATUSES

__all__ = ["FLEET_KINDS", "online_clause", "counted_clause", "node_state_counts"]

DOWN_STATUSES = ("offline", "failed")


def online_clause(now: dt.datetime):
    return and_(Node.status.not_in(DOWN_STATUSES), Node.last_seen >= now - dt.timedelta(seconds=ONLINE_WINDOW_S))


def counted_clause():
    """The nodes that are counted: fleet nodes, and simulated nodes of live runs."""
    live = select(Run.id).where(Run.status.in_(LIVE_STATUSES))
    return or_(Node.kind.in_(FLEET_KINDS), and_(Node.kind == "sim", Node.run_id.in_(live)))


def node_state_counts(s: Session, now: dt.datetime) -> dict[tuple[str, str], int]:
    """(state, device class) -> how many counted nodes are in it; class ``unknown`` when unset."""
    state = case((online_clause(now), "online"), else_="offline")
    dc = func.coalesce(Node.device_class, "unknown")
    rows = s.execute(select(state, dc, func.count()).where(counted_clause()).group_by(state, dc)).all()
    return {(str(st), str(c)): int(n) for st, c, n in rows}
