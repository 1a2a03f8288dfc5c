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

import torch

from fedswarm.config import RunConfig
from fedswarm.params import ParamLayout, get_flat, set_flat
from fedswarm.tasks import Task, TaskData, get_task
from fedswarm.tasks.partition import partition_indices

__all__ = [
    "LocalTrainer",
    "TrainResult",
    "resolve_device",
    "task_data",
    "partition_data",
    "node_validation",
    "trainer_for",
    "evaluate_flat",
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
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise RuntimeError(f"device '{spec}' was asked for but MPS is not available here")
    return dev


@functools.lru_cache(maxsize=8)
def _task_data(task_name: str, seed: int, test_fraction: float) -> TaskData:
    return get_task(task_name).load_data(seed, test_fraction)


def task_data(cfg: RunConfig) -> TaskData:
    """The task's data for this config (cached per process)."""
    return _task_data(cfg.task, cfg.seed, cfg.test_fraction)


def partition_data(cfg: RunConfig, partition_id: int, num_partitions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The training examples of client ``partition_id`` of ``num_partitions``."""
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition-id {partition_id} is outside 0..{num_partitions - 1}")
    data = task_data(cfg)
    parts = partition_indices(data.train_y.numpy(), cfg.partition, num_partitions, cfg.seed)
    idx = torch.from_numpy(parts[partition_id])
    return data.train_x[idx], data.train_y[idx]


@functools.lru_cache(maxsize=4096)
def _validation_idx(task_name: str, seed: int, test_fraction: float, num_partitions: int) -> tuple:
    data = _task_data(task_name, seed, test_fraction)
    return tuple(partition_indices(data.test_y.numpy(), "iid", num_partitions, seed))


def node_validation(cfg: RunConfig, partition_id: int, num_partitions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The validation split of node ``partition_id`` of ``num_partitions`` that holds no data
    of its own: its share of the task's held-out test set, cut IID with the run's seed, the
    same on every engine. The training partitions are not touched, so a run's training data
    is what it was without federated evaluation."""
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
        """Run local SGD from ``flat``. Minibatches are drawn by a generator seeded with
        ``seed``, so the same (flat, seed) gives the same result on every engine. ``dp``
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
        opt = torch.optim.SGD([p for p in self.model.parameters() if p.requires_grad], lr=lr, momentum=momentum)
        n_steps = self.steps_for(epochs, batch_size, steps)
        g = torch.Generator().manual_seed(seed)
        n = self.num_examples
        order = torch.randperm(n, generator=g)
        pos, total = 0, 0.0
        for _ in range(n_steps):
            if pos >= n:
                order, pos = torch.randperm(n, generator=g), 0
            idx = order[pos : pos + batch_size].to(self.device)
            pos += batch_size
            _count_seen(int(idx.numel()))
            opt.zero_grad(set_to_none=True)
            loss = self.task.objective(self.model, self.x[idx], self.y[idx])
            loss.backward()
            if grad_hook is not None:
                grad_hook(self.model)
            opt.step()
            total += loss.item()
        opt.zero_grad(set_to_none=True)  # a cached trainer holds no gradient between rounds
        return TrainResult(get_flat(self.model).cpu(), total / max(1, n_steps), n, n_steps)

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
             device: str, label_flip: bool = False) -> LocalTrainer:
    cfg = RunConfig(task=task_name, seed=seed, test_fraction=test_fraction, partition=partition,
                    clients=n)
    x, y = partition_data(cfg, pid, n)
    if label_flip:  # a data-poisoning Byzantine client: label y becomes C-1-y
        y = (task_data(cfg).num_classes - 1) - y
    return LocalTrainer(get_task(task_name), x, y, resolve_device(device), model_seed=seed)


def trainer_for(cfg: RunConfig, partition_id: int, num_partitions: int, *, label_flip: bool = False) -> LocalTrainer:
    """The (cached) trainer of one node: its partition loaded once per process
    (``label_flip``: the same partition with flipped labels, for a label-flipping attack)."""
    return _trainer(cfg.task, cfg.seed, cfg.test_fraction, cfg.partition, partition_id, num_partitions,
                    cfg.device, label_flip)
