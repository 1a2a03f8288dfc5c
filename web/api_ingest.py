"""/api/ingest: swarm peers and remote ServerApps report runs, rounds and nodes with their
own API tokens (role ``reporter``, optionally bound to one run), and read pending controls.
Every payload is validated (finite numbers, bounded sizes) before it reaches the store.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Depends, HTTPException, Path
from pydantic import BaseModel, ConfigDict, Field, field_validator
from sqlalchemy.exc import IntegrityError

from fedswarm.store import RUN_STATUSES
from fedswarm.web import schemas
from fedswarm.web.accounts import Principal
from fedswarm.web.deps import WebContext, get_ctx, require_reporter

router = APIRouter(prefix="/api/ingest", tags=["ingest"])
ERRORS = {401: {"model": schemas.Message}, 403: {"model": schemas.Message},
          404: {"model": schemas.Message}, 409: {"model": schemas.Message}}
Finite = Field(None, allow_inf_nan=False)
Bytes = Field(0, ge=0, le=2**62)


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid")


class NodeIn(_In):
    node_id: str = Field(pattern=schemas.ID_PATTERN)
    kind: Literal["peer", "supernode", "sim", "serverapp"] = "peer"
    run_id: str | None = Field(None, pattern=schemas.RUN_ID_PATTERN)
    device_class: str | None = Field(None, pattern=schemas.ID_PATTERN)
    status: Literal["online", "offline", "busy", "failed"] = "online"
    info: dict[str, Any] = Field(default_factory=dict)
    rejected_updates: int | None = Field(None, ge=0, le=2**31 - 1)

    @field_validator("info")
    @classmethod
    def _small(cls, v: dict) -> dict:
        return schemas._small_json(v)


class RunIn(_In):
    run_id: str | None = Field(None, pattern=schemas.RUN_ID_PATTERN)
    name: str | None = Field(None, max_length=200)
    config: dict[str, Any] = Field(default_factory=dict)
    status: Literal[RUN_STATUSES] = "running"  # type: ignore[valid-type]

    @field_validator("config")
    @classmethod
    def _check_config(cls, v: dict) -> dict:
        for key in ("seed", "rounds"):
            if key in v and (isinstance(v[key], bool) or not isinstance(v[key], int) or abs(v[key]) > 2**31 - 1):
                raise ValueError(f"config.{key} must be an integer")
        for key in ("name", "strategy", "task", "engine"):
            if key in v and v[key] is not None and (not isinstance(v[key], str) or len(v[key]) > 64):
                raise ValueError(f"config.{key} must be a string of at most 64 characters")
        return schemas._small_json(v)


class NodeRoundIn(_In):
    node_id: str = Field(pattern=schemas.ID_PATTERN)
    bytes_up: int = Bytes
    bytes_down: int = Bytes
    num_examples: int | None = Field(None, ge=0, le=2**31 - 1)
    train_loss: float | None = Finite
    device_class: str | None = Field(None, pattern=schemas.ID_PATTERN)
    status: Literal["ok", "failed", "rejected"] = "ok"
    reason: str | None = Field(None, max_length=2000)


class RoundIn(_In):
    round: int = Field(ge=0, le=2**31 - 1)
    train_loss: float | None = Finite
    test_loss: float | None = Finite
    test_accuracy: float | None = Field(None, ge=0, le=1)
    bytes_up: int = Bytes
    bytes_down: int = Bytes
    wall_s: float = Field(0.0, ge=0, allow_inf_nan=False)
    sim_time_s: float | None = Field(None, ge=0, allow_inf_nan=False)
    num_clients: int = Field(0, ge=0, le=2**31 - 1)
    metrics: dict[str, Any] = Field(default_factory=dict)
    nodes: list[NodeRoundIn] = Field(default_factory=list, max_length=10_000)

    @field_validator("metrics")
    @classmethod
    def _small(cls, v: dict) -> dict:
        return schemas._small_json(schemas.clean(v))


class StatusIn(_In):
    status: Literal[RUN_STATUSES]  # type: ignore[valid-type]
    error: str | None = Field(None, max_length=4000)


class Ack(BaseModel):
    ok: bool = True
    run_id: str | None = None
    detail: str = ""


def _own_run(ctx: WebContext, p: Principal, run_id: str) -> None:
    if p.run_id is not None and p.run_id != run_id:
        raise HTTPException(403, f"this token may only report on run '{p.run_id}'")
    if ctx.store.get_run(run_id) is None:
        raise HTTPException(404, f"no run '{run_id}' in the store")


RunPath = Path(pattern=schemas.RUN_ID_PATTERN)


@router.post("/nodes", response_model=Ack, responses=ERRORS)
def report_node(body: NodeIn, p: Principal = Depends(require_reporter), ctx: WebContext = Depends(get_ctx)) -> Ack:
    """A heartbeat or node description; updates the node's last-seen time."""
    if body.run_id is not None:
        _own_run(ctx, p, body.run_id)
    fields = body.model_dump(exclude={"node_id"}, exclude_none=True)
    fields["info"] = fields.get("info") or {}
    ctx.store.upsert_node(body.node_id, **fields)
    return Ack(run_id=body.run_id, detail=f"node '{body.node_id}' recorded")


@router.post("/runs", response_model=Ack, status_code=201, responses=ERRORS)
def report_run(body: RunIn, p: Principal = Depends(require_reporter), ctx: WebContext = Depends(get_ctx)) -> Ack:
    """Register a run that runs elsewhere (a swarm, a remote ServerApp)."""
    if p.run_id is not None and body.run_id != p.run_id:
        raise HTTPException(403, f"this token may only report on run '{p.run_id}'")
    if body.run_id is not None and ctx.store.get_run(body.run_id) is not None:
        raise HTTPException(409, f"run '{body.run_id}' already exists")
    rid = ctx.store.create_run(body.config, name=body.name, run_id=body.run_id, status=body.status)
    ctx.store.add_event(rid, "ingest.run", f"run reported by {p.name}", actor=p.name)
    return Ack(run_id=rid, detail=f"run '{rid}' registered")


@router.post("/runs/{run_id}/rounds", response_model=Ack, status_code=201, responses=ERRORS)
def report_round(body: RoundIn, run_id: str = RunPath, p: Principal = Depends(require_reporter),
                 ctx: WebContext = Depends(get_ctx)) -> Ack:
    """One finished round, with optional per-node rows."""
    _own_run(ctx, p, run_id)
    fields = body.model_dump(exclude={"round", "nodes"})
    try:
        ctx.store.add_round(run_id, body.round, **fields)
    except IntegrityError:
        raise HTTPException(409, f"round {body.round} of run '{run_id}' was already reported") from None
    if body.nodes:
        ctx.store.add_node_rounds(run_id, body.round, [n.model_dump() for n in body.nodes])
    return Ack(run_id=run_id, detail=f"round {body.round} recorded")


@router.post("/runs/{run_id}/status", response_model=Ack, responses=ERRORS)
def report_status(body: StatusIn, run_id: str = RunPath, p: Principal = Depends(require_reporter),
                  ctx: WebContext = Depends(get_ctx)) -> Ack:
    _own_run(ctx, p, run_id)
    ctx.store.set_status(run_id, body.status, error=body.error)
    return Ack(run_id=run_id, detail=f"run '{run_id}' is {body.status}")


@router.get("/runs/{run_id}/controls", response_model=list[schemas.ControlOut], responses=ERRORS)
def pending_controls(run_id: str = RunPath, p: Principal = Depends(require_reporter),
                     ctx: WebContext = Depends(get_ctx)) -> list[schemas.ControlOut]:
    """Controls not yet applied, oldest first: what a remote runtime should obey."""
    _own_run(ctx, p, run_id)
    return [schemas.ControlOut.model_validate(c) for c in ctx.store.pending_controls(run_id)]


@router.post("/runs/{run_id}/controls/{control_id}/applied", response_model=Ack, responses=ERRORS)
def control_applied(run_id: str = RunPath, control_id: int = Path(ge=1, le=2**62),
                    p: Principal = Depends(require_reporter), ctx: WebContext = Depends(get_ctx)) -> Ack:
    _own_run(ctx, p, run_id)
    if not any(c.id == control_id for c in ctx.store.pending_controls(run_id)):
        raise HTTPException(404, f"no pending control {control_id} for run '{run_id}'")
    ctx.store.mark_applied(control_id)
    return Ack(run_id=run_id, detail=f"control {control_id} applied")
