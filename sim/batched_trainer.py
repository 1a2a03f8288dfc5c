"""Local SGD of many clients at once: the batched engine's trainer.

The parameters of K clients are a ``[K, d]`` tensor and one step of all of them is
``vmap(grad(loss))`` over that axis (``torch.func.functional_call`` puts each client's row
into the task's own model). Clients whose data sizes or per-class policies differ are
padded to the longest schedule and masked. Minibatches and the SGD step are those of
:mod:`fedswarm.algorithms.local_sgd`, as :meth:`fedswarm.train.LocalTrainer.fit` takes them.
The engine around it is :mod:`fedswarm.sim.batched`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from fedswarm.algorithms.local_sgd import minibatch_plans, sgd_step
from fedswarm.algorithms.privacy.dp_fedavg import clip_sum
from fedswarm.errors import ConfigError
from fedswarm.params import ParamLayout
from fedswarm.sim.batched_memory import client_bytes, default_memory_budget, one_step_client_bytes
from fedswarm.tasks import Task

__all__ = ["BatchedTrainer", "ClientSchedule"]


@dataclass
class ClientSchedule:
    """Who trains this round and how: one entry per client, all ``[K]`` tensors."""

    partitions: torch.Tensor  # int64 partition ids
    steps: torch.Tensor  # int64 local steps
    batch_size: torch.Tensor  # int64
    lr: torch.Tensor  # float32
    seeds: torch.Tensor  # int64 round seeds
    # bool: clients that train on flipped labels y -> num_classes - 1 - y (a label-flipping
    # Byzantine client, as fedswarm.train.trainer_for(label_flip=True) trains); None: none do
    flip_labels: torch.Tensor | None = None


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
    the data, such as a ridge penalty): that is what lets padded examples weigh zero.
    ``model`` trains another module than the task's model under the task's objective (a
    ProgFed stage's sub-model); its values never matter, only its structure."""

    def __init__(self, task: Task, train_x: torch.Tensor, train_y: torch.Tensor, flat_idx: np.ndarray,
                 offsets: np.ndarray, device: torch.device | str = "cpu", model_seed: int = 0,
                 model: nn.Module | None = None, num_classes: int | None = None):
        self.task = task
        self.num_classes = num_classes  # for flip_labels
        self.device = torch.device(device)
        model = (task.model(model_seed) if model is None else model).to(self.device)
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
        x_numel = int(np.prod(self.x.shape[1:])) if self.x.dim() > 1 else 1
        return client_bytes(self.layout.d, x_numel, self._act_per_example, max_steps, max_batch)

    # the minibatches -------------------------------------------------------------------
    def minibatches(self, schedule: ClientSchedule) -> tuple[torch.Tensor, torch.Tensor]:
        """Training-row indices ``[K, S, B]`` and validity mask ``[K, S, B]`` of every
        client's local steps: :func:`~fedswarm.algorithms.local_sgd.minibatch_plans` of the
        cohort from its round seeds (each row the client's ``minibatch_plan``, as
        :meth:`LocalTrainer.fit` draws it), mapped to training rows; array operations over
        the cohort, no loop over clients."""
        n_k = self.num_examples(schedule.partitions)
        pos, size = minibatch_plans(n_k, schedule.steps, schedule.batch_size, schedule.seeds)
        valid = torch.arange(pos.shape[2])[None, None, :] < size[:, :, None]
        lo = torch.from_numpy(self.offsets[schedule.partitions.numpy()])
        at = torch.where(valid, lo[:, None, None] + pos, torch.zeros((), dtype=torch.int64))
        idx = torch.from_numpy(self.flat_idx)[at] if at.numel() else at
        return torch.where(valid, idx, torch.zeros((), dtype=torch.int64)), valid

    # training ----------------------------------------------------------------------------
    def fit(self, start: torch.Tensor, schedule: ClientSchedule, *, momentum: float = 0.0,
            chunk_size: int | None = None, memory_budget: int | None = None,
            on_chunk: Callable[[int], None] | None = None, trained: torch.Tensor | None = None):
        """Run every scheduled client's local SGD from ``start`` ([d]); yield, chunk by
        chunk, ``(rows, new_params [C, d], mean_loss [C], num_examples [C])`` where ``rows``
        is the chunk's slice of the schedule. ``chunk_size`` overrides the chunk the memory
        budget gives. ``trained`` (``[K, d]`` bool): the coordinates each client trains; the
        others are frozen (no gradient step, no momentum), as ``requires_grad = False``
        freezes a tensor (PVT)."""
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
        flip = schedule.flip_labels
        if flip is not None and self.num_classes is None:
            raise ValueError("flip_labels needs the trainer's num_classes")
        for lo in range(0, k_total, chunk_size):
            hi = min(k_total, lo + chunk_size)
            new, loss = self._fit_chunk(start, idx_all[lo:hi], valid_all[lo:hi], schedule.steps[lo:hi],
                                        schedule.lr[lo:hi], momentum,
                                        None if trained is None else trained[lo:hi].to(self.device),
                                        None if flip is None or not bool(flip[lo:hi].any()) else flip[lo:hi])
            yield slice(lo, hi), new, loss, n_examples[lo:hi]
            if on_chunk is not None:
                on_chunk(hi - lo)

    def average(self, start: torch.Tensor, schedule: ClientSchedule, weights: torch.Tensor, *,
                momentum: float = 0.0, chunk_size: int | None = None, memory_budget: int | None = None,
                on_chunk: Callable[[int], None] | None = None, per_client_loss: bool = True,
                clip: float | None = None, within: list[int] | None = None):
        """FedAvg's numerator, chunk by chunk: yield ``(rows, sum_k w_k theta_k [d] float64,
        mean_loss [C] or None, num_examples [C], sum_k w_k mean_loss_k, diverged)`` over the
        chunk's clients, ``theta_k`` being client ``k``'s model after local SGD from ``start``
        and ``w_k = weights[k]``. A client whose model is not finite (its local SGD diverged)
        is left out of both sums; ``diverged`` maps its position in the schedule to that model
        (what it would send, for the server to reject).

        When every client takes exactly one step, no client's model is ever formed: all
        start from ``start``, so ``sum_k w_k (start - lr_k g_k) = W start - grad(sum_k w_k
        lr_k L_k)(start)``, one backward pass over all the clients' examples at once (each
        example weighted ``w_k lr_k / b_k`` in its client's batch of ``b_k``). The same
        numbers as :meth:`fit` (a test holds them together), with no ``[K, d]`` tensor.

        ``per_client_loss=False`` (no per-node rows wanted) goes further: clients with the
        same per-example weight ``w_k lr_k / b_k`` are one group, and each group is one call
        of the task's objective on all its examples (``sum_i c ell_i = c N_g mean_g``), with
        no vmap at all; the round's weighted loss is exact, per-client losses are None.

        ``clip`` (DP-FedAvg): the sum is instead ``sum_k clip(theta_k - start)``, each change
        scaled to norm <= ``clip`` (:func:`~fedswarm.algorithms.privacy.dp_fedavg.clip_sum`, as
        the Flower strategies sum them; uniform weights, the loss still weighed by ``weights``),
        and ``within[0]`` counts the changes that were within it. Every client's model is formed (no shortcut)."""
        if schedule.partitions.numel() == 0:
            return
        if schedule.flip_labels is not None:
            raise ValueError("average() trains no label-flipping clients; use fit()")
        if clip is None and bool((schedule.steps == 1).all()):
            yield from self._one_step_average(start, schedule, weights, chunk_size, memory_budget, on_chunk,
                                              per_client_loss)
            return
        yield from self._per_client_average(start, schedule, weights, momentum, chunk_size, memory_budget, on_chunk,
                                            clip=clip, within=within)

    def _per_client_average(self, start, schedule, weights, momentum, chunk_size, memory_budget, on_chunk, lo=0,
                            clip=None, within=None):
        """:meth:`average` from every client's model (:meth:`fit`); ``lo``: the schedule's
        offset in the round (positions in ``rows`` and ``diverged`` are the round's)."""
        for rows, new, loss, n in self.fit(start, schedule, momentum=momentum, chunk_size=chunk_size,
                                           memory_budget=memory_budget, on_chunk=on_chunk):
            bad = ~torch.isfinite(new).all(dim=1)
            diverged = {rows.start + lo + int(j): new[j].cpu() for j in bad.nonzero()[:, 0].tolist()}
            w = torch.where(bad.cpu(), torch.zeros(()), weights[rows].to(torch.float32))
            new = torch.where(bad[:, None], torch.zeros((), device=new.device), new)
            loss = loss.cpu()
            loss_wsum = float(torch.where(bad.cpu(), torch.zeros(()), loss * w).sum())
            if clip is None:
                part = w.to(new.device) @ new
            else:
                part, ok = clip_sum(new[~bad] - start.to(new.device, torch.float32), clip)
                within[0] += ok
            yield slice(rows.start + lo, rows.stop + lo), part.cpu().to(torch.float64), loss, n, loss_wsum, diverged

    def _one_step_average(self, start, schedule, weights, chunk_size, memory_budget, on_chunk, per_client_loss):
        idx_all, valid_all = self.minibatches(schedule)
        idx_all, valid_all = idx_all[:, 0], valid_all[:, 0]  # [K, B]: the one step
        k_total, b_max = idx_all.shape
        if chunk_size is None:
            budget = memory_budget if memory_budget is not None else default_memory_budget(self.device)
            x_numel = int(np.prod(self.x.shape[1:])) if self.x.dim() > 1 else 1
            per_client = one_step_client_bytes(x_numel, self._act_per_example, b_max)
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
                # a client's step is not finite: the chunk's clients one by one, to leave it out
                part = ClientSchedule(*(getattr(schedule, f)[lo:hi] for f in
                                        ("partitions", "steps", "batch_size", "lr", "seeds")))
                yield from self._per_client_average(start, part, weights[lo:hi], 0.0, None, memory_budget, on_chunk, lo)
                continue
            contribution = float(weights[lo:hi].to(torch.float32).sum()) * start.to(torch.float64) - g.to(torch.float64)
            yield slice(lo, hi), contribution.cpu(), loss, n_examples[lo:hi], loss_wsum, {}
            if on_chunk is not None:
                on_chunk(hi - lo)

    def _grouped_step(self, params, theta, rows, client_of, coef, w, per_client) -> tuple[torch.Tensor, float]:
        """Gradient of ``sum_i coef_i ell_i`` and ``sum_k w_k mean_loss_k``, one objective call
        per distinct coefficient (clients of a group share ``w_k / b_k`` and ``lr_k``)."""
        w_over_b = (w / per_client.clamp_min(1))[client_of]
        if rows.numel() and _constant(coef) and _constant(w_over_b):  # one group (the usual case): no unique, no mask
            n_g = rows.numel()
            mean_g = functional_call(self._objective, params, (self.x[rows], self.y[rows]))
            (g,) = torch.autograd.grad(coef[0] * n_g * mean_g, theta)
            return g, float(w_over_b[0]) * n_g * float(mean_g.detach())
        # the distinct (coef, w/b) pairs in lexicographic order, from two 1-D uniques (a 2-D unique sorts rows
        # in Python-visible time: 0.12 s at 100,000 examples)
        coefs, coef_of = torch.unique(coef, return_inverse=True)
        wobs, wob_of = torch.unique(w_over_b, return_inverse=True)
        pairs, group_of_example = torch.unique(coef_of * wobs.numel() + wob_of, return_inverse=True)
        total = theta.new_zeros(())
        loss_wsum = 0.0
        for g_idx, pair in enumerate(pairs.tolist()):
            members = group_of_example == g_idx
            n_g = int(members.sum())
            mean_g = functional_call(self._objective, params, (self.x[rows[members]], self.y[rows[members]]))
            total = total + coefs[pair // wobs.numel()] * n_g * mean_g
            # the group's sum of w_k * mean_loss_k is (w_k / b_k) * (sum of its examples' losses)
            loss_wsum += float(wobs[pair % wobs.numel()]) * n_g * float(mean_g.detach())
        (g,) = torch.autograd.grad(total, theta)
        return g, loss_wsum

    def _fit_chunk(self, start: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor, steps: torch.Tensor,
                   lr: torch.Tensor, momentum: float, trained: torch.Tensor | None = None,
                   flip: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        c, s_max, _ = idx.shape
        dev = self.device
        if flip is not None:
            flip = flip.to(dev)[:, None]
        params = start.expand(c, -1).clone()
        buf = None  # momentum: torch.optim.SGD's buffer, the first step's gradient
        lr = lr.to(dev, torch.float32)[:, None]
        steps = steps.to(dev)
        loss_sum = torch.zeros(c, device=dev)
        full = valid.all(dim=2).all(dim=0).tolist() if valid.device.type == "cpu" else None
        idx, valid = idx.to(dev), valid.to(dev)
        for s in range(s_max):
            active = steps > s  # [C]
            rows, w = idx[:, s], valid[:, s]
            x, y = self.x[rows], self.y[rows]
            if flip is not None:
                y = torch.where(flip, self.num_classes - 1 - y, y)
            # which steps are unpadded, read from the CPU's mask before the loop (no GPU sync a step)
            if full[s] if full is not None else bool(w.all()):
                g, loss = self._full(params, x, y)
            else:
                g, loss = self._masked(params, x, y, w.to(params.dtype))
            if trained is not None:
                g = torch.where(trained, g, torch.zeros((), device=dev))
            params, buf = sgd_step(params, g, buf, lr, momentum, active[:, None])
            loss_sum = loss_sum + torch.where(active, loss.detach(), torch.zeros((), device=dev))
        mean_loss = loss_sum / steps.clamp_min(1).to(loss_sum.dtype)
        return params.detach(), mean_loss


def _constant(t: torch.Tensor) -> bool:
    """Whether every entry of the non-empty 1-D ``t`` is the same value."""
    lo, hi = torch.aminmax(t)
    return bool(lo == hi)


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
