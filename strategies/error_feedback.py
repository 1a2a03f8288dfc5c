"""Error feedback: the memory that makes biased codecs converge.

A client keeps the part of its update that its codec did not transmit and adds it to
the next update before compressing (Seide et al. 2014; Karimireddy et al. 2019)::

    p_t = x_t + e_{t-1}                   compensate
    m_t = decode(encode(p_t))             what the receiver gets
    e_t = p_t - m_t                       update

so that sum_t m_t + e_T = sum_t x_t: nothing is lost, only delayed. The memory is
separate from the codec, as in GRACE (compressor, memory, communicator), so any codec
works with it; the residual itself lives in the node's Flower ``Context.state``
(a ``RecordDict``), which persists across rounds, via :meth:`ErrorFeedback.load` and
:meth:`ErrorFeedback.save`.
"""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, RecordDict

from fedswarm.params import ParamLayout
from fedswarm.strategies.codec_base import Codec
from fedswarm.wire import Payload

__all__ = ["ErrorFeedback"]

_ARRAY = "residual"


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

    # -- persistence in Context.state ---------------------------------------------------
    @staticmethod
    def load(state: RecordDict, key: str, d: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """The residual stored under ``key`` as a ``[d]`` float32 tensor on ``device``;
        zeros if there is none, or if what is stored has the wrong size or non-finite
        values (a model change or a corrupted state must not poison the update)."""
        rec = state.array_records.get(key)
        if rec is not None and _ARRAY in rec:
            arr = rec[_ARRAY].numpy()
            if arr.dtype == np.float32 and arr.size == d and np.isfinite(arr).all():
                return torch.from_numpy(arr.reshape(d).copy()).to(device)
        return torch.zeros(d, dtype=torch.float32, device=device)

    @staticmethod
    def save(state: RecordDict, key: str, residual: torch.Tensor) -> None:
        """Store a ``[d]`` (or ``[1, d]``) residual under ``key`` as an ArrayRecord."""
        if residual.dim() == 2 and residual.shape[0] == 1:
            residual = residual[0]
        if residual.dim() != 1:
            raise ValueError(f"save one node's residual, [d] or [1, d]; got {tuple(residual.shape)}")
        arr = residual.detach().to(torch.float32).cpu().numpy()
        state[key] = ArrayRecord({_ARRAY: Array(np.ascontiguousarray(arr))})
