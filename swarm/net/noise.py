"""Forward-secret peer links: a Noise XX handshake at the start of every connection, then
every byte either way AES-256-GCM encrypted under per-direction session keys.

Pattern ``Noise_XX_25519_AESGCM_SHA256`` (the Noise Protocol Framework, revision 34, §7.5)::

    -> e
    <- e, ee, s, es
    -> s, se

The static keys ``s`` are the peers' identities: the X25519 form of their Ed25519 keys (the
birational map of :func:`~fedswarm.swarm.net.identity.x25519_public`, what libsodium's
``crypto_sign_ed25519_*_to_curve25519`` compute), so the allow list that admits a peer id
admits its static key, with no certificate or signature to carry. ``ee`` between two fresh
ephemeral keys makes the session keys unrecoverable once both ephemeral private keys are gone,
even to whoever later holds both identity keys; ``es`` and ``se`` prove each side holds its
identity. XX (not IK) because a joining peer does not know the responder's key yet; the
initiator checks the responder's identity (admitted, and the peer it meant to reach) before
it reveals its own in the third message.

After the handshake, ``Split()`` gives one key per direction. A record on the wire is
``len (4 bytes, big-endian) | AES-256-GCM(k, nonce = 0^32 | n^64, ad = len, plaintext)``;
``n`` counts the records of that direction and is never sent, so a replayed, dropped,
reordered or altered record fails to decrypt. A direction's key is replaced by Noise's
``REKEY`` (``k' = first 32 bytes of ENCRYPT(k, 2^64 - 1, "", 0^32)``) after
:data:`REKEY_BYTES` plaintext bytes or :data:`REKEY_RECORDS` records under it, whichever comes
first; both sides count, so no message announces it. ``docs/swarm-protocol.md`` has the rest.
"""

from __future__ import annotations

import hashlib
import os
import struct
import threading
import time

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from fedswarm.errors import ConfigError
from fedswarm.swarm.net.envelope import Conn, Dropped, Verifier
from fedswarm.swarm.net.identity import Identity, x25519_public

__all__ = ["INITIATOR_HANDSHAKE_BYTES", "MAGIC", "PIPELINE_ENV", "PROTOCOL", "REKEY_BYTES", "REKEY_RECORDS",
           "NoiseConn", "initiate", "pipeline_default", "read_exact", "respond"]

PROTOCOL = b"Noise_XX_25519_AESGCM_SHA256"
PROLOGUE = b"fedswarm-swarm-noise-v1"
#: The first 4 bytes an initiator sends. Read as an envelope's header length it is ~4.1 GB,
#: over any header limit, so a responder tells a handshake from a connection without one.
MAGIC = b"\xf5NX1"
REKEY_BYTES = 1 << 30  # a direction's key encrypts at most 1 GiB ...
REKEY_RECORDS = 1 << 20  # ... or 2^20 records, then it is replaced
MAX_RECORD = 4 << 20  # plaintext bytes per record a sender writes (a body chunk is 1 MB)
_LEN = struct.Struct(">I")
_TAG = 16
_DH = 32
_ID = 32  # the payload of messages 2 and 3: the sender's Ed25519 public key (its peer id)
_MSG2 = _DH + (_DH + _TAG) + (_ID + _TAG)  # e, encrypted s, encrypted payload
_MSG3 = (_DH + _TAG) + (_ID + _TAG)  # encrypted s, encrypted payload
_REKEY_NONCE = b"\x00" * 4 + b"\xff" * 8
#: ``on`` or ``off`` (the default): whether a body's records are encrypted on a second thread
#: while the previous ones are written (:meth:`NoiseConn.send_frames`). Off by default: on the
#: 2-core machines it was measured on, the extra thread takes the receiver's core and the 40 MB
#: exchange got slower (``fedswarm bench swarm`` has both rows); with free cores on the sender's
#: host it should not, and that is for a larger machine to show.
PIPELINE_ENV = "FEDSWARM_NOISE_PIPELINE"


def pipeline_default() -> bool:
    """What :data:`PIPELINE_ENV` asks for (unset: off)."""
    value = os.environ.get(PIPELINE_ENV, "off").strip().lower()
    if value in ("1", "on", "true", "yes"):
        return True
    if value in ("0", "off", "false", "no", ""):
        return False
    raise ConfigError(f"{PIPELINE_ENV}={value!r}: expected on or off")


#: What an initiator sends before its first record (messages 1 and 3).
INITIATOR_HANDSHAKE_BYTES = len(MAGIC) + _DH + _MSG3


def _nonce(n: int) -> bytes:
    return b"\x00\x00\x00\x00" + n.to_bytes(8, "big")


def _hkdf2(ck: bytes, ikm: bytes) -> tuple[bytes, bytes]:
    """Noise's HKDF(ck, ikm) with two outputs: RFC 5869 HKDF-SHA256, salt ``ck``, no info."""
    out = HKDF(hashes.SHA256(), 64, salt=ck, info=b"").derive(ikm)
    return out[:32], out[32:]


def _raw(pub: X25519PublicKey) -> bytes:
    return pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


class _Handshake:
    """Noise's SymmetricState: the chaining key ``ck``, the transcript hash ``h`` and the
    handshake's current cipher key."""

    def __init__(self):
        self.h = PROTOCOL.ljust(32, b"\x00")
        self.ck = self.h
        self.k: AESGCM | None = None
        self.n = 0
        self.mix_hash(PROLOGUE)

    def mix_hash(self, data: bytes) -> None:
        self.h = hashlib.sha256(self.h + data).digest()

    def mix_key(self, dh: bytes) -> None:
        self.ck, k = _hkdf2(self.ck, dh)
        self.k, self.n = AESGCM(k), 0

    def encrypt_and_hash(self, plain: bytes) -> bytes:
        out = self.k.encrypt(_nonce(self.n), plain, self.h)
        self.n += 1
        self.mix_hash(out)
        return out

    def decrypt_and_hash(self, data: bytes, what: str) -> bytes:
        try:
            plain = self.k.decrypt(_nonce(self.n), data, self.h)
        except InvalidTag:
            raise Dropped("forged", f"handshake: {what} does not decrypt") from None
        self.n += 1
        self.mix_hash(data)
        return plain

    def split(self, initiator: bool) -> tuple[bytes, bytes]:
        """(key we send with, key we receive with)."""
        k1, k2 = _hkdf2(self.ck, b"")
        return (k1, k2) if initiator else (k2, k1)


class NoiseConn(Conn):
    """A connection after the handshake: the byte stream a :class:`Conn` carries, cut into
    AES-256-GCM records under the session keys. ``peer`` is the peer id the handshake proved;
    ``sent`` and ``received`` count the bytes on the socket (handshake and record overhead
    included); ``rekeys`` counts each direction's key replacements."""

    channel_tag = "noise"

    def __init__(self, sock, send_key: bytes, recv_key: bytes, peer: str, handshake_hash: bytes, *,
                 max_record_bytes: int, rekey_bytes: int = REKEY_BYTES, rekey_records: int = REKEY_RECORDS,
                 pipeline: bool = False):
        super().__init__(sock)
        self.pipeline = pipeline  # the Transport resolves FEDSWARM_NOISE_PIPELINE once
        self.peer = peer
        self.handshake_hash = handshake_hash  # channel binding: the same on both ends
        self.max_record_bytes = max_record_bytes
        self.rekey_bytes, self.rekey_records = rekey_bytes, rekey_records
        self._tx = [send_key, AESGCM(send_key), 0, 0, 0]  # key, cipher, nonce, bytes and records under key
        self._rx = [recv_key, AESGCM(recv_key), 0, 0, 0]
        self.rekeys = {"sent": 0, "received": 0}
        self._out = bytearray(0)
        self._in = bytearray(0)
        self._plain = bytearray(0)  # decrypted bytes not yet read
        self._ppos = 0
        self.handshake_s = 0.0

    def _advance(self, state: list, n: int, direction: str) -> None:
        state[2] += 1
        state[3] += n
        state[4] += 1
        if state[3] >= self.rekey_bytes or state[4] >= self.rekey_records:
            key = state[1].encrypt(_REKEY_NONCE, b"\x00" * 32, None)[:32]  # Noise REKEY(k)
            state[0], state[1], state[3], state[4] = key, AESGCM(key), 0, 0
            self.rekeys[direction] += 1

    def sendall(self, data) -> None:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), MAX_RECORD):
            self._send_records((view[start : start + MAX_RECORD],))

    def send_frame(self, head: bytes, piece) -> None:
        """``head`` and ``piece`` as two records (as :meth:`sendall` twice would), in one write."""
        if len(piece) > MAX_RECORD:
            self.sendall(head)
            self.sendall(piece)
        else:
            self._send_records((head, memoryview(piece).cast("B")))

    def send_frames(self, frames) -> None:
        """Each ``(head, piece)`` as :meth:`send_frame` would send it: the same records, in the
        same order, under the same nonces. With ``pipeline`` (and at least 3 frames) a second
        thread encrypts the next frame into one of two buffers while this one writes the other
        (AES-GCM and ``sendall`` both release the GIL): the sender's thread then pays only the
        writes. Only that thread touches the send key while it runs; an error on either side
        stops both and is raised here, after the thread has ended."""
        frames = list(frames)
        if not self.pipeline or len(frames) < 3 or any(len(p) > MAX_RECORD for _, p in frames):
            super().send_frames(frames)
            return
        size = max(_record_bytes((h, p)) for h, p in frames)
        bufs, lens = (bytearray(size), bytearray(size)), [0, 0]
        ready = (threading.Semaphore(0), threading.Semaphore(0))  # buffer b holds the next records to write
        free = (threading.Semaphore(1), threading.Semaphore(1))  # buffer b may be overwritten
        state: dict = {"stop": False, "error": None}

        def seal_ahead() -> None:
            try:
                for i, (head, piece) in enumerate(frames):
                    b = i % 2
                    free[b].acquire()
                    if state["stop"]:
                        return
                    lens[b] = self._seal((head, memoryview(piece).cast("B")), memoryview(bufs[b]))
                    ready[b].release()
            except BaseException as exc:  # handed to the writer, which raises it
                state["error"] = exc
                ready[0].release()
                ready[1].release()

        worker = threading.Thread(target=seal_ahead, name="noise-seal", daemon=True)
        worker.start()
        try:
            for i in range(len(frames)):
                b = i % 2
                ready[b].acquire()
                if state["error"] is not None:
                    raise state["error"]
                self.sock.sendall(memoryview(bufs[b])[: lens[b]])
                self.sent += lens[b]
                free[b].release()
        finally:
            state["stop"] = True
            free[0].release()
            free[1].release()
            worker.join()  # at most the frame it is sealing: it never waits on the socket

    def _send_records(self, pieces) -> None:
        """One record per non-empty piece (each <= MAX_RECORD), written to the socket at once."""
        size = _record_bytes(pieces)
        if len(self._out) < size:
            self._out = bytearray(size)
        pos = self._seal(pieces, memoryview(self._out))
        self.sock.sendall(memoryview(self._out)[:pos])  # length and ciphertext of every record together
        self.sent += pos

    def _seal(self, pieces, out: memoryview) -> int:
        """Encrypt one record per non-empty piece into ``out`` (length, then ciphertext and tag),
        advancing the send nonce; returns the bytes written."""
        pos = 0
        for piece in pieces:
            if not len(piece):
                continue  # a receiver refuses an empty record
            c = len(piece) + _TAG
            head = _LEN.pack(c)
            out[pos : pos + 4] = head
            self._tx[1].encrypt_into(_nonce(self._tx[2]), piece, head, out[pos + 4 : pos + 4 + c])
            self._advance(self._tx, len(piece), "sent")
            pos += 4 + c
        return pos

    def recv_exact_into(self, view: memoryview) -> None:
        got, n = 0, len(view)
        while got < n:
            left = len(self._plain) - self._ppos
            if left:
                take = min(left, n - got)
                view[got : got + take] = memoryview(self._plain)[self._ppos : self._ppos + take]
                self._ppos += take
                got += take
                continue
            got += self._read_record_into(view[got:])

    def _read_record_into(self, view: memoryview) -> int:
        """The next record: straight into ``view`` when it fits whole (a body chunk), else
        into the plaintext buffer (served by the caller's loop). Returns bytes put in view."""
        head = bytearray(4)
        Conn.recv_exact_into(self, memoryview(head))
        c = _LEN.unpack(head)[0]
        if c <= _TAG or c - _TAG > self.max_record_bytes:  # a sender never writes an empty record
            raise Dropped("oversized" if c > _TAG else "malformed", f"record of {c} bytes")
        n = c - _TAG
        if len(self._in) < c:
            self._in = bytearray(c)
        ct = memoryview(self._in)[:c]
        Conn.recv_exact_into(self, ct)
        direct = n <= len(view)
        if not direct:
            self._plain, self._ppos = bytearray(n), 0
        try:
            self._rx[1].decrypt_into(_nonce(self._rx[2]), ct, bytes(head),
                                     view[:n] if direct else memoryview(self._plain))
        except InvalidTag:
            raise Dropped("forged", f"record {self._rx[2]} from {self.peer[:8]} does not decrypt "
                                    "(altered, replayed, reordered or dropped)") from None
        self._advance(self._rx, n, "received")
        return n if direct else 0


def _record_bytes(pieces) -> int:
    """Bytes on the wire of one record per non-empty piece."""
    return sum(4 + len(p) + _TAG for p in pieces if len(p))


def read_exact(sock, n: int, what: str) -> bytes:
    """``n`` bytes from a socket; Dropped("closed") if it closes first."""
    try:
        return bytes(Conn(sock).recv_exact(n))
    except Dropped as exc:
        raise Dropped("closed", f"handshake: {what}: {exc.detail}") from None


def _identity(payload: bytes, static: bytes, who: str) -> str:
    """The peer id a handshake payload names, once the static key it proved is that id's."""
    peer = payload.hex()
    try:
        if _raw(x25519_public(peer)) == static:
            return peer
    except ValueError:
        pass
    raise Dropped("forged", f"handshake: {who} names identity {peer[:8]} but proved another key")


def _conn(sock, hs: _Handshake, initiator: bool, peer: str, v: Verifier, t0: float, wire: tuple[int, int],
          **kw) -> NoiseConn:
    tx, rx = hs.split(initiator)
    conn = NoiseConn(sock, tx, rx, peer, hs.h, max_record_bytes=max(v.max_header_bytes, v.max_chunk_bytes) + 4, **kw)
    conn.sent, conn.received = wire
    conn.handshake_s = time.perf_counter() - t0
    return conn


def _dh(priv: X25519PrivateKey, pub: bytes, who: str) -> bytes:
    try:
        return priv.exchange(X25519PublicKey.from_public_bytes(pub))
    except ValueError:  # a low-order point: the shared secret would be all zeros
        raise Dropped("forged", f"handshake: {who} sent an unusable key") from None


def initiate(sock, ident: Identity, v: Verifier, remote: str | None, **kw) -> NoiseConn:
    """Run the initiator's side on a connected socket. ``remote``: the peer id we meant to
    reach ("" or None: any admitted peer, e.g. when joining). Raises :class:`Dropped`
    (``identity_mismatch``, ``not_allowed``, ``forged``, ``closed``), before our identity is
    revealed, if the responder is not who it should be."""
    t0 = time.perf_counter()
    hs = _Handshake()
    e = X25519PrivateKey.generate()
    e_pub = _raw(e.public_key())
    hs.mix_hash(e_pub)
    hs.mix_hash(b"")  # message 1's empty payload (EncryptAndHash without a key)
    sock.sendall(MAGIC + e_pub)
    msg2 = read_exact(sock, _MSG2, "the responder's reply")
    re_pub = msg2[:_DH]
    hs.mix_hash(re_pub)
    hs.mix_key(_dh(e, re_pub, "the responder"))  # ee
    rs = hs.decrypt_and_hash(msg2[_DH : 2 * _DH + _TAG], "the responder's static key")
    hs.mix_key(_dh(e, rs, "the responder"))  # es
    peer = _identity(hs.decrypt_and_hash(msg2[2 * _DH + _TAG :], "the responder's identity"), rs, "the responder")
    if remote and peer != remote:
        raise Dropped("identity_mismatch", f"handshake: the responder is {peer[:8]}, not {remote[:8]}")
    if not v.admit(peer):
        raise Dropped("not_allowed", f"handshake: the responder's key {peer[:16]}… is not on the allow list")
    s = ident.x25519_private()
    msg3 = hs.encrypt_and_hash(_raw(s.public_key()))
    hs.mix_key(_dh(s, re_pub, "the responder"))  # se
    msg3 += hs.encrypt_and_hash(ident.public_bytes)
    sock.sendall(msg3)
    return _conn(sock, hs, True, peer, v, t0, (len(MAGIC) + _DH + len(msg3), _MSG2), **kw)


def respond(sock, ident: Identity, v: Verifier, **kw) -> NoiseConn:
    """Run the responder's side once :data:`MAGIC` was read from ``sock``. Raises
    :class:`Dropped` (``not_allowed``, ``forged``, ``closed``) unless the initiator proves
    an admitted identity."""
    t0 = time.perf_counter()
    hs = _Handshake()
    ie_pub = read_exact(sock, _DH, "the initiator's ephemeral key")
    hs.mix_hash(ie_pub)
    hs.mix_hash(b"")
    e = X25519PrivateKey.generate()
    e_pub = _raw(e.public_key())
    hs.mix_hash(e_pub)
    hs.mix_key(_dh(e, ie_pub, "the initiator"))  # ee
    s = ident.x25519_private()
    msg2 = e_pub + hs.encrypt_and_hash(_raw(s.public_key()))
    hs.mix_key(_dh(s, ie_pub, "the initiator"))  # es
    msg2 += hs.encrypt_and_hash(ident.public_bytes)
    sock.sendall(msg2)
    msg3 = read_exact(sock, _MSG3, "the initiator's identity")
    is_pub = hs.decrypt_and_hash(msg3[: _DH + _TAG], "the initiator's static key")
    hs.mix_key(_dh(e, is_pub, "the initiator"))  # se
    peer = _identity(hs.decrypt_and_hash(msg3[_DH + _TAG :], "the initiator's identity"), is_pub, "the initiator")
    if not v.admit(peer):
        raise Dropped("not_allowed", f"handshake: the initiator's key {peer[:16]}… is not on the allow list")
    return _conn(sock, hs, False, peer, v, t0, (len(msg2), len(MAGIC) + _DH + _MSG3), **kw)
