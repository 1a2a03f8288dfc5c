"""The cryptographic primitives of SecAgg+, all from ``cryptography``: X25519 key agreement,
HKDF-SHA256, AES-256-GCM for the shares a node sends another through the server, and the
pseudo-random generator that expands a 32-byte seed into a mask over Z_{2^b}.

The PRG is AES-256 in counter mode over a zero block stream, read as ``d`` little-endian words
(uint32 for ``b <= 32``, else uint64) and reduced mod ``2^b`` by a bit mask (uniform, since
``2^b`` divides the word's range). Masks are summed in those words, reduced once at the end.
"""

from __future__ import annotations

import os

import numpy as np
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

__all__ = ["KeyPair", "agree", "decrypt", "derive", "encrypt", "field_dtype", "keystream", "new_seed", "prg_mask",
           "prg_words"]

_RAW = serialization.Encoding.Raw
_NONCE = 12


class KeyPair:
    """An X25519 key pair whose halves travel as 32 raw bytes."""

    def __init__(self, private: bytes | None = None):
        self._sk = X25519PrivateKey.from_private_bytes(private) if private is not None else X25519PrivateKey.generate()

    @property
    def private_bytes(self) -> bytes:
        return self._sk.private_bytes(_RAW, serialization.PrivateFormat.Raw, serialization.NoEncryption())

    @property
    def public_bytes(self) -> bytes:
        return self._sk.public_key().public_bytes(_RAW, serialization.PublicFormat.Raw)

    def exchange(self, peer_public: bytes) -> bytes:
        if len(peer_public) != 32:
            raise ValueError(f"secagg: an X25519 public key has 32 bytes, got {len(peer_public)}")
        return self._sk.exchange(X25519PublicKey.from_public_bytes(peer_public))


def agree(own: KeyPair, peer_public: bytes, info: bytes) -> bytes:
    """A 32-byte key both ends derive: HKDF-SHA256 of the X25519 shared secret, bound to ``info``
    (the round and what the key is for)."""
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(own.exchange(peer_public))


def derive(secret: bytes, label: bytes) -> bytes:
    """32 bytes of HKDF-SHA256 from ``secret`` for the purpose ``label``: independent keys from one secret."""
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=b"fedswarm-secagg/" + label).derive(secret)


def new_seed() -> bytes:
    """32 random bytes from the OS."""
    return os.urandom(32)


def encrypt(key: bytes, plaintext: bytes, associated: bytes) -> bytes:
    """AES-256-GCM: a fresh 12-byte nonce, then the ciphertext and its tag."""
    nonce = os.urandom(_NONCE)
    return nonce + AESGCM(key).encrypt(nonce, plaintext, associated)


def decrypt(key: bytes, blob: bytes, associated: bytes) -> bytes:
    """The plaintext of :func:`encrypt`; ``cryptography.exceptions.InvalidTag`` if ``blob`` or
    ``associated`` was altered or the key is wrong."""
    return AESGCM(key).decrypt(blob[:_NONCE], blob[_NONCE:], associated)


def field_dtype(bits: int) -> type:
    """The machine word masks are summed in: uint32 up to 32 bits, else uint64. Either wraps mod
    a multiple of ``2^bits``, so sums are reduced mod ``2^bits`` once, at the end."""
    return np.uint32 if bits <= 32 else np.uint64


def keystream(seed: bytes):
    """The PRG of ``seed`` as a cipher context: AES-256-CTR from a zero counter, whose output on
    zero bytes (``update`` or ``update_into``) is the keystream, continued across calls."""
    if len(seed) != 32:
        raise ValueError(f"secagg: a PRG seed has 32 bytes, got {len(seed)}")
    return Cipher(algorithms.AES(seed), modes.CTR(b"\0" * 16)).encryptor()


def prg_words(seed: bytes, d: int, bits: int) -> np.ndarray:
    """``d`` pseudo-random words of :func:`field_dtype` (read-only), unreduced: uniform mod
    ``2^bits`` once reduced. The keystream of :func:`keystream`, little-endian. (Masks are
    applied in place, chunk by chunk, by ``masking.apply_masks``; this is the whole-vector form.)"""
    dtype = np.dtype(field_dtype(bits)).newbyteorder("<")
    return np.frombuffer(keystream(seed).update(bytes(dtype.itemsize * d)), dtype=dtype)


def prg_mask(seed: bytes, d: int, bits: int) -> np.ndarray:
    """``d`` pseudo-random elements of Z_{2^bits} (uint64) expanded from a 32-byte ``seed``."""
    out = prg_words(seed, d, bits).astype(np.uint64)
    if bits < 64:
        out &= np.uint64((1 << bits) - 1)
    return out
