"""Local training and evaluation on flat parameter vectors, and the data each node holds.

A :class:`LocalTrainer` owns one model instance and one node's partition. It takes the
global flat vector, runs local SGD and returns the new flat vector, so every strategy's
client half (plain FedAvg, compressed deltas, gossip local steps) reuses it.
"""

from __future__ import annotations

import functools
import math
import threading
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from fedswarm.algorithms.local_sgd import minibatch_plan, sgd_step
from fedswarm.config import RunConfig, TrainingSpec
from fedswarm.errors import ConfigError
from fedswarm.params import ParamLayout, get_flat, set_flat
from fedswarm.tasks import Task, TaskData, get_task
from fedswarm.tasks.localdata import LocalDataSpec, load_local
from fedswarm.tasks.partition import partition_indices

__all__ = [
    "LocalTrainer",
    "TrainResult",
    "resolve_device",
    "check_node_device",
    "task_data",
    "partition_data",
    "node_validation",
    "trainer_for",
    "evaluate_flat",
    "client_data_spec",
    "pooled_client_data",
    "local_validation",
    "examples_seen",
]

_SEEN = threading.local()


def examples_seen() -> int:
    """Examples this thread's local SGD has processed so far (every minibatch's size summed):
    a node's telemetry reads it before and after a round to report examples per second."""
    return getattr(_SEEN, "n", 0)


def _count_seen(n: int) -> None:
    _SEEN.n = examples_seen() + n


def resolve_device(spec: str = "auto") -> torch.device:
    """``auto`` picks cuda, then mps, then cpu; anything else is checked to exist."""
    if spec == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    dev = torch.device(spec)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device '{spec}' was asked for but CUDA is not available here")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise RuntimeError(f"device '{spec}' was asked for but this machine has {torch.cuda.device_count()} CUDA "
                           f"device(s) (cuda:0..cuda:{torch.cuda.device_count() - 1})")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise RuntimeError(f"device '{spec}' was asked for but MPS is not available here")
    return dev


def check_node_device(spec: str) -> torch.device:
    """A node's ``--device`` checked before it starts: the form the run config allows
    (auto, cpu, mps, cuda, cuda:N) and present on this machine; a one-line ConfigError."""
    try:
        TrainingSpec(device=spec)
    except ValueError:
        raise ConfigError(f"invalid value for '--device': must be auto, cpu, mps, cuda or cuda:N (got '{spec}')") \
            from None
    try:
        return resolve_device(spec)
    except RuntimeError as exc:
        raise ConfigError(str(exc)) from None


@functools.lru_cache(maxsize=8)
def _task_data(task_name: str, seed: int, test_fraction: float) -> TaskData:
    return get_task(task_name).load_data(seed, test_fraction)


def task_data(cfg: RunConfig) -> TaskData:
    """The task's data for this config (cached per process)."""
    return _task_data(cfg.task, cfg.seed, cfg.test_fraction)


def client_data_spec(cfg: RunConfig, partition_id: int) -> LocalDataSpec | None:
    """Client ``partition_id``'s own dataset when the run simulates per-client data
    (``client_data``: the ``partition_id``-th entry of that folder), else None."""
    if not cfg.client_data:
        return None
    from fedswarm.tasks.localdata import client_datasets

    paths = client_datasets(cfg.client_data)
    if not 0 <= partition_id < len(paths):
        raise ValueError(f"client {partition_id} has no dataset: {cfg.client_data} holds {len(paths)}")
    return LocalDataSpec(str(paths[partition_id]), cfg.label_column or "label",
                         0.2 if cfg.val_fraction is None else cfg.val_fraction)


def local_validation(cfg: RunConfig, partition_id: int, local: LocalDataSpec | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A node's own validation split ``(val_x, val_y)``: of ``local`` (a deployed node's
    ``--data``, :func:`fedswarm.local.node_data`) or of client ``partition_id``'s dataset in
    the run's ``client_data``; None for a node without local data. Seeded by the run seed,
    the same every round; never part of the node's training examples."""
    local = local or client_data_spec(cfg, partition_id)
    if local is None:
        return None
    split = load_local(cfg.task, local, cfg.seed)
    return split.val_x, split.val_y


def pooled_client_data(cfg: RunConfig) -> tuple[torch.Tensor, torch.Tensor, np.ndarray, np.ndarray]:
    """Every client's own train split (``client_data``) in one pool, for engines that train
    clients side by side: ``(x, y, flat_idx, offsets)``, client ``k`` holding rows
    ``flat_idx[offsets[k]:offsets[k + 1]]`` (the layout of
    :func:`fedswarm.tasks.partition.partition_offsets`)."""
    parts = [partition_data(cfg, k, cfg.clients) for k in range(cfg.clients)]
    sizes = np.array([int(y.shape[0]) for _, y in parts], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    x = torch.cat([x for x, _ in parts])
    y = torch.cat([y for _, y in parts])
    return x, y, np.arange(int(offsets[-1]), dtype=np.int64), offsets


def partition_data(cfg: RunConfig, partition_id: int, num_partitions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The training examples of client ``partition_id`` of ``num_partitions`` (with
    ``client_data``: the train split of that client's own dataset)."""
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition-id {partition_id} is outside 0..{num_partitions - 1}")
    local = client_data_spec(cfg, partition_id)
    if local is not None:
        split = load_local(cfg.task, local, cfg.seed)
        return split.train_x, split.train_y
    data = task_data(cfg)
    parts = partition_indices(data.train_y.numpy(), cfg.partition, num_partitions, cfg.seed)
    idx = torch.from_numpy(parts[partition_id])
    return data.train_x[idx], data.train_y[idx]


@functools.lru_cache(maxsize=4096)
def _validation_idx(task_name: str, seed: int, test_fraction: float, num_partitions: int) -> tuple:
    data = _task_data(task_name, seed, test_fraction)
    return tuple(partition_indices(data.test_y.numpy(), "iid", num_partitions, seed))


def node_validation(cfg: RunConfig, partition_id: int, num_partitions: int,
                    local: LocalDataSpec | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The validation split of node ``partition_id`` of ``num_partitions``: with data of its
    own (``local``, a deployed node's ``--data``, or the run's ``client_data``) the split held
    out of it (:func:`local_validation`); otherwise its share of the task's held-out test set,
    cut IID with the run's seed, the same on every engine. The training partitions are not
    touched, so a run's training data is what it was without federated evaluation."""
    own = local_validation(cfg, partition_id, local)
    if own is not None:
        return own
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition-id {partition_id} is outside 0..{num_partitions - 1}")
    data = task_data(cfg)
    idx = torch.from_numpy(_validation_idx(cfg.task, cfg.seed, cfg.test_fraction, num_partitions)[partition_id])
    return data.test_x[idx], data.test_y[idx]


@dataclass
class TrainResult:
    flat: torch.Tensor  # new parameters, [d]
    loss: float  # mean training loss over the local steps
    num_examples: int
    steps: int
    dp_sample_rate: float | None = None  # DP-SGD: the Poisson sampling rate of each step


class LocalTrainer:
    """Local SGD for one node on its own data."""

    def __init__(self, task: Task, x: torch.Tensor, y: torch.Tensor, device: torch.device | str = "cpu",
                 model_seed: int = 0):
        self.task = task
        self.device = torch.device(device)
        self.model = task.model(model_seed).to(self.device)
        self.layout = ParamLayout.from_module(self.model)
        self.x = x.to(self.device)
        self.y = y.to(self.device)
        self.skipped_examples = 0  # a node's own data: unreadable examples left out (an ImageFolder's bad images)

    @property
    def num_examples(self) -> int:
        return int(self.x.shape[0])

    def steps_for(self, epochs: int, batch_size: int, steps: int | None = None) -> int:
        if steps is not None:
            return steps
        return epochs * max(1, math.ceil(self.num_examples / batch_size))

    def fit(
        self,
        flat: torch.Tensor,
        *,
        epochs: int = 1,
        batch_size: int = 16,
        lr: float = 0.1,
        momentum: float = 0.0,
        steps: int | None = None,
        seed: int = 0,
        grad_hook: Callable[[torch.nn.Module], None] | None = None,
        dp=None,
    ) -> TrainResult:
        """Run local SGD from ``flat``: :func:`~fedswarm.algorithms.local_sgd.minibatch_plan`'s
        minibatches from ``seed`` and :func:`~fedswarm.algorithms.local_sgd.sgd_step`, as every
        engine takes them, so the same (flat, seed) gives the same result on every engine. ``dp``
        (a :class:`~fedswarm.algorithms.privacy.dp_fedavg.DPSpec`) runs DP-SGD instead
        (:mod:`fedswarm.algorithms.privacy.dp_sgd`)."""
        if dp is not None:
            from fedswarm.algorithms.privacy.dp_sgd import dp_sgd_fit

            n_steps = self.steps_for(epochs, batch_size, steps)
            flat_new, loss, q = dp_sgd_fit(self, flat, dp, steps=n_steps, batch_size=batch_size, lr=lr,
                                           momentum=momentum, seed=seed)
            return TrainResult(flat_new, loss, self.num_examples, n_steps, dp_sample_rate=q)
        set_flat(self.model, flat)
        self.model.train()
        params = [p for p in self.model.parameters() if p.requires_grad]
        bufs: list[torch.Tensor | None] = [None] * len(params)  # momentum, per tensor as torch.optim.SGD keeps it
        n_steps = self.steps_for(epochs, batch_size, steps)
        n = self.num_examples
        plan, sizes = minibatch_plan(n, n_steps, batch_size, seed)
        plan, sizes = plan.to(self.device), sizes.tolist()
        # the loss summed on the device, read once at the end (no host sync per step); float64
        # as Python's float sum was (MPS has no float64)
        total = torch.zeros((), dtype=torch.float32 if self.device.type == "mps" else torch.float64,
                            device=self.device)
        for s in range(n_steps):
            idx = plan[s, :sizes[s]]
            _count_seen(sizes[s])
            for p in params:
                p.grad = None
            loss = self.task.objective(self.model, self.x[idx], self.y[idx])
            loss.backward()
            if grad_hook is not None:
                grad_hook(self.model)
            with torch.no_grad():
                for i, p in enumerate(params):
                    if p.grad is not None:  # as torch.optim.SGD: a tensor with no gradient is not stepped
                        new, bufs[i] = sgd_step(p, p.grad, bufs[i], lr, momentum)
                        p.copy_(new)
            total += loss.detach()
        for p in params:  # a cached trainer holds no gradient between rounds
            p.grad = None
        return TrainResult(get_flat(self.model).cpu(), float(total) / max(1, n_steps), n, n_steps)

    @torch.no_grad()
    def evaluate(self, flat: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
                 batch_size: int = 4096) -> tuple[float, float]:
        """(loss, accuracy) of ``flat`` on (x, y)."""
        return evaluate_flat(self.task, self.model, flat, x, y, self.device, batch_size)


@torch.no_grad()
def evaluate_flat(task: Task, model: torch.nn.Module, flat: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
                  device: torch.device, batch_size: int = 4096) -> tuple[float, float]:
    set_flat(model, flat)
    model.eval()
    n = x.shape[0]
    loss_sum, acc_sum = 0.0, 0.0
    for i in range(0, n, batch_size):
        xb, yb = x[i : i + batch_size].to(device), y[i : i + batch_size].to(device)
        m = xb.shape[0]
        loss_sum += task.objective(model, xb, yb).item() * m
        acc_sum += task.accuracy(model, xb, yb) * m
    return loss_sum / n, acc_sum / n


@functools.lru_cache(maxsize=4096)
def _trainer(task_name: str, seed: int, test_fraction: float, partition: str, pid: int, n: int,
             device: str, label_flip: bool = False, local: LocalDataSpec | None = None) -> LocalTrainer:
    cfg = RunConfig(task=task_name, seed=seed, test_fraction=test_fraction, partition=partition,
                    clients=n)
    skipped = 0
    if local is not None:
        split = load_local(task_name, local, seed)
        x, y, skipped = split.train_x, split.train_y, split.skipped
    else:
        x, y = partition_data(cfg, pid, n)
    if label_flip:  # a data-poisoning Byzantine client: label y becomes C-1-y
        y = (task_data(cfg).num_classes - 1) - y
    trainer = LocalTrainer(get_task(task_name), x, y, resolve_device(device), model_seed=seed)
    trainer.skipped_examples = skipped
    return trainer


def trainer_for(cfg: RunConfig, partition_id: int, num_partitions: int, *, label_flip: bool = False,
                local: LocalDataSpec | None = None) -> LocalTrainer:
    """The (cached) trainer of one node: its partition loaded once per process
    (``label_flip``: the same partition with flipped labels, for a label-flipping attack).
    ``local`` (a deployed node's ``--data``) or the run's ``client_data`` trains on the
    train split of the node's own dataset instead; ``partition_id`` then only names the node
    (its round seed, its place in a topology)."""
    local = local or client_data_spec(cfg, partition_id)
    return _trainer(cfg.task, cfg.seed, cfg.test_fraction, cfg.partition, partition_id, num_partitions,
                    cfg.device, label_flip, local)
