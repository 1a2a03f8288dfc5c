"""Example-level DP-SGD inside a client, through opacus.

Update rule (Abadi, Chu, Goodfellow, McMahan, Mironov, Talwar, Zhang, "Deep Learning with
Differential Privacy", CCS 2016, Alg. 1), each local step::

    lot  ← each local example independently with probability q = B / n     (Poisson)
    ḡ_e  ← ∇ℓ(θ; e) · min(1, C / ||∇ℓ(θ; e)||)       for e in the lot
    θ    ← θ − η · (Σ_e ḡ_e + N(0, (z·C)² I)) / B

opacus computes the per-example gradients (``GradSampleModule``) and clips and noises them
(``DPOptimizer``, ``expected_batch_size = B``); the Poisson sampling is drawn here with the
step's seeded generator, as the accountant assumes. A lot that comes out empty is a step
of noise alone (the mechanism still runs).

State: none kept across rounds (a DP copy of the model per trainer). Wire: unchanged.
The server accounts each client's steps (q, z, steps) and reports the worst client's ε.
"""

from __future__ import annotations

import copy
import warnings

import torch

from fedswarm.params import get_flat, set_flat

__all__ = ["dp_sgd_fit"]


def _dp_model(trainer):
    """An opacus ``GradSampleModule`` around a copy of the trainer's model (kept on the
    trainer: hooks are added once)."""
    gsm = getattr(trainer, "_dp_module", None)
    if gsm is None:
        from opacus import GradSampleModule

        gsm = GradSampleModule(copy.deepcopy(trainer.model), loss_reduction="mean")
        trainer._dp_module = gsm
    return gsm


def dp_sgd_fit(trainer, flat: torch.Tensor, spec, *, steps: int, batch_size: int, lr: float,
               momentum: float = 0.0, seed: int = 0) -> tuple[torch.Tensor, float, float]:
    """``steps`` DP-SGD steps from ``flat`` on the trainer's data; returns (new flat,
    mean loss, sampling rate q)."""
    from opacus.optimizers import DPOptimizer

    if spec.noise_multiplier is None:
        raise ValueError("--dp-sgd needs noise_multiplier=N in the clients (target_epsilon alone is calibrated "
                         "by the server for --dp only)")
    gsm = _dp_model(trainer)
    inner = gsm._module
    set_flat(inner, flat)
    gsm.train()
    n = trainer.num_examples
    batch = min(batch_size, n)
    q = batch / n
    g = torch.Generator().manual_seed(seed)
    params = [p for p in gsm.parameters() if p.requires_grad]
    opt = DPOptimizer(torch.optim.SGD(params, lr=lr, momentum=momentum), noise_multiplier=spec.noise_multiplier,
                      max_grad_norm=spec.clip, expected_batch_size=batch, loss_reduction="mean", generator=g)
    total = 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # opacus warns about hooks on input-less modules
        for _ in range(steps):
            mask = torch.rand(n, generator=g) < q
            idx = mask.nonzero().flatten().to(trainer.device)
            opt.zero_grad(set_to_none=True)
            if idx.numel() == 0:  # nobody sampled: the step is noise alone
                for p in params:
                    p.grad = torch.randn(p.shape,
                                         generator=g).to(p.device) * (spec.noise_multiplier * spec.clip / batch)
                opt.original_optimizer.step()
                continue
            loss = trainer.task.objective(gsm, trainer.x[idx], trainer.y[idx])
            loss.backward()
            opt.step()
            total += float(loss.item())
    opt.zero_grad(set_to_none=True)
    return get_flat(inner).cpu(), total / max(1, steps), q
