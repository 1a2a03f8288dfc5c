"""/api/nodes (the fleet: store nodes and Flower SuperNodes), /api/nodes/{id} (one node's history)
and /api/policies (per device class)."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Depends, HTTPException, Path, Query

from fedswarm.web import models
from fedswarm.web.services import fleet, queries
from fedswarm.web.services.accounts import Principal
from fedswarm.web.deps import WebContext, get_ctx, require_admin, require_reader
from fedswarm.web.services.federation import FederationError
from fedswarm.web.services.runs import RunError

router = APIRouter(prefix="/api")
SUPERNODES_MAX_AGE_S = 5.0  # the SuperLink's list is asked again after this long
ERRORS = {401: {"model": models.Message}, 403: {"model": models.Message},
          404: {"model": models.Message}, 409: {"model": models.Message}, 422: {"model": models.Message}}


def supernodes(ctx: WebContext) -> models.SuperNodesOut:
    fed = ctx.federation
    if not fed.configured:
        return models.SuperNodesOut(configured=False, error="no SuperLink configured")
    try:
        return models.SuperNodesOut(configured=True, superlink=fed.superlink,
                                     nodes=fed.supernodes(max_age_s=SUPERNODES_MAX_AGE_S))
    except FederationError as exc:
        return models.SuperNodesOut(configured=True, superlink=fed.superlink, error=str(exc))


@router.get("/nodes", response_model=models.NodesOut, responses=ERRORS, tags=["nodes"])
def list_nodes(supernodes_too: bool = Query(True, alias="supernodes",
                                            description="also ask the SuperLink for its SuperNodes"),
               state: Literal[models.FLEET_STATES] | None = Query(None),  # type: ignore[valid-type]
               device_class: str | None = Query(None, pattern=models.ID_PATTERN),
               run_id: str | None = Query(None, pattern=models.RUN_ID_PATTERN, description="last seen in this run"),
               kind: Literal[fleet.FLEET_KINDS] | None = Query(None),  # type: ignore[valid-type]
               q: str | None = Query(None, max_length=100, description="part of the node id or owner name"),
               sort: Literal[fleet.FLEET_SORTS] = Query("state"),  # type: ignore[valid-type]
               order: Literal["asc", "desc"] = Query("asc"),
               limit: int = Query(100, ge=1, le=2000), offset: int = Query(0, ge=0, le=10**7),
               _: Principal = Depends(require_reader), ctx: WebContext = Depends(get_ctx)) -> models.NodesOut:
    """The fleet, one page: Flower SuperNodes (the SuperLink's and those deployment runs recorded),
    swarm peers and remote ServerApps, each with its state (training, online, failed, offline),
    device class, last telemetry and last-seen time. Node ids sort as numbers where they are
    numbers. Simulated nodes are not listed (``simulated_nodes`` counts them): see their run."""
    sn = supernodes(ctx) if supernodes_too else models.SuperNodesOut(configured=ctx.federation.configured)
    query = fleet.FleetQuery(state=state, device_class=device_class, run_id=run_id, kind=kind, q=q, sort=sort,
                             order=order, limit=limit, offset=offset)
    return fleet.fleet(ctx.store, sn, query, ctx.settings.report_timeout_s)


@router.get("/nodes/{node_id}", response_model=models.NodeDetailOut, responses=ERRORS, tags=["nodes"])
def get_node(node_id: str = Path(pattern=models.ID_PATTERN),
             supernodes_too: bool = Query(True, alias="supernodes",
                                          description="also ask the SuperLink about this node"),
             _: Principal = Depends(require_reader), ctx: WebContext = Depends(get_ctx)) -> models.NodeDetailOut:
    """One node: its state, its runs (rounds trained, failures, rejected updates, bytes) and
    its rounds with their telemetry (the last 2000, oldest first)."""
    sn = supernodes(ctx) if supernodes_too else models.SuperNodesOut(configured=ctx.federation.configured)
    out = fleet.node_detail(ctx.store, node_id, sn, ctx.settings.report_timeout_s)
    if out is None:
        raise HTTPException(404, f"no node '{node_id}' in the store or on the SuperLink")
    return out


@router.get("/policies", response_model=list[models.PolicyOut], responses=ERRORS, tags=["policies"])
def list_policies(run_id: str | None = Query(None, pattern=models.RUN_ID_PATTERN),
                  _: Principal = Depends(require_reader),
                  ctx: WebContext = Depends(get_ctx)) -> list[models.PolicyOut]:
    """The policy of each device class per run (every change folded in order)."""
    return queries.policies(ctx.store, run_id)


@router.post("/policies", response_model=models.ActionOut, responses=ERRORS, tags=["policies"])
def set_policy(body: models.PolicyIn, p: Principal = Depends(require_admin),
               ctx: WebContext = Depends(get_ctx)) -> models.ActionOut:
    """Change a device class's policy; the run applies it from its next round. It is checked
    against the run's strategy and the catalog first: a key the strategy does not use, an
    unknown codec or a codec parameter out of range is refused (422 naming the key)."""
    policy = body.policy.model_dump(exclude_none=True)
    if not policy:
        raise HTTPException(422, "the policy sets nothing: give at least one of "
                                 + ", ".join(models.DevicePolicy.model_fields))
    try:
        cid, detail = ctx.runs.set_policy(body.run_id, body.device_class, policy, p.name)
    except RunError as exc:
        raise HTTPException(exc.status_code, exc.detail) from None
    ctx.cache.clear()
    return models.ActionOut(run_id=body.run_id, action="policy", control_id=cid, detail=detail)
