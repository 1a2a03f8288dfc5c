"""Local SGD, once for every runtime: the minibatch plan of a round and one SGD step.

Every runtime that trains a client locally (the ClientApp's :class:`~fedswarm.train.LocalTrainer`,
one client at a time; the batched engine's :class:`~fedswarm.sim.batched_trainer.BatchedTrainer`,
a whole cohort on a leading client axis; a decentralized node's
:func:`~fedswarm.algorithms.decentralized.steps.minibatch_gradient`) draws its minibatches
with :func:`minibatch_plan` and moves its parameters with :func:`sgd_step`, so the same round
seed gives the same examples and the same arithmetic on each of them.
"""

from __future__ import annotations

import torch

__all__ = ["minibatch_plan", "sgd_step"]


def minibatch_plan(n: int, steps: int, batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which of a client's ``n`` examples each of its ``steps`` local steps sees.

    Returns ``(pos [steps, b], size [steps])`` (int64, ``b = min(batch_size, n)``): step ``s``
    trains on examples ``pos[s, :size[s]]`` (positions ``0..n-1`` in the client's data; the
    rest of the row is 0). The definition: a ``torch.Generator`` seeded with ``seed`` draws a
    permutation of the ``n`` examples, batches of ``batch_size`` are cut from it in order
    (the last one short when ``batch_size`` does not divide ``n``), and a fresh permutation is
    drawn when one is used up. A client with no examples gets empty batches."""
    if n < 0 or steps < 0 or batch_size < 1:
        raise ValueError(f"minibatch_plan needs n >= 0, steps >= 0 and batch_size >= 1; got n={n}, "
                         f"steps={steps}, batch_size={batch_size}")
    if n == 0:
        return torch.zeros((steps, 0), dtype=torch.int64), torch.zeros(steps, dtype=torch.int64)
    g = torch.Generator().manual_seed(seed)
    if steps * batch_size <= n:  # the usual case: one permutation covers every step
        pos = torch.randperm(n, generator=g)[: steps * batch_size].view(steps, batch_size)
        return pos, torch.full((steps,), batch_size, dtype=torch.int64)
    per_perm = -(-n // batch_size)  # batches cut from one permutation
    perms = max(1, -(-steps // per_perm))
    padded = torch.zeros((perms, per_perm * batch_size), dtype=torch.int64)
    for e in range(perms):
        padded[e, :n] = torch.randperm(n, generator=g)
    b = min(batch_size, n)
    pos = padded.view(perms * per_perm, batch_size)[:steps, :b]
    size = (n - torch.arange(per_perm, dtype=torch.int64) * batch_size).clamp_max(batch_size)
    return pos, size.repeat(perms)[:steps]


def sgd_step(params: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor | None, lr: torch.Tensor | float,
             momentum: float, active: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One step of SGD with heavy-ball momentum, as ``torch.optim.SGD`` takes it (no
    dampening, weight decay or Nesterov): ``buf = g`` on the first step (``buf`` None), else
    ``momentum * buf + g``; ``params - lr * buf`` (``lr * g`` without momentum). Returns the
    new ``(params, buf)`` (buf None when ``momentum`` is 0); the inputs are not changed.

    Element-wise, so any shape: ``[C, d]`` with ``lr`` ``[C, 1]`` steps C clients at once,
    one parameter tensor with a float ``lr`` one client. ``active`` (bool, broadcastable
    to ``params``) leaves the other rows as they were: parameters and buffer (a client whose
    local steps are done while others' go on)."""
    if momentum:
        new_buf = grad if buf is None else momentum * buf + grad
        if active is not None:
            new_buf = torch.where(active, new_buf, torch.zeros((), device=grad.device) if buf is None else buf)
        grad = new_buf
    else:
        new_buf = None
    step = lr * grad
    if active is not None:
        step = torch.where(active, step, torch.zeros((), device=grad.device))
    return params - step, new_buf
