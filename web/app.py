"""The fedswarm dashboard: a FastAPI app over the run store.

``create_app(db_url)`` builds it; ``run(host, port, db)`` serves it with uvicorn (what
``fedswarm dashboard`` calls). The app imports only the core store and config, never torch
or flwr: the strategy catalog, runs and the Flower federation are reached in subprocesses.
"""

from __future__ import annotations

import gc
import ipaddress
import json
import logging
import sys
import threading
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Sequence

from fastapi import FastAPI, HTTPException, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

import fedswarm
from fedswarm.store import Store, migrate
from fedswarm.web import metrics, openapi
from fedswarm.web import tables  # noqa: F401  (registers the web tables on Base)
from fedswarm.web.cache import ResponseCache
from fedswarm.web.deps import SESSION_COOKIE, LoginRequired, WebContext
from fedswarm.web.hot_reads import CachedReads
from fedswarm.web.middleware import Edge
from fedswarm.web.models import clean, json_depth_ok
from fedswarm.web.ratelimit import IngestQuota, LoginThrottle
from fedswarm.web.routers.api import admin as api_admin
from fedswarm.web.routers.api import export as api_export
from fedswarm.web.routers.api import ingest as api_ingest
from fedswarm.web.routers.api import nodes as api_nodes
from fedswarm.web.routers.api import runs as api_runs
from fedswarm.web.routers.api import webhooks as api_webhooks
from fedswarm.web.routers.pages import compare as pages_compare
from fedswarm.web.routers.pages import docs
from fedswarm.web.routers.pages import misc as pages_misc
from fedswarm.web.routers.pages import nodes as pages_nodes
from fedswarm.web.routers.pages import runs as pages_runs
from fedswarm.web.services.accounts import Accounts
from fedswarm.web.services.catalog import Catalog
from fedswarm.web.services.federation import Federation
from fedswarm.web.services.live import Hub
from fedswarm.web.services.runs import RunService
from fedswarm.web.services.webhooks import Webhooks
from fedswarm.web.secret_box import load_box, seal_clear_secrets
from fedswarm.web.settings import Settings

__all__ = ["create_app", "run", "proxy_options", "LOOPBACK"]

HERE = Path(__file__).resolve().parent
log = logging.getLogger("fedswarm.web")


def create_app(db_url: str, *, runs_dir: str | Path | None = None, superlink: str | None = None,
               admin_password: str | None = None, secret_key: str | None = None,
               runner: list[str] | None = None, catalog_cmd: list[str] | None = None,
               poll_interval_s: float = 0.3, secure_cookies: bool = False, https: bool = False,
               behind_proxy: bool = False, report_timeout_s: float | None = None,
               announce: Any = print, freeze_gc: bool = False, cached_reads: bool = True,
               **limits: Any) -> FastAPI:
    """The dashboard app over the store at ``db_url`` (a path or an SQLAlchemy URL).

    On first start (no users yet) it creates user ``admin`` with ``admin_password``, else
    ``FEDSWARM_ADMIN_PASSWORD``, else a generated password passed once to ``announce``.
    ``runner`` and ``catalog_cmd`` replace ``python -m fedswarm`` (tests use fakes).
    ``https``: served over HTTPS (Secure cookies, HSTS); ``behind_proxy``: trust the proxy's
    X-Forwarded-* headers; ``report_timeout_s``: when a silent ingest run shows as lost.
    ``freeze_gc``: once started, move every object made so far (modules, the app, its routes
    and schemas) out of the garbage collector's reach (:func:`gc.freeze`), so that a full
    collection scans only what requests made since: measured, it took full-collection pauses
    from ~60 ms to ~3 ms of CPU. For a serving process, not for tests that build many apps.
    ``cached_reads``: answer repeats of the busiest reads before routing
    (:class:`~fedswarm.web.hot_reads.CachedReads`); off only to benchmark without it.
    ``limits`` override :class:`Settings` quotas (``ingest_per_minute``, ...).
    """
    kw: dict[str, Any] = dict(superlink=superlink, admin_password=admin_password, secret_key=secret_key,
                              poll_interval_s=poll_interval_s, https=https or secure_cookies,
                              behind_proxy=behind_proxy, report_timeout_s=report_timeout_s, **limits)
    if runner is not None:
        kw["runner"] = list(runner)
    if catalog_cmd is not None:
        kw["catalog_cmd"] = list(catalog_cmd)
    settings = Settings.build(db_url, runs_dir, **kw)
    store = Store(settings.db_url)
    migrate(store.engine)  # the web tables and columns, if the store was made before them
    box = load_box(settings.secret_key, settings.secret_key_file)  # the key file is made at first start
    if sealed := seal_clear_secrets(store, box):
        announce(f"fedswarm dashboard: sealed {sealed} webhook secret(s) kept in clear by an older fedswarm")
    accounts = Accounts(store, settings.session_hours, settings.token_days)
    generated = accounts.ensure_admin(settings.admin_password)
    if generated:
        announce(f"fedswarm dashboard: created user 'admin' with password {generated} (shown once)")
    catalog = Catalog(settings.catalog_cmd)
    runs = RunService(store, settings, catalog)
    ctx = WebContext(store=store, settings=settings, accounts=accounts, runs=runs, catalog=catalog,
                     hub=Hub(store, settings.poll_interval_s, settings.report_timeout_s, runs.can_restart),
                     federation=Federation(settings), key=accounts.signing_key(settings.secret_key),
                     templates=Jinja2Templates(directory=str(HERE / "templates")),
                     quota=IngestQuota(settings.ingest_per_minute, settings.ingest_bytes_per_hour),
                     throttle=LoginThrottle(), cache=ResponseCache(store), secrets=box)
    hooks = Webhooks(store, settings, box)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        catalog.start()
        threading.Thread(target=runs.resume_command_available, daemon=True, name="fedswarm-resume-probe").start()
        await ctx.hub.start()
        hooks.start()
        if freeze_gc:
            gc.collect()
            gc.freeze()
        try:
            yield
        finally:
            hooks.stop()
            await ctx.hub.stop()

    app = FastAPI(title="fedswarm dashboard", version=fedswarm.__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None,  # /docs is served offline by fedswarm.web.routers.pages.docs
                  description="Start, watch and steer federated and decentralized runs. "
                              "Authenticate with `Authorization: Bearer <token>` (an API token), or the "
                              "session cookie plus `X-CSRF-Token` on writes (never on GET, HEAD, OPTIONS); "
                              "the security schemes below say which each operation takes.")
    openapi.install(app)  # /openapi.json with the security schemes
    app.state.ctx = ctx
    app.state.metrics = metrics.Metrics(ctx)
    app.state.webhooks = hooks
    # the one middleware: refusals, cached reads, request metrics and security headers
    app.add_middleware(Edge, https=settings.https, session_cookie=SESSION_COOKIE, metrics=app.state.metrics,
                       templates=metrics.RouteTemplates(app.router),
                       cached=CachedReads(ctx, SESSION_COOKIE) if cached_reads else None)
    app.mount("/static", StaticFiles(directory=str(HERE / "static")), name="static")
    docs.mount(app)
    for module in (api_runs, api_export, api_nodes, api_ingest, api_admin, api_webhooks, metrics, pages_runs,
                   pages_compare, pages_misc, pages_nodes, docs):
        app.include_router(module.router)
    _install_handlers(app, ctx)
    return app


def _install_handlers(app: FastAPI, ctx: WebContext) -> None:
    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError):
        # FastAPI's own handler echoes the input back, and JSON cannot carry a NaN input; an input
        # nested past MAX_JSON_DEPTH is echoed as its type only (encoding it recurses once a level).
        errors = [{**e, "input": type(e["input"]).__name__} if "input" in e and not json_depth_ok(e["input"]) else e
                  for e in exc.errors()]
        # ASCII: a key or value with a lone surrogate (JSON's "\\ud800" parses to one) has no UTF-8
        body = json.dumps({"detail": clean(jsonable_encoder(errors))}, ensure_ascii=True, separators=(",", ":"))
        return Response(body, status_code=422, media_type="application/json")

    @app.exception_handler(LoginRequired)
    async def to_login(request: Request, exc: LoginRequired):
        return RedirectResponse(f"/login?next={exc.next_url}", status_code=303)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        if request.url.path.startswith("/api") or request.url.path.startswith("/static"):
            return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)
        return ctx.templates.TemplateResponse(request, "error.html", {"detail": exc.detail, "user": None,
                                                                     "csrf": None, "message": None},
                                              status_code=exc.status_code)


LOOPBACK = ("127.0.0.1", "::1")


def proxy_options(behind_proxy: bool, trusted_proxies: Sequence[str] | str | None = None) -> dict[str, Any]:
    """uvicorn's settings for X-Forwarded-For/-Proto: ignored unless ``behind_proxy``, and then
    believed only from ``trusted_proxies`` (IP addresses or networks, a list or a comma-separated
    string; loopback by default; ``*`` trusts any address). A bad entry raises ValueError naming
    it (uvicorn itself would quietly treat it as a name that never matches)."""
    if not behind_proxy:
        return {"proxy_headers": False}
    if trusted_proxies is None:
        trusted_proxies = LOOPBACK
    entries = trusted_proxies.split(",") if isinstance(trusted_proxies, str) else list(trusted_proxies)
    out = []
    for entry in (e.strip() for e in entries):
        if not entry:
            continue
        if entry != "*":
            try:
                ipaddress.ip_network(entry) if "/" in entry else ipaddress.ip_address(entry)
            except ValueError:
                raise ValueError(f"trusted proxy '{entry}' is not an IP address or network "
                                 "(e.g. 10.0.0.5 or 10.0.0.0/24)") from None
        out.append(entry)
    if not out:
        raise ValueError("no trusted proxy given: name the address of the proxy in front of the dashboard")
    return {"proxy_headers": True, "forwarded_allow_ips": ",".join(out)}


def run(host: str = "127.0.0.1", port: int = 8080, db: str | None = None, *,
        superlink: str | None = None, runs_dir: str | Path | None = None, log_level: str = "info",
        https: bool = False, behind_proxy: bool = False, trusted_proxies: Sequence[str] | str | None = None,
        certfile: str | None = None, keyfile: str | None = None, report_timeout_s: float | None = None,
        access_log: bool = False) -> None:
    """Serve the dashboard until interrupted (``fedswarm dashboard``).

    ``certfile``/``keyfile`` serve TLS directly (and imply ``https``); ``behind_proxy`` trusts
    X-Forwarded-For/-Proto, but only from ``trusted_proxies`` (loopback by default, see
    :func:`proxy_options`). ``access_log``: a line per request on stdout (uvicorn's access log);
    off by default, since writing it took about a fifth of the event loop's time under load
    (errors and start-up are logged either way)."""
    import uvicorn

    from fedswarm.store import default_db_url

    proxy = proxy_options(behind_proxy, trusted_proxies)  # a bad address fails before anything starts
    tls = bool(certfile and keyfile)
    app = create_app(db or default_db_url(), superlink=superlink, runs_dir=runs_dir, https=https or tls,
                     behind_proxy=behind_proxy, report_timeout_s=report_timeout_s, freeze_gc=True)
    scheme = "https" if tls else "http"
    print(f"fedswarm dashboard on {scheme}://{host}:{port}  (store: {app.state.ctx.store.url})", file=sys.stderr)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=3,
                access_log=access_log, **proxy,
                ssl_certfile=certfile if tls else None, ssl_keyfile=keyfile if tls else None)
