"""Fuzz targets of files read back from disk: node state snapshots and both checkpoints.

Each input is a whole file. Inputs start from a file the real writer made
(:meth:`~fedswarm.client.state_store.ClientStateStore.save`,
:func:`~fedswarm.swarm.checkpoint.save_checkpoint`, :func:`~fedswarm.server.checkpoint.dumps`),
then edit it: bytes flipped, cut, inserted or duplicated anywhere; for snapshots also a
header field changed *with the checksum and length made right again* (so the checks behind
the checksum are reached), the body edited likewise, or the header line replaced.

Refusals: ``StateFileError`` (snapshots), ``swarm.checkpoint.CheckpointError`` and
``fedswarm.errors.CheckpointError`` (server checkpoints). Accepted snapshots must carry an int round (the one
asked for) and node id; an accepted peer checkpoint must give ``Peer.start`` what it reads.
"""

from __future__ import annotations

import atexit
import hashlib
import io
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict
from hypothesis import strategies as st

from fedswarm.client.state_store import MAGIC, ClientStateStore, Snapshot, StateFileError
from fedswarm.errors import CheckpointError
from fedswarm.server import checkpoint as server_ck
from fedswarm.swarm import checkpoint as swarm_ck
from tests.fuzzing import Target
from tests.fuzzing.mutate import deep_json, dumps_loose, json_values, mutate_bytes, mutate_dict

__all__ = ["TARGETS"]

_TMP = Path(tempfile.mkdtemp(prefix="fedswarm-fuzz-files-"))
atexit.register(shutil.rmtree, _TMP, True)
RUN, PART, ROUND = "run-1", 2, 7


def _state_templates() -> list[bytes]:
    store = ClientStateStore(_TMP / "templates", RUN, PART)
    out = []
    for i, rd in enumerate([RecordDict({"ef": ArrayRecord({"residual": Array(np.arange(6, dtype=np.float32))})}),
                            RecordDict({"cfg": ConfigRecord({"a": 1, "b": "x"})}), RecordDict()]):
        out.append(store.save(ROUND, rd, node_id=11 + i).read_bytes())
    return out


STATE_TEMPLATES = _state_templates()
_STORE = ClientStateStore(_TMP / "read", RUN, PART)


def _with_body(header: dict, body: bytes) -> bytes:
    header = {**header, "nbytes": len(body), "sha256": hashlib.sha256(body).hexdigest()}
    return MAGIC + dumps_loose(header) + b"\n" + body


_HEADER_VALUES = st.one_of(json_values, st.sampled_from([RUN, PART, ROUND, float(ROUND), True]))
_HEADER_LINES = st.one_of(st.integers(1, 2100).map(lambda n: deep_json(n).encode()),
                          st.binary(max_size=40).filter(lambda b: b"\n" not in b))


@st.composite
def state_inputs(draw) -> bytes:
    raw = draw(st.sampled_from(STATE_TEMPLATES))
    line_end = raw.index(b"\n", len(MAGIC))
    header, body = json.loads(raw[len(MAGIC):line_end]), raw[line_end + 1:]
    how = draw(st.sampled_from(["valid", "bytes", "field", "field", "body", "line"]))
    if how == "bytes":
        return draw(mutate_bytes(raw))
    if how == "field":
        h = draw(mutate_dict(header, ["run_id", "partition", "round", "node_id"], _HEADER_VALUES))
        return _with_body(h, body)
    if how == "body":
        return _with_body(header, draw(mutate_bytes(body)))
    if how == "line":
        line = draw(_HEADER_LINES)
        return MAGIC + line + b"\n" + body
    return raw


def run_state(data: bytes) -> str:
    path = _TMP / "read" / "round-00000007.state"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    try:
        snap = _STORE.read(path, expect_round=ROUND)
    except StateFileError:
        return "refused:state_file_error"
    assert isinstance(snap, Snapshot) and type(snap.round) is int and snap.round == ROUND
    assert type(snap.node_id) is int and isinstance(snap.state, RecordDict)
    return "accepted"


# -- the swarm peer's checkpoint -------------------------------------------------------
def _peer_template() -> bytes:
    d = _TMP / "peer-template"
    state = {"round": 3, "history": [{"round": 1, "train_loss": 0.5}, {"round": 2, "train_loss": 0.4}],
             "restarts": 0, "driver": {"x": torch.linspace(-1, 1, 8), "step": 3}}
    return swarm_ck.save_checkpoint(d, state, fsync=False).read_bytes()


PEER_TEMPLATE = _peer_template()


_PEER_INPUTS = st.one_of(mutate_bytes(PEER_TEMPLATE, max_ops=2), st.just(PEER_TEMPLATE), st.binary(max_size=64))


@st.composite
def peer_inputs(draw) -> bytes:
    return draw(_PEER_INPUTS)


def run_peer(data: bytes) -> str:
    d = _TMP / "peer"
    d.mkdir(parents=True, exist_ok=True)
    (d / swarm_ck.CHECKPOINT_FILE).write_bytes(data)
    try:
        ck = swarm_ck.load_checkpoint(d)
    except swarm_ck.CheckpointError:
        return "refused:checkpoint_error"
    # what Peer.start reads from it
    assert isinstance(ck, dict) and type(ck["round"]) is int and ck["round"] >= 0
    assert isinstance(ck["history"], list) and isinstance(ck["driver"], dict)
    assert type(ck.get("restarts", 0)) is int
    return "accepted"


# -- the server's checkpoint -------------------------------------------------------------
def _server_template() -> bytes:
    ck = server_ck.ServerCheckpoint(
        round=4, arrays=ArrayRecord({"w": Array(np.ones((2, 3), np.float32)), "b": Array(np.zeros(3, np.float32))}),
        strategy={"momentum": torch.zeros(9), "step": 4}, rng={"python": None}, policies={"edge": {"local_steps": 2}},
        grid=None, byzantine=None, strategy_name="fedavg")
    return server_ck.dumps(ck)


SERVER_TEMPLATE = _server_template()


_SERVER_VALUES = st.one_of(json_values, st.just([("w", np.zeros(2))]))
_SERVER_BYTES = st.one_of(mutate_bytes(SERVER_TEMPLATE, max_ops=2), st.just(SERVER_TEMPLATE), st.binary(max_size=64))


@st.composite
def server_inputs(draw) -> bytes:
    if not draw(st.integers(0, 3)):  # a valid file holding another dict: fields missing or of the wrong type
        raw = torch.load(io.BytesIO(SERVER_TEMPLATE), weights_only=False)
        raw = draw(mutate_dict(raw, list(raw), _SERVER_VALUES))
        buf = io.BytesIO()
        torch.save(raw, buf)
        return buf.getvalue()
    return draw(_SERVER_BYTES)


def run_server(data: bytes) -> str:
    try:
        ck = server_ck.loads(data)
    except CheckpointError:
        return "refused:checkpoint_error"
    assert type(ck.round) is int and isinstance(ck.arrays, ArrayRecord) and isinstance(ck.strategy_name, str)
    assert isinstance(ck.strategy, dict) and isinstance(ck.rng, dict) and isinstance(ck.policies, dict)
    return "accepted"


TARGETS = [Target("state_file", state_inputs(), run_state, min_outcomes=2),
           Target("peer_checkpoint", peer_inputs(), run_peer, min_outcomes=2),
           Target("server_checkpoint", server_inputs(), run_server, min_outcomes=2)]


