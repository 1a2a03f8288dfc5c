"""Rate and volume limits, on the ``limits`` library (the engine under slowapi and
Flask-Limiter): moving windows in process memory.

* **Ingest quotas** (:class:`IngestQuota`): each API token may make ``per_minute`` ingest
  requests a minute and send ``bytes_per_hour`` bytes of request bodies an hour. Keyed by the
  token's id *after* it was authenticated, so a stranger cannot spend someone else's quota.
* **Login throttle** (:class:`LoginThrottle`): wrong passwords are counted per client address
  (spraying many names from one place is slowed), per (address, name) pair, and per name
  across all addresses. The per-name limit is what would let a stranger lock a user out, so a
  browser that has logged in as that user before (it holds a signed "known device" cookie for
  the name, OWASP's device-cookie scheme) is exempt from it: the stranger is blocked, the user
  is not.
"""

from __future__ import annotations

import math
import time

from limits import RateLimitItemPerHour, RateLimitItemPerMinute, parse
from limits.storage import MemoryStorage
from limits.strategies import MovingWindowRateLimiter

__all__ = ["IngestQuota", "LoginThrottle", "QuotaExceeded"]


class QuotaExceeded(Exception):
    def __init__(self, detail: str, retry_after_s: int):
        super().__init__(detail)
        self.detail = detail
        self.retry_after_s = retry_after_s


def _retry_after(limiter: MovingWindowRateLimiter, item, *keys: str) -> int:
    reset = limiter.get_window_stats(item, *keys).reset_time
    return max(1, math.ceil(reset - time.time()))


class IngestQuota:
    def __init__(self, per_minute: int, bytes_per_hour: int):
        self.limiter = MovingWindowRateLimiter(MemoryStorage())
        self.requests = RateLimitItemPerMinute(per_minute)
        self.volume = RateLimitItemPerHour(bytes_per_hour)

    def charge(self, token_id: int, body_bytes: int) -> None:
        """Count one request of ``body_bytes`` against the token; raise when over a limit."""
        key = str(token_id)
        if not self.limiter.hit(self.requests, "ingest-requests", key):
            raise QuotaExceeded(f"this token made more than {self.requests.amount} ingest requests in a minute",
                                _retry_after(self.limiter, self.requests, "ingest-requests", key))
        if body_bytes > 0 and not self.limiter.hit(self.volume, "ingest-bytes", key, cost=body_bytes):
            raise QuotaExceeded(f"this token sent more than {self.volume.amount} bytes to ingest in an hour",
                                _retry_after(self.limiter, self.volume, "ingest-bytes", key))


class LoginThrottle:
    """``per_address`` failures per address, ``per_pair`` per (address, name) and ``per_name``
    per name (strangers only), each in a window of ``window``, e.g. ``"5 minutes"``."""

    def __init__(self, per_address: int = 30, per_pair: int = 5, per_name: int = 20, window: str = "5 minutes"):
        self.limiter = MovingWindowRateLimiter(MemoryStorage())
        self.address = parse(f"{per_address} per {window}")
        self.pair = parse(f"{per_pair} per {window}")
        self.name = parse(f"{per_name} per {window}")

    def blocked(self, address: str, username: str, known_device: bool) -> str | None:
        """Why a login attempt is refused before its password is checked, or None."""
        checks = [(self.address, ("addr", address)), (self.pair, ("pair", address, username))]
        if not known_device:
            checks.append((self.name, ("name", username)))
        for item, keys in checks:
            if not self.limiter.test(item, "login", *keys):
                wait = _retry_after(self.limiter, item, "login", *keys)
                return f"too many failed logins; try again in {wait} s"
        return None

    def failed(self, address: str, username: str) -> None:
        self.limiter.hit(self.address, "login", "addr", address)
        self.limiter.hit(self.pair, "login", "pair", address, username)
        self.limiter.hit(self.name, "login", "name", username)

    def succeeded(self, address: str, username: str) -> None:
        self.limiter.clear(self.pair, "login", "pair", address, username)
