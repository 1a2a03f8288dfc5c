"""The privacy accountant: epsilon for a run's delta, after every round, from Google's
``dp-accounting`` (Rényi DP of the sampled Gaussian mechanism).

Each round of DP-FedAvg (or each local step of DP-SGD) is one sampled Gaussian mechanism:
every record (a client, or an example) is in the round with probability ``q`` and the sum
gets Gaussian noise of ``noise_multiplier`` times the clipping norm. Rounds compose;
:meth:`PrivacyAccountant.epsilon` converts the composed RDP curve to (ε, δ)-DP with
dp-accounting's conversion (Canonne, Kamath, Steinke 2020 / Asoodeh et al. 2021, tighter
than the classical one). :func:`classical_epsilon` is the classical conversion
(Mironov 2017, Prop. 3: ``ε = min_α RDP(α) + log(1/δ)/(α − 1)``) that older tools
reported: the accountant test checks it against a published value.

Assumptions (said plainly, as a user should read them): sampling is accounted as Poisson
with rate ``q`` (fedswarm samples a fixed number of clients, ``q = sampled / total``; with
``q = 1`` there is no amplification and the assumption is exact); the adjacency is
add-or-remove-one record (one client for DP-FedAvg, one example for DP-SGD).

State: the (q, noise multiplier, steps) history. Wire: none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

__all__ = ["PrivacyAccountant", "classical_epsilon", "calibrate_noise", "rdp_orders", "PrivacyBudgetExceeded"]


class PrivacyBudgetExceeded(RuntimeError):
    """The next round would spend more privacy than the run's ``target_epsilon``."""


def rdp_orders() -> list[float]:
    """The Rényi orders dp-accounting's RDP accountant uses by default."""
    from dp_accounting.rdp import rdp_privacy_accountant as rdp

    return list(rdp.DEFAULT_RDP_ORDERS) if hasattr(rdp, "DEFAULT_RDP_ORDERS") else (
        [1 + x / 10.0 for x in range(1, 100)] + list(range(11, 64)) + [128, 256, 512, 1024])


def _quiet_absl() -> None:
    """dp-accounting logs (through absl) every Rényi order whose series does not converge
    and is left out of the minimum; that is expected for small orders at large q, and a
    warning per order per round drowns the run's output."""
    import logging

    logging.getLogger("absl").setLevel(logging.ERROR)


def _event(q: float, noise_multiplier: float, steps: int):
    import dp_accounting

    gauss = dp_accounting.GaussianDpEvent(noise_multiplier)
    one = gauss if q >= 1.0 else dp_accounting.PoissonSampledDpEvent(q, gauss)
    return dp_accounting.SelfComposedDpEvent(one, int(steps))


@dataclass
class PrivacyAccountant:
    """Composes sampled Gaussian mechanisms and reports ε for ``delta``."""

    delta: float
    orders: list[float] | None = None
    history: list[tuple[float, float, int]] = field(default_factory=list)  # (q, noise_multiplier, steps)

    def __post_init__(self):
        if not 0.0 < self.delta < 1.0:
            raise ValueError(f"delta must be in (0, 1), got {self.delta}")

    def step(self, q: float, noise_multiplier: float, steps: int = 1) -> None:
        """Account for ``steps`` mechanisms with sampling rate ``q`` and noise multiplier."""
        if not 0.0 < q <= 1.0:
            raise ValueError(f"sampling rate q must be in (0, 1], got {q}")
        if not noise_multiplier > 0:
            raise ValueError(f"the noise multiplier must be > 0 for a finite epsilon, got {noise_multiplier}")
        if steps < 0:
            raise ValueError(f"steps must be >= 0, got {steps}")
        if self.history and self.history[-1][:2] == (q, noise_multiplier):
            self.history[-1] = (q, noise_multiplier, self.history[-1][2] + int(steps))
        else:
            self.history.append((float(q), float(noise_multiplier), int(steps)))

    def _accountant(self, extra: tuple[float, float, int] | None = None):
        from dp_accounting import rdp

        _quiet_absl()
        acc = rdp.RdpAccountant(self.orders) if self.orders else rdp.RdpAccountant()
        for q, z, n in self.history + ([extra] if extra else []):
            if n:
                acc.compose(_event(q, z, n))
        return acc

    def epsilon(self) -> float:
        """ε of everything accounted so far, at ``delta`` (0 before the first step)."""
        if not any(n for _, _, n in self.history):
            return 0.0
        return float(self._accountant().get_epsilon(self.delta))

    def epsilon_after(self, q: float, noise_multiplier: float, steps: int = 1) -> float:
        """ε if ``steps`` more mechanisms were run (nothing is recorded)."""
        return float(self._accountant((q, noise_multiplier, steps)).get_epsilon(self.delta))

    def state_dict(self) -> dict:
        return {"delta": self.delta, "history": [list(h) for h in self.history]}

    def load_state_dict(self, state: dict) -> None:
        self.delta = float(state["delta"])
        self.history = [(float(q), float(z), int(n)) for q, z, n in state.get("history", [])]


def classical_epsilon(q: float, noise_multiplier: float, steps: int, delta: float,
                      orders: list[float] | None = None) -> float:
    """ε by the classical RDP conversion ``min_α T·RDP_α + log(1/δ)/(α − 1)`` (Mironov
    2017, Prop. 3), on dp-accounting's RDP of the sampled Gaussian: what TensorFlow
    Privacy's ``compute_dp_sgd_privacy`` reported before the tighter conversion."""
    from dp_accounting.rdp import rdp_privacy_accountant as rdp

    orders = orders or ([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)))
    curve = np.asarray(rdp._compute_rdp_poisson_subsampled_gaussian(q, noise_multiplier, orders)) * steps
    return float(np.min(curve + math.log(1.0 / delta) / (np.asarray(orders) - 1.0)))


def calibrate_noise(target_epsilon: float, delta: float, q: float, steps: int,
                    low: float = 0.3, high: float = 1000.0) -> float:
    """The smallest noise multiplier (to 0.1%) whose ε after ``steps`` sampled Gaussian
    mechanisms at rate ``q`` is at most ``target_epsilon``. Raises ValueError if even
    ``high`` is not enough."""
    if not target_epsilon > 0:
        raise ValueError(f"target_epsilon must be > 0, got {target_epsilon}")

    def eps(z: float) -> float:
        acc = PrivacyAccountant(delta)
        acc.step(q, z, steps)
        return acc.epsilon()

    if eps(high) > target_epsilon:
        raise ValueError(f"no noise multiplier up to {high:g} reaches epsilon <= {target_epsilon:g} "
                         f"in {steps} rounds at q={q:g}, delta={delta:g}")
    if eps(low) <= target_epsilon:
        return low
    while high / low > 1.001:
        mid = math.sqrt(low * high)
        if eps(mid) <= target_epsilon:
            high = mid
        else:
            low = mid
    return high
