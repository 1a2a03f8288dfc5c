"""The ``--dp`` / ``--dp-sgd`` specs, parsed: torch-free, so the run config holds them parsed
(:class:`fedswarm.config.RunConfig`) without loading torch. The mechanisms that use them are
:mod:`.dp_fedavg` (client level) and :mod:`.dp_sgd` (example level)."""

from __future__ import annotations

from dataclasses import dataclass

from fedswarm.kv import parse_pairs

__all__ = ["DPSpec", "parse_dp"]

_KEYS = {
    "noise_multiplier": float, "clip": float, "delta": float, "target_epsilon": float,
    "adaptive": bool, "quantile": float, "clip_lr": float, "count_noise": float, "secure": bool,
    "mechanism": str,
}


@dataclass(frozen=True)
class DPSpec:
    """A parsed ``--dp`` or ``--dp-sgd`` spec."""

    noise_multiplier: float | None = None
    clip: float = 1.0
    delta: float = 1e-5
    target_epsilon: float | None = None
    adaptive: bool = False
    quantile: float = 0.5
    clip_lr: float = 0.2
    count_noise: float | None = None  # σ_b; None: max(K/20, z)
    secure: bool = False
    #: Under secure aggregation (``--secagg``): the nodes' integer noise, ``dgauss`` (default) or
    #: ``skellam`` (:mod:`fedswarm.algorithms.privacy.distributed`); None elsewhere.
    mechanism: str | None = None

    def text(self) -> str:
        parts = [f"{k}={getattr(self, k)}" for k in _KEYS if getattr(self, k) is not None]
        return ",".join(parts)


def parse_dp(spec: str, what: str = "dp") -> DPSpec:
    """``noise_multiplier=N[,clip=C,delta=D,...]`` or ``target_epsilon=E[,delta=D]``;
    raises ValueError naming the bad key or value."""
    values = parse_pairs(str(spec), what=f"--{what.replace('_', '-')}", types=_KEYS)
    out = DPSpec(**values)
    if out.noise_multiplier is None and out.target_epsilon is None:
        raise ValueError(f"--{what} needs noise_multiplier=N or target_epsilon=E")
    if out.noise_multiplier is not None and not out.noise_multiplier > 0:
        raise ValueError(f"--{what}: noise_multiplier must be > 0 (got {out.noise_multiplier})")
    if not out.clip > 0:
        raise ValueError(f"--{what}: clip must be > 0 (got {out.clip})")
    if not 0 < out.delta < 1:
        raise ValueError(f"--{what}: delta must be in (0, 1) (got {out.delta})")
    if out.target_epsilon is not None and not out.target_epsilon > 0:
        raise ValueError(f"--{what}: target_epsilon must be > 0 (got {out.target_epsilon})")
    if not 0 < out.quantile < 1:
        raise ValueError(f"--{what}: quantile must be in (0, 1) (got {out.quantile})")
    if out.mechanism is not None and out.mechanism not in ("dgauss", "skellam"):
        raise ValueError(f"--{what}: mechanism must be dgauss or skellam (distributed DP under --secagg), "
                         f"got {out.mechanism!r}")
    if not out.clip_lr > 0:
        raise ValueError(f"--{what}: clip_lr must be > 0 (got {out.clip_lr})")
    return out
