"""Error feedback: the memory that makes biased codecs converge.

A client keeps the part of its update that its codec did not transmit and adds it to
the next update before compressing (Seide et al. 2014; Karimireddy et al. 2019)::

    p_t = x_t + e_{t-1}                   compensate
    m_t = decode(encode(p_t))             what the receiver gets
    e_t = p_t - m_t                       update

so that sum_t m_t + e_T = sum_t x_t: nothing is lost, only delayed. The memory is
separate from the codec, as in GRACE (compressor, memory, communicator), so any codec
works with it.

The memory is an explicit state object, :class:`ErrorFeedbackState` (the residual, or
none yet), and one step is a pure function of it, :func:`error_feedback_step`
``(state, codec, x) -> (payload, new state)``, in the manner of the state object of torch's
PowerSGD communication hook. Whoever runs the step owns the state: a Flower client keeps it
in its ``Context.state`` between rounds
(:func:`fedswarm.strategies.strategy_utils.load_error_feedback` / ``save_error_feedback``),
a server keeps its own (1-bit SGD's second compression), a simulator keeps a ``[K, d]`` one.
See docs/algorithms.md, §Error feedback.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedswarm.params import ParamLayout, all_finite
from fedswarm.algorithms.compression.base import Codec
from fedswarm.payload import Payload

__all__ = ["ErrorFeedbackState", "error_feedback_step", "ErrorFeedback"]


@dataclass(frozen=True)
class ErrorFeedbackState:
    """The error-feedback memory of one node (``[d]``) or of a batch of clients (``[K, d]``).

    ``residual`` is None before the first step (nothing held back yet). Immutable: a step
    returns a new state, so a round that fails after the step leaves the old one in place.
    """

    residual: torch.Tensor | None = None

    def __post_init__(self) -> None:
        r = self.residual
        if r is not None:
            if not isinstance(r, torch.Tensor) or r.dim() not in (1, 2) or not r.is_floating_point():
                raise ValueError("an error-feedback residual is a float tensor, [d] or [K, d]")
            if not all_finite(r):
                raise ValueError("an error-feedback residual must be finite")

    @property
    def norm(self) -> float:
        return 0.0 if self.residual is None else float(self.residual.norm())


def error_feedback_step(state: ErrorFeedbackState, codec: Codec, x: torch.Tensor, layout: ParamLayout, *,
                        seed: int = 0) -> tuple[Payload, ErrorFeedbackState]:
    """compensate -> encode -> decode locally -> update, for ``x`` ``[K, d]`` (or ``[d]``,
    taken as one row). Pure: returns the payload to send and the new state; ``state`` is
    not changed. A residual of another width than ``x`` (the model changed) is dropped."""
    rows = x if x.dim() == 2 else x[None]
    residual = state.residual
    if residual is not None and residual.shape[-1] != rows.shape[-1]:
        residual = None
    corrected = ErrorFeedback.compensate(rows, residual)
    payload = codec.encode(corrected, layout, seed=seed)
    decoded = codec.decode(payload, layout, device=corrected.device)
    new = ErrorFeedback.update(corrected, decoded)
    return payload, ErrorFeedbackState(new if x.dim() == 2 else new[0])


class ErrorFeedback:
    """The two halves of a step on plain tensors (the residual passed in and out), for
    callers that batch many clients; :func:`error_feedback_step` composes them.

    The residual ``e`` is ``[d]`` for one node, or ``[K, d]`` for a batch of simulated
    clients, float32, on the device of the update.
    """

    @staticmethod
    def compensate(x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """``x + residual`` (``x`` if there is no residual yet); broadcasts ``[d]`` over ``[K, d]``."""
        return x if residual is None else x + residual

    @staticmethod
    def update(corrected: torch.Tensor, decoded: torch.Tensor) -> torch.Tensor:
        """The new residual: what was meant to be sent minus what the receiver decodes."""
        return corrected - decoded

    def step(
        self,
        codec: Codec,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        layout: ParamLayout,
        *,
        seed: int = 0,
    ) -> tuple[Payload, torch.Tensor]:
        """:func:`error_feedback_step` on a bare residual, for ``x`` ``[K, d]``.
        Returns the payload to send and the new residual (``[K, d]``)."""
        payload, state = error_feedback_step(ErrorFeedbackState(residual), codec, x, layout, seed=seed)
        return payload, state.residual
