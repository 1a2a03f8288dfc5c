"""The run store's tables (SQLAlchemy 2.0 models): runs, rounds, node_rounds, rejections,
nodes, events, checkpoints, controls (docs/architecture.md, "Where state lives"). The queries are
:class:`fedswarm.store.Store`'s, the schema's creation and upgrades :mod:`fedswarm.store.migrations`'s;
``from fedswarm.store import Run`` (and the other tables) keeps working.
"""

from __future__ import annotations

import datetime as dt

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

__all__ = ["Base", "Run", "Round", "NodeRound", "Rejection", "Node", "Event", "Checkpoint", "Control",
           "Webhook", "WebhookDelivery", "RUN_STATUSES", "CONTROL_KINDS", "NODE_ROUND_KEY"]

NODE_ROUND_KEY = "uq_node_rounds_run_id_round_node_id"  # node_rounds' unique (run_id, round, node_id)

RUN_STATUSES = ("pending", "running", "paused", "finished", "failed", "stopped")


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)


class Base(DeclarativeBase):
    pass


class Run(Base):
    __tablename__ = "runs"
    __table_args__ = (Index("ix_runs_created_at", "created_at"), Index("ix_runs_strategy", "strategy"))

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    name: Mapped[str | None] = mapped_column(String(200))
    status: Mapped[str] = mapped_column(String(16), default="pending", index=True)
    strategy: Mapped[str] = mapped_column(String(64), default="")
    task: Mapped[str] = mapped_column(String(200), default="")
    engine: Mapped[str] = mapped_column(String(32), default="")
    config: Mapped[dict] = mapped_column(JSON, default=dict)
    seed: Mapped[int] = mapped_column(Integer, default=0)
    code_version: Mapped[str] = mapped_column(String(64), default="")
    total_rounds: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=_now)
    started_at: Mapped[dt.datetime | None] = mapped_column(DateTime)
    finished_at: Mapped[dt.datetime | None] = mapped_column(DateTime)
    error: Mapped[str | None] = mapped_column(Text)
    # The process that runs it (fedswarm.store.liveness): a live run whose process is gone shows as lost
    pid: Mapped[int | None] = mapped_column(Integer)
    host: Mapped[str | None] = mapped_column(String(255))
    pid_start: Mapped[str | None] = mapped_column(String(64))  # fedswarm.procs.process_start: tells pid reuse
    summary: Mapped[dict] = mapped_column(JSON, default=dict)
    # Who registered the run: "dashboard" (started from the web), "token:<id>" (an ingest
    # token), "cli" or None (written by a runtime directly). Ingest tokens act only on runs
    # they own or are bound to (fedswarm.web.deps.authorize_run).
    owner: Mapped[str | None] = mapped_column(String(64))
    last_report_at: Mapped[dt.datetime | None] = mapped_column(DateTime)  # last ingest call for the run
    lost_after_s: Mapped[float | None] = mapped_column(Float)  # no report for this long: shown as lost


class Round(Base):
    __tablename__ = "rounds"
    __table_args__ = (UniqueConstraint("run_id", "round"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    round: Mapped[int] = mapped_column(Integer)
    train_loss: Mapped[float | None] = mapped_column(Float)
    test_loss: Mapped[float | None] = mapped_column(Float)
    test_accuracy: Mapped[float | None] = mapped_column(Float)
    bytes_up: Mapped[int] = mapped_column(BigInteger, default=0)
    bytes_down: Mapped[int] = mapped_column(BigInteger, default=0)
    wall_s: Mapped[float] = mapped_column(Float, default=0.0)
    sim_time_s: Mapped[float | None] = mapped_column(Float)
    num_clients: Mapped[int] = mapped_column(Integer, default=0)
    metrics: Mapped[dict] = mapped_column(JSON, default=dict)  # anything else (consensus_distance, ...)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=_now)
    reported_by: Mapped[str | None] = mapped_column(String(64))  # the ingest token that wrote it, if any
    node_rows: Mapped[int | None] = mapped_column(Integer)  # per-node rows of the round
    failed_node_rows: Mapped[int | None] = mapped_column(Integer)  # of which failed or rejected
    # federated evaluation (fedswarm.server.fed_eval): the cohort's example-weighted loss/accuracy
    fed_loss: Mapped[float | None] = mapped_column(Float)
    fed_accuracy: Mapped[float | None] = mapped_column(Float)
    fed_examples: Mapped[int | None] = mapped_column(Integer)


class NodeRound(Base):
    __tablename__ = "node_rounds"
    # a node's history across runs (the dashboard's node page) and a run's node table; one row per
    # node per round, kept by the database (a unique index: SQLite cannot add a constraint to a table)
    __table_args__ = (Index("ix_node_rounds_node_id_run_id", "node_id", "run_id", "round"),
                      Index("ix_node_rounds_run_id_node_id", "run_id", "node_id"),
                      Index(NODE_ROUND_KEY, "run_id", "round", "node_id", unique=True))

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    round: Mapped[int] = mapped_column(Integer)
    node_id: Mapped[str] = mapped_column(String(64))
    bytes_up: Mapped[int] = mapped_column(BigInteger, default=0)
    bytes_down: Mapped[int] = mapped_column(BigInteger, default=0)
    num_examples: Mapped[int | None] = mapped_column(Integer)
    train_loss: Mapped[float | None] = mapped_column(Float)
    device_class: Mapped[str | None] = mapped_column(String(64))
    policy: Mapped[dict] = mapped_column(JSON, default=dict)
    status: Mapped[str] = mapped_column(String(16), default="ok")  # ok | failed | rejected
    reason: Mapped[str | None] = mapped_column(Text)
    fed_loss: Mapped[float | None] = mapped_column(Float)  # this node's federated evaluation
    fed_accuracy: Mapped[float | None] = mapped_column(Float)
    fed_examples: Mapped[int | None] = mapped_column(Integer)
    telemetry: Mapped[dict | None] = mapped_column(JSON)  # fedswarm.telemetry: absent sources left out


class Rejection(Base):
    """A reply a strategy refused (malformed, non-finite, too large, not its own...): it never
    touched the model. Written by the run recorder from the strategy's ``reject`` calls."""

    __tablename__ = "rejections"
    __table_args__ = (Index("ix_rejections_run_id_round", "run_id", "round"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    round: Mapped[int] = mapped_column(Integer)
    node_id: Mapped[str] = mapped_column(String(64))
    reason: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=_now)


class Node(Base):
    __tablename__ = "nodes"
    __table_args__ = (Index("ix_nodes_kind_last_seen", "kind", "last_seen"),)  # the fleet: every kind but sim

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    kind: Mapped[str] = mapped_column(String(16), default="supernode")  # supernode | peer | sim
    run_id: Mapped[str | None] = mapped_column(String(36), index=True)
    device_class: Mapped[str | None] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16), default="online")
    info: Mapped[dict] = mapped_column(JSON, default=dict)
    rejected_updates: Mapped[int] = mapped_column(Integer, default=0)
    last_seen: Mapped[dt.datetime] = mapped_column(DateTime, default=_now)
    owner: Mapped[str | None] = mapped_column(String(64))  # "token:<id>" for nodes reported through ingest
    telemetry: Mapped[dict | None] = mapped_column(JSON)  # the last telemetry it sent (as NodeRound.telemetry)


class Event(Base):
    __tablename__ = "events"
    __table_args__ = (Index("ix_events_run_id_id", "run_id", "id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str | None] = mapped_column(String(36), index=True)
    ts: Mapped[dt.datetime] = mapped_column(DateTime, default=_now)
    kind: Mapped[str] = mapped_column(String(32))
    message: Mapped[str] = mapped_column(Text, default="")
    data: Mapped[dict] = mapped_column(JSON, default=dict)
    actor: Mapped[str | None] = mapped_column(String(64))


class Checkpoint(Base):
    __tablename__ = "checkpoints"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    round: Mapped[int] = mapped_column(Integer)
    path: Mapped[str] = mapped_column(Text)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=_now)
    # The checkpoint itself (fedswarm.server.checkpoint), when it is kept in the store: then
    # it is committed in one transaction with its row, and ``path`` names it as "store:".
    data: Mapped[bytes | None] = mapped_column(LargeBinary)
    size_bytes: Mapped[int | None] = mapped_column(BigInteger)


class Control(Base):
    """A request to a running run: pause, resume, stop, add_rounds, policy."""

    __tablename__ = "controls"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    kind: Mapped[str] = mapped_column(String(16))
    payload: Mapped[dict] = mapped_column(JSON, default=dict)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=_now)
    applied_at: Mapped[dt.datetime | None] = mapped_column(DateTime)
    actor: Mapped[str | None] = mapped_column(String(64))


CONTROL_KINDS = ("pause", "resume", "stop", "add_rounds", "policy")


class Webhook(Base):
    """A URL the dashboard POSTs signed JSON to when a run ends, is lost, reaches its privacy
    budget, or a node goes offline (:mod:`fedswarm.web.services.webhooks`). ``secret_sealed`` is the HMAC
    key sealed with AES-GCM under a key kept outside the store (:mod:`fedswarm.web.secret_box`);
    ``secret`` held it in clear before, and is emptied when a dashboard first starts on the store."""

    __tablename__ = "webhooks"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    url: Mapped[str] = mapped_column(Text)
    secret: Mapped[str] = mapped_column(String(128), default="")  # clear text of stores before sealing
    secret_sealed: Mapped[str | None] = mapped_column(Text)
    events: Mapped[list] = mapped_column(JSON, default=list)
    enabled: Mapped[bool] = mapped_column(Boolean, default=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=_now)
    created_by: Mapped[str | None] = mapped_column(String(64))


class WebhookDelivery(Base):
    """One event for one webhook: sent until it is answered 2xx or its attempts run out. The
    (webhook, event key) pair is unique, so an event is never queued twice for a webhook, by
    this dashboard after a restart or by another one over the same store."""

    __tablename__ = "webhook_deliveries"
    __table_args__ = (UniqueConstraint("webhook_id", "event_key"),
                      Index("ix_webhook_deliveries_due", "status", "next_attempt_at"))

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    webhook_id: Mapped[int] = mapped_column(ForeignKey("webhooks.id", ondelete="CASCADE"), index=True)
    event: Mapped[str] = mapped_column(String(32))
    event_key: Mapped[str] = mapped_column(String(200))
    run_id: Mapped[str | None] = mapped_column(String(36))
    node_id: Mapped[str | None] = mapped_column(String(64))
    payload: Mapped[dict] = mapped_column(JSON, default=dict)
    status: Mapped[str] = mapped_column(String(16), default="pending")  # pending | delivered | failed
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[dt.datetime] = mapped_column(DateTime, default=_now)
    last_code: Mapped[int | None] = mapped_column(Integer)  # the receiver's last HTTP status
    last_error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=_now)
    delivered_at: Mapped[dt.datetime | None] = mapped_column(DateTime)
