"""A float32 body is scanned for non-finite values chunk by chunk as it arrives (on every
way a body travels), and a peer's ``read_vector`` takes that verdict for the buffer it
scanned: the verdict must equal an independent look at the values, wherever the bad value
sits relative to the chunks, and chunks need not hold whole values."""

from __future__ import annotations

import os
import random

import pytest
import torch
from fedswarm.swarm.net import noise
from fedswarm.swarm.net.bodies import FiniteScan
from fedswarm.swarm.net.envelope import Dropped, Verifier, recv_message, send_message
from fedswarm.swarm.net.identity import Identity
from fedswarm.swarm.net.payload import read_vector, vector_body

from tests.noise_helpers import Wire
from tests.swarm_helpers import Recorder, Replay

A, B = Identity.generate(), Identity.generate()
D = 20_000
BAD = (float("nan"), float("inf"), float("-inf"))


def _send_and_receive(path: str, x: torch.Tensor, chunk: int, meta: dict | None = None):
    """``x`` sent by A to B along ``path`` in chunks of ``chunk`` bytes; B's verified message."""
    vmeta, body = vector_body(x)
    meta = vmeta if meta is None else meta
    v = Verifier(B, None, window_s=1e12)
    if path == "noise":
        k1, k2 = os.urandom(32), os.urandom(32)
        tx = noise.NoiseConn(Wire(), k1, k2, B.peer_id, b"", max_record_bytes=1 << 20)
        send_message(tx, A, "model", to=B.peer_id, meta=meta, body=body, chunk_bytes=chunk, tls_bound=True)
        rx = noise.NoiseConn(Wire(tx.sock.data), k2, k1, A.peer_id, b"", max_record_bytes=1 << 20)
        return recv_message(rx, v, bound_peer=A.peer_id)
    rec = Recorder()
    send_message(rec, A, "model", to=B.peer_id, meta=meta, body=body, chunk_bytes=chunk,
                 encrypt=path == "static", tls_bound=path == "tls")
    return recv_message(Replay(bytes(rec.data)), v, bound_peer=A.peer_id if path == "tls" else None)


@pytest.mark.parametrize("path", ["plain", "static", "tls", "noise"])
@pytest.mark.parametrize("chunk", [6, 10_002, 1 << 20])  # 6 and 10,002 bytes split values across chunks
def test_the_scan_on_arrival_agrees_with_the_values_wherever_the_bad_one_sits(path, chunk):
    rng = random.Random(f"{path}-{chunk}")
    # no bad value; the first; the last; one straddling a chunk boundary; one at random
    where = [None, 0, D - 1, (chunk * 3 // 4 + 1) // 4 % D, rng.randrange(D)]
    for i, pos in enumerate(where):
        x = torch.randn(D)
        if pos is not None:
            x[pos] = BAD[i % 3]
        msg = _send_and_receive(path, x, chunk)
        oracle = bool(torch.isfinite(x).all())
        assert msg.finite is oracle, (path, chunk, pos)
        if oracle:
            assert torch.equal(read_vector(msg.meta, msg.body, D, finite=msg.finite), x)
        else:
            with pytest.raises(Dropped, match="non-finite") as exc:
                read_vector(msg.meta, msg.body, D, finite=msg.finite)
            assert exc.value.reason == "invalid_payload"


def test_only_a_body_declared_float32_with_whole_values_is_scanned():
    x = torch.randn(64)
    assert _send_and_receive("plain", x, 100, meta={"dtype": "int32", "d": 64}).finite is None
    assert _send_and_receive("plain", x, 100, meta={}).finite is None
    rec = Recorder()  # 255 bytes: not a whole number of float32 values, and read_vector refuses the length
    send_message(rec, A, "model", to=B.peer_id, meta={"dtype": "float32", "d": 63}, body=os.urandom(255))
    msg = recv_message(Replay(bytes(rec.data)), Verifier(B, None))
    assert msg.finite is None
    with pytest.raises(Dropped, match="values"):
        read_vector(msg.meta, msg.body, 63, finite=msg.finite)


def test_the_scan_covers_every_value_once_whatever_the_cut_points():
    rng = random.Random(7)
    for trial in range(200):
        n = rng.randrange(1, 400)
        x = torch.randn(n)
        if trial % 2:
            x[rng.randrange(n)] = BAD[trial % 3]
        raw = bytearray(x.numpy().tobytes())
        scan = FiniteScan(raw)
        cuts = sorted(rng.randrange(len(raw) + 1) for _ in range(rng.randrange(0, 12)))
        for c in cuts + [len(raw)]:  # chunk ends as a receiver reports them, repeats included
            scan.upto(c)
        assert scan.done == len(raw)
        assert scan.finite is bool(torch.isfinite(x).all()), (trial, cuts)
