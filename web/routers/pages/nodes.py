"""HTML pages of the fleet: the Nodes page (filtered, sorted, paged on the server) and one
node's page (its runs, and its telemetry over time drawn by ``static/node.js``)."""

from __future__ import annotations

from urllib.parse import quote, urlencode

from fastapi import APIRouter, Depends, Path, Query, Request
from fastapi.responses import HTMLResponse

from fedswarm.web import models
from fedswarm.web.routers.api import nodes as api_nodes
from fedswarm.web.services import fleet
from fedswarm.web.services.accounts import Principal
from fedswarm.web.deps import WebContext, get_ctx, page_user
from fedswarm.web.routers.pages.common import render

router = APIRouter(include_in_schema=False)
PAGE_SIZE = 100


def _one_of(value: str | None, allowed: tuple[str, ...], default: str | None = None) -> str | None:
    return value if value in allowed else default


@router.get("/nodes", response_class=HTMLResponse)
def nodes_page(request: Request, state: str | None = Query(None, max_length=16),
               device_class: str | None = Query(None, pattern=models.ID_PATTERN),
               run_id: str | None = Query(None, pattern=models.RUN_ID_PATTERN),
               kind: str | None = Query(None, max_length=16), q: str | None = Query(None, max_length=100),
               sort: str = Query("state", max_length=16), order: str = Query("asc", pattern="^(asc|desc)$"),
               page: int = Query(1, ge=1, le=100_000), p: Principal = Depends(page_user),
               ctx: WebContext = Depends(get_ctx)):
    query = fleet.FleetQuery(state=_one_of(state, models.FLEET_STATES), device_class=device_class or None,
                             run_id=run_id or None, kind=_one_of(kind, fleet.FLEET_KINDS), q=q or None,
                             sort=_one_of(sort, fleet.FLEET_SORTS, "state") or "state", order=order,
                             limit=PAGE_SIZE, offset=(page - 1) * PAGE_SIZE)
    out = fleet.fleet(ctx.store, api_nodes.supernodes(ctx), query, ctx.settings.report_timeout_s)
    filters = {"state": query.state or "", "device_class": query.device_class or "", "run_id": query.run_id or "",
               "kind": query.kind or "", "q": query.q or "", "sort": query.sort, "order": order}

    def link(**change) -> str:
        args = {k: v for k, v in {**filters, "page": page, **change}.items() if v not in ("", None)}
        return "/nodes?" + urlencode(args)

    pages = max(1, -(-out.total // PAGE_SIZE))
    return render(request, ctx, p, "nodes.html", fleet=out, filters=filters, page=page, pages=pages, link=link,
                  states=models.FLEET_STATES, kinds=fleet.FLEET_KINDS, sorts=fleet.FLEET_SORTS,
                  quote=quote)


@router.get("/nodes/{node_id}", response_class=HTMLResponse)
def node_page(request: Request, node_id: str = Path(pattern=models.ID_PATTERN), p: Principal = Depends(page_user),
              ctx: WebContext = Depends(get_ctx)):
    detail = fleet.node_detail(ctx.store, node_id, api_nodes.supernodes(ctx), ctx.settings.report_timeout_s)
    if detail is None:
        return render(request, ctx, p, "error.html", status=404,
                      detail=f"no node '{node_id}' in the store or on the SuperLink")
    return render(request, ctx, p, "node.html", node_id=node_id, detail=detail)
