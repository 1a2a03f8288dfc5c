"""The one builder of a train reply's metered records (fedswarm.local.train_reply / node_report),
against the records written out by hand: what a ClientApp sends and the batched engine meters."""

from __future__ import annotations

import json

import numpy as np
from flwr.app import Array, ArrayRecord, RecordDict

from fedswarm.local import node_report, train_reply


def test_train_reply_records():
    arrays = ArrayRecord({"vector": Array(np.zeros(3, np.float32))})
    policy = json.dumps({"lr": 0.1}, sort_keys=True)
    content = train_reply(RecordDict({"arrays": arrays}), 5, 0.25, 3,
                          node_report("edge", policy, **{"partition-id": 2}), skipped_examples=1)
    assert list(content.keys()) == ["arrays", "metrics", "node"]
    assert dict(content.metric_records["metrics"]) == {"num-examples": 5, "train_loss": 0.25, "steps": 3,
                                                       "skipped_examples": 1}
    assert dict(content.config_records["node"]) == {"device_class": "edge", "policy": '{"lr": 0.1}',
                                                    "partition-id": 2}

