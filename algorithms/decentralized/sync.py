"""Synchronous gossip algorithms: D-PSGD, D², DSGDm and QG-DSGDm.

Each is a :class:`~fedswarm.algorithms.decentralized.base.DecentralizedAlgorithm`; equations
follow ``docs/algorithms.md`` (§2, §4, §8). All math is on ``[n, d]`` tensors.
Notation: ``x`` models, ``g`` gradients at the pre-mix models, ``η`` the learning rate
passed to ``local_step``, ``W`` the round's mixing matrix.
"""

from __future__ import annotations

from typing import Any

import torch

from fedswarm.algorithms.decentralized.base import DecentralizedAlgorithm, GossipState

__all__ = ["DPSGD", "D2", "DSGDm", "QGDSGDm"]


class DPSGD(DecentralizedAlgorithm):
    """D-PSGD, decentralized parallel SGD (Lian et al., NeurIPS 2017; docs/algorithms.md §2).

    Update, ``order="cta"`` (combine-then-adapt, the paper's Algorithm 1)::

        x_i ← Σ_j W_ij x_j − η g_i,     g_i = ∇F_i(x_i; ξ_i) at the pre-mix model

    The message is the pre-step model, so sending overlaps the gradient computation.
    With ``order="atc"`` (adapt-then-combine, the form D² and epfml's code use)::

        x_i ← Σ_j W_ij (x_j − η g_j)

    On the complete graph with ``W = 11ᵀ/n`` and equal starting models, "atc" is exactly
    centralized minibatch SGD at every node. With "cta" each node differs from the average
    by its own last step, and the average is centralized SGD only when the local losses
    share a Hessian (quadratics); in general gradients are taken at different points.

    State: ``x``; "cta" also the pending local update ``−η g`` (d floats).
    Wire: 4d bytes to each neighbour per iteration.
    """

    name = "dpsgd"

    def __init__(self, order: str = "cta", weight_decay: float = 0.0):
        super().__init__(weight_decay)
        if order not in ("cta", "atc"):
            raise ValueError(f"order must be 'cta' or 'atc' (got {order!r})")
        self.order = order

    def _init_buffers(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"update": torch.zeros_like(x)} if self.order == "cta" else {}

    def local_step(self, state: GossipState, grads: torch.Tensor, lr: float) -> None:
        g = self._grad(state, grads)
        if self.order == "cta":
            state.buffers["update"] = -lr * g
        else:
            state.x = state.x - lr * g

    def _finish(self, state: GossipState, mixed: torch.Tensor) -> None:
        if self.order == "cta":
            mixed = mixed + state.buffers["update"]
            state.buffers["update"] = torch.zeros_like(mixed)
        super()._finish(state, mixed)

    def hyperparams(self) -> dict[str, Any]:
        return {"order": self.order, **super().hyperparams()}


class D2(DecentralizedAlgorithm):
    """D², decentralized training over decentralized data (Tang et al., ICML 2018;
    docs/algorithms.md §4). Removes D-PSGD's bias from data heterogeneity::

        t = 0:  x_{1/2} = x_0 − η g_0                                  (D-PSGD, "atc")
        t ≥ 1:  x_{t+1/2} = 2 x_t − x_{t−1} − η g_t + η g_{t−1}
        x_{t+1} = W x_{t+1/2}

    ``g_{t−1}`` is the stored gradient of the previous step, not recomputed. We store
    ``η_{t−1} g_{t−1}`` (identical for a constant η, the paper's setting), which keeps the
    node average moving by exactly ``−mean_i η_t g_i`` under a learning-rate schedule.

    Requires ``λ_min(W) > −1/3``; :meth:`check_mixing_matrix` refuses any other W (an
    even ring with 1/3 weights has exactly −1/3: use an odd n or ``ring+lazy``).

    State: ``x_t``, ``x_{t−1}``, ``η g_{t−1}`` (3d floats).
    Wire: 4d bytes of ``x_{t+1/2}`` to each neighbour per iteration.
    """

    name = "d2"
    min_eigenvalue: float = -1.0 / 3.0

    def _init_buffers(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"x_prev": x.clone(), "lr_grad_prev": torch.zeros_like(x)}

    def local_step(self, state: GossipState, grads: torch.Tensor, lr: float) -> None:
        lr_g = lr * self._grad(state, grads)
        if state.step == 0:
            half = state.x - lr_g
        else:
            half = 2 * state.x - state.buffers["x_prev"] - lr_g + state.buffers["lr_grad_prev"]
        state.buffers["x_prev"] = state.x
        state.buffers["lr_grad_prev"] = lr_g
        state.x = half

    def check_mixing_matrix(self, W: torch.Tensor) -> None:
        super().check_mixing_matrix(W)
        lam = float(torch.linalg.eigvalsh(W.to(torch.float64)).min())
        if lam <= self.min_eigenvalue + 1e-9:
            raise ValueError(
                f"D² needs the mixing matrix's smallest eigenvalue > -1/3, but it is "
                f"{lam:.6g}; use a lazy topology (append '+lazy', e.g. 'ring+lazy', for "
                f"W <- (I + W)/2) or, on a ring, an odd number of nodes"
            )


class DSGDm(DecentralizedAlgorithm):
    """DSGDm, D-PSGD with local heavy-ball momentum (the baseline of Lin et al., ICML 2021,
    as in epfml's code; adapt-then-combine)::

        m_i ← β m_i + g_i
        x_i^{t+1/2} = x_i − η u_i,   u_i = m_i  (heavy ball)  or  g_i + β m_i  (Nesterov)
        x_i^{t+1} = Σ_j W_ij x_j^{t+1/2}

    State: ``x``, ``m`` (2d floats). Wire: 4d bytes to each neighbour per iteration.
    """

    name = "dsgdm"

    def __init__(self, momentum: float = 0.9, nesterov: bool = False, weight_decay: float = 0.0):
        super().__init__(weight_decay)
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1) (got {momentum})")
        self.momentum = float(momentum)
        self.nesterov = bool(nesterov)

    def _init_buffers(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"momentum": torch.zeros_like(x)}

    def local_step(self, state: GossipState, grads: torch.Tensor, lr: float) -> None:
        g = self._grad(state, grads)
        m = self.momentum * state.buffers["momentum"] + g
        state.buffers["momentum"] = m
        u = g + self.momentum * m if self.nesterov else m
        state.x = state.x - lr * u

    def hyperparams(self) -> dict[str, Any]:
        return {"momentum": self.momentum, "nesterov": self.nesterov, **super().hyperparams()}


class QGDSGDm(DecentralizedAlgorithm):
    """QG-DSGDm, quasi-global momentum (Lin, Karimireddy, Stich, Jaggi, ICML 2021;
    docs/algorithms.md §8; epfml/quasi-global-momentum ``decentralized_qg_sgd.py``)::

        g   = ∇F_i(x_i^t) + wd·x_i^t
        m   = g + β m̂_i                 (heavy ball)  or  g + β(β m̂_i + g)  (Nesterov)
        x_i^{t+1/2} = x_i^t − η m
        x_i^{t+1}   = Σ_j W_ij x_j^{t+1/2}
        d_i = (x_i^t − x_i^{t+1}) / η   # displacement, neighbours' progress included
        m̂_i ← μ m̂_i + (1 − μ) d_i

    ``m̂`` is never updated with the raw local gradient, only through ``d_i``. With η = 0
    there is no displacement to learn from and ``m̂`` is left unchanged. (The official
    code can update ``m̂`` every few steps; we update it every step, its default.)

    State: ``x``, ``m̂``, the pre-step ``x^t`` (3d floats). Wire: 4d bytes to each
    neighbour per iteration, exactly as DSGD.
    """

    name = "qgm"

    def __init__(self, momentum: float = 0.9, mu: float = 0.9, nesterov: bool = False,
                 weight_decay: float = 0.0):
        super().__init__(weight_decay)
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1) (got {momentum})")
        if not 0.0 <= mu < 1.0:
            raise ValueError(f"mu must be in [0, 1) (got {mu})")
        self.momentum = float(momentum)
        self.mu = float(mu)
        self.nesterov = bool(nesterov)

    def _init_buffers(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"m_hat": torch.zeros_like(x), "x_prev": x.clone()}

    def local_step(self, state: GossipState, grads: torch.Tensor, lr: float) -> None:
        g = self._grad(state, grads)
        m_hat = state.buffers["m_hat"]
        m = self.momentum * m_hat + g
        if self.nesterov:
            m = g + self.momentum * m
        state.buffers["x_prev"] = state.x
        state.meta["lr"] = float(lr)
        state.x = state.x - lr * m

    def _finish(self, state: GossipState, mixed: torch.Tensor) -> None:
        lr = state.meta.pop("lr", 0.0)  # consumed: a mix without a local step learns nothing
        if lr != 0.0:
            d = (state.buffers["x_prev"] - mixed) / lr
            state.buffers["m_hat"] = self.mu * state.buffers["m_hat"] + (1.0 - self.mu) * d
        super()._finish(state, mixed)

    def hyperparams(self) -> dict[str, Any]:
        return {"momentum": self.momentum, "mu": self.mu, "nesterov": self.nesterov,
                **super().hyperparams()}
