"""Which codecs can run under secure aggregation (``Codec.linear``), and the one-line refusal
of those that cannot.

Secure aggregation reveals only the sum of the nodes' (quantized) vectors. A codec can run
under it when it is *linear*: the payload of a sum is the sum of the payloads, because every
node encodes with the same map (the same round seed: the same random-k coordinates, the same
sketch hashes) and no per-node scale or index set; the server then decodes (unsketches) the
summed payload once. Top-k, 1-bit, sign and QSGD send per-node indices or scales and are
refused before the run starts with one line saying why; whether a *strategy* can run under
secure aggregation is its registry entry's ``secagg`` (:func:`fedswarm.server.secagg.check_secagg`).

``SecAggGrid`` masks a codec strategy's payload (``compressed_fedavg`` with a linear codec,
``fetchsgd``) as :mod:`fedswarm.strategies.secagg_payload` describes; ``sketched_sgd``'s second
exchange (the exact values at the shared candidates) is a second secure sum in the round (on
the batched engine too: :mod:`fedswarm.sim.batched_secagg_sketch`); ``gs_sgd`` keeps ``secagg=False``
(:data:`STRATEGY_WHY`: the one-line reason).
"""

from __future__ import annotations

from typing import Any

from fedswarm.algorithms.compression.codecs import CODECS
from fedswarm.errors import ConfigError

__all__ = ["NONLINEAR_WHY", "STRATEGY_WHY", "BATCHED_WHY", "batched_refusal", "strategy_refusal",
           "linear_codecs", "codec_refusal", "check_linear_codecs"]

#: Why each codec that is not linear cannot run under secure aggregation.
NONLINEAR_WHY: dict[str, str] = {
    "topk": "each node sends its own top-k index set, so the sum of the masked values has no meaning",
    "onebit": "each node sends its own per-column scales (a0, a1), so a sum of codes is not the code of the sum",
    "sign": "each node sends its own scale, so a sum of signs is not the sign code of the sum",
    "qsgd": "each node sends its own norm per bucket, so a sum of levels is not the code of the sum",
    "fp16": "it sends float16 values; secure aggregation sums integers, and its quantizer already is the "
            "shared-scale integer quantization (use codec=none)",
}


#: Why a strategy whose entry says no ``secagg`` cannot run under secure aggregation, where the
#: general reason (its server needs each node's own update) does not say it.
STRATEGY_WHY: dict[str, str] = {
    "gs_sgd": "its exact values (a second exchange) are not wired to a second secure sum as sketched_sgd's are, "
              "and without them each node is told the indices the server used of its own sketch (sketched_sgd and "
              "fetchsgd run under it)",
}


#: Why a strategy that runs under secure aggregation in-process does not on the batched engine.
BATCHED_WHY: dict[str, str] = {}


def batched_refusal(name: str) -> str | None:
    """Why strategy ``name`` does not run under ``--secagg`` on the batched engine, or None."""
    return BATCHED_WHY.get(name)


def strategy_refusal(name: str) -> str | None:
    """The specific reason strategy ``name`` cannot run under secure aggregation, or None."""
    return STRATEGY_WHY.get(name)


def linear_codecs() -> list[str]:
    """The codecs that can run under secure aggregation."""
    return [name for name, cls in CODECS.items() if cls.linear]


def _codec_refusal(name: str, where: str) -> str | None:
    cls = CODECS.get(name)
    if cls is None or cls.linear:
        return None
    why = NONLINEAR_WHY.get(name, "its encoding is not the same linear map on every node")
    return (f"--secagg cannot run codec '{name}' ({where}): {why}; linear codecs: {', '.join(linear_codecs())}")


def codec_refusal(cfg: Any, params: dict[str, Any]) -> str | None:
    """Why the codecs of ``cfg`` (the strategy's uplink codec in its resolved hyperparameters
    ``params``, and any device-class policy's) cannot run under secure aggregation (one
    line), or None. Whether the strategy itself can is its entry's ``secagg``
    (:func:`fedswarm.server.secagg.check_secagg`)."""
    if "codec" in params and (why := _codec_refusal(str(params["codec"]), "the strategy's uplink codec")):
        return why
    for device_class, policy in sorted((getattr(cfg, "policies", None) or {}).items()):
        if "codec" in policy and (why := _codec_refusal(str(policy["codec"]), f"policy of '{device_class}'")):
            return why
    return None


def check_linear_codecs(cfg: Any, params: dict[str, Any]) -> None:
    """Raise a one-line :class:`ConfigError` when ``cfg`` asks for secure aggregation
    (``cfg.secagg``) with a codec that is not linear."""
    if getattr(cfg, "secagg", False) and (why := codec_refusal(cfg, params)) is not None:
        raise ConfigError(why)
