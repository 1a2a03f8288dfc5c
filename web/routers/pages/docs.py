"""``/docs``: the API's Swagger UI (5.x, which reads OpenAPI 3.1), served from the installed
``swagger-ui-py`` package's copy of the Swagger UI distribution.

No CDN and no inline script, so it works with no network and under the pages' strict CSP
(``default-src 'self'``): the page loads the bundle from ``/docs/assets`` and starts it from
``/static/docs.js``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

__all__ = ["router", "mount"]

router = APIRouter(include_in_schema=False)

_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>fedswarm dashboard API</title>
<link rel="stylesheet" href="/docs/assets/swagger-ui.css">
<link rel="icon" href="/static/favicon.svg" type="image/svg+xml">
</head><body>
<div id="swagger-ui"><p id="docs-missing">{missing}</p></div>
<script src="/docs/assets/swagger-ui-bundle.js"></script>
<script src="/static/docs.js"></script>
</body></html>"""


def _assets() -> str | None:
    """The folder of Swagger UI's files, found without importing the package (whose modules
    wire it into other web frameworks)."""
    spec = importlib.util.find_spec("swagger_ui")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "static"
    return str(path) if (path / "swagger-ui-bundle.js").is_file() else None


def mount(app: FastAPI) -> None:
    path = _assets()
    if path is not None:
        app.mount("/docs/assets", StaticFiles(directory=path), name="docs-assets")


@router.get("/docs", response_class=HTMLResponse)
def docs_page() -> HTMLResponse:
    missing = "" if _assets() else ("The API reference needs the swagger-ui-py package "
                                    "(pip install swagger-ui-py); the schema is at /openapi.json.")
    return HTMLResponse(_PAGE.format(missing=missing))
