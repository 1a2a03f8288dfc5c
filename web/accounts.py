"""Users, login sessions and API tokens in the store (the business side of auth)."""

from __future__ import annotations

import datetime as dt
import hmac
import re
import secrets
import time
from dataclasses import dataclass

from sqlalchemy import delete, select

from fedswarm.store import Store
from fedswarm.web import security
from fedswarm.web.auth_models import ROLES, TOKEN_ROLES, ApiToken, User, WebSecret, WebSession

__all__ = ["Principal", "Accounts", "AccountError", "LoginThrottle"]

_USERNAME_RE = re.compile(r"^[A-Za-z0-9_.@-]{1,64}$")


class AccountError(ValueError):
    """A bad username, password, role or token request; the message names the problem."""


@dataclass(frozen=True)
class Principal:
    """Who is asking: a logged-in user (``session_id`` set) or an API token."""

    name: str
    role: str  # admin | viewer | reporter
    session_id: str | None = None
    token_id: int | None = None
    run_id: str | None = None  # a token bound to one run

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"

    @property
    def can_read(self) -> bool:
        return self.role in ("admin", "viewer")


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)


class Accounts:
    def __init__(self, store: Store, session_hours: float = 12.0):
        self.store = store
        self.session_hours = session_hours

    # -- secrets -----------------------------------------------------------------------
    def signing_key(self, configured: str | None = None) -> bytes:
        """The cookie signing key: configured, or made once and kept in the store."""
        if configured:
            return configured.encode()
        with self.store.session() as s:
            row = s.get(WebSecret, "cookie_key")
            if row is None:
                row = WebSecret(name="cookie_key", value=secrets.token_hex(32))
                s.add(row)
            return row.value.encode()

    # -- users -------------------------------------------------------------------------
    def ensure_admin(self, password: str | None) -> str | None:
        """Create user ``admin`` if there are no users yet. Returns the generated
        password when one had to be made (to print once), else None."""
        with self.store.session() as s:
            if s.scalars(select(User.id).limit(1)).first() is not None:
                return None
        generated = None
        if not password:
            password = generated = secrets.token_urlsafe(12)
        self.create_user("admin", password, "admin")
        self.store.add_event(None, "user.created", "admin user created at first start", actor="system")
        return generated

    def create_user(self, username: str, password: str, role: str) -> User:
        if not _USERNAME_RE.match(username or ""):
            raise AccountError("username must be 1-64 characters of letters, digits, '_', '.', '@', '-'")
        if role not in ROLES:
            raise AccountError(f"unknown role {role!r} (allowed: {', '.join(ROLES)})")
        if len(password or "") < 8:
            raise AccountError("password must have at least 8 characters")
        with self.store.session() as s:
            if s.scalars(select(User).where(User.username == username)).first() is not None:
                raise AccountError(f"user {username!r} already exists")
            user = User(username=username, password_hash=security.hash_password(password), role=role)
            s.add(user)
            s.flush()
            return user

    def list_users(self) -> list[User]:
        with self.store.session() as s:
            return list(s.scalars(select(User).order_by(User.id)))

    def authenticate(self, username: str, password: str) -> User | None:
        with self.store.session() as s:
            user = s.scalars(select(User).where(User.username == username)).first()
        if user is None or user.disabled:
            security.hash_password(password)  # same work either way: no user enumeration by timing
            return None
        return user if security.verify_password(password, user.password_hash) else None

    # -- sessions ----------------------------------------------------------------------
    def open_session(self, user: User) -> str:
        sid = security.random_id()
        with self.store.session() as s:
            s.execute(delete(WebSession).where(WebSession.expires_at < _now()))
            s.add(WebSession(id=sid, user_id=user.id,
                             expires_at=_now() + dt.timedelta(hours=self.session_hours)))
        return sid

    def close_session(self, sid: str) -> None:
        with self.store.session() as s:
            s.execute(delete(WebSession).where(WebSession.id == sid))

    def principal_for_session(self, sid: str) -> Principal | None:
        with self.store.session() as s:
            row = s.get(WebSession, sid)
            if row is None or row.expires_at < _now():
                return None
            user = s.get(User, row.user_id)
            if user is None or user.disabled:
                return None
            return Principal(name=user.username, role=user.role, session_id=sid)

    # -- API tokens --------------------------------------------------------------------
    def create_token(self, name: str, role: str, run_id: str | None, created_by: str) -> tuple[ApiToken, str]:
        if role not in TOKEN_ROLES:
            raise AccountError(f"unknown token role {role!r} (allowed: {', '.join(TOKEN_ROLES)})")
        if not name or len(name) > 100:
            raise AccountError("token name must be 1-100 characters")
        with self.store.session() as s:
            row = ApiToken(name=name, token_hash="", role=role, run_id=run_id, created_by=created_by)
            s.add(row)
            s.flush()
            token, digest = security.new_api_token(row.id)
            row.token_hash = digest
        return row, token

    def list_tokens(self) -> list[ApiToken]:
        with self.store.session() as s:
            return list(s.scalars(select(ApiToken).order_by(ApiToken.id)))

    def revoke_token(self, token_id: int) -> bool:
        with self.store.session() as s:
            row = s.get(ApiToken, token_id)
            if row is None:
                return False
            row.revoked = True
            return True

    def principal_for_token(self, token: str) -> Principal | None:
        parts = security.split_api_token(token)
        if parts is None:
            return None
        token_id, secret = parts
        with self.store.session() as s:
            row = s.get(ApiToken, token_id)
            if row is None or row.revoked:
                return None
            if not hmac.compare_digest(row.token_hash, security.hash_token_secret(secret)):
                return None
            now = _now()
            if row.last_used_at is None or now - row.last_used_at > dt.timedelta(seconds=60):
                row.last_used_at = now  # at most one write a minute per token
            return Principal(name=f"token:{row.name}", role=row.role, token_id=row.id, run_id=row.run_id)


class LoginThrottle:
    """At most ``max_failures`` wrong passwords per username in ``window_s``."""

    def __init__(self, max_failures: int = 10, window_s: float = 300.0):
        self.max_failures = max_failures
        self.window_s = window_s
        self._fails: dict[str, list[float]] = {}

    def blocked(self, username: str) -> bool:
        now = time.monotonic()
        recent = [t for t in self._fails.get(username, []) if now - t < self.window_s]
        self._fails[username] = recent
        return len(recent) >= self.max_failures

    def failed(self, username: str) -> None:
        if len(self._fails) > 10_000:
            self._fails.clear()
        self._fails.setdefault(username, []).append(time.monotonic())

    def succeeded(self, username: str) -> None:
        self._fails.pop(username, None)
