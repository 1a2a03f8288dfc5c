"""Byzantine attacks: what K chosen clients send instead of their honest update.

An attack is a function of the Byzantine clients' own honest vectors ``own [B, d]`` and,
for the omniscient ones, the honest clients' vectors ``honest [H, d]`` of the same round
(``n`` clients in all, ``B`` of them Byzantine): it returns the ``[B, d]`` vectors they
send. Vectors are whatever the strategy's clients send, read in update space (a model
change, a decoded codec payload, a coded message). Spec strings, as on the command line:
``NAME[:key=value,...]``.

============  ============================================================  =================
name          what the Byzantine clients send                               paper
============  ============================================================  =================
signflip      −scale · own  (scale = 1: reversed update)                    (common baseline)
gaussian      N(0, std²) per coordinate, or own + noise (``add=true``)      Blanchard+17
alie          μ − z·σ  per coordinate (μ, σ of the honest vectors; z from   Baruch+19
              n and B unless given): "a little is enough"
ipm           −eps · μ  (inner-product manipulation)                        Xie+19
signvote      −sign(Σ_h sign(honest_h)) · mean|honest|: every coordinate    (against Signum)
              pushed against the honest majority vote, at honest scale
labelflip     trains on labels y → C−1−y (data poisoning; the update is     Biggio+12,
              then sent as computed)                                        Fang+20
random        random bytes in every array of the reply (same sizes)          (wire fault)
============  ============================================================  =================

``labelflip`` and ``random`` act elsewhere (in the client's training, and on the raw
message): :attr:`Attack.kind` says where. ``signvote`` is the attack designed here against
majority vote (the Solon paper reports attacks that break Signum and Bulyan; its text
was not available, see ``coding.py``); ``alie`` is the published attack that breaks
Bulyan and Krum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fedswarm.kv import parse_pairs

if TYPE_CHECKING:
    import torch

__all__ = ["Attack", "ATTACKS", "parse_attack", "alie_z"]

# name -> (kind, {param: default}, help)
ATTACKS: dict[str, tuple[str, dict[str, Any], str]] = {
    "signflip": ("update", {"scale": 1.0}, "send -scale x the honest update"),
    "gaussian": ("update", {"std": 1.0, "add": False}, "send Gaussian noise N(0, std^2) (add=true: honest + noise)"),
    "alie": ("update", {"z": None}, "'a little is enough': mean - z*std of the honest updates per coordinate"),
    "ipm": ("update", {"eps": 0.5}, "inner-product manipulation: send -eps x the honest mean"),
    "signvote": ("update", {}, "push every coordinate against the honest majority vote, at honest magnitude"),
    "labelflip": ("data", {}, "data poisoning: train on flipped labels y -> C-1-y"),
    "random": ("bytes", {}, "replace every array of the reply by random bytes of the same size"),
}


def alie_z(n: int, b: int) -> float:
    """Baruch et al. 2019, §4: with ``s = ⌊n/2 + 1⌋ − b`` honest "supporters" needed,
    ``z = Φ⁻¹((n − s)/n)`` (clamped to >= 0)."""
    s = math.floor(n / 2 + 1) - b
    p = min(max((n - s) / n, 1e-6), 1 - 1e-6)
    return max(0.0, math.sqrt(2.0) * _erfinv(2 * p - 1))


def _erfinv(y: float) -> float:
    import torch  # a spec parses without torch (the run config holds it parsed)

    return float(torch.erfinv(torch.tensor(y, dtype=torch.float64)))


@dataclass(frozen=True)
class Attack:
    """A parsed attack spec."""

    name: str
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        """``update`` (rewrites update vectors), ``data`` (poisons training) or ``bytes``
        (corrupts the serialized arrays)."""
        return ATTACKS[self.name][0]

    @property
    def spec(self) -> str:
        args = ",".join(f"{k}={v}" for k, v in self.params.items() if v is not None)
        return self.name + (f":{args}" if args else "")

    def apply(self, own: torch.Tensor, honest: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
        """The ``[B, d]`` vectors the Byzantine clients send (``kind == "update"``).
        ``honest`` may be empty (every sampled client is Byzantine): the attack then uses
        the Byzantine clients' own honest vectors in its place."""
        if self.kind != "update":
            return own
        import torch  # a spec parses without torch (the run config holds it parsed)

        own = own.to(torch.float32)
        ref = honest.to(torch.float32) if honest.numel() else own
        b = own.shape[0]
        p = self.params
        if self.name == "signflip":
            return -float(p["scale"]) * own
        if self.name == "gaussian":
            noise = torch.randn(own.shape, generator=generator, dtype=torch.float32) * float(p["std"])
            return own + noise if p["add"] else noise
        if self.name == "alie":
            z = alie_z(n, b) if p.get("z") is None else float(p["z"])
            mu, sd = ref.mean(dim=0), ref.std(dim=0, unbiased=False) if ref.shape[0] > 1 else torch.zeros_like(ref[0])
            return (mu - z * sd).expand(b, -1).clone()
        if self.name == "ipm":
            return (-float(p["eps"]) * ref.mean(dim=0)).expand(b, -1).clone()
        if self.name == "signvote":
            vote = torch.sign(torch.sign(ref).sum(dim=0))
            vote[vote == 0] = 1.0
            return (-vote * ref.abs().mean(dim=0)).expand(b, -1).clone()
        raise AssertionError(self.name)


def parse_attack(spec: str) -> Attack:
    """``"signflip:scale=10"`` -> Attack("signflip", {"scale": 10.0}); raises ValueError
    naming the attack or key that is wrong."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"an attack is NAME[:key=value,...] with NAME one of {', '.join(ATTACKS)}")
    name, _, rest = spec.strip().partition(":")
    name = name.strip().lower()
    if name not in ATTACKS:
        raise ValueError(f"unknown attack '{name}' (available: {', '.join(ATTACKS)})")
    defaults = ATTACKS[name][1]
    params = dict(defaults) | parse_pairs(rest, what=f"attack '{name}'",
                                          types={k: bool if k == "add" else float for k in defaults})
    for key in ("std", "z"):
        if params.get(key) is not None and params[key] < 0:
            raise ValueError(f"attack '{name}': {key} must be a finite number >= 0 (got {params[key]})")
    return Attack(name, params)
