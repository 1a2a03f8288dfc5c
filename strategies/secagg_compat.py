"""Which strategies and codecs can run under secure aggregation, and the one-line refusal
of those that cannot, read from the registry (``StrategyEntry.secagg``) and the codecs
(``Codec.linear``).

Secure aggregation reveals only the sum of the nodes' (quantized) vectors. A strategy can
use it when its aggregate is a function of that sum: FedAvg's weighted mean, and
``compressed_fedavg`` / ``sketched_sgd`` / ``fetchsgd`` with a *linear* uplink codec, one
whose payload for a sum is the sum of the payloads because every node encodes with the
same map (the same round seed: the same random-k coordinates, the same sketch hashes) and
no per-node scale or index set. The server then decodes (unsketches) the summed payload once.
Robust rules (Krum, medians, trimmed means, ...) need each node's own update, and top-k,
gTop-k, 1-bit, sign and QSGD send per-node indices or scales: they are refused before the
run starts with one line saying why.
"""

from __future__ import annotations

from typing import Any

from fedswarm.algorithms.compression.codecs import CODECS
from fedswarm.errors import ConfigError
from fedswarm.strategies import registry

__all__ = ["NONLINEAR_WHY", "linear_codecs", "secagg_refusal", "check_secagg"]

#: Why each codec that is not linear cannot run under secure aggregation.
NONLINEAR_WHY: dict[str, str] = {
    "topk": "each node sends its own top-k index set, so the sum of the masked values has no meaning",
    "onebit": "each node sends its own per-column scales (a0, a1), so a sum of codes is not the code of the sum",
    "sign": "each node sends its own scale, so a sum of signs is not the sign code of the sum",
    "qsgd": "each node sends its own norm per bucket, so a sum of levels is not the code of the sum",
    "fp16": "it sends float16 values; secure aggregation sums integers, and its quantizer already is the "
            "shared-scale integer quantization (use codec=none)",
}


def linear_codecs() -> list[str]:
    """The codecs that can run under secure aggregation."""
    return [name for name, cls in CODECS.items() if cls.linear]


def _codec_refusal(name: str, where: str) -> str | None:
    cls = CODECS.get(name)
    if cls is None or cls.linear:
        return None
    why = NONLINEAR_WHY.get(name, "its encoding is not the same linear map on every node")
    return (f"--secagg cannot run codec '{name}' ({where}): {why}; linear codecs: {', '.join(linear_codecs())}")


def secagg_refusal(cfg: Any, params: dict[str, Any] | None = None) -> str | None:
    """Why ``cfg`` cannot run under secure aggregation (one line), or None. ``params``: the
    strategy's resolved hyperparameters (default: resolved from ``cfg.params``)."""
    entry = registry.get(cfg.strategy)
    if not entry.secagg:
        able = ", ".join(e.name for e in registry.entries(registered=True) if e.secagg)
        return (f"strategy '{cfg.strategy}' cannot run under --secagg: its aggregate is not a function of the sum "
                f"of the nodes' vectors (it needs each node's own update); strategies that can: {able}")
    params = registry.resolve_params(cfg.strategy, cfg.params) if params is None else params
    if "codec" in params and (why := _codec_refusal(str(params["codec"]), "the strategy's uplink codec")):
        return why
    for device_class, policy in sorted((getattr(cfg, "policies", None) or {}).items()):
        if "codec" in policy and (why := _codec_refusal(str(policy["codec"]), f"policy of '{device_class}'")):
            return why
    return None


def check_secagg(cfg: Any, params: dict[str, Any] | None = None) -> None:
    """Raise a one-line :class:`ConfigError` when ``cfg`` asks for secure aggregation
    (``cfg.secagg``) on a strategy or codec that cannot run under it."""
    if getattr(cfg, "secagg", False) and (why := secagg_refusal(cfg, params)) is not None:
        raise ConfigError(why)
