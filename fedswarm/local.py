"""What a node does with a train message: read its config and partition, train locally.

Shared by fedswarm's ClientApp and by every strategy's client update, so each algorithm
adds only what it does differently (compress a delta, keep a residual, mix neighbours).
"""

from __future__ import annotations

import torch
from flwr.app import Context, Message

from fedswarm.config import ConfigError, RunConfig
from fedswarm.train import LocalTrainer, TrainResult, trainer_for
from fedswarm.wire import arrayrecord_to_vector

__all__ = ["run_config_of", "node_partition", "round_seed", "server_round", "local_fit"]

_RUN_KEYS = set(RunConfig.allowed_keys())


def run_config_of(msg: Message, context: Context) -> RunConfig:
    flat = {k: v for k, v in context.run_config.items() if k in _RUN_KEYS or k.startswith("params.")}
    rec = msg.content.config_records.get("config")
    if rec is not None:
        flat.update({k: v for k, v in rec.items() if k in _RUN_KEYS or k.startswith("params.")})
    return RunConfig.from_flat(flat)


def node_partition(context: Context, cfg: RunConfig) -> tuple[int, int]:
    nc = context.node_config
    if "partition-id" not in nc:
        raise ConfigError("this node has no 'partition-id' in its node config "
                          "(start it with fedswarm client --partition-id N --num-partitions M)")
    return int(nc["partition-id"]), int(nc.get("num-partitions", cfg.clients))


def round_seed(seed: int, server_round: int, partition_id: int) -> int:
    """The seed of one node's local training in one round: equal on every engine."""
    return (seed * 1_000_003 + server_round * 10_007 + partition_id) % (2**31 - 1)


def server_round(msg: Message) -> int:
    rec = msg.content.config_records.get("config")
    return int(rec.get("server-round", 0)) if rec is not None else 0


def local_fit(msg: Message, context: Context) -> tuple[RunConfig, LocalTrainer, "torch.Tensor", TrainResult]:
    """Shared first half of every client update: (config, trainer, start vector, result)."""
    cfg = run_config_of(msg, context)
    pid, n = node_partition(context, cfg)
    trainer = trainer_for(cfg, pid, n)
    flat = arrayrecord_to_vector(next(iter(msg.content.array_records.values())), trainer.layout.d)
    res = trainer.fit(flat, epochs=cfg.local_epochs, steps=cfg.local_steps, batch_size=cfg.batch_size,
                      lr=cfg.lr, momentum=cfg.momentum, seed=round_seed(cfg.seed, server_round(msg), pid))
    return cfg, trainer, flat, res


