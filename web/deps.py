"""FastAPI dependencies: the app context, who is asking, and what they may do.

API requests authenticate with ``Authorization: Bearer <token>`` or the session cookie;
cookie-authenticated writes (any method but GET, HEAD and OPTIONS) must also send
``X-CSRF-Token`` (pages get it from a meta tag), so another site cannot make a logged-in
browser change anything; safe methods never need it. Page forms carry the same token in a
``csrf_token`` field. The OpenAPI document declares these schemes (:mod:`fedswarm.web.openapi`).
"""

from __future__ import annotations

import asyncio
import datetime as dt
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, quote

from fastapi import Depends, HTTPException, Path, Request, Security
from fastapi.security import APIKeyCookie, HTTPBearer
from starlette.datastructures import UploadFile
from starlette.templating import Jinja2Templates

from fedswarm.store import Run, Store
from fedswarm.web import security
from fedswarm.web.services.accounts import Accounts, Principal
from fedswarm.web.cache import ResponseCache
from fedswarm.web.services.catalog import Catalog
from fedswarm.web.services.federation import Federation
from fedswarm.web.services.live import Hub
from fedswarm.web.ratelimit import IngestQuota, LoginThrottle, QuotaExceeded
from fedswarm.web.services.runs import RunService
from fedswarm.web.models import RUN_ID_PATTERN
from fedswarm.web.secret_box import SecretBox
from fedswarm.web.settings import Settings

__all__ = ["WebContext", "get_ctx", "principal", "require_reader", "require_admin", "require_reporter",
           "authorize_run", "ingest_run", "page_user", "page_admin_form", "read_form", "LoginRequired",
           "SESSION_COOKIE", "CSRF_HEADER", "SAFE_METHODS", "RunIdPath"]

# Every run id in a path is checked against this before anything reads a file or the store.
RunIdPath = Path(pattern=RUN_ID_PATTERN, description="a run id, as listed by GET /api/runs")

SESSION_COOKIE = "fedswarm_session"
CSRF_HEADER = "X-CSRF-Token"
#: Methods that change nothing: a cookie-authenticated request needs no CSRF token for them.
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# The schemes the OpenAPI document declares (fedswarm.web.openapi); as dependencies they only
# name the credentials a route takes, the principal is read below.
BEARER = HTTPBearer(auto_error=False, scheme_name="bearerToken",
                    description="An API token (admin page, API tokens): `Authorization: Bearer <token>`.")
COOKIE = APIKeyCookie(name=SESSION_COOKIE, auto_error=False, scheme_name="sessionCookie",
                      description="The session cookie a browser gets by logging in at /login; writes also send "
                                  "X-CSRF-Token (scheme csrfHeader).")
MAX_FORM_BYTES = 256_000


@dataclass
class WebContext:
    store: Store
    settings: Settings
    accounts: Accounts
    runs: RunService
    catalog: Catalog
    hub: Hub
    federation: Federation
    key: bytes
    templates: Jinja2Templates
    quota: IngestQuota
    throttle: LoginThrottle
    cache: ResponseCache
    secrets: SecretBox  # seals and opens the webhook secrets kept in the store

    def csrf(self, p: Principal | None) -> str | None:
        return security.csrf_token(self.key, p.session_id) if p and p.session_id else None


# The dependencies below are ``async`` so that FastAPI runs them on the event loop instead of
# a worker thread each: with the principal cached, a request costs no thread hop and no query.
async def get_ctx(request: Request) -> WebContext:
    return request.app.state.ctx


async def principal(request: Request, ctx: WebContext = Depends(get_ctx), _token: Any = Security(BEARER),
                    _cookie: Any = Security(COOKIE)) -> Principal | None:
    """Who sends the request: an API token's principal or a logged-in user's (None: nobody)."""
    return await _principal(request, ctx)


async def token_principal(request: Request, ctx: WebContext = Depends(get_ctx),
                          _token: Any = Security(BEARER)) -> Principal | None:
    """Like :func:`principal`, for routes that take an API token only (declared so in OpenAPI)."""
    return await _principal(request, ctx)


async def _principal(request: Request, ctx: WebContext) -> Principal | None:
    auth = request.headers.get("authorization")
    if auth:
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer":
            return None
        hit, p = ctx.accounts.peek_token(token)
        return p if hit else await asyncio.to_thread(ctx.accounts.principal_for_token, token)
    sid = security.unsign(ctx.key, request.cookies.get(SESSION_COOKIE))
    if not sid:
        return None
    hit, p = ctx.accounts.peek_session(sid)
    return p if hit else await asyncio.to_thread(ctx.accounts.principal_for_session, sid)


async def require_reader(p: Principal | None = Depends(principal)) -> Principal:
    if p is None:
        raise HTTPException(401, "log in or send 'Authorization: Bearer <token>'",
                            headers={"WWW-Authenticate": "Bearer"})
    if not p.can_read:
        raise HTTPException(403, "a reporter token may only write to /api/ingest")
    return p


async def require_admin(request: Request, p: Principal = Depends(require_reader),
                        ctx: WebContext = Depends(get_ctx)) -> Principal:
    if not p.is_admin:
        raise HTTPException(403, f"'{p.name}' is a {p.role}; this needs the admin role")
    if (p.session_id and request.method not in SAFE_METHODS
            and not security.check_csrf(ctx.key, p.session_id, request.headers.get(CSRF_HEADER))):
        raise HTTPException(403, f"missing or wrong {CSRF_HEADER} header for a cookie-authenticated write")
    return p


async def require_reporter(request: Request, p: Principal | None = Depends(token_principal),
                           ctx: WebContext = Depends(get_ctx)) -> Principal:
    """A reporter or admin API token within its ingest quota (429 with Retry-After past it)."""
    if p is None:
        raise HTTPException(401, "send 'Authorization: Bearer <token>' (a reporter or admin token)",
                            headers={"WWW-Authenticate": "Bearer"})
    if p.token_id is None or p.role not in ("reporter", "admin"):
        raise HTTPException(403, "ingest needs a reporter or admin API token")
    try:
        ctx.quota.charge(p.token_id, len(await request.body()))
    except QuotaExceeded as exc:
        raise HTTPException(429, exc.detail, headers={"Retry-After": str(exc.retry_after_s)}) from None
    return p


def authorize_run(ctx: WebContext, p: Principal, run_id: str) -> Run:
    """The run ``run_id`` if ingest principal ``p`` may act on it, else 404 or 403.

    An admin token acts on any run; a token bound to a run only on that run; any other
    reporter token only on runs it registered itself (``Run.owner``). A run started from the
    dashboard is owned by the dashboard, so only its own process (which writes the store
    directly) or an admin can report on, finish or steer it. Each accepted call refreshes the
    run's last-report time (what liveness reads).
    """
    run = ctx.store.get_run(run_id)
    if run is None:
        raise HTTPException(404, f"no run '{run_id}' in the store")
    if not p.is_admin:
        if p.run_id is not None:
            if p.run_id != run_id:
                raise HTTPException(403, f"this token may only report on run '{p.run_id}'")
        elif run.owner != p.owner_tag:
            raise HTTPException(403, f"run '{run_id}' was not registered by this token; "
                                     "a reporter token acts only on runs it registered or is bound to")
    now = dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)
    if run.last_report_at is None or (now - run.last_report_at).total_seconds() > 1.0:
        ctx.store.update_run(run_id, last_report_at=now)
    return run


def ingest_run(run_id: str = RunIdPath, p: Principal = Depends(require_reporter),
               ctx: WebContext = Depends(get_ctx)) -> tuple[Principal, Run]:
    """The one ownership check of every ``/api/ingest/runs/{run_id}/...`` route."""
    return p, authorize_run(ctx, p, run_id)


# -- pages -----------------------------------------------------------------------------
class LoginRequired(Exception):
    def __init__(self, next_url: str):
        self.next_url = next_url


async def page_user(request: Request, p: Principal | None = Depends(principal)) -> Principal:
    """A logged-in user for a page; anyone else is sent to the login page."""
    if p is None or not p.can_read:
        raise LoginRequired(quote(request.url.path))
    return p


async def read_form(request: Request) -> dict[str, str]:
    """An url-encoded form body, or a multipart one whose files (UTF-8 text: an edge list, a
    profiles file) come back as strings under their field names."""
    ctype = request.headers.get("content-type", "")
    if ctype.startswith("multipart/form-data"):
        try:
            form = await request.form(max_files=4, max_fields=2000, max_part_size=2_100_000)
        except Exception as exc:  # starlette raises its own parser errors
            raise HTTPException(400, f"malformed form: {exc}") from None
        out: dict[str, str] = {}
        for k, v in form.multi_items():
            if isinstance(v, UploadFile):
                data = await v.read()
                if data:
                    try:
                        out[k] = data.decode("utf-8")
                    except UnicodeDecodeError:
                        raise HTTPException(400, f"the file in '{k}' is not UTF-8 text") from None
            else:
                out[k] = v
        return out
    if not ctype.startswith("application/x-www-form-urlencoded"):
        raise HTTPException(415, "forms must be application/x-www-form-urlencoded or multipart/form-data")
    body = await request.body()
    if len(body) > MAX_FORM_BYTES:
        raise HTTPException(413, f"form larger than {MAX_FORM_BYTES} bytes")
    try:
        return dict(parse_qsl(body.decode("utf-8"), keep_blank_values=True, max_num_fields=2000))
    except (UnicodeDecodeError, ValueError) as exc:
        raise HTTPException(400, f"malformed form: {exc}") from None


async def page_admin_form(request: Request, p: Principal = Depends(page_user),
                          ctx: WebContext = Depends(get_ctx)) -> tuple[Principal, dict[str, Any]]:
    """An admin's form post with a valid CSRF token, and its fields."""
    form = await read_form(request)
    if not p.session_id or not security.check_csrf(ctx.key, p.session_id, form.get("csrf_token")):
        raise HTTPException(403, "missing or wrong CSRF token; reload the page and try again")
    if not p.is_admin:
        raise HTTPException(403, f"'{p.name}' is a {p.role}; this needs the admin role")
    return p, form
