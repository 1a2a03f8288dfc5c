"""Read models for the API and pages, built with a few aggregate queries on the store."""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import case, func, select

from fedswarm.store import Control, Node, NodeRound, Round, Run, Store
from fedswarm.web import schemas
from fedswarm.web.launcher import pid_alive

__all__ = ["display_status", "run_summaries", "run_summary", "run_detail", "rounds", "node_list",
           "policies", "node_stats", "stats_for", "summary_of", "recent_events", "ONLINE_WINDOW_S"]

ONLINE_WINDOW_S = 60.0
LIVE_STATUSES = ("pending", "running", "paused")


def display_status(run: Run) -> str:
    """The run's status, or 'lost' when it should be alive but its process is gone."""
    if run.status in LIVE_STATUSES and run.pid and not pid_alive(run.pid):
        return "lost"
    return run.status


def stats_for(store: Store, run_ids: list[str]) -> dict[str, dict[str, Any]]:
    if not run_ids:
        return {}
    with store.session() as s:
        agg = s.execute(
            select(Round.run_id, func.sum(case((Round.round > 0, 1), else_=0)), func.max(Round.round),
                   func.sum(Round.bytes_up), func.sum(Round.bytes_down), func.max(Round.test_accuracy))
            .where(Round.run_id.in_(run_ids)).group_by(Round.run_id)).all()
        last = select(Round.run_id, func.max(Round.round).label("m")).where(
            Round.run_id.in_(run_ids)).group_by(Round.run_id).subquery()
        accs = s.execute(select(Round.run_id, Round.test_accuracy).join(
            last, (Round.run_id == last.c.run_id) & (Round.round == last.c.m))).all()
    acc = dict(accs)
    return {rid: {"rounds_done": int(n or 0), "last_round": m, "bytes_up": int(up or 0),
                  "bytes_down": int(down or 0), "best_test_accuracy": best,
                  "test_accuracy": acc.get(rid)}
            for rid, n, m, up, down, best in agg}


def summary_of(run: Run, stats: dict[str, Any]) -> schemas.RunOut:
    fields = {k: getattr(run, k) for k in ("id", "name", "status", "strategy", "task", "engine",
                                            "total_rounds", "created_at", "started_at", "finished_at",
                                            "error", "pid")}
    fields.update(stats)
    fields["display_status"] = display_status(run)
    return schemas.RunOut(**{k: schemas.clean(v) for k, v in fields.items()})


def run_summaries(store: Store, limit: int = 200) -> list[schemas.RunOut]:
    runs = store.list_runs(limit=limit)
    stats = stats_for(store, [r.id for r in runs])
    return [summary_of(r, stats.get(r.id, {})) for r in runs]


def run_summary(store: Store, run: Run) -> schemas.RunOut:
    return summary_of(run, stats_for(store, [run.id]).get(run.id, {}))


def node_stats(store: Store, run_id: str) -> list[schemas.NodeStatsOut]:
    with store.session() as s:
        rows = s.execute(
            select(NodeRound.node_id, func.count(), func.sum(NodeRound.bytes_up), func.sum(NodeRound.bytes_down),
                   func.sum(case((NodeRound.status == "rejected", 1), else_=0)),
                   func.sum(case((NodeRound.status == "failed", 1), else_=0)),
                   func.max(NodeRound.round), func.max(NodeRound.device_class))
            .where(NodeRound.run_id == run_id).group_by(NodeRound.node_id).order_by(NodeRound.node_id)
            .limit(2000)).all()
        ids = [r[0] for r in rows]
        seen = dict(s.execute(select(Node.id, Node.last_seen).where(Node.id.in_(ids))).all()) if ids else {}
        reasons = dict(s.execute(
            select(NodeRound.node_id, NodeRound.reason).where(
                NodeRound.run_id == run_id, NodeRound.reason.is_not(None)).order_by(NodeRound.id)).all())
    return [schemas.NodeStatsOut(node_id=n, rounds=c, bytes_up=int(up or 0), bytes_down=int(dn or 0),
                                 rejected=int(rej or 0), failed=int(fail or 0), last_round=lr,
                                 device_class=dc, last_seen=seen.get(n), last_reason=reasons.get(n))
            for n, c, up, dn, rej, fail, lr, dc in rows]


def policies(store: Store, run_id: str | None = None) -> list[schemas.PolicyOut]:
    """Each (run, device class)'s policy: every policy control folded in order."""
    with store.session() as s:
        q = select(Control).where(Control.kind == "policy").order_by(Control.id)
        if run_id is not None:
            q = q.where(Control.run_id == run_id)
        controls = list(s.scalars(q))
    merged: dict[tuple[str, str], schemas.PolicyOut] = {}
    for c in controls:
        dc = str((c.payload or {}).get("device_class", ""))
        key = (c.run_id, dc)
        cur = merged.get(key) or schemas.PolicyOut(run_id=c.run_id, device_class=dc, policy={}, pending=False)
        cur.policy.update((c.payload or {}).get("policy") or {})
        cur.pending = cur.pending or c.applied_at is None
        merged[key] = cur
    return list(merged.values())


def run_detail(store: Store, run: Run) -> schemas.RunDetailOut:
    base = run_summary(store, run).model_dump()
    with store.session() as s:
        controls = list(s.scalars(select(Control).where(Control.run_id == run.id)
                                  .order_by(Control.id.desc()).limit(50)))
    return schemas.RunDetailOut(
        **base, config=run.config or {}, seed=run.seed, code_version=run.code_version or "",
        summary=run.summary or {}, nodes=node_stats(store, run.id),
        controls=[schemas.ControlOut.model_validate(c) for c in controls],
        policies={p.device_class: p.policy for p in policies(store, run.id)},
        events=[schemas.EventOut.model_validate(e) for e in store.events(run.id, limit=50)],
    )


def rounds(store: Store, run_id: str, since: int = -1) -> list[schemas.RoundOut]:
    return [schemas.RoundOut.model_validate(r) for r in store.rounds(run_id, since=since)]


def node_list(store: Store) -> list[schemas.NodeOut]:
    now = dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)
    out = []
    for n in store.list_nodes()[:2000]:
        node = schemas.NodeOut.model_validate(n)
        node.online = (n.status not in ("offline", "failed") and n.last_seen is not None
                       and (now - n.last_seen).total_seconds() < ONLINE_WINDOW_S)
        out.append(node)
    return out


def recent_events(store: Store, limit: int = 100) -> list[schemas.EventOut]:
    return [schemas.EventOut.model_validate(e) for e in store.events(None, limit=limit)]
