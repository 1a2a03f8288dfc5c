"""SQuARM-SGD: Nesterov momentum, event-triggered compressed gossip (docs/algorithms.md §7).

Singh, Data, George, Diggavi, "SQuARM-SGD: Communication-Efficient Momentum SGD for
Decentralized Optimization", IEEE JSAIT 2021, arXiv:2005.07041.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch

from fedswarm.params import ParamLayout
from fedswarm.algorithms.compression.codecs import make_codec
from fedswarm.algorithms.decentralized.base import DecentralizedAlgorithm, GossipState, gossip
from fedswarm.payload import Payload, PayloadError, check_array

__all__ = ["SQuARM"]


class SQuARM(DecentralizedAlgorithm):
    """SQuARM-SGD (Singh et al., JSAIT 2021; docs/algorithms.md §7). Node ``i``, step ``t``::

        v_i ← β v_i + g_i
        x_i^{t+1/2} = x_i − η (β v_i + g_i)                        # Nesterov step
        if (t+1) % H == 0:                                          # synchronization step
            δ_i = x_i^{t+1/2} − x̂_i
            q_i = C(δ_i)  if ‖δ_i‖² > c·η²  else 0                  # event trigger (local)
            x̂_j ← x̂_j + q_j  for j ∈ N(i) ∪ {i}                     # public replicas
            x_i^{t+1} = x_i^{t+1/2} + γ Σ_j w_ij (x̂_j − x̂_i)
        else:  x_i^{t+1} = x_i^{t+1/2}

    ``C`` is a codec of :mod:`fedswarm.algorithms.compression.codecs` (``topk``, ``sign``, ``none``, ...)
    applied to the whole flat vector; the message is the decoded ``q_i`` (zeros when not
    triggered or not a sync step). What the compressor drops stays in ``x − x̂`` and is
    re-sent later (CHOCO-style implicit error feedback).

    Implementation choices (documented simplifications):

    * Node ``i`` keeps ``x̂_i`` and ``s_i = Σ_j w_ij x̂_j`` (self included) instead of one
      replica per neighbour; ``s_i ← s_i + Σ_j w_ij q_j`` is the same thing for a *static*
      W, so time-varying topologies are refused. A neighbour that fails for a round on the
      router (its weight moved to the node itself) makes ``s_i`` drift from the true
      weighted replica sum from then on.
    * Replicas start at the initial model when every node starts from the same model
      (fedswarm always does), else at zero as in CHOCO-SGD.
    * The threshold is constant (``c_t = c``); the paper lets it shrink.

    With codec ``none``, ``threshold = 0``, ``gamma = 1`` and ``period = 1`` it is exactly
    DSGDm with Nesterov momentum (adapt-then-combine).

    State: ``x``, momentum ``v``, ``x̂_i``, ``s_i`` and the pending message ``q`` (5d floats).
    Wire: only at sync steps and only if triggered: the codec's payload (e.g. top-k: 8k
    bytes) to each neighbour; 0 bytes otherwise. :attr:`GossipState.meta` ``"wire_bytes"``
    accumulates what the nodes sent, ``"triggers"`` how many node-sends happened.
    """

    name = "squarm"

    def __init__(self, momentum: float = 0.9, gamma: float = 0.5, period: int = 5, threshold: float = 0.0,
                 codec: str = "topk", ratio: float = 0.01, seed: int = 0, weight_decay: float = 0.0):
        super().__init__(weight_decay)
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1) (got {momentum})")
        if not 0.0 < gamma <= 1.0:
            raise ValueError(f"gamma must be in (0, 1] (got {gamma})")
        if int(period) < 1:
            raise ValueError(f"period must be >= 1 (got {period})")
        if threshold < 0:
            raise ValueError(f"threshold must be >= 0 (got {threshold})")
        self.momentum, self.gamma, self.period = float(momentum), float(gamma), int(period)
        self.threshold, self.codec_name, self.ratio, self.seed = float(threshold), codec, float(ratio), int(seed)
        params = {"ratio": self.ratio} if codec in ("topk", "randk") else {}
        self.codec = make_codec(codec, **params)
        self._layouts: dict[int, ParamLayout] = {}

    def _layout(self, d: int) -> ParamLayout:
        if d not in self._layouts:
            self._layouts[d] = ParamLayout.from_shapes([("x", (d,))])
        return self._layouts[d]

    def payload_bytes(self, d: int) -> int:
        """Bytes of one triggered message (the codec's payload for one node)."""
        return int(self.codec.wire_bytes(self._layout(d), 1))

    def _init_buffers(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        same = bool((x == x[:1]).all())
        rep = x.clone() if same else torch.zeros_like(x)
        return {"momentum": torch.zeros_like(x), "x_hat": rep, "s": rep.clone(), "q": torch.zeros_like(x)}

    def init_state(self, x0: torch.Tensor) -> GossipState:
        state = super().init_state(x0)
        state.meta.update({"sync": 0.0, "wire_bytes": 0.0, "triggers": 0.0})
        return state

    def is_sync(self, step: int) -> bool:
        return (step + 1) % self.period == 0

    def local_step(self, state: GossipState, grads: torch.Tensor, lr: float) -> None:
        g = self._grad(state, grads)
        v = self.momentum * state.buffers["momentum"] + g
        state.buffers["momentum"] = v
        state.x = state.x - lr * (self.momentum * v + g)
        q = torch.zeros_like(state.x)
        sync = self.is_sync(state.step)
        state.payloads = {}
        if sync:
            delta = state.x - state.buffers["x_hat"]
            fire = delta.pow(2).sum(dim=1) > self.threshold * lr * lr
            layout = self._layout(state.d)
            for r in torch.nonzero(fire).reshape(-1).tolist():  # one payload per node: what it sends
                payload = self.codec.encode(delta[r : r + 1], layout, seed=self._codec_seed(state, r))
                state.payloads[r] = payload
                q[r] = self.codec.decode(payload, layout)[0].to(q.dtype)
        state.buffers["q"] = q
        state.meta["sync"] = 1.0 if sync else 0.0

    def _codec_seed(self, state: GossipState, row: int) -> int:
        return (self.seed * 1_000_003 + state.step * 7_919 + state.index0 + row) % (2**31 - 1)

    def payload(self, state: GossipState, row: int = 0) -> Payload:
        """The codec's payload of ``q_row`` if the node fired this step, else an empty
        ``skip`` message (a few bytes of metadata)."""
        p = state.payloads.get(row)
        return p if p is not None else Payload({}, {"kind": "skip"})

    def read_payload(self, payload: Payload, d: int) -> torch.Tensor:
        if payload.meta.get("kind") == "skip":
            if payload.arrays:
                raise PayloadError("a squarm 'skip' message carries no arrays")
            return torch.zeros(d)
        for k, a in payload.arrays.items():
            check_array(k, a.detach().cpu().numpy() if isinstance(a, torch.Tensor) else np.asarray(a))
        q = self.codec.decode(payload, self._layout(d))
        if q.shape != (1, d):
            raise PayloadError(f"squarm message decodes to shape {tuple(q.shape)}, expected (1, {d})")
        return q[0].to(torch.float32)

    def replica_mix(self, state: GossipState, i: int, replicas: Mapping[int, torch.Tensor],
                    weights: Mapping[int, float]) -> None:
        """A peer's mix from explicit copies: ``replicas[j]`` is node ``i``'s copy of
        ``x̂_j`` for each neighbour ``j`` (the caller has already added ``q_j``), so
        ``s_i = w_ii x̂_i + Σ_j w_ij x̂_j`` is recomputed rather than kept incrementally.
        Same result as :meth:`node_mix` on a static topology (to float rounding), and it
        stays right when the neighbour set changes (the swarm's membership)."""
        if state.n != 1:
            raise ValueError(f"replica_mix needs a one-node state, got n={state.n}")
        if set(weights) != {i, *replicas}:
            raise ValueError(f"weights must cover node {i} and exactly the replicas held "
                             f"(weights: {sorted(weights)}, replicas: {sorted(replicas)})")
        self._account(state, (state.buffers["q"] != 0).any(dim=1), torch.tensor([len(replicas)]))
        x_hat = state.buffers["x_hat"] + state.buffers["q"]  # x̂_i after this step's q_i
        order = sorted(replicas)
        X = torch.stack([x_hat[0]] + [replicas[j].reshape(-1).to(x_hat.dtype) for j in order])
        w = torch.tensor([[weights[i]] + [weights[j] for j in order]], dtype=torch.float64)
        state.buffers["s"] = torch.zeros_like(x_hat)  # _finish adds the mix: s = Σ_j w_ij x̂_j
        self._finish(state, gossip(w, X))

    def message(self, state: GossipState) -> torch.Tensor:
        return state.buffers["q"]

    def _account(self, state: GossipState, sent: torch.Tensor, degrees: torch.Tensor) -> None:
        state.meta["triggers"] = state.meta.get("triggers", 0.0) + float(sent.sum())
        state.meta["wire_bytes"] = state.meta.get("wire_bytes", 0.0) + float(
            (sent.to(torch.float64) * degrees.to(torch.float64)).sum() * self.payload_bytes(state.d))

    def mix(self, state: GossipState, received: torch.Tensor, W: torch.Tensor) -> None:
        off = (W != 0).to(torch.int64)
        deg = off.sum(dim=1) - torch.diagonal(off)
        self._account(state, (state.buffers["q"] != 0).any(dim=1), deg)
        super().mix(state, received, W)

    def node_mix(self, state: GossipState, i: int, received: Mapping[int, torch.Tensor],
                 weights: Mapping[int, float]) -> None:
        self._account(state, (state.buffers["q"] != 0).any(dim=1), torch.tensor([len(received)]))
        super().node_mix(state, i, received, weights)

    def _finish(self, state: GossipState, mixed: torch.Tensor) -> None:
        q = state.buffers["q"]
        state.buffers["x_hat"] = state.buffers["x_hat"] + q
        state.buffers["s"] = state.buffers["s"] + mixed
        if state.meta.get("sync", 0.0):
            mixed_x = state.x + self.gamma * (state.buffers["s"] - state.buffers["x_hat"])
        else:
            mixed_x = state.x
        state.buffers["q"] = torch.zeros_like(q)
        state.meta["sync"] = 0.0
        super()._finish(state, mixed_x)

    def check_topology(self, topology) -> None:
        if topology.time_varying:
            raise ValueError(f"squarm keeps Σ_j w_ij x̂_j incrementally, so it needs a static topology; "
                             f"'{topology.name}' is time-varying")
        super().check_topology(topology)

    def wire_bytes(self, d: int, degree: int) -> int:
        """Upper bound per iteration, averaged over the period: one payload to each
        neighbour every ``period`` steps if it triggers (0 when it does not)."""
        return degree * self.payload_bytes(d) // self.period

    def hyperparams(self) -> dict[str, Any]:
        return {"momentum": self.momentum, "gamma": self.gamma, "period": self.period,
                "threshold": self.threshold, "codec": self.codec_name, "ratio": self.ratio,
                "seed": self.seed, **super().hyperparams()}
