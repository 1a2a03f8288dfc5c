"""Password hashing, API tokens, signed cookie values and CSRF tokens.

Standard library only: scrypt for passwords, HMAC-SHA256 for signatures, sha256 for
stored token secrets, and :func:`hmac.compare_digest` for every comparison of secrets.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets

__all__ = [
    "hash_password",
    "verify_password",
    "new_api_token",
    "split_api_token",
    "hash_token_secret",
    "sign",
    "unsign",
    "csrf_token",
    "check_csrf",
    "random_id",
]

# scrypt cost: ~50 ms per hash on a laptop core (RFC 7914 interactive-login parameters).
_SCRYPT_N, _SCRYPT_R, _SCRYPT_P = 2**14, 8, 1
TOKEN_PREFIX = "fst"


def _b64(b: bytes) -> str:
    return base64.urlsafe_b64encode(b).decode().rstrip("=")


def _unb64(s: str) -> bytes:
    return base64.urlsafe_b64decode(s + "=" * (-len(s) % 4))


def hash_password(password: str) -> str:
    salt = secrets.token_bytes(16)
    dk = hashlib.scrypt(password.encode(), salt=salt, n=_SCRYPT_N, r=_SCRYPT_R, p=_SCRYPT_P, dklen=32)
    return f"scrypt${_SCRYPT_N}${_SCRYPT_R}${_SCRYPT_P}${_b64(salt)}${_b64(dk)}"


def verify_password(password: str, stored: str) -> bool:
    try:
        algo, n, r, p, salt, dk = stored.split("$")
        if algo != "scrypt":
            return False
        got = hashlib.scrypt(password.encode(), salt=_unb64(salt), n=int(n), r=int(r), p=int(p),
                             dklen=len(_unb64(dk)))
    except (ValueError, TypeError):
        return False
    return hmac.compare_digest(got, _unb64(dk))


def random_id(nbytes: int = 32) -> str:
    return secrets.token_hex(nbytes)


def hash_token_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def new_api_token(token_id: int) -> tuple[str, str]:
    """A fresh token ``fst_<id>_<secret>`` and the hash of its secret to store."""
    secret = _b64(secrets.token_bytes(32))
    return f"{TOKEN_PREFIX}_{token_id}_{secret}", hash_token_secret(secret)


def split_api_token(token: str) -> tuple[int, str] | None:
    """``fst_<id>_<secret>`` -> (id, secret); None if the shape is wrong."""
    parts = token.strip().split("_", 2)
    if len(parts) != 3 or parts[0] != TOKEN_PREFIX or not parts[1].isdigit() or not parts[2]:
        return None
    if len(parts[1]) > 12:
        return None
    return int(parts[1]), parts[2]


def _mac(key: bytes, msg: str) -> str:
    return _b64(hmac.new(key, msg.encode(), hashlib.sha256).digest())


def sign(key: bytes, value: str) -> str:
    return f"{value}.{_mac(key, 'cookie:' + value)}"


def unsign(key: bytes, signed: str | None) -> str | None:
    if not signed or "." not in signed:
        return None
    value, mac = signed.rsplit(".", 1)
    return value if hmac.compare_digest(mac, _mac(key, "cookie:" + value)) else None


def csrf_token(key: bytes, session_id: str) -> str:
    """The CSRF token of a login session: bound to it, so it cannot be reused elsewhere."""
    return _mac(key, "csrf:" + session_id)


def check_csrf(key: bytes, session_id: str, token: str | None) -> bool:
    return bool(token) and hmac.compare_digest(str(token), csrf_token(key, session_id))
