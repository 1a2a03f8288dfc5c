"""/api/nodes (store nodes and Flower SuperNodes) and /api/policies (per device class)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, HTTPException, Query

from fedswarm.web import queries, schemas
from fedswarm.web.accounts import Principal
from fedswarm.web.deps import WebContext, get_ctx, require_admin, require_reader
from fedswarm.web.federation import FederationError
from fedswarm.web.runs_service import RunError

router = APIRouter(prefix="/api")
ERRORS = {401: {"model": schemas.Message}, 403: {"model": schemas.Message},
          404: {"model": schemas.Message}, 409: {"model": schemas.Message}, 422: {"model": schemas.Message}}


def supernodes(ctx: WebContext) -> schemas.SuperNodesOut:
    fed = ctx.federation
    if not fed.configured:
        return schemas.SuperNodesOut(configured=False, error="no SuperLink configured")
    try:
        return schemas.SuperNodesOut(configured=True, superlink=fed.superlink, nodes=fed.supernodes())
    except FederationError as exc:
        return schemas.SuperNodesOut(configured=True, superlink=fed.superlink, error=str(exc))


@router.get("/nodes", response_model=schemas.NodesOut, responses=ERRORS, tags=["nodes"])
def list_nodes(supernodes_too: bool = Query(True, alias="supernodes",
                                            description="also ask the SuperLink for its SuperNodes"),
               limit: int = Query(200, ge=1, le=2000), offset: int = Query(0, ge=0, le=10**7),
               _: Principal = Depends(require_reader), ctx: WebContext = Depends(get_ctx)) -> schemas.NodesOut:
    """Swarm peers and simulated nodes from the store, most recently seen first (one page);
    Flower SuperNodes from the SuperLink."""
    sn = supernodes(ctx) if supernodes_too else schemas.SuperNodesOut(configured=ctx.federation.configured)
    return schemas.NodesOut(nodes=queries.node_list(ctx.store, limit, offset), supernodes=sn)


@router.get("/policies", response_model=list[schemas.PolicyOut], responses=ERRORS, tags=["policies"])
def list_policies(run_id: str | None = Query(None, pattern=schemas.RUN_ID_PATTERN),
                  _: Principal = Depends(require_reader),
                  ctx: WebContext = Depends(get_ctx)) -> list[schemas.PolicyOut]:
    """The policy of each device class per run (every change folded in order)."""
    return queries.policies(ctx.store, run_id)


@router.post("/policies", response_model=schemas.ActionOut, responses=ERRORS, tags=["policies"])
def set_policy(body: schemas.PolicyIn, p: Principal = Depends(require_admin),
               ctx: WebContext = Depends(get_ctx)) -> schemas.ActionOut:
    """Change a device class's policy; the run applies it from its next round. It is checked
    against the run's strategy and the catalog first: a key the strategy does not use, an
    unknown codec or a codec parameter out of range is refused (422 naming the key)."""
    policy = body.policy.model_dump(exclude_none=True)
    if not policy:
        raise HTTPException(422, "the policy sets nothing: give at least one of "
                                 + ", ".join(schemas.DevicePolicy.model_fields))
    try:
        cid, detail = ctx.runs.set_policy(body.run_id, body.device_class, policy, p.name)
    except RunError as exc:
        raise HTTPException(exc.status_code, exc.detail) from None
    ctx.cache.clear()
    return schemas.ActionOut(run_id=body.run_id, action="policy", control_id=cid, detail=detail)
