"""Fuzz targets of the swarm wire: the envelope and frame reader, and the model payloads.

``envelope``: a byte stream read by :func:`~fedswarm.swarm.net.envelope.recv_message` from an
in-memory socket, up to four messages. Inputs start from valid streams (a sender on the allow
list, clear, AES-GCM or TLS-bound bodies, several chunk sizes) and then change a header field
*before* signing (an authenticated but misbehaving peer), sign a header that is not JSON at
all, or edit the frames (awkward length fields, frames dropped, duplicated, swapped, cut).
The first input byte picks the receiver's policy: bit 0 requires encryption, bit 1 binds the
connection to the sender's certificate, bit 2 admits any key. Refusals: ``Dropped`` (any reason).
The handshake above this layer is not involved: the stream is what a connected socket delivers.

``swarm_payload``: ``meta`` JSON, a newline and the body, read as a driver does
(``read_payload`` or ``read_vector``, then the algorithm's ``read_payload``: squarm with a codec,
or a dense gossip algorithm). Refusals: ``Dropped("invalid_payload")`` and ``PayloadError``.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import strategies as st

from fedswarm.algorithms.decentralized import make_algorithm
from fedswarm.params import ParamLayout
from fedswarm.payload import PayloadError
from fedswarm.swarm.net import envelope
from fedswarm.swarm.net.envelope import TAG_BYTES, Conn, Dropped, Verifier, recv_message, send_message
from fedswarm.swarm.net.identity import Identity, _raw_public
from fedswarm.swarm.net.payload import payload_body, read_payload, read_vector, vector_body
from tests.fuzzing import Target
from tests.fuzzing.mutate import (awkward_ints, deep_json, dumps_loose, json_values, mutate_bytes, mutate_dict,
                                  mutate_frames, random_batch)

__all__ = ["TARGETS"]

_LEN = struct.Struct(">I")


def _identity(n: int) -> Identity:
    key = Ed25519PrivateKey.from_private_bytes(bytes([n]) * 32)
    return Identity(key, _raw_public(key.public_key()))


SENDER, RECEIVER, STRANGER = _identity(1), _identity(2), _identity(3)
TS = 1_800_000_000.0  # a fixed timestamp, inside the harness's (huge) window forever: replays stay valid
LIMITS = {"max_header_bytes": 1 << 14, "max_body_bytes": 1 << 12, "max_chunk_bytes": 256}
_HEADER_FIELDS = ["v", "from", "to", "ts", "nonce", "kind", "re", "meta", "blen", "enc", "tag"]


class _Capture:
    """A socket that keeps what is sent (wrapped in a real ``Conn``, as the transport does)."""

    def __init__(self):
        self.data = bytearray()

    def sendall(self, b) -> None:
        self.data += bytes(b)


class _Stream:
    """An in-memory socket: ``recv_into`` hands out the input bytes, then EOF; it records the
    largest read asked for (every read goes into a buffer at least that large)."""

    def __init__(self, data: bytes):
        self.data, self.pos, self.largest = data, 0, 0

    def recv_into(self, view, n: int = 0) -> int:
        n = n or len(view)
        self.largest = max(self.largest, n)
        got = self.data[self.pos:self.pos + n]
        view[:len(got)] = got
        self.pos += len(got)
        return len(got)


def _split(stream: bytes) -> list[bytes]:
    frames, pos = [], 0
    while pos + 4 <= len(stream):
        n = _LEN.unpack_from(stream, pos)[0]
        frames.append(stream[pos:pos + 4 + n])
        pos += 4 + n
    return frames


def _signed(signer: Identity, text: bytes) -> bytes:
    return _LEN.pack(len(text) + 64) + text + signer.sign(envelope._HEADER_DOMAIN + text)


_HEADER_VALUES = st.one_of(json_values, st.sampled_from(
    [SENDER.peer_id, RECEIVER.peer_id, "", "aes256gcm", "tls", "zz" * 32, " " * 64, "0" * 32]))
_HEADER_TEXTS = st.one_of(st.binary(max_size=64), st.integers(1, 6000).map(lambda n: deep_json(n).encode()),
                          st.sampled_from([b"null", b"[]", b"{}", b'{"v":1}', b"\xff\xfe", b"NaN"]))


@st.composite
def _message(draw) -> list[bytes]:
    signer = draw(st.sampled_from([SENDER, SENDER, SENDER, STRANGER]))
    to = draw(st.sampled_from([RECEIVER.peer_id] * 4 + ["", STRANGER.peer_id]))
    meta = draw(st.sampled_from([{}, {"round": 3}, {"dtype": "float32", "d": 4}]))
    body = draw(st.binary(max_size=300)) if to else b""
    if body and meta.get("dtype") == "float32" and draw(st.booleans()):  # whole values, NaN and inf among them
        body = np.array(draw(st.lists(st.floats(width=32), min_size=1, max_size=75)), dtype="<f4").tobytes()
    mode = draw(st.sampled_from(["clear", "enc", "tls"]))
    nonce = draw(st.binary(min_size=16, max_size=16)).hex()
    kind = draw(st.sampled_from(["model", "join", "probe", "push"]))
    re = draw(st.sampled_from([None, None, "ab" * 16]))
    cap = _Capture()
    send_message(Conn(cap), signer, kind, to=to, meta=meta, body=body, re=re, ts=TS, nonce=nonce,
                 chunk_bytes=draw(st.sampled_from([16, 64, 256, 1000])), encrypt=mode == "enc",
                 tls_bound=mode == "tls")
    frames = _split(bytes(cap.data))
    how = draw(st.sampled_from(["valid", "valid", "field", "field", "field", "text"]))
    if how == "field":  # an allowed peer signs a header with odd fields: only the checks after the signature stop it
        h = {"v": 1, "from": signer.peer_id, "to": to, "ts": TS, "nonce": nonce, "kind": kind, "re": re,
             "meta": meta, "blen": len(body)}
        h = draw(mutate_dict(h, _HEADER_FIELDS, _HEADER_VALUES))
        frames[0] = _signed(signer, dumps_loose(h))
    elif how == "text":  # a signed header that is not a v1 envelope at all
        frames[0] = _signed(signer, draw(_HEADER_TEXTS))
    return frames


@st.composite
def envelope_inputs(draw) -> bytes:
    policy = draw(st.integers(0, 7))
    frames: list[bytes] = []
    for _ in range(draw(st.integers(1, 3))):
        frames += draw(_message())
    if draw(st.booleans()):
        frames = draw(mutate_frames(frames))
    return bytes([policy]) + b"".join(frames)


def run_envelope(data: bytes) -> str:
    policy, stream = (data[0], data[1:]) if data else (0, b"")
    v = Verifier(RECEIVER, None if policy & 4 else {SENDER.peer_id}, window_s=1e12, require_encryption=bool(policy & 1),
                 **LIMITS)
    sock = _Stream(stream)
    conn = Conn(sock)
    bound = SENDER.peer_id if policy & 2 else None
    first = None
    for _ in range(4):
        try:
            msg = recv_message(conn, v, bound_peer=bound)
        except Dropped as exc:
            assert v.dropped[exc.reason] >= 1, "a refusal was not counted"
            first = first or f"refused:{exc.reason}"
            break
        assert v.admit(msg.sender), "a message from a key off the allow list was accepted"
        assert bound is None or msg.sender == bound
        assert msg.to in (RECEIVER.peer_id, ""), "a misdirected message was accepted"
        assert len(msg.body) <= LIMITS["max_body_bytes"] and isinstance(msg.meta, dict)
        if msg.finite is not None:  # the scan on arrival agrees with a look at the whole body's values
            assert msg.meta.get("dtype") == "float32" and len(msg.body) % 4 == 0, "a body scanned that is no float32"
            values = np.frombuffer(bytes(msg.body), dtype="<f4")
            assert msg.finite == bool(np.isfinite(values).all()), "the scan on arrival missed or invented a bad value"
        first = first or "accepted"
    limit = max(LIMITS["max_header_bytes"], LIMITS["max_body_bytes"], LIMITS["max_chunk_bytes"] + TAG_BYTES)
    assert sock.largest <= limit, f"a read of {sock.largest} bytes, past every limit ({limit})"
    return first or "accepted"


# -- payloads -----------------------------------------------------------------------------
D = 24
#: squarm's codecs (its own choices, with the ratio it passes to topk and randk)
_CODECS = ["topk", "randk", "qsgd", "onebit", "sign", "fp16", "none"]
_ALGOS = {name: make_algorithm("squarm", codec=name, ratio=0.25) for name in _CODECS}
_DENSE = make_algorithm("dpsgd")
_LAYOUT = ParamLayout.from_shapes([("x", (D,))])


_ENTRY_VALUES = st.one_of(json_values, st.lists(awkward_ints, max_size=4))


@st.composite
def payload_inputs(draw) -> bytes:
    x = draw(random_batch(1, D))
    kind = draw(st.sampled_from(["vector", *_CODECS, "skip"]))
    if kind == "vector":
        meta, body = vector_body(x[0])
        body = bytes(body)
    elif kind == "skip":
        meta, body = {"arrays": {}, "codec_meta": {"kind": "skip"}}, b""
    else:
        algo = _ALGOS[kind]
        meta, body = payload_body(algo.codec.encode(x, _LAYOUT, seed=draw(st.integers(0, 3))))
    how = draw(st.sampled_from(["valid", "meta", "entry", "codec_meta", "body", "nan"]))
    if how == "meta":
        meta = draw(mutate_dict(meta, ["dtype", "d", "arrays", "codec_meta"]))
    elif how == "entry" and meta.get("arrays"):
        name = draw(st.sampled_from(sorted(meta["arrays"])))
        meta["arrays"][name] = draw(mutate_dict(meta["arrays"][name], ["dtype", "shape", "offset", "nbytes"],
                                                _ENTRY_VALUES))
    elif how == "codec_meta" and "codec_meta" in meta:
        meta["codec_meta"] = draw(mutate_dict(meta["codec_meta"]))
    elif how == "body":
        body = draw(mutate_bytes(body))
    elif how == "nan" and len(body) >= 4:
        pos = draw(st.integers(0, len(body) // 4 - 1)) * 4
        bad = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
        body = body[:pos] + np.float32(bad).tobytes() + body[pos + 4:]
    algo = draw(st.sampled_from(["dense", *_CODECS]))
    return algo.encode() + b"\n" + dumps_loose(meta) + b"\n" + body


def run_payload(data: bytes) -> str:
    algo_name, _, rest = data.partition(b"\n")
    line, _, body = rest.partition(b"\n")
    algo = _ALGOS.get(algo_name.decode(errors="replace"), _DENSE)
    try:
        meta = json.loads(line)
    except (ValueError, RecursionError):
        return "refused:not_json"  # the envelope refuses such a header before any payload reader sees it
    if not isinstance(meta, dict):
        return "refused:not_json"
    buf = bytearray(body)
    try:  # what SwarmDriver.accept does
        if "arrays" in meta:
            payload = read_payload(meta, buf)
        else:
            payload = _payload_of_vector(read_vector(meta, buf, D))
        x = algo.read_payload(payload, D)
    except Dropped as exc:
        assert exc.reason == "invalid_payload", exc
        return "refused:dropped"
    except PayloadError:
        return "refused:payload_error"
    assert isinstance(x, torch.Tensor) and x.dtype == torch.float32 and tuple(x.shape) == (D,), x
    assert bool(torch.isfinite(x).all()), "a non-finite value reached the model"
    return "accepted"


def _payload_of_vector(v: torch.Tensor):
    from fedswarm.payload import Payload

    return Payload({"vector": v}, {"kind": "dense"})


TARGETS = [Target("envelope", envelope_inputs(), run_envelope, min_outcomes=5),
           Target("swarm_payload", payload_inputs(), run_payload, min_outcomes=3)]
