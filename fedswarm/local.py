"""What a node does with a train message: read its config and partition, train locally.

Shared by fedswarm's ClientApp and by every strategy's client update, so each algorithm
adds only what it does differently (compress a delta, keep a residual, mix neighbours).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict

from fedswarm.config import RunConfig, round_seed
from fedswarm.errors import ConfigError
from fedswarm.policy import device_class_of, policy_for
from fedswarm.tasks.localdata import LocalDataError, LocalDataSpec
from fedswarm.train import LocalTrainer, TrainResult, trainer_for
from fedswarm.wire import arrayrecord_to_vector

__all__ = ["run_config_of", "node_partition", "node_data", "round_seed", "server_round", "local_fit", "LocalFit",
           "prepare_local", "LocalSetup", "node_report", "train_reply"]

_RUN_KEYS = set(RunConfig.allowed_keys())


def run_config_of(msg: Message, context: Context) -> RunConfig:
    flat = {k: v for k, v in context.run_config.items() if k in _RUN_KEYS or k.startswith("params.")}
    rec = msg.content.config_records.get("config")
    if rec is not None:
        flat.update({k: v for k, v in rec.items() if k in _RUN_KEYS or k.startswith("params.")})
    if context.node_config.get("device"):  # the node's own hardware (fedswarm client --device) over the run's
        flat["device"] = str(context.node_config["device"])
    return RunConfig.from_flat(flat)


def node_partition(context: Context, cfg: RunConfig) -> tuple[int, int]:
    """The node's (partition-id, num-partitions). A node with its own data (``data-path``)
    trains on that; its partition-id (default 0 of 1) then only names it: its round seed and
    its place in a gossip topology."""
    nc = context.node_config
    if "partition-id" not in nc and "data-path" in nc:
        return 0, 1
    if "partition-id" not in nc:
        raise ConfigError("this node has no 'partition-id' in its node config "
                          "(start it with fedswarm client --partition-id N --num-partitions M)")
    return int(nc["partition-id"]), int(nc.get("num-partitions", cfg.clients))


def node_data(context: Context) -> LocalDataSpec | None:
    """The node's own dataset from its node config (``data-path``, ``label-column``,
    ``val-fraction``; set by ``fedswarm client --data``), or None: it trains on a partition."""
    nc = context.node_config
    if not nc.get("data-path"):
        return None
    try:
        return LocalDataSpec(str(nc["data-path"]), str(nc.get("label-column", "label")),
                             float(nc.get("val-fraction", 0.2)))
    except ValueError:
        raise LocalDataError(f"node config: val-fraction {nc.get('val-fraction')!r} is not a number") from None


def server_round(msg: Message) -> int:
    rec = msg.content.config_records.get("config")
    return int(rec.get("server-round", 0)) if rec is not None else 0


@dataclass
class LocalFit:
    """What one node's local training round produced, and under which policy."""

    cfg: RunConfig
    trainer: LocalTrainer
    start: torch.Tensor  # the parameters the round started from, [d]
    result: TrainResult
    device_class: str
    policy: dict[str, Any]

    probe: dict[str, Any] | None = None

    def report(self) -> ConfigRecord:
        """The reply's ``node`` record: the class and policy this node trained under, and on
        a real device (node config ``probe=true``, set by ``fedswarm client``) what it runs on."""
        rec = node_report(self.device_class, json.dumps(self.policy, sort_keys=True))
        skipped = getattr(self.trainer, "skipped_examples", 0)  # a Flower user's own model (the mod) has none
        if skipped:  # a node's own data: examples it could not read
            rec["skipped_examples"] = int(skipped)
        if self.probe is not None:  # with the device it trained on (fedswarm client --device)
            rec["probe"] = json.dumps({**self.probe, "train_device": str(self.trainer.device)}, sort_keys=True)
        return rec


    def reply(self, content: RecordDict, **metrics: float) -> RecordDict:
        """:func:`train_reply` of this round's result, with its :meth:`report` (and DP-SGD's
        ``dp_sample_rate``, what the server's accountant needs)."""
        res = self.result
        if res.dp_sample_rate is not None:
            metrics["dp_sample_rate"] = res.dp_sample_rate
        return train_reply(content, res.num_examples, res.loss, res.steps, self.report(), **metrics)


def node_report(device_class: str, policy_json: str, **extra: int | str) -> ConfigRecord:
    """A train reply's ``node`` record: the device class and the policy (JSON, sorted keys)
    the node trained under, then ``extra`` (``partition-id``, ...). Every engine builds it
    here, so the bytes the batched engine meters are those a ClientApp sends."""
    return ConfigRecord({"device_class": device_class, "policy": policy_json, **extra})


def train_reply(content: RecordDict, num_examples: int, loss: float, steps: int, node: ConfigRecord,
                **metrics: float) -> RecordDict:
    """Complete a train reply: ``content`` (what the algorithm sends: a model, a payload, a
    delta) gets its ``metrics`` record (``num-examples``, ``train_loss``, ``steps``, then
    ``metrics``) and its ``node`` record (:func:`node_report`). Every client half and every
    engine that meters a reply it does not send builds it here."""
    content["metrics"] = MetricRecord({"num-examples": num_examples, "train_loss": loss, "steps": steps, **metrics})
    content["node"] = node
    return content


@dataclass
class LocalSetup:
    """What a node knows before it trains: config, trainer, the round's start parameters,
    its class and policy, and the local-SGD arguments its policy gives."""

    cfg: RunConfig
    trainer: LocalTrainer
    start: torch.Tensor  # [d]
    device_class: str
    policy: dict[str, Any]
    fit_kwargs: dict[str, Any]

    def report(self, result: TrainResult) -> ConfigRecord:
        """The reply's ``node`` record (class and policy trained under)."""
        return LocalFit(self.cfg, self.trainer, self.start, result, self.device_class, self.policy).report()


def prepare_local(msg: Message, context: Context, vector: torch.Tensor | None = None,
                  partition: int | None = None) -> LocalSetup:
    """The first half of :func:`fedswarm.local.local_fit`, without training: the same
    config, partition, policy and local-SGD arguments, for client updates that must change
    the model before they train (freeze variables, swap in a sub-model). ``vector`` is the
    round's start parameters if the caller read them itself (else the message's first
    ArrayRecord, checked against the model's size). ``partition`` trains on another
    partition than the node's own (redundant data assignment: Draco, Solon); the seed is
    then that partition's, so every node that holds it computes the same update.

    A ``byzantine`` record in the message (a data-poisoning attack, added on the way by
    :class:`fedswarm.server.byzantine.ByzantineGrid`) flips the labels this node trains
    on; ``dp_sgd`` in the run config trains with per-example clipping and noise."""
    cfg = run_config_of(msg, context)
    own, n = node_partition(context, cfg)
    pid = own if partition is None else int(partition)
    device_class = device_class_of(context.node_config, cfg.devices, own, n)
    rec = msg.content.config_records.get("config")
    policy = policy_for(rec, device_class) if rec is not None else {}
    poison = msg.content.config_records.get("byzantine")
    label_flip = poison is not None and str(poison.get("attack", "")) == "labelflip"
    local = node_data(context) if partition is None else None
    trainer = trainer_for(cfg, pid, n, label_flip=label_flip, local=local)
    if vector is None:
        vector = arrayrecord_to_vector(next(iter(msg.content.array_records.values())), trainer.layout.d)
    # Same reading of the policy as local_fit: epochs without steps means epochs.
    steps = policy.get("local_steps", None if "local_epochs" in policy else cfg.local_steps)
    kwargs = dict(epochs=policy.get("local_epochs", cfg.local_epochs), steps=steps,
                  batch_size=policy.get("batch_size", cfg.batch_size), lr=policy.get("lr", cfg.lr),
                  momentum=cfg.momentum, seed=round_seed(cfg.seed, server_round(msg), pid))
    if cfg.dp_sgd:
        kwargs["dp"] = cfg.dp_sgd  # parsed by the config
    return LocalSetup(cfg, trainer, vector, device_class, policy, kwargs)


def local_fit(msg: Message, context: Context) -> LocalFit:
    """Shared first half of every client update: read config, partition and this node's
    device-class policy, then run local SGD from the message's parameters."""
    setup = prepare_local(msg, context)
    res = setup.trainer.fit(setup.start, **setup.fit_kwargs)
    cfg, trainer, flat, device_class, policy = setup.cfg, setup.trainer, setup.start, setup.device_class, setup.policy
    probe = _device_probe() if str(context.node_config.get("probe", "")).lower() == "true" else None
    return LocalFit(cfg, trainer, flat, res, device_class, policy, probe)


_PROBE: dict[str, Any] | None = None


def _device_probe() -> dict[str, Any]:
    """This device's probe (accelerator, memory, a measured step time), measured once."""
    global _PROBE
    if _PROBE is None:
        from fedswarm.probe import probe

        _PROBE = probe(measure=True)
    return _PROBE
