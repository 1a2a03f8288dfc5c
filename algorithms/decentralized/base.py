"""The shape every decentralized algorithm shares: state, local step, message, mix.

Decentralized algorithms keep no global model; node ``i``'s model is row ``i`` of
``x [n, d]``. One iteration, identical for the three runtimes that drive these objects
(the Flower router strategy, the simulator and the swarm peers):

1. each node computes its gradient ``g_i`` at its current model ``state.x[i]``;
2. ``algo.local_step(state, grads, lr)`` — the local part of the update;
3. ``algo.message(state)`` — row ``i`` is what node ``i`` sends to every neighbour;
4. ``algo.mix(state, received, W)`` — gossip ``W @ received`` and finish the update.

The simulator holds all ``n`` nodes in one state and calls ``mix`` with the stacked
messages, so a gossip step is one matrix product. A peer holds a one-node state
(``init_state(x0[None])`` or ``state.node(i)``) and calls :meth:`node_mix` with the
messages it received and its row of W (``topology.weights(i, round)``); both paths end in
the same ``_finish``, and tests hold them equal. A peer cannot see all of W, so its runtime
calls :meth:`check_topology` once at start.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping

import numpy as np
import torch

from fedswarm.algorithms.decentralized.topology import Topology, check_mixing
from fedswarm.payload import Payload, PayloadError, check_array

__all__ = ["GossipState", "DecentralizedAlgorithm", "gossip", "consensus_distance"]


@dataclass
class GossipState:
    """The memory of ``n`` nodes (or of one node, ``n = 1``).

    Attributes
    ----------
    x : torch.Tensor
        ``[n, d]`` float32, each node's model.
    buffers : dict[str, torch.Tensor]
        Algorithm memory, each ``[n, d]`` (momentum, previous model, ...).
    step : int
        Completed iterations (one local step plus one mix).
    meta : dict[str, Any]
        Small per-state scalars (e.g. the last learning rate).
    index0 : int
        Global index of row 0 (a peer's one-node state: its node index), so per-node
        randomness (codec seeds) is the same whichever runtime holds the node.
    payloads : dict[int, Payload]
        Transient: messages the last local step encoded, by row (compressed algorithms);
        not part of the persisted state.
    """

    x: torch.Tensor
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    step: int = 0
    meta: dict[str, Any] = field(default_factory=dict)
    index0: int = 0
    payloads: dict[int, Payload] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return self.x.shape[0]

    @property
    def d(self) -> int:
        return self.x.shape[1]

    def node(self, i: int) -> "GossipState":
        """An independent copy of node ``i``'s memory as a one-node state (what a peer
        holds)."""
        return GossipState(
            x=self.x[i : i + 1].clone(),
            buffers={k: v[i : i + 1].clone() for k, v in self.buffers.items()},
            step=self.step,
            meta=dict(self.meta),
            index0=self.index0 + i,
        )

    def clone(self) -> "GossipState":
        return GossipState(
            x=self.x.clone(),
            buffers={k: v.clone() for k, v in self.buffers.items()},
            step=self.step,
            meta=dict(self.meta),
            index0=self.index0,
        )


_CHUNK = 1 << 22  # columns per float64 block: caps the temporary copy at n * 32 MiB


def gossip(W: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``W @ x`` accumulated in float64 and returned in ``x``'s dtype.

    Why float64: in float32, weights such as 1/3 are rounded and W's columns no longer sum
    to exactly 1, so every round scales the node average by about 1 + 1e-7. D-PSGD barely
    notices; D² integrates that error in its invariant and drifts away from the optimum
    linearly in time. Column blocks keep the float64 temporary small for large d.
    """
    W64 = W.to(device=x.device, dtype=torch.float64)
    if x.dtype == torch.float64:
        return W64 @ x
    out = torch.empty((W.shape[0], x.shape[1]), dtype=x.dtype, device=x.device)
    for start in range(0, x.shape[1], _CHUNK):
        block = x[:, start : start + _CHUNK].to(torch.float64)
        out[:, start : start + _CHUNK] = W64 @ block
    return out


def consensus_distance(x: torch.Tensor) -> float:
    """``(1/n) Σ_i ‖x_i − x̄‖²``: how far the nodes are from agreeing (reported per round
    by decentralized runs)."""
    return float((x - x.mean(dim=0, keepdim=True)).pow(2).sum(dim=1).mean())


class DecentralizedAlgorithm:
    """Base class. Subclasses set ``name`` and override :meth:`_init_buffers`,
    :meth:`local_step` and, when mixing does more than ``x ← W @ message``,
    :meth:`_finish`.

    Parameters
    ----------
    weight_decay : float
        Added to the gradient as ``g + weight_decay · x`` before the update.
    """

    name: ClassVar[str] = "base"

    def __init__(self, weight_decay: float = 0.0):
        if weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0 (got {weight_decay})")
        self.weight_decay = float(weight_decay)
        self._checked: dict[int, torch.Tensor] = {}  # id -> W already checked (kept alive)

    # -- lifecycle
    def init_state(self, x0: torch.Tensor) -> GossipState:
        """State for models ``x0 [n, d]`` (copied to float32); ``[d]`` means one node."""
        if x0.ndim == 1:
            x0 = x0[None]
        if x0.ndim != 2:
            raise ValueError(f"x0 must be [n, d], got shape {tuple(x0.shape)}")
        x = x0.detach().to(torch.float32).clone()
        return GossipState(x=x, buffers=self._init_buffers(x))

    def _init_buffers(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {}

    def local_step(self, state: GossipState, grads: torch.Tensor, lr: float) -> None:
        """The local part of one iteration, ``grads [n, d]`` taken at ``state.x``."""
        raise NotImplementedError

    def message(self, state: GossipState) -> torch.Tensor:
        """What each node sends to each of its neighbours this iteration, ``[n, d]``."""
        return state.x

    # -- the wire
    def payload(self, state: GossipState, row: int = 0) -> Payload:
        """Row ``row``'s message as it travels (every runtime sends this): by default the
        dense float32 vector ``message(state)[row]``; compressed algorithms override."""
        return Payload({"vector": self.message(state)[row].detach().to(torch.float32).contiguous()},
                       {"kind": "dense"})

    def read_payload(self, payload: Payload, d: int) -> torch.Tensor:
        """The ``[d]`` message in a payload that came off a network: checked (keys, dtype,
        length, finiteness), :class:`~fedswarm.payload.PayloadError` naming what is wrong."""
        if payload.meta.get("kind") != "dense" or set(payload.arrays) != {"vector"}:
            raise PayloadError(f"{self.name} expects a dense message with one array 'vector' "
                               f"(got kind {payload.meta.get('kind')!r}, arrays {sorted(payload.arrays)})")
        arr = payload.arrays["vector"]
        arr = arr.detach().cpu().numpy() if isinstance(arr, torch.Tensor) else np.asarray(arr)
        check_array("vector", arr)
        if arr.dtype != np.float32 or arr.size != d:
            raise PayloadError(f"message has {arr.size} values of {arr.dtype}, expected {d} float32")
        return torch.from_numpy(arr.reshape(-1).copy())

    # -- mixing
    def mix(self, state: GossipState, received: torch.Tensor, W: torch.Tensor) -> None:
        """Gossip all nodes at once: ``received`` stacks every node's message ``[n, d]``
        and node ``i`` mixes ``Σ_j W_ij received_j``."""
        if received.shape != state.x.shape:
            raise ValueError(
                f"received must be [n, d] = {tuple(state.x.shape)}, got {tuple(received.shape)}"
            )
        if W.shape != (state.n, state.n):
            raise ValueError(f"W must be [{state.n}, {state.n}], got {tuple(W.shape)}")
        if self._checked.get(id(W)) is not W:  # topologies cache W: checked once per matrix
            self.check_mixing_matrix(W)
            if len(self._checked) >= 64:
                self._checked.clear()
            self._checked[id(W)] = W
        self._finish(state, gossip(W, received))

    def node_mix(self, state: GossipState, i: int, received: Mapping[int, torch.Tensor],
                 weights: Mapping[int, float]) -> None:
        """One peer's mix. ``state`` is node ``i``'s one-node state, ``received`` maps each
        neighbour ``j`` to its message ``[d]`` and ``weights`` maps ``i`` and every
        ``j`` to ``w_ij`` (``topology.weights(i, round)``)."""
        if state.n != 1:
            raise ValueError(f"node_mix needs a one-node state, got n={state.n}")
        if set(weights) != {i, *received}:
            raise ValueError(
                f"weights must cover node {i} and exactly the neighbours received from "
                f"(weights: {sorted(weights)}, received: {sorted(received)})"
            )
        total = sum(weights.values())
        if abs(total - 1.0) > 1e-6 or min(weights.values()) < 0:
            raise ValueError(f"weights of node {i} must be >= 0 and sum to 1 (sum {total:.6g})")
        order = sorted(received)
        rows = [self.message(state)[0]] + [received[j].reshape(-1) for j in order]
        for j, r in zip(order, rows[1:]):
            if r.shape != (state.d,):
                raise ValueError(f"message from node {j} has {r.numel()} values, expected {state.d}")
        X = torch.stack(rows).to(state.x.dtype)
        w = torch.tensor([[weights[i]] + [weights[j] for j in order]], dtype=torch.float64)
        self._finish(state, gossip(w, X))

    def _finish(self, state: GossipState, mixed: torch.Tensor) -> None:
        """Complete the iteration given ``mixed = W @ message`` (``[n, d]``)."""
        state.x = mixed
        state.step += 1

    # -- stale gradients (asynchronous algorithms under a fixed schedule)
    #: how many earlier models ``local_step`` keeps (``snap.1`` = the model one iteration
    #: ago, ...), so a gradient can be taken at a stale model; 0 for synchronous algorithms
    max_staleness: int = 0

    def _snapshot_buffers(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {f"snap.{s}": x.clone() for s in range(1, self.max_staleness + 1)}

    def _remember(self, state: GossipState) -> None:
        """Push the current models ``x^t`` into the snapshots (called by ``local_step``,
        before ``x`` changes): afterwards ``snap.s`` holds ``x^{t+1-s}``."""
        for s in range(self.max_staleness, 1, -1):
            state.buffers[f"snap.{s}"] = state.buffers[f"snap.{s - 1}"]
        if self.max_staleness:
            state.buffers["snap.1"] = state.x.clone()

    def gradient_point(self, state: GossipState, row: int = 0, staleness: int = 0) -> torch.Tensor:
        """The model ``[d]`` at which row ``row`` takes its gradient this iteration: its
        current model, or (``staleness = s >= 1``) its model ``s`` iterations ago, as a
        fixed schedule replays an asynchronous run (``schedule.FixedSchedule.staleness``).
        Every runtime asks this, so they take the same gradients."""
        s = int(staleness)
        if s == 0:
            return state.x[row]
        if not 0 < s <= self.max_staleness:
            raise ValueError(f"{self.name}: staleness {s} is outside 0..max_staleness={self.max_staleness}")
        return state.buffers[f"snap.{s}"][row]

    # -- checks and accounting
    def check_mixing_matrix(self, W: torch.Tensor) -> None:
        """Raise ValueError if this algorithm cannot use ``W``."""
        check_mixing(W)

    def check_topology(self, topology: Topology) -> None:
        """Check the mixing matrix of every round of one period of ``topology``."""
        for r in range(topology.period):
            try:
                self.check_mixing_matrix(topology.mixing_matrix(r))
            except ValueError as exc:
                where = f" at round {r}" if topology.time_varying else ""
                raise ValueError(f"{self.name} cannot use topology '{topology.name}'{where}: {exc}") from None

    def wire_bytes(self, d: int, degree: int) -> int:
        """Formula for the bytes one node sends per iteration (a test oracle; runtimes
        measure serialized messages): a float32 model to each neighbour, ``4·d·deg``."""
        return 4 * d * degree

    def _grad(self, state: GossipState, grads: torch.Tensor) -> torch.Tensor:
        if grads.shape != state.x.shape:
            raise ValueError(f"grads must be [n, d] = {tuple(state.x.shape)}, got {tuple(grads.shape)}")
        g = grads.to(state.x.dtype)
        return g + self.weight_decay * state.x if self.weight_decay else g

    def hyperparams(self) -> dict[str, Any]:
        return {"weight_decay": self.weight_decay}

    def summary(self) -> str:
        params = ", ".join(f"{k}={v}" for k, v in self.hyperparams().items())
        return f"{self.name}({params})"

    def __repr__(self) -> str:
        return self.summary()
