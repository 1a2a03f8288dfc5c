"""The batched engine across a Ray cluster: ``fedswarm sim --engine batched --ray-address
HOST:PORT [--workers N]``.

Each round's cohort is split across N workers, each client always on the same one (client
``p`` on worker ``p mod N``: sticky, so what a client keeps between rounds, an error-feedback
residual or a sketch client's memory, stays on its worker in arrays of its own,
:class:`~fedswarm.sim.batched_round.ClientRows`). A worker
(:class:`ShardWorker`) holds the run's :class:`~fedswarm.sim.batched_trainer.BatchedTrainer`,
built from the config on its own machine (no data is shipped), and runs the batched trainer on
its shard; the driver keeps the strategy and reduces what it needs:

- FedAvg (runner ``weighted_mean``): each worker sends its shard's weighted sum ``[d]``
  (float64), its examples and losses; the driver adds the sums (:class:`ShardedTrainer` stands
  in for the trainer in FedAvg's own round, :func:`fedswarm.sim.batched._one_round`). With
  ``--dp`` each worker sums its clients' clipped changes and counts those within the norm; the
  driver adds both and noises the total once (the strategy's mechanism, adaptive clipping too).
- the codec strategies (``compressed_fedavg``, ``onebit``, the robust rules; runner ``codec``),
  ``gtopk`` (runner ``global_topk``: the ``select`` record the server sent each client, what
  it used of that client's last top-k, goes to the worker that keeps its accumulator) and the
  one-exchange Count-Sketch one (``fetchsgd``; runner ``sketch``): each worker runs the
  strategy's own client half on its shard (the runner's ``_client_step``, with its clients'
  state) and sends the batched payloads (top-k indices and values, sketches): the driver
  gathers them, reads them as the server reads every reply and hands them to the strategy
  (its robust rule, its sketch sum, its top-k), as :class:`CompressedRounds` does in one process.
  ``--byzantine`` is the driver's too: the gathered replies pass the attack before the rule reads
  them (``labelflip``'s clients train on flipped labels on the workers that own them); ``--dp``'s
  clients clip on the workers, the strategy object noises on the driver.

Federated evaluation is sharded too: each worker scores the cohort's clients it owns on their
validation splits (:meth:`_Sharded.score_cohort`, the engine's
:class:`~fedswarm.sim.batched_eval.CohortEvaluator` calls it) and the driver puts the arrays
together (a task with an accuracy of its own, or ``--client-data``, is scored node by node on
the driver, as in one process).

The same seed gives the same model as one process: the same clients, schedules and seeds; only
the order in which the float64 sums are added differs (tests hold the two to 1e-5). What a
round moves to and from the workers is metered (the pickled size of the arguments and of the
replies) and its time beside the workers' own compute: each round's row carries
``shard_bytes_out``, ``shard_bytes_in``, ``shard_wait_s`` and ``shard_compute_s``, and the
evaluation's the same four prefixed ``eval_``.

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
SHARDED_RUNNERS = ("weighted_mean", "codec", "global_topk", "sketch")


# -- which runs -------------------------------------------------------------------------------------

#: Why a round runner is not sharded (the one-line refusal names it).
_NOT_SHARDED = {
    "variable_subsets": "its clients train sub-models of their own subsets, a round runner the workers do not run",
    "stages": "its clients train the stage's sub-model, a round runner the workers do not run",
    "fedbuff": "its asynchronous aggregations train clients in waves the workers do not run",
}


def _why_not(entry: registry.StrategyEntry) -> str | None:
    """Why the sharded path does not run ``entry`` (None: it does)."""
    runner = entry.batched.runner if entry.batched is not None else None
    if runner == "sketch":
        from fedswarm.strategies.federated.sketched import SKETCH_CLIENTS

        if SKETCH_CLIENTS[entry.name].prefix is not None:
            return "it asks the round's clients a second time (their exact values), which the workers do not answer"
        return None
    if runner in SHARDED_RUNNERS:
        return None
    return _NOT_SHARDED.get(runner, "its round runner is not one the workers run")  # type: ignore[arg-type]


def _serves(entry: registry.StrategyEntry) -> bool:
    return entry.batched is not None and _why_not(entry) is None


def sharded_names() -> list[str]:
    """The strategies ``--engine batched --ray-address`` runs, in registration order."""
    return [e.name for e in registry.entries(registered=True) if _serves(e)]


def check_sharded(cfg: RunConfig, *, need_address: bool = True) -> None:
    """Raise a one-line :class:`ConfigError` for a run the sharded batched engine cannot do
    (``need_address``: the run makes its own Ray pool, so it needs ``--ray-address``)."""
    if need_address and not cfg.ray_address:
        raise ConfigError("--workers splits the batched engine's cohort across Ray actors: give --ray-address "
                          "HOST:PORT too")
    entry = registry.get(cfg.strategy)
    if not _serves(entry):
        raise ConfigError(f"--engine batched --ray-address runs {', '.join(sharded_names())}; strategy "
                          f"'{cfg.strategy}' runs on --engine batched without --ray-address ({_why_not(entry)})")
    if cfg.secagg and entry.batched.runner == "weighted_mean":
        raise ConfigError("--engine batched --ray-address --secagg runs the codec strategies (their payloads come back "
                          "to the driver): FedAvg's shards send back only their sums, and a secure sum needs each "
                          "node's update; drop --ray-address")
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
    flip = None if sched.flip_labels is None else sched.flip_labels[idx]  # --byzantine labelflip's clients
    return ClientSchedule(*(getattr(sched, f)[idx] for f in ("partitions", "steps", "batch_size", "lr", "seeds")),
                          flip_labels=flip)


# -- the driver's half -----------------------------------------------------------------------------------

class _Sharded:
    """What the sharded round runners share: the pool's figures in the round's row, and federated
    evaluation on the workers (the engine's evaluator calls :meth:`score_cohort`, after the round)."""

    pool: _Pool

    def _taken(self, row: dict) -> dict:
        row.update(self.pool.take())
        self._row = row  # the round's row, which the evaluation's figures join before it is recorded
        return row

    def score_cohort(self, vec: torch.Tensor, pids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`~fedswarm.sim.batched_eval.CohortEvaluator.score` of the cohort ``pids``: each
        worker scores the clients it owns on their validation splits, the driver puts the arrays
        back in cohort order. What it moved joins the round's row as ``eval_shard_*``."""
        shards = shard_positions(pids, self.pool.workers)
        out = self.pool.call("score", [(vec, pids[pos]) if len(pos) else None for pos in shards])
        loss, acc = np.empty(len(pids)), np.empty(len(pids))
        n = np.empty(len(pids), dtype=np.int64)
        for pos, r in zip(shards, out):
            if r is not None:
                loss[pos], acc[pos], n[pos] = r["loss"], r["acc"], r["n"]
        row = getattr(self, "_row", None)  # the round just run (an evaluation before any round: the next one's)
        if row is not None:
            row.update({f"eval_{k}": v for k, v in self.pool.take().items()})
        return loss, acc, n


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
        k = schedule.partitions.numel()
        if k == 0:
            return
        shards = shard_positions(schedule.partitions.numpy(), self.pool.workers)
        out = self.pool.call("average", [None if not len(pos) else
                                         (start, _sub_schedule(schedule, pos), weights[torch.from_numpy(pos)],
                                          momentum, per_client_loss, clip) for pos in shards])
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
            if within is not None:  # --dp: the changes within the clip norm, counted where they were clipped
                within[0] += r["within"]
            diverged.update({int(pos[j]): model for j, model in r["diverged"].items()})
        yield slice(0, k), total, loss, n, loss_wsum, diverged
        if on_chunk is not None:
            on_chunk(k)


class _ShardedReplies(_Sharded):
    """A compressed runner's round with its clients trained on the workers: the hook
    ``_train_replies`` gathers the shards' payloads and makes each client's reply on the
    driver (read as the server reads it, its bytes measured), the rest of the round unchanged."""

    def round(self, server_round: int):
        row, node_rows = super().round(server_round)  # type: ignore[misc]
        return self._taken(row), node_rows

    def _train_replies(self, x, sched, messages, node_ids, classes, pols, policy_json, total):
        from fedswarm.sim.batched_compressed import sent_rows
        from fedswarm.strategies.federated.compressed_base import KNOBS, SELECT

        knobs = messages[0].content.config_records[KNOBS]
        shards = shard_positions(sched.partitions.numpy(), self.pool.workers)
        out = self.pool.call("client_round", [None if not len(pos) else
                                              (x, _sub_schedule(sched, pos), knobs, [pols[int(k)] for k in pos],
                                               _selects([messages[int(k)] for k in pos], SELECT))
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
        return self._measured(messages, replies)

    def _group_values(self, payload, seed: int, rows: int) -> list:
        """What the server's ``parse_reply`` makes of each row of a batched codec payload."""
        out = torch.empty(rows, self.layout.d)
        self._decode(payload, list(range(rows)), seed, out)
        return list(out)


def _selects(messages: list, key: str) -> list | None:
    """The ``select`` record of each train message (what the server used of a client's last
    message: gTop-k's), None where it has none; None when none has one."""
    out = [m.content.config_records.get(key) for m in messages]
    return out if any(s is not None for s in out) else None


class _ShardedFedAvg(_Sharded):
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
        return self._taken(row), node_rows


def sharded_runner(strategy: str, pool: _Pool) -> Callable[..., Any]:
    """The round runner of ``strategy`` with its cohort on ``pool``'s workers: called as a
    round runner class, ``(run, model, notes=...)``."""
    from fedswarm.sim.batched import round_runner
    from fedswarm.sim.batched_gtopk import GTopKRounds
    from fedswarm.sim.batched_sketched import SketchRounds

    entry = registry.get(strategy)
    if entry.batched.runner == "weighted_mean":
        return partial(_ShardedFedAvg, pool=pool)
    base = round_runner(entry)
    if issubclass(base, SketchRounds):
        def values(self, payload, seed, rows):  # what SketchStrategy.parse_reply returns: the table
            return [t.to(torch.float32).clone() for t in payload.arrays["table"]]
        extra = {"_group_values": values}
    elif issubclass(base, GTopKRounds):
        def values(self, payload, seed, rows):  # what GlobalTopK.parse_reply returns: indices and values
            return [(i.to(torch.int64), v.to(torch.float32))
                    for i, v in zip(payload.arrays["indices"], payload.arrays["values"])]
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
