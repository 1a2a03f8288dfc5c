"""A Noise session's body records encrypted on a second thread while earlier ones are written
(``NoiseConn.send_frames`` with ``pipeline``): the wire must carry exactly the bytes the
sequential sender writes (same records, order, nonces and rekeys), a failure on either
thread must surface in the caller without a hang or a thread left behind, and
``FEDSWARM_NOISE_PIPELINE`` is read strictly."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from fedswarm.errors import ConfigError
from fedswarm.swarm.net import noise
from fedswarm.swarm.net.envelope import Verifier, recv_message, send_message
from fedswarm.swarm.net.payload import read_vector, vector_body

from tests.noise_helpers import A, B, Wire, records, transport

K1, K2 = os.urandom(32), os.urandom(32)


def _conn(pipeline: bool, sock=None, **kw) -> noise.NoiseConn:
    return noise.NoiseConn(sock if sock is not None else Wire(), K1, K2, B.peer_id, b"",
                           max_record_bytes=1 << 20, pipeline=pipeline, **kw)


def _seal_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "noise-seal"]


@pytest.mark.parametrize("chunk", [6, 4096, 30_001, 1 << 20])  # 13,334, 20, 3 and 1 frames
@pytest.mark.parametrize("rekey", [{}, {"rekey_records": 5}, {"rekey_bytes": 50_000}])
def test_pipelined_records_are_the_sequential_ones_and_decode(chunk, rekey):
    x = torch.randn(20_001)
    meta, body = vector_body(x)
    wires = {}
    for pipeline in (False, True):
        tx = _conn(pipeline, **rekey)
        tx.sendall(b"before")  # the session already carried something: nonces do not start at 0
        send_message(tx, A, "model", to=B.peer_id, meta=meta, body=body, chunk_bytes=chunk, nonce="ab" * 16,
                     ts=1.0, tls_bound=True)
        tx.sendall(b"after")  # and carries on under the same counters
        wires[pipeline] = (bytes(tx.sock.data), tx._tx[2], dict(tx.rekeys), tx.sent)
    assert wires[True] == wires[False]
    assert len(wires[True][0]) == wires[True][3]  # every byte written was counted, once
    rx = noise.NoiseConn(Wire(wires[True][0]), K2, K1, A.peer_id, b"", max_record_bytes=1 << 20, **rekey)
    assert bytes(rx.recv_exact(6)) == b"before"
    msg = recv_message(rx, Verifier(B, None, window_s=1e12), bound_peer=A.peer_id)
    assert torch.equal(read_vector(msg.meta, msg.body, x.numel(), finite=msg.finite), x)
    assert bytes(rx.recv_exact(5)) == b"after"


def test_too_few_frames_or_a_frame_over_a_record_are_sent_in_turn(monkeypatch):
    """Two frames, or a piece larger than one record, go the sequential way (no thread)."""
    started = []
    real = threading.Thread.start
    monkeypatch.setattr(threading.Thread, "start", lambda self: (started.append(self.name), real(self))[1])
    for frames in ([(b"h1", b"x" * 10), (b"h2", b"y" * 10)],
                   [(b"h", b"z" * 10)] * 3 + [(b"big", b"w" * (noise.MAX_RECORD + 1))]):
        seq, pipe = _conn(False), _conn(True)
        seq.send_frames(frames)
        pipe.send_frames(frames)
        assert bytes(pipe.sock.data) == bytes(seq.sock.data)
    assert "noise-seal" not in started


class _Breaks(Wire):
    """A socket that fails on its ``n``-th write."""

    def __init__(self, n: int):
        super().__init__()
        self.n = n

    def sendall(self, b) -> None:
        self.n -= 1
        if self.n == 0:
            raise ConnectionResetError("peer went away")
        super().sendall(b)


def test_a_failed_write_stops_the_sealing_thread_and_is_raised():
    frames = [(b"%04d" % i, os.urandom(50_000)) for i in range(40)]
    before = len(_seal_threads())
    tx = _conn(True, _Breaks(5))
    with pytest.raises(ConnectionResetError, match="peer went away"):
        tx.send_frames(frames)
    assert len(_seal_threads()) == before  # joined before send_frames returned
    assert tx.sent == len(tx.sock.data)  # four writes made it out, and only they are counted
    assert 5 * 2 <= tx._tx[2] <= 6 * 2  # two records a frame: those written, the one that failed, one more at most


def test_a_failure_while_sealing_is_raised_in_the_sender(monkeypatch):
    tx = _conn(True)
    real, calls = tx._seal, []

    def seal(pieces, out):
        calls.append(1)
        if len(calls) == 4:
            raise MemoryError("no room for the record")
        return real(pieces, out)

    monkeypatch.setattr(tx, "_seal", seal)
    before = len(_seal_threads())
    t0 = time.monotonic()
    with pytest.raises(MemoryError, match="no room"):
        tx.send_frames([(b"%04d" % i, os.urandom(10_000)) for i in range(20)])
    assert time.monotonic() - t0 < 30 and len(_seal_threads()) == before
    # whole frames only (two records each): 0-1, and 2 unless the failure was seen first
    assert len(tx.sock.data) == tx.sent and len(records(bytes(tx.sock.data))) in (4, 6)



def test_the_setting_is_read_strictly(monkeypatch):
    monkeypatch.delenv(noise.PIPELINE_ENV, raising=False)
    assert noise.pipeline_default() is False  # off unless asked for
    for value, want in (("on", True), ("1", True), ("OFF", False), ("0", False)):
        monkeypatch.setenv(noise.PIPELINE_ENV, value)
        assert noise.pipeline_default() is want
    monkeypatch.setenv(noise.PIPELINE_ENV, "sometimes")
    with pytest.raises(ConfigError, match="FEDSWARM_NOISE_PIPELINE='sometimes': expected on or off"):
        noise.pipeline_default()
    with pytest.raises(ConfigError, match="FEDSWARM_NOISE_PIPELINE"):
        transport(A)  # refused when the peer starts, not on its first connection


def test_two_transports_exchange_models_with_the_pipeline_on():
    got = []

    def handle(msg, s):  # one session, two models
        for _ in range(2):
            got.append(bytes(msg.body))
            s.send("ack", {}, bytes(msg.body)[::-1], re=msg.nonce)
            if len(got) < 2:
                msg = s.recv()

    server = transport(A, handle, noise_pipeline=True, chunk_bytes=65_536).start()
    client = transport(B, noise_pipeline=True, chunk_bytes=65_536)
    try:
        bodies = [os.urandom(1_000_003), os.urandom(200_000)]
        s = client.open_session(server.address, A.peer_id, "avg")
        for body in bodies:
            n = s.send("model", {}, body)
            assert bytes(s.recv(10, expect_re=n).body) == body[::-1]  # the answer was pipelined too
        s.close()
        assert got == bodies
    finally:
        server.stop()
        client.stop()
