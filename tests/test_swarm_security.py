"""Swarm identity and transport security: keys, allow lists, and every kind of bad message
refused, counted by reason, and never touching the model."""

from __future__ import annotations

import os
import stat
import struct
import time

import pytest
import torch
from fedswarm.swarm.net.envelope import Dropped, Verifier, send_message
from fedswarm.swarm.net.identity import (
    Identity,
    create_or_load,
    load_allow_list,
    parse_public_key,
)
from fedswarm.swarm.net.payload import read_payload, read_vector, vector_body

from tests.helpers import wait_until
from tests.swarm_helpers import (
    Recorder,
    make_peers,
    self_signed,
    send_raw,
    start_all,
    stop_all,
)


def test_keys_created_once_private_mode_600_and_allow_list(tmp_path):
    a = create_or_load(tmp_path / "k")
    assert stat.S_IMODE(os.stat(tmp_path / "k" / "private.pem").st_mode) == 0o600
    assert create_or_load(tmp_path / "k").peer_id == a.peer_id  # loaded, not regenerated
    assert (tmp_path / "k" / "public.txt").read_text().strip() == a.peer_id
    b = Identity.generate()
    allow = tmp_path / "allow.txt"
    allow.write_text(f"# the swarm\n{a.peer_id}  # alice\n\n   {b.public_b64}\n")
    assert load_allow_list(allow) == {a.peer_id, b.peer_id}
    allow.write_text(f"{a.peer_id}\nnot-a-key\n")
    with pytest.raises(ValueError, match=":2:"):
        load_allow_list(allow)
    with pytest.raises(ValueError):
        parse_public_key("00" * 31)
    os.chmod(tmp_path / "k" / "private.pem", 0o644)
    with pytest.raises(PermissionError):
        create_or_load(tmp_path / "k")


def test_keys_command_prints_public_key(tmp_path):
    from fedswarm.swarm.cli import app
    from typer.testing import CliRunner

    res = CliRunner().invoke(app, ["keys", "--dir", str(tmp_path / "k")])
    assert res.exit_code == 0, res.output
    assert res.output.split()[0] == create_or_load(tmp_path / "k").peer_id


def _craft(ident, kind, *, to, meta=None, body=b"", **kw) -> bytes:
    rec = Recorder()
    send_message(rec, ident, kind, to=to, meta=meta, body=body, **kw)
    return bytes(rec.data)


def test_bad_messages_are_refused_counted_and_leave_the_model_untouched(tmp_path):
    a, b = make_peers(tmp_path, 2, algorithm="adpsgd", max_body_mb=1)
    start_all([a, b])
    try:
        x_before = a.driver.model().clone()
        evil = Identity.generate()
        impostor = Identity(evil.private_key, b.ident.public_bytes)  # claims b's id, signs with its own key
        meta, body = vector_body(torch.full((a.d,), 5.0))
        gossip = {"members": []}
        # a well-formed message works, once
        good = _craft(b.ident, "gossip", to=a.id, meta=gossip)
        assert send_raw(a.transport.address, good)  # answered
        assert send_raw(a.transport.address, good) == b""  # replayed
        cases = {
            "forged": [_craft(impostor, "avg_req", to=a.id, meta=meta, body=body)],
            "not_allowed": [_craft(evil, "avg_req", to=a.id, meta=meta, body=body)],
            "expired": [_craft(b.ident, "avg_req", to=a.id, meta=meta, body=body, ts=time.time() - 3600)],
            "misdirected": [_craft(b.ident, "avg_req", to=b.id, meta=meta, body=body)],
            "oversized": [struct.pack(">I", 8 << 20) + b"x" * 100,  # header over the limit
                          _craft(b.ident, "avg_req", to=a.id, meta=meta, body=b"\0" * (2 << 20))],
            "malformed": [struct.pack(">I", 10) + b"0123456789", struct.pack(">I", 80) + b"{" * 80],
            "invalid_payload": [
                _craft(b.ident, "avg_req", to=a.id, meta=meta, body=vector_body(torch.full((a.d,), float("nan")))[1]),
                _craft(b.ident, "avg_req", to=a.id, meta={"dtype": "float32", "d": a.d + 1},
                       body=torch.zeros(a.d + 1).numpy().tobytes()),
                _craft(b.ident, "avg_req", to=a.id, meta={"dtype": "float64", "d": a.d},
                       body=torch.zeros(a.d, dtype=torch.float64).numpy().tobytes()),
            ],
        }
        tampered = bytearray(_craft(b.ident, "avg_req", to=a.id, meta=meta, body=body))
        tampered[-(16 + 4) - 3] ^= 0xFF  # a byte of the body: its Poly1305 tag no longer matches
        cases["forged"].append(bytes(tampered))
        for reason, messages in cases.items():
            for m in messages:
                reply = send_raw(a.transport.address, m)
                assert b"avg_acc" not in reply, reason
        expected = {reason: len(ms) for reason, ms in cases.items()}
        expected["replayed"] = 1
        # a refusal is counted by the serving thread, possibly just after the reply was sent
        wait_until(lambda: sum(a.verifier.drop_counts().values()) >= sum(expected.values()), 10,
                   what="every refused message counted")
        assert a.verifier.drop_counts() == expected
        assert torch.equal(a.driver.model(), x_before)  # no bad message touched the model
        assert a.driver.counts["served"] == 0
        assert evil.peer_id not in a.membership.ids()
    finally:
        stop_all([a, b])


def test_ed25519_keys_map_to_a_shared_x25519_secret():
    a, b, c = Identity.generate(), Identity.generate(), Identity.generate()
    assert a.shared_secret(b.peer_id) == b.shared_secret(a.peer_id)
    assert a.shared_secret(b.peer_id) != a.shared_secret(c.peer_id)


def test_payload_readers_refuse_bad_models():
    meta, body = vector_body(torch.arange(4.0))
    assert torch.equal(read_vector(meta, bytearray(body), 4), torch.arange(4.0))
    with pytest.raises(Dropped, match="expected 5"):
        read_vector(meta, bytearray(body), 5)
    with pytest.raises(Dropped, match="non-finite"):
        m2, b2 = vector_body(torch.tensor([1.0, float("inf")]))
        read_vector(m2, bytearray(b2), 2)
    with pytest.raises(Dropped, match="does not fit"):
        read_payload({"arrays": {"v": {"dtype": "float32", "shape": [8], "offset": 0, "nbytes": 32}},
                      "codec_meta": {}}, bytearray(16))


def test_verifier_replay_cache_is_bounded():
    v = Verifier(Identity.generate(), None, window_s=1.0, max_nonces=10)
    now = time.time()
    for k in range(50):
        v.check_nonce("p", f"{k:032x}", now)
    assert len(v._seen) <= 11
    with pytest.raises(Dropped):
        v.check_nonce("p", f"{49:032x}", now)


def test_tls_peers_talk_and_plain_clients_get_nothing(tmp_path):
    cert, key = self_signed(tmp_path)
    peers = make_peers(tmp_path, 2, algorithm="dpsgd", tls_cert=str(cert), tls_key=str(key), tls_ca=str(cert))
    start_all(peers)  # the join is a signed exchange over TLS
    try:
        assert peers[0].membership.count() == 2 and peers[1].membership.count() == 2
        x = torch.randn(peers[0].d)
        acks = peers[1].send_model([peers[0].id], "model", 1, x)
        assert acks[peers[0].id] is not None
        assert torch.equal(peers[0].inbox.wait("model", 1, [peers[1].id], 1.0)[peers[1].id], x)
        plain = _craft(peers[1].ident, "gossip", to=peers[0].id, meta={"members": []})
        assert send_raw(peers[0].transport.address, plain) == b""  # not TLS: no answer
    finally:
        stop_all(peers)
