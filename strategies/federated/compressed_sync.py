"""Model replicas on clients, kept in step with the server's model by sending updates.

Compressed strategies compress the *downlink* too (1-bit SGD sends the 1-bit aggregate,
gTop-k and the sketch methods a sparse update), so a client must hold the model the
server's updates apply to. The server keeps the **public model** x̂_t, the one every
client can reconstruct, with a version t (the number of updates committed), and for each
node the version it holds. A train message carries a ``sync`` record and whichever body
is smallest for that node:

==========  ===============================================  ============================
mode        body                                             client does
==========  ===============================================  ============================
full        ``sync.model``: the float32 model                x = model
sparse      ``sync.sparse``: the coordinates changed since   x[indices] = values
            the node's version, with their current values    (FetchSGD's download)
updates     ``sync.u0 ..``: the payloads of the updates      x = x + decode(u_i), in order
            since the node's version (e.g. 1-bit aggregates)
none        nothing (the node is current)                    --
==========  ===============================================  ============================

The server applies every update as ``x̂ = x̂ + decode(u)`` in float32, exactly as the
client does, so replicas stay bit-identical; each message carries a CRC-32 of x̂_t and a
client whose result differs raises (:data:`REPLICA_LOST`): that costs the round its
update and the node gets the full model next time. So does any failed round (the client
saves its replica only with a successful reply) and a node the server has not seen.

State: the server keeps x̂ (d floats), the version at which each coordinate last changed
(d int64) and the last ``history`` update payloads; a client keeps its replica and its
version in ``Context.state``.
"""

from __future__ import annotations

import uuid
import zlib
from collections import OrderedDict

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from fedswarm.params import ParamLayout
from fedswarm.algorithms.compression.codecs import decode_payload
from fedswarm.payload import Payload, PayloadError
from fedswarm.wire import (PAYLOAD_ARRAYS, PAYLOAD_META, arrayrecord_to_vector, payload_from_records,
                           payload_to_records, recorddict_nbytes, vector_to_arrayrecord)

__all__ = ["ReplicaSync", "client_sync", "save_replica", "crc32", "REPLICA_LOST", "SYNC"]

#: Marker in the error of a client whose replica is missing or out of step.
REPLICA_LOST = "fedswarm: replica out of step"

SYNC, SYNC_MODEL, SYNC_SPARSE = "sync", "sync.model", "sync.sparse"
_STATE, _STATE_META = "compressed.replica", "compressed.replica.meta"
_HEADER = 200  # bytes of record framing per array, for choosing the smallest body (a guess; sizes are measured)


def crc32(x: torch.Tensor) -> int:
    return zlib.crc32(np.ascontiguousarray(x.detach().cpu().numpy(), dtype=np.float32).tobytes())


class ReplicaSync:
    """The server half: the public model, its version, and the version each node holds.

    Parameters
    ----------
    history : int
        How many past update payloads to keep for ``updates`` bodies.
    """

    def __init__(self, history: int = 8):
        self.history_len = int(history)
        self.x: torch.Tensor | None = None
        self.version = 0
        self.epoch = uuid.uuid4().hex[:12]  # tells replicas of another server instance apart
        self.changed_at = torch.zeros(0, dtype=torch.int64)
        self.history: OrderedDict[int, tuple[Payload | None, int]] = OrderedDict()
        self.nodes: dict[int, int] = {}  # node id -> version it holds (acknowledged)
        self.sent: dict[int, int] = {}  # node id -> version sent this round
        self.crc = 0
        self._bodies: dict[int, tuple[str, dict]] = {}  # base version -> body, for this version

    def reset(self, x: torch.Tensor) -> None:
        self.x = x.detach().to(torch.float32).clone()
        self.version = 0
        self.changed_at = torch.zeros(x.numel(), dtype=torch.int64)
        self.history.clear()
        self.nodes.clear()
        self.crc = crc32(self.x)
        self._bodies = {}

    def commit(self, update: torch.Tensor, payload: Payload | None = None) -> None:
        """x̂ ← x̂ + update (the vector ``payload`` decodes to, if given)."""
        new = self.x + update
        changed = new != self.x
        self.version += 1
        self.changed_at[changed] = self.version
        self.x = new
        nbytes = recorddict_nbytes(payload_to_records(payload)) if payload is not None else 0
        self.history[self.version] = (payload, nbytes)
        while len(self.history) > self.history_len:
            self.history.popitem(last=False)
        self.crc = crc32(new)
        self._bodies = {}

    def __getstate__(self) -> dict:
        """A copy (a checkpoint's ``deepcopy``) leaves out the cache of planned bodies: it is
        rebuilt from ``x`` on demand, and in a deployment it holds the records Flower sent,
        whose buffers (memoryviews) cannot be copied."""
        return {**self.__dict__, "_bodies": {}}

    # -- per node ------------------------------------------------------------------------
    def write(self, content: RecordDict, node_id: int) -> None:
        """Put the smallest body that brings ``node_id`` to the current version into
        ``content``."""
        for key, rec in self.body(self.nodes.get(node_id)).items():
            content[key] = rec
        self.sent[node_id] = self.version

    def body(self, base: int | None) -> dict:
        """The records :meth:`write` puts into the message of a node that holds version ``base``
        (``None``: no replica): the body's records, then the ``sync`` record (a new one)."""
        if base not in self._bodies:
            self._bodies[base] = self._plan(base)
        mode, records = self._bodies[base]
        return {**records, SYNC: ConfigRecord({"mode": mode, "base": -1 if base is None else base,
                                               "version": self.version, "epoch": self.epoch, "crc": self.crc,
                                               "n": len(records) // 2})}

    def send_all(self, node_ids: list[int]) -> list[int | None]:
        """:meth:`write`'s bookkeeping for every node of ``node_ids`` at once, without a message:
        each node is sent the current version; returns the version each holds (its body's base)."""
        bases = [self.nodes.get(nid) for nid in node_ids]
        self.sent.update(dict.fromkeys(node_ids, self.version))
        return bases

    def ack(self, node_id: int) -> None:
        """The node replied: it now holds the version it was sent."""
        if node_id in self.sent:
            self.nodes[node_id] = self.sent.pop(node_id)

    def forget(self, node_id: int) -> None:
        """The node failed (its replica may be lost): send it the full model next time."""
        self.nodes.pop(node_id, None)
        self.sent.pop(node_id, None)

    def _plan(self, base: int | None) -> tuple[str, dict]:
        d = self.x.numel()
        if base is None or base > self.version:
            return "full", {SYNC_MODEL: vector_to_arrayrecord(self.x)}
        if base == self.version:
            return "none", {}
        changed = (self.changed_at > base).nonzero().flatten()
        costs = {"full": 4 * d + _HEADER, "sparse": 8 * changed.numel() + 2 * _HEADER}
        updates = [self.history.get(v) for v in range(base + 1, self.version + 1)]
        if all(u is not None and u[0] is not None for u in updates):
            costs["updates"] = sum(u[1] for u in updates)
        mode = min(costs, key=costs.get)
        if mode == "full":
            return "full", {SYNC_MODEL: vector_to_arrayrecord(self.x)}
        if mode == "sparse":
            idx = changed.to(torch.int32).numpy()
            vals = self.x[changed].numpy()
            rec = ArrayRecord({"indices": Array(np.ascontiguousarray(idx)),
                               "values": Array(np.ascontiguousarray(vals))})
            return "sparse", {SYNC_SPARSE: rec}
        records = {}
        for i, (payload, _) in enumerate(updates):
            sub = payload_to_records(payload)
            records[f"sync.u{i}"] = sub[PAYLOAD_ARRAYS]
            records[f"sync.u{i}.meta"] = sub[PAYLOAD_META]
        return "updates", records


# -- the client half ---------------------------------------------------------------------


def _lost(why: str) -> RuntimeError:
    return RuntimeError(f"{REPLICA_LOST}: {why}")


def _load_replica(state: RecordDict, epoch: str, d: int) -> tuple[torch.Tensor, int]:
    meta = state.config_records.get(_STATE_META)
    rec = state.array_records.get(_STATE)
    if meta is None or rec is None or meta.get("epoch") != epoch:
        raise _lost("this node holds no replica of this server's model")
    return arrayrecord_to_vector(rec, d), int(meta["version"])


def client_sync(content: RecordDict, state: RecordDict, layout: ParamLayout) -> tuple[torch.Tensor, int, str]:
    """The server's current model from a train message and this node's replica: returns
    ``(x [d], version, epoch)``. Raises PayloadError for a malformed body and
    RuntimeError(:data:`REPLICA_LOST`) when the replica cannot be brought up to date."""
    d = layout.d
    meta = content.config_records.get(SYNC)
    if meta is None:
        raise PayloadError(f"train message has no '{SYNC}' record")
    mode, base, version, epoch = meta.get("mode"), int(meta["base"]), int(meta["version"]), str(meta["epoch"])
    if mode == "full":
        if SYNC_MODEL not in content.array_records:
            raise PayloadError(f"sync mode 'full' without '{SYNC_MODEL}'")
        x = arrayrecord_to_vector(content.array_records[SYNC_MODEL], d)
    else:
        x, held = _load_replica(state, epoch, d)
        if mode == "none":
            if held != version:
                raise _lost(f"holds version {held}, the server sent nothing for version {version}")
        elif mode == "sparse":
            if not base <= held <= version:
                raise _lost(f"holds version {held}, the update covers {base}..{version}")
            idx, vals = _sparse(content, d)
            x[idx] = vals
        elif mode == "updates":
            if held != base:
                raise _lost(f"holds version {held}, the updates start from {base}")
            for i in range(int(meta["n"])):
                sub = RecordDict()
                for key, name in ((f"sync.u{i}", PAYLOAD_ARRAYS), (f"sync.u{i}.meta", PAYLOAD_META)):
                    if key not in content:
                        raise PayloadError(f"sync update {i} is missing '{key}'")
                    sub[name] = content[key]
                x = x + decode_payload(payload_from_records(sub), layout)[0]
        else:
            raise PayloadError(f"unknown sync mode {mode!r}")
    if crc32(x) != int(meta["crc"]):
        raise _lost(f"the model after a '{mode}' sync does not match the server's (version {version})")
    return x, version, epoch


def _sparse(content: RecordDict, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    rec = content.array_records.get(SYNC_SPARSE)
    if rec is None or set(rec.keys()) != {"indices", "values"}:
        raise PayloadError(f"'{SYNC_SPARSE}' must hold 'indices' and 'values'")
    idx, vals = rec["indices"].numpy(), rec["values"].numpy()
    if idx.dtype != np.int32 or vals.dtype != np.float32 or idx.shape != vals.shape or idx.ndim != 1:
        raise PayloadError("sparse sync: int32 indices and float32 values of one length expected")
    if idx.size and (idx.min() < 0 or idx.max() >= d or (np.diff(idx) <= 0).any()):
        raise PayloadError("sparse sync: indices must be strictly increasing in [0, d)")
    if not np.isfinite(vals).all():
        raise PayloadError("sparse sync: non-finite values")
    return torch.from_numpy(idx.astype(np.int64)), torch.from_numpy(vals.copy())


def save_replica(state: RecordDict, x: torch.Tensor, version: int, epoch: str) -> None:
    state[_STATE] = vector_to_arrayrecord(x)
    state[_STATE_META] = ConfigRecord({"version": int(version), "epoch": epoch})
