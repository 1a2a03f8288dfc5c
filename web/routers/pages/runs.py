"""HTML pages for runs: the list (search, filter, sort, pages), a run's detail with live charts
and controls, and the new-run form."""

from __future__ import annotations

import json
from urllib.parse import quote, urlencode

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse
from pydantic import ValidationError

from fedswarm.errors import ConfigError
from fedswarm.web import models
from fedswarm.web.services import queries
from fedswarm.web.services.accounts import Principal
from fedswarm.web.routers.api.runs import Sort, Status, run_detail
from fedswarm.web.deps import RunIdPath, WebContext, get_ctx, page_admin_form, page_user
from fedswarm.web.services.forms import config_from_form, form_fields
from fedswarm.web.services.launcher import log_tail
from fedswarm.web.routers.pages.common import redirect, render
from fedswarm.web.services.runs import RunError
from fedswarm.web.services.secagg import secagg_on, secagg_rounds

__all__ = ["router", "render"]

router = APIRouter(include_in_schema=False)
DEVICE_CLASSES = ("datacenter", "gpu", "cpu", "edge-wifi", "edge-lte", "straggler")
PAGE_SIZE = 25


def _back(request: Request, ctx: WebContext, run_id: str, msg: str) -> RedirectResponse:
    return redirect(request, ctx, f"/runs/{quote(run_id)}", msg)


@router.get("/")
def home() -> RedirectResponse:
    return RedirectResponse("/runs", status_code=303)


@router.get("/runs", response_class=HTMLResponse)
def runs_page(request: Request, q: str | None = Query(None, max_length=100), status: Status | None = None,
              strategy: str | None = Query(None, max_length=64), sort: Sort = "created",
              order: str = Query("desc", pattern="^(asc|desc)$"), page: int = Query(1, ge=1, le=100_000),
              p: Principal = Depends(page_user), ctx: WebContext = Depends(get_ctx)):
    query = queries.RunQuery(q=q or None, status=status, strategy=strategy or None, sort=sort, order=order,
                             limit=PAGE_SIZE, offset=(page - 1) * PAGE_SIZE)
    runs, total = queries.list_runs(ctx.store, query, ctx.settings.report_timeout_s)
    cat = ctx.catalog.get(wait_s=0.2)
    filters = {"q": q or "", "status": status or "", "strategy": strategy or "", "sort": sort, "order": order}

    def link(**change) -> str:
        args = {k: v for k, v in {**filters, "page": page, **change}.items() if v not in ("", None)}
        return "/runs?" + urlencode(args)

    pages = max(1, -(-total // PAGE_SIZE))
    return render(request, ctx, p, "runs.html", runs=runs, total=total, page=page, pages=pages, link=link,
                  filters=filters, statuses=models.DISPLAY_STATUSES,
                  strategies=sorted({s.get("name") for s in cat.strategies} | {r.strategy for r in runs}))


@router.get("/runs/new", response_class=HTMLResponse)
def new_run_page(request: Request, p: Principal = Depends(page_user), ctx: WebContext = Depends(get_ctx)):
    return _new_form(request, ctx, p, {}, None)


def _new_form(request: Request, ctx: WebContext, p: Principal, values: dict, error: str | None,
              status: int = 200) -> HTMLResponse:
    cat = ctx.catalog.get(wait_s=20.0)
    return render(request, ctx, p, "new_run.html", status=status, catalog=cat, fields=form_fields(cat),
                  values=values, error=error)


@router.post("/runs/new", response_class=HTMLResponse)
def start_from_form(request: Request, pf=Depends(page_admin_form), ctx: WebContext = Depends(get_ctx)):
    p, form = pf
    edges = form.pop("topology_file", None)
    profiles = form.pop("profiles_file", None)
    try:
        raw = config_from_form(form, ctx.catalog.get(wait_s=20.0))
        run = ctx.runs.start(raw, actor=p.name, topology_edges=edges, profiles_toml=profiles)
    except ConfigError as exc:
        return _new_form(request, ctx, p, form, str(exc), status=422)
    except RunError as exc:
        return _new_form(request, ctx, p, form, exc.detail, status=exc.status_code)
    ctx.cache.clear()
    return RedirectResponse(f"/runs/{quote(run.id)}", status_code=303)


@router.get("/runs/{run_id}", response_class=HTMLResponse)
def run_page(request: Request, run_id: str = RunIdPath, p: Principal = Depends(page_user),
             ctx: WebContext = Depends(get_ctx)):
    try:
        run = ctx.runs.get(run_id)
    except RunError as exc:
        return render(request, ctx, p, "error.html", status=404, detail=exc.detail)
    detail = run_detail(ctx, run)
    cat = ctx.catalog.get(wait_s=0.5)
    entry = cat.strategy(run.strategy) or {}
    classes = sorted({n.device_class for n in detail.nodes if n.device_class} | set(detail.policies)
                     | {d.device_class for d in detail.device_classes if d.device_class != "unknown"}
                     | set(DEVICE_CLASSES))
    pending = [c for c in detail.controls if c.applied_at is None]
    return render(request, ctx, p, "run.html", run=detail, log=log_tail(ctx.runs.log_path(run_id), 6000),
                  codecs=[c.get("name") for c in cat.codecs], device_classes=classes, pending=pending,
                  policy_keys=entry.get("policy_keys"), policy_fields=models.DevicePolicy.model_fields,
                  decentralized=entry.get("kind") in ("decentralized", "async", "array"),
                  secagg_on=secagg_on(run.config), secagg_rows=secagg_rounds(ctx.store, run.id),
                  status_json=json.dumps({"actions": detail.actions, "pending": detail.pending}))


@router.post("/runs/{run_id}/control")
def control_form(request: Request, run_id: str = RunIdPath, pf=Depends(page_admin_form),
                 ctx: WebContext = Depends(get_ctx)):
    p, form = pf
    action = form.get("action", "")
    try:
        if action == "kill":
            msg = ctx.runs.force_stop(run_id, p.name)
        elif action in ("pause", "resume", "stop"):
            msg = ctx.runs.control(run_id, action, p.name)[1]
        elif action == "restart":
            msg = ctx.runs.restart(run_id, p.name)
        elif action == "add_rounds":
            try:
                body = models.AddRoundsIn(rounds=form.get("rounds", ""))
            except ValidationError:
                return _back(request, ctx, run_id, "rounds to add must be a whole number from 1 to 100000")
            msg = ctx.runs.control(run_id, "add_rounds", p.name, {"rounds": body.rounds})[1]
        else:
            msg = "unknown action"
    except RunError as exc:
        msg = exc.detail
    ctx.cache.clear()
    return _back(request, ctx, run_id, msg)


@router.post("/runs/{run_id}/policy")
def policy_form(request: Request, run_id: str = RunIdPath, pf=Depends(page_admin_form),
                ctx: WebContext = Depends(get_ctx)):
    p, form = pf
    values: dict = {k: form[k].strip() for k in models.DevicePolicy.model_fields if form.get(k, "").strip()}
    if "codec_params" in values:
        try:
            values["codec_params"] = json.loads(values["codec_params"])
        except ValueError:
            return _back(request, ctx, run_id, "policy refused: 'codec_params' must be a JSON object")
    try:
        body = models.PolicyIn(run_id=run_id, device_class=form.get("device_class", "").strip(),
                                policy=models.DevicePolicy.model_validate(values))
    except ValidationError as exc:
        err = exc.errors()[0]
        return _back(request, ctx, run_id, f"policy refused: '{'.'.join(map(str, err['loc']))}': {err['msg']}")
    policy = body.policy.model_dump(exclude_none=True)
    if not policy:
        return _back(request, ctx, run_id, "policy refused: it sets nothing")
    try:
        msg = ctx.runs.set_policy(run_id, body.device_class, policy, p.name)[1]
    except RunError as exc:
        msg = f"policy refused: {exc.detail}" if exc.status_code == 422 else exc.detail
    ctx.cache.clear()
    return _back(request, ctx, run_id, msg)
