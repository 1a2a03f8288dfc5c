"""The workers of the batched engine on Ray (:mod:`fedswarm.sim.batched_ray`) and their pools.

A :class:`ShardWorker` holds the run's batched trainer, built from the config where it runs,
and the state of the clients it owns; each round it trains its shard and runs the strategy's
client half on it (the strategy's round runner with its ``capture`` hook set: its own
``_train_replies`` and ``_client_step``, their payloads and figures kept for the driver). A pool
calls a method on every worker and meters what moves: :class:`LocalPool` in this process (the
tests' oracle, no Ray), :class:`RayPool` as Ray actors. Ray is imported by :class:`RayPool` only.
"""

from __future__ import annotations

import pickle
import socket
import sys
import time
from types import SimpleNamespace
from typing import Any, Callable

import torch

from fedswarm.config import RunConfig
from fedswarm.errors import ConfigError
from fedswarm.strategies import registry

__all__ = ["ShardWorker", "LocalPool", "RayPool"]


# -- a worker ---------------------------------------------------------------------------------------------

def _worker_trainer(cfg: RunConfig):
    """The run's batched trainer, built from ``cfg`` where the worker runs (its data, its partition)."""
    from fedswarm.sim.batched_trainer import BatchedTrainer
    from fedswarm.tasks import get_task
    from fedswarm.tasks.partition import partition_offsets
    from fedswarm.train import pooled_client_data, resolve_device, task_data

    data = task_data(cfg)
    if cfg.client_data:
        x, y, flat_idx, offsets = pooled_client_data(cfg)
    else:
        x, y = data.train_x, data.train_y
        flat_idx, offsets = partition_offsets(y.numpy(), cfg.partition, cfg.clients, cfg.seed)
    return BatchedTrainer(get_task(cfg.task), x, y, flat_idx, offsets, resolve_device(cfg.device),
                          model_seed=cfg.seed, num_classes=data.num_classes)


class ShardWorker:
    """One worker: the trainer and the state of the clients it owns in the current run
    (:meth:`begin` starts one: a pool's workers serve one run after another)."""

    def __init__(self, memory_budget: int | None = None, chunk_size: int | None = None, threads: int | None = None):
        if threads is not None:
            torch.set_num_threads(threads)
        self.memory_budget, self.chunk_size = memory_budget, chunk_size
        self.cfg: RunConfig | None = None

    def begin(self, cfg: RunConfig) -> None:
        """Start run ``cfg``: its trainer built here (its data, its partition), no client state yet;
        for a strategy whose clients send payloads, its round runner as its shards' client half
        (:attr:`~fedswarm.sim.batched_compressed.CompressedRounds.capture`)."""
        from fedswarm.server.app import strategy_for

        self.cfg = cfg
        self.trainer = _worker_trainer(cfg)
        self.run = SimpleNamespace(cfg=cfg, trainer=self.trainer, memory_budget=self.memory_budget,
                                   chunk_size=self.chunk_size, progress=lambda total: None,
                                   strategy=lambda: strategy_for(cfg, self.trainer.layout))
        self._half = None
        self._evaluator = None  # made on the first federated evaluation
        entry = registry.get(cfg.strategy)
        if entry.batched.runner != "weighted_mean":
            from fedswarm.sim.batched import round_runner

            # built here, not on the first round: a strategy's build may draw random numbers, and a
            # LocalPool's workers share the driver's generators, which the run seeds after this
            self._half = round_runner(entry)(self.run, torch.zeros(self.trainer.layout.d))

    def node(self) -> str:
        """The Ray node this worker runs on (its id), or the host's name outside Ray."""
        ray = sys.modules.get("ray")
        if ray is not None and ray.is_initialized():
            return ray.get_runtime_context().get_node_id()
        return socket.gethostname()

    def average(self, start: torch.Tensor, sched, weights: torch.Tensor, momentum: float,
                per_client_loss: bool, clip: float | None = None) -> dict:
        """FedAvg's numerator over this shard (:meth:`BatchedTrainer.average`'s chunks added up):
        ``sum`` [d] float64, ``loss`` [k] or None, ``n`` [k], ``loss_wsum``, ``diverged``
        (shard position -> model), ``within`` (with ``clip``, DP-FedAvg's: the sum is of the
        clipped changes, and this many were within the norm), ``compute_s``."""
        t0 = time.perf_counter()
        k = sched.partitions.numel()
        total = torch.zeros(self.trainer.layout.d, dtype=torch.float64)
        loss = torch.zeros(k)
        has_loss = False
        n = torch.zeros(k, dtype=torch.int64)
        loss_wsum, diverged, within = 0.0, {}, [0]
        for rows, part, chunk_loss, chunk_n, lw, div in self.trainer.average(
                start, sched, weights, momentum=momentum, chunk_size=self.run.chunk_size,
                memory_budget=self.run.memory_budget, per_client_loss=per_client_loss, clip=clip, within=within):
            total += part
            n[rows] = chunk_n
            if chunk_loss is not None:
                loss[rows], has_loss = chunk_loss, True
            loss_wsum += lw
            diverged.update(div)
        return {"sum": total, "loss": loss if has_loss else None, "n": n, "loss_wsum": loss_wsum,
                "diverged": diverged, "within": within[0], "compute_s": time.perf_counter() - t0}

    def score(self, vec: torch.Tensor, pids) -> dict:
        """Federated evaluation of this shard's clients ``pids`` (numpy partition ids), each on its own
        validation split as in one process (:meth:`fedswarm.sim.batched_eval.CohortEvaluator.score`):
        ``loss``, ``acc``, ``n`` arrays in the order of ``pids``, ``compute_s``."""
        t0 = time.perf_counter()
        if self._evaluator is None:
            from fedswarm.sim.batched_eval import CohortEvaluator
            from fedswarm.tasks import get_task
            from fedswarm.train import resolve_device, task_data

            cfg, data = self.cfg, task_data(self.cfg)
            task, device = get_task(cfg.task), resolve_device(cfg.device)
            self._evaluator = CohortEvaluator(cfg, task, task.model(cfg.seed).to(device), device, data.test_x,
                                              data.test_y, on_partition=None)  # type: ignore[arg-type]
        loss, acc, n = self._evaluator.score(vec, pids)
        return {"loss": loss, "acc": acc, "n": n, "compute_s": time.perf_counter() - t0}

    def client_round(self, x: torch.Tensor, sched, knobs, policies: list[dict], selects: list | None = None) -> dict:
        """Train this shard from ``x`` and run the strategy's client half on it with the
        clients' own state (the round runner's ``_train_replies``, as in one process, with its
        ``capture`` hook set); each client's train message stands in as its ``knobs`` and, where
        the server sent it one, its ``select`` record (``selects``, None: none did). Returns
        ``replies``, ``(shard position, examples, loss, steps)`` or ``(shard position, examples,
        exception)`` for a client whose code raised; ``groups``, ``(batched payload, shard
        positions, seed)`` of what they send; ``compute_s``."""
        t0 = time.perf_counter()
        half = self._half
        half.initial = x  # the runner's model: its strategy here never aggregates, so the round's start
        half.capture = _Capture(sched.partitions.tolist())
        from fedswarm.strategies.federated.compressed_base import KNOBS, SELECT

        messages = [SimpleNamespace(content=SimpleNamespace(config_records={KNOBS: knobs} if sel is None else
                                                            {KNOBS: knobs, SELECT: sel}))
                    for sel in (selects or [None] * sched.partitions.numel())]
        replies = half._train_replies(x, sched, messages, None, None, policies, None, len(messages))
        return {"replies": replies, "groups": half.capture.groups, "compute_s": time.perf_counter() - t0}


class _Capture:
    """A shard's client half's sink (the round runner's ``capture`` hook): each batched payload as
    sent, with its clients' positions in the shard, and each client's figures as a tuple."""

    def __init__(self, pids: list[int]):
        self.position = {p: j for j, p in enumerate(pids)}
        self.groups: list[tuple] = []

    def payload(self, payload, pids: list[int], seed: int) -> None:
        self.groups.append((payload, [self.position[p] for p in pids], seed))

    @staticmethod
    def reply(k: int, n: int, loss: float, steps: int) -> tuple:
        return (k, n, loss, steps)

    @staticmethod
    def error(k: int, n: int, exc: BaseException) -> tuple:
        return (k, n, exc)


# -- pools of workers ----------------------------------------------------------------------------------

class _Pool:
    """Workers and what a round moved to and from them: ``call`` a method on each worker
    with its arguments (None: that worker has no clients this round), in parallel where the
    pool can; :meth:`take` the round's figures."""

    workers: int

    def __init__(self):
        self.bytes_out = self.bytes_in = 0
        self.wait_s = self.compute_s = 0.0

    def call(self, method: str, args: list[tuple | None]) -> list[Any]:
        self.bytes_out += sum(len(pickle.dumps(a, protocol=5)) for a in args if a is not None)
        t0 = time.perf_counter()
        out = self._call(method, args)
        self.wait_s += time.perf_counter() - t0
        self.bytes_in += sum(len(pickle.dumps(r, protocol=5)) for r in out if r is not None)
        self.compute_s += max((r["compute_s"] for r in out if r is not None), default=0.0)
        return out

    def _call(self, method: str, args: list[tuple | None]) -> list[Any]:
        raise NotImplementedError

    def begin(self, cfg: RunConfig) -> None:
        """Every worker starts run ``cfg`` (:meth:`ShardWorker.begin`)."""
        self._call("begin", [(cfg,)] * self.workers)

    def take(self) -> dict[str, Any]:
        """The figures since the last call: bytes to and from the workers (pickled), the
        driver's wait for them and the slowest worker's compute in each call, added up."""
        out = {"shard_bytes_out": self.bytes_out, "shard_bytes_in": self.bytes_in, "shard_wait_s": self.wait_s,
               "shard_compute_s": self.compute_s}
        self.bytes_out = self.bytes_in = 0
        self.wait_s = self.compute_s = 0.0
        return out

    def close(self) -> None:
        pass


class LocalPool(_Pool):
    """The workers in this process, one after another: the sharding and the reduction without
    Ray (the tests' oracle; the bytes are what a cluster would move)."""

    def __init__(self, workers: int, *, memory_budget: int | None = None, chunk_size: int | None = None):
        super().__init__()
        self.workers = workers
        self.members = [ShardWorker(memory_budget, chunk_size) for _ in range(workers)]

    def _call(self, method, args):
        return [None if a is None else getattr(w, method)(*a) for w, a in zip(self.members, args)]


class RayPool(_Pool):
    """The workers as Ray actors of the cluster at ``cfg.ray_address``, one CPU each, spread
    over its nodes (``nodes``: where each runs); they build their trainers from the config
    where they run."""

    def __init__(self, cfg: RunConfig, workers: int, *, memory_budget: int | None = None,
                 chunk_size: int | None = None, log: Callable[[str], None] | None = None):
        super().__init__()
        import ray

        from fedswarm.sim.flower_engine import check_ray_address, start_ray

        self.workers = workers
        check_ray_address(cfg.ray_address)
        start_ray({"address": cfg.ray_address, "log_to_driver": False}, log=log)
        self._ray = ray
        try:
            cpus = ray.cluster_resources().get("CPU", 0)
            if cpus < workers:
                raise ConfigError(f"--workers {workers}: the Ray cluster at {cfg.ray_address} has {cpus:g} CPUs, one "
                                  "per worker is needed")
            actor = ray.remote(num_cpus=1, scheduling_strategy="SPREAD")(ShardWorker)
            self.actors = [actor.remote(memory_budget, chunk_size, threads=1) for _ in range(workers)]
            self.nodes = ray.get([a.node.remote() for a in self.actors])  # the actors are up
        except BaseException:
            ray.shutdown()
            raise

    def _call(self, method, args):
        refs = {i: getattr(a, method).remote(*x) for i, (a, x) in enumerate(zip(self.actors, args)) if x is not None}
        got = dict(zip(refs, self._ray.get(list(refs.values()))))
        return [got.get(i) for i in range(self.workers)]

    def close(self) -> None:
        for a in getattr(self, "actors", []):
            self._ray.kill(a)
        self._ray.shutdown()
