"""Quantization of a node's update into the secure-aggregation field Z_{2^b}.

A node's update ``x`` (floats) is clipped to ``[-clip, clip]`` per coordinate, multiplied by
its integer weight ``w`` (its number of examples, ``1 <= w <= weight_max``) and by
``scale = levels / clip``, and rounded stochastically (unbiased: ``floor(v) + 1`` with
probability ``v - floor(v)``). So every quantized coordinate lies in ``[-w*levels, w*levels]``.
The weight itself is appended as the last coordinate: the server unmasks only the sums, so
it learns the total weight and the weighted sum, never one node's count.

**No wrap-around.** Values are signed integers stored mod ``2^b``. A sum of ``n`` nodes'
coordinates lies in ``[-n*B, n*B]`` with ``B = weight_max*levels + noise_bound`` (the noise
bound is what a distributed-DP hook may add to one coordinate), and ``2*n*B + 1`` distinct
values fit in ``Z_{2^b}`` exactly when::

    b >= ceil(log2(2*n*B + 1))                              (field_bits)

so, given ``b``, the quantizer takes the largest ``levels`` with
``2*n*(weight_max*levels + noise_bound) + 1 <= 2^b``:
``levels = floor(((2^b - 1)/(2n) - noise_bound) / weight_max)``. The total weight (at most
``n*weight_max``) fits under the same bound.

The decoded weighted mean is off from the clipped weighted mean by at most
``n / (W * scale)`` per coordinate (``W`` the total weight; one rounding unit per node), and
in expectation by nothing.

**The train loss** (:func:`with_loss`, :func:`split_loss`): where the server asks for it, a
node appends its train loss, clipped to ``[0, LOSS_MAX]`` and scaled to ``[0, clip]``
(``loss * clip / LOSS_MAX``), as one more coordinate of the vector it encodes. The quantizer
weights it as any coordinate, so the server unmasks ``sum(w_i * loss_i)`` only and learns the
survivors' weighted mean loss, never one node's; the coordinate stays in ``[-clip, clip]``, so
the formula above holds unchanged. The mean loss is off by at most ``n * LOSS_MAX / (W * levels)``
(plus the clipping: a node whose loss is past ``LOSS_MAX``, or not finite, counts as ``LOSS_MAX``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from fedswarm.algorithms.secagg.crypto import field_dtype
from fedswarm.errors import ConfigError

__all__ = ["LOSS_MAX", "DecodedSum", "NoiseHook", "Quantizer", "field_bits", "loss_coordinate", "split_loss",
           "to_signed", "with_loss"]

#: The largest field: arithmetic is done in numpy uint64, which wraps mod 2^64.
MAX_BITS = 64
#: Coordinates :meth:`Quantizer.encode` works on at a time (three float64/int64 buffers of this size).
CHUNK = 1 << 14

#: ``noise(d, rng) -> int64 array [d]``: integer noise a node adds to its quantized vector
#: before masking (distributed DP). Its values must stay within the quantizer's ``noise_bound``.
NoiseHook = Callable[[int, np.random.Generator], np.ndarray]
#: The range ``[0, LOSS_MAX]`` a node's train loss is clipped to before it joins the masked vector.
LOSS_MAX = 100.0


def loss_coordinate(loss: float, clip: float) -> float:
    """The coordinate a node's train ``loss`` becomes: clipped to ``[0, LOSS_MAX]`` (not finite:
    ``LOSS_MAX``), scaled to ``[0, clip]`` (module docstring)."""
    loss = float(loss)
    loss = min(max(loss, 0.0), LOSS_MAX) if math.isfinite(loss) else LOSS_MAX
    return loss * float(clip) / LOSS_MAX


def with_loss(update: np.ndarray, loss: float, clip: float) -> np.ndarray:
    """``update`` (flat, float64) with :func:`loss_coordinate` appended."""
    return np.append(np.asarray(update, dtype=np.float64).ravel(), loss_coordinate(loss, clip))


def split_loss(mean: np.ndarray, clip: float) -> tuple[np.ndarray, float]:
    """A decoded weighted mean of :func:`with_loss` vectors: the mean update and the weighted
    mean train loss."""
    return mean[:-1], float(mean[-1]) * LOSS_MAX / float(clip)


def field_bits(n: int, levels: int, weight_max: int = 1, noise_bound: int = 0) -> int:
    """The fewest field bits ``b`` so that ``n`` nodes' sum of coordinates in
    ``[-(weight_max*levels + noise_bound), weight_max*levels + noise_bound]`` cannot wrap:
    ``ceil(log2(2*n*(weight_max*levels + noise_bound) + 1))``."""
    for name, value in (("n", n), ("levels", levels), ("weight_max", weight_max)):
        if int(value) < 1:
            raise ConfigError(f"field_bits: {name} must be >= 1, got {value}")
    if noise_bound < 0:
        raise ConfigError(f"field_bits: noise_bound must be >= 0, got {noise_bound}")
    span = 2 * int(n) * (int(weight_max) * int(levels) + int(noise_bound)) + 1
    return max(1, (span - 1).bit_length())


def to_signed(v: np.ndarray, bits: int) -> np.ndarray:
    """The signed integers (int64) that the field elements ``v`` (uint64, in ``[0, 2^bits)``)
    stand for: ``v`` if ``v < 2^(bits-1)``, else ``v - 2^bits``."""
    v = np.asarray(v, dtype=np.uint64)
    if bits == MAX_BITS:
        return v.view(np.int64)
    half = np.uint64(1 << (bits - 1))
    out = v.astype(np.int64)
    out[v >= half] -= np.int64(1 << bits)
    return out


@dataclass(frozen=True)
class DecodedSum:
    """An unmasked sum, decoded: ``weighted_sum`` (float64 ``[d]``) is the sum of the nodes'
    weight-scaled clipped updates, ``total_weight`` the sum of their weights."""

    weighted_sum: np.ndarray
    total_weight: int

    @property
    def mean(self) -> np.ndarray:
        """The weighted mean of the nodes' clipped updates."""
        if self.total_weight <= 0:
            raise ValueError("secure aggregation: the unmasked total weight is 0; no mean to take")
        return self.weighted_sum / self.total_weight


@dataclass(frozen=True)
class Quantizer:
    """Maps float updates into ``Z_{2^bits}`` so that ``n_max`` nodes' sum cannot wrap (the
    module docstring has the formula). ``encode`` gives ``d + 1`` field elements (uint32 up to
    32 bits, else uint64),
    the last one the weight; ``decode_sum`` turns a sum of such vectors back into floats."""

    clip: float
    bits: int
    n_max: int
    weight_max: int = 1
    noise_bound: int = 0

    def __post_init__(self):
        if not (self.clip > 0 and math.isfinite(self.clip)):
            raise ConfigError(f"secagg clip must be a positive finite number, got {self.clip}")
        if not 2 <= int(self.bits) <= MAX_BITS:
            raise ConfigError(f"secagg field bits must be in [2, {MAX_BITS}], got {self.bits}")
        if int(self.n_max) < 1 or int(self.weight_max) < 1 or int(self.noise_bound) < 0:
            raise ConfigError(f"secagg quantizer: n_max and weight_max must be >= 1 and noise_bound >= 0, "
                              f"got n_max={self.n_max}, weight_max={self.weight_max}, "
                              f"noise_bound={self.noise_bound}")
        if self.levels < 1:
            need = field_bits(self.n_max, 1, self.weight_max, self.noise_bound)
            raise ConfigError(f"secagg field of {self.bits} bits is too small for {self.n_max} nodes with weights "
                              f"up to {self.weight_max} (noise bound {self.noise_bound}): it needs at least "
                              f"{need} bits")

    @property
    def levels(self) -> int:
        """Quantization levels per unit weight on ``[0, clip]``: the largest that cannot wrap."""
        per_node = ((1 << int(self.bits)) - 1) // (2 * int(self.n_max))
        return (per_node - int(self.noise_bound)) // int(self.weight_max)

    @property
    def scale(self) -> float:
        """Integers per unit of update (times the weight)."""
        return self.levels / self.clip

    @property
    def mask(self) -> np.uint64:
        return np.uint64((1 << int(self.bits)) - 1) if self.bits < MAX_BITS else np.uint64(0xFFFFFFFFFFFFFFFF)

    def encode(self, x: np.ndarray, rng: np.random.Generator, weight: int = 1,
               noise: NoiseHook | None = None, noise_rng: np.random.Generator | None = None) -> np.ndarray:
        """``d + 1`` field elements in the field's word (uint32 up to 32 bits, else uint64: the
        array masks are added to, ``crypto.field_dtype``): the quantized weight-scaled update
        (plus the integer ``noise`` a DP hook draws, if given) and, last, the weight. Rounding
        is stochastic: ``v = weight * clip(x) * scale`` becomes ``floor(v + U)``, ``U`` uniform on
        [0, 1), which is ``ceil(v)`` with probability ``v - floor(v)`` (unbiased) and stays within
        ``[-weight*levels, weight*levels]``. ``rng`` draws the ``U`` (``rng.random(d)``'s stream,
        whatever the chunking);
        the noise hook draws from ``noise_rng``, by default a generator seeded by the OS: DP
        noise must not come from a seed the server could know.

        Works in chunks of ``CHUNK`` coordinates (clip, scale, round, wrap into the word), so
        no d-long float64 temporaries are made and the update crosses memory once."""
        weight = int(weight)
        if not 1 <= weight <= self.weight_max:
            raise ValueError(f"secagg: a node's weight (its number of examples) must be in [1, {self.weight_max}] "
                             f"(secagg weight max), got {weight}")
        x = np.asarray(x).ravel()
        d = x.size
        out = np.empty(d + 1, dtype=field_dtype(self.bits))
        factor = self.scale * weight
        step = max(1, min(CHUNK, d))
        f, u, ints = np.empty(step), np.empty(step), np.empty(step, dtype=np.int64)
        for lo in range(0, d, step):
            k = min(step, d - lo)
            fk, uk, ik = f[:k], u[:k], ints[:k]
            xk = x[lo:lo + k]
            if not np.isfinite(xk).all():
                raise ValueError("secagg: the update to quantize has non-finite values")
            np.clip(xk, -self.clip, self.clip, out=fk, dtype=np.float64)
            fk *= factor
            fk += rng.random(out=uk)
            np.floor(fk, out=ik, casting="unsafe")
            np.copyto(out[lo:lo + k], ik, casting="unsafe")  # two's complement, wrapped into the word
        out[-1] = weight
        if noise is not None:  # drawn after the rounding, so a hook may share ``rng``
            extra = np.asarray(noise(d, noise_rng if noise_rng is not None else np.random.default_rng()))
            if extra.shape != (d,) or not np.issubdtype(extra.dtype, np.integer):
                raise ValueError(f"secagg noise hook must return {d} integers, got {extra.dtype} {extra.shape}")
            if self.noise_bound and np.abs(extra).max(initial=0) > self.noise_bound:
                raise ValueError(f"secagg noise exceeds the quantizer's noise bound {self.noise_bound}")
            out[:-1] += extra.astype(np.int64, copy=False).astype(out.dtype)  # two's complement, wrapped
        if self.bits < out.itemsize * 8:
            out &= out.dtype.type((1 << self.bits) - 1)
        return out

    def decode_sum(self, total: np.ndarray) -> DecodedSum:
        """The floats of an unmasked sum of ``encode`` vectors (``[d + 1]`` field elements, any unsigned word)."""
        signed = to_signed(np.asarray(total, dtype=np.uint64) & self.mask, int(self.bits))
        weight = int(signed[-1])
        if weight < 0 or weight > self.n_max * self.weight_max:
            raise ValueError(f"secagg: the unmasked total weight {weight} is out of range: the sum is corrupt")
        out = signed[:-1].astype(np.float64) / self.scale
        # A weighted mean of updates clipped to [-clip, clip] lies there too (plus one rounding unit
        # per node and the noise): anything past that is a corrupt sum, not an aggregate.
        slack = self.n_max * (1 + self.noise_bound) / self.scale
        if weight and np.abs(out).max(initial=0.0) > (self.clip * weight + slack):
            raise ValueError(f"secagg: the unmasked sum exceeds what {weight} weight of clipped updates can add up "
                             f"to: the sum is corrupt")
        return DecodedSum(out, weight)
