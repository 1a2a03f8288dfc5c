"""FastAPI dependencies: the app context, who is asking, and what they may do.

API requests authenticate with ``Authorization: Bearer <token>`` or the session cookie;
cookie-authenticated writes must also send ``X-CSRF-Token`` (pages get it from a meta tag),
so another site cannot make a logged-in browser change anything. Page forms carry the same
token in a ``csrf_token`` field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, quote

from fastapi import Depends, HTTPException, Request
from starlette.templating import Jinja2Templates

from fedswarm.store import Store
from fedswarm.web import security
from fedswarm.web.accounts import Accounts, Principal
from fedswarm.web.catalog import Catalog
from fedswarm.web.federation import Federation
from fedswarm.web.live import Hub
from fedswarm.web.runs_service import RunService
from fedswarm.web.settings import Settings

__all__ = ["WebContext", "get_ctx", "principal", "require_reader", "require_admin", "require_reporter",
           "page_user", "page_admin_form", "read_form", "LoginRequired", "SESSION_COOKIE"]

SESSION_COOKIE = "fedswarm_session"
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

    def csrf(self, p: Principal | None) -> str | None:
        return security.csrf_token(self.key, p.session_id) if p and p.session_id else None


def get_ctx(request: Request) -> WebContext:
    return request.app.state.ctx


def principal(request: Request, ctx: WebContext = Depends(get_ctx)) -> Principal | None:
    auth = request.headers.get("authorization")
    if auth:
        scheme, _, token = auth.partition(" ")
        return ctx.accounts.principal_for_token(token) if scheme.lower() == "bearer" else None
    sid = security.unsign(ctx.key, request.cookies.get(SESSION_COOKIE))
    return ctx.accounts.principal_for_session(sid) if sid else None


def require_reader(p: Principal | None = Depends(principal)) -> Principal:
    if p is None:
        raise HTTPException(401, "log in or send 'Authorization: Bearer <token>'",
                            headers={"WWW-Authenticate": "Bearer"})
    if not p.can_read:
        raise HTTPException(403, "a reporter token may only write to /api/ingest")
    return p


def require_admin(request: Request, p: Principal = Depends(require_reader),
                  ctx: WebContext = Depends(get_ctx)) -> Principal:
    if not p.is_admin:
        raise HTTPException(403, f"'{p.name}' is a {p.role}; this needs the admin role")
    if p.session_id and not security.check_csrf(ctx.key, p.session_id, request.headers.get("x-csrf-token")):
        raise HTTPException(403, "missing or wrong X-CSRF-Token header for a cookie-authenticated write")
    return p


def require_reporter(p: Principal | None = Depends(principal)) -> Principal:
    if p is None:
        raise HTTPException(401, "send 'Authorization: Bearer <token>' (a reporter or admin token)",
                            headers={"WWW-Authenticate": "Bearer"})
    if p.token_id is None or p.role not in ("reporter", "admin"):
        raise HTTPException(403, "ingest needs a reporter or admin API token")
    return p


# -- pages -----------------------------------------------------------------------------
class LoginRequired(Exception):
    def __init__(self, next_url: str):
        self.next_url = next_url


def page_user(request: Request, p: Principal | None = Depends(principal)) -> Principal:
    """A logged-in user for a page; anyone else is sent to the login page."""
    if p is None or not p.can_read:
        raise LoginRequired(quote(request.url.path))
    return p


async def read_form(request: Request) -> dict[str, str]:
    """An url-encoded form body (the pages post nothing else)."""
    ctype = request.headers.get("content-type", "")
    if not ctype.startswith("application/x-www-form-urlencoded"):
        raise HTTPException(415, "forms must be application/x-www-form-urlencoded")
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
