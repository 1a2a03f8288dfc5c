"""The math of the Count-Sketch strategies (Sketched-SGD, gs-SGD, FetchSGD), on a client axis.

Client side, for ``C`` clients at once (a Flower client is ``C = 1``, the batched engine a
cohort): each keeps an error accumulator ``v`` and, for Sketched-SGD, a momentum ``u``
(Ivkin et al., NeurIPS 2019, Alg. 1); FetchSGD's clients keep nothing. One step
(:func:`sketch_client_step`), with δ the local model change::

    u[T] ← 0, v[T] ← 0          T: the coordinates the server used of the last sketch
    u ← ρ u + δ;  v ← v + u     (no momentum kept: v ← v + δ, gs-SGD's e)
    send S(v)                   (stateless: S(δ))

Sketches are linear and every client hashes with the round's shared seed, so the ``[C, d]``
rows are sketched in one ``encode`` and row ``i`` of the batch is client ``i``'s own table.

Server side, FetchSGD (Rothchild et al., ICML 2020, Alg. 1): momentum and error live in
sketch space (:func:`fetchsgd_step`).

Plain torch, no Flower: the strategies (:mod:`fedswarm.strategies.federated.sketched`) keep
each client's state in its ``Context.state`` and call these functions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedswarm.algorithms.compression.countsketch import CountSketch
from fedswarm.algorithms.compression.sparse import CountSketchCodec
from fedswarm.params import ParamLayout
from fedswarm.payload import Payload

__all__ = ["SketchClientState", "sketch_client_step", "fetchsgd_step"]


@dataclass(frozen=True)
class SketchClientState:
    """The memories of ``C`` clients of a sketch strategy, each ``[C, d]`` float32.

    ``error`` is v (Sketched-SGD) or e (gs-SGD); None for stateless clients (FetchSGD).
    ``momentum`` is u (Sketched-SGD only; None: no momentum kept). Immutable: a step
    returns a new state, so a round that fails after it leaves the old one in place.
    """

    error: torch.Tensor | None = None
    momentum: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.momentum is not None and self.error is None:
            raise ValueError("a sketch client's momentum needs an error accumulator beside it")
        for name in ("error", "momentum"):
            t = getattr(self, name)
            if t is not None and (not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype != torch.float32):
                raise ValueError(f"a sketch client's {name} is a float32 [C, d] tensor, got "
                                 f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        if self.momentum is not None and self.momentum.shape != self.error.shape:
            raise ValueError(f"momentum {tuple(self.momentum.shape)} and error {tuple(self.error.shape)} "
                             "must have the same shape")


def sketch_client_step(state: SketchClientState, codec: CountSketchCodec, delta: torch.Tensor, layout: ParamLayout,
                       *, seed: int, rho: float = 0.0,
                       taken: torch.Tensor | None = None) -> tuple[Payload, SketchClientState]:
    """One step of ``C`` clients: clear the memories at ``taken`` (a bool ``[C, d]`` mask of
    what the server used of each one's last sketch, or None), accumulate ``delta``
    (``[C, d]``) with momentum ``rho`` and sketch the accumulators (``delta`` itself for a
    stateless state) with the hashes of ``seed``. Pure: returns the ``[C, r, c]`` payload
    and the new state; ``state`` is not changed."""
    if delta.dim() != 2:
        raise ValueError(f"delta must be [C, d], got {tuple(delta.shape)}")
    if state.error is None:
        return codec.encode(delta, layout, seed=seed), state
    if state.error.shape != delta.shape:
        raise ValueError(f"the clients' memory is {tuple(state.error.shape)}, their update {tuple(delta.shape)}")
    if taken is not None and (taken.dtype != torch.bool or taken.shape != delta.shape):
        raise ValueError(f"taken must be a bool mask shaped like delta {tuple(delta.shape)}")
    error, momentum = state.error, state.momentum
    if taken is not None:
        error = error.masked_fill(taken, 0.0)
        momentum = None if momentum is None else momentum.masked_fill(taken, 0.0)
    step = delta if momentum is None else float(rho) * momentum + delta
    error = error + step
    new = SketchClientState(error, None if momentum is None else step)
    return codec.encode(error, layout, seed=seed), new


def fetchsgd_step(sketch: CountSketch, momentum: torch.Tensor, error: torch.Tensor, table: torch.Tensor, *,
                  rho: float, lr: float, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One FetchSGD server step, in place on the ``[r, c]`` tables ``momentum`` (S_u) and
    ``error`` (S_e)::

        S_u ← ρ S_u + S_t;   S_e ← S_e + lr·S_u;   Δ = top-k(unsketch(S_e))
        zero the cells of S_u and S_e that supp Δ hashes to

    Zeroing cells rather than subtracting S(Δ) follows the reference code (subtracting
    diverged there). Returns Δ as (indices ascending, values)."""
    momentum.mul_(rho).add_(table)
    error.add_(momentum, alpha=lr)
    idx, vals = sketch.unsketch(error, k)
    sketch.zero_cells(momentum, idx)
    sketch.zero_cells(error, idx)
    return idx, vals
