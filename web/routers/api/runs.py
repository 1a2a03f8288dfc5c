"""/api: health, who am I, runs (list, start, detail, rounds, live stream, log) and controls."""

from __future__ import annotations

import asyncio
import json
from typing import Callable, Literal

from fastapi import APIRouter, Depends, HTTPException, Query, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

import fedswarm
from fedswarm.web import models
from fedswarm.web.services import live, queries
from fedswarm.web.services.accounts import Principal
from fedswarm.web.cache import Answer
from fedswarm.web.deps import RunIdPath, WebContext, get_ctx, require_admin, require_reader
from fedswarm.web.services.launcher import log_tail
from fedswarm.web.services.runs import RunError

router = APIRouter(prefix="/api")
RunId = RunIdPath
ERRORS = {401: {"model": models.Message}, 403: {"model": models.Message},
          404: {"model": models.Message}, 409: {"model": models.Message}}
Status = Literal[models.DISPLAY_STATUSES]  # type: ignore[valid-type]
Sort = Literal["created", "name", "strategy", "status", "rounds", "accuracy"]


def _run(ctx: WebContext, run_id: str):
    try:
        return ctx.runs.get(run_id)
    except RunError as exc:
        raise HTTPException(exc.status_code, exc.detail) from None


@router.get("/health", response_model=models.Health, tags=["meta"])
def health(ctx: WebContext = Depends(get_ctx)) -> models.Health:
    """Liveness: the app answers and the store is reachable. Needs no login."""
    with ctx.store.engine.connect() as conn:
        conn.exec_driver_sql("SELECT 1")
    return models.Health(version=fedswarm.__version__, store=ctx.store.engine.dialect.name)


@router.get("/whoami", response_model=models.Whoami, responses=ERRORS, tags=["meta"])
def whoami(p: Principal = Depends(require_reader), ctx: WebContext = Depends(get_ctx)) -> models.Whoami:
    return models.Whoami(name=p.name, role=p.role, csrf_token=ctx.csrf(p))


async def _cached(ctx: WebContext, request: Request, key: tuple, build: Callable[[], Answer]) -> Response:
    """A shared answer: from memory on the event loop when fresh (or recent, while a thread
    rebuilds it), else built in a thread. The raw request is recorded as answered by ``key`` so
    that :class:`~fedswarm.web.hot_reads.CachedReads` can serve its repeats."""
    answer, refresh = ctx.cache.lookup(key)
    if answer is None:
        answer = await asyncio.to_thread(ctx.cache.get, key, build)
    elif refresh:
        ctx.cache.refresh_soon(key)
    ctx.cache.alias(request.scope["path"], request.scope["query_string"], key)
    return Response(content=answer.body, media_type="application/json", headers=dict(answer.headers))


@router.get("/runs", response_model=list[models.RunOut], responses=ERRORS, tags=["runs"])
async def list_runs(request: Request,
                    q: str | None = Query(None, max_length=100, description="search id, name, strategy and task"),
              status: Status | None = Query(None, description="only runs shown with this status"),
              strategy: str | None = Query(None, max_length=64),
              sort: Sort = Query("created"), order: Literal["asc", "desc"] = Query("desc"),
              limit: int = Query(50, ge=1, le=500), offset: int = Query(0, ge=0, le=10**6),
              _: Principal = Depends(require_reader), ctx: WebContext = Depends(get_ctx)) -> Response:
    """One page of runs with progress, accuracy, bytes and node health; the number of runs that
    match is in the ``X-Total-Count`` header."""
    query = queries.RunQuery(q=q, status=status, strategy=strategy, sort=sort, order=order, limit=limit,
                             offset=offset)

    def build() -> Answer:
        runs, total = queries.list_runs(ctx.store, query, ctx.settings.report_timeout_s)
        return Answer(json.dumps([r.model_dump(mode="json") for r in runs]).encode(),
                      (("X-Total-Count", str(total)),))

    return await _cached(ctx, request, ("runs", q, status, strategy, sort, order, limit, offset), build)


@router.post("/runs", response_model=models.RunOut, status_code=201, tags=["runs"],
             responses=ERRORS | {422: {"model": models.Message}, 503: {"model": models.Message}})
def start_run(body: models.StartRunIn, p: Principal = Depends(require_admin),
              ctx: WebContext = Depends(get_ctx)) -> models.RunOut:
    """Start a simulation in its own process (it survives a dashboard restart). Tasks are
    registered names; an edge-list topology or a profiles file comes in the request."""
    try:
        run = ctx.runs.start(body.config, actor=p.name, topology_edges=body.topology_edges,
                             profiles_toml=body.profiles_toml)
    except RunError as exc:
        raise HTTPException(exc.status_code, exc.detail) from None
    ctx.cache.clear()
    return queries.run_summary(ctx.store, run, ctx.settings.report_timeout_s)


@router.get("/runs/{run_id}", response_model=models.RunDetailOut, responses=ERRORS, tags=["runs"])
async def get_run(request: Request, run_id: str = RunId, _: Principal = Depends(require_reader),
                  ctx: WebContext = Depends(get_ctx)) -> Response:
    """A run: config, progress, per-node table and device-class roll-up, controls (pending
    ones included), policies, recent events, and which actions are valid now."""

    def build() -> Answer:
        return Answer(run_detail(ctx, _run(ctx, run_id)).model_dump_json().encode())

    return await _cached(ctx, request, ("run", run_id), build)


@router.get("/runs/{run_id}/rounds", response_model=list[models.RoundOut], responses=ERRORS, tags=["runs"])
async def get_rounds(request: Request, run_id: str = RunId, since: int = Query(-1, ge=-1, le=2**31 - 1,
                                                      description="only rounds after this one"),
               limit: int = Query(10_000, ge=1, le=10_000, description="at most this many rounds (page with since)"),
               _: Principal = Depends(require_reader), ctx: WebContext = Depends(get_ctx)) -> Response:
    """Rounds in order. Pages of ``limit``: ask again with ``since`` = the last round received."""

    def build() -> Answer:
        _run(ctx, run_id)
        rows = queries.rounds(ctx.store, run_id, since, limit)
        return Answer(json.dumps([r.model_dump(mode="json") for r in rows]).encode())

    return await _cached(ctx, request, ("rounds", run_id, since, limit), build)


class LogOut(BaseModel):
    run_id: str
    log: str


@router.get("/runs/{run_id}/log", response_model=LogOut, responses=ERRORS, tags=["runs"])
def get_log(run_id: str = RunId, _: Principal = Depends(require_reader),
            ctx: WebContext = Depends(get_ctx)) -> LogOut:
    """The last lines the run's process printed (runs started from this dashboard)."""
    _run(ctx, run_id)
    try:
        return LogOut(run_id=run_id, log=log_tail(ctx.runs.log_path(run_id)))
    except RunError as exc:
        raise HTTPException(exc.status_code, exc.detail) from None


@router.get("/runs/{run_id}/stream", include_in_schema=False)
async def stream_run(request: Request, run_id: str = RunId, since: int = Query(-1, ge=-1),
                     _: Principal = Depends(require_reader), ctx: WebContext = Depends(get_ctx)):
    """Server-sent events: `round` for each finished round, `status` on status changes."""
    _run(ctx, run_id)
    last = request.headers.get("last-event-id", "")
    since = max(since, int(last)) if last.isdigit() else since
    return _sse(live.stream(ctx.hub, ctx.store, run_id, since, request.is_disconnected))


@router.get("/stream", include_in_schema=False)
async def stream_all(request: Request, _: Principal = Depends(require_reader), ctx: WebContext = Depends(get_ctx)):
    """Server-sent events for every run: `run` (its new summary), `round`, `status`."""
    return _sse(live.stream(ctx.hub, ctx.store, None, -1, request.is_disconnected))


def _sse(body) -> StreamingResponse:
    return StreamingResponse(body, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _control(ctx: WebContext, run_id: str, kind: str, actor: str, payload: dict | None = None) -> models.ActionOut:
    try:
        cid, detail = ctx.runs.control(run_id, kind, actor, payload)
    except RunError as exc:
        raise HTTPException(exc.status_code, exc.detail) from None
    ctx.cache.clear()
    return models.ActionOut(run_id=run_id, action=kind, control_id=cid, detail=detail)


@router.post("/runs/{run_id}/pause", response_model=models.ActionOut, responses=ERRORS, tags=["control"])
def pause(run_id: str = RunId, p: Principal = Depends(require_admin), ctx: WebContext = Depends(get_ctx)):
    """Pause after the current round (the run waits until resumed)."""
    return _control(ctx, run_id, "pause", p.name)


@router.post("/runs/{run_id}/resume", response_model=models.ActionOut, responses=ERRORS, tags=["control"])
def resume(run_id: str = RunId, p: Principal = Depends(require_admin), ctx: WebContext = Depends(get_ctx)):
    return _control(ctx, run_id, "resume", p.name)


@router.post("/runs/{run_id}/stop", response_model=models.ActionOut, responses=ERRORS, tags=["control"])
def stop(run_id: str = RunId, force: bool = Query(False, description="terminate the process now"),
         p: Principal = Depends(require_admin), ctx: WebContext = Depends(get_ctx)):
    """Stop after the current round; with force, terminate the run's process at once."""
    if force:
        try:
            detail = ctx.runs.force_stop(run_id, p.name)
        except RunError as exc:
            raise HTTPException(exc.status_code, exc.detail) from None
        ctx.cache.clear()
        return models.ActionOut(run_id=run_id, action="kill", detail=detail)
    return _control(ctx, run_id, "stop", p.name)


@router.post("/runs/{run_id}/add_rounds", response_model=models.ActionOut, responses=ERRORS, tags=["control"])
def add_rounds(body: models.AddRoundsIn, run_id: str = RunId, p: Principal = Depends(require_admin),
               ctx: WebContext = Depends(get_ctx)):
    """Raise the run's number of rounds by `rounds`."""
    return _control(ctx, run_id, "add_rounds", p.name, {"rounds": body.rounds})


@router.post("/runs/{run_id}/restart", response_model=models.ActionOut, responses=ERRORS, tags=["control"])
def restart(run_id: str = RunId, p: Principal = Depends(require_admin), ctx: WebContext = Depends(get_ctx)):
    """Resume a failed, lost or stopped run from its last checkpoint (``fedswarm resume RUN_ID``)."""
    try:
        detail = ctx.runs.restart(run_id, p.name)
    except RunError as exc:
        raise HTTPException(exc.status_code, exc.detail) from None
    ctx.cache.clear()
    return models.ActionOut(run_id=run_id, action="restart", detail=detail)


def run_detail(ctx: WebContext, run) -> models.RunDetailOut:
    """The run as its page and ``GET /api/runs/{id}`` show it."""
    return queries.run_detail(ctx.store, run, ctx.settings.report_timeout_s, ctx.runs.can_restart(run),
                              ctx.runs.error_hint)


@router.get("/events", response_model=list[models.EventOut], responses=ERRORS, tags=["meta"])
def events(limit: int = Query(100, ge=1, le=1000),
           run_id: str | None = Query(None, pattern=models.RUN_ID_PATTERN),
           _: Principal = Depends(require_reader), ctx: WebContext = Depends(get_ctx)):
    """The audit trail: every action with its actor, newest first."""
    return [models.EventOut.model_validate(e) for e in ctx.store.events(run_id, limit=limit)]
