"""Local training and evaluation on flat parameter vectors, and the data each node holds.

A :class:`LocalTrainer` owns one model instance and one node's partition. It takes the
global flat vector, runs local SGD and returns the new flat vector, so every strategy's
client half (plain FedAvg, compressed deltas, gossip local steps) reuses it.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

import torch

from fedswarm.config import ConfigError, RunConfig, TrainingSpec
from fedswarm.params import ParamLayout, get_flat, set_flat
from fedswarm.tasks import Task, TaskData, get_task
from fedswarm.tasks.partition import partition_indices

__all__ = [
    "LocalTrainer",
    "TrainResult",
    "resolve_device",
    "check_node_device",
    "task_data",
    "partition_data",
    "trainer_for",
    "evaluate_flat",
]


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


def partition_data(cfg: RunConfig, partition_id: int, num_partitions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The training examples of client ``partition_id`` of ``num_partitions``."""
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition-id {partition_id} is outside 0..{num_partitions - 1}")
    data = task_data(cfg)
    parts = partition_indices(data.train_y.numpy(), cfg.partition, num_partitions, cfg.seed)
    idx = torch.from_numpy(parts[partition_id])
    return data.train_x[idx], data.train_y[idx]


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
        order = torch.randperm(n, generator=g).to(self.device)
        # the loss summed on the device, read once at the end (no host sync per step); float64
        # as Python's float sum was (MPS has no float64)
        pos, total = 0, torch.zeros((), dtype=torch.float32 if self.device.type == "mps" else torch.float64,
                                    device=self.device)
        for _ in range(n_steps):
            if pos >= n:
                order, pos = torch.randperm(n, generator=g).to(self.device), 0
            idx = order[pos : pos + batch_size]
            pos += batch_size
            opt.zero_grad(set_to_none=True)
            loss = self.task.objective(self.model, self.x[idx], self.y[idx])
            loss.backward()
            if grad_hook is not None:
                grad_hook(self.model)
            opt.step()
            total += loss.detach()
        opt.zero_grad(set_to_none=True)  # a cached trainer holds no gradient between rounds
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
