"""The fleet: the real nodes an operator runs, each in an honest state.

The fleet is the store's nodes of every kind but ``sim`` (Flower SuperNodes recorded by
deployment runs, swarm peers reporting through ingest, remote ServerApps) merged with the
SuperNodes the configured SuperLink lists. Simulated nodes are not a fleet: they are listed
under their run only. A node's state, from the best evidence there is:

* ``offline``: the SuperLink says so (since its ``offline-at``), or, without a SuperLink
  entry, the node said so or was not heard from for :data:`ONLINE_WINDOW_S` while no live
  run holds it (since its last-seen time);
* ``failed``: reachable, but its last round failed or its update was rejected;
* ``training``: reachable, and the run it was last seen in is live (not ended, not lost); a node
  its run's last round did not pick (``--eligible``, ``--availability``: its node status
  ``ineligible`` or ``unavailable``) is ``online``, and the detail says why, from its row;
* ``online``: reachable and idle.

Filtering, sorting (node ids naturally: numbers as numbers) and paging happen here, on the
server; the store query reads the fleet's rows only (``ix_nodes_kind_last_seen``), never the
simulated nodes, however many there are.
"""

from __future__ import annotations

import datetime as dt
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

from sqlalchemy import case, exists, func, select

from fedswarm.store import Node, NodeRound, Round, Run, Store
from fedswarm.store.rows import NOT_PICKED
from fedswarm.web.models import (FLEET_STATES, FleetNodeOut, NodeDetailOut, NodeRoundOut, NodeRunOut, NodesOut,
                                 SuperNodesOut, clean, telemetry_of)
from fedswarm.web.services.run_state import LIVE_STATUSES, lost_reason

__all__ = ["FleetQuery", "fleet", "node_detail", "natural_key", "FLEET_KINDS", "FLEET_SORTS", "ONLINE_WINDOW_S"]

ONLINE_WINDOW_S = 60.0  # a node not heard from for longer, outside a live run, is offline
FLEET_KINDS = ("supernode", "peer", "serverapp")
FLEET_SORTS = ("state", "id", "last_seen", "device_class")
MAX_FLEET = 50_000
HISTORY_ROUNDS = 2000
_STATE_RANK = {s: i for i, s in enumerate(FLEET_STATES)}
_GONE = ("unregistered", "deleted")  # SuperLink entries that are no longer part of the fleet


def natural_key(node_id: str) -> tuple:
    """Sort key that orders the digit runs of an id as numbers: ``2 < 10``, ``run:4 < run:15``,
    SuperNode ids (large integers) by value; text parts stay alphabetical."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"(\d+)", str(node_id)) if p)


@dataclass
class FleetQuery:
    state: str | None = None
    device_class: str | None = None
    run_id: str | None = None
    kind: str | None = None
    q: str | None = None  # substring of the id or the SuperLink owner name
    sort: str = "state"
    order: str = "asc"
    limit: int = 100
    offset: int = 0


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)


def _ts(value: Any) -> dt.datetime | None:
    """A SuperLink timestamp (``2026-01-02 03:04:05Z``, ISO 8601, or ``N/A``) as naive UTC."""
    if not isinstance(value, str) or not value.strip() or value.strip() == "N/A":
        return None
    try:
        t = dt.datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError:
        return None
    return t.astimezone(dt.timezone.utc).replace(tzinfo=None) if t.tzinfo else t


def _fmt(t: dt.datetime) -> str:
    return f"{t:%Y-%m-%d %H:%M:%S} UTC"


def _superlink_index(sn: SuperNodesOut) -> dict[str, dict[str, Any]]:
    out = {}
    for d in sn.nodes:
        nid = d.get("node-id", d.get("node_id"))
        if nid is not None and str(d.get("status", "")) not in _GONE:
            out[str(nid)] = d
    return out


@dataclass
class _Row:
    """A fleet node's state, cheap to filter and sort; made a :class:`FleetNodeOut` only when on the page."""

    id: str
    node: Node | None
    link: dict | None  # the SuperLink's entry
    run: Run | None
    state: str
    detail: str
    since: dt.datetime | None
    reachable: bool

    @property
    def kind(self) -> str:
        return self.node.kind if self.node is not None else "supernode"

    @property
    def device_class(self) -> str | None:
        return self.node.device_class if self.node is not None else None

    @property
    def run_id(self) -> str | None:
        return self.node.run_id if self.node is not None else None

    @property
    def last_seen(self) -> dt.datetime | None:
        return self.node.last_seen if self.node is not None else None

    @property
    def owner_name(self) -> str | None:
        name = self.link.get("owner-name") if self.link else None
        return str(name)[:100] if name is not None else None

    def out(self) -> FleetNodeOut:
        n, link = self.node, self.link
        return FleetNodeOut(
            id=self.id, kind=self.kind, state=self.state, state_detail=self.detail, online=self.reachable,
            since=self.since, run_id=self.run_id, run_status=self.run.status if self.run is not None else None,
            device_class=self.device_class, superlink_status=str(link.get("status")) if link else None,
            owner_name=self.owner_name, rejected_updates=(n.rejected_updates or 0) if n is not None else 0,
            last_seen=self.last_seen, telemetry=telemetry_of(n.telemetry if n is not None else None),
            info=(n.info or {}) if n is not None else {})


def _not_picked_reasons(s, nodes: list[Node]) -> dict[str, str]:
    """Why each node its run's sampling left out was not picked: the reason of its newest row there."""
    out: dict[str, str] = {}
    for n in nodes:
        if n.status in NOT_PICKED and n.run_id:
            local = n.id.split(":", 1)[1] if n.kind == "sim" and ":" in n.id else n.id
            row = s.execute(select(NodeRound.round, NodeRound.reason).where(
                NodeRound.run_id == n.run_id, NodeRound.node_id == local, NodeRound.status == n.status)
                .order_by(NodeRound.round.desc()).limit(1)).first()
            if row is not None:
                out[n.id] = f"not picked in round {row.round} of run {n.run_id}: {row.reason or n.status}"
    return out


def _row(node_id: str, n: Node | None, sn: dict | None, run: Run | None, run_live: bool, now: dt.datetime,
         not_picked: str | None = None) -> _Row:
    """The node's state from the best evidence (the module's docstring says which)."""
    last_seen = n.last_seen if n is not None else None
    age = (now - last_seen).total_seconds() if last_seen is not None else None
    status = n.status if n is not None else None
    run_id = n.run_id if n is not None else None
    if sn is not None:  # the SuperLink knows whether the node is connected
        reachable = sn.get("status") == "online"
    else:
        reachable = status != "offline" and ((age is not None and age < ONLINE_WINDOW_S)
                                             or (n is not None and n.kind == "supernode" and run_live))
    since = None
    if not reachable:
        since = (_ts(sn.get("offline-at")) if sn else None) or last_seen
        state = "offline"
        if sn is not None and sn.get("status") == "registered":
            detail = "registered on the SuperLink, never connected"
        else:
            detail = f"offline since {_fmt(since)}" if since else "offline"
    elif status in ("failed", "rejected"):
        state, since = "failed", last_seen
        what = "failed" if status == "failed" else "had its update rejected"
        detail = f"{what} in its last round" + (f" of run {run_id}" if run_id else "")
    elif not_picked:
        state, detail = "online", not_picked
    elif run_live and run_id:
        state, detail = "training", f"training in run {run_id}"
    else:
        state = "online"
        since = _ts(sn.get("online-at")) if sn else None
        detail = f"online since {_fmt(since)}" if since else "online"
    return _Row(node_id, n, sn, run, state, detail, since, reachable)


def _runs_live(runs: dict[str, Run], timeout_s: float, now: dt.datetime) -> dict[str, bool]:
    return {rid: r.status in LIVE_STATUSES and lost_reason(r, timeout_s, now) is None for rid, r in runs.items()}


def fleet_nodes(store: Store, sn: SuperNodesOut, timeout_s: float = 120.0,
                now: dt.datetime | None = None) -> tuple[list[_Row], int]:
    """Every fleet node with its state, and how many simulated nodes the store holds."""
    now = now or _now()
    with store.session() as s:
        nodes = list(s.scalars(select(Node).where(Node.kind.in_(FLEET_KINDS)).limit(MAX_FLEET)))
        run_ids = sorted({n.run_id for n in nodes if n.run_id})
        runs: dict[str, Run] = {}
        for i in range(0, len(run_ids), 500):
            runs.update((r.id, r) for r in s.scalars(select(Run).where(Run.id.in_(run_ids[i:i + 500]))))
        simulated = int(s.scalar(select(func.count()).select_from(Node).where(Node.kind == "sim")) or 0)
        why = _not_picked_reasons(s, nodes)
    live = _runs_live(runs, timeout_s, now)
    links = _superlink_index(sn)
    out = [_row(n.id, n, links.get(n.id), runs.get(n.run_id or ""), live.get(n.run_id or "", False), now,
                why.get(n.id)) for n in nodes]
    known = {n.id for n in nodes}
    out += [_row(nid, None, d, None, False, now) for nid, d in links.items() if nid not in known]
    return out, simulated


def _sort_key(sort: str):
    if sort == "id":
        return lambda e: natural_key(e.id)
    if sort == "last_seen":
        return lambda e: (e.last_seen or dt.datetime.min, natural_key(e.id))
    if sort == "device_class":
        return lambda e: (e.device_class is None, e.device_class or "", natural_key(e.id))
    return lambda e: (_STATE_RANK[e.state], natural_key(e.id))


def fleet(store: Store, sn: SuperNodesOut, query: FleetQuery, timeout_s: float = 120.0,
          now: dt.datetime | None = None) -> NodesOut:
    """One page of the fleet matching ``query``, with counts per state and the filters' choices."""
    entries, simulated = fleet_nodes(store, sn, timeout_s, now)
    text = (query.q or "").lower()
    chosen = [e for e in entries
              if (not query.device_class or e.device_class == query.device_class)
              and (not query.run_id or e.run_id == query.run_id)
              and (not query.kind or e.kind == query.kind)
              and (not text or text in f"{e.id} {e.owner_name or ''}".lower())]
    counts = {s: 0 for s in FLEET_STATES}
    counts.update(Counter(e.state for e in chosen))
    rows = [e for e in chosen if not query.state or e.state == query.state]
    rows.sort(key=_sort_key(query.sort), reverse=query.order == "desc")
    page = [e.out() for e in rows[query.offset:query.offset + query.limit]]
    return NodesOut(nodes=page, total=len(rows), limit=query.limit, offset=query.offset, counts=counts,
                    device_classes=sorted({e.device_class for e in entries if e.device_class}),
                    runs=sorted({e.run_id for e in entries if e.run_id}), simulated_nodes=simulated, supernodes=sn)


def node_detail(store: Store, node_id: str, sn: SuperNodesOut, timeout_s: float = 120.0) -> NodeDetailOut | None:
    """A node's fleet entry, its runs and its rounds with their telemetry; None if nothing knows it.

    A fleet node's history is its rows in every run except those where a simulated node had
    the same id (``RUN:ID`` in the nodes table: the in-process engine numbers its nodes 1, 2, ...);
    a simulated node's (``RUN:ID``) is its rows in that run only."""
    now = _now()
    with store.session() as s:
        node = s.get(Node, node_id)
        simulated = node is not None and node.kind == "sim"
        if simulated and ":" in node_id:
            run_part, local = node_id.split(":", 1)
            cond = (NodeRound.run_id == run_part) & (NodeRound.node_id == local)
        else:
            sim_twin = exists().where(Node.id == NodeRound.run_id + ":" + NodeRound.node_id)
            cond = (NodeRound.node_id == node_id) & ~sim_twin
        agg = s.execute(
            select(NodeRound.run_id, func.count(), func.sum(case((NodeRound.status == "failed", 1), else_=0)),
                   func.sum(case((NodeRound.status == "rejected", 1), else_=0)), func.sum(NodeRound.bytes_up),
                   func.sum(NodeRound.bytes_down), func.min(NodeRound.round), func.max(NodeRound.round),
                   Run.name, Run.status, Run.created_at)
            .join(Run, Run.id == NodeRound.run_id).where(cond)
            .group_by(NodeRound.run_id, Run.name, Run.status, Run.created_at)
            .order_by(Run.created_at.desc())).all()
        hist = s.execute(
            select(NodeRound, Round.created_at).outerjoin(
                Round, (Round.run_id == NodeRound.run_id) & (Round.round == NodeRound.round))
            .where(cond).order_by(NodeRound.id.desc()).limit(HISTORY_ROUNDS)).all()
        run = s.get(Run, node.run_id) if node is not None and node.run_id else None
        why = _not_picked_reasons(s, [node]) if node is not None else {}
    link = None if simulated else _superlink_index(sn).get(node_id)
    if node is None and link is None and not agg:
        return None
    entry = None
    if not simulated and (node is not None or link is not None):
        live = _runs_live({run.id: run}, timeout_s, now).get(run.id, False) if run is not None else False
        entry = _row(node_id, node, link, run, live, now, why.get(node_id)).out()
    runs = [NodeRunOut(run_id=rid, name=name, status=status, rounds=int(c or 0), failed=int(f or 0),
                       rejected=int(rj or 0), bytes_up=int(up or 0), bytes_down=int(dn or 0), first_round=lo,
                       last_round=hi)
            for rid, c, f, rj, up, dn, lo, hi, name, status, _ in agg]
    rounds = [NodeRoundOut(run_id=nr.run_id, round=nr.round, at=at, status=nr.status, reason=nr.reason,
                           bytes_up=nr.bytes_up or 0, bytes_down=nr.bytes_down or 0,
                           train_loss=clean(nr.train_loss), telemetry=telemetry_of(nr.telemetry))
              for nr, at in reversed(hist)]
    return NodeDetailOut(node=entry, simulated=simulated, runs=runs, rounds=rounds)
