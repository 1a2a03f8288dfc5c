"""Client-level differential privacy for federated averaging (DP-FedAvg), and the
``--dp`` / ``--dp-sgd`` specs.

Update rule (McMahan, Ramage, Talwar, Zhang, "Learning Differentially Private Recurrent
Language Models", ICLR 2018), for the K clients of a round with updates ``v_i``::

    v̄_i = v_i · min(1, C / ||v_i||)                     # clip each update (norm <= C)
    u   = (Σ_i v̄_i + N(0, (z·C)² I)) / K                # noise on the sum, uniform weights

Sensitivity of the sum to one client is C, so one round is a Gaussian mechanism with
noise multiplier z; with clients sampled at rate q it is the sampled Gaussian mechanism
the accountant (:mod:`.accountant`) composes over rounds.

Adaptive clipping (Andrew, Thakkar, McMahan, Ramaswamy, "Differentially Private Learning
with Adaptive Clipping", NeurIPS 2021, Alg. 1): the clip tracks the γ-quantile of update
norms, ``C ← C · exp(−η_C (b̃ − γ))`` with ``b̃ = (Σ_i 1[||v_i|| <= C] + N(0, σ_b²)) / K``.
The count is released with noise too, so the update's noise multiplier becomes
``z_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2)`` and the pair costs exactly one Gaussian mechanism of
multiplier z (their Thm. 1); σ_b defaults to K/20 as in the paper, or z when that is
larger (with few clients K/20 would leave no noise for the update).

Composing with compression: clients clip *before* compressing (so the codec sees a
bounded vector); the server clips again what it decodes, because error feedback adds a
residual the client's clip did not bound, and the guarantee must not rest on clients.

State: the clip C, the noise generator, the accountant. Wire: unchanged (the noise is
added on the server).

Noise comes from torch's generator seeded by the run's seed, so a run is reproducible;
it is not a cryptographic random source — a deployment that must resist an attacker who
knows the seed should draw it from ``os.urandom`` (``secure=true``).
"""

from __future__ import annotations

import math
import os

import torch

from fedswarm.algorithms.privacy.accountant import PrivacyAccountant, PrivacyBudgetExceeded, calibrate_noise
from fedswarm.algorithms.privacy.dp_spec import DPSpec, parse_dp

__all__ = ["DPSpec", "parse_dp", "ClientLevelDP", "clip_rows", "clip_sum"]

def clip_rows(x: torch.Tensor, clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row scaled to norm <= ``clip``; also whether each row was within it."""
    norms = torch.linalg.vector_norm(x.to(torch.float64), dim=1)
    scale = torch.clamp(clip / torch.clamp(norms, min=1e-12), max=1.0).to(x.dtype)
    return x * scale[:, None], norms <= clip


def clip_sum(x: torch.Tensor, clip: float) -> tuple[torch.Tensor, int]:
    """DP-FedAvg's sum of ``x [K, d]`` (one update per client), each row clipped with
    :func:`clip_rows`, and how many rows were within the clip. Every runtime sums here: the
    Flower strategies all the round's clients at once, the batched engine a chunk at a time."""
    clipped, within = clip_rows(x, clip)
    return clipped.sum(dim=0), int(within.sum())


class ClientLevelDP:
    """The server half of DP-FedAvg: clip, noise, adaptive clip, accounting.

    Parameters
    ----------
    spec : DPSpec
    rounds : int
        Rounds the run plans (to calibrate ``target_epsilon`` alone, or to refuse a run
        whose planned rounds would exceed it).
    sample_rate : float
        q, the fraction of clients in a round.
    seed : int
    """

    def __init__(self, spec: DPSpec, *, rounds: int, sample_rate: float, seed: int = 0):
        self.spec = spec
        self.q = float(sample_rate)
        self.accountant = PrivacyAccountant(spec.delta)
        if spec.noise_multiplier is None:
            self.noise_multiplier = calibrate_noise(spec.target_epsilon, spec.delta, self.q, rounds)
        else:
            self.noise_multiplier = float(spec.noise_multiplier)
            if spec.target_epsilon is not None:
                planned = self.accountant.epsilon_after(self.q, self.noise_multiplier, rounds)
                if planned > spec.target_epsilon:
                    raise PrivacyBudgetExceeded(
                        f"{rounds} rounds at noise_multiplier={self.noise_multiplier:g} (q={self.q:g}) spend "
                        f"epsilon={planned:.3f} > target_epsilon={spec.target_epsilon:g} at delta={spec.delta:g}; "
                        f"use fewer rounds, more noise, or target_epsilon alone to calibrate the noise")
        self.clip = float(spec.clip)
        self.generator = torch.Generator().manual_seed(
            int.from_bytes(os.urandom(8), "little") % (2**63) if spec.secure else seed * 7_777_777 + 12_345)

    def before_round(self) -> None:
        """Refuse a round that would take ε past ``target_epsilon``."""
        t = self.spec.target_epsilon
        if t is not None:
            nxt = self.accountant.epsilon_after(self.q, self.noise_multiplier, 1)
            if nxt > t * (1 + 1e-9):
                raise PrivacyBudgetExceeded(
                    f"one more round would spend epsilon={nxt:.3f} > target_epsilon={t:g} (delta={self.spec.delta:g}): "
                    f"stopped after epsilon={self.accountant.epsilon():.3f}")

    def _update_noise(self, k: int) -> tuple[float, float]:
        """(z_Δ, σ_b) for a round of k clients."""
        z = self.noise_multiplier
        if not self.spec.adaptive:
            return z, 0.0
        # The paper's K/20 assumes hundreds of clients; with few, 2σ_b must still exceed z.
        sigma_b = self.spec.count_noise if self.spec.count_noise is not None else max(k / 20.0, z)
        if 2 * sigma_b <= z:
            raise ValueError(f"adaptive clipping needs count noise 2*sigma_b > z ({2 * sigma_b:g} <= {z:g}): "
                             f"raise count_noise")
        return (z ** -2 - (2 * sigma_b) ** -2) ** -0.5, sigma_b

    def privatize(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """``x [K, d]`` (one update per client) -> (the noised mean of clipped updates,
        the round's metrics); accounts the round."""
        return self.noised_mean(*clip_sum(x.to(torch.float32), self.clip), x.shape[0])

    def noised_mean(self, clipped_sum: torch.Tensor, within: int, k: int) -> tuple[torch.Tensor, dict[str, float]]:
        """:meth:`privatize` from the sum ``[d]`` of the k clients' updates, each clipped with
        :func:`clip_sum` at ``self.clip`` (an engine that never holds all k at once sums them
        chunk by chunk), and how many of them were within the clip."""
        z_update, sigma_b = self._update_noise(k)
        noise = torch.randn(clipped_sum.shape[0], generator=self.generator, dtype=torch.float32)
        noise *= z_update * self.clip
        mean = (clipped_sum.to(torch.float32) + noise) / k
        metrics = {"dp_clip": self.clip, "dp_noise_multiplier": self.noise_multiplier,
                   "dp_clipped_fraction": 1.0 - within / k}
        if self.spec.adaptive:
            b = (within + float(torch.randn((), generator=self.generator, dtype=torch.float64)) * sigma_b) / k
            self.clip *= math.exp(-self.spec.clip_lr * (b - self.spec.quantile))
        self.accountant.step(self.q, self.noise_multiplier, 1)
        metrics["epsilon"] = self.accountant.epsilon()
        metrics["delta"] = self.spec.delta
        return mean, metrics

    def state_dict(self) -> dict:
        return {"clip": self.clip, "noise_multiplier": self.noise_multiplier,
                "accountant": self.accountant.state_dict(), "generator": self.generator.get_state().tolist()}

    def load_state_dict(self, state: dict) -> None:
        self.clip = float(state["clip"])
        self.noise_multiplier = float(state["noise_multiplier"])
        self.accountant.load_state_dict(state["accountant"])
        self.generator.set_state(torch.tensor(state["generator"], dtype=torch.uint8))
