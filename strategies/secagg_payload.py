"""A linear codec's payload under secure aggregation: what the node masks and what the server
hands the strategy (shared by :mod:`fedswarm.client.secagg_mod` and :mod:`fedswarm.server.secagg`).

A strategy whose train messages carry the global model as ``arrays`` has its nodes mask their
model change. A sketch strategy (FetchSGD) sends no model: its nodes reply with a Count Sketch
table (a ``payload`` of one array), and the sketch of a weighted sum is the weighted sum of the
sketches (every node hashes with the round's shared ``hash_seed``). So the node masks the
table's cells, weighted by its ``num-examples``; the server unmasks the weighted mean table
and hands the strategy one reply carrying it, which the strategy unsketches as it unsketches
the mean of the plain tables (FetchSGD's momentum and error accumulation stay on the server).

The vector's length must be known before the protocol's first stage (the nodes expand their
masks to it): it is ``rows * cols`` of the sketch knobs in the train message
(:func:`payload_dim`). Next to its masked input, each node sends in the clear the payload's
*spec* (array key, shape, dtype and codec metadata: the sketch's dimensions and hash seed,
the same for every node and known to the server); the server requires every survivor's spec
to be identical (:func:`check_specs`). Nothing of the table's values travels in the clear.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping

import numpy as np
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

from fedswarm.payload import Payload, PayloadError
from fedswarm.wire import PAYLOAD_ARRAYS, payload_from_records, payload_to_records

__all__ = ["SPEC_RECORD", "SUM_KEY", "payload_dim", "payload_of", "payload_vector", "check_specs", "payload_reply",
           "reply_loss", "sum_metrics"]

#: The ConfigRecord, next to the masked input, that names the payload the masked vector is.
SPEC_RECORD = "secagg.payload"
#: A train message's config key: which of the round's secure sums it asks for (0, the default:
#: the first; Sketched-SGD's exact values: 1). Distributed DP draws each sum's noise from its own
#: stream (``fedswarm.client.secagg_dp``).
SUM_KEY = "secagg-sum"
_KNOBS = "compress"  # fedswarm.strategies.federated.compressed_client.KNOBS (not imported: torch-free here)


def payload_dim(msg: Message) -> int | None:
    """The length of the vector a sketch strategy's node masks (``rows * cols`` of the
    message's sketch knobs), or None when the message carries no sketch knobs."""
    knobs = msg.content.config_records.get(_KNOBS)
    if knobs is None or "rows" not in knobs or "cols" not in knobs or "hash_seed" not in knobs:
        return None
    rows, cols = int(knobs["rows"]), int(knobs["cols"])
    if rows < 1 or cols < 1:
        raise ValueError(f"secagg: sketch knobs rows={rows}, cols={cols} must be positive")
    return rows * cols


def payload_of(reply: Message) -> tuple[np.ndarray, int, ConfigRecord]:
    """The node's payload as the vector to mask (float64, flat), its weight (the reply's
    ``num-examples``) and its spec (:data:`SPEC_RECORD`). Raises ValueError when the reply
    carries no single-array payload."""
    if reply.has_error():
        raise RuntimeError(f"secagg: the train function failed: {reply.error.reason}")
    content = reply.content
    if PAYLOAD_ARRAYS not in content.array_records:
        raise ValueError("secagg_mod: a train reply without the model ('arrays') must carry a linear codec's "
                         f"'{PAYLOAD_ARRAYS}'")
    try:
        p = payload_from_records(content)
    except PayloadError as exc:
        raise ValueError(f"secagg_mod: the train reply's payload is malformed: {exc}") from None
    vector, spec = payload_vector(p)
    metrics = content.metric_records.get("metrics")
    if metrics is None or "num-examples" not in metrics:
        raise ValueError("secagg_mod: the train reply needs a 'num-examples' metric (the node's weight)")
    return vector, int(metrics["num-examples"]), spec


def reply_loss(reply: Message) -> float:
    """The train loss of a node's plain train reply (its ``train_loss`` metric), which the node
    adds to its masked vector when the server asks for it (``algorithms.secagg.quantize.with_loss``)."""
    metrics = next(iter(reply.content.metric_records.values()), None)
    if metrics is None or "train_loss" not in metrics:
        raise ValueError("secagg_mod: the server asks for the train loss, and the train reply has no 'train_loss' "
                         "metric")
    return float(metrics["train_loss"])


def sum_metrics(total_weight: int, loss: float | None) -> MetricRecord:
    """The one reply's metrics under secure aggregation: the survivors' total weight
    (``num-examples``) and, where the nodes sent it, their weighted mean ``train_loss``."""
    return MetricRecord({"num-examples": int(total_weight), **({} if loss is None else {"train_loss": float(loss)})})


def payload_vector(p: Payload) -> tuple[np.ndarray, ConfigRecord]:
    """A linear codec's payload as the vector a node masks (its one array, flat, float64) and
    its spec (:data:`SPEC_RECORD`): the one layout the in-process node (:func:`payload_of`) and
    the batched engine's direct sum (:mod:`fedswarm.sim.batched_secagg_codec`) use."""
    if len(p.arrays) != 1:
        raise ValueError(f"secagg_mod: a payload under secure aggregation holds one array, got {sorted(p.arrays)}")
    (key, arr), = p.arrays.items()
    arr = np.asarray(arr)
    spec = ConfigRecord({"key": key, "shape": [int(s) for s in arr.shape], "dtype": str(arr.dtype),
                         "meta": json.dumps(dict(p.meta), sort_keys=True)})
    return arr.reshape(-1).astype(np.float64), spec


def check_specs(specs: Mapping[int, ConfigRecord | None], dim: int) -> ConfigRecord:
    """The survivors' common spec; ValueError when one is missing, they differ, or its shape
    is not ``dim`` values."""
    if not specs:
        raise ValueError("secagg: no survivor sent a payload spec")
    missing = sorted(n for n, s in specs.items() if s is None)
    if missing:
        raise ValueError(f"secagg: nodes {missing} sent a masked input without its payload spec")
    seen = {json.dumps(dict(s), sort_keys=True) for s in specs.values()}
    if len(seen) != 1:
        raise ValueError(f"secagg: the survivors' payload specs differ ({len(seen)} kinds): their sum has no meaning")
    spec = next(iter(specs.values()))
    if math.prod(int(s) for s in spec["shape"]) != dim:
        raise ValueError(f"secagg: the payload's shape {list(spec['shape'])} is not the {dim} values masked")
    return spec


def payload_reply(mean: np.ndarray, spec: ConfigRecord) -> RecordDict:
    """The strategy's one reply content: the payload whose array is ``mean`` (the weighted
    mean of the survivors' arrays), shaped and typed as ``spec`` says."""
    arr = np.asarray(mean).astype(np.dtype(str(spec["dtype"]))).reshape([int(s) for s in spec["shape"]])
    return payload_to_records(Payload(arrays={str(spec["key"]): arr}, meta=json.loads(str(spec["meta"]))))
