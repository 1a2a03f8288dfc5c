"""A plain ASGI middleware (cheaper than Starlette's BaseHTTPMiddleware, and it leaves
streaming responses alone) that does the cheap refusals before any work, and adds headers.

Before the app sees a request:

* a write to ``/api/`` with neither an ``Authorization`` header nor a session cookie is
  answered 401 without reading its body;
* each route has a body cap (:data:`BODY_CAPS`, else :data:`DEFAULT_CAP`): a declared
  ``Content-Length`` over it is answered 413 at once, and a chunked body is read only up to
  the cap (so memory stays bounded by it) and answered 413 as soon as it passes it. Both
  answers close the connection, so the client stops sending.

On the way out: ``nosniff``, ``DENY`` framing, ``same-origin`` referrers, a strict CSP on
HTML, ``Cache-Control: no-store`` on everything but static assets (pages and answers carry
run data and, once, token secrets), and HSTS when the dashboard is served over HTTPS.
"""

from __future__ import annotations

import json
import re

__all__ = ["SecurityHeaders", "BODY_CAPS", "DEFAULT_CAP", "body_cap"]

DEFAULT_CAP = 65_536
# (method, path pattern, cap in bytes), first match wins.
BODY_CAPS: list[tuple[str, re.Pattern, int]] = [(m, re.compile(p), n) for m, p, n in (
    ("POST", r"^/api/ingest/runs/[^/]+/rounds$", 2_000_000),  # up to 10,000 per-node rows
    ("POST", r"^/api/ingest/runs$", 80_000),
    ("POST", r"^/api/ingest/nodes$", 16_384),
    ("POST", r"^/api/ingest/", 8_192),
    ("POST", r"^/api/runs$", 2_200_000),  # may carry an uploaded topology or profiles file
    ("POST", r"^/runs/new$", 2_200_000),  # the form, with its file uploads
    ("POST", r"^/login$", 8_192),
)]
_WRITES = {"POST", "PUT", "PATCH", "DELETE"}
_HEADERS = [(b"x-content-type-options", b"nosniff"), (b"x-frame-options", b"DENY"),
            (b"referrer-policy", b"same-origin")]
_CSP = (b"content-security-policy",
        b"default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'; frame-ancestors 'none'")
_NO_STORE = (b"cache-control", b"no-store")
_HSTS = (b"strict-transport-security", b"max-age=31536000")


def body_cap(method: str, path: str) -> int:
    for m, pattern, cap in BODY_CAPS:
        if m == method and pattern.match(path):
            return cap
    return DEFAULT_CAP


async def _answer(send, status: int, detail: str, extra: list | None = None) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"), _NO_STORE, *(extra or [])]})
    await send({"type": "http.response.body", "body": body})


class SecurityHeaders:
    def __init__(self, app, https: bool = False, session_cookie: str = "fedswarm_session"):
        self.app = app
        self.https = https
        self.session_cookie = session_cookie.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        method, path = scope["method"], scope["path"]
        headers = dict(scope.get("headers") or [])
        if method in _WRITES and path.startswith("/api/") and b"authorization" not in headers \
                and self.session_cookie + b"=" not in headers.get(b"cookie", b""):
            return await _answer(send, 401, "log in or send 'Authorization: Bearer <token>'",
                                 [(b"www-authenticate", b"Bearer")])
        cap = body_cap(method, path)
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > cap:
            return await _answer(send, 413, f"request body over {cap} bytes (the limit of {method} {path})")
        if method in _WRITES and not length:
            body = bytearray()
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    return
                body += msg.get("body", b"")
                if len(body) > cap:
                    return await _answer(send, 413, f"request body over {cap} bytes (the limit of {method} {path})")
                if not msg.get("more_body", False):
                    break
            receive = _replay(bytes(body), receive)

        static = path.startswith("/static/") or path.startswith("/docs/assets/")
        https = self.https or scope.get("scheme") == "https"

        async def send_with_headers(message):
            if message["type"] == "http.response.start":
                out = list(message.get("headers") or [])
                names = {k.lower() for k, _ in out}
                out += [h for h in _HEADERS if h[0] not in names]
                ctype = next((v for k, v in out if k.lower() == b"content-type"), b"")
                if ctype.startswith(b"text/html") and _CSP[0] not in names:
                    out.append(_CSP)
                if not static and b"cache-control" not in names:
                    out.append(_NO_STORE)
                if https:
                    out.append(_HSTS)
                message = {**message, "headers": out}
            await send(message)

        await self.app(scope, receive, send_with_headers)


def _replay(body: bytes, receive):
    """A ``receive`` that gives the buffered body once, then the real channel (disconnects)."""
    sent = False

    async def again():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return again
