"""/api/ingest: swarm peers and remote ServerApps report runs, rounds and nodes with their
own API tokens (role ``reporter``, optionally bound to one run), and read pending controls.

Before a payload reaches the store: its body was capped (fedswarm.web.middleware), the token
was charged against its quota (429 past it), the token was checked to own the run
(:func:`fedswarm.web.deps.authorize_run`, 403 otherwise), and every value was validated
(finite numbers, bounded sizes). Rounds and status changes record the token that made them.
"""

from __future__ import annotations

import datetime as dt
from typing import Any, Literal

from fastapi import APIRouter, Depends, HTTPException, Path
from pydantic import BaseModel, ConfigDict, Field, field_validator
from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError

from fedswarm.store import RUN_STATUSES, RowConflict
from fedswarm.web import models
from fedswarm.web.services.accounts import Principal
from fedswarm.store import Node, Run
from fedswarm.web.deps import WebContext, authorize_run, get_ctx, ingest_run, require_reporter
from fedswarm.web.models import TelemetryIn
from fedswarm.web.services.run_state import LIVE_STATUSES

router = APIRouter(prefix="/api/ingest", tags=["ingest"])
ERRORS = {401: {"model": models.Message}, 403: {"model": models.Message},
          404: {"model": models.Message}, 409: {"model": models.Message},
          413: {"model": models.Message}, 429: {"model": models.Message}}
# Why an ingest call was refused, by its answer's status (counted in /metrics; 401 and 413
# can also come from the body caps of fedswarm.web.middleware, before this router).
REJECTION_REASONS = {400: "malformed", 401: "unauthenticated", 403: "forbidden", 404: "unknown_run",
                     409: "conflict", 413: "too_large", 415: "malformed", 422: "invalid", 429: "rate_limited"}
MAX_NODE_INFO = 8_192
Finite = Field(None, allow_inf_nan=False)
Bytes = Field(0, ge=0, le=2**62)


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid")


class NodeIn(_In):
    node_id: str = Field(pattern=models.ID_PATTERN)
    kind: Literal["peer", "supernode", "sim", "serverapp"] = "peer"
    run_id: str | None = Field(None, pattern=models.RUN_ID_PATTERN)
    device_class: str | None = Field(None, pattern=models.ID_PATTERN)
    status: Literal["online", "offline", "busy", "failed"] = "online"
    info: dict[str, Any] = Field(default_factory=dict)
    rejected_updates: int | None = Field(None, ge=0, le=2**31 - 1)
    telemetry: TelemetryIn | None = Field(None, description="what the node measured (kept as its last values)")

    @field_validator("info")
    @classmethod
    def _small(cls, v: dict) -> dict:
        return models._small_json(v, MAX_NODE_INFO)


class RunIn(_In):
    run_id: str | None = Field(None, pattern=models.RUN_ID_PATTERN)
    name: str | None = Field(None, max_length=200)
    config: dict[str, Any] = Field(default_factory=dict)
    status: Literal[RUN_STATUSES] = "running"  # type: ignore[valid-type]
    lost_after_s: float | None = Field(None, ge=5, le=7 * 86400, allow_inf_nan=False,
                                       description="silent this long, the run shows as lost (default: the "
                                                   "dashboard's report timeout)")

    @field_validator("config")
    @classmethod
    def _check_config(cls, v: dict) -> dict:
        for key in ("seed", "rounds"):
            if key in v and (isinstance(v[key], bool) or not isinstance(v[key], int) or abs(v[key]) > 2**31 - 1):
                raise ValueError(f"config.{key} must be an integer")
        for key in ("name", "strategy", "task", "engine"):
            if key in v and v[key] is not None and (not isinstance(v[key], str) or len(v[key]) > 64):
                raise ValueError(f"config.{key} must be a string of at most 64 characters")
        return models._small_json(v)


class NodeRoundIn(_In):
    node_id: str = Field(pattern=models.ID_PATTERN)
    bytes_up: int = Bytes
    bytes_down: int = Bytes
    num_examples: int | None = Field(None, ge=0, le=2**31 - 1)
    train_loss: float | None = Finite
    device_class: str | None = Field(None, pattern=models.ID_PATTERN)
    status: Literal["ok", "failed", "rejected"] = "ok"
    reason: str | None = Field(None, max_length=2000)
    telemetry: TelemetryIn | None = Field(None, description="what the node measured in this round")

    def row(self) -> dict[str, Any]:
        """The store's per-node row: telemetry with only the keys that were sent."""
        out = self.model_dump(exclude={"telemetry"})
        if self.telemetry is not None:
            out["telemetry"] = self.telemetry.model_dump(exclude_none=True) or None
        return out


class RoundIn(_In):
    round: int = Field(ge=0, le=1_000_000)
    train_loss: float | None = Finite
    test_loss: float | None = Finite
    test_accuracy: float | None = Field(None, ge=0, le=1)
    bytes_up: int = Bytes
    bytes_down: int = Bytes
    wall_s: float = Field(0.0, ge=0, le=10**7, allow_inf_nan=False)
    sim_time_s: float | None = Field(None, ge=0, allow_inf_nan=False)
    num_clients: int = Field(0, ge=0, le=2**31 - 1)
    metrics: dict[str, Any] = Field(default_factory=dict)
    nodes: list[NodeRoundIn] = Field(default_factory=list, max_length=10_000)

    @field_validator("metrics")
    @classmethod
    def _small(cls, v: dict) -> dict:
        return models.clean(models._small_json(v))  # bounded (size, depth) before clean() recurses into it

    @field_validator("nodes")
    @classmethod
    def _once_each(cls, v: list[NodeRoundIn]) -> list[NodeRoundIn]:
        seen: set[str] = set()
        for n in v:
            if n.node_id in seen:
                raise ValueError(f"node '{n.node_id}' appears twice in the round's nodes")
            seen.add(n.node_id)
        return v


class StatusIn(_In):
    status: Literal[RUN_STATUSES]  # type: ignore[valid-type]
    error: str | None = Field(None, max_length=4000)


class Ack(BaseModel):
    ok: bool = True
    run_id: str | None = None
    detail: str = ""


def _node_owner(ctx: WebContext, p: Principal, node_id: str, run: Run | None) -> None:
    """A token may write a node it reported before, a new node, or a node of a run it may act
    on; never another reporter's node (leaving run_id out changes nothing to that)."""
    with ctx.store.session() as s:
        node = s.get(Node, node_id)
        owned = 0 if p.is_admin or node is not None else s.scalar(
            select(func.count()).select_from(Node).where(Node.owner == p.owner_tag))
    if node is None:
        if owned >= ctx.settings.nodes_per_token:
            raise HTTPException(429, f"this token already reported {owned} nodes "
                                     f"(at most {ctx.settings.nodes_per_token})")
        return
    if p.is_admin or node.owner == p.owner_tag:
        return
    if node.run_id is not None:
        authorize_run(ctx, p, node.run_id)
        return
    raise HTTPException(403, f"node '{node_id}' was reported by another token")


@router.post("/nodes", response_model=Ack, responses=ERRORS)
def report_node(body: NodeIn, p: Principal = Depends(require_reporter), ctx: WebContext = Depends(get_ctx)) -> Ack:
    """A heartbeat or node description; updates the node's last-seen time. A token bound to a
    run reports nodes of that run (``run_id`` defaults to it)."""
    run_id = body.run_id if body.run_id is not None else p.run_id
    run = authorize_run(ctx, p, run_id) if run_id is not None else None
    _node_owner(ctx, p, body.node_id, run)
    fields = body.model_dump(exclude={"node_id"}, exclude_none=True)
    fields["info"] = fields.get("info") or {}
    if not fields.get("telemetry"):
        fields.pop("telemetry", None)  # none sent: the last values stay
    if run_id is not None:
        fields["run_id"] = run_id
    if p.owner_tag and not p.is_admin:
        fields["owner"] = p.owner_tag
    ctx.store.upsert_node(body.node_id, **fields)
    return Ack(run_id=run_id, detail=f"node '{body.node_id}' recorded")


@router.post("/runs", response_model=Ack, status_code=201, responses=ERRORS)
def report_run(body: RunIn, p: Principal = Depends(require_reporter), ctx: WebContext = Depends(get_ctx)) -> Ack:
    """Register a run that runs elsewhere (a swarm, a remote ServerApp); this token owns it."""
    if p.run_id is not None and body.run_id != p.run_id:
        raise HTTPException(403, f"this token may only report on run '{p.run_id}'")
    if body.run_id is not None and ctx.store.get_run(body.run_id) is not None:
        raise HTTPException(409, f"run '{body.run_id}' already exists")
    try:  # owner in the same commit: a retry that finds the run never finds it without its owner
        rid = ctx.store.create_run(body.config, name=body.name, run_id=body.run_id, status=body.status,
                                   owner=p.owner_tag, lost_after_s=body.lost_after_s, last_report_at=_now())
    except IntegrityError:  # registered by a request that passed the check above at the same time
        raise HTTPException(409, f"run '{body.run_id}' already exists") from None
    ctx.store.add_event(rid, "ingest.run", f"run reported by {p.name}", actor=p.name)
    ctx.cache.clear()
    return Ack(run_id=rid, detail=f"run '{rid}' registered")


@router.post("/runs/{run_id}/rounds", response_model=Ack, status_code=201, responses=ERRORS)
def report_round(body: RoundIn, owned=Depends(ingest_run), ctx: WebContext = Depends(get_ctx)) -> Ack:
    """One finished round, with optional per-node rows, in one commit; recorded with the token
    that sent it. A round already recorded (e.g. a retry of a request that had in fact
    succeeded) gets 409 and changes nothing."""
    p, run = owned
    fields = body.model_dump(exclude={"round", "nodes"})
    try:
        ctx.store.add_round(run.id, body.round, reported_by=p.name[:64], nodes=[n.row() for n in body.nodes],
                            **fields)
    except IntegrityError:
        raise HTTPException(409, f"round {body.round} of run '{run.id}' was already reported") from None
    except RowConflict as exc:  # node rows written without their round (an old store) that differ
        raise HTTPException(409, str(exc)) from None
    return Ack(run_id=run.id, detail=f"round {body.round} recorded")


@router.post("/runs/{run_id}/status", response_model=Ack, responses=ERRORS)
def report_status(body: StatusIn, owned=Depends(ingest_run), ctx: WebContext = Depends(get_ctx)) -> Ack:
    """The run's new status; a run that already ended cannot be brought back this way."""
    p, run = owned
    if run.status not in LIVE_STATUSES and body.status != run.status:
        raise HTTPException(409, f"run '{run.id}' is {run.status}; its status can no longer change")
    ctx.store.set_status(run.id, body.status, error=body.error, actor=p.name)
    ctx.cache.clear()
    return Ack(run_id=run.id, detail=f"run '{run.id}' is {body.status}")


@router.get("/runs/{run_id}/controls", response_model=list[models.ControlOut], responses=ERRORS)
def pending_controls(owned=Depends(ingest_run), ctx: WebContext = Depends(get_ctx)) -> list[models.ControlOut]:
    """Controls not yet applied, oldest first: what a remote runtime should obey."""
    return [models.ControlOut.model_validate(c) for c in ctx.store.pending_controls(owned[1].id)]


@router.post("/runs/{run_id}/controls/{control_id}/applied", response_model=Ack, responses=ERRORS)
def control_applied(control_id: int = Path(ge=1, le=2**62), owned=Depends(ingest_run),
                    ctx: WebContext = Depends(get_ctx)) -> Ack:
    p, run = owned
    if not any(c.id == control_id for c in ctx.store.pending_controls(run.id)):
        raise HTTPException(404, f"no pending control {control_id} for run '{run.id}'")
    ctx.store.mark_applied(control_id)
    ctx.store.add_event(run.id, "control.applied", f"control {control_id} applied", actor=p.name)
    return Ack(run_id=run.id, detail=f"control {control_id} applied")


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)
