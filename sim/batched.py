"""The batched engine: every sampled client's local SGD as one batched computation.

A round of FedAvg over K clients is K independent local-SGD runs from the same start.
Here they run side by side on a leading client axis: the parameters are a ``[K, d]``
tensor, and one step of all K clients is ``vmap(grad(loss))`` over that axis
(``torch.func.functional_call`` puts each client's row into the task's own model, so any
task whose objective is a mean over examples works unchanged). Clients whose data sizes
or per-class policies (local steps, batch size, learning rate) differ are padded to the
longest schedule and masked: a padded example weighs zero in its client's mean loss and
a client past its last step does not move. The client axis is cut into chunks that fit
``--memory-budget`` and each chunk's models are folded into the running weighted sum at
once, so memory does not grow with the number of clients.

Same numbers as ``--engine inprocess``: the same clients are sampled (Flower's
``random.sample`` after ``random.seed(seed)``), each client's minibatches come from a
``torch.Generator`` seeded with :func:`fedswarm.local.round_seed` exactly as
:meth:`fedswarm.train.LocalTrainer.fit` draws them, and the average is weighted by
examples as Flower's FedAvg does. Tests hold the two engines to 1e-5.

Bytes are measured, not computed: a real train message and a real reply are built and
serialized for every distinct size class of the round (node-id and partition-id varint
lengths, example count, steps, device class), and counted once per client of that class.

What it does not do: strategies other than ``fedavg`` (their client halves keep state or
send payloads that are not a model; they run on ``--engine inprocess``), ``--dp``,
``--dp-sgd``, ``--byzantine``, models with buffers (batch-norm statistics), and the
``--devices`` time model's simulated seconds (rows carry ``sim_time_s = null``).
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import traceback
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable
from uuid import uuid4

import numpy as np
import torch
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from fedswarm.config import ConfigError, RunConfig
from fedswarm.local import round_seed
from fedswarm.params import ParamLayout, get_flat
from fedswarm.policy import DEFAULT_CLASS, PolicyBook, policy_for
from fedswarm.store import Store
from fedswarm.tasks import Task, get_task
from fedswarm.tasks.partition import partition_offsets
from fedswarm.train import evaluate_flat, resolve_device, task_data
from fedswarm.wire import vector_to_arrayrecord
from fedswarm.server.metered_grid import Traffic, serialized_size
from fedswarm.server.recorder import RoundListener, RoundRecorder, StopRun

__all__ = ["BatchedTrainer", "ClientSchedule", "run_batched", "parse_memory_budget", "default_memory_budget",
           "check_supported", "SUPPORTED_STRATEGIES"]

SUPPORTED_STRATEGIES = ("fedavg",)

# Rounds with more clients than this record the round's totals but no per-node rows:
# 10,000 rows a round would cost the store more than the training does.
NODE_ROWS_MAX = 2000

ClientsListener = Callable[[int, int], None]  # (clients done this round, clients this round)


# -- memory budget ------------------------------------------------------------------------

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_memory_budget(spec: str | int | None) -> int | None:
    """``'2GB'``, ``'512MiB'``, ``'300000000'`` -> bytes; None stays None (the default)."""
    if spec is None or isinstance(spec, int):
        return spec
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(spec))
    if m is None or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"invalid value for 'memory_budget': '{spec}' (use e.g. 2GB, 512MiB or a byte count)")
    value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value < 1_000_000:
        raise ConfigError(f"invalid value for 'memory_budget': '{spec}' is under 1 MB")
    return value


def default_memory_budget(device: torch.device) -> int:
    """A safe share of what is free: half the free GPU memory, or a quarter of the
    available RAM (at most 8 GB, which already holds tens of thousands of small models)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.5)
    return int(min(available_ram() * 0.25, 8e9))


def available_ram() -> int:
    """Bytes of RAM available to new work: Linux's MemAvailable, else free pages."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        return 4 * 2**30


# -- which runs it serves ----------------------------------------------------------------------

def check_supported(cfg: RunConfig) -> None:
    """Raise a one-line :class:`ConfigError` for a run the batched engine cannot serve,
    naming the engine that can."""
    if cfg.strategy not in SUPPORTED_STRATEGIES:
        raise ConfigError(f"--engine batched serves {', '.join(SUPPORTED_STRATEGIES)}; strategy '{cfg.strategy}' "
                          "runs on --engine inprocess (or flower)")
    for key, what in (("dp", "--dp"), ("dp_sgd", "--dp-sgd"), ("byzantine", "--byzantine")):
        if getattr(cfg, key):
            raise ConfigError(f"--engine batched does not run {what}; use --engine inprocess")


# -- the batched local SGD -----------------------------------------------------------------------

@dataclass
class ClientSchedule:
    """Who trains this round and how: one entry per client, all ``[K]`` tensors."""

    partitions: torch.Tensor  # int64 partition ids
    steps: torch.Tensor  # int64 local steps
    batch_size: torch.Tensor  # int64
    lr: torch.Tensor  # float32
    seeds: torch.Tensor  # int64 round seeds


class _Objective(nn.Module):
    """The task's objective as a module, so ``functional_call`` can swap its parameters."""

    def __init__(self, task: Task, model: nn.Module):
        super().__init__()
        self.task = task
        self.model = model

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.task.objective(self.model, x, y)


class BatchedTrainer:
    """Local SGD of many clients at once, on a leading client axis.

    ``flat_idx``/``offsets`` is the partition (client ``p`` holds training rows
    ``flat_idx[offsets[p]:offsets[p + 1]]``, see :func:`fedswarm.tasks.partition.partition_offsets`).
    The task's objective must be a mean over examples (plus terms that do not depend on
    the data, such as a ridge penalty): that is what lets padded examples weigh zero."""

    def __init__(self, task: Task, train_x: torch.Tensor, train_y: torch.Tensor, flat_idx: np.ndarray,
                 offsets: np.ndarray, device: torch.device | str = "cpu", model_seed: int = 0):
        self.task = task
        self.device = torch.device(device)
        model = task.model(model_seed).to(self.device)
        if any(True for _ in model.buffers()):
            raise ConfigError(f"--engine batched cannot train task '{task.name}': its model has buffers "
                              "(batch-norm statistics); use --engine inprocess")
        self.layout = ParamLayout.from_module(model)
        self._objective = _Objective(task, model)
        self._specs = [(f"model.{name}", p.shape, p.numel()) for name, p in model.named_parameters()]
        self.x = train_x.to(self.device)
        self.y = train_y.to(self.device)
        self.flat_idx = np.asarray(flat_idx, dtype=np.int64)
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self._act_per_example = _activations_per_example(model, train_x[:1].to(self.device))
        self._full = vmap(grad_and_value(self._batch_loss))
        self._masked = vmap(grad_and_value(self._masked_loss))

    # losses of one client (vmapped over clients) ------------------------------------
    def _params(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        out, pos = {}, 0
        for name, shape, n in self._specs:
            out[name] = flat[pos:pos + n].view(shape)
            pos += n
        return out

    def _batch_loss(self, flat: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return functional_call(self._objective, self._params(flat), (x, y))

    def _masked_loss(self, flat: torch.Tensor, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        params = self._params(flat)
        per_example = vmap(lambda xi, yi: functional_call(self._objective, params, (xi[None], yi[None])))(x, y)
        return (per_example * w).sum() / w.sum().clamp_min(1.0)

    # sizes ------------------------------------------------------------------------------
    def num_examples(self, partitions: torch.Tensor) -> torch.Tensor:
        p = partitions.numpy()
        return torch.from_numpy(self.offsets[p + 1] - self.offsets[p])

    def bytes_per_client(self, max_steps: int, max_batch: int) -> int:
        """A conservative estimate of one client's working memory in a chunk: parameters,
        gradient, momentum and update ([d] each, a few copies under vmap), its minibatch
        indices, and the activations of one step (forward and backward)."""
        d = self.layout.d
        x_numel = int(np.prod(self.x.shape[1:])) if self.x.dim() > 1 else 1
        return 4 * (10 * d + 3 * max_steps * max_batch + 4 * max_batch * (x_numel + self._act_per_example))

    # the minibatches -------------------------------------------------------------------
    def minibatches(self, schedule: ClientSchedule) -> tuple[torch.Tensor, torch.Tensor]:
        """Training-row indices ``[K, S, B]`` and validity mask ``[K, S, B]`` of every
        client's local steps, drawn exactly as :meth:`LocalTrainer.fit` draws them: a
        generator seeded with the round seed, a fresh permutation of the client's rows
        whenever the last one is used up, batches cut in order (the last may be short).

        The draws loop over clients in Python: torch's generator is the definition of
        the order, and one ``randperm`` per client costs microseconds; the training
        itself is never a loop over clients."""
        k_total = schedule.partitions.numel()
        n_k = self.num_examples(schedule.partitions)
        s_max = int(schedule.steps.max()) if k_total else 0
        # a batch never holds more than the client's examples: pad only to what is used
        b_max = int(torch.minimum(schedule.batch_size, n_k).max()) if k_total else 0
        idx = torch.zeros((k_total, s_max, b_max), dtype=torch.int64)
        valid = torch.zeros((k_total, s_max, b_max), dtype=torch.bool)
        parts = schedule.partitions.tolist()
        steps = schedule.steps.tolist()
        bss = schedule.batch_size.tolist()
        seeds = schedule.seeds.tolist()
        # one example: every step is that example, whatever the generator says (vectorized:
        # the many-clients-on-a-small-task case)
        single = (n_k == 1).numpy()
        if single.any():
            ks = np.nonzero(single)[0]
            step_ok = torch.arange(s_max)[None, :] < schedule.steps[ks][:, None]  # [k1, S]
            rows1 = torch.from_numpy(self.flat_idx[self.offsets[schedule.partitions[ks].numpy()]])
            idx[ks, :, 0] = torch.where(step_ok, rows1[:, None], torch.zeros((), dtype=torch.int64))
            valid[ks, :, 0] = step_ok
        for k in np.nonzero(~single)[0].tolist():
            lo, hi = int(self.offsets[parts[k]]), int(self.offsets[parts[k] + 1])
            n, bs, s_k = hi - lo, bss[k], steps[k]
            g = torch.Generator().manual_seed(seeds[k])
            rows = torch.from_numpy(self.flat_idx[lo:hi])
            order = torch.randperm(n, generator=g)
            if s_k * bs <= n:  # the usual case: one permutation covers every step
                take = order[: s_k * bs].view(s_k, bs)
                idx[k, :s_k, :bs] = rows[take]
                valid[k, :s_k, :bs] = True
                continue
            pos = 0
            for s in range(s_k):
                if pos >= n:
                    order, pos = torch.randperm(n, generator=g), 0
                chunk = order[pos:pos + bs]
                pos += bs
                idx[k, s, :chunk.numel()] = rows[chunk]
                valid[k, s, :chunk.numel()] = True
        return idx, valid

    # training ----------------------------------------------------------------------------
    def fit(self, start: torch.Tensor, schedule: ClientSchedule, *, momentum: float = 0.0,
            chunk_size: int | None = None, memory_budget: int | None = None,
            on_chunk: Callable[[int], None] | None = None):
        """Run every scheduled client's local SGD from ``start`` ([d]); yield, chunk by
        chunk, ``(rows, new_params [C, d], mean_loss [C], num_examples [C])`` where ``rows``
        is the chunk's slice of the schedule. ``chunk_size`` overrides the chunk the memory
        budget gives."""
        k_total = schedule.partitions.numel()
        if k_total == 0:
            return
        idx_all, valid_all = self.minibatches(schedule)
        s_max, b_max = idx_all.shape[1], idx_all.shape[2]
        if chunk_size is None:
            budget = memory_budget if memory_budget is not None else default_memory_budget(self.device)
            chunk_size = max(1, min(k_total, budget // self.bytes_per_client(s_max, b_max)))
        n_examples = self.num_examples(schedule.partitions)
        start = start.to(self.device, torch.float32)
        for lo in range(0, k_total, chunk_size):
            hi = min(k_total, lo + chunk_size)
            new, loss = self._fit_chunk(start, idx_all[lo:hi], valid_all[lo:hi], schedule.steps[lo:hi],
                                        schedule.lr[lo:hi], momentum)
            yield slice(lo, hi), new, loss, n_examples[lo:hi]
            if on_chunk is not None:
                on_chunk(hi - lo)

    def average(self, start: torch.Tensor, schedule: ClientSchedule, weights: torch.Tensor, *,
                momentum: float = 0.0, chunk_size: int | None = None, memory_budget: int | None = None,
                on_chunk: Callable[[int], None] | None = None, per_client_loss: bool = True):
        """FedAvg's numerator, chunk by chunk: yield ``(rows, sum_k w_k theta_k [d] float64,
        mean_loss [C] or None, num_examples [C], sum_k w_k mean_loss_k)`` over the chunk's
        clients, ``theta_k`` being client ``k``'s model after local SGD from ``start`` and
        ``w_k = weights[k]``.

        When every client takes exactly one step, no client's model is ever formed: all
        start from ``start``, so ``sum_k w_k (start - lr_k g_k) = W start - grad(sum_k w_k
        lr_k L_k)(start)``, one backward pass over all the clients' examples at once (each
        example weighted ``w_k lr_k / b_k`` in its client's batch of ``b_k``). The same
        numbers as :meth:`fit` (a test holds them together), with no ``[K, d]`` tensor.

        ``per_client_loss=False`` (no per-node rows wanted) goes further: clients with the
        same per-example weight ``w_k lr_k / b_k`` are one group, and each group is one call
        of the task's objective on all its examples (``sum_i c ell_i = c N_g mean_g``), with
        no vmap at all; the round's weighted loss is exact, per-client losses are None."""
        if schedule.partitions.numel() == 0:
            return
        if bool((schedule.steps == 1).all()):
            yield from self._one_step_average(start, schedule, weights, chunk_size, memory_budget, on_chunk,
                                              per_client_loss)
            return
        for rows, new, loss, n in self.fit(start, schedule, momentum=momentum, chunk_size=chunk_size,
                                           memory_budget=memory_budget, on_chunk=on_chunk):
            bad = ~torch.isfinite(new).all(dim=1)
            if bool(bad.any()):
                raise FloatingPointError(f"client at position {int(bad.nonzero()[0, 0]) + rows.start} of the round "
                                         "diverged (non-finite parameters); lower --lr")
            w = weights[rows].to(new.device, new.dtype)
            loss = loss.cpu()
            yield rows, (w @ new).cpu().to(torch.float64), loss, n, float((loss * weights[rows]).sum())

    def _one_step_average(self, start, schedule, weights, chunk_size, memory_budget, on_chunk, per_client_loss):
        idx_all, valid_all = self.minibatches(schedule)
        idx_all, valid_all = idx_all[:, 0], valid_all[:, 0]  # [K, B]: the one step
        k_total, b_max = idx_all.shape
        if chunk_size is None:
            budget = memory_budget if memory_budget is not None else default_memory_budget(self.device)
            x_numel = int(np.prod(self.x.shape[1:])) if self.x.dim() > 1 else 1
            per_client = 4 * b_max * (4 + 2 * x_numel + 6 * self._act_per_example)
            chunk_size = max(1, min(k_total, budget // per_client))
        n_examples = self.num_examples(schedule.partitions)
        start = start.to(self.device, torch.float32)
        for lo in range(0, k_total, chunk_size):
            hi = min(k_total, lo + chunk_size)
            valid = valid_all[lo:hi].to(self.device)
            rows = idx_all[lo:hi].to(self.device)[valid]  # the chunk's examples, client by client
            per_client = valid.sum(dim=1)
            client_of = torch.repeat_interleave(torch.arange(hi - lo, device=self.device), per_client)
            w = weights[lo:hi].to(self.device, torch.float32)
            coef = (w * schedule.lr[lo:hi].to(self.device, torch.float32) / per_client.clamp_min(1))[client_of]
            theta = start.clone().requires_grad_(True)
            params = self._params(theta)
            w_chunk = weights[lo:hi].to(torch.float64)
            if per_client_loss:
                def one(xi, yi, params=params):  # one example's loss; called at once, within this chunk
                    return functional_call(self._objective, params, (xi[None], yi[None]))

                per_example = vmap(one)(self.x[rows], self.y[rows])
                (g,) = torch.autograd.grad((per_example * coef).sum(), theta)
                loss = torch.zeros(hi - lo, device=self.device).index_add_(0, client_of, per_example.detach())
                loss = (loss / per_client.clamp_min(1)).cpu()
                loss_wsum = float((loss.to(torch.float64) * w_chunk).sum())
                finite = bool(torch.isfinite(loss).all())
            else:
                g, loss_wsum = self._grouped_step(params, theta, rows, client_of, coef, w, per_client)
                loss, finite = None, math.isfinite(loss_wsum)
            if not finite or not bool(torch.isfinite(g).all()):
                bad = (~torch.isfinite(loss)).nonzero() if loss is not None else torch.zeros(0, 1)
                where = f"client at position {int(bad[0, 0]) + lo} of the round" if bad.numel() else "a client"
                raise FloatingPointError(f"{where} diverged (non-finite loss or gradient); lower --lr")
            contribution = float(w.sum()) * start.to(torch.float64) - g.to(torch.float64)
            yield slice(lo, hi), contribution.cpu(), loss, n_examples[lo:hi], loss_wsum
            if on_chunk is not None:
                on_chunk(hi - lo)

    def _grouped_step(self, params, theta, rows, client_of, coef, w, per_client) -> tuple[torch.Tensor, float]:
        """Gradient of ``sum_i coef_i ell_i`` and ``sum_k w_k mean_loss_k``, one objective call
        per distinct coefficient (clients of a group share ``w_k / b_k`` and ``lr_k``)."""
        w_over_b = (w / per_client.clamp_min(1))[client_of]
        keys, group_of_example = torch.unique(torch.stack([coef, w_over_b], dim=1), dim=0, return_inverse=True)
        total = theta.new_zeros(())
        loss_wsum = 0.0
        for g_idx in range(keys.shape[0]):
            members = group_of_example == g_idx
            n_g = int(members.sum())
            mean_g = functional_call(self._objective, params, (self.x[rows[members]], self.y[rows[members]]))
            total = total + keys[g_idx, 0] * n_g * mean_g
            # the group's sum of w_k * mean_loss_k is (w_k / b_k) * (sum of its examples' losses)
            loss_wsum += float(keys[g_idx, 1]) * n_g * float(mean_g.detach())
        (g,) = torch.autograd.grad(total, theta)
        return g, loss_wsum

    def _fit_chunk(self, start: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor, steps: torch.Tensor,
                   lr: torch.Tensor, momentum: float) -> tuple[torch.Tensor, torch.Tensor]:
        c, s_max, _ = idx.shape
        dev = self.device
        params = start.expand(c, -1).clone()
        buf = torch.zeros_like(params) if momentum else None
        lr = lr.to(dev, torch.float32)[:, None]
        steps = steps.to(dev)
        loss_sum = torch.zeros(c, device=dev)
        idx, valid = idx.to(dev), valid.to(dev)
        for s in range(s_max):
            active = steps > s  # [C]
            rows, w = idx[:, s], valid[:, s]
            x, y = self.x[rows], self.y[rows]
            if bool(w.all()):
                g, loss = self._full(params, x, y)
            else:
                g, loss = self._masked(params, x, y, w.to(params.dtype))
            if buf is not None:
                # torch.optim.SGD: the first step's buffer is the gradient itself
                buf = torch.where(active[:, None], g if s == 0 else momentum * buf + g, buf)
                g = buf
            params = params - torch.where(active[:, None], lr * g, torch.zeros((), device=dev))
            loss_sum = loss_sum + torch.where(active, loss.detach(), torch.zeros((), device=dev))
        mean_loss = loss_sum / steps.clamp_min(1).to(loss_sum.dtype)
        return params.detach(), mean_loss


def _activations_per_example(model: nn.Module, x1: torch.Tensor) -> int:
    """Numbers each leaf module outputs for one example (what a step holds for backward)."""
    total = [0]

    def hook(_m, _inp, out):
        if isinstance(out, torch.Tensor):
            total[0] += out.numel()

    handles = [m.register_forward_hook(hook) for m in model.modules() if not list(m.children())]
    try:
        with torch.no_grad():
            model(x1)
    finally:
        for h in handles:
            h.remove()
    return max(1, total[0])


# -- the engine --------------------------------------------------------------------------------

class _Meter:
    """What :class:`RoundRecorder` reads after a round: the bytes this engine measured."""

    def __init__(self):
        self.traffic = Traffic()

    def take(self) -> Traffic:
        t, self.traffic = self.traffic, Traffic()
        return t


def _varint_len(n: int) -> int:
    return max(1, (int(n).bit_length() + 6) // 7)


def round_schedule(cfg: RunConfig, node_ids: list[int], train_config: ConfigRecord, n_examples: np.ndarray,
                   server_round: int) -> tuple[ClientSchedule, list[str], list[dict]]:
    """Each sampled node's local-SGD arguments, read from its device class's policy the
    way :func:`fedswarm.local.prepare_local` reads them."""
    pids = np.asarray(node_ids, dtype=np.int64) - 1
    classes = [DEFAULT_CLASS] * len(pids)
    if cfg.devices:  # device_class_of's reading of --devices, parsed once for all nodes
        from fedswarm.timemodel import parse_devices

        every = parse_devices(cfg.devices, cfg.clients)
        classes = [every[p] for p in pids.tolist()]
    per_class: dict[str, dict] = {c: policy_for(train_config, c) for c in set(classes)}
    steps = np.empty(len(pids), dtype=np.int64)
    bss = np.empty(len(pids), dtype=np.int64)
    lrs = np.empty(len(pids), dtype=np.float32)
    by_class: dict[str, list[int]] = defaultdict(list)
    for i, c in enumerate(classes):
        by_class[c].append(i)
    for c, members in by_class.items():
        pol = per_class[c]
        m = np.asarray(members)
        bs = int(pol.get("batch_size", cfg.batch_size))
        fixed = pol.get("local_steps", None if "local_epochs" in pol else cfg.local_steps)
        epochs = int(pol.get("local_epochs", cfg.local_epochs))
        n = n_examples[pids[m]]
        steps[m] = fixed if fixed is not None else epochs * np.maximum(1, -(-n // bs))
        bss[m] = bs
        lrs[m] = float(pol.get("lr", cfg.lr))
    seeds = [round_seed(cfg.seed, server_round, int(p)) for p in pids]
    sched = ClientSchedule(torch.from_numpy(pids), torch.from_numpy(steps), torch.from_numpy(bss),
                           torch.from_numpy(lrs), torch.tensor(seeds, dtype=torch.int64))
    return sched, classes, [per_class[c] for c in classes]


class _ByteCounter:
    """Serialized sizes of real train messages and replies, one per size class."""

    def __init__(self, train_config: ConfigRecord):
        self.train_config = train_config
        self._cache: dict[tuple, tuple[int, int]] = {}

    def sizes(self, arrays, new_vec: torch.Tensor, node_id: int, pid: int, n: int, steps: int, loss: float,
              device_class: str, policy_json: str, server_round: int) -> tuple[int, int]:
        key = (_varint_len(node_id), _varint_len(pid), _varint_len(2 * pid), n, steps, device_class, policy_json,
               _varint_len(server_round))
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        config = ConfigRecord(dict(self.train_config))
        config["server-round"] = server_round
        # As Flower's FedAvg builds it (no group id), measured before the grid gives it an id.
        ins = Message(RecordDict({"arrays": arrays, "config": config}), node_id, "train")
        down = serialized_size(ins)
        ins.metadata.__dict__["_message_id"] = str(uuid4())
        metrics = MetricRecord({"num-examples": n, "train_loss": loss, "steps": steps, "partition-id": pid})
        node = ConfigRecord({"device_class": device_class, "policy": policy_json})
        TaskIdentity.node_id = node_id  # the reply's source, as on a SuperNode
        try:
            reply = Message(RecordDict({"arrays": vector_to_arrayrecord(new_vec), "metrics": metrics, "node": node}),
                            reply_to=ins)
        finally:
            TaskIdentity.node_id = 0
        reply.metadata.__dict__["_message_id"] = str(uuid4())
        out = (down, serialized_size(reply))
        self._cache[key] = out
        return out


def run_batched(cfg: RunConfig, *, store: Store, run_id: str, listeners: list[RoundListener] | None = None,
                on_clients: ClientsListener | None = None, memory_budget: int | None = None,
                chunk_size: int | None = None) -> str:
    """Run FedAvg on the batched engine, recording into ``run_id``; return the final status.

    ``on_clients(done, total)`` is called after every chunk (the CLI's clients/s bar)."""
    from fedswarm.sim.inprocess import _run_ids

    check_supported(cfg)
    TaskIdentity.run_id = next(_run_ids)  # what Flower's Message stamps on the messages it builds
    TaskIdentity.task_id = 1
    TaskIdentity.node_id = 0
    if memory_budget is None:
        memory_budget = parse_memory_budget(cfg.memory_budget)
    random.seed(cfg.seed)  # as run_server: Flower's node sampling uses the random module
    torch.manual_seed(cfg.seed)
    task = get_task(cfg.task)
    device = resolve_device(cfg.device)
    model = task.model(cfg.seed).to(device)
    data = task_data(cfg)
    flat_idx, offsets = partition_offsets(data.train_y.numpy(), cfg.partition, cfg.clients, cfg.seed)
    trainer = BatchedTrainer(task, data.train_x, data.train_y, flat_idx, offsets, device, model_seed=cfg.seed)
    n_examples = offsets[1:] - offsets[:-1]
    global_vec = get_flat(model).cpu()

    def evaluate(vec: torch.Tensor) -> tuple[float, float]:
        return evaluate_flat(task, model, vec, data.test_x, data.test_y, device)

    train_config = ConfigRecord({k: v for k, v in cfg.to_flat().items() if k != "policies"})
    policies = PolicyBook(cfg.policies)
    policies.write(train_config)
    meter = _Meter()
    recorder = RoundRecorder(store, run_id, meter, evaluate,  # type: ignore[arg-type]  (a _Meter: only take())
                             listeners=listeners, policies=policies,
                             train_config=train_config, node_kind="sim")
    counter = _ByteCounter(train_config)
    all_nodes = list(range(1, cfg.clients + 1))
    store.set_status(run_id, "running")
    try:
        recorder(0, global_vec)
        rounds, done = cfg.rounds, 0
        while rounds > 0:
            for _ in range(rounds):
                done += 1
                sample = random.sample(all_nodes, max(int(cfg.clients * cfg.fraction), 1))
                global_vec, row, node_rows = _one_round(cfg, trainer, counter, global_vec, sample, train_config,
                                                        n_examples, done, momentum=cfg.momentum,
                                                        memory_budget=memory_budget, chunk_size=chunk_size,
                                                        on_clients=on_clients, meter=meter)
                if node_rows:
                    store.add_node_rounds(run_id, done, node_rows)
                recorder.note(**row)
                recorder(done, global_vec)
            rounds, recorder.extra_rounds = recorder.extra_rounds, 0
    except StopRun as stop:
        store.set_status(run_id, "stopped", error=None)
        store.add_event(run_id, "stopped", str(stop))
        return "stopped"
    except BaseException as exc:
        store.set_status(run_id, "failed", error=f"{type(exc).__name__}: {exc}")
        store.add_event(run_id, "error", traceback.format_exc()[-4000:])
        raise
    store.set_status(run_id, "finished")
    return "finished"


def _one_round(cfg, trainer: BatchedTrainer, counter: _ByteCounter, global_vec: torch.Tensor, sample: list[int],
               train_config: ConfigRecord, n_examples: np.ndarray, server_round: int, *, momentum: float,
               memory_budget: int | None, chunk_size: int | None, on_clients: ClientsListener | None,
               meter: _Meter) -> tuple[torch.Tensor, dict, list[dict]]:
    """Train the sampled clients, average their models weighted by examples (Flower's
    FedAvg), count the bytes of every client's message and reply."""
    sched, classes, pols = round_schedule(cfg, sample, train_config, n_examples, server_round)
    total = len(sample)
    acc = torch.zeros(trainer.layout.d, dtype=torch.float64)
    weight_sum, loss_sum = 0.0, 0.0
    arrays = vector_to_arrayrecord(global_vec)
    traffic = Traffic()
    node_rows: list[dict] = []
    record_nodes = total <= NODE_ROWS_MAX
    done = [0]

    def on_chunk(n: int) -> None:
        done[0] += n
        if on_clients is not None:
            on_clients(done[0], total)

    policy_json = {c: json.dumps(p, sort_keys=True) for c, p in zip(classes, pols)}
    weights = trainer.num_examples(sched.partitions).to(torch.float32)  # FedAvg weighs by num-examples
    for rows, part_sum, loss, n, loss_wsum in trainer.average(global_vec, sched, weights, momentum=momentum,
                                                              chunk_size=chunk_size, memory_budget=memory_budget,
                                                              on_chunk=on_chunk, per_client_loss=record_nodes):
        acc += part_sum
        weight_sum += float(weights[rows].sum())
        loss_sum += loss_wsum
        n_list = n.tolist()
        loss_list = loss.tolist() if loss is not None else [0.0] * len(n_list)  # sizes: any float is 8 bytes
        steps_list = sched.steps[rows].tolist()
        for j, i in enumerate(range(rows.start, rows.stop)):
            node_id = sample[i]
            # the reply's size depends on the model's length, not its values
            down, up = counter.sizes(arrays, global_vec, node_id, node_id - 1, n_list[j], steps_list[j],
                                     loss_list[j], classes[i], policy_json[classes[i]], server_round)
            traffic.bytes_down += down
            traffic.bytes_up += up
            traffic.node_down[node_id] += down
            traffic.node_up[node_id] += up
            if record_nodes:
                node_rows.append({"node_id": str(node_id), "bytes_up": up, "bytes_down": down,
                                  "num_examples": n_list[j], "train_loss": loss_list[j],
                                  "device_class": classes[i], "policy": pols[i]})
    meter.traffic = traffic
    new_global = (acc / weight_sum).to(torch.float32)
    row = {"train_loss": loss_sum / weight_sum, "num_clients": total}
    return new_global, row, node_rows
