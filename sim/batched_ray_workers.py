"""The workers of the batched engine on Ray (:mod:`fedswarm.sim.batched_ray`) and their pools.

A :class:`ShardWorker` holds the run's batched trainer, built from the config where it runs,
and the state of the clients it owns; each round it trains its shard and runs the strategy's
client half on it (the round runner's own ``_train_replies`` and ``_client_step``). A pool
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
        """Start run ``cfg``: its trainer built here (its data, its partition), no client state yet."""
        self.cfg = cfg
        self.trainer = _worker_trainer(cfg)
        self.run = SimpleNamespace(cfg=cfg, trainer=self.trainer, memory_budget=self.memory_budget,
                                   chunk_size=self.chunk_size, progress=lambda total: None)
        self._half = None  # the strategy's client half, made on the first round

    def node(self) -> str:
        """The Ray node this worker runs on (its id), or the host's name outside Ray."""
        ray = sys.modules.get("ray")
        if ray is not None and ray.is_initialized():
            return ray.get_runtime_context().get_node_id()
        return socket.gethostname()

    def average(self, start: torch.Tensor, sched, weights: torch.Tensor, momentum: float,
                per_client_loss: bool) -> dict:
        """FedAvg's numerator over this shard (:meth:`BatchedTrainer.average`'s chunks added up):
        ``sum`` [d] float64, ``loss`` [k] or None, ``n`` [k], ``loss_wsum``, ``diverged``
        (shard position -> model), ``compute_s``."""
        t0 = time.perf_counter()
        k = sched.partitions.numel()
        total = torch.zeros(self.trainer.layout.d, dtype=torch.float64)
        loss = torch.zeros(k)
        has_loss = False
        n = torch.zeros(k, dtype=torch.int64)
        loss_wsum, diverged = 0.0, {}
        for rows, part, chunk_loss, chunk_n, lw, div in self.trainer.average(
                start, sched, weights, momentum=momentum, chunk_size=self.run.chunk_size,
                memory_budget=self.run.memory_budget, per_client_loss=per_client_loss):
            total += part
            n[rows] = chunk_n
            if chunk_loss is not None:
                loss[rows], has_loss = chunk_loss, True
            loss_wsum += lw
            diverged.update(div)
        return {"sum": total, "loss": loss if has_loss else None, "n": n, "loss_wsum": loss_wsum,
                "diverged": diverged, "compute_s": time.perf_counter() - t0}

    def client_round(self, x: torch.Tensor, sched, knobs, policies: list[dict]) -> dict:
        """Train this shard from ``x`` and run the strategy's client half on it with the
        clients' own state (the runner's ``_train_replies``, as in one process): ``replies``,
        ``(shard position, examples, loss, steps)`` or ``(shard position, examples, exception)``
        for a client whose code raised; ``groups``, ``(batched payload, shard positions, seed)``
        of what they send; ``compute_s``."""
        t0 = time.perf_counter()
        if self._half is None:
            self._half = _worker_half(self.cfg.strategy, self.run)
        half = self._half
        half.model, half.captured = x, []
        messages = [SimpleNamespace(k=j, content=SimpleNamespace(config_records={_knobs_key(): knobs}))
                    for j in range(sched.partitions.numel())]
        replies = half._train_replies(x, sched, messages, None, None, policies, None, len(messages))
        return {"replies": replies, "groups": half.captured, "compute_s": time.perf_counter() - t0}


def _knobs_key() -> str:
    from fedswarm.strategies.federated.compressed_base import KNOBS

    return KNOBS


class _CapturingClient:
    """A sketch strategy's client half that keeps each batched payload it sends."""

    def __init__(self, client, half):
        self.client, self.half = client, half

    def step(self, rounds, delta):
        payload = self.client.step(rounds, delta)
        self.half.captured.append((payload, [cr.msg.k for cr in rounds], int(payload.meta["seed"])))
        return payload


def _worker_half(strategy: str, run) -> Any:
    """The strategy's round runner as a worker runs it: its ``_train_replies`` and
    ``_client_step`` unchanged, with the clients' state here; each reply kept as its figures
    and each batched payload as sent (the driver measures and decodes them)."""
    from fedswarm.sim.batched import round_runner
    from fedswarm.sim.batched_round import ClientRows
    from fedswarm.sim.batched_sketched import SketchRounds, _contexts
    from fedswarm.strategies.federated.sketched import SKETCH_CLIENTS

    base = round_runner(registry.get(strategy))

    class Half(base):  # type: ignore[misc, valid-type]
        model = None  # the public model of the round, set by the worker (not the strategy's)

        def __init__(self):  # no strategy object here: the driver has it
            self.run = run
            self.layout = run.trainer.layout
            self.residuals = ClientRows(self.layout.d, run.cfg.clients)  # as CompressedRounds keeps them
            self.captured: list = []
            if issubclass(base, SketchRounds):
                self.contexts = _contexts(run.cfg.clients)
                self.client = _CapturingClient(SKETCH_CLIENTS[strategy], self)

        def _client_step(self, delta, pids, ins, policies):
            self._ks = [m.k for m in ins]
            return super()._client_step(delta, pids, ins, policies)

        def _decode(self, payload, members, seed, out):  # the codec's payload: decoded on the driver
            self.captured.append((payload, [self._ks[j] for j in members], seed))

        def _reply(self, messages, node_ids, classes, policy_json, k, sent, n, loss, steps, value):
            return (k, n, loss, steps)

        def _error_reply(self, messages, node_ids, classes, k, n, exc):
            return (k, n, exc)

    return Half()


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
