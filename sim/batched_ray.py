"""The batched engine across a Ray cluster: ``fedswarm sim --engine batched --ray-address
HOST:PORT [--workers N]``.

Each round's cohort is split across N workers, each client always on the same one (client
``p`` on worker ``p mod N``: sticky, so what a client keeps between rounds, an error-feedback
residual or a sketch client's ``Context``, stays on its worker in a
:class:`~fedswarm.sim.batched_round.ClientRows` of its own). A worker
(:class:`ShardWorker`) holds the run's :class:`~fedswarm.sim.batched_trainer.BatchedTrainer`,
built from the config on its own machine (no data is shipped), and runs the batched trainer on
its shard; the driver keeps the strategy and reduces what it needs:

- FedAvg (runner ``weighted_mean``): each worker sends its shard's weighted sum ``[d]``
  (float64), its examples and losses; the driver adds the sums (:class:`ShardedTrainer` stands
  in for the trainer in FedAvg's own round, :func:`fedswarm.sim.batched._one_round`).
- the codec strategies (``compressed_fedavg``, ``onebit``, the robust rules; runner ``codec``)
  and the one-exchange Count-Sketch one (``fetchsgd``; runner ``sketch``): each worker runs the
  strategy's own client half on its shard (the runner's ``_client_step``, with its clients'
  state) and sends the batched payloads (top-k indices and values, sketches): the driver
  gathers them, reads them as the server reads every reply and hands them to the strategy
  (its robust rule, its sketch sum, its top-k), as :class:`CompressedRounds` does in one process.

The same seed gives the same model as one process: the same clients, schedules and seeds; only
the order in which the float64 sums are added differs (tests hold the two to 1e-5). What a
round moves to and from the workers is metered (the pickled size of the arguments and of the
replies) and its time beside the workers' own compute: each round's row carries
``shard_bytes_out``, ``shard_bytes_in``, ``shard_wait_s`` and ``shard_compute_s``.

The workers are a pool (:mod:`fedswarm.sim.batched_ray_workers`): :class:`LocalPool` runs
them in this process (the tests' oracle of the sharding and reduction math, without Ray),
:class:`RayPool` as Ray actors (one CPU each, spread over the cluster's nodes). Ray is
imported by :class:`RayPool` only: without ``--ray-address`` nothing of Ray is imported.
What the sharded path does not run is refused in one line by :func:`check_sharded`.
"""

from __future__ import annotations

import copy
from functools import partial
from typing import Any, Callable

import numpy as np
import torch

from fedswarm.config import RunConfig
from fedswarm.errors import ConfigError
from fedswarm.sim.batched_ray_workers import LocalPool, RayPool, ShardWorker, _Pool
from fedswarm.strategies import registry

__all__ = ["DEFAULT_WORKERS", "SHARDED_RUNNERS", "check_sharded", "sharded_names", "owner_of", "shard_positions",
           "ShardWorker", "LocalPool", "RayPool", "ShardedTrainer", "sharded_runner", "run_batched_ray"]

#: ``--workers`` when not given.
DEFAULT_WORKERS = 2
#: The round runners (:data:`fedswarm.sim.batched.ROUND_RUNNERS`) the sharded path serves.
SHARDED_RUNNERS = ("weighted_mean", "codec", "sketch")


# -- which runs -------------------------------------------------------------------------------------

def _serves(entry: registry.StrategyEntry) -> bool:
    if entry.batched is None or entry.batched.runner not in SHARDED_RUNNERS:
        return False
    if entry.batched.runner == "sketch":  # a second exchange in the round asks the clients again: not here
        from fedswarm.strategies.federated.sketched import SKETCH_CLIENTS

        return SKETCH_CLIENTS[entry.name].prefix is None
    return True


def sharded_names() -> list[str]:
    """The strategies ``--engine batched --ray-address`` runs, in registration order."""
    return [e.name for e in registry.entries(registered=True) if _serves(e)]


def check_sharded(cfg: RunConfig, *, need_address: bool = True) -> None:
    """Raise a one-line :class:`ConfigError` for a run the sharded batched engine cannot do
    (``need_address``: the run makes its own Ray pool, so it needs ``--ray-address``)."""
    if need_address and not cfg.ray_address:
        raise ConfigError("--workers splits the batched engine's cohort across Ray actors: give --ray-address "
                          "HOST:PORT too")
    if not _serves(registry.get(cfg.strategy)):
        raise ConfigError(f"--engine batched --ray-address runs {', '.join(sharded_names())}; strategy "
                          f"'{cfg.strategy}' runs on --engine batched without --ray-address")
    if cfg.secagg and registry.get(cfg.strategy).batched.runner == "weighted_mean":
        raise ConfigError("--engine batched --ray-address --secagg runs the codec strategies (their payloads come back "
                          "to the driver): FedAvg's shards send back only their sums, and a secure sum needs each "
                          "node's update; drop --ray-address")
    for flag, given in (("--dp", cfg.dp), ("--byzantine", cfg.byzantine)):
        if given:
            raise ConfigError(f"--engine batched --ray-address does not run {flag}; drop --ray-address")
    if cfg.device != "cpu":
        raise ConfigError(f"--engine batched --ray-address trains on the actors' CPUs; --device '{cfg.device}' "
                          "runs without --ray-address")


# -- the sharding --------------------------------------------------------------------------------------

def owner_of(partitions: np.ndarray, workers: int) -> np.ndarray:
    """The worker of each client (partition id): ``p mod workers``, the same every round."""
    return np.asarray(partitions, dtype=np.int64) % workers


def shard_positions(partitions: np.ndarray, workers: int) -> list[np.ndarray]:
    """For each worker, the positions in the round's cohort of the clients it owns, in order."""
    owner = owner_of(partitions, workers)
    return [np.nonzero(owner == w)[0] for w in range(workers)]


def _sub_schedule(sched, pos: np.ndarray):
    from fedswarm.sim.batched_trainer import ClientSchedule

    idx = torch.from_numpy(pos)
    return ClientSchedule(*(getattr(sched, f)[idx] for f in ("partitions", "steps", "batch_size", "lr", "seeds")))


# -- the driver's half -----------------------------------------------------------------------------------

class ShardedTrainer:
    """The trainer FedAvg's round sees: :meth:`average` over the whole cohort as one chunk,
    its sum added up from the workers' shards; the rest is the driver's trainer."""

    def __init__(self, trainer, pool: _Pool):
        self._trainer = trainer
        self.pool = pool

    def __getattr__(self, name: str) -> Any:
        return getattr(self._trainer, name)

    def average(self, start, schedule, weights, *, momentum=0.0, chunk_size=None, memory_budget=None, on_chunk=None,
                per_client_loss=True, clip=None, within=None):
        if clip is not None:  # pragma: no cover - check_sharded refuses --dp
            raise ConfigError("--engine batched --ray-address does not run --dp")
        k = schedule.partitions.numel()
        if k == 0:
            return
        shards = shard_positions(schedule.partitions.numpy(), self.pool.workers)
        out = self.pool.call("average", [None if not len(pos) else
                                         (start, _sub_schedule(schedule, pos), weights[torch.from_numpy(pos)],
                                          momentum, per_client_loss) for pos in shards])
        total = torch.zeros(self._trainer.layout.d, dtype=torch.float64)
        loss = torch.zeros(k) if per_client_loss else None
        n = torch.zeros(k, dtype=torch.int64)
        loss_wsum, diverged = 0.0, {}
        for pos, r in zip(shards, out):
            if r is None:
                continue
            idx = torch.from_numpy(pos)
            total += r["sum"]
            n[idx] = r["n"]
            if r["loss"] is not None:
                loss = torch.zeros(k) if loss is None else loss
                loss[idx] = r["loss"]
            loss_wsum += r["loss_wsum"]
            diverged.update({int(pos[j]): model for j, model in r["diverged"].items()})
        yield slice(0, k), total, loss, n, loss_wsum, diverged
        if on_chunk is not None:
            on_chunk(k)


class _ShardedReplies:
    """A compressed runner's round with its clients trained on the workers: the hook
    ``_train_replies`` gathers the shards' payloads and makes each client's reply on the
    driver (read as the server reads it, its bytes measured), the rest of the round unchanged."""

    pool: _Pool

    def round(self, server_round: int):
        row, node_rows = super().round(server_round)  # type: ignore[misc]
        row.update(self.pool.take())
        return row, node_rows

    def _train_replies(self, x, sched, messages, node_ids, classes, pols, policy_json, total):
        from fedswarm.sim.batched_compressed import sent_rows
        from fedswarm.strategies.federated.compressed_base import KNOBS

        knobs = messages[0].content.config_records[KNOBS]
        shards = shard_positions(sched.partitions.numpy(), self.pool.workers)
        out = self.pool.call("client_round", [None if not len(pos) else
                                              (x, _sub_schedule(sched, pos), knobs, [pols[int(k)] for k in pos])
                                              for pos in shards])
        replies = []
        for pos, r in zip(shards, out):
            if r is None:
                continue
            sent: dict[int, tuple] = {}
            for payload, members, seed in r["groups"]:
                values = self._group_values(payload, seed, len(members))
                for j, row, value in zip(members, sent_rows(payload, seed), values):
                    sent[j] = (row, value)
            for reply in r["replies"]:
                j, n = reply[0], reply[1]
                k = int(pos[j])
                if len(reply) == 3:  # its code raised on the worker: the reason names it (its traceback stayed there)
                    try:
                        raise reply[2]
                    except Exception as exc:  # noqa: BLE001 - any exception of a client's code, as in one process
                        replies.append(self._error_reply(messages, node_ids, classes, k, n, exc))
                else:
                    row, value = sent[j]
                    replies.append(self._reply(messages, node_ids, classes, policy_json, k, row, n, reply[2],
                                               reply[3], value))
        self.run.progress(total)(total)
        return replies

    def _group_values(self, payload, seed: int, rows: int) -> list:
        """What the server's ``parse_reply`` makes of each row of a batched codec payload."""
        out = torch.empty(rows, self.layout.d)
        self._decode(payload, list(range(rows)), seed, out)
        return list(out)


class _ShardedFedAvg:
    """FedAvg's round with :class:`ShardedTrainer`; its row carries the pool's figures."""

    def __init__(self, run, model, notes=None, *, pool: _Pool):
        from fedswarm.sim.batched import FedAvgRounds

        sharded = copy.copy(run)
        sharded.trainer = ShardedTrainer(run.trainer, pool)
        self.inner = FedAvgRounds(sharded, model, notes)
        self.pool = pool

    @property
    def model(self):
        return self.inner.model

    def round(self, server_round: int):
        row, node_rows = self.inner.round(server_round)
        row.update(self.pool.take())
        return row, node_rows


def sharded_runner(strategy: str, pool: _Pool) -> Callable[..., Any]:
    """The round runner of ``strategy`` with its cohort on ``pool``'s workers: called as a
    round runner class, ``(run, model, notes=...)``."""
    from fedswarm.sim.batched import round_runner
    from fedswarm.sim.batched_sketched import SketchRounds

    entry = registry.get(strategy)
    if entry.batched.runner == "weighted_mean":
        return partial(_ShardedFedAvg, pool=pool)
    base = round_runner(entry)
    if issubclass(base, SketchRounds):
        def values(self, payload, seed, rows):  # what SketchStrategy.parse_reply returns: the table
            return [t.to(torch.float32).clone() for t in payload.arrays["table"]]
        extra = {"_group_values": values}
    else:
        extra = {}
    cls = type(f"Sharded{base.__name__}", (_ShardedReplies, base), {"pool": pool, **extra})
    return cls


def run_batched_ray(cfg: RunConfig, *, store, run_id: str, listeners=None, on_clients=None, prepared=None,
                    memory_budget: int | None = None, chunk_size: int | None = None, pool: _Pool | None = None) -> str:
    """:func:`fedswarm.sim.batched.run_batched` with each round's cohort on ``cfg.workers`` Ray
    actors of the cluster at ``cfg.ray_address`` (``pool``: workers made already, a
    :class:`LocalPool` or a :class:`RayPool` that served other runs; the caller closes it).
    Returns the final status."""
    from fedswarm.sim.batched import run_batched
    from fedswarm.sim.batched_memory import parse_memory_budget

    check_sharded(cfg, need_address=pool is None)
    if memory_budget is None:
        memory_budget = parse_memory_budget(cfg.memory_budget)
    own = pool is None
    if own:
        pool = RayPool(cfg, cfg.workers or DEFAULT_WORKERS, memory_budget=memory_budget, chunk_size=chunk_size)
    try:
        pool.begin(cfg)
        return run_batched(cfg, store=store, run_id=run_id, listeners=listeners, on_clients=on_clients,
                           memory_budget=memory_budget, chunk_size=chunk_size, prepared=prepared,
                           runner=sharded_runner(cfg.strategy, pool))
    finally:
        if own:
            pool.close()
