"""Communication codecs: one import point for every compressor.

Every codec is stateless and vectorized over a leading client axis::

    codec = make_codec("topk", ratio=0.01)
    payload = codec.encode(x, layout, seed=round_seed)   # x: [K, d] float32
    payload_to_records(payload, message.content)         # into a Flower Message (fedswarm.wire)
    ...
    x_hat = decode_payload(payload_from_records(content), layout)   # [K, d]

===========  ===================================  =====================================  ========
name         what travels                         bytes per client                       unbiased
===========  ===================================  =====================================  ========
none         float32 values                       4·d                                    yes
fp16         float16 values                       2·d                                    no (≈)
onebit       1 bit/value + 2 float32/column       ceil(d/8) + 8·#columns                 no
sign         1 bit/value + one float32 scale      ceil(d/8) + 4                          no
topk         k float32 values + k int32 indices   8·k                                    no
randk        k float32 values (indices: seed)     4·k                                    option
qsgd         int8/int16 codes + norm per bucket   d·(1 or 2) + 4·ceil(d/bucket)          yes
countsketch  r x c float32 table                  4·r·c                                  no
===========  ===================================  =====================================  ========

Biased codecs (``codec.error_feedback``) should be paired with the error-feedback memory
of :mod:`fedswarm.algorithms.compression.error_feedback`. Sizes are measured on serialized Flower
messages (:func:`fedswarm.wire.message_nbytes`); ``codec.wire_bytes`` is the formula
the tests hold those measurements to.
"""

from __future__ import annotations

from typing import Any

import torch

from fedswarm.errors import ConfigError
from fedswarm.params import ParamLayout
from fedswarm.algorithms.compression.base import Codec
from fedswarm.hyperparams import HyperParam
from fedswarm.algorithms.compression.quant import Fp16Codec, NoneCodec, OneBitCodec, QSGDCodec, SignCodec
from fedswarm.algorithms.compression.sparse import CountSketchCodec, RandKCodec, TopKCodec
from fedswarm.payload import Payload, PayloadError

__all__ = [
    "Codec",
    "HyperParam",
    "CODECS",
    "make_codec",
    "decode_payload",
    "describe_codecs",
    "NoneCodec",
    "Fp16Codec",
    "OneBitCodec",
    "SignCodec",
    "TopKCodec",
    "RandKCodec",
    "QSGDCodec",
    "CountSketchCodec",
]

CODECS: dict[str, type[Codec]] = {
    c.name: c
    for c in (NoneCodec, Fp16Codec, OneBitCodec, SignCodec, TopKCodec, RandKCodec, QSGDCodec, CountSketchCodec)
}


def make_codec(name: str, **params: Any) -> Codec:
    """The codec ``name`` with hyperparameters ``params`` (defaults for the rest).

    Raises ConfigError naming an unknown codec, an unknown parameter, or a value outside
    its allowed range."""
    try:
        cls = CODECS[name]
    except KeyError:
        raise ConfigError(f"unknown codec '{name}' (available: {', '.join(CODECS)})") from None
    return cls(**params)


def decode_payload(payload: Payload, layout: ParamLayout, *, device: torch.device | str | None = None,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode a payload with the codec and hyperparameters its meta names (a server that
    accepts several codecs needs nothing else), into ``out`` if given (see
    :meth:`Codec.decode`). Raises PayloadError."""
    name = payload.meta.get("codec") if isinstance(payload, Payload) else None
    if not isinstance(name, str) or name not in CODECS:  # a list from a client's ConfigRecord is no name
        raise PayloadError(f"payload names codec {name!r}; known codecs: {', '.join(CODECS)}")
    return CODECS[name]().decode(payload, layout, device=device, out=out)


def describe_codecs() -> list[dict[str, Any]]:
    """One row per codec for a CLI or a form: name, description, paper, whether it is
    unbiased and wants error feedback (with default hyperparameters), and each
    hyperparameter's name, default, help and allowed range."""
    rows = []
    for name, cls in CODECS.items():
        codec = cls()
        rows.append(
            {
                "name": name,
                "description": cls.describe(),
                "paper": cls.paper,
                "unbiased": codec.unbiased,
                "error_feedback": codec.error_feedback,
                "hyperparams": [
                    {"name": h.name, "default": h.default, "help": h.help, "allowed": h.allowed()}
                    for h in cls.hyperparams
                ],
            }
        )
    return rows
