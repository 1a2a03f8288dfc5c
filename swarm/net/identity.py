"""Peer identities: Ed25519 key pairs and the allow list of admitted public keys.

A peer's identity is an Ed25519 key pair kept in a key directory (``private.pem``, mode
0600, and ``public.txt``). The same key pair, mapped to Curve25519 by libsodium's
``crypto_sign_ed25519_*_to_curve25519`` (through PyNaCl), gives every pair of peers a static
Diffie-Hellman secret (:meth:`Identity.shared_secret`) with no handshake: it keys the
one-time Poly1305 tag that authenticates a message body far faster than hashing it. Its
**peer id** is the hex of the 32-byte raw public key; the
swarm sorts peer ids to derive the topology, so every peer computes the same graph.
:func:`create_or_load` is what ``fedswarm keys`` does: create the pair on first use,
load it afterwards.

An allow list is a text file with one public key per line (hex or base64 of the raw 32
bytes); ``#`` starts a comment. A swarm admits only listed keys; ``--insecure-allow-any``
(loopback demos only) admits everyone.
"""

from __future__ import annotations

import base64
import binascii
import os
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from cryptography.hazmat.primitives.asymmetric.x25519 import (
    X25519PrivateKey,
    X25519PublicKey,
)
from nacl.bindings import crypto_sign_ed25519_pk_to_curve25519, crypto_sign_ed25519_sk_to_curve25519
from nacl.exceptions import CryptoError

__all__ = [
    "SIGNATURE_BYTES",
    "Identity",
    "create_or_load",
    "load_allow_list",
    "parse_public_key",
    "verify",
    "x25519_public",
]

SIGNATURE_BYTES = 64
PRIVATE_FILE = "private.pem"
PUBLIC_FILE = "public.txt"


@dataclass(frozen=True)
class Identity:
    """A peer's key pair. ``peer_id`` is the raw public key in hex (64 characters)."""

    private_key: Ed25519PrivateKey
    public_bytes: bytes
    _shared: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def peer_id(self) -> str:
        return self.public_bytes.hex()

    @property
    def public_b64(self) -> str:
        return base64.b64encode(self.public_bytes).decode()

    @property
    def short_id(self) -> str:
        return self.peer_id[:8]

    def sign(self, data: bytes) -> bytes:
        return self.private_key.sign(data)

    def shared_secret(self, peer_id: str) -> bytes:
        """The X25519 secret between us and ``peer_id`` (both keys mapped from Ed25519),
        cached; raises ValueError for a key that is not a valid point."""
        secret = self._shared.get(peer_id)
        if secret is None:
            secret = self.x25519_private().exchange(x25519_public(peer_id))
            if len(self._shared) > 4096:
                self._shared.clear()
            self._shared[peer_id] = secret
        return secret

    def x25519_private(self) -> X25519PrivateKey:
        """This identity's X25519 private key (the clamped scalar of its Ed25519 seed, so its
        public key is :func:`x25519_public` of our peer id); cached."""
        key = self._shared.get("")
        if key is None:
            seed = self.private_key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                                  serialization.NoEncryption())
            scalar = crypto_sign_ed25519_sk_to_curve25519(seed + self.public_bytes)  # libsodium's secret key
            key = self._shared[""] = X25519PrivateKey.from_private_bytes(scalar)
        return key

    @classmethod
    def generate(cls) -> Identity:
        key = Ed25519PrivateKey.generate()
        return cls(key, _raw_public(key.public_key()))


def x25519_public(peer_id: str) -> X25519PublicKey:
    """The Curve25519 (Montgomery) form of an Ed25519 public key, ``u = (1 + y) / (1 − y)``;
    ValueError for a peer id that is no valid point (libsodium also refuses small-order points)."""
    try:
        raw = bytes.fromhex(peer_id)
    except ValueError:
        raise ValueError(f"not a peer id: {peer_id[:16]!r}") from None
    try:
        return X25519PublicKey.from_public_bytes(crypto_sign_ed25519_pk_to_curve25519(raw))
    except (CryptoError, ValueError):
        raise ValueError("public key is not a usable curve point") from None


def _raw_public(pub: Ed25519PublicKey) -> bytes:
    return pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def create_or_load(key_dir: str | os.PathLike) -> Identity:
    """The identity stored in ``key_dir``, created there (private key mode 0600) if absent."""
    d = Path(key_dir).expanduser()
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    priv = d / PRIVATE_FILE
    if priv.exists():
        mode = priv.stat().st_mode & 0o777
        if mode & 0o077:
            raise PermissionError(f"{priv} is readable by others (mode {mode:o}); chmod 600 it")
        key = serialization.load_pem_private_key(priv.read_bytes(), password=None)
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError(f"{priv} is not an Ed25519 private key")
        ident = Identity(key, _raw_public(key.public_key()))
    else:
        ident = Identity.generate()
        pem = ident.private_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        tmp = d / (PRIVATE_FILE + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
        os.replace(tmp, priv)
    (d / PUBLIC_FILE).write_text(ident.peer_id + "\n")
    return ident


def parse_public_key(text: str) -> bytes:
    """A raw 32-byte Ed25519 public key from hex (64 chars) or base64 (44 chars)."""
    s = text.strip()
    try:
        raw = bytes.fromhex(s) if len(s) == 64 else base64.b64decode(s, validate=True)
    except (ValueError, binascii.Error):
        raise ValueError(f"not a hex or base64 Ed25519 public key: {s[:70]!r}") from None
    if len(raw) != 32:
        raise ValueError(f"an Ed25519 public key has 32 bytes, got {len(raw)}: {s[:70]!r}")
    Ed25519PublicKey.from_public_bytes(raw)  # raises on a malformed point
    return raw


def load_allow_list(path: str | os.PathLike) -> set[str]:
    """Peer ids (hex) admitted by an allow-list file: one key per line, ``#`` comments."""
    ids: set[str] = set()
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        key = line.split("#", 1)[0].strip()
        if not key:
            continue
        try:
            ids.add(parse_public_key(key.split()[0]).hex())
        except ValueError as exc:
            raise ValueError(f"{path}:{n}: {exc}") from None
    return ids


_KEY_CACHE: dict[str, Ed25519PublicKey] = {}


def verify(peer_id: str, signature: bytes, data: bytes) -> bool:
    """Whether ``signature`` is ``peer_id``'s Ed25519 signature of ``data``."""
    key = _KEY_CACHE.get(peer_id)
    if key is None:
        try:
            key = Ed25519PublicKey.from_public_bytes(bytes.fromhex(peer_id))
        except ValueError:
            return False
        if len(_KEY_CACHE) > 4096:
            _KEY_CACHE.clear()
        _KEY_CACHE[peer_id] = key
    try:
        key.verify(signature, data)
        return True
    except InvalidSignature:
        return False
