"""Error feedback: the memory that makes biased codecs converge.

A client keeps the part of its update that its codec did not transmit and adds it to
the next update before compressing (Seide et al. 2014; Karimireddy et al. 2019)::

    p_t = x_t + e_{t-1}                   compensate
    m_t = decode(encode(p_t))             what the receiver gets
    e_t = p_t - m_t                       update

so that sum_t m_t + e_T = sum_t x_t: nothing is lost, only delayed. The memory is
separate from the codec, as in GRACE (compressor, memory, communicator), so any codec
works with it. Where the residual is kept is the runtime's business: a Flower client keeps
it in its ``Context.state`` (:func:`fedswarm.strategies.strategy_utils.load_vector`).
"""

from __future__ import annotations

import torch

from fedswarm.params import ParamLayout
from fedswarm.algorithms.compression.base import Codec
from fedswarm.payload import Payload

__all__ = ["ErrorFeedback"]


class ErrorFeedback:
    """Error-feedback memory (stateless itself: the residual is passed in and out).

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
        """compensate -> encode -> decode locally -> update, for ``x`` ``[K, d]``.
        Returns the payload to send and the new residual (``[K, d]``)."""
        corrected = self.compensate(x, residual)
        payload = codec.encode(corrected, layout, seed=seed)
        decoded = codec.decode(payload, layout, device=corrected.device)
        return payload, self.update(corrected, decoded)
