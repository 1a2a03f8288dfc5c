"""/api/tokens and /api/users: admins issue API tokens (stored hashed) and add users."""

from __future__ import annotations

from fastapi import APIRouter, Depends, HTTPException, Path

from fedswarm.web import models
from fedswarm.web.services.accounts import AccountError, Principal
from fedswarm.web.deps import WebContext, get_ctx, require_admin

router = APIRouter(prefix="/api")
ERRORS = {401: {"model": models.Message}, 403: {"model": models.Message},
          404: {"model": models.Message}, 409: {"model": models.Message}}


def create_token(ctx: WebContext, body: models.TokenIn, actor: str) -> models.TokenCreated:
    if body.run_id is not None and ctx.store.get_run(body.run_id) is None:
        raise HTTPException(404, f"no run '{body.run_id}' in the store")
    try:
        row, token = ctx.accounts.create_token(body.name, body.role, body.run_id, actor, body.expires_in_days)
    except AccountError as exc:
        raise HTTPException(422, str(exc)) from None
    ctx.store.add_event(body.run_id, "token.created", f"{body.role} token '{body.name}' (id {row.id}) created",
                        actor=actor)
    return models.TokenCreated(**models.TokenOut.model_validate(row).model_dump(), token=token)


def create_user(ctx: WebContext, body: models.UserIn, actor: str) -> models.UserOut:
    try:
        user = ctx.accounts.create_user(body.username, body.password, body.role)
    except AccountError as exc:
        raise HTTPException(409 if "exists" in str(exc) else 422, str(exc)) from None
    ctx.store.add_event(None, "user.created", f"{body.role} user '{body.username}' created", actor=actor)
    return models.UserOut.model_validate(user)


@router.get("/tokens", response_model=list[models.TokenOut], responses=ERRORS, tags=["auth"])
def list_tokens(_: Principal = Depends(require_admin), ctx: WebContext = Depends(get_ctx)):
    """Issued tokens (never their secrets)."""
    return [models.TokenOut.model_validate(t) for t in ctx.accounts.list_tokens()]


@router.post("/tokens", response_model=models.TokenCreated, status_code=201, responses=ERRORS, tags=["auth"])
def new_token(body: models.TokenIn, p: Principal = Depends(require_admin), ctx: WebContext = Depends(get_ctx)):
    """Issue a token (it expires after ``expires_in_days``); its secret is in this answer only,
    which is never cached."""
    return create_token(ctx, body, p.name)


@router.delete("/tokens/{token_id}", response_model=models.Message, responses=ERRORS, tags=["auth"])
def revoke_token(token_id: int = Path(ge=1, le=2**62), p: Principal = Depends(require_admin),
                 ctx: WebContext = Depends(get_ctx)):
    if not ctx.accounts.revoke_token(token_id):
        raise HTTPException(404, f"no token {token_id}")
    ctx.store.add_event(None, "token.revoked", f"token {token_id} revoked", actor=p.name)
    return models.Message(detail=f"token {token_id} revoked")


@router.get("/users", response_model=list[models.UserOut], responses=ERRORS, tags=["auth"])
def list_users(_: Principal = Depends(require_admin), ctx: WebContext = Depends(get_ctx)):
    return [models.UserOut.model_validate(u) for u in ctx.accounts.list_users()]


@router.post("/users", response_model=models.UserOut, status_code=201, responses=ERRORS, tags=["auth"])
def new_user(body: models.UserIn, p: Principal = Depends(require_admin), ctx: WebContext = Depends(get_ctx)):
    """Add an admin or a viewer (viewers can look, not start or stop anything)."""
    return create_user(ctx, body, p.name)
