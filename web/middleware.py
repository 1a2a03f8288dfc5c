"""The dashboard's one ASGI middleware, :class:`Edge` (plain ASGI: cheaper than Starlette's
BaseHTTPMiddleware, and it leaves streaming responses alone). Every HTTP request passes it once,
and it wraps ``send`` once; it does, in order:

1. the cheap refusals, before any work:

   * a write to ``/api/`` with neither an ``Authorization`` header nor a session cookie is
     answered 401 without reading its body;
   * each route has a body cap (:data:`BODY_CAPS`, else :data:`DEFAULT_CAP`): a declared
     ``Content-Length`` over it is answered 413 at once, and a chunked body is read only up to
     the cap (so memory stays bounded by it) and answered 413 as soon as it passes it. Both
     answers close the connection, so the client stops sending.

2. cached reads: a reader's repeat of a busy ``GET`` is answered from the response cache
   (:class:`fedswarm.web.hot_reads.CachedReads`) with headers built once per cached answer;

3. metrics: each request's time to its first byte and its status, labelled by route template
   (:class:`fedswarm.web.metrics.RouteTemplates`, :meth:`fedswarm.web.metrics.Metrics.observe`);
   a request the app ends with an exception counts as a 500;

4. headers on the way out: ``nosniff``, ``DENY`` framing, ``same-origin`` referrers, a strict CSP
   on HTML, ``Cache-Control: no-store`` on everything but static assets (pages and answers carry
   run data and, once, token secrets), and HSTS when the dashboard is served over HTTPS.

Starlette's own ``ServerErrorMiddleware`` stays outside it (it answers 500 to an exception the
app raises before answering, and logs it); by the benchmark's profile it is about 1% of a
request's time.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

__all__ = ["Edge", "BODY_CAPS", "DEFAULT_CAP", "body_cap"]

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


async def _answer(send, status: int, detail: str, https: bool, extra: list | None = None) -> None:
    body = json.dumps({"detail": detail}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"connection", b"close"), *(extra or [])]
    await send({"type": "http.response.start", "status": status, "headers": _extra_headers(headers, https, False)})
    await send({"type": "http.response.body", "body": body})


def _extra_headers(out: list, https: bool, static: bool) -> list:
    """``out`` (a response's headers) with the security headers it lacks added."""
    names = set()
    ctype = b""
    for k, v in out:
        k = k.lower()
        names.add(k)
        if k == b"content-type" and not ctype:
            ctype = v
    out = out + [h for h in _HEADERS if h[0] not in names]
    if _CSP[0] not in names and ctype.startswith(b"text/html"):
        out.append(_CSP)
    if not static and b"cache-control" not in names:
        out.append(_NO_STORE)
    if https:
        out.append(_HSTS)
    return out


class Edge:
    """See the module's docstring. ``metrics`` (a :class:`~fedswarm.web.metrics.Metrics`) and
    ``templates`` (a :class:`~fedswarm.web.metrics.RouteTemplates`) time requests; ``cached``
    (a :class:`~fedswarm.web.hot_reads.CachedReads`, or None) answers repeated reads."""

    def __init__(self, app, *, https: bool = False, session_cookie: str = "fedswarm_session",
                 metrics: Any = None, templates: Any = None, cached: Any = None):
        self.app = app
        self.https = https
        self.session_cookie = session_cookie.encode()
        self.metrics, self.templates, self.cached = metrics, templates, cached

    def _observe(self, scope, status: int, t0: float) -> None:
        if self.metrics is not None:
            self.metrics.observe(scope["method"], self.templates(scope), status, time.perf_counter() - t0)

    @staticmethod
    def _messages(answer, https: bool) -> tuple[dict, dict]:
        """A cached answer's start and body messages, security headers included: built once and
        kept on the answer (:attr:`fedswarm.web.cache.Answer.ready`), so they go with it."""
        hit = answer.ready.get(https)
        if hit is None:
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(answer.body)).encode())]
            headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in answer.headers]
            hit = answer.ready[https] = ({"type": "http.response.start", "status": 200,
                                          "headers": _extra_headers(headers, https, False)},
                                         {"type": "http.response.body", "body": answer.body})
        return hit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        method, path = scope["method"], scope["path"]
        https = self.https or scope.get("scheme") == "https"
        length = auth = cookie = None
        for k, v in scope["headers"]:
            if k == b"content-length":
                length = v
            elif k == b"authorization":
                auth = v
            elif k == b"cookie":
                cookie = v
        if method in _WRITES and path.startswith("/api/") and auth is None \
                and (cookie is None or self.session_cookie + b"=" not in cookie):
            await _answer(send, 401, "log in or send 'Authorization: Bearer <token>'", https,
                          [(b"www-authenticate", b"Bearer")])
            return self._observe(scope, 401, t0)
        cap = body_cap(method, path)
        if length is not None and length.isdigit() and int(length) > cap:
            await _answer(send, 413, f"request body over {cap} bytes (the limit of {method} {path})", https)
            return self._observe(scope, 413, t0)
        if method in _WRITES and not length:
            body = bytearray()
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":  # no answer: counted as a 500, as an error would be
                    return self._observe(scope, 500, t0)
                body += msg.get("body", b"")
                if len(body) > cap:
                    await _answer(send, 413, f"request body over {cap} bytes (the limit of {method} {path})", https)
                    return self._observe(scope, 413, t0)
                if not msg.get("more_body", False):
                    break
            receive = _replay(bytes(body), receive)
        elif method == "GET" and self.cached is not None:
            answer = self.cached.answer(scope)
            if answer is not None:
                start, body_msg = self._messages(answer, https)
                self._observe(scope, 200, t0)
                await send(start)
                await send(body_msg)
                return

        static = path.startswith("/static/") or path.startswith("/docs/assets/")
        started = False

        async def edge_send(message):
            nonlocal started
            if message["type"] == "http.response.start" and not started:
                started = True
                self._observe(scope, message["status"], t0)
                message = {**message, "headers": _extra_headers(list(message.get("headers") or ()), https, static)}
            await send(message)

        try:
            await self.app(scope, receive, edge_send)
        finally:
            if not started:  # no answer at all (an error, a dropped connection)
                self._observe(scope, 500, t0)


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
