"""The codec contract: a stateless ``encode(x[K, d], layout) -> Payload`` and a validating
``decode(Payload, layout) -> [K, d]``, with hyperparameters a CLI can list.

A codec object holds only its hyperparameters (and memoized, data-independent tables such
as hash functions); every piece of algorithm state, error-feedback residuals included,
lives outside it (:mod:`fedswarm.algorithms.compression.error_feedback`), as in GRACE's split of
compressor and memory.

Payload conventions, shared by every codec:

* ``arrays``: torch tensors on the device of ``x`` (``fedswarm.wire.payload_to_records`` moves them to
  host numpy for the wire); each has the leading client axis ``K``.
* ``meta``: scalars only -- ``codec``, ``K``, ``d``, ``seed`` and every hyperparameter.
  Payloads are self-describing: :meth:`Codec.decode` reads the hyperparameters from
  ``meta`` (checked against their allowed ranges), so clients may use different settings.
* ``decode`` checks keys, dtypes, shapes, index ranges and finiteness against the layout
  and the meta and raises :class:`~fedswarm.payload.PayloadError` naming the problem; it
  never returns garbage.
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping

import numpy as np
import torch

from fedswarm.errors import ConfigError
from fedswarm.params import ParamLayout, all_finite
from fedswarm.hyperparams import HyperParam
from fedswarm.payload import Payload, PayloadError

__all__ = ["Codec"]

_META_FIXED = ("codec", "K", "d", "seed")
#: A torch generator takes seeds in [-2^63, 2^64 - 1], and row i of a batch uses seed + i.
_SEED_MIN, _SEED_MAX = -(1 << 63), (1 << 64) - 1


def _seed_range_error(seed: int, k: int) -> str | None:
    """Why ``seed`` cannot seed a batch of ``k`` rows, or None."""
    if _SEED_MIN <= seed and seed + k - 1 <= _SEED_MAX:
        return None
    return f"seed {seed} is out of range: the {k} rows' seeds must lie in [-2^63, 2^64 - 1]"


class Codec:
    """Base class of the communication codecs.

    Subclasses set ``name``, ``hyperparams``, ``paper`` and a docstring with the math and
    the wire size, and implement ``_encode``, ``_decode``, ``_array_specs`` and
    ``wire_bytes``.

    Attributes
    ----------
    unbiased : bool
        ``E[decode(encode(x))] == x`` over the codec's randomness.
    error_feedback : bool
        The codec is biased enough that it should be paired with an error-feedback
        memory (Karimireddy et al. 2019; Stich et al. 2018).
    linear : bool
        Every node given the same round seed encodes with the same linear map and no
        per-node scale or index set, so the sum of the nodes' payload arrays is the payload
        of the sum: the codec can run under secure aggregation, which only reveals the sum.
    """

    name: ClassVar[str] = ""
    hyperparams: ClassVar[tuple[HyperParam, ...]] = ()
    paper: ClassVar[str] = ""
    unbiased: bool = False
    error_feedback: bool = True
    linear: bool = False

    def __init__(self, **params: Any):
        self.params = self.resolve_params(params)

    # -- hyperparameters -----------------------------------------------------------------
    @classmethod
    def resolve_params(cls, overrides: Mapping[str, Any]) -> dict[str, Any]:
        """Defaults updated with ``overrides``; raises ConfigError naming a bad key/value."""
        known = {h.name: h for h in cls.hyperparams}
        out = {h.name: h.default for h in cls.hyperparams}
        for key, value in overrides.items():
            if key not in known:
                allowed = ", ".join(known) or "none"
                raise ConfigError(f"unknown parameter '{key}' for codec '{cls.name}' (allowed: {allowed})")
            out[key] = known[key].check(value, cls.name)
        return out

    @classmethod
    def describe(cls) -> str:
        """The first paragraph of the docstring: a one-line description for listings."""
        return (cls.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")

    def summary(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        return f"{self.name}({args})"

    __repr__ = summary

    # -- the contract --------------------------------------------------------------------
    def encode(self, x: torch.Tensor, layout: ParamLayout, *, seed: int = 0) -> Payload:
        """Compress ``x`` ``[K, d]`` (float32; other float dtypes are converted).

        ``seed`` drives any randomness; for codecs whose randomness is per client, row
        ``i`` of a batch uses ``seed + i`` (so a batch equals K calls with K=1)."""
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.is_floating_point():
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{self.name}.encode needs a [K, d] float tensor, got {shape}")
        if x.shape[1] != layout.d or x.shape[0] < 1:
            raise ValueError(f"{self.name}.encode: x is {tuple(x.shape)}, the layout has d={layout.d} (K >= 1)")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise ValueError(f"{self.name}.encode: seed must be an int, got {seed!r}")
        if (why := _seed_range_error(int(seed), x.shape[0])) is not None:
            raise ValueError(f"{self.name}.encode: {why}")
        x = x.detach().to(torch.float32)
        arrays = self._encode(x, layout, int(seed))
        meta = {"codec": self.name, "K": int(x.shape[0]), "d": layout.d, "seed": int(seed), **self.params}
        return Payload(arrays=arrays, meta=meta)

    def decode(self, payload: Payload, layout: ParamLayout, *, device: torch.device | str | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """The ``[K, d]`` float32 vector a payload stands for, on ``device`` (default: the
        device of ``out``, else the payload's, CPU for numpy arrays). Raises PayloadError if
        it is malformed.

        ``out``: a contiguous float32 ``[K, d]`` tensor to write the result into (and
        return), e.g. one buffer reused every round: a fresh 40 MB tensor costs thousands
        of page faults, several times the decoding itself. Its contents are overwritten;
        a malformed payload may leave it partly written. It must not share memory with
        the payload."""
        k, params, seed = self._check_meta(payload, layout)
        if out is not None:
            if not isinstance(out, torch.Tensor) or out.dtype != torch.float32 or tuple(out.shape) != (k, layout.d) \
                    or not out.is_contiguous():
                got = f"{out.dtype} {list(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
                raise ValueError(f"{self.name}.decode: out must be a contiguous float32 [{k}, {layout.d}] tensor, "
                                 f"got {got}")
            if device is not None and torch.device(device) != out.device:
                raise ValueError(f"{self.name}.decode: out is on {out.device}, device is {device}")
            device = out.device
        specs = self._array_specs(k, layout, params)
        if device is None:
            first = next(iter(payload.arrays.values()), None)
            device = first.device if isinstance(first, torch.Tensor) else torch.device("cpu")
        arrays = self._check_arrays(payload, specs, torch.device(device))
        return self._decode(arrays, k, layout, params, seed, out)

    def wire_bytes(self, layout: ParamLayout, K: int = 1) -> int:
        """Bytes of the payload's arrays for K clients (a test oracle: real sizes are
        measured on serialized messages)."""
        raise NotImplementedError

    def ratio(self, layout: ParamLayout) -> float:
        """Compression ratio versus float32, from :meth:`wire_bytes`."""
        return 4 * layout.d / max(1, self.wire_bytes(layout))

    # -- for subclasses ------------------------------------------------------------------
    def _encode(self, x: torch.Tensor, layout: ParamLayout, seed: int) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def _decode(self, arrays: dict[str, torch.Tensor], k: int, layout: ParamLayout, params: dict[str, Any],
                seed: int, out: torch.Tensor | None) -> torch.Tensor:
        """``arrays`` are checked against ``_array_specs``; ``params`` and ``seed`` come from
        the payload's meta; ``out`` is the caller's checked buffer or None (see
        :func:`~fedswarm.algorithms.compression.kernels.out_buffer`)."""
        raise NotImplementedError

    def _array_specs(self, k: int, layout: ParamLayout,
                     params: dict[str, Any]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """Expected ``{key: (dtype, shape)}`` of a valid payload; raise PayloadError if the
        hyperparameters themselves are inconsistent with the layout."""
        raise NotImplementedError

    def _fail(self, message: str) -> PayloadError:
        return PayloadError(f"{self.name} payload: {message}")

    # -- validation ----------------------------------------------------------------------
    def _check_meta(self, payload: Payload, layout: ParamLayout) -> tuple[int, dict[str, Any], int]:
        if not isinstance(payload, Payload):
            raise PayloadError(f"{self.name}: expected a Payload, got {type(payload).__name__}")
        meta = payload.meta
        codec = meta.get("codec")
        if codec != self.name:
            raise self._fail(f"meta 'codec' is {codec!r}, expected {self.name!r}")
        expected = set(_META_FIXED) | {h.name for h in self.hyperparams}
        missing, extra = expected - set(meta), set(meta) - expected
        if missing:
            raise self._fail(f"meta is missing {', '.join(sorted(missing))}")
        if extra:
            raise self._fail(f"meta has unexpected keys {', '.join(sorted(extra))}")
        for key in ("K", "d", "seed"):
            if isinstance(meta[key], bool) or not isinstance(meta[key], (int, np.integer)):
                raise self._fail(f"meta '{key}' must be an int, got {meta[key]!r}")
        k, d = int(meta["K"]), int(meta["d"])
        if d != layout.d:
            raise self._fail(f"meta 'd' is {d}, the model layout has d={layout.d}")
        if k < 1:
            raise self._fail(f"meta 'K' is {k}, must be >= 1")
        if (why := _seed_range_error(int(meta["seed"]), k)) is not None:
            raise self._fail(f"meta {why}")
        try:
            params = self.resolve_params({h.name: meta[h.name] for h in self.hyperparams})
        except ConfigError as exc:
            raise self._fail(f"meta {exc}") from None
        return k, params, int(meta["seed"])

    def _check_arrays(self, payload: Payload, specs: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                      device: torch.device) -> dict[str, torch.Tensor]:
        arrays = payload.arrays
        missing, extra = set(specs) - set(arrays), set(arrays) - set(specs)
        if missing:
            raise self._fail(f"missing array(s) {', '.join(sorted(missing))}")
        if extra:
            raise self._fail(f"unexpected array(s) {', '.join(sorted(extra))}")
        out = {}
        for key, (dtype, shape) in specs.items():
            arr = arrays[key]
            if isinstance(arr, np.ndarray):
                got = arr.dtype.name if arr.dtype.isnative else arr.dtype.str
                if arr.dtype != _numpy_dtype(dtype):
                    raise self._fail(f"array '{key}' has dtype {got}, expected {_dt(dtype)}")
                t = torch.from_numpy(arr if arr.flags.writeable else arr.copy())
            elif isinstance(arr, torch.Tensor):
                t = arr.detach()
                if t.dtype != dtype:
                    raise self._fail(f"array '{key}' has dtype {_dt(t.dtype)}, expected {_dt(dtype)}")
            else:
                raise self._fail(f"array '{key}' is a {type(arr).__name__}, not an array")
            if tuple(t.shape) != tuple(shape):
                raise self._fail(f"array '{key}' has shape {list(t.shape)}, expected {list(shape)}")
            t = t.to(device)
            if t.is_floating_point() and not all_finite(t):
                raise self._fail(f"array '{key}' has non-finite values")
            out[key] = t
        return out


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    return torch.empty(0, dtype=dtype).numpy().dtype
