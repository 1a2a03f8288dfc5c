"""Secrets at rest: the webhook secrets the dashboard keeps in the store, sealed with AES-256-GCM.

A webhook's secret is the HMAC key its deliveries are signed with, so the dashboard must read
it back; the store holds it only sealed (``webhooks.secret_sealed``), under a key that is not
in the store. A copy of the store (a backup, a copied SQLite file, a shared PostgreSQL read by
someone else) yields no secret without that key.

The key, in this order:

1. ``FEDSWARM_SECRET_KEY`` (the same value also signs the dashboard's cookies; any string of 16
   characters or more): give it to every dashboard that serves one store;
2. else the key file ``$FEDSWARM_SECRET_KEY_FILE``, by default
   ``$XDG_CONFIG_HOME/fedswarm/secret.key`` (``~/.config/fedswarm/secret.key``), made with
   mode 0600 at the dashboard's first start; one that others can read is refused.

The AES key is HKDF-SHA256 of that value. A sealed secret reads ``fsk1:<key id>:<base64url of
nonce + ciphertext>``, where the key id (8 hex digits of a hash of the key) lets a dashboard with
another key say so instead of failing obscurely. The webhook's id is the associated data, so a
sealed secret copied onto another row does not open.

Rotating: ``POST /api/webhooks/{id}/secret`` gives a webhook a new secret (shown once);
``fedswarm dashboard-rekey`` re-seals every secret under a new key (:func:`reseal_all`).
"""

from __future__ import annotations

import base64
import hashlib
import os
import secrets
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from sqlalchemy import select, update

from fedswarm.store import Store
from fedswarm.store.schema import Webhook

__all__ = ["KEY_ENV", "KEY_FILE_ENV", "SecretBox", "SecretKeyError", "SecretUnavailable", "default_key_file",
           "load_box", "reseal_all", "seal_clear_secrets"]

KEY_ENV = "FEDSWARM_SECRET_KEY"
KEY_FILE_ENV = "FEDSWARM_SECRET_KEY_FILE"
PREFIX = "fsk1"
MIN_KEY_CHARS = 16


class SecretKeyError(ValueError):
    """The secret key cannot be used (too short, unreadable, a key file readable by others)."""


class SecretUnavailable(RuntimeError):
    """A sealed secret this dashboard cannot open (another key, or an altered value)."""


def default_key_file() -> Path:
    """``$FEDSWARM_SECRET_KEY_FILE``, else ``$XDG_CONFIG_HOME/fedswarm/secret.key``."""
    if os.environ.get(KEY_FILE_ENV):
        return Path(os.environ[KEY_FILE_ENV])
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "fedswarm" / "secret.key"


class SecretBox:
    """Seals and opens secrets under one key (``material``: the operator's string)."""

    def __init__(self, material: str, source: str):
        if len(material) < MIN_KEY_CHARS:
            raise SecretKeyError(f"the secret key from {source} has {len(material)} characters; it needs at least "
                                 f"{MIN_KEY_CHARS} (make one with: python -c 'import secrets; "
                                 f"print(secrets.token_urlsafe(32))')")
        key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
                   info=b"fedswarm webhook secrets v1").derive(material.encode())
        self.source = source
        self.key_id = hashlib.sha256(b"fedswarm key id" + key).hexdigest()[:8]
        self._aead = AESGCM(key)

    def seal(self, secret: str, row_id: int) -> str:
        nonce = secrets.token_bytes(12)
        sealed = self._aead.encrypt(nonce, secret.encode(), _aad(row_id))
        return f"{PREFIX}:{self.key_id}:{base64.urlsafe_b64encode(nonce + sealed).decode()}"

    def open(self, sealed: str | None, row_id: int) -> str:
        """The secret; :class:`SecretUnavailable` saying why not."""
        parts = (sealed or "").split(":")
        if len(parts) != 3 or parts[0] != PREFIX:
            raise SecretUnavailable(f"webhook {row_id} has no sealed secret")
        if parts[1] != self.key_id:
            raise SecretUnavailable(f"webhook {row_id}'s secret was sealed under key {parts[1]}; this dashboard's "
                                    f"key ({self.source}) is {self.key_id}")
        try:
            raw = base64.urlsafe_b64decode(parts[2])
            return self._aead.decrypt(raw[:12], raw[12:], _aad(row_id)).decode()
        except (InvalidTag, ValueError) as exc:
            raise SecretUnavailable(f"webhook {row_id}'s sealed secret does not open under key {self.key_id} "
                                    f"(altered, or moved from another row: {type(exc).__name__})") from None


def _aad(row_id: int) -> bytes:
    return f"webhooks:{int(row_id)}".encode()


def load_box(key: str | None = None, key_file: str | os.PathLike | None = None, *, create: bool = True) -> SecretBox:
    """The box for ``key`` (the dashboard's: ``$FEDSWARM_SECRET_KEY`` or its ``secret_key``), else
    for the key file ``key_file`` (default :func:`default_key_file`), made (0600) when missing and
    ``create``."""
    if key:
        return SecretBox(key, f"${KEY_ENV}" if key == os.environ.get(KEY_ENV) else "the configured secret key")
    path = Path(key_file) if key_file is not None else default_key_file()
    if not path.exists():
        if not create:
            raise SecretKeyError(f"no secret key: set ${KEY_ENV} or create {path}")
        _write_key_file(path)
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise SecretKeyError(f"{path} is readable by others (mode {mode:o}); chmod 600 it")
    try:
        material = path.read_text().strip()
    except OSError as exc:
        raise SecretKeyError(f"cannot read the secret key file {path}: {exc}") from None
    return SecretBox(material, str(path))


def _write_key_file(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32) + "\n")
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, path)  # never replaces a key another dashboard made at the same moment
    except FileExistsError:
        pass
    finally:
        tmp.unlink()


def seal_clear_secrets(store: Store, box: SecretBox) -> int:
    """Seal, in place, the secrets an older fedswarm kept in clear (``webhooks.secret``); returns
    how many. Each row is updated only if it still holds that clear secret and no sealed one, so
    two dashboards starting at once seal it once. On SQLite the update runs with
    ``secure_delete``, so the clear text's old bytes are overwritten, not left in free space."""
    with store.session() as s:
        rows = s.execute(select(Webhook.id, Webhook.secret).where(
            Webhook.secret_sealed.is_(None), Webhook.secret != "")).all()
    done = 0
    for row_id, clear in rows:
        with store.session() as s:
            if store.engine.dialect.name == "sqlite":
                s.connection().exec_driver_sql("PRAGMA secure_delete = ON")
            done += s.execute(update(Webhook).where(
                Webhook.id == row_id, Webhook.secret == clear, Webhook.secret_sealed.is_(None)).values(
                secret="", secret_sealed=box.seal(clear, row_id))).rowcount
    return done


def reseal_all(store: Store, old: SecretBox, new: SecretBox) -> int:
    """Re-seal every webhook secret from ``old``'s key under ``new``'s, in one transaction (all or
    none); :class:`SecretUnavailable` naming the first that ``old`` cannot open. Returns how many."""
    with store.session() as s:
        hooks = list(s.scalars(select(Webhook).order_by(Webhook.id).with_for_update()))
        for h in hooks:
            if h.secret_sealed is None:
                h.secret_sealed, h.secret = new.seal(h.secret, h.id), ""
            else:
                h.secret_sealed = new.seal(old.open(h.secret_sealed, h.id), h.id)
        return len(hooks)
