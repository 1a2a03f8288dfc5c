"""Faults survived, with real sockets and real processes.

- Network: a fault-injecting proxy (tests/faultproxy.py) between two peers delays, drops or
  cuts their messages; no request outlives its timeout and no half-received model reaches
  the inbox (a model is stored only after its whole body arrived and was authenticated).
- Processes: in tests/test_swarm_kill.py (its own file, so that pytest-xdist's
  ``--dist loadfile`` can run it beside these).

Run 10 times in a row: ``python -m pytest -q -x tests/test_swarm_faults.py tests/test_swarm_kill.py --count 10``.
"""

from __future__ import annotations

import struct
import threading
import time

import pytest
import torch
from fedswarm.swarm.net.envelope import Dropped, send_message

from tests.faultproxy import FaultProxy
from tests.swarm_helpers import make_peers, start_all, stop_all

TIMEOUT_S = 1.0
# a hung request would wait for the socket's 30 s I/O timeout (or forever); the slack is for a loaded machine
HANG_S = TIMEOUT_S + 8.0


def _via(peer, target, proxy: FaultProxy) -> None:
    """Route ``peer``'s messages to ``target`` through ``proxy`` (gossip cannot undo it)."""
    orig = peer.membership.addr_of
    peer.membership.addr_of = lambda pid: proxy.address if pid == target.id else orig(pid)


@pytest.fixture
def pair(tmp_path):
    a, b = make_peers(tmp_path, 2, algorithm="dpsgd", round_timeout_s=TIMEOUT_S, heartbeat_s=0.1)
    start_all([a, b])
    try:
        yield a, b
    finally:
        stop_all([a, b])


def _request(b, a, addr: str, x: torch.Tensor):
    from fedswarm.swarm.net.payload import vector_body

    meta, body = vector_body(x)
    return b.transport.request(addr, a.id, "model", {**meta, "round": 1}, body, timeout=TIMEOUT_S, retries=0)


@pytest.mark.parametrize("mode", ["drop", "delay"])
def test_a_black_hole_or_a_slow_link_costs_one_timeout(pair, mode):
    a, b = pair
    target = tuple(a.transport.address.rsplit(":", 1))
    with FaultProxy((target[0], int(target[1])), mode=mode, delay_s=3 * TIMEOUT_S) as proxy:
        t0 = time.monotonic()
        with pytest.raises((Dropped, OSError)):
            _request(b, a, proxy.address, torch.randn(a.d))
        waited = time.monotonic() - t0
        assert waited < HANG_S, f"the request hung {waited:.1f} s past its {TIMEOUT_S} s timeout"
        assert proxy.stats == {mode: 1}
    if mode == "delay":  # the slow message may still arrive whole: it is then a complete, verified model
        got = a.inbox.wait("model", 1, [b.id], 5 * TIMEOUT_S)
        assert set(got) <= {b.id}
    else:
        assert a.inbox.rounds_of("model") == []


def _cut_points(a, b, x) -> dict[str, int]:
    """Byte offsets, from the start of the connection, inside one model message sent over a
    Noise session (the default link): its header's length, header, body and last record's tag."""
    from fedswarm.swarm.net.noise import INITIATOR_HANDSHAKE_BYTES, NoiseConn
    from fedswarm.swarm.net.payload import vector_body

    from tests.swarm_helpers import Recorder

    rec = Recorder()
    meta, body = vector_body(x)
    conn = NoiseConn(rec, bytes(32), bytes(32), a.id, b"", max_record_bytes=1 << 30)  # record sizes only
    send_message(conn, b.ident, "model", to=a.id, meta={**meta, "round": 1}, body=body, tls_bound=True)
    hs, header = INITIATOR_HANDSHAKE_BYTES, struct.unpack(">I", rec.data[:4])[0] + 4
    # "tag": the middle of the last record's 16-byte GCM tag, so that the header of the message
    # actually sent may be a few bytes shorter (its timestamp's digits) and still be cut
    return {"length": hs + 6, "header": hs + header // 2, "body": hs + len(rec.data) // 2,
            "tag": hs + len(rec.data) - 8}


@pytest.mark.parametrize("where", ["length", "header", "body", "tag"])
def test_a_connection_cut_mid_message_never_delivers_half_a_model(pair, where):
    a, b = pair
    host, port = a.transport.address.rsplit(":", 1)
    x = torch.randn(a.d)
    cut_after = _cut_points(a, b, x)[where]
    with FaultProxy((host, int(port)), mode="cut", cut_after=cut_after) as proxy:
        t0 = time.monotonic()
        with pytest.raises((Dropped, OSError)):
            _request(b, a, proxy.address, x)
        assert time.monotonic() - t0 < HANG_S
        # the receiving side saw a closed connection (or a truncated header), stored nothing
        from tests.helpers import wait_until

        wait_until(lambda: sum(a.verifier.drop_counts().values()) >= 1, 40, what="the cut counted")
        assert set(a.verifier.drop_counts()) <= {"closed", "malformed"}
        assert a.inbox.rounds_of("model") == []
        proxy.mode = "pass"  # the link heals: the next message arrives whole
        ack = _request(b, a, proxy.address, x)
        assert ack.kind == "ack"
    assert torch.equal(a.inbox.wait("model", 1, [b.id], 2.0)[b.id], x)


def test_peers_train_through_a_cutting_proxy_without_hanging(tmp_path):
    """Three peers on a ring, every message from p1 to p0 cut mid-body: all finish every
    round, p0 mixes only with p2 (the cut model is never applied), no round hangs."""
    peers = make_peers(tmp_path, 3, algorithm="dpsgd", round_timeout_s=TIMEOUT_S, rounds=4, linger_s=0.5)
    p0, p1, _ = peers
    host, port = p0.transport.address.rsplit(":", 1)
    cut = _cut_points(p0, p1, torch.zeros(p0.d))["body"]  # gossip (no body) passes, models are cut
    with FaultProxy((host, int(port)), mode="cut", cut_after=cut) as proxy:
        _via(p1, p0, proxy)
        out: list = [None] * 3
        threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, peers[i].run())) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        for p in peers:
            p.stop.set()
        assert all(o is not None for o in out), "a peer hung"
        assert proxy.stats.get("cut", 0) >= 4
    rows0 = out[0]["rows"]
    # a peer that lags may skip rounds its neighbours already finished (the swarm's catch-up), never the last
    rounds0 = [r["round"] for r in rows0]
    assert len(rounds0) >= 2 and rounds0 == sorted(set(rounds0)) and rounds0[-1] == 4, rounds0
    assert all(o["rounds_done"] == 4 for o in out), [o["rounds_done"] for o in out]
    # p1's models never arrive whole, so never count as answers (p2's may time out on a loaded machine)
    assert all(r["neighbours"] == 2 and r["answered"] <= 1 for r in rows0), rows0
    assert out[0]["dropped"].get("closed", 0) + out[0]["dropped"].get("malformed", 0) >= 4
    assert all(r["wall_s"] < 2 * HANG_S for o in out for r in o["rows"])  # push, then wait: two timeouts
