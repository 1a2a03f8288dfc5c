"""The signed envelope every swarm message travels in, and the checks that drop bad ones.

Wire format (all lengths big-endian uint32, every piece one length-prefixed frame)::

    header frame   JSON {v, from, to, ts, nonce, kind, re, meta, blen} + Ed25519 signature
    body frames    chunks of the body, each <= max_chunk bytes, blen bytes in all
    trailer frame  16-byte Poly1305 tag of the body                          (blen > 0)

The header is signed on its own so a peer refuses a forged, replayed, expired, misdirected
or oversized message *before* reading its body. The trailer binds the body to that header:
a one-time Poly1305 key ``HMAC-SHA256(shared, "fedswarm-mac" | nonce | from | to)`` from
the static X25519 secret of sender and receiver (their Ed25519 keys mapped to Curve25519,
:meth:`~fedswarm.swarm.net.identity.Identity.shared_secret`), so only the two of them can make
it, and a fresh nonce makes every key single-use. Poly1305 streams at several GB/s; a
SHA-256 of the body for an Ed25519 signature was the bottleneck of large models.
``to`` names the receiving peer, so a message captured on one link cannot be replayed to
another; ``re`` names the request a response answers.

Over a connection whose mutual-TLS certificate is bound to the sender's signing key (a
permissioned swarm), the trailer is left out and the header says so (``"tag": "tls"``):
TLS's AEAD already authenticates every byte as coming from the holder of that key, in
order; the receiver accepts such a body only on a connection bound to the header's
sender, and refuses a header from anyone else before reading any body.

Over a Noise session (:mod:`~fedswarm.swarm.net.noise`, the default without TLS), the
same holds with ``"tag": "noise"``: the session's handshake proved the sender's identity
key and its records authenticate (and encrypt) every byte.

Every refusal raises :class:`Dropped` with one of :data:`DROP_REASONS`; the
:class:`Verifier` counts them (``verifier.dropped``), and the peer logs and reports them.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import socket
import ssl
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.poly1305 import Poly1305
from fedswarm.swarm.net.bodies import BODY_POOL, POOL_MIN_BYTES, BodyPool, FiniteScan, alloc_body, float_scan
from fedswarm.swarm.net.identity import SIGNATURE_BYTES, Identity, verify

__all__ = ["BODY_POOL", "CHUNK_BYTES", "DROP_REASONS", "POOL_MIN_BYTES", "TAG_NOISE", "TAG_TLS", "BodyPool", "Conn",
           "Dropped", "FiniteScan", "Message", "Verifier", "alloc_body", "header_frame", "recv_message",
           "send_message"]

VERSION = 1
_LEN = struct.Struct(">I")
_HEADER_DOMAIN = b"fedswarm-swarm-v1\x00"
_MAC_DOMAIN = b"fedswarm-mac\x00"
_ENC_DOMAIN = b"fedswarm-enc\x00"
ENC_AES_GCM = "aes256gcm"
TAG_TLS = "tls"  # header "tag": the body's integrity is the identity-bound TLS channel's
TAG_NOISE = "noise"  # ... or the Noise channel's (:mod:`~fedswarm.swarm.net.noise`)
TAG_BYTES = 16
DROP_REASONS = ("malformed", "oversized", "not_allowed", "forged", "expired", "replayed", "misdirected",
                "invalid_payload", "timeout", "closed", "revoked", "untrusted", "identity_mismatch")


class Dropped(Exception):
    """A message refused by the transport (or by payload validation), with its reason."""

    def __init__(self, reason: str, detail: str = ""):
        assert reason in DROP_REASONS, reason
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@dataclass
class Message:
    """A verified message. ``body`` is a writable buffer (bytearray or anonymous mmap)."""

    sender: str
    to: str
    ts: float
    nonce: str
    kind: str
    meta: dict[str, Any] = field(default_factory=dict)
    body: bytearray = field(default_factory=bytearray)
    re: str | None = None
    #: Whether every float32 of the body is finite, scanned as it arrived (a header saying
    #: ``dtype: float32``, a whole number of values); None when not scanned.
    finite: bool | None = None


class Conn:
    """A blocking socket (plain or TLS) that counts the bytes it moves. ``head``: bytes
    already read from it (the responder's look at the first four), read again first.
    ``channel_tag``: the header "tag" of a body that this connection, once bound to its
    peer's identity, authenticates itself."""

    channel_tag = TAG_TLS

    def __init__(self, sock, head: bytes = b""):
        self.sock = sock
        self.sent = 0
        self.received = 0
        self.head = head

    def sendall(self, data) -> None:
        self.sock.sendall(data)
        self.sent += len(data)

    def send_frame(self, head: bytes, piece) -> None:
        """``head`` then ``piece`` in one system call where the socket allows (``sendmsg``;
        a TLS socket has none), not one write for a 4-byte length and one for its chunk."""
        if not isinstance(self.sock, socket.socket) or isinstance(self.sock, ssl.SSLSocket):
            self.sendall(head)
            self.sendall(piece)
            return
        bufs = [memoryview(head), memoryview(piece).cast("B")]
        total = sum(len(b) for b in bufs)
        while bufs:
            n = self.sock.sendmsg(bufs)
            while bufs and n >= len(bufs[0]):
                n -= len(bufs.pop(0))
            if bufs:
                bufs[0] = bufs[0][n:]
        self.sent += total

    def send_frames(self, frames) -> None:
        """Each ``(head, piece)`` of ``frames`` as :meth:`send_frame` sends it (a Noise
        session may encrypt the next ones on a second thread meanwhile)."""
        for head, piece in frames:
            self.send_frame(head, piece)

    def recv_exact_into(self, view: memoryview) -> None:
        got, n = 0, len(view)
        if self.head:
            got = min(n, len(self.head))
            view[:got] = self.head[:got]
            self.head = self.head[got:]
        while got < n:
            r = self.sock.recv_into(view[got:], n - got)
            if r == 0:
                raise Dropped("closed", f"connection closed after {got} of {n} bytes")
            got += r
        self.received += n

    def recv_exact(self, n: int) -> bytearray:
        buf = bytearray(n)
        self.recv_exact_into(memoryview(buf))
        return buf

    def read_len(self) -> int:
        return _LEN.unpack(self.recv_exact(4))[0]

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class Verifier:
    """The receiving side's policy: who is admitted, size limits, the time window and
    the replay cache, and the count of every dropped message by reason.

    Parameters
    ----------
    ident : Identity
        This peer; messages addressed to anyone else are ``misdirected``, and its key
        derives the body tags' keys.
    allowed : set[str] | None
        Admitted peer ids; None admits any key (loopback demos only).
    max_body_bytes, max_header_bytes, max_chunk_bytes : int
        Size limits; a message over one is ``oversized`` and its body is never read.
    window_s : float
        A timestamp further than this from our clock is ``expired``; nonces are kept
        ``2·window_s``, so the replay cache stays bounded.
    """

    def __init__(self, ident: Identity, allowed: set[str] | None, *, max_body_bytes: int = 1 << 30,
                 max_header_bytes: int = 1 << 20, max_chunk_bytes: int = 4 << 20, window_s: float = 120.0,
                 max_nonces: int = 1_000_000, require_encryption: bool = False):
        self.ident = ident
        self.peer_id = ident.peer_id
        self.allowed = allowed
        self.max_body_bytes = max_body_bytes
        self.max_header_bytes = max_header_bytes
        self.max_chunk_bytes = max_chunk_bytes
        self.window_s = window_s
        self.max_nonces = max_nonces
        self.require_encryption = require_encryption
        self.dropped: dict[str, int] = {r: 0 for r in DROP_REASONS}
        self._seen: OrderedDict[tuple[str, str], float] = OrderedDict()
        self._lock = threading.Lock()

    def count(self, reason: str) -> None:
        with self._lock:
            self.dropped[reason] = self.dropped.get(reason, 0) + 1

    def drop_counts(self) -> dict[str, int]:
        with self._lock:
            return {k: v for k, v in self.dropped.items() if v}

    def admit(self, peer_id: str) -> bool:
        return self.allowed is None or peer_id in self.allowed

    def check_nonce(self, sender: str, nonce: str, now: float) -> None:
        with self._lock:
            horizon = now - 2 * self.window_s
            while self._seen and (next(iter(self._seen.values())) < horizon or len(self._seen) > self.max_nonces):
                self._seen.popitem(last=False)
            key = (sender, nonce)
            if key in self._seen:
                raise Dropped("replayed", f"nonce {nonce} from {sender[:8]} was seen before")
            self._seen[key] = now


def _body_mac(ident: Identity, other: str, nonce: str, sender: str, receiver: str) -> Poly1305:
    try:
        shared = ident.shared_secret(other)
    except ValueError as exc:
        raise Dropped("forged", f"no shared key with {other[:8]}: {exc}") from None
    info = _MAC_DOMAIN + bytes.fromhex(nonce) + bytes.fromhex(sender) + bytes.fromhex(receiver)
    return Poly1305(hmac.new(shared, info, hashlib.sha256).digest())


#: Body bytes per chunk a sender writes (1 MB): of 128 KB to 4 MB side by side, the fastest for clear and
#: encrypted bodies in the 40 MB exchange of ``fedswarm bench swarm --exchange-only`` on loopback.
CHUNK_BYTES = 1 << 20


def _dump(obj: dict) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True, allow_nan=False).encode()


def header_frame(ident: Identity, kind: str, *, to: str, blen: int, nonce: str, meta: dict | None = None,
                 re: str | None = None, ts: float | None = None, enc: bool = False, tls_tag: bool | str = False
                 ) -> bytes:
    """The signed header frame of a message announcing a ``blen``-byte body (``tls_tag``:
    True or a channel's tag, for a body its bound channel authenticates)."""
    h = {"v": VERSION, "from": ident.peer_id, "to": to, "ts": time.time() if ts is None else ts,
         "nonce": nonce, "kind": kind, "re": re, "meta": meta or {}, "blen": blen}
    if enc:
        h["enc"] = ENC_AES_GCM
    if tls_tag:
        h["tag"] = TAG_TLS if tls_tag is True else tls_tag
    header = _dump(h)
    return _LEN.pack(len(header) + SIGNATURE_BYTES) + header + ident.sign(_HEADER_DOMAIN + header)


def _body_cipher(ident: Identity, other: str, nonce: str, sender: str, receiver: str) -> AESGCM:
    try:
        shared = ident.shared_secret(other)
    except ValueError as exc:
        raise Dropped("forged", f"no shared key with {other[:8]}: {exc}") from None
    info = _ENC_DOMAIN + bytes.fromhex(nonce) + bytes.fromhex(sender) + bytes.fromhex(receiver)
    return AESGCM(hmac.new(shared, info, hashlib.sha256).digest())


def _chunk_nonce(i: int, last: bool) -> bytes:
    return i.to_bytes(8, "big") + (b"\x00\x00\x00\x01" if last else b"\x00\x00\x00\x00")


def send_message(conn: Conn, ident: Identity, kind: str, *, to: str, meta: dict | None = None,
                 body=b"", re: str | None = None, chunk_bytes: int = CHUNK_BYTES, ts: float | None = None,
                 nonce: str | None = None, encrypt: bool = False, tls_bound: bool = False) -> str:
    """Sign and send one message; returns its nonce. ``body`` is any bytes-like object
    (a memoryview of a tensor's storage is sent without a copy). With ``encrypt`` the body
    travels AES-256-GCM encrypted chunk by chunk (each chunk authenticated) instead of in
    clear with a Poly1305 tag. ``tls_bound`` says ``conn`` is a channel bound to both peers'
    signing keys (mutual TLS with certificates bound to them, or a Noise session): the body
    goes without a tag of its own (the channel authenticates it) and the header says which
    channel (``conn.channel_tag``)."""
    view = memoryview(body).cast("B") if len(body) else memoryview(b"")
    if len(view) and not to:
        raise ValueError("a message with a body needs a known recipient (its tag key depends on it)")
    nonce = nonce or os.urandom(16).hex()
    enc = encrypt and bool(len(view))
    tls_tag = tls_bound and not enc and bool(len(view))
    conn.sendall(header_frame(ident, kind, to=to, meta=meta, blen=len(view), re=re, ts=ts, nonce=nonce, enc=enc,
                              tls_tag=tls_tag and conn.channel_tag))
    if tls_tag:
        pieces = (view[start : start + chunk_bytes] for start in range(0, len(view), chunk_bytes))
        conn.send_frames((_LEN.pack(len(piece)), piece) for piece in pieces)
    elif enc:
        aes = _body_cipher(ident, to, nonce, ident.peer_id, to)
        out = bytearray(4 + min(chunk_bytes, len(view)) + TAG_BYTES)
        for i, start in enumerate(range(0, len(view), chunk_bytes)):
            piece = view[start : start + chunk_bytes]
            frame = memoryview(out)[: 4 + len(piece) + TAG_BYTES]
            _LEN.pack_into(frame, 0, len(piece) + TAG_BYTES)
            aes.encrypt_into(_chunk_nonce(i, start + len(piece) == len(view)), piece, None, frame[4:])
            conn.sendall(frame)  # one write per chunk: length and ciphertext together
    elif len(view):
        mac = _body_mac(ident, to, nonce, ident.peer_id, to)
        for start in range(0, len(view), chunk_bytes):
            piece = view[start : start + chunk_bytes]
            conn.send_frame(_LEN.pack(len(piece)), piece)
            mac.update(piece)
        conn.sendall(_LEN.pack(TAG_BYTES) + mac.finalize())
    return nonce


def _parse_header(raw: bytearray, v: Verifier) -> tuple[dict, bytes, bytes]:
    if len(raw) <= SIGNATURE_BYTES:
        raise Dropped("malformed", "header frame too short")
    text, sig = bytes(raw[:-SIGNATURE_BYTES]), bytes(raw[-SIGNATURE_BYTES:])
    try:
        h = json.loads(text)
    except (UnicodeDecodeError, ValueError, RecursionError):  # RecursionError: arrays nested thousands deep
        raise Dropped("malformed", "header is not JSON") from None
    if not isinstance(h, dict) or h.get("v") != VERSION:
        raise Dropped("malformed", f"header is not a v{VERSION} envelope")
    types = {"from": str, "to": str, "ts": (int, float), "nonce": str, "kind": str, "meta": dict, "blen": int}
    for key, typ in types.items():
        if not isinstance(h.get(key), typ) or isinstance(h.get(key), bool):
            raise Dropped("malformed", f"header field '{key}' is missing or has the wrong type")
    if h.get("re") is not None and not isinstance(h["re"], str):
        raise Dropped("malformed", "header field 're' has the wrong type")
    h["re"] = h.get("re")
    try:
        h["ts"] = float(h["ts"])  # an integer timestamp of 400 digits has no float
    except OverflowError:
        h["ts"] = math.inf
    if len(h["from"]) != 64 or len(h["nonce"]) != 32 or not math.isfinite(h["ts"]) or h["blen"] < 0:
        raise Dropped("malformed", "bad sender, nonce, timestamp or body length")
    try:
        bytes.fromhex(h["from"]), bytes.fromhex(h["nonce"])
    except ValueError:
        raise Dropped("malformed", "sender or nonce is not hex") from None
    return h, _HEADER_DOMAIN + text, sig


def recv_message(conn: Conn, v: Verifier, *, expect_re: str | None = None, bound_peer: str | None = None
                 ) -> Message:
    """Read one message and verify it; raise :class:`Dropped` (and count it) if it is
    malformed, oversized, not allowed, forged, expired, replayed or misdirected.
    ``bound_peer``: the peer id ``conn``'s TLS certificate proves (a permissioned swarm); a
    header signed by anyone else is ``identity_mismatch`` before its body is read, and only
    such a connection may carry a body without a tag of its own."""
    try:
        return _recv(conn, v, expect_re, bound_peer)
    except Dropped as exc:
        v.count(exc.reason)
        raise
    except TimeoutError:
        v.count("timeout")
        raise Dropped("timeout", "peer too slow") from None


def _recv_encrypted(conn: Conn, v: Verifier, h: dict, body, scan: FiniteScan | None) -> None:
    """Read and decrypt AES-GCM chunks into ``body``: every chunk is authenticated before
    the next is read, numbered (no reordering), and the last one is marked (no truncation)."""
    sender, blen = h["from"], h["blen"]
    aes = _body_cipher(v.ident, sender, h["nonce"], sender, h["to"])
    scratch = bytearray(0)  # sized by the first chunk (the sender's chunk size), after its length is checked
    view, got, i = memoryview(body), 0, 0
    while got < blen:
        c = conn.read_len()
        n = c - TAG_BYTES
        if n <= 0 or n > v.max_chunk_bytes or got + n > blen:
            raise Dropped("oversized" if n > v.max_chunk_bytes else "malformed", f"body chunk of {c} bytes at {got}")
        if len(scratch) < c:
            scratch = bytearray(c)
        frame = memoryview(scratch)[:c]
        conn.recv_exact_into(frame)
        try:
            aes.decrypt_into(_chunk_nonce(i, got + n == blen), frame, None, view[got : got + n])
        except InvalidTag:
            raise Dropped("forged", f"body chunk {i} does not decrypt (from {sender[:8]})") from None
        got += n
        i += 1
        if scan is not None:
            scan.upto(got)


def _recv_chunks(conn: Conn, v: Verifier, body, blen: int, mac: Poly1305 | None, scan: FiniteScan | None) -> None:
    view, got = memoryview(body), 0
    while got < blen:
        c = conn.read_len()
        if c == 0 or c > v.max_chunk_bytes or got + c > blen:
            raise Dropped("oversized" if c else "malformed", f"body chunk of {c} bytes at offset {got}")
        conn.recv_exact_into(view[got : got + c])
        if mac is not None:
            mac.update(view[got : got + c])
        got += c
        if scan is not None:
            scan.upto(got)


def _recv(conn: Conn, v: Verifier, expect_re: str | None, bound_peer: str | None) -> Message:
    n = conn.read_len()
    if n > v.max_header_bytes:
        raise Dropped("oversized", f"header of {n} bytes, the limit is {v.max_header_bytes}")
    h, signed, sig = _parse_header(conn.recv_exact(n), v)
    sender, blen = h["from"], h["blen"]
    if blen > v.max_body_bytes:
        raise Dropped("oversized", f"body of {blen} bytes, the limit is {v.max_body_bytes}")
    if not v.admit(sender):
        raise Dropped("not_allowed", f"key {sender[:16]}… is not on the allow list")
    if not verify(sender, sig, signed):
        raise Dropped("forged", f"bad header signature from {sender[:8]}")
    if bound_peer is not None and sender != bound_peer:
        raise Dropped("identity_mismatch", f"message signed by {sender[:8]} over the TLS connection of "
                                           f"{bound_peer[:8]}")
    if h["to"] != v.peer_id and not (h["to"] == "" and h["kind"] in ("join", "probe")):
        raise Dropped("misdirected", f"addressed to {h['to'][:8]}, not to us")
    now = time.time()
    if abs(now - h["ts"]) > v.window_s:
        raise Dropped("expired", f"timestamp {now - h['ts']:+.1f} s off (window {v.window_s:.0f} s)")
    if expect_re is not None and h["re"] != expect_re:
        raise Dropped("malformed", "response does not answer our request")
    v.check_nonce(sender, h["nonce"], now)
    if blen and not h["to"]:
        raise Dropped("malformed", "a message with a body must name its recipient")
    body_tag = h.get("tag")
    if body_tag is not None and (body_tag not in (TAG_TLS, TAG_NOISE) or h.get("enc") is not None):
        raise Dropped("malformed", f"unknown body tag {body_tag!r}")
    if body_tag is not None and (bound_peer is None or body_tag != conn.channel_tag):
        raise Dropped("malformed", "body without a tag over a connection not bound to the sender's certificate "
                                   "or Noise session")
    body = BODY_POOL.take(blen)
    scan = float_scan(h["meta"], body, blen)
    if blen and body_tag is not None:
        _recv_chunks(conn, v, body, blen, None, scan)  # the channel (bound to the sender, checked above) vouches
    elif blen and h.get("enc") == ENC_AES_GCM:
        _recv_encrypted(conn, v, h, body, scan)
    elif blen and h.get("enc") is not None:
        raise Dropped("malformed", f"unknown body encryption {h.get('enc')!r}")
    elif v.require_encryption and blen:
        raise Dropped("malformed", "body not encrypted (this peer requires encryption)")
    elif blen:
        mac = _body_mac(v.ident, sender, h["nonce"], sender, h["to"])
        _recv_chunks(conn, v, body, blen, mac, scan)
        if conn.read_len() != TAG_BYTES:
            raise Dropped("malformed", "missing body tag")
        tag = bytes(conn.recv_exact(TAG_BYTES))
        try:
            mac.verify(tag)
        except InvalidSignature:
            raise Dropped("forged", f"body does not match its tag (from {sender[:8]})") from None
    return Message(sender=sender, to=h["to"], ts=float(h["ts"]), nonce=h["nonce"], kind=h["kind"],
                   meta=h["meta"], body=body, re=h["re"],
                   finite=scan.finite if scan is not None and scan.done == blen else None)  # a whole scan, or none
