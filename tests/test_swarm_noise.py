"""Forward secrecy on the swarm's peer links: the Noise XX handshake, its session
keys, rekeying, and every altered, replayed, reordered or truncated frame refused.

The decryptor below re-derives the key schedule of ``docs/swarm-protocol.md`` on its own
(HMAC-SHA256 for HKDF, AES-256-GCM), independently of ``fedswarm.swarm.net.noise``.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import socket
import struct
import threading

import pytest
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from fedswarm.swarm.net import noise
from fedswarm.swarm.net.envelope import Dropped, Verifier, recv_message, send_message
from fedswarm.swarm.net.identity import Identity
from fedswarm.swarm.net.transport import Transport

from tests.helpers import wait_until

A, B, EVE = Identity.generate(), Identity.generate(), Identity.generate()
ALLOWED = {A.peer_id, B.peer_id}


def _transport(ident: Identity, handler=None, **kw) -> Transport:
    def echo(msg, s):
        s.send("ack", {"n": len(msg.body)}, bytes(msg.body)[::-1], re=msg.nonce)

    return Transport(ident, Verifier(ident, ALLOWED), handler or echo, encrypt=True, io_timeout_s=10, **kw)


class _Proxy:
    """A recording TCP proxy on loopback for one connection: what each side sent."""

    def __init__(self, upstream: str):
        self.upstream = upstream
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = "127.0.0.1:%d" % self.sock.getsockname()[1]
        self.c2s, self.s2c = bytearray(), bytearray()
        self.threads: list[threading.Thread] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        c, _ = self.sock.accept()
        host, port = self.upstream.rsplit(":", 1)
        s = socket.create_connection((host, int(port)))
        for src, dst, rec in ((c, s, self.c2s), (s, c, self.s2c)):
            t = threading.Thread(target=self._pump, args=(src, dst, rec), daemon=True)
            t.start()
            self.threads.append(t)

    @staticmethod
    def _pump(src, dst, rec) -> None:
        try:
            while data := src.recv(1 << 16):
                rec += data
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)
        except OSError:  # the other side hung up
            pass

    def wait(self) -> None:
        wait_until(lambda: len(self.threads) == 2, 10, what="proxied connection")
        for t in self.threads:
            t.join(10)
        self.sock.close()


# -- an independent decryptor that knows the protocol -----------------------------------------
def _hkdf(ck: bytes, ikm: bytes) -> tuple[bytes, bytes]:
    prk = hmac.new(ck, ikm, hashlib.sha256).digest()
    o1 = hmac.new(prk, b"\x01", hashlib.sha256).digest()
    return o1, hmac.new(prk, o1 + b"\x02", hashlib.sha256).digest()


def _n(i: int) -> bytes:
    return bytes(4) + i.to_bytes(8, "big")


def _records(data: bytes) -> list[tuple[bytes, bytes]]:
    out, pos = [], 0
    while pos < len(data):
        head = data[pos : pos + 4]
        c = struct.unpack(">I", head)[0]
        out.append((head, data[pos + 4 : pos + 4 + c]))
        pos += 4 + c
    return out


def _decrypt(c2s: bytes, s2c: bytes, ee: bytes, es: bytes, se: bytes) -> tuple[bytes, bytes]:
    """Both directions' plaintext of a recorded session, given its three DH results (raises
    InvalidTag for wrong ones)."""
    assert c2s[:4] == noise.MAGIC
    ie, re_ = c2s[4:36], s2c[:32]
    h = b"Noise_XX_25519_AESGCM_SHA256".ljust(32, b"\x00")
    ck = h
    for part in (b"fedswarm-swarm-noise-v1", ie, b"", re_):  # prologue, message 1 (e, empty payload), e
        h = hashlib.sha256(h + part).digest()
    ck, k = _hkdf(ck, ee)
    h = hashlib.sha256(h + s2c[32:80]).digest()  # the responder's encrypted static key
    ck, k = _hkdf(ck, es)
    h = hashlib.sha256(h + s2c[80:128]).digest()
    h = hashlib.sha256(h + c2s[36:84]).digest()  # the initiator's encrypted static key
    ck, k = _hkdf(ck, se)
    k1, k2 = _hkdf(ck, b"")
    plain = []
    for key, data in ((k1, c2s[132:]), (k2, s2c[128:])):
        aes = AESGCM(key)
        plain.append(b"".join(aes.decrypt(_n(i), ct, head) for i, (head, ct) in enumerate(_records(data))))
    return plain[0], plain[1]


def test_recorded_session_stays_secret_from_both_static_keys(monkeypatch):
    ephemeral: list[X25519PrivateKey] = []
    real = X25519PrivateKey

    class Recording:
        @staticmethod
        def generate():
            ephemeral.append(real.generate())
            return ephemeral[-1]

    monkeypatch.setattr(noise, "X25519PrivateKey", Recording)
    server, client = _transport(A).start(), _transport(B)
    proxy = _Proxy(server.address)
    body = os.urandom(50_000)
    try:
        reply = client.request(proxy.address, A.peer_id, "model", {"round": 1}, body, timeout=10)
        assert bytes(reply.body) == body[::-1]
        proxy.wait()
    finally:
        server.stop()
        client.stop()
    c2s, s2c = bytes(proxy.c2s), bytes(proxy.s2c)
    assert body[1000:1032] not in c2s and body[::-1][1000:1032] not in s2c
    ie, re_ = (X25519PublicKey.from_public_bytes(x) for x in (c2s[4:36], s2c[:32]))
    statics = [A.x25519_private(), B.x25519_private()]
    # everything the static keys give: every DH of a static private key with any public key
    # on the wire or in the allow list, tried as each of the three secrets
    publics = [ie, re_] + [k.public_key() for k in statics]
    secrets = {k.exchange(p) for k in statics for p in publics}
    es, se = A.x25519_private().exchange(ie), B.x25519_private().exchange(re_)  # computable
    for ee in secrets:
        with pytest.raises(InvalidTag):
            _decrypt(c2s, s2c, ee, es, se)
    # the control: the same decryptor with the ephemeral keys recovers both bodies
    assert len(ephemeral) == 2
    ee = ephemeral[0].exchange(re_)
    assert ee == ephemeral[1].exchange(ie)
    up, down = _decrypt(c2s, s2c, ee, es, se)
    assert body in up and body[::-1] in down


# -- a man in the middle without an allowed identity -------------------------------------------
def test_unlisted_identity_refused_both_ways_and_a_spoofed_one_too():
    a, eve = _transport(A).start(), Transport(EVE, Verifier(EVE, None), lambda m, s: s.send("ack", re=m.nonce),
                                             encrypt=True, io_timeout_s=10).start()
    b = _transport(B)
    try:
        # eve answers where b expects a: refused before b reveals its identity
        with pytest.raises(Dropped) as exc:
            b.request(eve.address, A.peer_id, "gossip", {})
        assert exc.value.reason == "identity_mismatch"
        with pytest.raises(Dropped) as exc:  # joining (any admitted peer): eve is not admitted
            b.request(eve.address, "", "join", {})
        assert exc.value.reason == "not_allowed"
        assert b.verifier.drop_counts() == {"identity_mismatch": 1, "not_allowed": 1}
        assert eve.stats.handshakes == 0  # eve never learnt who b is
        # eve connects to a: a refuses her identity
        with pytest.raises((Dropped, OSError)):
            eve.request(a.address, A.peer_id, "gossip", {})
        wait_until(lambda: a.verifier.drop_counts().get("not_allowed") == 1, 10, what="a refuses eve")
        # eve claims b's identity with her own key: the handshake proves another key
        spoof = Transport(Identity(EVE.private_key, B.public_bytes), Verifier(EVE, None), lambda m, s: None,
                          encrypt=True)
        try:
            with pytest.raises((Dropped, OSError)):
                spoof.request(a.address, A.peer_id, "gossip", {})
        finally:
            spoof.stop()
        wait_until(lambda: a.verifier.drop_counts().get("forged") == 1, 10, what="a refuses the spoof")
        fake_a = Transport(Identity(EVE.private_key, A.public_bytes), Verifier(EVE, None), lambda m, s: None,
                           encrypt=True).start()
        try:
            with pytest.raises(Dropped) as exc:
                b.request(fake_a.address, A.peer_id, "gossip", {})
            assert exc.value.reason == "forged"
        finally:
            fake_a.stop()
        assert [r["reason"] for r in a.refusals] == ["not_allowed", "forged"]
    finally:
        for t in (a, b, eve):
            t.stop()


# -- rekeying --------------------------------------------------------------------------------
class _Wire:
    """A socket stand-in: what is sent is kept; reads replay ``data``."""

    def __init__(self, data: bytes = b""):
        self.data, self.pos = bytearray(data), 0

    def sendall(self, b) -> None:
        self.data += bytes(b)

    def recv_into(self, view, n) -> int:
        n = min(n, len(self.data) - self.pos)
        view[:n] = self.data[self.pos : self.pos + n]
        self.pos += n
        return n

    def settimeout(self, t) -> None:
        pass


K1, K2 = os.urandom(32), os.urandom(32)


def _pair(wire_in: bytes = b"", **kw) -> tuple[noise.NoiseConn, noise.NoiseConn]:
    tx = noise.NoiseConn(_Wire(), K1, K2, A.peer_id, b"", max_record_bytes=1 << 20, **kw)
    rx = noise.NoiseConn(_Wire(wire_in), K2, K1, B.peer_id, b"", max_record_bytes=1 << 20, **kw)
    return tx, rx


def test_rekey_at_the_byte_and_record_bounds_and_data_keeps_flowing():
    records = [os.urandom(1000) for _ in range(10)]
    for kw, expect in (({"rekey_bytes": 4000}, 2), ({"rekey_bytes": 1 << 30, "rekey_records": 3}, 3)):
        tx, _ = _pair(**kw)
        keys = []
        for r in records:
            tx.sendall(r)
            keys.append(tx._tx[0])
        assert tx.rekeys["sent"] == expect
        every = 4 if "rekey_records" not in kw else 3  # the key changes right after each bound
        assert [keys[i] != keys[i - 1] for i in range(1, 10)] == [(i + 1) % every == 0 for i in range(1, 10)]
        _, rx = _pair(bytes(tx.sock.data), **kw)
        assert [bytes(rx.recv_exact(1000)) for _ in records] == records and rx.rekeys["received"] == expect
        # a receiver that does not rekey reads up to the bound, and not one record further
        _, stale = _pair(bytes(tx.sock.data), rekey_bytes=1 << 30)
        for _ in range(every):
            stale.recv_exact(1000)
        with pytest.raises(Dropped, match="does not decrypt"):
            stale.recv_exact(1000)


def test_rekeying_session_between_transports():
    got = []

    def handle(msg, s):
        got.append(bytes(msg.body))
        s.send("ack", {}, bytes(msg.body), re=msg.nonce)
        msg2 = s.recv()
        got.append(bytes(msg2.body))
        s.send("ack", {"rekeys": s.conn.rekeys}, re=msg2.nonce)

    server = _transport(A, handle, rekey_bytes=100_000, chunk_bytes=16_384).start()
    client = _transport(B, rekey_bytes=100_000, chunk_bytes=16_384)
    try:
        s = client.open_session(server.address, A.peer_id, "avg")
        bodies = [os.urandom(500_000), os.urandom(300_000)]
        n = s.send("model", {}, bodies[0])
        assert bytes(s.recv(10, expect_re=n).body) == bodies[0]
        n = s.send("model", {}, bodies[1])
        reply = s.recv(10, expect_re=n)
        # a key encrypts at least 100 kB and at most 100 kB + one record (16 kB + 4 bytes)
        up, down = s.conn.rekeys["sent"], s.conn.rekeys["received"]
        assert 800_000 // (100_000 + 16_388) <= up <= s.conn.sent // 100_000
        assert up == reply.meta["rekeys"]["received"]  # both ends of the direction agree
        # the server counted its rekeys before its last ack, which may have crossed one more bound
        assert 500_000 // (100_000 + 16_388) <= reply.meta["rekeys"]["sent"] <= down <= reply.meta["rekeys"]["sent"] + 1
        s.close()
        assert got == bodies
    finally:
        server.stop()
        client.stop()


# -- altered, replayed, reordered, truncated frames ----------------------------------------------
def test_body_records_altered_replayed_reordered_or_truncated_are_refused():
    body = os.urandom(40_000)
    tx, _ = _pair()
    send_message(tx, A, "model", to=B.peer_id, body=body, chunk_bytes=10_000, tls_bound=True)
    recs = [h + c for h, c in _records(bytes(tx.sock.data))]
    assert len(recs) == 1 + 2 * 4  # the header frame, then each chunk's length and chunk
    _, rx = _pair(b"".join(recs))
    assert bytes(recv_message(rx, Verifier(B, None), bound_peer=A.peer_id).body) == body
    flipped = bytearray(recs[4])
    flipped[-20] ^= 1
    cases = {"altered": recs[:4] + [bytes(flipped)] + recs[5:], "reordered": recs[:3] + [recs[4], recs[3]] + recs[5:],
             "replayed": recs[:5] + [recs[4]] + recs[5:], "dropped": recs[:3] + recs[5:],
             "truncated": recs[:-1], "cut in a record": recs[:-1] + [recs[-1][:100]]}
    for name, frames in cases.items():
        v = Verifier(B, None)
        with pytest.raises(Dropped) as exc:
            recv_message(_pair(b"".join(frames))[1], v, bound_peer=A.peer_id)
        want = "closed" if name.startswith(("truncated", "cut")) else "forged"
        assert exc.value.reason == want, name
        assert v.drop_counts() == {want: 1}, name
    # a channel-tagged body is accepted only over the Noise session bound to its sender
    for bound in (None, EVE.peer_id):
        with pytest.raises(Dropped) as exc:
            recv_message(_pair(b"".join(recs))[1], Verifier(B, None), bound_peer=bound)
        assert exc.value.reason == ("malformed" if bound is None else "identity_mismatch")


class _Tamper:
    """Wraps a socket; ``sendall`` passes its data through ``mutate`` first."""

    def __init__(self, sock, mutate):
        self.sock, self.mutate = sock, mutate

    def sendall(self, data) -> None:
        self.sock.sendall(self.mutate(bytes(data)))

    def __getattr__(self, name):
        return getattr(self.sock, name)


def _flip(i: int):
    def f(data: bytes) -> bytes:
        out = bytearray(data)
        out[i] ^= 1
        return bytes(out)
    return f


def _handshake(mutate_i=None, mutate_r=None) -> tuple[BaseException | None, BaseException | None]:
    """Both sides of one handshake over a socket pair; what each raised (None: succeeded)."""
    si, sr = socket.socketpair()
    for s in (si, sr):
        s.settimeout(5)
    out: list = [None, None]

    def responder():
        try:
            assert noise.read_exact(sr, 4, "magic") == noise.MAGIC
            noise.respond(_Tamper(sr, mutate_r or (lambda d: d)), A, Verifier(A, ALLOWED))
        except Exception as exc:  # noqa: BLE001 -- reported to the test
            out[1] = exc
            sr.close()

    t = threading.Thread(target=responder)
    t.start()
    try:
        noise.initiate(_Tamper(si, mutate_i or (lambda d: d)), B, Verifier(B, ALLOWED), A.peer_id)
    except Exception as exc:  # noqa: BLE001
        out[0] = exc
    with contextlib.suppress(OSError):  # the responder reads to the end of what was sent, then ends
        si.shutdown(socket.SHUT_WR)
    t.join(10)
    si.close()
    sr.close()
    return out[0], out[1]


def test_handshake_frames_altered_truncated_or_replayed_are_refused():
    assert _handshake() == (None, None)
    reasons = lambda r: tuple(getattr(x, "reason", None) for x in r)  # noqa: E731
    assert reasons(_handshake(mutate_r=_flip(40)))[0] == "forged"  # the responder's encrypted static key
    assert reasons(_handshake(mutate_r=_flip(100)))[0] == "forged"  # its identity payload
    assert reasons(_handshake(mutate_r=_flip(5)))[0] == "forged"  # its ephemeral key (the transcript)
    assert reasons(_handshake(mutate_i=lambda d: d if d[:4] == noise.MAGIC else _flip(60)(d)))[1] == "forged"
    assert reasons(_handshake(mutate_i=lambda d: d if d[:4] == noise.MAGIC else d[:50]))[1] == "closed"
    low_order = noise.MAGIC + bytes(32)  # an ephemeral key of small order: no shared secret
    assert reasons(_handshake(mutate_i=lambda d: low_order if d[:4] == noise.MAGIC else d))[1] == "forged"


def test_replayed_connection_refused_by_a_live_peer():
    server, client = _transport(A).start(), _transport(B)
    proxy = _Proxy(server.address)
    try:
        client.request(proxy.address, A.peer_id, "model", {}, os.urandom(1000), timeout=10)
        proxy.wait()
        host, port = server.address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as s:
            try:
                s.sendall(bytes(proxy.c2s))  # the whole recorded connection, again
                s.shutdown(socket.SHUT_WR)
                while s.recv(1 << 16):
                    pass
            except OSError:  # refused and reset before all of it was sent
                pass
        wait_until(lambda: server.verifier.drop_counts() == {"forged": 1}, 10, what="replay refused")
        assert server.refusals[-1]["reason"] == "forged" and "handshake" in server.refusals[-1]["detail"]
    finally:
        server.stop()
        client.stop()


# -- interoperability with another Noise implementation ------------------------------------------
def _raw_private(ident: Identity) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return ident.x25519_private().private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                                serialization.NoEncryption())


def _reference(ident: Identity, initiator: bool):
    conn = pytest.importorskip("noise.connection")  # noiseprotocol, a dev dependency
    n = conn.NoiseConnection.from_name(b"Noise_XX_25519_AESGCM_SHA256")
    n.set_as_initiator() if initiator else n.set_as_responder()
    n.set_prologue(b"fedswarm-swarm-noise-v1")
    n.set_keypair_from_private_bytes(conn.Keypair.STATIC, _raw_private(ident))
    n.start_handshake()
    return n


def test_handshake_and_records_interoperate_with_the_noiseprotocol_package():
    # our initiator, their responder; our records (rekeyed every 2) decrypted by their cipher state
    ref = _reference(A, initiator=False)
    x, y = socket.socketpair()
    seen = {}

    def responder():
        m1 = noise.read_exact(x, 36, "message 1")
        assert m1[:4] == noise.MAGIC
        ref.read_message(m1[4:])
        x.sendall(ref.write_message(A.public_bytes))
        seen["payload"] = ref.read_message(noise.read_exact(x, 96, "message 3"))

    t = threading.Thread(target=responder)
    t.start()
    ours = noise.initiate(y, B, Verifier(B, ALLOWED), A.peer_id, rekey_records=2)
    t.join(10)
    assert seen["payload"] == B.public_bytes and ref.handshake_finished
    assert ref.get_handshake_hash() == ours.handshake_hash
    ours.sock = _Wire()
    msgs = [os.urandom(100 + i) for i in range(5)]
    for m in msgs:
        ours.sendall(m)
    theirs = ref.noise_protocol.cipher_state_decrypt
    for i, (head, ct) in enumerate(_records(bytes(ours.sock.data))):
        assert theirs.decrypt_with_ad(head, ct) == msgs[i]
        if i % 2 == 1:
            theirs.rekey()
    # their initiator, our responder; their record read by ours
    ref = _reference(B, initiator=True)
    x, y = socket.socketpair()
    got = {}

    def our_responder():
        assert noise.read_exact(x, 4, "magic") == noise.MAGIC
        got["conn"] = noise.respond(x, A, Verifier(A, ALLOWED))

    t = threading.Thread(target=our_responder)
    t.start()
    y.sendall(noise.MAGIC + ref.write_message())
    assert ref.read_message(noise.read_exact(y, 128, "message 2")) == A.public_bytes
    y.sendall(ref.write_message(B.public_bytes))
    t.join(10)
    assert got["conn"].peer == B.peer_id and got["conn"].handshake_hash == ref.get_handshake_hash()
    head = struct.pack(">I", 16 + 11)
    y.sendall(head + ref.noise_protocol.cipher_state_encrypt.encrypt_with_ad(head, b"hello, swarm"[:11]))
    assert bytes(got["conn"].recv_exact(11)) == b"hello, swarm"[:11]
    for s in (x, y):
        s.close()


def test_a_responder_accepts_the_handshake_and_the_legacy_static_key_mode():
    server = _transport(A).start()
    noise_client, legacy = _transport(B), _transport(B, static_keys=True)
    try:
        for client, handshakes in ((noise_client, 1), (legacy, 1)):  # the legacy request adds none
            body = os.urandom(20_000)
            assert bytes(client.request(server.address, A.peer_id, "model", {}, body, timeout=10).body) == body[::-1]
            assert server.stats.handshakes == handshakes
        assert noise_client.stats.handshakes == 1 and legacy.stats.handshakes == 0
        assert server.verifier.drop_counts() == {}
    finally:
        for t in (server, noise_client, legacy):
            t.stop()


def test_legacy_static_keys_needs_encryption():
    from fedswarm.swarm.peer import PeerConfig

    PeerConfig(insecure_allow_any=True, legacy_static_keys=True).check()
    with pytest.raises(ValueError, match="cannot go with --no-encrypt"):
        PeerConfig(insecure_allow_any=True, encrypt=False, legacy_static_keys=True).check()


# -- the Ed25519 -> X25519 map (libsodium through PyNaCl) ------------------------------------------
def _fixed(seed: bytes) -> Identity:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    key = Ed25519PrivateKey.from_private_bytes(seed)
    return Identity(key, key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw))


def test_x25519_keys_match_the_known_answers():
    """Vectors written down from the former field-arithmetic conversion (u = (1 + y)/(1 − y)
    mod 2^255 − 19, scalar = SHA-512(seed)[:32]) before it was replaced: PyNaCl gives the same."""
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    from fedswarm.swarm.net.identity import x25519_public

    def raw(pub: X25519PublicKey) -> str:
        return pub.public_bytes(Encoding.Raw, PublicFormat.Raw).hex()

    a, b = _fixed(bytes(range(32))), _fixed(bytes(range(100, 132)))
    assert a.peer_id == "03a107bff3ce10be1d70dd18e74bc09967e4d6309ba50d5f1ddc8664125531b8"
    assert raw(x25519_public(a.peer_id)) == "4701d08488451f545a409fb58ae3e58581ca40ac3f7f114698cd71deac73ca01"
    assert raw(x25519_public(b.peer_id)) == "5bccd484527714f28eb6b6fa9e43feabae73eab192aef1e7d59d2111343d7b70"
    assert raw(a.x25519_private().public_key()) == raw(x25519_public(a.peer_id))
    secret = "b56138ad241960171c76273df6634f09ce469acc28bc81439b5c8c231819ff5a"
    assert a.shared_secret(b.peer_id).hex() == secret and b.shared_secret(a.peer_id).hex() == secret


@pytest.mark.parametrize("peer_id,match", [
    ("01" + "00" * 31, "not a usable curve point"),         # y = 1: the neutral point, u would divide by 0
    ("ed" + "ff" * 30 + "7f", "not a usable curve point"),  # y = p: not a field element
    ("00" * 31, "not a usable curve point"),                # 31 bytes
    ("zz" * 32, "not a peer id"),
])
def test_unusable_public_keys_are_refused(peer_id, match):
    from fedswarm.swarm.net.identity import x25519_public

    with pytest.raises(ValueError, match=match):
        x25519_public(peer_id)
