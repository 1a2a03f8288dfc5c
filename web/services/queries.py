"""Read models for the API and pages, built with a few aggregate queries on the store."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from sqlalchemy import and_, case, func, or_, select
from sqlalchemy.orm import Session

from fedswarm.store import Control, Node, NodeRound, Round, Run, Store
from fedswarm.web import models
from fedswarm.web.services.fleet import natural_key
from fedswarm.web.services.run_state import (LIVE_STATUSES, Health, allowed_actions, is_remote,
                                             lost_reason, shown_status, timeout_of)

__all__ = ["RunQuery", "list_runs", "run_summaries", "run_summary", "run_detail", "rounds",
           "policies", "node_stats", "stats_for", "summary_of", "recent_events", "device_classes", "SORTS"]

SORTS = {"created": Run.created_at, "name": Run.name, "strategy": Run.strategy, "status": Run.status,
         "rounds": Run.total_rounds}


@dataclass
class RunQuery:
    """Search, filter, sort and page the runs list."""

    q: str | None = None
    status: str | None = None  # a display status: a stored one, or lost / degraded
    strategy: str | None = None
    sort: str = "created"  # created | name | strategy | status | rounds | accuracy
    order: str = "desc"
    limit: int = 50
    offset: int = 0


def _health(row: Any) -> Health:
    return Health(rounds_with_nodes=int(row.with_nodes or 0), bad_rounds=int(row.bad or 0),
                  dead_rounds=int(row.dead or 0), node_rounds=int(row.nodes or 0),
                  failed_node_rounds=int(row.failed or 0))


def stats_for(store: Store, run_ids: list[str], session: Session | None = None) -> dict[str, dict[str, Any]]:
    """Progress, bytes, accuracy, node health and pending controls of each run, from the
    rounds and controls tables (in ``session``'s snapshot when one is given)."""
    if not run_ids:
        return {}
    if session is None:
        with store.session() as s:
            return stats_for(store, run_ids, s)
    s = session
    total = func.coalesce(Round.node_rows, 0)
    failed = func.coalesce(Round.failed_node_rows, 0)
    agg = s.execute(
        select(Round.run_id, func.sum(case((Round.round > 0, 1), else_=0)).label("n"),
               func.max(Round.round).label("m"), func.sum(Round.bytes_up).label("up"),
               func.sum(Round.bytes_down).label("down"), func.max(Round.test_accuracy).label("best"),
               func.sum(case((total > 0, 1), else_=0)).label("with_nodes"),
               func.sum(case((and_(total > 0, 2 * failed > total), 1), else_=0)).label("bad"),
               func.sum(case((and_(total > 0, failed == total), 1), else_=0)).label("dead"),
               func.sum(total).label("nodes"), func.sum(failed).label("failed"))
        .where(Round.run_id.in_(run_ids)).group_by(Round.run_id)).all()
    last = select(Round.run_id, func.max(Round.round).label("m")).where(
        Round.run_id.in_(run_ids)).group_by(Round.run_id).subquery()
    accs = s.execute(select(Round.run_id, Round.test_accuracy).join(
        last, (Round.run_id == last.c.run_id) & (Round.round == last.c.m))).all()
    pending = s.execute(select(Control.run_id, Control.kind).where(
        Control.run_id.in_(run_ids), Control.applied_at.is_(None))).all()
    acc = dict(accs)
    pend: dict[str, set[str]] = {}
    for rid, kind in pending:
        pend.setdefault(rid, set()).add(kind)
    out: dict[str, dict[str, Any]] = {rid: {"pending": sorted(pend.get(rid, ()))} for rid in run_ids}
    for row in agg:
        h = _health(row)
        out[row.run_id].update({
            "rounds_done": int(row.n or 0), "last_round": row.m, "bytes_up": int(row.up or 0),
            "bytes_down": int(row.down or 0), "best_test_accuracy": row.best, "test_accuracy": acc.get(row.run_id),
            "node_rounds": h.node_rounds, "failed_node_rounds": h.failed_node_rounds,
            "bad_rounds": h.bad_rounds, "rounds_with_nodes": h.rounds_with_nodes, "_health": h})
    return out


def summary_of(run: Run, stats: dict[str, Any], timeout_s: float = 120.0, can_restart: bool = False) -> models.RunOut:
    fields = {k: getattr(run, k) for k in ("id", "name", "status", "strategy", "task", "engine",
                                            "total_rounds", "created_at", "started_at", "finished_at",
                                            "error", "pid", "last_report_at")}
    stats = dict(stats)
    health = stats.pop("_health", None)
    fields.update(stats)
    why = lost_reason(run, timeout_s)  # read once: status, reason and error hint agree
    shown = shown_status(run, why, health)
    fields["display_status"] = shown
    fields["lost_reason"] = why
    fields["remote"] = is_remote(run)
    fields["lost_after_s"] = timeout_of(run, timeout_s) if is_remote(run) else None
    fields["actions"] = allowed_actions(run, shown, set(stats.get("pending", ())), can_restart)
    return models.RunOut(**{k: models.clean(v) for k, v in fields.items()})


def _filtered(query: RunQuery):
    q = select(Run)
    if query.q:
        like = f"%{query.q.lower()}%"
        q = q.where(or_(func.lower(Run.id).like(like), func.lower(func.coalesce(Run.name, "")).like(like),
                        func.lower(Run.strategy).like(like), func.lower(Run.task).like(like)))
    if query.strategy:
        q = q.where(Run.strategy == query.strategy)
    if query.status in ("lost",):
        q = q.where(Run.status.in_(LIVE_STATUSES))
    elif query.status in ("degraded",):
        q = q.where(Run.status == "finished")
    elif query.status == "failed":
        q = q.where(Run.status.in_(("failed", "finished")))
    elif query.status:
        q = q.where(Run.status == query.status)
    return q


def list_runs(store: Store, query: RunQuery, timeout_s: float = 120.0) -> tuple[list[models.RunOut], int]:
    """One page of runs matching ``query``, and how many match in all."""
    base = _filtered(query)
    desc = query.order != "asc"
    if query.sort == "accuracy":
        best = select(Round.run_id, func.max(Round.test_accuracy).label("best")).group_by(Round.run_id).subquery()
        col = func.coalesce(best.c.best, -1.0)
        ordered = base.outerjoin(best, best.c.run_id == Run.id).order_by(col.desc() if desc else col.asc(),
                                                                          Run.id)
    else:
        col = SORTS.get(query.sort, Run.created_at)
        ordered = base.order_by(col.desc() if desc else col.asc(), Run.id)
    derived = query.status in ("lost", "degraded", "failed") or (query.status in LIVE_STATUSES)
    with store.session() as s:
        if not derived:
            total = int(s.scalar(select(func.count()).select_from(base.subquery())) or 0)
            runs = list(s.scalars(ordered.limit(query.limit).offset(query.offset)))
        else:  # the shown status is computed: filter the candidates in Python (bounded)
            runs = list(s.scalars(ordered.limit(5000)))
    stats = stats_for(store, [r.id for r in runs])
    out = [summary_of(r, stats.get(r.id, {}), timeout_s) for r in runs]
    if derived:
        out = [r for r in out if r.display_status == query.status]
        total = len(out)
        out = out[query.offset:query.offset + query.limit]
    return out, total


def run_summaries(store: Store, limit: int = 200, timeout_s: float = 120.0) -> list[models.RunOut]:
    return list_runs(store, RunQuery(limit=limit), timeout_s)[0]


def run_summary(store: Store, run: Run, timeout_s: float = 120.0, can_restart: bool = False) -> models.RunOut:
    return summary_of(run, stats_for(store, [run.id]).get(run.id, {}), timeout_s, can_restart)


def node_stats(store: Store, run: Run) -> list[models.NodeStatsOut]:
    run_id = run.id
    with store.session() as s:
        rows = s.execute(
            select(NodeRound.node_id, func.count(), func.sum(NodeRound.bytes_up), func.sum(NodeRound.bytes_down),
                   func.sum(case((NodeRound.status == "rejected", 1), else_=0)),
                   func.sum(case((NodeRound.status == "failed", 1), else_=0)),
                   func.max(NodeRound.round), func.max(NodeRound.device_class))
            .where(NodeRound.run_id == run_id).group_by(NodeRound.node_id)
            .order_by(func.length(NodeRound.node_id), NodeRound.node_id)  # digit ids: by value
            .limit(2000)).all()
        rows.sort(key=lambda r: natural_key(r[0]))  # numbers as numbers inside mixed ids too
        ids = [r[0] for r in rows]
        store_ids = ids + [f"{run_id}:{i}" for i in ids]  # simulated nodes are stored as RUN:NODE
        known = {n.id: n for n in s.scalars(select(Node).where(Node.id.in_(store_ids)))} if ids else {}
        reasons = dict(s.execute(
            select(NodeRound.node_id, NodeRound.reason).where(
                NodeRound.run_id == run_id, NodeRound.reason.is_not(None)).order_by(NodeRound.id)).all())
        latest: dict[str, dict] = {}  # each node's latest telemetry and federated accuracy
        has = NodeRound.telemetry.is_not(None) | NodeRound.fed_accuracy.is_not(None)
        for nid, tel, acc in s.execute(
                select(NodeRound.node_id, NodeRound.telemetry, NodeRound.fed_accuracy).where(
                    NodeRound.run_id == run_id, has).order_by(NodeRound.round)):
            got = latest.setdefault(nid, {})
            if tel:
                got["telemetry"] = tel
            if acc is not None:
                got["fed_accuracy"] = acc
    out = []
    for n, c, up, dn, rej, fail, lr, dc in rows:
        node = known.get(f"{run_id}:{n}") or known.get(n)
        out.append(models.NodeStatsOut(
            node_id=n, rounds=c, bytes_up=int(up or 0), bytes_down=int(dn or 0), rejected=int(rej or 0),
            failed=int(fail or 0), last_round=lr,
            device_class=dc or (node.device_class if node else None) or _class_from_config(run, n),
            last_seen=node.last_seen if node else None, last_reason=reasons.get(n),
            fed_accuracy=latest.get(n, {}).get("fed_accuracy"), telemetry=latest.get(n, {}).get("telemetry"),
            device=device_summary(latest.get(n, {}).get("telemetry"))))
    return out


def device_summary(tel: dict | None) -> str | None:
    """A node's telemetry in a few words (what its source exposed; absent ones left out)."""
    if not tel:
        return None
    parts = []
    if tel.get("train_s") is not None:
        parts.append(f"{tel['train_s']:.2f} s")
    if tel.get("examples_per_s") is not None:
        parts.append(f"{tel['examples_per_s']:.0f} ex/s")
    if tel.get("peak_rss_mb") is not None:
        parts.append(f"{tel['peak_rss_mb']:.0f} MB")
    if tel.get("accelerator"):
        parts.append(str(tel["accelerator"]))
    if tel.get("battery_pct") is not None:
        source = f" ({tel['power_source']})" if tel.get("power_source") else ""
        parts.append(f"battery {tel['battery_pct']:.0f}%{source}")
    elif tel.get("power_source"):
        parts.append(str(tel["power_source"]))
    if tel.get("cpu_temp_c") is not None:
        parts.append(f"{tel['cpu_temp_c']:.0f} °C")
    return " · ".join(parts) or None


def device_classes(store: Store, run: Run, nodes: list[models.NodeStatsOut]) -> list[models.DeviceClassOut]:
    """Per-device-class roll-up of a run's nodes: how many, rounds, failures, bytes."""
    by: dict[str, models.DeviceClassOut] = {}
    for n in nodes:
        dc = n.device_class or "unknown"
        cur = by.setdefault(dc, models.DeviceClassOut(device_class=dc))
        cur.nodes += 1
        cur.node_rounds += n.rounds
        cur.failed += n.failed
        cur.rejected += n.rejected
        cur.bytes_up += n.bytes_up
        cur.bytes_down += n.bytes_down
    return sorted(by.values(), key=lambda d: d.device_class)


def _class_from_config(run: Run, node_id: str) -> str | None:
    """A node's class from the run's ``devices`` spec (``gpu:4,edge-wifi:12``) when its rows do
    not carry one (the decentralized strategies' replies do not). Only where the node id tells
    the partition: the in-process engine gives partition ``i`` node id ``i + 1``."""
    cfg = run.config or {}
    spec, tail = cfg.get("devices"), node_id.rsplit(":", 1)[-1]
    if not spec or not isinstance(spec, str) or cfg.get("engine", "inprocess") != "inprocess" or not tail.isdigit():
        return None
    idx, start = int(tail) - 1, 0
    for part in spec.split(","):
        name, _, count = part.strip().partition(":")
        if not count.strip().isdigit():
            return None
        start += int(count)
        if 0 <= idx < start:
            return name.strip() or None
    return None


def policies(store: Store, run_id: str | None = None) -> list[models.PolicyOut]:
    """Each (run, device class)'s policy: every policy control folded in order."""
    with store.session() as s:
        q = select(Control).where(Control.kind == "policy").order_by(Control.id)
        if run_id is not None:
            q = q.where(Control.run_id == run_id)
        controls = list(s.scalars(q.limit(10_000)))
    merged: dict[tuple[str, str], models.PolicyOut] = {}
    for c in controls:
        dc = str((c.payload or {}).get("device_class", ""))
        key = (c.run_id, dc)
        cur = merged.get(key) or models.PolicyOut(run_id=c.run_id, device_class=dc, policy={}, pending=False)
        cur.policy.update((c.payload or {}).get("policy") or {})
        cur.pending = cur.pending or c.applied_at is None
        merged[key] = cur
    return list(merged.values())


def run_detail(store: Store, run: Run, timeout_s: float = 120.0, can_restart: bool = False,
               error_hint: Callable[[Run, str], str | None] | None = None) -> models.RunDetailOut:
    """``error_hint(run, why_lost)``: the error to show for a lost run that recorded none,
    given the reason this answer's summary found (so the two never disagree)."""
    base = run_summary(store, run, timeout_s, can_restart).model_dump()
    if not base.get("error") and base.get("lost_reason") and error_hint is not None:
        base["error"] = error_hint(run, base["lost_reason"])
    with store.session() as s:
        controls = list(s.scalars(select(Control).where(Control.run_id == run.id)
                                  .order_by(Control.id.desc()).limit(50)))
    nodes = node_stats(store, run)
    return models.RunDetailOut(
        **base, config=run.config or {}, seed=run.seed, code_version=run.code_version or "",
        summary=run.summary or {}, nodes=nodes, device_classes=device_classes(store, run, nodes),
        controls=[models.ControlOut.model_validate(c) for c in controls],
        policies={p.device_class: p.policy for p in policies(store, run.id)},
        events=[models.EventOut.model_validate(e) for e in store.events(run.id, limit=50)],
        rejections=[models.RejectionOut.model_validate(r) for r in store.rejections(run.id, limit=100)],
    )


def rounds(store: Store, run_id: str, since: int = -1, limit: int = 100_000) -> list[models.RoundOut]:
    with store.session() as s:
        q = (select(Round).where(Round.run_id == run_id, Round.round > since).order_by(Round.round).limit(limit))
        return [models.RoundOut.model_validate(r) for r in s.scalars(q)]


def recent_events(store: Store, limit: int = 100) -> list[models.EventOut]:
    return [models.EventOut.model_validate(e) for e in store.events(None, limit=limit)]
