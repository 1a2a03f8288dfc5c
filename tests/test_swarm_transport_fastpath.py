"""The swarm's exchange fast path: received bodies reused only once nobody refers to them,
and each body chunk written with its length in one system call, the bytes on the wire unchanged."""

from __future__ import annotations

import os
import socket
import threading

import torch
from fedswarm.swarm.net import envelope, noise
from fedswarm.swarm.net.envelope import BodyPool, Conn, Verifier, header_frame, recv_message, send_message
from fedswarm.swarm.net.identity import Identity
from fedswarm.swarm.net.payload import read_vector, vector_body

from tests.swarm_helpers import Recorder, Replay

A, B = Identity.generate(), Identity.generate()
D = 1_500_000  # 6 MB bodies: over envelope.POOL_MIN_BYTES


def _exchange(x: torch.Tensor):
    """``x`` sent by A and received (verified) by B."""
    rec = Recorder()
    meta, body = vector_body(x)
    send_message(rec, A, "model", to=B.peer_id, meta=meta, body=body)
    return recv_message(Replay(bytes(rec.data)), Verifier(B, None))


def test_a_body_still_referenced_is_never_reused_and_a_released_one_is(monkeypatch):
    pool = BodyPool()
    monkeypatch.setattr(envelope, "BODY_POOL", pool)
    xs = [torch.randn(D) for _ in range(3)]
    m1 = _exchange(xs[0])
    first = id(m1.body)
    t1 = read_vector(m1.meta, m1.body, D)  # shares m1's buffer
    del m1
    m2 = _exchange(xs[1])
    assert pool.reused == 0 and torch.equal(t1, xs[0])  # the tensor still holds its buffer: not overwritten
    assert torch.equal(read_vector(m2.meta, m2.body, D), xs[1])
    del t1
    m3 = _exchange(xs[2])
    assert pool.reused == 1 and id(m3.body) == first  # nothing referred to it any more
    assert torch.equal(read_vector(m3.meta, m3.body, D), xs[2])
    assert torch.equal(read_vector(m2.meta, m2.body, D), xs[1])


def test_the_pool_keeps_at_most_max_bytes_alive():
    pool = BodyPool(max_bytes=13 << 20)
    n = 6 << 20
    held = [pool.take(n) for _ in range(3)]  # the oldest of the three is let go
    ids = [id(b) for b in held]
    del held
    again = [pool.take(n) for _ in range(3)]
    assert pool.reused == 2 and {id(b) for b in again[:2]} == set(ids[1:])
    assert len(pool.take(4 << 10)) == 4 << 10 and pool.reused == 2  # small bodies bypass the pool


class _Writes:
    """A socket stand-in that keeps what is written and counts the writes."""

    def __init__(self):
        self.data, self.writes = bytearray(), 0

    def sendall(self, b) -> None:
        self.data += bytes(b)
        self.writes += 1


class _Wire:
    """A socket stand-in whose reads replay ``data``."""

    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def recv_into(self, view, n) -> int:
        n = min(n, len(self.data) - self.pos)
        view[:n] = self.data[self.pos : self.pos + n]
        self.pos += n
        return n


def test_noise_body_chunks_go_in_one_write_each_as_the_same_records():
    k1, k2, body, nonce = os.urandom(32), os.urandom(32), os.urandom(50_000), "ab" * 16

    def conn(sock, tx=k1, rx=k2):
        return noise.NoiseConn(sock, tx, rx, A.peer_id, b"", max_record_bytes=1 << 20)

    fast = conn(_Writes())
    send_message(fast, A, "model", to=B.peer_id, body=body, chunk_bytes=10_000, nonce=nonce, ts=1.0, tls_bound=True)
    assert fast.sock.writes == 1 + 5  # the header, then one write per chunk
    slow = conn(_Writes())  # the same keys, each length and chunk written on its own: the same records
    slow.sendall(header_frame(A, "model", to=B.peer_id, blen=len(body), nonce=nonce, ts=1.0, tls_tag="noise"))
    for start in range(0, len(body), 10_000):
        slow.sendall((10_000).to_bytes(4, "big"))
        slow.sendall(body[start : start + 10_000])
    assert fast.sock.data == slow.sock.data and fast.sent == len(fast.sock.data)
    rx = conn(_Wire(bytes(fast.sock.data)), k2, k1)
    msg = recv_message(rx, Verifier(B, None, window_s=1e12), bound_peer=A.peer_id)
    assert bytes(msg.body) == body


def test_plain_chunk_and_length_survive_partial_writes():
    a, b = socket.socketpair()
    try:
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # sendmsg returns after part of it
        for s in (a, b):
            s.settimeout(10)
        head, piece = b"\x00\x20\x00\x00", os.urandom(2 << 20)
        got = bytearray()

        def read():
            while len(got) < len(head) + len(piece):
                chunk = b.recv(1 << 16)
                if not chunk:
                    return
                got.extend(chunk)

        reader = threading.Thread(target=read)
        reader.start()
        conn = Conn(a)
        conn.send_frame(head, memoryview(piece))
        reader.join(10)
        assert not reader.is_alive()
        assert bytes(got) == head + piece and conn.sent == len(head) + len(piece)
    finally:
        a.close()
        b.close()
