"""The batched engine across a Ray cluster: ``fedswarm sim --engine batched --ray-address
HOST:PORT [--workers N]``.

Each round's cohort is split across N workers, each client always on the same one (client
``p`` on worker ``p mod N``: sticky, so what a client keeps between rounds, an error-feedback
residual or a sketch client's ``Context``, stays on its worker in a
:class:`~fedswarm.sim.batched_round.ClientMemory` of its own). A worker
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

The workers are a pool: :class:`LocalPool` runs them in this process (the tests' oracle of the
sharding and reduction math, without Ray), :class:`RayPool` as Ray actors (one CPU each,
spread over the cluster's nodes). Ray is imported by :class:`RayPool` only: without
``--ray-address`` nothing of Ray is imported. What the sharded path does not run is refused
in one line by :func:`check_sharded`.
"""

from __future__ import annotations

import copy
import pickle
import socket
import sys
import time
from functools import partial
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np
import torch

from fedswarm.config import RunConfig
from fedswarm.errors import ConfigError
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
    from fedswarm.sim.batched_round import ClientMemory
    from fedswarm.sim.batched_sketched import SketchRounds, _contexts
    from fedswarm.strategies.federated.sketched import SKETCH_CLIENTS

    base = round_runner(registry.get(strategy))

    class Half(base):  # type: ignore[misc, valid-type]
        model = None  # the public model of the round, set by the worker (not the strategy's)

        def __init__(self):  # no strategy object here: the driver has it
            self.run = run
            self.layout = run.trainer.layout
            self.residuals = ClientMemory(lambda pid: torch.zeros(self.layout.d))
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
