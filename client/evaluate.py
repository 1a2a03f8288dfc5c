"""Federated evaluation on the node, and the device telemetry of its train replies.

A node of a round's evaluation cohort gets an ``evaluate`` message from the server
(:mod:`fedswarm.server.fed_eval`) after the round: it scores the model the message carries
(the new global model) or, for a decentralized strategy (config ``fed-eval-own``), its own
model from its state, on its local validation split, and replies ``eval_loss``,
``eval_accuracy`` and ``num-examples``. The split of a node with no data of its own is its
share of the task's held-out test set (:func:`fedswarm.train.node_validation`).

Every train reply gets a ``report.telemetry`` record (:mod:`fedswarm.telemetry`): training
seconds, examples per second, peak memory, the device, battery and temperature where the OS
exposes them. ``report.*`` records are monitoring: the server's MeteredGrid counts them apart
from the algorithm's ``bytes_up``.
"""

from __future__ import annotations

import time

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict

from fedswarm.local import node_data, node_partition, run_config_of
from fedswarm.protocol import OWN_MODEL_KEY, TELEMETRY_RECORD
from fedswarm.telemetry import round_telemetry
from fedswarm.train import examples_seen, node_validation, trainer_for
from fedswarm.wire import arrayrecord_to_vector

__all__ = ["evaluate_on_node", "TrainClock", "answer_telemetry"]



def evaluate_on_node(msg: Message, context: Context) -> RecordDict:
    """Score the message's model (or the node's own) on this node's validation split."""
    cfg = run_config_of(msg, context)
    pid, n = node_partition(context, cfg)
    local = node_data(context)  # the node's own dataset (fedswarm client --data), or None
    trainer = trainer_for(cfg, pid, n, local=local)
    conf = msg.content.config_records.get("config")
    if conf is not None and bool(conf.get(OWN_MODEL_KEY, False)):
        from fedswarm.strategies.decentralized.node import own_model

        flat = own_model(context, trainer.layout.d)
        if flat is None:
            raise RuntimeError("federated evaluation of the node's own model: this node holds no model yet")
    else:
        if not msg.content.array_records:
            raise ValueError("federated evaluation: the evaluate message carries no model")
        flat = arrayrecord_to_vector(next(iter(msg.content.array_records.values())), trainer.layout.d)
    x, y = node_validation(cfg, pid, n, local)
    loss, acc = trainer.evaluate(flat, x, y)
    return RecordDict({"metrics": MetricRecord({"eval_loss": float(loss), "eval_accuracy": float(acc),
                                                "num-examples": int(x.shape[0])})})


def answer_telemetry(msg: Message, context: Context) -> RecordDict:
    """The eligibility probe (:mod:`fedswarm.server.fleet_grid`): this node's telemetry now (no
    training: no ``train_s`` speed) and its device class and partition id, and nothing else."""
    from fedswarm.policy import device_class_of

    cfg = run_config_of(msg, context)
    pid, n = node_partition(context, cfg)
    tel = round_telemetry(0.0, 0)
    tel.pop("train_s", None)
    node = ConfigRecord({"device_class": device_class_of(context.node_config, cfg.devices, pid, n),
                         "partition-id": int(pid)})
    return RecordDict({TELEMETRY_RECORD: ConfigRecord(tel), "node": node})


class TrainClock:
    """Times one client update (its whole local work: in a process's first round that includes
    loading its data) and counts the examples its local SGD processed."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.seen0 = examples_seen()

    def attach(self, content: RecordDict) -> RecordDict:
        """Add the round's telemetry record to a train reply's content."""
        train_s = time.perf_counter() - self.t0
        seen = examples_seen() - self.seen0
        tel = round_telemetry(train_s, seen)  # no examples counted (DP-SGD): no speed
        content[TELEMETRY_RECORD] = ConfigRecord(tel)
        return content
