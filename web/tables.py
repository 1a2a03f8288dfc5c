"""Tables the dashboard adds to the run store: users, login sessions, API tokens and the
key that signs session cookies.

They share :class:`fedswarm.store.Base`, so ``Base.metadata.create_all`` (which
:func:`fedswarm.web.app.create_app` calls after importing this module) creates them in
the same SQLite file or PostgreSQL database as the runs.
"""

from __future__ import annotations

import datetime as dt

from sqlalchemy import Boolean, DateTime, ForeignKey, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from fedswarm.store import Base

__all__ = ["User", "WebSession", "ApiToken", "WebSecret", "ROLES", "TOKEN_ROLES"]

ROLES = ("admin", "viewer")
# A reporter token may only write through /api/ingest (swarm peers, remote ServerApps).
TOKEN_ROLES = ("reporter", "viewer", "admin")


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)


class User(Base):
    __tablename__ = "web_users"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    username: Mapped[str] = mapped_column(String(64), unique=True, index=True)
    password_hash: Mapped[str] = mapped_column(String(256))
    role: Mapped[str] = mapped_column(String(16), default="viewer")
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=_now)
    disabled: Mapped[bool] = mapped_column(Boolean, default=False)


class WebSession(Base):
    """A login. The cookie carries the signed id; logging out deletes the row."""

    __tablename__ = "web_sessions"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("web_users.id", ondelete="CASCADE"), index=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=_now)
    expires_at: Mapped[dt.datetime] = mapped_column(DateTime)


class ApiToken(Base):
    """A bearer token; only the sha256 of its secret part is stored."""

    __tablename__ = "web_api_tokens"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(100))
    token_hash: Mapped[str] = mapped_column(String(64))
    role: Mapped[str] = mapped_column(String(16), default="reporter")
    run_id: Mapped[str | None] = mapped_column(String(36))  # reporter tokens may be bound to one run
    created_by: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=_now)
    last_used_at: Mapped[dt.datetime | None] = mapped_column(DateTime)
    expires_at: Mapped[dt.datetime | None] = mapped_column(DateTime)  # NULL only on tokens made before expiry existed
    revoked: Mapped[bool] = mapped_column(Boolean, default=False)


class WebSecret(Base):
    """Server-side secrets kept across restarts (the cookie signing key)."""

    __tablename__ = "web_secrets"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(String(256))
