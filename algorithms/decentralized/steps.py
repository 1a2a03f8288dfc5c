"""A node's local step, shared by every decentralized runtime (the router's node half,
the array engine, the clock engines, the swarm peers): the seed of its minibatches and its
gradient.

Plain torch on a :class:`~fedswarm.train.LocalTrainer` the runtime built (its model, data
and ``fit``); the trainer is only named for type checking, so this algorithm layer stays
under ``fedswarm.train``, which imports it (DP-SGD).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fedswarm.algorithms.local_sgd import minibatch_plan
from fedswarm.params import set_flat

if TYPE_CHECKING:
    from fedswarm.train import LocalTrainer

__all__ = ["minibatch_gradient", "local_gradient"]


def minibatch_gradient(trainer: LocalTrainer, flat: torch.Tensor, batch_size: int,
                       seed: int) -> tuple[torch.Tensor, float]:
    """Gradient ``[d]`` and loss of the node's objective at ``flat`` on one minibatch.

    The minibatch is the first of :func:`~fedswarm.algorithms.local_sgd.minibatch_plan` with
    ``seed``, the one :meth:`LocalTrainer.fit` trains on first, so
    one gossip iteration sees exactly the data one FedAvg local step with that seed sees.
    """
    model = trainer.model
    set_flat(model, flat.to(trainer.device))
    model.train()
    pos, size = minibatch_plan(trainer.num_examples, 1, batch_size, seed)
    idx = pos[0, :int(size[0])].to(trainer.device)
    params = [p for p in model.parameters() if p.requires_grad]
    loss = trainer.task.objective(model, trainer.x[idx], trainer.y[idx])
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    flat_g = torch.cat([(torch.zeros_like(p) if gr is None else gr).reshape(-1)
                        for p, gr in zip(params, grads, strict=True)])
    return flat_g.detach().to(torch.float32).cpu(), float(loss.item())


def local_gradient(trainer: LocalTrainer, flat: torch.Tensor, *, steps: int, batch_size: int,
                   lr: float, seed: int) -> tuple[torch.Tensor, float]:
    """What a node feeds to ``algo.local_step``: the minibatch gradient when ``steps`` is
    1 (the papers' setting), else the pseudo-gradient ``(x − x_H) / lr`` of ``H = steps``
    plain local SGD steps (decentralized local SGD)."""
    if steps == 1:
        return minibatch_gradient(trainer, flat, batch_size, seed)
    res = trainer.fit(flat, steps=steps, batch_size=batch_size, lr=lr, momentum=0.0, seed=seed)
    return (flat - res.flat) / lr, res.loss
