"""The dashboard's OpenAPI document with its security schemes, so that ``/docs``' "Authorize"
and clients generated from ``/openapi.json`` can authenticate.

Three schemes (:mod:`fedswarm.web.deps` enforces them):

- ``bearerToken``: ``Authorization: Bearer <API token>`` (tokens are made on the admin page);
- ``sessionCookie``: the cookie a browser gets by logging in;
- ``csrfHeader``: ``X-CSRF-Token``, which a cookie-authenticated write must send too.

FastAPI lists, for each operation, the schemes its dependencies name (``deps.BEARER`` and
``deps.COOKIE``: every route behind ``require_reader`` or ``require_admin`` takes either; an
ingest route, behind ``require_reporter``, a token only; public routes none). An OpenAPI
security list is "any one of", and a requirement object "all of", so this document puts the CSRF
header beside the cookie in every write's requirements (any method but GET, HEAD, OPTIONS).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from fedswarm.web.deps import COOKIE, CSRF_HEADER, SAFE_METHODS

__all__ = ["CSRF_SCHEME", "install"]

CSRF_SCHEME = {"type": "apiKey", "in": "header", "name": CSRF_HEADER,
               "description": "With the session cookie, every write (not GET, HEAD or OPTIONS) sends the session's "
                              "CSRF token: the `csrf-token` meta tag of any page, or `csrf_token` of GET /api/whoami."}


def with_csrf(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with the CSRF header scheme, required with the cookie on every write."""
    cookie = COOKIE.scheme_name
    schema.setdefault("components", {}).setdefault("securitySchemes", {})["csrfHeader"] = CSRF_SCHEME
    for ops in schema.get("paths", {}).values():
        for method, op in ops.items():
            if method.upper() in SAFE_METHODS or not isinstance(op, dict):
                continue
            op["security"] = [{**req, "csrfHeader": []} if cookie in req else req for req in op.get("security", [])]
    return schema


def install(app: FastAPI) -> None:
    """Make ``app.openapi()`` (what /openapi.json serves) carry the CSRF requirement of writes."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = with_csrf(get_openapi(title=app.title, version=app.version,
                                                       description=app.description, routes=app.routes))
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
