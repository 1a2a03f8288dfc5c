"""EASGD and LSGD (Leader SGD) on ``[n, d]`` (docs/algorithms.md §9).

Both replace neighbour gossip with a pull: EASGD towards an elastic center variable,
LSGD towards the best-performing worker of the group and of the whole run (single-leader,
multi-leader and asynchronous forms). The leader election and the pull are module
functions (:func:`elect_leader`, :func:`leader_pull`) that every runtime uses.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from fedswarm.algorithms.decentralized.base import DecentralizedAlgorithm, GossipState

__all__ = ["EASGD", "LSGD", "LSGD_MODES", "contiguous_groups", "elect_leader", "leader_pull", "leader_server_update"]


def elect_leader(losses: Mapping[Any, float]) -> Any:
    """LSGD's leader, ``j* = argmin_j f_j`` (ties: the smallest key). Keys are node indices
    on ``[n, d]`` and peer ids in the swarm; the same rule everywhere."""
    if not losses:
        raise ValueError("no losses to elect a leader from")
    return min(losses, key=lambda j: (float(losses[j]), j))


def leader_pull(x: torch.Tensor, leader_x: torch.Tensor, c: float) -> torch.Tensor:
    """LSGD's periodic pull as in the official code, ``x ← (1 − c) x + c x̃`` (rows of ``x``
    towards ``leader_x``), accumulated in float64, returned in ``x``'s dtype."""
    if not 0.0 <= c <= 1.0:
        raise ValueError(f"pull strength must be in [0, 1] (got {c})")
    return ((1.0 - c) * x.to(torch.float64) + c * leader_x.to(torch.float64)).to(x.dtype)


def leader_server_update(leader_x: torch.Tensor, leader_f: float, x: torch.Tensor,
                         f: float) -> tuple[torch.Tensor, float, bool]:
    """Asynchronous LSGD's leader server: a report ``(x, f)`` with a lower loss than the
    stored leader's becomes the leader. Returns the (new) leader copy, its loss, and
    whether the reporter took over."""
    if f < leader_f:
        return x.clone(), float(f), True
    return leader_x, float(leader_f), False


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


LSGD_MODES = ("multi", "single", "async")


class LSGD(DecentralizedAlgorithm):
    """LSGD, Leader SGD (Teng et al., NeurIPS 2019, arXiv:1905.10395; docs/algorithms.md §9), in
    the three forms of the paper, as the official code (``yunfei-teng/LSGD``) applies the
    pulls, periodically::

        x_i ← x_i − η g_i                                   (every step; momentum optional)
        every τ_l steps:  x_i ← (1 − c1) x_i + c1 x̃_group(i),  x̃_group = x_{argmin_{j∈G} f_j}
        every τ_g steps:  x_i ← (1 − c2) x_i + c2 x̃_global,   x̃_global = x_{argmin_j f_j}

    ``mode``:

    * ``multi`` (default): ``groups`` contiguous groups (:func:`contiguous_groups`), each
      with its local leader, plus the global leader. When both pulls fall on the same step
      the local pull comes first (a leader does not move, so the global leader's model is
      the same before and after it).
    * ``single``: one leader, the global pull only (``groups``, ``c1``, ``tau_local`` unused).
    * ``async``: the paper's leader servers without barriers, replayed under a fixed
      schedule so every runtime computes the same thing. Each group's server and the global
      server hold a leader copy ``x̃`` and its loss ``f̃`` (buffers ``lead_local`` and
      ``lead_global``, replicated per member). Worker ``i`` talks to its group's server at
      its steps ``k`` with ``(k + i) % τ_l == 0`` and to the global server when
      ``(k + i) % τ_g == 0`` (staggered: not all at once), in node order within a step:
      it reports ``f_i``; if ``f_i < f̃`` (or the server is empty) it becomes the leader,
      ``x̃ ← x_i``; then it pulls ``x_i ← (1 − c) x_i + c x̃``. The leader it pulls towards
      can be stale (the worker that reported it has moved on since): that is the
      asynchronous form's point. This schedule is a reconstruction, not the paper's timing.

    ``f_j`` is worker ``j``'s training loss, passed to :meth:`local_step` as ``losses``
    (``[n]``); the estimate is the mean minibatch loss since the worker's last pull.

    Simplifications: ties go to the lowest index; BatchNorm statistics are not averaged
    (no BN in the flat vector). W is ignored: the groups, not the gossip graph, define
    who talks to whom.

    Per-node runtimes (the swarm) drive the same math with :meth:`due`, :meth:`node_pulls`
    and :meth:`finish_node_pulls` (sync modes), and :func:`leader_server_update` on the
    server peer with :meth:`node_pull` / :meth:`end_node_step` on the worker (async).

    State: ``x``, momentum (if ``momentum > 0``), the running loss per worker; ``async``:
    the leader copies. Wire: per pull, an all-gather of 12 bytes per worker (sync; a
    12-byte report in async) and the leader's model, 4d bytes, received by every other
    member; ``meta["wire_bytes"]`` counts received model bytes plus the 12-byte reports.
    """

    name = "lsgd"

    def __init__(self, mode: str = "multi", groups: int = 2, c1: float = 0.1, c2: float = 0.1,
                 tau_local: int = 4, tau_global: int = 16, momentum: float = 0.0, weight_decay: float = 0.0):
        super().__init__(weight_decay)
        if mode not in LSGD_MODES:
            raise ValueError(f"mode must be one of {', '.join(LSGD_MODES)} (got {mode!r})")
        for nm, v in (("c1", c1), ("c2", c2)):
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{nm} must be in [0, 1] (got {v})")
        if int(tau_local) < 1 or int(tau_global) < 1 or int(groups) < 1:
            raise ValueError("groups, tau_local and tau_global must be >= 1")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1) (got {momentum})")
        self.mode = mode
        self.groups, self.c1, self.c2 = int(groups), float(c1), float(c2)
        self.tau_local, self.tau_global, self.momentum = int(tau_local), int(tau_global), float(momentum)

    def _init_buffers(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        bufs = {"momentum": torch.zeros_like(x)} if self.momentum else {}
        if self.mode == "async":
            bufs.update({"lead_local": x.clone(), "lead_global": x.clone()})
        return bufs

    def init_state(self, x0: torch.Tensor) -> GossipState:
        state = super().init_state(x0)
        n = state.n
        state.meta.update({"wire_bytes": 0.0, "loss_sum": torch.zeros(n, dtype=torch.float64),
                           "loss_count": torch.zeros(n, dtype=torch.float64), "leaders": []})
        if self.mode == "async":  # empty servers: the first report becomes the leader
            state.meta["lead_local_loss"] = torch.full((n,), float("inf"), dtype=torch.float64)
            state.meta["lead_global_loss"] = torch.full((n,), float("inf"), dtype=torch.float64)
        return state

    def local_step(self, state: GossipState, grads: torch.Tensor, lr: float,
                   losses: Sequence[float] | torch.Tensor | None = None) -> None:
        if losses is None:
            raise ValueError("lsgd needs each worker's training loss: local_step(state, grads, lr, losses=[n])")
        losses = torch.as_tensor(losses, dtype=torch.float64).reshape(-1)
        if losses.numel() != state.n:
            raise ValueError(f"losses must have {state.n} values, got {losses.numel()}")
        if not bool(torch.isfinite(losses).all()):
            raise ValueError("lsgd losses must be finite")
        g = self._grad(state, grads)
        if self.momentum:
            m = self.momentum * state.buffers["momentum"] + g
            state.buffers["momentum"] = m
            g = m
        state.x = state.x - lr * g
        state.meta["loss_sum"] = state.meta["loss_sum"] + losses
        state.meta["loss_count"] = state.meta["loss_count"] + 1.0

    # -- which pulls are due
    def due(self, step: int, i: int = 0) -> tuple[bool, bool]:
        """``(local, global)``: whether node ``i`` pulls after iteration ``step`` (0-based).
        In the sync modes every node pulls on the same steps; in ``async`` node ``i``'s
        schedule is shifted by ``i``."""
        k = step + 1 + (i if self.mode == "async" else 0)
        local = self.mode != "single" and k % self.tau_local == 0
        return local, k % self.tau_global == 0

    def _estimate(self, state: GossipState) -> torch.Tensor:
        return state.meta["loss_sum"] / state.meta["loss_count"].clamp(min=1.0)

    def _reset_loss(self, state: GossipState, rows) -> None:
        state.meta["loss_sum"][rows] = 0.0
        state.meta["loss_count"][rows] = 0.0

    # -- all nodes at once
    def mix(self, state: GossipState, received: torch.Tensor | None = None, W: torch.Tensor | None = None) -> None:
        """Apply the pulls due after this step (``received`` and ``W`` are ignored)."""
        if self.mode == "async":
            for i in range(state.n):
                self.server_exchange(state, i, i)
        else:
            local, glob = self.due(state.step)
            if local or glob:
                f = self._estimate(state)
                n, leaders = state.n, []
                x = state.x.clone()
                if local:
                    for grp in contiguous_groups(n, self.groups):
                        lead = elect_leader({j: float(f[j]) for j in grp})
                        leaders.append(lead)
                        x[grp] = leader_pull(x[grp], x[lead], self.c1)
                        state.meta["wire_bytes"] += 4.0 * state.d * (len(grp) - 1) + 12.0 * len(grp)
                if glob:
                    lead = elect_leader({j: float(f[j]) for j in range(n)})
                    leaders.append(lead)
                    x = leader_pull(x, x[lead], self.c2)
                    state.meta["wire_bytes"] += 4.0 * state.d * (n - 1) + 12.0 * n
                state.x = x
                state.meta["leaders"] = leaders
                self._reset_loss(state, slice(None))
        state.step += 1

    # -- one node (the swarm)
    def node_pulls(self, state: GossipState, i: int, n: int, losses: Mapping[int, float]) -> list[tuple[int, float]]:
        """Sync modes, node ``i`` of ``n``: the pulls due after this step, in order, as
        ``(leader index, c)``; ``losses`` maps node indices (``i`` and whoever answered)
        to their estimate (:meth:`loss_estimate`). Fetch each leader's model (as it was
        before any pull of this step) and call :meth:`finish_node_pulls`."""
        if self.mode == "async":
            raise ValueError("async lsgd talks to leader servers: use leader_server_update / node_pull "
                             "(server_exchange on [n, d])")
        local, glob = self.due(state.step)
        pulls = []
        if local:
            grp = next(g for g in contiguous_groups(n, self.groups) if i in g)
            pulls.append((elect_leader({j: v for j, v in losses.items() if j in grp}), self.c1))
        if glob:
            pulls.append((elect_leader(dict(losses)), self.c2))
        return pulls

    def loss_estimate(self, state: GossipState) -> float:
        """A one-node state's loss estimate ``f_i`` (what it reports)."""
        return float(self._estimate(state)[0])

    def node_pull(self, state: GossipState, leader_x: torch.Tensor, c: float) -> None:
        """One pull of a one-node state towards a leader's model ``[d]`` (no step ends)."""
        state.x = leader_pull(state.x, leader_x.reshape(1, -1), c)
        state.meta["wire_bytes"] += 4.0 * state.d

    def end_node_step(self, state: GossipState, reported: bool) -> None:
        """End a one-node iteration; ``reported``: the node reported its loss this step,
        so its running estimate starts afresh."""
        if reported:
            self._reset_loss(state, slice(None))
        state.step += 1

    def finish_node_pulls(self, state: GossipState, pulls: list[tuple[int, float]],
                          leader_models: Sequence[torch.Tensor | None]) -> None:
        """Apply ``pulls`` to a one-node state with the leaders' models (None: the leader is
        this node, or its model did not arrive: no pull), then end the iteration."""
        for (_, c), xl in zip(pulls, leader_models, strict=True):
            if xl is not None:
                self.node_pull(state, xl, c)
        if pulls:
            state.meta["leaders"] = [j for j, _ in pulls]
        self.end_node_step(state, bool(pulls))

    def server_exchange(self, state: GossipState, row: int, i: int) -> None:
        """Async mode on ``[n, d]``: row ``row`` (node ``i``) reports to its group's and
        then the global leader server if due (:func:`leader_server_update`), and pulls
        towards the leader copy each returns. The servers' copies are the buffers
        ``lead_local`` (replicated over the group's rows) and ``lead_global`` (over all).
        A peer-to-peer runtime hosts each server on one peer and calls
        :func:`leader_server_update` there, :meth:`node_pull` on the worker."""
        local, glob = self.due(state.step, i)
        if not (local or glob):
            return
        f = float(self._estimate(state)[row])
        pulls = (("lead_local", "lead_local_loss", self.c1, local), ("lead_global", "lead_global_loss", self.c2, glob))
        for buf, loss_key, c, is_due in pulls:
            if not is_due:
                continue
            rows = self._server_rows(state, i, buf)
            x_lead, f_lead, took = leader_server_update(state.buffers[buf][rows[0]],
                                                        float(state.meta[loss_key][rows[0]]), state.x[row], f)
            if took:
                state.buffers[buf][rows], state.meta[loss_key][rows] = x_lead, f_lead
                state.meta["leaders"] = [i]
            else:
                state.meta["wire_bytes"] += 4.0 * state.d
            state.x[row] = leader_pull(state.x[row], x_lead, c)
            state.meta["wire_bytes"] += 12.0
        self._reset_loss(state, row)

    def _server_rows(self, state: GossipState, i: int, buf: str) -> list[int]:
        if buf == "lead_global":
            return list(range(state.n))
        return next(g for g in contiguous_groups(state.n, self.groups) if i in g)

    def node_mix(self, state, i, received, weights) -> None:
        raise NotImplementedError("lsgd pulls towards leaders, it does not gossip: per node use "
                                  "node_pulls/finish_node_pulls (sync) or server_exchange (async)")

    def wire_bytes(self, d: int, degree: int) -> int:
        """Model bytes a non-leader worker receives per iteration, averaged over the periods."""
        local = 0 if self.mode == "single" else 4 * d // self.tau_local
        return local + 4 * d // self.tau_global

    def hyperparams(self) -> dict[str, Any]:
        return {"mode": self.mode, "groups": self.groups, "c1": self.c1, "c2": self.c2,
                "tau_local": self.tau_local, "tau_global": self.tau_global, "momentum": self.momentum,
                **super().hyperparams()}
