"""Repeated reads of the busiest routes answered straight from the response cache, before
FastAPI's routing and per-parameter validation (which cost most of a
cached answer's CPU time: about 0.5 ms a request, so under 50 concurrent clients the queue,
not the query, made the latency).

:meth:`CachedReads.answer` (called by the dashboard's one middleware,
:class:`fedswarm.web.middleware.Edge`) gives the cached answer of a ``GET`` only when all of these
hold, and otherwise None, and the request goes on to the app untouched:

* the exact path and query string were answered before by the validated route, which recorded
  the cache entry it used (:meth:`ResponseCache.alias`), so parameters and run ids are the ones
  the route checked;
* the caller is a reader (admin or viewer) found in the accounts' principal cache, by the same
  rule as :func:`fedswarm.web.deps.principal` (an ``Authorization`` header if present, else the
  signed session cookie); an unknown, expired, revoked or reporter credential goes to the route,
  which refuses it as before;
* the entry is fresh, or recent enough to serve while a background rebuild runs
  (:meth:`ResponseCache.lookup`).

Every answer of the dashboard is the same for every reader, so no per-user data can leak; the
security headers are added by the middleware, once per answer.
"""

from __future__ import annotations

from starlette.requests import cookie_parser

from fedswarm.web import security
from fedswarm.web.cache import Answer

__all__ = ["CachedReads"]


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    for k, v in headers:  # the first one, as starlette's Request.headers.get reads it
        if k == name:
            return v
    return None


class CachedReads:
    def __init__(self, ctx, session_cookie: str):
        self.ctx = ctx
        self.session_cookie = session_cookie

    def _reader(self, headers: list[tuple[bytes, bytes]]) -> bool:
        accounts = self.ctx.accounts
        auth = _header(headers, b"authorization")
        if auth is not None:
            scheme, _, token = auth.decode("latin-1").partition(" ")
            if scheme.lower() != "bearer":
                return False
            hit, p = accounts.peek_token(token)
        else:
            cookie = _header(headers, b"cookie")
            if not cookie:
                return False
            sid = security.unsign(self.ctx.key, cookie_parser(cookie.decode("latin-1")).get(self.session_cookie))
            if not sid:
                return False
            hit, p = accounts.peek_session(sid)
        return bool(hit and p is not None and p.can_read)

    def answer(self, scope) -> Answer | None:
        """The cached answer to this ``GET`` (a reader's repeat of a validated request), or None;
        schedules the entry's background refresh when it is due. Call on the event loop."""
        cache = self.ctx.cache
        key = cache.key_for(scope["path"], scope["query_string"])
        if key is None or not self._reader(scope["headers"]):
            return None
        value, refresh = cache.lookup(key)
        if not isinstance(value, Answer):
            return None
        if refresh:
            cache.refresh_soon(key)
        return value
