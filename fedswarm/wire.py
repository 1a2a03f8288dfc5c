"""Flower's wire format and byte accounting.

A :class:`~fedswarm.payload.Payload` (a codec's or an algorithm's message) converts
losslessly to and from Flower records (an ``ArrayRecord`` for the arrays, a
``ConfigRecord`` for the metadata) with :func:`payload_to_records` and
:func:`payload_from_records`, so it travels inside any Flower ``Message``. Sizes are always
measured on the serialized message (:func:`message_nbytes`), never computed from a
formula: the formula is a test oracle.
"""

from __future__ import annotations

import io
import math

import numpy as np
import numpy.lib.format as npy
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.common.serde import message_to_proto, recorddict_to_proto

from fedswarm.payload import Payload, PayloadError, check_array

__all__ = [
    "payload_to_records",
    "payload_from_records",
    "message_nbytes",
    "recorddict_nbytes",
    "vector_to_arrayrecord",
    "arrayrecord_to_vector",
    "array_keys",
    "vector_to_arrays_like",
    "read_array",
]

# Keys a payload occupies inside a RecordDict.
PAYLOAD_ARRAYS = "payload"
PAYLOAD_META = "payload.meta"


def payload_to_records(payload: Payload, content: RecordDict | None = None) -> RecordDict:
    """Put ``payload`` into ``content`` (a new RecordDict if None) and return it."""
    content = RecordDict() if content is None else content
    rec = ArrayRecord()
    for k, v in payload.arrays.items():
        arr = v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else np.asarray(v)
        rec[k] = Array(np.ascontiguousarray(arr))
    content[PAYLOAD_ARRAYS] = rec
    content[PAYLOAD_META] = ConfigRecord(dict(payload.meta))
    return content


def payload_from_records(content: RecordDict, max_bytes: int | None = None) -> Payload:
    """Read a payload back, checking that it is well formed. Raises :class:`PayloadError`."""
    if PAYLOAD_ARRAYS not in content.array_records:
        raise PayloadError(f"message has no '{PAYLOAD_ARRAYS}' ArrayRecord")
    if PAYLOAD_META not in content.config_records:
        raise PayloadError(f"message has no '{PAYLOAD_META}' ConfigRecord")
    rec = content.array_records[PAYLOAD_ARRAYS]
    if max_bytes is not None and rec.count_bytes() > max_bytes:
        raise PayloadError(f"payload is {rec.count_bytes()} bytes, the limit is {max_bytes}")
    arrays = {k: check_array(k, read_array(k, rec[k], "payload array")) for k in rec.keys()}
    return Payload(arrays=arrays, meta=dict(content.config_records[PAYLOAD_META]))


def read_array(key: str, array: Array, what: str = "array") -> np.ndarray:
    """The numpy array a Flower ``Array`` that came off the network holds; PayloadError if its
    bytes are not one ``.npy`` array whose header's shape and dtype account for exactly the
    bytes that follow. Checked before numpy reads it: ``np.load`` allocates what the header
    declares, so a few bytes declaring a 10 GB shape would otherwise allocate 10 GB."""
    data = array.data if isinstance(array.data, (bytes, bytearray, memoryview)) else b""
    f = io.BytesIO(data)
    try:
        version = npy.read_magic(f)
        if version not in ((1, 0), (2, 0)):
            raise ValueError(f"npy version {version} is not supported")
        read_header = npy.read_array_header_1_0 if version == (1, 0) else npy.read_array_header_2_0
        shape, fortran_order, dtype = read_header(f)
        if dtype.hasobject or dtype.itemsize == 0:
            raise ValueError(f"dtype {dtype} holds no plain values")
        count = math.prod(shape)
        if count * dtype.itemsize != len(data) - f.tell():
            raise ValueError(f"its header declares {count * dtype.itemsize} bytes of data, it holds "
                             f"{len(data) - f.tell()}")
        # what np.load does, without parsing the header a second time (a copy: writable, as np.load's)
        flat = np.frombuffer(data, dtype=dtype, count=count, offset=f.tell())
        return flat.reshape(shape, order="F" if fortran_order else "C").copy(order="K")
    except Exception as exc:  # corrupt bytes, an unknown dtype, a header numpy refuses
        raise PayloadError(f"{what} '{key}' cannot be read: {exc}") from None


def message_nbytes(message: Message) -> int:
    """Bytes of the message as Flower serializes it for the wire (protobuf, metadata included)."""
    return message_to_proto(message).ByteSize()


def recorddict_nbytes(content: RecordDict) -> int:
    """Bytes of a RecordDict as serialized (the content of a message, no metadata)."""
    return recorddict_to_proto(content).ByteSize()


def vector_to_arrayrecord(vec: torch.Tensor | np.ndarray, key: str = "vector") -> ArrayRecord:
    """A flat float32 vector as a one-array ArrayRecord."""
    arr = vec.detach().cpu().numpy() if isinstance(vec, torch.Tensor) else np.asarray(vec)
    return ArrayRecord({key: Array(np.ascontiguousarray(arr.astype(np.float32, copy=False)))})


def array_keys(rec: ArrayRecord) -> list[tuple[str, tuple[int, ...]]]:
    """The (name, shape) of each array of ``rec``, in order: what :func:`vector_to_arrays_like` needs."""
    return [(k, tuple(rec[k].shape)) for k in rec.keys()]


def vector_to_arrays_like(vec: torch.Tensor, keys: list[tuple[str, tuple[int, ...]]] | None) -> ArrayRecord:
    """A flat vector as an ArrayRecord shaped as :func:`array_keys` read one (a Flower-style
    per-tensor record of a model stays one); one key (or none known: ``vector``) is one flat array."""
    if not keys or len(keys) == 1:
        return vector_to_arrayrecord(vec, keys[0][0] if keys else "vector")
    rec, off = ArrayRecord(), 0
    for key, shape in keys:
        n = int(np.prod(shape, dtype=np.int64)) if shape else 1
        rec[key] = Array(np.ascontiguousarray(vec[off:off + n].reshape(shape).numpy()))
        off += n
    return rec


def arrayrecord_to_vector(rec: ArrayRecord, d: int | None = None) -> torch.Tensor:
    """The inverse of :func:`vector_to_arrayrecord`; the record's arrays are concatenated in
    order, so a Flower-style per-tensor record of a model converts too. Checks length and
    finiteness; raises :class:`PayloadError`."""
    parts = []
    for k in rec.keys():
        arr = read_array(k, rec[k])
        if arr.dtype.kind != "f":
            raise PayloadError(f"array '{k}' has dtype {arr.dtype}, expected floating point")
        parts.append(arr.reshape(-1).astype(np.float32, copy=False))
    vec = np.concatenate(parts) if parts else np.zeros(0, np.float32)
    if d is not None and vec.size != d:
        raise PayloadError(f"parameter vector has {vec.size} values, the model has {d}")
    if not np.isfinite(vec).all():
        raise PayloadError("parameter vector has non-finite values")
    return torch.from_numpy(vec.copy())
