"""HTML pages for runs: the list, a run's detail with live charts and controls, the new-run form."""

from __future__ import annotations

import json
from urllib.parse import quote

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse, RedirectResponse
from pydantic import ValidationError

from fedswarm.config import ConfigError
from fedswarm.web import queries, schemas
from fedswarm.web.accounts import Principal
from fedswarm.web.deps import WebContext, get_ctx, page_admin_form, page_user
from fedswarm.web.forms import config_from_form, form_fields
from fedswarm.web.launcher import log_tail
from fedswarm.web.runs_service import RunError

router = APIRouter(include_in_schema=False)
DEVICE_CLASSES = ("datacenter", "gpu", "cpu", "edge-wifi", "edge-lte", "straggler")


def render(request: Request, ctx: WebContext, p: Principal | None, name: str, status: int = 200,
           **context) -> HTMLResponse:
    context.update(user=p, csrf=ctx.csrf(p), message=request.query_params.get("msg"))
    return ctx.templates.TemplateResponse(request, name, context, status_code=status)


def _back(run_id: str, msg: str) -> RedirectResponse:
    return RedirectResponse(f"/runs/{quote(run_id)}?msg={quote(msg)}", status_code=303)


@router.get("/")
def home() -> RedirectResponse:
    return RedirectResponse("/runs", status_code=303)


@router.get("/runs", response_class=HTMLResponse)
def runs_page(request: Request, p: Principal = Depends(page_user), ctx: WebContext = Depends(get_ctx)):
    return render(request, ctx, p, "runs.html", runs=queries.run_summaries(ctx.store))


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
    try:
        raw = config_from_form(form, ctx.catalog.get(wait_s=20.0))
        run = ctx.runs.start(raw, actor=p.name)
    except ConfigError as exc:
        return _new_form(request, ctx, p, form, str(exc), status=422)
    except RunError as exc:
        return _new_form(request, ctx, p, form, exc.detail, status=exc.status_code)
    return RedirectResponse(f"/runs/{quote(run.id)}", status_code=303)


@router.get("/runs/{run_id}", response_class=HTMLResponse)
def run_page(request: Request, run_id: str, p: Principal = Depends(page_user), ctx: WebContext = Depends(get_ctx)):
    try:
        run = ctx.runs.get(run_id)
    except RunError as exc:
        return render(request, ctx, p, "error.html", status=404, detail=exc.detail)
    detail = queries.run_detail(ctx.store, run)
    cat = ctx.catalog.get(wait_s=0.5)
    classes = sorted({n.device_class for n in detail.nodes if n.device_class} | set(detail.policies)
                     | set(DEVICE_CLASSES))
    return render(request, ctx, p, "run.html", run=detail, log=log_tail(ctx.runs.log_path(run_id), 6000),
                  codecs=[c.get("name") for c in cat.codecs], device_classes=classes,
                  policy_fields=schemas.DevicePolicy.model_fields)


@router.post("/runs/{run_id}/control")
def control_form(run_id: str, pf=Depends(page_admin_form), ctx: WebContext = Depends(get_ctx)):
    p, form = pf
    action = form.get("action", "")
    try:
        if action == "kill":
            msg = ctx.runs.force_stop(run_id, p.name)
        elif action in ("pause", "resume", "stop"):
            msg = ctx.runs.control(run_id, action, p.name)[1]
        elif action == "add_rounds":
            try:
                body = schemas.AddRoundsIn(rounds=form.get("rounds", ""))
            except ValidationError:
                return _back(run_id, "rounds to add must be a whole number from 1 to 100000")
            msg = ctx.runs.control(run_id, "add_rounds", p.name, {"rounds": body.rounds})[1]
        else:
            msg = f"unknown action {action!r}"
    except RunError as exc:
        msg = exc.detail
    return _back(run_id, msg)


@router.post("/runs/{run_id}/policy")
def policy_form(run_id: str, pf=Depends(page_admin_form), ctx: WebContext = Depends(get_ctx)):
    p, form = pf
    values: dict = {k: form[k].strip() for k in schemas.DevicePolicy.model_fields if form.get(k, "").strip()}
    if "codec_params" in values:
        try:
            values["codec_params"] = json.loads(values["codec_params"])
        except ValueError:
            return _back(run_id, "invalid policy: codec_params must be a JSON object")
    try:
        body = schemas.PolicyIn(run_id=run_id, device_class=form.get("device_class", "").strip(),
                                policy=schemas.DevicePolicy.model_validate(values))
    except ValidationError as exc:
        err = exc.errors()[0]
        return _back(run_id, f"invalid policy: {'.'.join(map(str, err['loc']))}: {err['msg']}")
    policy = body.policy.model_dump(exclude_none=True)
    if not policy:
        return _back(run_id, "the policy sets nothing")
    try:
        msg = ctx.runs.control(run_id, "policy", p.name, {"device_class": body.device_class, "policy": policy})[1]
    except RunError as exc:
        msg = exc.detail
    return _back(run_id, msg)
