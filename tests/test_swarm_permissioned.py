"""A permissioned swarm: peers join only with a certificate the swarm's CA issued for their
identity key (mutual TLS); a foreign-CA, revoked or mismatched peer is refused with a clear
reason in the refusing peer's log and report; replays and oversized frames are refused."""

from __future__ import annotations

import logging
import os
import socket
import ssl
import struct

import pytest
import torch
from fedswarm.certs import CertAuthority, init_pki, issue_peer, revoke
from fedswarm.swarm.net.envelope import header_frame, send_message
from fedswarm.swarm.net.identity import create_or_load
from fedswarm.swarm.net.transport import client_tls_context
from fedswarm.swarm.peer import Peer, PeerConfig

from tests.helpers import wait_until
from tests.swarm_helpers import Recorder, Replay, start_all, stop_all


def _peer(pki, name: str, tmp, *, join: str | None = None, ca=None, crl=True, **kw) -> Peer:
    cfg = PeerConfig(join=[join] if join else [], algorithm="dpsgd", task="synthetic-logreg", num_partitions=4,
                     partition_id=0, swarm_ca=str(ca or pki / "ca.pem"),
                     tls_cert=str(pki / "peers" / name / "cert.pem"),
                     keys=str(pki / "peers" / name / "keys"), tls_crl=str(pki / "crl.pem") if crl else None,
                     state_dir=str(tmp / f"state-{pki.name}-{name}"),
                     **{"min_peers": 1, "heartbeat_s": 0.1, "round_timeout_s": 5.0, "start_timeout_s": 3.0, **kw})
    return Peer(cfg)


@pytest.fixture
def pki(tmp_path):
    init_pki(tmp_path / "pki", hosts=[], peers=3)
    return tmp_path / "pki"


def _tls_client(pki, name):
    d = pki / "peers" / name
    return client_tls_context(str(pki / "ca.pem"), cert=str(d / "cert.pem"), key=str(d / "keys" / "private.pem"))


def _send_tls(ctx, addr: str, data: bytes, *, timeout: float = 10.0) -> bytes:
    """Send bytes over TLS with our certificate; return what the peer answered before closing."""
    host, port = addr.rsplit(":", 1)
    raw = socket.create_connection((host, int(port)), timeout=timeout)
    with ctx.wrap_socket(raw) as s:
        s.sendall(data)
        chunks = []
        while True:
            try:
                c = s.recv(65536)
            except (ConnectionResetError, ssl.SSLError):
                break
            if not c:
                break
            chunks.append(c)
    return b"".join(chunks)


def _counted(peer, reason: str, n: int) -> None:
    """Refusals are counted by the serving thread, possibly just after the connection closed."""
    wait_until(lambda: peer.verifier.drop_counts().get(reason, 0) >= n, 10, what=f"{n} {reason} counted")


def _craft(ident, kind, *, to, meta=None, body=b"", **kw) -> bytes:
    rec = Recorder()
    send_message(rec, ident, kind, to=to, meta=meta, body=body, **kw)
    return bytes(rec.data)


def test_ca_issued_peers_join_and_exchange_over_mutual_tls(pki, tmp_path):
    a = _peer(pki, "p0", tmp_path)
    b = _peer(pki, "p1", tmp_path, join=a.transport.address, min_peers=2)
    start_all([a, b])
    try:
        assert a.membership.count() == 2 and b.membership.count() == 2
        x = torch.randn(a.d)
        assert b.send_model([a.id], "model", 1, x)[a.id] is not None
        assert torch.equal(a.inbox.wait("model", 1, [b.id], 2.0)[b.id], x)
        # a client without a certificate gets no answer: the server requires one
        plain_tls = client_tls_context(str(pki / "ca.pem"))
        hello = _craft(b.ident, "gossip", to=a.id, meta={"members": []})
        try:
            reply = _send_tls(plain_tls, a.transport.address, hello)
        except OSError:  # ssl.SSLError included: TLS 1.3 reports the refusal on the first read or write
            reply = b""
        assert reply == b""
        _counted(a, "untrusted", 1)
    finally:
        stop_all([a, b])


def test_foreign_ca_peer_is_refused_with_a_reason(pki, tmp_path, caplog):
    init_pki(tmp_path / "foreign", hosts=[], peers=1)
    a = _peer(pki, "p0", tmp_path)
    start_all([a])
    try:
        # the intruder knows the swarm's CA certificate (it is public) but holds a certificate of its own CA
        intruder = _peer(tmp_path / "foreign", "p0", tmp_path, join=a.transport.address, ca=pki / "ca.pem",
                         crl=False)
        with caplog.at_level(logging.WARNING, logger="fedswarm.swarm"):
            with pytest.raises(RuntimeError, match="could not reach any join peer"):
                intruder.start()
        _counted(a, "untrusted", 1)
        refusal = a.transport.refusals[0]
        assert refusal["reason"] == "untrusted" and "certificate" in refusal["detail"]
        assert any(a.ident.short_id in r.message and "refused" in r.message and "certificate" in r.message
                   for r in caplog.records), [r.message for r in caplog.records]
        assert intruder.id not in a.membership.ids()
        # the other way round: our peer refuses to talk to a server whose certificate is foreign
        # (intruder.start() left its transport listening)
        with pytest.raises(Exception, match="certificate"):
            a.transport.request(intruder.transport.address, intruder.id, "gossip", {"members": []}, retries=0)
        stop_all([intruder])
    finally:
        stop_all([a])


def test_revoked_peer_is_refused_and_the_report_says_so(pki, tmp_path):
    revoke(pki, name="p2", reason="device stolen")
    a = _peer(pki, "p0", tmp_path)
    start_all([a])
    try:
        revoked = _peer(pki, "p2", tmp_path, join=a.transport.address, crl=False)
        with pytest.raises(RuntimeError, match="could not reach any join peer"):
            revoked.start()
        stop_all([revoked])
        _counted(a, "revoked", 1)
        assert revoked.id not in a.membership.ids()
        # an unrevoked peer of the same CA still joins
        ok = _peer(pki, "p1", tmp_path, join=a.transport.address)
        ok.start()
        stop_all([ok])
        assert ok.id in a.membership.ids()
    finally:
        summary = a.finish(0.0)
    assert summary["dropped"]["revoked"] >= 1
    assert any(r["reason"] == "revoked" and "revoked" in r["detail"] for r in summary["refused"])


def test_certificate_must_match_the_signing_key(pki, tmp_path):
    # a peer cannot start with another peer's certificate
    with pytest.raises(ValueError, match="not issued for this peer's key"):
        cfg = PeerConfig(swarm_ca=str(pki / "ca.pem"), tls_cert=str(pki / "peers" / "p1" / "cert.pem"),
                         keys=str(pki / "peers" / "p0" / "keys"), task="synthetic-logreg",
                         state_dir=str(tmp_path / "s"))
        Peer(cfg)
    # a message signed by p2 over the TLS connection of p1 is refused
    a = _peer(pki, "p0", tmp_path)
    start_all([a])
    try:
        p2 = create_or_load(pki / "peers" / "p2" / "keys")
        reply = _send_tls(_tls_client(pki, "p1"), a.transport.address,
                          _craft(p2, "gossip", to=a.id, meta={"members": []}))
        assert reply == b""
        _counted(a, "identity_mismatch", 1)
        assert a.verifier.drop_counts() == {"identity_mismatch": 1}
        assert p2.peer_id not in a.membership.ids()
    finally:
        stop_all([a])


def test_replayed_message_is_refused(pki, tmp_path):
    a = _peer(pki, "p0", tmp_path)
    start_all([a])
    try:
        p1 = create_or_load(pki / "peers" / "p1" / "keys")
        msg = _craft(p1, "gossip", to=a.id, meta={"members": []})
        ctx = _tls_client(pki, "p1")
        assert b"members" in _send_tls(ctx, a.transport.address, msg)  # answered once
        assert _send_tls(ctx, a.transport.address, msg) == b""  # the same bytes again: refused
        _counted(a, "replayed", 1)
        assert a.verifier.drop_counts() == {"replayed": 1}
    finally:
        stop_all([a])


def test_oversized_frames_are_refused_before_they_are_read(pki, tmp_path):
    a = _peer(pki, "p0", tmp_path, max_body_mb=1)
    start_all([a])
    try:
        p1 = create_or_load(pki / "peers" / "p1" / "keys")
        ctx = _tls_client(pki, "p1")
        # a signed header announcing a 1 TiB body, and nothing after it: had the peer
        # allocated or waited for the body, it would not close the connection at once
        hdr = header_frame(p1, "model", to=a.id, meta={"round": 1}, blen=1 << 40, nonce=os.urandom(16).hex())
        host, port = a.transport.address.rsplit(":", 1)
        with ctx.wrap_socket(socket.create_connection((host, int(port)), timeout=10)) as s:
            s.sendall(hdr)
            # closed by the peer while our side is still open; waiting for the body would
            # have taken its 30 s I/O timeout, past our 10 s socket timeout
            assert s.recv(1) == b""
        # a header frame over the header limit is refused from its length alone
        with ctx.wrap_socket(socket.create_connection((host, int(port)), timeout=10)) as s:
            s.sendall(struct.pack(">I", 64 << 20) + b"x" * 100)
            assert s.recv(1) == b""
        _counted(a, "oversized", 2)
        assert a.verifier.drop_counts() == {"oversized": 2}
    finally:
        stop_all([a])


def test_issue_for_existing_key_then_join(pki, tmp_path):
    """A device makes its key (`fedswarm keys`); the CA issues its certificate from the public key."""
    dev = create_or_load(pki / "peers" / "dev" / "keys")
    issue_peer(CertAuthority.load(pki), "dev", dev.peer_id)
    a = _peer(pki, "p0", tmp_path)
    start_all([a])
    try:
        d = _peer(pki, "dev", tmp_path, join=a.transport.address)
        d.start()
        stop_all([d])
        assert d.id in a.membership.ids()
    finally:
        stop_all([a])


# -- encrypted bodies (the default without TLS) ---------------------------------------------
def _frames(data: bytes) -> list[bytes]:
    out, pos = [], 0
    while pos < len(data):
        n = struct.unpack(">I", data[pos : pos + 4])[0]
        out.append(data[pos : pos + 4 + n])
        pos += 4 + n
    return out


def test_encrypted_body_round_trip_and_every_tampering_refused():
    from fedswarm.swarm.net.envelope import Dropped, Verifier, recv_message
    from fedswarm.swarm.net.identity import Identity

    a, b, eve = Identity.generate(), Identity.generate(), Identity.generate()
    body = os.urandom(10_000)
    pipe = Replay()
    send_message(pipe, b, "model", to=a.peer_id, meta={"round": 1}, body=body,
                 chunk_bytes=4096, encrypt=True)
    wire = bytes(pipe.data)
    assert body[:64] not in wire and body[5000:5064] not in wire  # the body is not on the wire in clear
    frames = _frames(wire)
    assert len(frames) == 1 + 3  # header + three encrypted chunks (4096, 4096, 1808), no trailer
    msg = recv_message(Replay(wire), Verifier(a, None))
    assert bytes(msg.body) == body
    # flipped byte, swapped chunks, dropped last chunk, wrong recipient: all refused
    flipped = bytearray(wire)
    flipped[len(frames[0]) + 100] ^= 1
    swapped = frames[0] + frames[2] + frames[1] + frames[3]
    truncated = b"".join(frames[:3])
    cases = {"forged": [bytes(flipped), swapped], "closed": [truncated]}
    for reason, datas in cases.items():
        for data in datas:
            with pytest.raises(Dropped) as exc:
                recv_message(Replay(data), Verifier(a, None))
            assert exc.value.reason == reason
    with pytest.raises(Dropped, match="forged|misdirected"):
        recv_message(Replay(wire), Verifier(eve, None))
    # a peer that requires encryption refuses a body in clear
    clear = Replay()
    send_message(clear, b, "model", to=a.peer_id, meta={"round": 1}, body=body)
    with pytest.raises(Dropped, match="not encrypted"):
        recv_message(Replay(bytes(clear.data)), Verifier(a, None, require_encryption=True))
