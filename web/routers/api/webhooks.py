"""/api/webhooks (admin only): register a URL with the events to send, change or delete it, give
it a new secret, and read its deliveries (:mod:`fedswarm.web.services.webhooks`). A secret is shown
once, when it is made; the store keeps it sealed (:mod:`fedswarm.web.secret_box`). The admin page's
webhook forms (:mod:`fedswarm.web.routers.pages.misc`) call :func:`create`, :func:`delete` and
:func:`page_data`."""

from __future__ import annotations

import datetime as dt
import secrets
from typing import Any, Literal

from fastapi import APIRouter, Depends, HTTPException, Path, Query
from pydantic import BaseModel, ConfigDict, Field, field_validator
from sqlalchemy import select

from fedswarm.store import Store
from fedswarm.store.schema import Webhook, WebhookDelivery
from fedswarm.web import models
from fedswarm.web.services.accounts import Principal
from fedswarm.web.deps import WebContext, get_ctx, require_admin
from fedswarm.web.services.webhooks import EVENTS, check_url

__all__ = ["router", "page_data", "create", "delete", "WebhookIn", "WebhookId"]

router = APIRouter(prefix="/api/webhooks", tags=["webhooks"])
ERRORS = {401: {"model": models.Message}, 403: {"model": models.Message}, 404: {"model": models.Message}}
EventName = Literal[EVENTS]  # type: ignore[valid-type]
WebhookId = Path(ge=1, le=2**62)
EVENTS_DOC = ("run.finished (also a finished run shown as degraded), run.failed (also a finished run where every "
              "node failed), run.lost, run.stopped, run.privacy_budget (the run stopped at its DP budget), "
              "node.offline (a SuperNode or peer not heard from for a minute, or reported offline)")


class _WebhookFields(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @field_validator("url", check_fields=False)
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        return None if v is None else check_url(v)

    @field_validator("events", check_fields=False)
    @classmethod
    def _events(cls, v: list[str] | None) -> list[str] | None:
        return None if v is None else sorted(set(v), key=EVENTS.index)


class WebhookIn(_WebhookFields):
    url: str = Field(max_length=2000, description="an http:// or https:// URL that accepts a JSON POST")
    events: list[EventName] = Field(min_length=1, max_length=len(EVENTS), description=EVENTS_DOC)
    secret: str | None = Field(None, min_length=16, max_length=128,
                               description="the HMAC-SHA256 key (default: a generated one, shown once)")
    enabled: bool = True


class SecretIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    secret: str | None = Field(None, min_length=16, max_length=128,
                               description="the new HMAC-SHA256 key (default: a generated one, shown once)")


class WebhookPatch(_WebhookFields):
    url: str | None = Field(None, max_length=2000)
    events: list[EventName] | None = Field(None, min_length=1, max_length=len(EVENTS))
    enabled: bool | None = None


class WebhookOut(models.Out):
    id: int
    url: str
    events: list[str]
    enabled: bool
    created_at: dt.datetime | None = None
    created_by: str | None = None


class WebhookCreated(WebhookOut):
    secret: str = Field(description="shown once: check each delivery's X-Fedswarm-Signature "
                                    "(sha256=<hex HMAC-SHA256 of the body under this key>)")


class DeliveryOut(models.Out):
    id: int
    webhook_id: int
    event: str
    run_id: str | None = None
    node_id: str | None = None
    status: str = Field(description="pending, delivered, or failed (attempts ran out)")
    attempts: int
    last_code: int | None = Field(None, description="the receiver's last HTTP status")
    last_error: str | None = None
    created_at: dt.datetime | None = None
    next_attempt_at: dt.datetime | None = None
    delivered_at: dt.datetime | None = None


def _get(store: Store, webhook_id: int) -> Webhook:
    with store.session() as s:
        hook = s.get(Webhook, webhook_id)
    if hook is None:
        raise HTTPException(404, f"no webhook {webhook_id}")
    return hook


def create(ctx: WebContext, body: WebhookIn, actor: str) -> WebhookCreated:
    secret = body.secret or secrets.token_urlsafe(32)
    with ctx.store.session() as s:
        hook = Webhook(url=body.url, events=list(body.events), enabled=body.enabled, created_by=actor)
        s.add(hook)
        s.flush()  # the id, which the sealed secret is bound to
        hook.secret_sealed = ctx.secrets.seal(secret, hook.id)
        out = WebhookCreated(**WebhookOut.model_validate(hook).model_dump(), secret=secret)
    ctx.store.add_event(None, "webhook.created", f"webhook {out.id} for {', '.join(out.events)} created",
                        actor=actor)
    return out


def delete(ctx: WebContext, webhook_id: int, actor: str) -> None:
    with ctx.store.session() as s:
        hook = s.get(Webhook, webhook_id)
        if hook is None:
            raise HTTPException(404, f"no webhook {webhook_id}")
        s.delete(hook)
    ctx.store.add_event(None, "webhook.deleted", f"webhook {webhook_id} deleted", actor=actor)


def deliveries(store: Store, webhook_id: int | None = None, limit: int = 100) -> list[DeliveryOut]:
    q = select(WebhookDelivery).order_by(WebhookDelivery.id.desc()).limit(limit)
    if webhook_id is not None:
        q = q.where(WebhookDelivery.webhook_id == webhook_id)
    with store.session() as s:
        return [DeliveryOut.model_validate(d) for d in s.scalars(q)]


def page_data(store: Store) -> dict[str, Any]:
    """What the admin page shows of webhooks: each one, and the latest deliveries."""
    with store.session() as s:
        hooks = [WebhookOut.model_validate(h) for h in s.scalars(select(Webhook).order_by(Webhook.id))]
    return {"webhooks": hooks, "deliveries": deliveries(store, limit=50), "webhook_events": EVENTS,
            "new_webhook": None}


@router.get("", response_model=list[WebhookOut], responses=ERRORS)
def list_webhooks(_: Principal = Depends(require_admin), ctx: WebContext = Depends(get_ctx)):
    """Registered webhooks (never their secrets)."""
    with ctx.store.session() as s:
        return [WebhookOut.model_validate(h) for h in s.scalars(select(Webhook).order_by(Webhook.id))]


@router.post("", response_model=WebhookCreated, status_code=201, responses=ERRORS)
def new_webhook(body: WebhookIn, p: Principal = Depends(require_admin), ctx: WebContext = Depends(get_ctx)):
    """Register a URL for the events listed. Each delivery is a JSON POST signed with
    HMAC-SHA256 of its body under the secret (``X-Fedswarm-Signature: sha256=<hex>``), retried
    with backoff until answered 2xx; it carries ``X-Fedswarm-Event`` and ``X-Fedswarm-Delivery``
    (the same id on a retry). Only events that happen after registration are sent.

    The body: ``event``, ``occurred_at`` (UTC), ``message``, ``delivery_id``, and ``run`` (id,
    name, status, display_status, strategy, task, total_rounds, error, lost_reason, started_at,
    finished_at) or ``node`` (id, kind, device_class, run_id, status, last_seen)."""
    return create(ctx, body, p.name)


@router.get("/{webhook_id}", response_model=WebhookOut, responses=ERRORS)
def get_webhook(webhook_id: int = WebhookId, _: Principal = Depends(require_admin),
                ctx: WebContext = Depends(get_ctx)):
    return WebhookOut.model_validate(_get(ctx.store, webhook_id))


@router.patch("/{webhook_id}", response_model=WebhookOut, responses=ERRORS)
def change_webhook(body: WebhookPatch, webhook_id: int = WebhookId, p: Principal = Depends(require_admin),
                   ctx: WebContext = Depends(get_ctx)):
    """Change the URL, the events or whether it is enabled (a disabled webhook is sent nothing)."""
    with ctx.store.session() as s:
        hook = s.get(Webhook, webhook_id)
        if hook is None:
            raise HTTPException(404, f"no webhook {webhook_id}")
        for key, value in body.model_dump(exclude_none=True).items():
            setattr(hook, key, value)
        s.flush()
        out = WebhookOut.model_validate(hook)
    ctx.store.add_event(None, "webhook.changed", f"webhook {webhook_id} changed", actor=p.name)
    return out


@router.post("/{webhook_id}/secret", response_model=WebhookCreated, responses=ERRORS)
def rotate_secret(body: SecretIn | None = None, webhook_id: int = WebhookId, p: Principal = Depends(require_admin),
                  ctx: WebContext = Depends(get_ctx)):
    """Give the webhook a new secret (the one in the body, else a generated one), shown in this
    answer only. Deliveries from now on are signed with it, retries of earlier ones too."""
    secret = (body.secret if body else None) or secrets.token_urlsafe(32)
    with ctx.store.session() as s:
        hook = s.get(Webhook, webhook_id)
        if hook is None:
            raise HTTPException(404, f"no webhook {webhook_id}")
        hook.secret_sealed, hook.secret = ctx.secrets.seal(secret, webhook_id), ""
        s.flush()
        out = WebhookCreated(**WebhookOut.model_validate(hook).model_dump(), secret=secret)
    ctx.store.add_event(None, "webhook.secret_rotated", f"webhook {webhook_id} has a new secret", actor=p.name)
    return out


@router.delete("/{webhook_id}", response_model=models.Message, responses=ERRORS)
def delete_webhook(webhook_id: int = WebhookId, p: Principal = Depends(require_admin),
                   ctx: WebContext = Depends(get_ctx)):
    """Delete the webhook and its delivery log."""
    delete(ctx, webhook_id, p.name)
    return models.Message(detail=f"webhook {webhook_id} deleted")


@router.get("/{webhook_id}/deliveries", response_model=list[DeliveryOut], responses=ERRORS)
def list_deliveries(webhook_id: int = WebhookId, limit: int = Query(100, ge=1, le=1000),
                    _: Principal = Depends(require_admin), ctx: WebContext = Depends(get_ctx)):
    """The webhook's deliveries, newest first: status, attempts, the receiver's last answer."""
    _get(ctx.store, webhook_id)
    return deliveries(ctx.store, webhook_id, limit)
