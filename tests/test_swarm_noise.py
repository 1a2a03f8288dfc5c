"""Forward secrecy on the swarm's peer links: the Noise XX handshake, its session
keys, rekeying, and every altered, replayed, reordered or truncated frame refused.

The decryptor below re-derives the key schedule of ``docs/swarm-protocol.md`` on its own
(HMAC-SHA256 for HKDF, AES-256-GCM), independently of ``fedswarm.swarm.net.noise``.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
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
from tests.noise_helpers import EVE, A, B, Wire, handshake, records, transport

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
        plain.append(b"".join(aes.decrypt(_n(i), ct, head) for i, (head, ct) in enumerate(records(data))))
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
    server, client = transport(A).start(), transport(B)
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
    a, eve = transport(A).start(), Transport(EVE, Verifier(EVE, None), lambda m, s: s.send("ack", re=m.nonce),
                                             encrypt=True, io_timeout_s=10).start()
    b = transport(B)
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
K1, K2 = os.urandom(32), os.urandom(32)


def _pair(wire_in: bytes = b"", **kw) -> tuple[noise.NoiseConn, noise.NoiseConn]:
    tx = noise.NoiseConn(Wire(), K1, K2, A.peer_id, b"", max_record_bytes=1 << 20, **kw)
    rx = noise.NoiseConn(Wire(wire_in), K2, K1, B.peer_id, b"", max_record_bytes=1 << 20, **kw)
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

    server = transport(A, handle, rekey_bytes=100_000, chunk_bytes=16_384).start()
    client = transport(B, rekey_bytes=100_000, chunk_bytes=16_384)
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
    recs = [h + c for h, c in records(bytes(tx.sock.data))]
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


def _flip(i: int):
    def f(data: bytes) -> bytes:
        out = bytearray(data)
        out[i] ^= 1
        return bytes(out)
    return f


def test_handshake_frames_altered_truncated_or_replayed_are_refused():
    assert handshake() == (None, None)
    reasons = lambda r: tuple(getattr(x, "reason", None) for x in r)  # noqa: E731
    assert reasons(handshake(mutate_r=_flip(40)))[0] == "forged"  # the responder's encrypted static key
    assert reasons(handshake(mutate_r=_flip(100)))[0] == "forged"  # its identity payload
    assert reasons(handshake(mutate_r=_flip(5)))[0] == "forged"  # its ephemeral key (the transcript)
    assert reasons(handshake(mutate_i=lambda d: d if d[:4] == noise.MAGIC else _flip(60)(d)))[1] == "forged"
    assert reasons(handshake(mutate_i=lambda d: d if d[:4] == noise.MAGIC else d[:50]))[1] == "closed"
    low_order = noise.MAGIC + bytes(32)  # an ephemeral key of small order: no shared secret
    assert reasons(handshake(mutate_i=lambda d: low_order if d[:4] == noise.MAGIC else d))[1] == "forged"


def test_replayed_connection_refused_by_a_live_peer():
    server, client = transport(A).start(), transport(B)
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
