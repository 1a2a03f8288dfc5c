"""The run store: every runtime writes it, the dashboard reads it (the queries: :class:`Store`).

SQLAlchemy 2.0; an SQLite file by default (``--db PATH_OR_URL`` or ``FEDSWARM_DB``),
PostgreSQL by URL. Tables (docs/architecture.md, "Where state lives"): runs, rounds, node_rounds, nodes,
events, checkpoints, controls. ``result.json`` is an export of one run
(:meth:`Store.export_result`). The tables are in :mod:`fedswarm.store.schema`, their creation and
upgrades in :mod:`fedswarm.store.migrations`; what this module names is re-exported by
:mod:`fedswarm.store`, where callers import it from.
"""

from __future__ import annotations

import json
import os
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from sqlalchemy import (
    case,
    create_engine,
    delete,
    event,
    func,
    select,
    update,
)
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, defer, sessionmaker

from fedswarm.store.migrations import create_schema, migrate, sqlite_pragmas
from fedswarm.store.rows import RowConflict, _add_node_rows, _add_rejections
from fedswarm.store.schema import (
    CONTROL_KINDS,
    RUN_STATUSES,
    Base,
    Checkpoint,
    Control,
    Event,
    Node,
    NodeRound,
    Rejection,
    Round,
    Run,
    _now,
)

__all__ = [
    "Base",
    "Run",
    "Round",
    "NodeRound",
    "Rejection",
    "Node",
    "Event",
    "Checkpoint",
    "Control",
    "Store",
    "RowConflict",
    "default_db_url",
    "create_schema",
    "migrate",
    "to_url",
    "RUN_STATUSES",
    "CONTROL_KINDS",
]

# Connections one Store may hold at once. The dashboard serves every sync route from
# anyio's thread pool (40 threads) and more work through asyncio.to_thread (up to 32);
# SQLAlchemy's default pool (5 + 10 overflow) made the rest wait for a connection, and after
# 30 s fail with 500, under load. Overflow connections are closed when returned, so an idle
# store keeps at most POOL_SIZE open.
POOL_SIZE = 10
POOL_OVERFLOW = 64


def default_db_url() -> str:
    """``FEDSWARM_DB`` if set, else ``./fedswarm.db``."""
    return os.environ.get("FEDSWARM_DB") or "fedswarm.db"


def to_url(path_or_url: str | os.PathLike) -> str:
    s = str(path_or_url)
    if "://" in s:
        return s
    return f"sqlite:///{Path(s).expanduser().resolve()}"


class Store:
    """A handle on the run store. Thread-safe; one per process is enough."""

    def __init__(self, path_or_url: str | os.PathLike | None = None):
        self.url = to_url(path_or_url or default_db_url())
        kwargs: dict[str, Any] = {"future": True}
        if self.url.startswith("sqlite"):
            kwargs["connect_args"] = {"check_same_thread": False, "timeout": 30}
        u = make_url(self.url)
        if not (u.get_backend_name() == "sqlite" and u.database in (None, "", ":memory:")):  # not one shared conn
            kwargs.update(pool_size=POOL_SIZE, max_overflow=POOL_OVERFLOW)
        self.engine: Engine = create_engine(self.url, **kwargs)
        if self.url.startswith("sqlite"):
            event.listen(self.engine, "connect", sqlite_pragmas)
        migrate(self.engine)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)

    @contextmanager
    def session(self) -> Iterator[Session]:
        with self._sessions() as s:
            try:
                yield s
                s.commit()
            except BaseException:
                s.rollback()
                raise

    @contextmanager
    def snapshot(self) -> Iterator[Session]:
        """A read-only session whose queries all see one consistent state of the store (a
        reader that needs two tables to agree, e.g. a run's status and its pending controls)."""
        with self._sessions() as s:
            if self.engine.dialect.name == "sqlite":
                s.connection().exec_driver_sql("BEGIN")  # pysqlite opens no transaction for reads
            else:
                s.connection(execution_options={"isolation_level": "REPEATABLE READ"})
            try:
                yield s
            finally:
                s.rollback()

    def close(self) -> None:
        self.engine.dispose()

    # -- runs --------------------------------------------------------------------------
    def create_run(self, config: dict, *, name: str | None = None, run_id: str | None = None,
                   status: str = "pending", **fields: Any) -> str:
        """Insert a run; ``fields`` are further :class:`Run` columns (``owner``...), written in
        the same commit, so no reader ever sees the run without them. A ``run_id`` that exists
        raises :class:`sqlalchemy.exc.IntegrityError`."""
        rid = run_id or uuid.uuid4().hex[:12]
        with self.session() as s:
            s.add(Run(
                **fields,
                id=rid,
                name=name or config.get("name"),
                status=status,
                strategy=str(config.get("strategy", "")),
                task=str(config.get("task", "")),
                engine=str(config.get("engine", "")),
                config=config,
                seed=int(config.get("seed", 0)),
                code_version=_code_version(),
                total_rounds=int(config.get("rounds", 0)),
            ))
        self.add_event(rid, "created", f"run {rid} created")
        return rid

    def get_run(self, run_id: str) -> Run | None:
        with self.session() as s:
            return s.get(Run, run_id)

    def list_runs(self, limit: int = 100) -> list[Run]:
        with self.session() as s:
            return list(s.scalars(select(Run).order_by(Run.created_at.desc()).limit(limit)))

    def update_run(self, run_id: str, **fields: Any) -> None:
        with self.session() as s:
            run = s.get(Run, run_id)
            if run is None:
                raise KeyError(f"no run {run_id!r} in the store")
            for k, v in fields.items():
                setattr(run, k, v)

    def set_status(self, run_id: str, status: str, *, error: str | None = None,
                   actor: str | None = None) -> None:
        if status not in RUN_STATUSES:
            raise ValueError(f"unknown run status {status!r}")
        fields: dict[str, Any] = {"status": status}
        if status == "running":
            run = self.get_run(run_id)
            if run is not None and run.started_at is None:
                fields["started_at"] = _now()
        if status in ("finished", "failed", "stopped"):
            fields["finished_at"] = _now()
        if error is not None:
            fields["error"] = error
        self.update_run(run_id, **fields)
        self.add_event(run_id, "status", f"run is {status}" + (f": {error}" if error else ""), actor=actor)

    # -- rounds ------------------------------------------------------------------------
    def add_round(self, run_id: str, round: int, *, nodes: list[dict] | None = None,
                  rejections: dict[str, str] | None = None, **fields: Any) -> None:
        """One round's row with its per-node rows ``nodes`` (as :meth:`add_node_rounds`) and
        rejected replies ``rejections`` (as :meth:`add_rejections`) in one transaction: a writer
        that fails halfway, or whose retry finds the round recorded
        (:class:`sqlalchemy.exc.IntegrityError`), never leaves a round without its node rows, nor
        node rows without their round."""
        known = {c.name for c in Round.__table__.columns} - {"id", "run_id", "round", "created_at"}
        extra = {k: v for k, v in fields.items() if k not in known}
        cols = {k: v for k, v in fields.items() if k in known}
        metrics = dict(cols.pop("metrics", {}) or {})
        metrics.update(extra)
        with self.session() as s:
            row = Round(run_id=run_id, round=round, metrics=metrics, **cols)
            s.add(row)
            s.flush()  # the round first: a round recorded already fails here, before any node row
            _add_node_rows(s, run_id, round, nodes or [])
            s.flush()
            # counted, not incremented: rows written before their round (by an older fedswarm's
            # engines) count too; a round without node rows keeps NULL
            total, failed = s.execute(select(func.count(), func.sum(case((NodeRound.status != "ok", 1), else_=0)))
                                      .where(NodeRound.run_id == run_id, NodeRound.round == round)).one()
            if total:
                row.node_rows, row.failed_node_rows = int(total), int(failed or 0)
            if rejections:
                _add_rejections(s, run_id, round, rejections)

    def rounds(self, run_id: str, since: int = -1) -> list[Round]:
        with self.session() as s:
            q = select(Round).where(Round.run_id == run_id, Round.round > since).order_by(Round.round)
            return list(s.scalars(q))

    def add_node_rounds(self, run_id: str, round: int, rows: list[dict]) -> None:
        """Per-node rows of a round; the round's ``node_rows``/``failed_node_rows`` counters
        (what the dashboard's health and "degraded" state read) are kept in the same commit.
        Idempotent: a row the store holds with the same values (a retry) is skipped; one with
        other values raises :class:`RowConflict`, which names it."""
        for attempt in range(2):
            try:
                with self.session() as s:
                    fresh = _add_node_rows(s, run_id, round, rows)
                    failed = sum(1 for r in fresh if r["status"] != "ok")
                    s.execute(update(Round).where(Round.run_id == run_id, Round.round == round).values(
                        node_rows=func.coalesce(Round.node_rows, 0) + len(fresh),
                        failed_node_rows=func.coalesce(Round.failed_node_rows, 0) + failed))
                return
            except IntegrityError:
                # another writer inserted some of these rows between our read and our insert
                # (the unique (run_id, round, node_id)); the second pass compares with them
                if attempt:
                    raise

    def node_rounds(self, run_id: str) -> list[NodeRound]:
        with self.session() as s:
            q = select(NodeRound).where(NodeRound.run_id == run_id).order_by(NodeRound.round, NodeRound.node_id)
            return list(s.scalars(q))

    def add_rejections(self, run_id: str, round: int, reasons: dict[str, str]) -> None:
        """The round's rejected replies, ``{node id: reason}``."""
        with self.session() as s:
            _add_rejections(s, run_id, round, reasons)

    def rejections(self, run_id: str, limit: int | None = None) -> list[Rejection]:
        """Rejected replies of a run, newest round first."""
        with self.session() as s:
            q = select(Rejection).where(Rejection.run_id == run_id).order_by(Rejection.round.desc(), Rejection.id)
            if limit is not None:
                q = q.limit(limit)
            return list(s.scalars(q))

    # -- nodes -------------------------------------------------------------------------
    def upsert_node(self, node_id: str, **fields: Any) -> None:
        self.upsert_nodes({node_id: fields})

    def upsert_nodes(self, nodes: dict[str, dict[str, Any]]) -> None:
        """:meth:`upsert_node` for many nodes in one commit (a round's thousands of simulated nodes)."""
        ids = list(nodes)
        for attempt in range(2):
            try:
                now = _now()
                with self.session() as s:
                    have: dict[str, Node] = {}
                    for i in range(0, len(ids), 500):  # bounded IN lists (SQLite's parameter limit)
                        have.update((n.id, n) for n in s.scalars(select(Node).where(Node.id.in_(ids[i:i + 500]))))
                    for node_id, fields in nodes.items():
                        node = have.get(node_id)
                        if node is None:
                            node = Node(id=node_id)
                            s.add(node)
                        for k, v in fields.items():
                            setattr(node, k, v)
                        node.last_seen = now
                return
            except IntegrityError:
                # Two first reports of one node at once (a heartbeat and its retry): the other
                # inserted it between our read and our insert; the second pass updates it.
                if attempt:
                    raise

    def list_nodes(self, run_id: str | None = None) -> list[Node]:
        with self.session() as s:
            q = select(Node).order_by(Node.last_seen.desc())
            if run_id is not None:
                q = q.where(Node.run_id == run_id)
            return list(s.scalars(q))

    # -- events, checkpoints, controls -------------------------------------------------
    def add_event(self, run_id: str | None, kind: str, message: str = "", *,
                  data: dict | None = None, actor: str | None = None) -> None:
        with self.session() as s:
            s.add(Event(run_id=run_id, kind=kind, message=message, data=data or {}, actor=actor))

    def events(self, run_id: str | None = None, limit: int = 200) -> list[Event]:
        with self.session() as s:
            q = select(Event).order_by(Event.id.desc()).limit(limit)
            if run_id is not None:
                q = q.where(Event.run_id == run_id)
            return list(s.scalars(q))

    def add_checkpoint(self, run_id: str, round: int, path: str) -> None:
        with self.session() as s:
            s.add(Checkpoint(run_id=run_id, round=round, path=path))

    def latest_checkpoint(self, run_id: str) -> Checkpoint | None:
        """The newest checkpoint's row (its ``data`` not loaded: see :meth:`checkpoint_data`)."""
        with self.session() as s:
            q = (select(Checkpoint).options(defer(Checkpoint.data)).where(Checkpoint.run_id == run_id)
                 .order_by(Checkpoint.round.desc(), Checkpoint.id.desc()))
            return s.scalars(q).first()

    def save_checkpoint(self, run_id: str, round: int, data: bytes, *, keep: int = 2) -> None:
        """Keep ``data`` as the run's checkpoint after ``round``, in one transaction that also
        drops all but the newest ``keep`` checkpoints of the run: a process killed at any
        instant leaves the previous checkpoint or this one, never part of one."""
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        with self.session() as s:
            s.execute(delete(Checkpoint).where(Checkpoint.run_id == run_id, Checkpoint.round >= round))
            s.add(Checkpoint(run_id=run_id, round=round, path=f"store:checkpoints/{run_id}/{round}",
                             data=data, size_bytes=len(data)))
            s.flush()
            old = select(Checkpoint.id).where(Checkpoint.run_id == run_id).order_by(
                Checkpoint.round.desc(), Checkpoint.id.desc()).offset(keep)
            s.execute(delete(Checkpoint).where(Checkpoint.id.in_(list(s.scalars(old)))))

    def checkpoint_data(self, run_id: str) -> tuple[int, bytes] | None:
        """(round, bytes) of the run's newest checkpoint kept in the store, or None."""
        with self.session() as s:
            q = (select(Checkpoint.round, Checkpoint.data).where(Checkpoint.run_id == run_id,
                                                                 Checkpoint.data.is_not(None))
                 .order_by(Checkpoint.round.desc(), Checkpoint.id.desc()).limit(1))
            row = s.execute(q).first()
            return (int(row[0]), bytes(row[1])) if row is not None else None

    def drop_rounds_after(self, run_id: str, round: int) -> int:
        """Delete the round, per-node and rejection rows after ``round`` (a resumed run redoes
        those rounds from its checkpoint, so each round stays recorded once); how many rounds."""
        with self.session() as s:
            n = s.execute(delete(Round).where(Round.run_id == run_id, Round.round > round)).rowcount
            s.execute(delete(NodeRound).where(NodeRound.run_id == run_id, NodeRound.round > round))
            s.execute(delete(Rejection).where(Rejection.run_id == run_id, Rejection.round > round))
            return int(n or 0)

    def add_control(self, run_id: str, kind: str, payload: dict | None = None, *,
                    actor: str | None = None) -> int:
        if kind not in CONTROL_KINDS:
            raise ValueError(f"unknown control {kind!r} (allowed: {', '.join(CONTROL_KINDS)})")
        with self.session() as s:
            c = Control(run_id=run_id, kind=kind, payload=payload or {}, actor=actor)
            s.add(c)
            s.flush()
            cid = c.id
        self.add_event(run_id, f"control.{kind}", f"{kind} requested", data=payload or {}, actor=actor)
        return cid

    def pending_controls(self, run_id: str) -> list[Control]:
        with self.session() as s:
            q = select(Control).where(Control.run_id == run_id, Control.applied_at.is_(None)).order_by(Control.id)
            return list(s.scalars(q))

    def mark_applied(self, control_id: int) -> None:
        with self.session() as s:
            c = s.get(Control, control_id)
            if c is not None:
                c.applied_at = _now()

    # -- export ------------------------------------------------------------------------
    def export_result(self, run_id: str) -> dict:
        """The run as the ``result.json`` of the output contract (docs/architecture.md)."""
        run = self.get_run(run_id)
        if run is None:
            raise KeyError(f"no run {run_id!r} in the store")
        rows = []
        for r in self.rounds(run_id):
            row = {
                "round": r.round,
                "train_loss": r.train_loss,
                "test_loss": r.test_loss,
                "test_accuracy": r.test_accuracy,
                "bytes_up": int(r.bytes_up),
                "bytes_down": int(r.bytes_down),
                "wall_s": r.wall_s,
                "sim_time_s": r.sim_time_s,
                "num_clients": r.num_clients,
                "fed_loss": r.fed_loss,
                "fed_accuracy": r.fed_accuracy,
                "fed_examples": r.fed_examples,
            }
            row.update(r.metrics or {})
            rows.append(row)
        accs = [r["test_accuracy"] for r in rows if r["test_accuracy"] is not None and r["round"] > 0]
        summary = {
            "status": run.status,
            "rounds": len([r for r in rows if r["round"] > 0]),
            "final_test_accuracy": accs[-1] if accs else None,
            "best_test_accuracy": max(accs) if accs else None,
            "total_bytes_up": sum(r["bytes_up"] for r in rows),
            "total_bytes_down": sum(r["bytes_down"] for r in rows),
            "wall_s": sum(r["wall_s"] for r in rows),
        }
        feds = [(r["fed_accuracy"], r["fed_loss"]) for r in rows if r["fed_accuracy"] is not None and r["round"] > 0]
        if feds:  # federated evaluation (the nodes' own validation data)
            summary.update(final_fed_accuracy=feds[-1][0], best_fed_accuracy=max(a for a, _ in feds),
                           final_fed_loss=feds[-1][1])
        sims = [r["sim_time_s"] for r in rows if r["sim_time_s"] is not None]
        summary["sim_time_s"] = sum(sims) if sims else None
        reports = [r["bytes_report"] for r in rows if r.get("bytes_report") is not None]
        if reports:  # monitoring (decentralized nodes' model reports), not in total_bytes_up
            summary["total_bytes_report"] = sum(reports)
        # Privacy spent and attacks suffered, when the run had them (DP, --byzantine).
        for key in ("epsilon", "epsilon_example"):
            eps = [r[key] for r in rows if r.get(key) is not None]
            if eps:
                summary[key] = eps[-1]
                summary["delta" if key == "epsilon" else "delta_example"] = next(
                    (r.get("delta" if key == "epsilon" else "delta_example") for r in reversed(rows)
                     if r.get(key) is not None), None)
        attacked = [r for r in rows if r.get("byzantine_nodes")]
        if attacked:
            summary["byzantine_nodes"] = sorted({n for r in attacked for n in r["byzantine_nodes"]},
                                                key=lambda n: (len(str(n)), str(n)))
            summary["attack"] = attacked[-1].get("attack")
        summary.update({k: v for k, v in (run.summary or {}).items() if k not in summary})
        out = {
            "run_id": run.id,
            "config": run.config,
            "code_version": run.code_version,
            "rounds": rows,
            "summary": summary,
        }
        nodes = self._node_evals(run_id)
        if nodes:
            out["node_rounds"] = nodes
        return out

    def _node_evals(self, run_id: str) -> list[dict]:
        """The node-round rows that carry a federated evaluation or telemetry, for ``result.json``."""
        keep = []
        for nr in self.node_rounds(run_id):
            if nr.fed_accuracy is None and not nr.telemetry:
                continue
            keep.append({"round": nr.round, "node_id": nr.node_id, "status": nr.status,
                         "num_examples": nr.num_examples, "fed_loss": nr.fed_loss, "fed_accuracy": nr.fed_accuracy,
                         "fed_examples": nr.fed_examples, "telemetry": nr.telemetry or {}})
        return keep

    def write_result(self, run_id: str, out_dir: str | os.PathLike) -> Path:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        path = out / "result.json"
        path.write_text(json.dumps(self.export_result(run_id), indent=2, default=str))
        return path


def _code_version() -> str:
    from fedswarm import __version__

    return __version__
