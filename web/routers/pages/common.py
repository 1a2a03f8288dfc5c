"""What every HTML page shares: rendering with the user and CSRF token, and flash messages.

A banner shows only text the server chose: a redirect after an action carries its message in
a short-lived cookie signed with the dashboard's key (never in the URL, where anyone could
write a link that puts their words in the banner).
"""

from __future__ import annotations

import base64

from fastapi import Request
from fastapi.responses import HTMLResponse, RedirectResponse

from fedswarm.web import security
from fedswarm.web.services.accounts import Principal
from fedswarm.web.deps import WebContext

__all__ = ["render", "redirect", "secure_cookies", "FLASH_COOKIE"]

FLASH_COOKIE = "fedswarm_flash"


def secure_cookies(request: Request, ctx: WebContext) -> bool:
    """Cookies are ``Secure`` when the dashboard is served over HTTPS (or says it is)."""
    return ctx.settings.https or request.url.scheme == "https"


def _read_flash(request: Request, ctx: WebContext) -> str | None:
    value = security.unsign(ctx.key, request.cookies.get(FLASH_COOKIE))
    if not value or not value.startswith("flash:"):
        return None
    try:
        return base64.urlsafe_b64decode(value[6:].encode()).decode("utf-8")[:2000]
    except (ValueError, UnicodeDecodeError):
        return None


def render(request: Request, ctx: WebContext, p: Principal | None, name: str, status: int = 200,
           **context) -> HTMLResponse:
    message = _read_flash(request, ctx)
    context.update(user=p, csrf=ctx.csrf(p), message=message)
    resp = ctx.templates.TemplateResponse(request, name, context, status_code=status)
    if FLASH_COOKIE in request.cookies:
        resp.delete_cookie(FLASH_COOKIE, path="/")
    return resp


def redirect(request: Request, ctx: WebContext, url: str, message: str | None = None) -> RedirectResponse:
    """A 303 to ``url`` whose next page shows ``message`` in its banner."""
    resp = RedirectResponse(url, status_code=303)
    if message:
        value = "flash:" + base64.urlsafe_b64encode(message[:2000].encode()).decode()
        resp.set_cookie(FLASH_COOKIE, security.sign(ctx.key, value), max_age=60, path="/", httponly=True,
                        samesite="lax", secure=secure_cookies(request, ctx))
    return resp
