"""Users, login sessions and API tokens in the store (the business side of auth).

Who a token or session belongs to is looked up once and kept for ``CACHE_S`` seconds, so a
busy API does not pay a database round trip per request; revoking a token or logging out
drops the cached entry at once in this process (another dashboard process over the same
store sees it within ``CACHE_S``).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import re
import secrets
import threading
import time
from dataclasses import dataclass

from sqlalchemy import delete, select

from fedswarm.store import Store
from fedswarm.web import security
from fedswarm.web.tables import ROLES, TOKEN_ROLES, ApiToken, User, WebSecret, WebSession

__all__ = ["Principal", "Accounts", "AccountError", "CACHE_S"]

_USERNAME_RE = re.compile(r"^[A-Za-z0-9_.@-]{1,64}$")
CACHE_S = 5.0
_CACHE_MAX = 10_000


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

    @property
    def owner_tag(self) -> str | None:
        """What runs and nodes this principal registers are owned by."""
        return f"token:{self.token_id}" if self.token_id is not None else None


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)


class _TTLCache:
    """A small thread-safe map whose entries live ``ttl_s`` seconds."""

    def __init__(self, ttl_s: float):
        self.ttl_s = ttl_s
        self._d: dict[str, tuple[float, object]] = {}
        self._lock = threading.Lock()

    def get(self, key: str) -> tuple[bool, object]:
        hit = self._d.get(key)
        if hit is None or hit[0] < time.monotonic():
            return False, None
        return True, hit[1]

    def put(self, key: str, value: object) -> None:
        with self._lock:
            if len(self._d) >= _CACHE_MAX:
                self._d.clear()
            self._d[key] = (time.monotonic() + self.ttl_s, value)

    def drop(self, pred) -> None:
        with self._lock:
            for k in [k for k, (_, v) in self._d.items() if pred(v)]:
                del self._d[k]


class Accounts:
    def __init__(self, store: Store, session_hours: float = 12.0, token_days: float = 90.0,
                 cache_s: float = CACHE_S):
        self.store = store
        self.session_hours = session_hours
        self.token_days = token_days
        self._tokens = _TTLCache(cache_s)
        self._sessions = _TTLCache(cache_s)

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
        self._sessions.drop(lambda p: p is not None and p.session_id == sid)

    def principal_for_session(self, sid: str) -> Principal | None:
        hit, cached = self._sessions.get(sid)
        if hit:
            return cached  # type: ignore[return-value]
        with self.store.session() as s:
            row = s.get(WebSession, sid)
            user = s.get(User, row.user_id) if row is not None and row.expires_at >= _now() else None
            p = None if user is None or user.disabled else Principal(name=user.username, role=user.role,
                                                                      session_id=sid)
        self._sessions.put(sid, p)
        return p

    # -- API tokens --------------------------------------------------------------------
    def create_token(self, name: str, role: str, run_id: str | None, created_by: str,
                     expires_in_days: float | None = None) -> tuple[ApiToken, str]:
        if role not in TOKEN_ROLES:
            raise AccountError(f"unknown token role {role!r} (allowed: {', '.join(TOKEN_ROLES)})")
        if not name or len(name) > 100:
            raise AccountError("token name must be 1-100 characters")
        days = self.token_days if expires_in_days is None else expires_in_days
        if not 0 < days <= 3650:
            raise AccountError("a token lives more than 0 and at most 3650 days")
        with self.store.session() as s:
            row = ApiToken(name=name, token_hash="", role=role, run_id=run_id, created_by=created_by,
                           expires_at=_now() + dt.timedelta(days=days))
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
        self._tokens.drop(lambda p: p is not None and p.token_id == token_id)
        return True

    def peek_token(self, token: str) -> tuple[bool, Principal | None]:
        """(True, principal) when the token was looked up within the cache's lifetime."""
        return self._tokens.get(hashlib.sha256(token.encode()).hexdigest())  # type: ignore[return-value]

    def peek_session(self, sid: str) -> tuple[bool, Principal | None]:
        return self._sessions.get(sid)  # type: ignore[return-value]

    def principal_for_token(self, token: str) -> Principal | None:
        key = hashlib.sha256(token.encode()).hexdigest()  # never keep the raw secret around
        hit, cached = self._tokens.get(key)
        if hit:
            return cached  # type: ignore[return-value]
        p = self._lookup_token(token)
        self._tokens.put(key, p)
        return p

    def _lookup_token(self, token: str) -> Principal | None:
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
            if row.expires_at is not None and row.expires_at <= now:
                return None
            if row.last_used_at is None or now - row.last_used_at > dt.timedelta(seconds=60):
                row.last_used_at = now  # at most one write a minute per token
            return Principal(name=f"token:{row.name}", role=row.role, token_id=row.id, run_id=row.run_id)
