"""SecAgg+'s stage messages as Flower records: the one format both Flower halves agree on
(the server's :mod:`fedswarm.server.secagg` and the node's :mod:`fedswarm.client.secagg_mod`).

Every stage travels as a message of the round's own train message type (``train`` or
``train.<name>``, so a ClientApp dispatches it to the handler the secagg mod wraps) whose
content has a ``secagg`` ConfigRecord: ``stage`` (0..3), ``round_id`` and the stage's
fields. Node ids travel packed as big-endian uint64 bytes (Flower node ids are unsigned
64-bit; a ConfigRecord int is signed); fixed-size items (keys, shares, ciphertexts) as one
concatenated bytes value. The masked input comes back in the ``secagg`` ArrayRecord.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from fedswarm.algorithms.secagg.messages import (ADVERTISE, MASKED_INPUT, SHARE_KEYS, UNMASK, Keys,
                                                 MaskedInputRequest, SecAggRefused, Setup, ShareKeysRequest,
                                                 UnmaskReply, UnmaskRequest)
from fedswarm.algorithms.secagg.shamir import SHARE_BYTES

__all__ = ["RECORD", "STATE_RECORD", "decode_request", "encode_request", "is_secagg", "keys_from", "keys_to",
           "masked_from", "masked_to", "pack_ids", "shares_from", "shares_to", "state_dump", "state_load",
           "unmask_from", "unmask_to", "unpack_ids"]

#: The ConfigRecord (requests and small replies) and ArrayRecord (the masked input) name.
RECORD = "secagg"
#: Where the node keeps its state between the stages, in ``context.state``.
STATE_RECORD = "secagg.state"
_KEY = 32


def pack_ids(ids) -> bytes:
    return np.asarray(sorted(int(i) for i in ids), dtype=">u8").tobytes()


def unpack_ids(raw: bytes) -> list[int]:
    if len(raw) % 8:
        raise SecAggRefused(f"secagg: a node id list of {len(raw)} bytes is not whole uint64s")
    return [int(i) for i in np.frombuffer(raw, dtype=">u8")]


def _chunks(raw: bytes, size: int, count: int, what: str) -> list[bytes]:
    if len(raw) != size * count:
        raise SecAggRefused(f"secagg: {what}: expected {count} items of {size} bytes, got {len(raw)} bytes")
    return [raw[i * size:(i + 1) * size] for i in range(count)]


def _blobs(items: list[bytes]) -> bytes:
    """Variable-size items: each prefixed by its 4-byte length."""
    return b"".join(len(b).to_bytes(4, "big") + b for b in items)


def _unblobs(raw: bytes) -> list[bytes]:
    out, i = [], 0
    while i < len(raw):
        n = int.from_bytes(raw[i:i + 4], "big")
        out.append(raw[i + 4:i + 4 + n])
        i += 4 + n
    if i != len(raw):
        raise SecAggRefused("secagg: a ciphertext list is truncated")
    return out


# -- server -> node ----------------------------------------------------------------------------

def encode_request(req) -> ConfigRecord:
    """A stage request as the ``secagg`` ConfigRecord."""
    base: dict[str, Any] = {"stage": int(req.stage), "round_id": req.round_id}
    if isinstance(req, Setup):
        base.update(node_ids=pack_ids(req.node_ids), degree=req.degree, threshold=req.threshold,
                    graph_seed=req.graph_seed, dim=req.dim, clip=float(req.clip), bits=req.bits,
                    weight_max=req.weight_max, noise_bound=req.noise_bound)
    elif isinstance(req, ShareKeysRequest):
        ids = sorted(req.keys)
        base.update(ids=pack_ids(ids), c_pk=b"".join(req.keys[i].c_public for i in ids),
                    s_pk=b"".join(req.keys[i].s_public for i in ids))
    elif isinstance(req, MaskedInputRequest):
        ids = sorted(req.ciphertexts)
        base.update(ids=pack_ids(ids), blobs=_blobs([req.ciphertexts[i] for i in ids]))
    elif isinstance(req, UnmaskRequest):
        base.update(survivors=pack_ids(req.survivors), dropped=pack_ids(req.dropped))
    else:
        raise TypeError(f"not a secagg request: {type(req).__name__}")
    return ConfigRecord(base)


def decode_request(rec: ConfigRecord):
    """The stage request a ``secagg`` ConfigRecord holds (a malformed one is refused)."""
    try:
        stage, rid = int(rec["stage"]), bytes(rec["round_id"])
        if stage == ADVERTISE:
            return Setup(round_id=rid, node_ids=tuple(unpack_ids(rec["node_ids"])), degree=int(rec["degree"]),
                         threshold=int(rec["threshold"]), graph_seed=int(rec["graph_seed"]), dim=int(rec["dim"]),
                         clip=float(rec["clip"]), bits=int(rec["bits"]), weight_max=int(rec["weight_max"]),
                         noise_bound=int(rec["noise_bound"]))
        if stage == SHARE_KEYS:
            ids = unpack_ids(rec["ids"])
            cs = _chunks(rec["c_pk"], _KEY, len(ids), "public keys")
            ss = _chunks(rec["s_pk"], _KEY, len(ids), "public keys")
            return ShareKeysRequest(rid, {i: Keys(c, s) for i, c, s in zip(ids, cs, ss, strict=True)})
        if stage == MASKED_INPUT:
            ids, blobs = unpack_ids(rec["ids"]), _unblobs(rec["blobs"])
            if len(ids) != len(blobs):
                raise SecAggRefused("secagg: ciphertexts and senders differ in number")
            return MaskedInputRequest(rid, dict(zip(ids, blobs, strict=True)))
        if stage == UNMASK:
            return UnmaskRequest(rid, tuple(unpack_ids(rec["survivors"])), tuple(unpack_ids(rec["dropped"])))
    except (KeyError, TypeError, ValueError) as exc:
        raise SecAggRefused(f"secagg: a malformed stage message ({type(exc).__name__}: {exc})") from None
    raise SecAggRefused(f"secagg: unknown stage {stage}")


def is_secagg(content: RecordDict) -> bool:
    return RECORD in content.config_records


# -- node -> server ----------------------------------------------------------------------------

def keys_to(keys: Keys) -> RecordDict:
    return RecordDict({RECORD: ConfigRecord({"c_pk": keys.c_public, "s_pk": keys.s_public,
                                             "b_commit": keys.seed_commit})})


def keys_from(content: RecordDict) -> Keys:
    rec = content.config_records[RECORD]
    return Keys(bytes(rec["c_pk"]), bytes(rec["s_pk"]), bytes(rec["b_commit"]))


def shares_to(cts: dict[int, bytes]) -> RecordDict:
    ids = sorted(cts)
    return RecordDict({RECORD: ConfigRecord({"ids": pack_ids(ids), "blobs": _blobs([cts[i] for i in ids])})})


def shares_from(content: RecordDict) -> dict[int, bytes]:
    rec = content.config_records[RECORD]
    ids, blobs = unpack_ids(rec["ids"]), _unblobs(rec["blobs"])
    if len(ids) != len(blobs):
        raise ValueError("secagg: a share reply's ciphertexts and receivers differ in number")
    return dict(zip(ids, blobs, strict=True))


def masked_to(vec: np.ndarray, bits: int) -> RecordDict:
    """The masked input, as uint32 where the field fits (the wire size of a float32 update)."""
    arr = vec.astype(np.uint32, copy=False) if bits <= 32 else vec
    return RecordDict({RECORD: ArrayRecord({"masked": Array(np.ascontiguousarray(arr))})})


def masked_from(content: RecordDict) -> np.ndarray:
    arr = content.array_records[RECORD]["masked"].numpy()
    if arr.dtype not in (np.uint32, np.uint64) or arr.ndim != 1:
        raise ValueError(f"secagg: a masked input must be a flat uint32/uint64 array, got {arr.dtype} {arr.shape}")
    return arr


def unmask_to(reply: UnmaskReply) -> RecordDict:
    si, ki = sorted(reply.seed_shares), sorted(reply.key_shares)
    return RecordDict({RECORD: ConfigRecord({
        "seed_ids": pack_ids(si), "seed_shares": b"".join(reply.seed_shares[i] for i in si),
        "key_ids": pack_ids(ki), "key_shares": b"".join(reply.key_shares[i] for i in ki)})})


def unmask_from(content: RecordDict) -> UnmaskReply:
    rec = content.config_records[RECORD]
    si, ki = unpack_ids(rec["seed_ids"]), unpack_ids(rec["key_ids"])
    return UnmaskReply(dict(zip(si, _chunks(rec["seed_shares"], SHARE_BYTES, len(si), "shares"), strict=True)),
                       dict(zip(ki, _chunks(rec["key_shares"], SHARE_BYTES, len(ki), "shares"), strict=True)))


# -- the node's state in context.state ---------------------------------------------------------

def state_dump(state: dict[str, Any]) -> ConfigRecord:
    """The node's protocol state as one JSON string (bytes as hex; ids can pass 2^63)."""
    def enc(v):
        if isinstance(v, bytes):
            return {"b": v.hex()}
        if isinstance(v, list):
            return [enc(x) for x in v]
        return v

    return ConfigRecord({"json": json.dumps({k: enc(v) for k, v in state.items()})})


def state_load(rec: ConfigRecord | None) -> dict[str, Any] | None:
    if rec is None:
        return None

    def dec(v):
        if isinstance(v, dict):
            return bytes.fromhex(v["b"])
        if isinstance(v, list):
            return [dec(x) for x in v]
        return v

    return {k: dec(v) for k, v in json.loads(str(rec["json"])).items()}
