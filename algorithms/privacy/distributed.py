"""Distributed DP under secure aggregation: every node adds a share of integer noise to
its quantized update before masking, so the unmasked sum is already private and no party
(the server included) ever sees a noiseless sum.

Pipeline of one node (``v`` its update, ``C`` the L2 clip, ``s`` the quantizer's scale in
integer units per float unit, ``n`` the nodes whose noise ends in the sum)::

    v̄ = v · min(1, C / ||v||)                 # clip (uniform weights: DP-FedAvg's)
    q = stochastic_round(s · v̄)                # the secure-aggregation quantizer
    y = q + η,  η ~ N_Z(0, σ²/n)^d  or  Sk(σ²/n)^d    # this module: noise_share()
    masked(y) mod 2^b                          # the secure-aggregation masks

and the server unmasks ``Σ y = Σ q + Σ η``, divides by ``s`` and by the survivors.
``σ = z · C · s`` with ``z`` the ``--dp`` noise multiplier, so the noise on the sum has
the standard deviation central DP-FedAvg would add (``z·C`` in float units).

Mechanisms
----------
``dgauss``: discrete Gaussian N_Z(0, σ²) (pmf ∝ exp(−x²/2σ²) on the integers), sampled
with Canonne, Kamath, Steinke, "The Discrete Gaussian for Differential Privacy",
NeurIPS 2020, Algorithm 3 (discrete Laplace proposal, rejection). :func:`discrete_gaussian`
runs it vectorized with float64 acceptance probabilities (the rejection test's only
inexactness: each probability within 2^-52 relative); :func:`discrete_gaussian_exact`
is the scalar, exact version (integer and rational arithmetic only: Bernoulli(exp(−γ))
by CKS Algorithm 1), used by the tests as a second sampler. A sum of discrete Gaussians is
not a discrete Gaussian; its privacy is Kairouz, Liu, Steinke, "The Distributed Discrete
Gaussian Mechanism for Federated Learning with Secure Aggregation", ICML 2021, Theorem 1 /
Proposition 14: for n shares of variance σ_i² (in integer units), l = Δ₂ / sqrt(n σ_i²),
τ = 10 Σ_{k=1}^{n−1} exp(−2π² σ_i² k/(k+1)),

    RDP(α) <= min( α l²/2 + τ d,  α (l + τ sqrt(d))² / 2 ).

``skellam``: symmetric Skellam Sk(μ) = Poisson(μ/2) − Poisson(μ/2) (variance μ), closed
under sums (n shares of μ/n sum to exactly Sk(μ)). Agarwal, Kairouz, Liu, "The Skellam
Mechanism for Differentially Private Federated Learning", NeurIPS 2021, Thm 3.5, for
integer α > 1:

    RDP(α) <= α Δ₂²/(2μ) + min( ((2α − 1) Δ₂² + 6 Δ₁) / (4μ²),  3 Δ₁ / (2μ) ).

Sensitivity (integer domain, add/remove one node): a clipped, scaled vector has norm
<= s·C and stochastic rounding moves each coordinate by less than 1, so
Δ₂ = s·C + sqrt(d) (a worst-case bound, no conditional rounding); an integer vector's L1
norm is at most its squared L2 norm and at most sqrt(d) times its L2 norm, so
Δ₁ = min(Δ₂², sqrt(d)·Δ₂).

Accounting: dp-accounting has no event for either mechanism, so the per-round RDP curve is
computed here on integer orders, summed over rounds, and converted to (ε, δ) with
dp-accounting's ``compute_epsilon`` (the same conversion :mod:`.accountant` uses). Each
round is accounted with the nodes whose noise actually reached the sum (dropouts remove
their share). No amplification by sampling is claimed (every round counts as q = 1): a
valid upper bound whatever the sampling. As σ grows the discrete Gaussian's ε tends to the
continuous Gaussian's with noise multiplier Δ₂/σ (the tests hold it to that oracle).

Noise seeds: a node's noise is drawn from ``noise_seed(seed, round, node)``, so the batched
engine (which computes the masked sum directly) and the real protocol draw the same noise.
A deployment that must resist a server knowing the seed draws it from ``os.urandom``
(``secure=true`` in ``--dp``).

State: the per-round RDP curves (:class:`DistributedAccountant`). Wire: none of its own
(the noise rides inside the quantized, masked vector).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Literal

import numpy as np

__all__ = [
    "MECHANISMS", "Mechanism", "discrete_gaussian", "discrete_gaussian_exact", "discrete_gaussian_pmf",
    "skellam", "noise_seed", "node_rng", "noise_share", "noise_bound_for", "NOISE_BOUND_SIGMAS",
    "clip_l2", "integer_sensitivity", "ddg_rdp", "skellam_rdp", "RDP_ORDERS",
    "DistributedAccountant", "DistributedDP", "secagg_with_dp",
]

Mechanism = Literal["dgauss", "skellam"]
MECHANISMS: tuple[str, ...] = ("dgauss", "skellam")

#: Integer Rényi orders (Skellam's bound holds for integer α > 1).
RDP_ORDERS: tuple[int, ...] = tuple(range(2, 65)) + tuple(range(72, 257, 8)) + (320, 384, 512, 768, 1024)


# -- samplers --------------------------------------------------------------------------------------
def discrete_gaussian(rng: np.random.Generator, sigma2: float, size: int) -> np.ndarray:
    """``size`` draws of N_Z(0, sigma2) (int64): CKS 2020 Algorithm 3, vectorized.

    Proposal: the discrete Laplace with scale t = floor(σ) + 1, whose magnitude is
    geometric (P(|Z| = k) ∝ e^{−k/t}; a fair sign, −0 rejected); acceptance
    Bernoulli(exp(−(|Z| − σ²/t)² / 2σ²)). Expected proposals per draw < 2 for σ >= 1."""
    if sigma2 < 0:
        raise ValueError(f"the discrete Gaussian's variance must be >= 0, got {sigma2}")
    out = np.zeros(int(size), dtype=np.int64)
    if sigma2 == 0 or size == 0:
        return out
    t = math.floor(math.sqrt(sigma2)) + 1
    p = -math.expm1(-1.0 / t)  # 1 − e^{−1/t}
    todo = np.arange(out.size)
    while todo.size:
        m = todo.size
        mag = rng.geometric(p, m).astype(np.int64) - 1  # numpy's geometric starts at 1
        neg = rng.random(m) < 0.5
        z = np.where(neg, -mag, mag)
        accept = rng.random(m) < np.exp(-((mag - sigma2 / t) ** 2) / (2.0 * sigma2))
        ok = accept & ~(neg & (mag == 0))
        out[todo[ok]] = z[ok]
        todo = todo[~ok]
    return out


def _bernoulli_exp_neg(rng: np.random.Generator, gamma: Fraction) -> bool:
    """Bernoulli(exp(−γ)) for a rational γ >= 0 with integer draws only (CKS Algorithm 1)."""
    while gamma > 1:  # exp(−γ) = exp(−1)^floor(γ) · exp(−(γ − floor γ))
        if not _bernoulli_exp_neg(rng, Fraction(1)):
            return False
        gamma -= 1
    k = 1
    while True:  # K = first k with A_k = 0, A_k ~ Bernoulli(γ/k); accept iff K is odd
        if _uniform_below(rng, gamma.denominator * k) >= gamma.numerator:
            return k % 2 == 1
        k += 1


def _uniform_below(rng: np.random.Generator, m: int) -> int:
    """A uniform integer in [0, m) for an arbitrarily large m (rejection on random bits)."""
    bits = max(1, (m - 1).bit_length())
    while True:
        x = int.from_bytes(rng.bytes((bits + 7) // 8), "little") & ((1 << bits) - 1)
        if x < m:
            return x


def discrete_gaussian_exact(rng: np.random.Generator, sigma2: Fraction | int, size: int) -> np.ndarray:
    """``size`` draws of N_Z(0, sigma2) for a rational ``sigma2``: CKS 2020 Algorithms 1-3 in
    exact integer/rational arithmetic (slow: a reference sampler for small sizes)."""
    s2 = Fraction(sigma2)
    if s2 <= 0:
        raise ValueError(f"the discrete Gaussian's variance must be > 0, got {sigma2}")
    t = math.isqrt(math.floor(s2)) + 1
    out = np.empty(int(size), dtype=np.int64)
    for i in range(out.size):
        while True:
            u = _uniform_below(rng, t)  # discrete Laplace(t), CKS Algorithm 2
            if not _bernoulli_exp_neg(rng, Fraction(u, t)):
                continue
            v = 0
            while _bernoulli_exp_neg(rng, Fraction(1)):
                v += 1
            x = u + t * v
            neg = _uniform_below(rng, 2) == 1
            if neg and x == 0:
                continue
            if _bernoulli_exp_neg(rng, (Fraction(x) - s2 / t) ** 2 / (2 * s2)):  # CKS Algorithm 3
                out[i] = -x if neg else x
                break
    return out


def discrete_gaussian_pmf(sigma2: float, support: np.ndarray) -> np.ndarray:
    """N_Z(0, sigma2)'s probability of each integer in ``support`` (normalized on the
    integers, the tails beyond 40σ dropped: < 1e-300)."""
    width = int(40 * math.sqrt(sigma2)) + 2
    grid = np.arange(-width, width + 1, dtype=np.float64)
    norm = np.exp(-(grid ** 2) / (2 * sigma2)).sum()
    return np.exp(-(np.asarray(support, dtype=np.float64) ** 2) / (2 * sigma2)) / norm


_POISSON_MAX = 1e18  # numpy's Poisson sampler refuses means near 2^63


def skellam(rng: np.random.Generator, variance: float, size: int) -> np.ndarray:
    """``size`` draws of the symmetric Skellam with ``variance``: Poisson(v/2) − Poisson(v/2)."""
    if variance < 0:
        raise ValueError(f"the Skellam variance must be >= 0, got {variance}")
    if variance / 2.0 > _POISSON_MAX:
        raise ValueError(f"a Skellam share of variance {variance:.3g} is past numpy's Poisson sampler "
                         f"(mean <= {_POISSON_MAX:.0e} per half): use fewer secagg bits or mechanism=dgauss")
    return rng.poisson(variance / 2.0, int(size)).astype(np.int64) - rng.poisson(variance / 2.0, int(size))


def noise_seed(seed: int, round_: int, node: int, stream: int = 0) -> np.random.SeedSequence:
    """The seed of node ``node``'s noise in round ``round_`` of a run seeded ``seed``: what the
    protocol's node and the batched engine's simulation of it both draw from. ``stream``: the
    round's secure sum (0 the first; Sketched-SGD's exact values are 1), each an independent
    stream, so two sums of one round never carry the same noise."""
    if stream < 0:
        raise ValueError(f"noise_seed: stream must be >= 0, got {stream}")
    extra = [int(stream)] if stream else []  # stream 0 keeps the one-sum rounds' draws
    return np.random.SeedSequence([0x5ECD9, int(seed) & (2**63 - 1), int(round_), int(node) & (2**63 - 1), *extra])


def node_rng(seed: int, round_: int, node: int, stream: int = 0) -> np.random.Generator:
    """Node ``node``'s generator in round ``round_`` (and secure sum ``stream``): its stochastic
    rounding, then its noise share, drawn in that order. The protocol's node and the batched
    engine's direct sum both draw from it, which is what makes the two agree bit for bit."""
    return np.random.default_rng(noise_seed(seed, round_, node, stream))


def noise_share(mechanism: str, variance: float, size: int,
                seed: np.random.SeedSequence | int | np.random.Generator) -> np.ndarray:
    """One node's integer noise: ``size`` draws of ``mechanism`` with ``variance`` (int64),
    from ``seed`` (or a generator, which it advances)."""
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    if mechanism == "dgauss":
        return discrete_gaussian(rng, variance, size)
    if mechanism == "skellam":
        return skellam(rng, variance, size)
    raise ValueError(f"unknown distributed DP mechanism {mechanism!r} (one of {', '.join(MECHANISMS)})")


#: A node's noise share is refused past this many of its standard deviations (plus a margin of
#: the same count, for small variances): the quantizer reserves that much room per coordinate so
#: that the field cannot wrap; a discrete Gaussian passes it with probability < 1e-32 per value.
NOISE_BOUND_SIGMAS = 12


def noise_bound_for(share_variance: float) -> int:
    """The per-coordinate bound the quantizer reserves for a noise share of ``share_variance``."""
    return math.ceil(NOISE_BOUND_SIGMAS * math.sqrt(share_variance)) + NOISE_BOUND_SIGMAS


def clip_l2(update: np.ndarray, clip: float) -> np.ndarray:
    """``update`` scaled to L2 norm <= ``clip`` (DP-FedAvg's clip, on the node)."""
    norm = float(np.linalg.norm(update))
    return update * min(1.0, clip / max(norm, 1e-300))


# -- accounting --------------------------------------------------------------------------------------
def integer_sensitivity(clip: float, scale: float, dim: int) -> tuple[float, float]:
    """(Δ₂, Δ₁) of one node's quantized vector: a vector of L2 norm <= ``clip`` scaled by
    ``scale`` and stochastically rounded (each coordinate moves by < 1)."""
    l2 = float(scale) * float(clip) + math.sqrt(dim)
    return l2, min(l2 * l2, math.sqrt(dim) * l2)


def ddg_rdp(orders, *, l2: float, dim: int, n: int, share_variance: float) -> np.ndarray:
    """RDP of the sum of ``n`` discrete Gaussian shares of ``share_variance`` each (Kairouz,
    Liu, Steinke 2021, Thm 1 / Prop. 14), one round, at ``orders``."""
    a = np.asarray(orders, dtype=np.float64)
    scale = l2 / math.sqrt(n * share_variance)
    ks = np.arange(1, n, dtype=np.float64)
    tau = 10.0 * float(np.exp(-2.0 * math.pi ** 2 * share_variance * ks / (ks + 1.0)).sum())
    return np.minimum(a * scale ** 2 / 2.0 + tau * dim, a * (scale + tau * math.sqrt(dim)) ** 2 / 2.0)


def skellam_rdp(orders, *, l2: float, l1: float, variance: float) -> np.ndarray:
    """RDP of the Skellam mechanism with total ``variance`` (Agarwal, Kairouz, Liu 2021,
    Thm 3.5), one round, at integer ``orders``."""
    a = np.asarray(orders, dtype=np.float64)
    if not np.all(a == np.floor(a)) or np.any(a < 2):
        raise ValueError("the Skellam bound holds for integer orders >= 2")
    tail = np.minimum(((2 * a - 1) * l2 ** 2 + 6 * l1) / (4 * variance ** 2), 3 * l1 / (2 * variance))
    return a * l2 ** 2 / (2 * variance) + tail


@dataclass
class DistributedAccountant:
    """Sums rounds' RDP curves and reports ε at ``delta`` (dp-accounting's conversion)."""

    delta: float
    orders: tuple[int, ...] = RDP_ORDERS
    rdp: np.ndarray = field(default=None)  # type: ignore[assignment]
    rounds: int = 0

    def __post_init__(self):
        if not 0.0 < self.delta < 1.0:
            raise ValueError(f"delta must be in (0, 1), got {self.delta}")
        if self.rdp is None:
            self.rdp = np.zeros(len(self.orders))

    def step(self, curve: np.ndarray) -> None:
        self.rdp = self.rdp + np.asarray(curve, dtype=np.float64)
        self.rounds += 1

    def epsilon_of(self, rdp: np.ndarray) -> float:
        from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon

        return float(compute_epsilon(list(map(float, self.orders)), list(rdp), self.delta)[0])

    def epsilon(self) -> float:
        return 0.0 if self.rounds == 0 else self.epsilon_of(self.rdp)

    def state_dict(self) -> dict:
        return {"delta": self.delta, "rdp": self.rdp.tolist(), "rounds": self.rounds}

    def load_state_dict(self, state: dict) -> None:
        self.delta = float(state["delta"])
        self.rdp = np.asarray(state["rdp"], dtype=np.float64)
        self.rounds = int(state["rounds"])


class DistributedDP:
    """The distributed-DP half of a secure-aggregation round: the nodes' noise and the
    server's accounting.

    Parameters
    ----------
    mechanism : {"dgauss", "skellam"}
    noise_multiplier : float
        z: the noise on the sum has standard deviation z·clip (float units), as in
        central DP-FedAvg.
    clip : float
        Each node's L2 clip C before quantization.
    scale : float
        The quantizer's integer units per float unit (s).
    dim : int
        Length d of the quantized vector the noise is added to.
    nodes : int
        n, the nodes whose shares make up the noise (each adds σ²/n).
    delta : float
    seed : int
        The run's noise seed (:func:`noise_seed`).
    accountant : DistributedAccountant, optional
        The run's, shared by its rounds (default: a new one).
    """

    def __init__(self, mechanism: str, *, noise_multiplier: float, clip: float, scale: float, dim: int,
                 nodes: int, delta: float = 1e-5, seed: int = 0, accountant: DistributedAccountant | None = None):
        if mechanism not in MECHANISMS:
            raise ValueError(f"unknown distributed DP mechanism {mechanism!r} (one of {', '.join(MECHANISMS)})")
        for name, value in (("noise_multiplier", noise_multiplier), ("clip", clip), ("scale", scale)):
            if not value > 0:
                raise ValueError(f"distributed DP: {name} must be > 0, got {value}")
        if dim < 1 or nodes < 1:
            raise ValueError(f"distributed DP: dim and nodes must be >= 1, got dim={dim}, nodes={nodes}")
        self.mechanism = mechanism
        self.noise_multiplier = float(noise_multiplier)
        self.clip, self.scale, self.dim, self.nodes = float(clip), float(scale), int(dim), int(nodes)
        self.seed = int(seed)
        self.variance = (self.noise_multiplier * self.clip * self.scale) ** 2  # σ² of the whole sum
        self.share_variance = self.variance / self.nodes
        self.l2, self.l1 = integer_sensitivity(self.clip, self.scale, self.dim)
        self.accountant = accountant if accountant is not None else DistributedAccountant(delta)

    def noise(self, round_: int, node: int, size: int | None = None) -> np.ndarray:
        """Node ``node``'s noise share for round ``round_`` (int64, length ``dim``)."""
        return noise_share(self.mechanism, self.share_variance, self.dim if size is None else size,
                           noise_seed(self.seed, round_, node))

    def noise_hook(self):
        """The secure-aggregation quantizer's noise hook (``noise(d, rng) -> int64 [d]``): a
        share drawn from the node's own generator, after its rounding (:func:`node_rng`)."""
        return lambda size, rng: noise_share(self.mechanism, self.share_variance, size, rng)

    def round_rdp(self, survivors: int) -> np.ndarray:
        """One round's RDP curve when ``survivors`` nodes' shares reached the sum."""
        if survivors < 1:
            raise ValueError("distributed DP: a round with no surviving node has no noise to account")
        if self.mechanism == "dgauss":
            return ddg_rdp(self.accountant.orders, l2=self.l2, dim=self.dim, n=survivors,
                           share_variance=self.share_variance)
        return skellam_rdp(self.accountant.orders, l2=self.l2, l1=self.l1,
                           variance=self.share_variance * survivors)

    def account(self, survivors: int) -> dict[str, float]:
        """Account one round and return its metrics (``epsilon`` and ``delta`` as DP-FedAvg
        records them, and the mechanism's figures)."""
        self.accountant.step(self.round_rdp(survivors))
        return {"epsilon": self.accountant.epsilon(), "delta": self.accountant.delta,
                "dp_noise_multiplier": self.noise_multiplier, "dp_clip": self.clip,
                "dp_noise_share_std": math.sqrt(self.share_variance), "dp_noise_nodes": float(survivors)}

    def epsilon_after(self, rounds: int, survivors: int | None = None) -> float:
        """ε if ``rounds`` more rounds ran with ``survivors`` (default: all nodes)."""
        curve = self.round_rdp(self.nodes if survivors is None else survivors)
        return self.accountant.epsilon_of(self.accountant.rdp + rounds * curve)


def secagg_with_dp(params, nodes: int, dim: int, *, mechanism: str, noise_multiplier: float, dp_clip: float,
                   delta: float = 1e-5, seed: int = 0, accountant: DistributedAccountant | None = None):
    """Secure-aggregation parameters that leave room for distributed DP noise, and the
    :class:`DistributedDP` that draws and accounts it.

    ``params`` is a :class:`fedswarm.algorithms.secagg.SecAggParams` (its ``clip`` is the
    quantizer's per-coordinate clip, ``bits`` the field). Under DP every node weighs 1 (DP-FedAvg's
    uniform weights: a node's count would multiply its sensitivity), so ``weight_max = 1``;
    the quantizer's levels ``L`` and the noise room ``B`` split the per-node range
    ``R = floor((2^b − 1) / 2n)``: ``L + B <= R`` with ``B = noise_bound_for(σ²/n)`` and
    ``σ = z·dp_clip·L/clip`` (the quantizer's scale is ``L/clip``)."""
    from dataclasses import replace

    per_node = ((1 << int(params.bits)) - 1) // (2 * int(nodes))
    # L + 12 z C L / (clip sqrt(n)) + 13 <= R, then step down until the rounded bound fits
    ratio = noise_multiplier * dp_clip / (float(params.clip) * math.sqrt(nodes))
    levels = int((per_node - NOISE_BOUND_SIGMAS - 1) / (1 + NOISE_BOUND_SIGMAS * ratio))

    def share_var(lv: int) -> float:
        return (noise_multiplier * dp_clip * lv / float(params.clip)) ** 2 / nodes

    while levels >= 1 and levels + noise_bound_for(share_var(levels)) > per_node:
        levels -= 1
    if levels < 1:
        raise ValueError(f"a {params.bits}-bit field has no room for {nodes} nodes' values and DP noise "
                         f"(noise_multiplier={noise_multiplier:g}); raise secagg bits")
    out = replace(params, weight_max=1, noise_bound=per_node - levels)
    dp = DistributedDP(mechanism, noise_multiplier=noise_multiplier, clip=dp_clip, scale=levels / float(params.clip),
                       dim=dim, nodes=nodes, delta=delta, seed=seed, accountant=accountant)
    return out, dp
