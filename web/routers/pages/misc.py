"""HTML pages: login and logout, the Flower federation, users, API tokens and webhooks."""

from __future__ import annotations

import secrets
import sys

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from fastapi import APIRouter, Depends, HTTPException, Path, Request
from fastapi.responses import HTMLResponse, RedirectResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from fedswarm.web import models, security
from fedswarm.web.routers.api import admin as api_admin, webhooks as api_webhooks
from fedswarm.web.services import webhooks
from fedswarm.web.services.accounts import Principal
from fedswarm.web.deps import (SESSION_COOKIE, WebContext, get_ctx, page_admin_form, page_user, principal,
                               read_form)
from fedswarm.web.services.federation import FederationError
from fedswarm.web.routers.pages.common import redirect, render, secure_cookies

router = APIRouter(include_in_schema=False)
LOGIN_CSRF_COOKIE = "fedswarm_login_csrf"
KNOWN_DEVICE_COOKIE = "fedswarm_known"  # this browser logged in as this user before (login throttle)


def _safe_next(url: str | None) -> str:
    return url if url and url.startswith("/") and not url.startswith("//") and "\\" not in url else "/runs"


@router.get("/login", response_class=HTMLResponse)
def login_page(request: Request, next: str = "/runs", p: Principal | None = Depends(principal),
               ctx: WebContext = Depends(get_ctx)):
    if p is not None and p.session_id:
        return RedirectResponse(_safe_next(next), status_code=303)
    return _login_form(request, ctx, _safe_next(next), None)


def _login_form(request: Request, ctx: WebContext, next_url: str, error: str | None, status: int = 200):
    token = secrets.token_urlsafe(24)
    resp = render(request, ctx, None, "login.html", status=status, next=next_url, error=error, login_csrf=token)
    resp.set_cookie(LOGIN_CSRF_COOKIE, token, httponly=True, samesite="strict", max_age=3600,
                    secure=secure_cookies(request, ctx))
    return resp


def _known_device(request: Request, ctx: WebContext, username: str) -> bool:
    value = security.unsign(ctx.key, request.cookies.get(KNOWN_DEVICE_COOKIE))
    return value == "known:" + security.hash_token_secret(username)


@router.post("/login")
async def login(request: Request, ctx: WebContext = Depends(get_ctx)):
    form = await read_form(request)
    next_url = _safe_next(form.get("next"))
    cookie = request.cookies.get(LOGIN_CSRF_COOKIE, "")
    if not cookie or not secrets.compare_digest(cookie, form.get("csrf_token", "")):
        return _login_form(request, ctx, next_url, "the login form expired; try again", status=403)
    username = form.get("username", "")[:64]
    address = request.client.host if request.client else "unknown"
    why = ctx.throttle.blocked(address, username, _known_device(request, ctx, username))
    if why:
        return _login_form(request, ctx, next_url, why, status=429)
    user = await run_in_threadpool(ctx.accounts.authenticate, username, form.get("password", ""))
    if user is None:
        ctx.throttle.failed(address, username)
        return _login_form(request, ctx, next_url, "wrong username or password", status=401)
    ctx.throttle.succeeded(address, username)
    sid = await run_in_threadpool(ctx.accounts.open_session, user)
    ctx.store.add_event(None, "login", f"{user.username} logged in from {address}", actor=user.username)
    resp = RedirectResponse(next_url, status_code=303)
    secure = secure_cookies(request, ctx)
    resp.set_cookie(SESSION_COOKIE, security.sign(ctx.key, sid), httponly=True, samesite="lax",
                    max_age=int(ctx.settings.session_hours * 3600), secure=secure)
    resp.set_cookie(KNOWN_DEVICE_COOKIE, security.sign(ctx.key, "known:" + security.hash_token_secret(user.username)),
                    httponly=True, samesite="strict", max_age=180 * 86400, secure=secure)
    resp.delete_cookie(LOGIN_CSRF_COOKIE)
    return resp


@router.post("/logout")
async def logout(request: Request, p: Principal = Depends(page_user), ctx: WebContext = Depends(get_ctx)):
    form = await read_form(request)
    if not p.session_id or not security.check_csrf(ctx.key, p.session_id, form.get("csrf_token")):
        raise HTTPException(403, "missing or wrong CSRF token")
    ctx.accounts.close_session(p.session_id)
    ctx.store.add_event(None, "logout", f"{p.name} logged out", actor=p.name)
    resp = RedirectResponse("/login", status_code=303)
    resp.delete_cookie(SESSION_COOKIE)
    return resp


@router.get("/federation", response_class=HTMLResponse)
def federation_page(request: Request, log_run: int | None = None, p: Principal = Depends(page_user),
                    ctx: WebContext = Depends(get_ctx)):
    fed, runs, error, log = ctx.federation, [], None, None
    if fed.configured:
        try:
            runs = fed.runs()
            log = fed.log(log_run) if log_run is not None else None
        except FederationError as exc:
            error = str(exc)
    return render(request, ctx, p, "federation.html", fed=fed, runs=runs, error=error, log=log, log_run=log_run)


@router.post("/federation/start")
def federation_start(request: Request, pf=Depends(page_admin_form), ctx: WebContext = Depends(get_ctx)):
    p, form = pf
    try:
        run_config = _flat(tomllib.loads(form.get("run_config", "")))
        out = ctx.federation.start(run_config)
        msg = f"started on the SuperLink: {out.strip()[:300]}"
        ctx.store.add_event(None, "federation.run", msg, data=run_config, actor=p.name)
    except tomllib.TOMLDecodeError as exc:
        msg = f"the run config is not TOML key=value lines: {exc}"
    except FederationError as exc:
        msg = str(exc)
    return redirect(request, ctx, "/federation", msg)


def _flat(d: dict, prefix: str = "") -> dict:
    """Flower's run_config is flat: nested TOML tables become dotted keys."""
    out: dict = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


@router.post("/federation/stop")
def federation_stop(request: Request, pf=Depends(page_admin_form), ctx: WebContext = Depends(get_ctx)):
    p, form = pf
    try:
        flwr_run = int(form.get("run_id", ""))
        ctx.federation.stop(flwr_run)
        msg = f"stop sent for Flower run {flwr_run}"
        ctx.store.add_event(None, "federation.stop", msg, actor=p.name)
    except ValueError:
        msg = "a Flower run id is a number"
    except FederationError as exc:
        msg = str(exc)
    return redirect(request, ctx, "/federation", msg)


def admin_data(ctx: WebContext) -> dict:
    """What the admin page shows: users, tokens, webhooks and their latest deliveries."""
    return dict(users=ctx.accounts.list_users(), tokens=ctx.accounts.list_tokens(), new_token=None,
                **api_webhooks.page_data(ctx.store))


@router.get("/admin", response_class=HTMLResponse)
def admin_page(request: Request, p: Principal = Depends(page_user), ctx: WebContext = Depends(get_ctx)):
    if not p.is_admin:
        return render(request, ctx, p, "error.html", status=403, detail="users and tokens need the admin role")
    return render(request, ctx, p, "admin.html", **admin_data(ctx))


@router.post("/admin/users")
def admin_add_user(request: Request, pf=Depends(page_admin_form), ctx: WebContext = Depends(get_ctx)):
    p, form = pf
    try:
        body = models.UserIn(username=form.get("username", ""), password=form.get("password", ""),
                              role=form.get("role", "viewer"))
        api_admin.create_user(ctx, body, p.name)
        msg = f"user '{body.username}' added"
    except ValidationError as exc:
        msg = f"invalid user: {exc.errors()[0]['loc'][-1]}: {exc.errors()[0]['msg']}"
    except HTTPException as exc:
        msg = str(exc.detail)
    return redirect(request, ctx, "/admin", msg)


@router.post("/admin/tokens", response_class=HTMLResponse)
def admin_add_token(request: Request, pf=Depends(page_admin_form), ctx: WebContext = Depends(get_ctx)):
    p, form = pf
    try:
        body = models.TokenIn(name=form.get("name", ""), role=form.get("role", "reporter"),
                               run_id=form.get("run_id") or None,
                               expires_in_days=form.get("expires_in_days") or None)
        created = api_admin.create_token(ctx, body, p.name)
    except ValidationError as exc:
        msg = f"invalid token request: {exc.errors()[0]['loc'][-1]}: {exc.errors()[0]['msg']}"
        return redirect(request, ctx, "/admin", msg)
    except HTTPException as exc:
        return redirect(request, ctx, "/admin", str(exc.detail))
    # The secret is shown in this answer only (never in a URL, never stored).
    return render(request, ctx, p, "admin.html", **{**admin_data(ctx), "new_token": created})


@router.post("/admin/tokens/{token_id}/revoke")
def admin_revoke_token(request: Request, token_id: int = Path(ge=1, le=2**62), pf=Depends(page_admin_form),
                       ctx: WebContext = Depends(get_ctx)):
    p, _ = pf
    ok = ctx.accounts.revoke_token(token_id)
    if ok:
        ctx.store.add_event(None, "token.revoked", f"token {token_id} revoked", actor=p.name)
    return redirect(request, ctx, "/admin", "token revoked" if ok else "no such token")


@router.post("/admin/webhooks", response_class=HTMLResponse)
def admin_add_webhook(request: Request, pf=Depends(page_admin_form), ctx: WebContext = Depends(get_ctx)):
    p, form = pf
    try:
        body = api_webhooks.WebhookIn(url=form.get("url", ""), secret=form.get("secret") or None,
                                      events=[e for e in webhooks.EVENTS if form.get(f"event_{e}")])
    except ValidationError as exc:
        err = exc.errors()[0]
        where = err["loc"][-1] if err["loc"] else "webhook"
        return redirect(request, ctx, "/admin", f"invalid webhook: {where}: {err['msg']}")
    created = api_webhooks.create(ctx, body, p.name)
    # The secret is shown in this answer only.
    return render(request, ctx, p, "admin.html", **{**admin_data(ctx), "new_webhook": created})


@router.post("/admin/webhooks/{webhook_id}/delete")
def admin_delete_webhook(request: Request, webhook_id: int = api_webhooks.WebhookId, pf=Depends(page_admin_form),
                         ctx: WebContext = Depends(get_ctx)):
    try:
        api_webhooks.delete(ctx, webhook_id, pf[0].name)
        msg = f"webhook {webhook_id} deleted"
    except HTTPException as exc:
        msg = str(exc.detail)
    return redirect(request, ctx, "/admin", msg)
