"""EASGD and LSGD (Leader SGD), synchronous versions on ``[n, d]`` (docs/algorithms.md §9).

Both replace neighbour gossip with a pull: EASGD towards an elastic center variable,
LSGD towards the best-performing worker of the group and of the whole run.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from fedswarm.algorithms.decentralized.base import DecentralizedAlgorithm, GossipState

__all__ = ["EASGD", "LSGD", "contiguous_groups"]


def contiguous_groups(n: int, groups: int) -> list[list[int]]:
    """Split nodes ``0..n-1`` into ``groups`` contiguous groups of (nearly) equal size,
    like the GPUs of one machine."""
    if not 1 <= groups <= n:
        raise ValueError(f"groups must be in [1, n={n}] (got {groups})")
    bounds = [round(k * n / groups) for k in range(groups + 1)]
    return [list(range(bounds[k], bounds[k + 1])) for k in range(groups)]


class EASGD(DecentralizedAlgorithm):
    """EASGD, elastic averaging SGD (Zhang, Choromanska, LeCun, NeurIPS 2015), the
    baseline LSGD argues against (docs/algorithms.md §9). Synchronous, every ``period`` steps::

        x_i ← x_i − η g_i                                   (every step)
        if (t+1) % τ == 0:   α = β / n
            x_i ← x_i − α (x_i − c)                          (elastic pull)
            c   ← c + α Σ_i (x_i − c)                        (with the pre-pull x_i)

    ``β`` is the moving rate (0.43 in the LSGD code's EASGD baseline). The center ``c`` is
    kept by every node as an identical replica: ``Σ_i x_i = n · (W x)_i`` needs the
    all-reduce, so :meth:`check_mixing_matrix` requires ``W = 11ᵀ/n`` (topology
    ``complete``). On the router each node updates its own replica of ``c`` from the
    gossiped average, which equals the parameter server's ``c``.

    Simplification: plain SGD locally (the paper's EAMSGD momentum variant is left out).

    State: ``x``, the center ``c`` (2d floats).
    Wire: every τ steps a reduce of each worker's model and a broadcast of the center,
    4d bytes sent and 4d received per worker (``meta["wire_bytes"]`` counts sent bytes).
    """

    name = "easgd"

    def __init__(self, beta: float = 0.43, period: int = 16, weight_decay: float = 0.0):
        super().__init__(weight_decay)
        if not 0.0 < beta <= 1.0:
            raise ValueError(f"beta must be in (0, 1] (got {beta})")
        if int(period) < 1:
            raise ValueError(f"period must be >= 1 (got {period})")
        self.beta, self.period = float(beta), int(period)

    def _init_buffers(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"center": x.mean(dim=0, keepdim=True).expand_as(x).clone()}

    def init_state(self, x0: torch.Tensor) -> GossipState:
        state = super().init_state(x0)
        state.meta["wire_bytes"] = 0.0
        return state

    def local_step(self, state: GossipState, grads: torch.Tensor, lr: float) -> None:
        state.x = state.x - lr * self._grad(state, grads)

    def mix(self, state: GossipState, received: torch.Tensor, W: torch.Tensor) -> None:
        super().mix(state, received, W)

    def _finish(self, state: GossipState, mixed: torch.Tensor) -> None:
        # mixed = W @ x = the average of all workers (W = 11ᵀ/n), replicated per node
        if (state.step + 1) % self.period == 0:
            n_total = state.meta.get("n_total", float(state.n))
            alpha = self.beta / n_total
            c = state.buffers["center"]
            x = state.x
            state.x = x - alpha * (x - c)
            state.buffers["center"] = c + self.beta * (mixed - c)  # α Σ_i (x_i − c) = β (x̄ − c)
            state.meta["wire_bytes"] = state.meta.get("wire_bytes", 0.0) + 4.0 * state.d * state.n
        state.step += 1

    def node_mix(self, state: GossipState, i: int, received: Mapping[int, torch.Tensor],
                 weights: Mapping[int, float]) -> None:
        state.meta["n_total"] = float(len(weights))
        super().node_mix(state, i, received, weights)

    def check_mixing_matrix(self, W: torch.Tensor) -> None:
        super().check_mixing_matrix(W)
        n = W.shape[0]
        if not torch.allclose(W.to(torch.float64), torch.full((n, n), 1.0 / n, dtype=torch.float64), atol=1e-9):
            raise ValueError("EASGD needs the all-reduce of every worker (W = 11ᵀ/n): use topology 'complete'")

    def wire_bytes(self, d: int, degree: int) -> int:
        """Per iteration, averaged over the period: 4d sent every τ steps."""
        return 4 * d // self.period

    def hyperparams(self) -> dict[str, Any]:
        return {"beta": self.beta, "period": self.period, **super().hyperparams()}


class LSGD(DecentralizedAlgorithm):
    """LSGD, Leader SGD (Teng et al., NeurIPS 2019, arXiv:1905.10395; docs/algorithms.md §9), the
    synchronous multi-leader version as in the official code (``yunfei-teng/LSGD``)::

        x_i ← x_i − η g_i                                   (every step; momentum optional)
        every τ_l steps:  x_i ← (1 − c1) x_i + c1 x̃_group(i),  x̃_group = x_{argmin_{j∈G} f_j}
        every τ_g steps:  x_i ← (1 − c2) x_i + c2 x̃_global,   x̃_global = x_{argmin_j f_j}

    ``f_j`` is worker ``j``'s training loss, passed to :meth:`local_step` as ``losses``
    (``[n]``). Groups are contiguous (``contiguous_groups``). When both pulls fall on the
    same step the local pull is applied first (the leaders themselves do not move).

    Simplifications: ``f_j`` is the mean minibatch loss since the last pull (the code
    all-gathers the recent training loss, the paper's stochastic LSGD estimates f from
    it); ties go to the lowest index; BatchNorm statistics are not averaged (no BN in the
    flat vector); the asynchronous variant (leader servers) is not here. W is ignored:
    the groups, not the gossip graph, define who talks to whom. It needs every worker's
    loss, so it runs on the ``[n, d]`` simulator, not on the per-node router.

    State: ``x``, momentum (if ``momentum > 0``), the running loss per worker.
    Wire: per pull, an all-gather of 12 bytes per worker and the leader's model, 4d bytes,
    received by every other member; ``meta["wire_bytes"]`` counts received model bytes
    plus the 12-byte reports.
    """

    name = "lsgd"

    def __init__(self, groups: int = 2, c1: float = 0.1, c2: float = 0.1, tau_local: int = 4,
                 tau_global: int = 16, momentum: float = 0.0, weight_decay: float = 0.0):
        super().__init__(weight_decay)
        for nm, v in (("c1", c1), ("c2", c2)):
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{nm} must be in [0, 1] (got {v})")
        if int(tau_local) < 1 or int(tau_global) < 1 or int(groups) < 1:
            raise ValueError("groups, tau_local and tau_global must be >= 1")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1) (got {momentum})")
        self.groups, self.c1, self.c2 = int(groups), float(c1), float(c2)
        self.tau_local, self.tau_global, self.momentum = int(tau_local), int(tau_global), float(momentum)

    def _init_buffers(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"momentum": torch.zeros_like(x)} if self.momentum else {}

    def init_state(self, x0: torch.Tensor) -> GossipState:
        state = super().init_state(x0)
        state.meta.update({"wire_bytes": 0.0, "loss_sum": torch.zeros(state.n, dtype=torch.float64),
                           "loss_count": 0, "leaders": []})
        return state

    def local_step(self, state: GossipState, grads: torch.Tensor, lr: float,
                   losses: Sequence[float] | torch.Tensor | None = None) -> None:
        if losses is None:
            raise ValueError("lsgd needs each worker's training loss: local_step(state, grads, lr, losses=[n])")
        losses = torch.as_tensor(losses, dtype=torch.float64).reshape(-1)
        if losses.numel() != state.n:
            raise ValueError(f"losses must have {state.n} values, got {losses.numel()}")
        g = self._grad(state, grads)
        if self.momentum:
            m = self.momentum * state.buffers["momentum"] + g
            state.buffers["momentum"] = m
            g = m
        state.x = state.x - lr * g
        state.meta["loss_sum"] = state.meta["loss_sum"] + losses
        state.meta["loss_count"] += 1

    def mix(self, state: GossipState, received: torch.Tensor | None = None, W: torch.Tensor | None = None) -> None:
        """Apply the pulls due after this step (``received`` and ``W`` are ignored)."""
        k = state.step + 1
        pull_l, pull_g = k % self.tau_local == 0, k % self.tau_global == 0
        if pull_l or pull_g:
            f = state.meta["loss_sum"] / max(1, state.meta["loss_count"])
            x = state.x.to(torch.float64)
            leaders = []
            d, n = state.d, state.n
            if pull_l:
                for grp in contiguous_groups(n, self.groups):
                    idx = torch.tensor(grp)
                    lead = grp[int(torch.argmin(f[idx]))]
                    leaders.append(lead)
                    x[idx] = (1.0 - self.c1) * x[idx] + self.c1 * x[lead]
                    state.meta["wire_bytes"] += 4.0 * d * (len(grp) - 1) + 12.0 * len(grp)
            if pull_g:
                lead = int(torch.argmin(f))
                leaders.append(lead)
                x = (1.0 - self.c2) * x + self.c2 * x[lead]
                state.meta["wire_bytes"] += 4.0 * d * (n - 1) + 12.0 * n
            state.x = x.to(state.x.dtype)
            state.meta["leaders"] = leaders
            state.meta["loss_sum"] = torch.zeros(n, dtype=torch.float64)
            state.meta["loss_count"] = 0
        state.step += 1

    def node_mix(self, state, i, received, weights) -> None:
        raise NotImplementedError("lsgd needs every worker's loss: it runs on the [n, d] simulator "
                                  "(or the swarm's LeaderDriver), not per node")

    def wire_bytes(self, d: int, degree: int) -> int:
        """Model bytes a non-leader worker receives per iteration, averaged over the periods."""
        return 4 * d // self.tau_local + 4 * d // self.tau_global

    def hyperparams(self) -> dict[str, Any]:
        return {"groups": self.groups, "c1": self.c1, "c2": self.c2, "tau_local": self.tau_local,
                "tau_global": self.tau_global, "momentum": self.momentum, **super().hyperparams()}
