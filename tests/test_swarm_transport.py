"""The swarm transport's fast path in a permissioned swarm: TLS's AEAD instead of a per-body tag.

Over a mutual-TLS connection whose certificates are bound to both peers' signing keys, a
body carries no Poly1305 tag of its own (TLS's AEAD authenticates it); only such a
connection may carry one, and a header signed by anyone but the certificate's peer is
refused before its body is read. A later connection to the same peer resumes its TLS 1.3
session (no certificate signatures) and still proves the peer's certificate.
"""

from __future__ import annotations

import json
import os
import struct

import pytest
from fedswarm.certs import init_pki
from fedswarm.swarm.net.envelope import Dropped, Verifier, recv_message, send_message
from fedswarm.swarm.net.identity import create_or_load
from fedswarm.swarm.net.transport import Transport, permissioned_tls

from tests.swarm_helpers import Recorder, Replay


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki") / "pki"
    init_pki(root, hosts=[], peers=3)
    return root


def _frames(data: bytes) -> list[bytes]:
    out, pos = [], 0
    while pos < len(data):
        n = struct.unpack(">I", data[pos : pos + 4])[0]
        out.append(data[pos + 4 : pos + 4 + n])
        pos += 4 + n
    return out


def _transport(pki, name: str, handler) -> Transport:
    d = pki / "peers" / name
    ident = create_or_load(d / "keys")
    others = {create_or_load(pki / "peers" / p / "keys").peer_id for p in ("p0", "p1", "p2")}
    tls_s, tls_c = permissioned_tls(str(pki / "ca.pem"), str(d / "cert.pem"), str(d / "keys" / "private.pem"),
                                    ident.peer_id, str(pki / "crl.pem"))
    return Transport(ident, Verifier(ident, others), handler, tls_server=tls_s, tls_client=tls_c,
                     bind_identity=True, chunk_bytes=1 << 16)


def test_tls_tagged_body_needs_a_connection_bound_to_its_sender(pki):
    a, b = (create_or_load(pki / "peers" / p / "keys") for p in ("p0", "p1"))
    eve = create_or_load(pki / "peers" / "p2" / "keys")
    body = os.urandom(100_000)
    rec = Recorder()
    send_message(rec, b, "model", to=a.peer_id, meta={"round": 1}, body=body, chunk_bytes=40_000, tls_bound=True)
    wire = bytes(rec.data)
    frames = _frames(wire)
    header = json.loads(frames[0][:-64])
    assert header["tag"] == "tls" and header["blen"] == len(body)
    assert [len(f) for f in frames[1:]] == [40_000, 40_000, 20_000]  # the body's chunks, no trailer tag
    assert b"".join(frames[1:]) == body
    # over a connection bound to the sender's certificate: accepted, intact
    msg = recv_message(Replay(wire), Verifier(a, None), bound_peer=b.peer_id)
    assert bytes(msg.body) == body and msg.sender == b.peer_id
    # over a connection not bound to a certificate: no tag means no proof, refused
    v = Verifier(a, None)
    with pytest.raises(Dropped, match="not bound") as exc:
        recv_message(Replay(wire), v, bound_peer=None)
    assert exc.value.reason == "malformed" and v.drop_counts() == {"malformed": 1}
    # over the connection of another peer (eve's certificate): refused after the header,
    # before a byte of the body is read
    v, pipe = Verifier(a, None), Replay(wire)
    with pytest.raises(Dropped) as exc:
        recv_message(pipe, v, bound_peer=eve.peer_id)
    assert exc.value.reason == "identity_mismatch" and v.drop_counts() == {"identity_mismatch": 1}
    assert pipe.pos == 4 + len(frames[0])
    # a tagged (Poly1305) body is still accepted on a bound connection, and a tampered one refused
    rec = Recorder()
    send_message(rec, b, "model", to=a.peer_id, body=body, chunk_bytes=40_000)
    assert len(_frames(bytes(rec.data))) == 1 + 3 + 1
    assert bytes(recv_message(Replay(bytes(rec.data)), Verifier(a, None), bound_peer=b.peer_id).body) == body
    tampered = bytearray(rec.data)
    tampered[-100] ^= 1
    with pytest.raises(Dropped, match="forged"):
        recv_message(Replay(bytes(tampered)), Verifier(a, None), bound_peer=b.peer_id)


def test_bound_tls_exchange_resumes_and_still_proves_the_certificate(pki, monkeypatch):
    def no_tag(*a, **k):
        raise AssertionError("a body tag was made over an identity-bound TLS connection")

    monkeypatch.setattr("fedswarm.swarm.net.envelope._body_mac", no_tag)  # neither side may need one
    seen = []

    def handle(msg, s):
        seen.append({"body": bytes(msg.body), "cert_id": s.cert_id, "reused": s.conn.sock.session_reused})
        s.send("ack", {"n": len(msg.body)}, re=msg.nonce)

    server = _transport(pki, "p1", handle).start()
    client = _transport(pki, "p0", lambda m, s: None)
    try:
        bodies = [os.urandom(300_000 + i) for i in range(3)]
        for body in bodies:
            reply = client.request(server.address, server.ident.peer_id, "model", {"round": 1}, body, timeout=10)
            assert reply.meta == {"n": len(body)} and reply.sender == server.ident.peer_id
        assert [s["body"] for s in seen] == bodies
        assert all(s["cert_id"] == client.ident.peer_id for s in seen)  # proved on every connection
        assert [s["reused"] for s in seen] == [False, True, True]  # full handshake once, then resumed
        assert server.verifier.drop_counts() == {} and client.verifier.drop_counts() == {}
    finally:
        server.stop()
        client.stop()
