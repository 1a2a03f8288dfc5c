"""Fuzz targets of what clients send back over Flower: codec payloads and model replies.

An input is a first line naming the check (``codec`` or ``reply``) and a Flower ``RecordDict``
in Flower's protobuf serialization, the content of a client's reply message. Inputs start
from a valid encode of a random ``[K, d]`` batch by one of the codecs (small shapes: d = 18
in two tensors), then mutate the payload as a client could: meta values changed, removed or
added; an array's dtype, shape or length changed; NaN, infinity or out-of-range indices
written into it; an array dropped or added; an array's ``.npy`` header rewritten to declare
another shape or dtype (10^10 values over a few bytes); or bytes of the message flipped.

``codec``: :func:`~fedswarm.wire.payload_from_records` then
:func:`~fedswarm.algorithms.compression.codecs.decode_payload` (what the compressed strategies
do), refusals: ``PayloadError``; an accepted payload must decode to a finite float32
``[K, d]``, and reading any input may not allocate more than 64 MB. ``reply``:
:func:`~fedswarm.strategies.strategy_utils.check_model_reply` on a plain train reply, refusals:
``PayloadError``; an accepted model is a finite float32 ``[d]``. ``pvt``: partial-variable
training's reply parser, refusals: what its ``aggregate_train`` rejects (``PayloadError``,
``KeyError``, ``ValueError``, ``TypeError``); what it accepts adds only finite values in range.
A message Flower itself cannot parse (protobuf's ``DecodeError``, or any error of flwr's
``recorddict_from_proto``) never reaches fedswarm: ``refused:flower``.
"""

from __future__ import annotations

import io
import math
import tracemalloc
from types import SimpleNamespace

import numpy as np
import numpy.lib.format as npy
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict
from hypothesis import strategies as st

from fedswarm.algorithms.compression.codecs import decode_payload, make_codec
from fedswarm.params import ParamLayout
from fedswarm.payload import Payload, PayloadError
from fedswarm.strategies.edge.pvt import PartialVariableTraining
from fedswarm.strategies.strategy_utils import check_model_reply
from fedswarm.wire import payload_from_records, payload_to_records
from tests.fuzzing import Target
from tests.fuzzing.mutate import mutate_bytes, mutate_dict, random_batch

__all__ = ["TARGETS"]

LAYOUT = ParamLayout.from_shapes([("w", (3, 4)), ("b", (6,))])
D = LAYOUT.d
MAX_BYTES = 8 * D * 4 + 4096
MAX_ALLOC = 64 << 20
CODECS = [("none", {}), ("fp16", {}), ("onebit", {}), ("onebit", {"scale": "tensor"}), ("sign", {}),
          ("topk", {"ratio": 0.25}), ("randk", {"ratio": 0.3, "unbiased": True}), ("qsgd", {"levels": 4, "bucket": 5}),
          ("qsgd", {"levels": 300, "bucket": 0}), ("countsketch", {"rows": 3, "cols": 8, "k_ratio": 0.2})]
_CODEC_OBJS = [make_codec(n, **p) for n, p in CODECS]
_PVT = PartialVariableTraining(LAYOUT)
#: Values a Flower ConfigRecord can carry (protobuf sint64 ints, doubles, strings, bytes, bools, lists).
_config_values = st.one_of(
    st.integers(-(2**63), 2**63 - 1), st.sampled_from([0, -1, 1, 2**31, 2**62, 10**12, D, D + 1]),
    st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.text(max_size=10),
    st.sampled_from(["topk", "none", "column", "tensor", "auto", ""]), st.binary(max_size=4),
    st.lists(st.integers(-5, 5), max_size=3), st.lists(st.floats(), max_size=3))
_DTYPES = [np.float16, np.float32, np.float64, np.int8, np.uint8, np.int16, np.int32, np.int64, np.bool_,
           np.complex64, np.uint64, np.dtype(">f4")]


@st.composite
def _mutate_array(draw, arr: np.ndarray) -> np.ndarray:
    op = draw(st.sampled_from(["dtype", "shape", "shorter", "longer", "special", "special", "indices"]))
    if op == "dtype":
        return arr.astype(draw(st.sampled_from(_DTYPES)))
    if op == "shape":
        return draw(st.sampled_from([arr.reshape(-1), arr.reshape(1, *arr.shape), arr.T.copy(),
                                     arr.reshape(-1)[None, None]]))
    flat = arr.reshape(-1)
    if op == "shorter":
        return flat[: draw(st.integers(0, max(0, flat.size - 1)))]
    if op == "longer":
        return np.concatenate([flat, flat[:1] if flat.size else np.zeros(1, flat.dtype)])
    out = flat.copy()
    if out.size == 0:
        return out.reshape(arr.shape)
    i = draw(st.integers(0, out.size - 1))
    if op == "special" and out.dtype.kind == "f":
        out[i] = draw(st.sampled_from([np.nan, np.inf, -np.inf, np.finfo(out.dtype).max]))
    elif out.dtype.kind in "iu":
        info = np.iinfo(out.dtype)
        out[i] = draw(st.sampled_from([info.min, info.max, -1, D, D - 1, 0] if info.min < 0 else [info.max, D, 0]))
    return out.reshape(arr.shape)


@st.composite
def _codec_records(draw) -> RecordDict:
    codec = draw(st.sampled_from(_CODEC_OBJS))
    k = draw(st.integers(1, 3))
    p = codec.encode(draw(random_batch(k, D)), LAYOUT, seed=draw(st.integers(0, 5)))
    arrays = {n: a.numpy() for n, a in p.arrays.items()}
    meta = dict(p.meta)
    for _ in range(draw(st.integers(0, 2))):
        how = draw(st.sampled_from(["meta", "array", "array", "drop", "add"]))
        if how == "meta":
            meta = draw(mutate_dict(meta, list(meta), _config_values))
        elif how == "array" and arrays:
            name = draw(st.sampled_from(sorted(arrays)))
            arrays[name] = draw(_mutate_array(arrays[name]))
        elif how == "drop" and arrays:
            arrays.pop(draw(st.sampled_from(sorted(arrays))))
        elif how == "add":
            arrays[draw(st.sampled_from(["extra", "values", "indices"]))] = np.zeros(draw(st.integers(0, 4)),
                                                                                     np.float32)
    return payload_to_records(Payload(arrays, meta))


@st.composite
def _reply_records(draw) -> RecordDict:
    x = draw(random_batch(1, D))[0].numpy()
    parts = {"arrays.0": x} if draw(st.booleans()) else {"w": x[:12].reshape(3, 4), "b": x[12:]}
    if draw(st.booleans()):
        name = draw(st.sampled_from(sorted(parts)))
        parts[name] = draw(_mutate_array(parts[name]))
    rd = RecordDict({"arrays": ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in parts.items()})})
    if draw(st.integers(0, 5)):
        rd["metrics"] = MetricRecord({"num-examples": draw(st.sampled_from([1, 10, 0]))})
    if not draw(st.integers(0, 9)):
        rd["config"] = ConfigRecord({"x": 1})
    return rd


_NPY_SHAPES = st.one_of(st.lists(st.integers(0, 40), max_size=3).map(tuple), st.sampled_from(
    [(10**10,), (2**31, 2**31), (2**62,), (0, 10**12), (-1,), (3, -2)]))


@st.composite
def _npy_header(draw, rd: RecordDict) -> RecordDict:
    """One array's ``.npy`` header rewritten to declare another shape (or dtype) over the same bytes."""
    recs = [r for r in rd.array_records.values() if len(r)]
    if not recs:
        return rd
    rec = draw(st.sampled_from(recs))
    key = draw(st.sampled_from(sorted(rec.keys())))
    old = rec[key]
    f = io.BytesIO(old.data)
    npy.read_magic(f)
    _, _, dtype = npy.read_array_header_1_0(f)
    body = old.data[f.tell():]
    out = io.BytesIO()
    descr = draw(st.sampled_from([npy.dtype_to_descr(dtype), "<f8", "|O", "<U3", "|V0", "<c8"]))
    try:
        npy.write_array_header_1_0(out, {"descr": descr, "fortran_order": draw(st.booleans()),
                                         "shape": draw(_NPY_SHAPES)})
    except ValueError:
        return rd
    rec[key] = Array(dtype=old.dtype, shape=old.shape, stype=old.stype, data=out.getvalue() + body)
    return rd


_METRIC_VALUES = st.one_of(st.sampled_from([0, -1, 1, 2, 10**12, 2**62, float("inf"), float("-inf"), float("nan"),
                                            0.5, 1e300]), st.integers(-(2**63), 2**63 - 1))


@st.composite
def _pvt_records(draw) -> RecordDict:
    ids = sorted(draw(st.sets(st.integers(0, len(LAYOUT) - 1), min_size=1)))
    x = draw(random_batch(1, D))[0].numpy()
    parts = {"values": np.concatenate([x[LAYOUT.specs[i].offset:LAYOUT.specs[i].end] for i in ids]),
             "ids": np.array(ids, np.int32)}
    if draw(st.booleans()):
        name = draw(st.sampled_from(sorted(parts)))
        parts[name] = draw(_mutate_array(parts[name]))
    if not draw(st.integers(0, 4)):
        parts.pop("ids")
    metrics = {"num-examples": 10, "train_loss": 0.5, "variables": len(ids)}
    if draw(st.booleans()):
        metrics = draw(mutate_dict(metrics, list(metrics), _METRIC_VALUES))
    return RecordDict({"update": ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in parts.items()}),
                       "metrics": MetricRecord(metrics)})


@st.composite
def flower_inputs(draw) -> bytes:
    check = draw(st.sampled_from(["codec", "codec", "codec", "reply", "pvt"]))
    rd = draw({"codec": _codec_records, "reply": _reply_records, "pvt": _pvt_records}[check]())
    if not draw(st.integers(0, 5)):
        rd = draw(_npy_header(rd))
    raw = recorddict_to_proto(rd).SerializeToString()
    if not draw(st.integers(0, 7)):
        raw = draw(mutate_bytes(raw))
    return check.encode() + b"\n" + raw


def run_flower(data: bytes) -> str:
    check, _, raw = data.partition(b"\n")
    proto = ProtoRecordDict()
    try:
        proto.ParseFromString(raw)
        rd = recorddict_from_proto(proto)
    except Exception:  # noqa: BLE001 Flower's own deserialization refuses it (DecodeError; also AttributeError
        return "refused:flower"  # and others from flwr's serde on some malformed protos: Flower's, not ours)
    tracemalloc.start()
    try:
        if check == b"reply":
            x = check_model_reply(SimpleNamespace(content=rd), D)
            shape: tuple[int, ...] = (D,)
        elif check == b"pvt":
            return _run_pvt(rd)
        else:
            payload = payload_from_records(rd, max_bytes=MAX_BYTES)
            x = decode_payload(payload, LAYOUT)
            shape = (int(payload.meta["K"]), D)
    except PayloadError as exc:
        assert "allocate" not in str(exc), f"tried to allocate what a header declared: {exc}"
        return "refused:payload_error"
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        # every input is a few KB: a parser that allocates more believed a size field before checking it
        assert peak < MAX_ALLOC, f"{peak} bytes allocated to read a {len(raw)}-byte message"
    assert isinstance(x, torch.Tensor) and x.dtype == torch.float32 and tuple(x.shape) == shape, (x.dtype, x.shape)
    assert bool(torch.isfinite(x).all()), "a non-finite value reached the model"
    return "accepted"


def _run_pvt(rd: RecordDict) -> str:
    reply = SimpleNamespace(content=rd, metadata=SimpleNamespace(src_node_id=5))
    try:
        idx, values, weight, _ = _PVT._parse(1, reply)
    except (PayloadError, KeyError, ValueError, TypeError):  # what PartialVariableTraining.aggregate_train rejects
        return "refused:pvt_rejected"
    assert idx.dtype == torch.int64 and idx.numel() == values.numel() and bool((idx >= 0).all() & (idx < D).all())
    assert values.dtype == torch.float32 and bool(torch.isfinite(values).all()), "a non-finite value reached the model"
    assert math.isfinite(weight) and weight > 0, f"weight {weight} reaches the weighted mean"
    return "accepted"


TARGETS = [Target("flower_reply", flower_inputs(), run_flower, min_outcomes=3)]
