"""Distributed DP under secure aggregation (fedswarm.algorithms.privacy.distributed):
the samplers against their pmfs and moments, the sum of n shares against the target
variance, and the accounting against the continuous Gaussian's epsilon as an oracle."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from scipy import stats

from fedswarm.algorithms.privacy.accountant import PrivacyAccountant
from fedswarm.algorithms.privacy.distributed import (
    RDP_ORDERS,
    DistributedDP,
    ddg_rdp,
    discrete_gaussian,
    discrete_gaussian_exact,
    discrete_gaussian_pmf,
    integer_sensitivity,
    noise_seed,
    noise_share,
    skellam,
    skellam_rdp,
)


def _chi_square_p(draws: np.ndarray, pmf) -> float:
    """Chi-square goodness of fit of integer ``draws`` to ``pmf(support)``, the tails pooled
    into the two end bins so that every expected count is >= 5."""
    lo, hi = int(draws.min()), int(draws.max())
    support = np.arange(lo, hi + 1)
    probs = pmf(support)
    n = draws.size
    counts = np.bincount(draws - lo, minlength=support.size).astype(float)
    # pool bins from each end while the expected count is < 5
    keep = np.nonzero(probs * n >= 5)[0]
    a, b = keep[0], keep[-1]
    obs = np.concatenate([[counts[: a + 1].sum()], counts[a + 1: b], [counts[b:].sum()]])
    exp = np.concatenate([[probs[: a].sum() + pmf(np.arange(lo - 5000, lo)).sum() + probs[a]], probs[a + 1: b],
                          [probs[b:].sum() + pmf(np.arange(hi + 1, hi + 5001)).sum()]]) * n
    return float(stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


@pytest.mark.parametrize("sigma2", [0.6, 2.0, 9.5])
def test_vectorized_discrete_gaussian_fits_its_pmf(sigma2):
    draws = discrete_gaussian(np.random.default_rng(11), sigma2, 200_000)
    assert _chi_square_p(draws, lambda s: discrete_gaussian_pmf(sigma2, s)) > 1e-3


def test_exact_discrete_gaussian_fits_its_pmf():
    sigma2 = Fraction(5, 2)
    draws = discrete_gaussian_exact(np.random.default_rng(3), sigma2, 6000)
    assert _chi_square_p(draws, lambda s: discrete_gaussian_pmf(float(sigma2), s)) > 1e-3


@pytest.mark.parametrize("sigma2", [0.6, 4.0, 1e4])
def test_discrete_gaussian_moments(sigma2):
    n = 400_000
    draws = discrete_gaussian(np.random.default_rng(5), sigma2, n).astype(np.float64)
    # the true variance of N_Z(0, s2), from its pmf (below s2 for small s2, ~s2 above 1)
    width = int(40 * math.sqrt(sigma2)) + 2
    grid = np.arange(-width, width + 1)
    var = float((discrete_gaussian_pmf(sigma2, grid) * grid ** 2).sum())
    assert abs(draws.mean()) < 4 * math.sqrt(var / n)
    # Var of the sample variance of a near-Gaussian: 2 var^2 / n
    assert abs(draws.var() - var) < 4 * var * math.sqrt(2 / n)
    if sigma2 >= 1:
        assert var == pytest.approx(sigma2, rel=1e-6)


def test_skellam_moments():
    n, v = 400_000, 37.0
    draws = skellam(np.random.default_rng(7), v, n).astype(np.float64)
    assert abs(draws.mean()) < 4 * math.sqrt(v / n)
    assert abs(draws.var() - v) < 4 * v * math.sqrt(2 / n)
    # Skellam(v/2, v/2) pmf from scipy as the oracle
    ints = draws.astype(np.int64)
    assert _chi_square_p(ints[:100_000], lambda s: stats.skellam.pmf(s, v / 2, v / 2)) > 1e-3


@pytest.mark.parametrize("mechanism", ["dgauss", "skellam"])
def test_sum_of_node_shares_has_the_target_variance(mechanism):
    nodes, d = 16, 60_000
    dp = DistributedDP(mechanism, noise_multiplier=0.8, clip=1.0, scale=40.0, dim=d, nodes=nodes, seed=9)
    total = sum(dp.noise(round_=3, node=i) for i in range(nodes)).astype(np.float64)
    target = (0.8 * 1.0 * 40.0) ** 2
    assert dp.variance == pytest.approx(target)
    assert abs(total.var() - target) < 4 * target * math.sqrt(2 / d)
    assert abs(total.mean()) < 4 * math.sqrt(target / d)


def test_noise_is_a_function_of_seed_round_and_node():
    a = noise_share("dgauss", 100.0, 1000, noise_seed(1, 2, 3))
    assert np.array_equal(a, noise_share("dgauss", 100.0, 1000, noise_seed(1, 2, 3)))
    for other in (noise_seed(1, 2, 4), noise_seed(1, 3, 3), noise_seed(2, 2, 3)):
        assert not np.array_equal(a, noise_share("dgauss", 100.0, 1000, other))


def _gaussian_epsilon(z: float, rounds: int, delta: float) -> float:
    acc = PrivacyAccountant(delta, orders=[float(a) for a in RDP_ORDERS])  # the same orders as the module
    acc.step(1.0, z, rounds)
    return acc.epsilon()


@pytest.mark.parametrize("mechanism", ["dgauss", "skellam"])
def test_epsilon_tends_to_the_continuous_gaussians(mechanism):
    """Oracle: with a large integer scale (many integer units per float unit) both
    mechanisms' epsilon approaches, from above, the continuous Gaussian mechanism's with
    noise multiplier sigma / Delta_2 (dp-accounting's GaussianDpEvent)."""
    d, nodes, rounds = 1000, 20, 10
    dp = DistributedDP(mechanism, noise_multiplier=1.2, clip=1.0, scale=2.0 ** 20, dim=d, nodes=nodes)
    for _ in range(rounds):
        metrics = dp.account(nodes)
    z_effective = math.sqrt(dp.variance) / dp.l2
    oracle = _gaussian_epsilon(z_effective, rounds, 1e-5)
    assert metrics["epsilon"] >= oracle * (1 - 1e-6)
    assert metrics["epsilon"] == pytest.approx(oracle, rel=0.01)
    # and with z = 1.2 itself, within the rounding slack sqrt(d) / (s C)
    assert metrics["epsilon"] == pytest.approx(_gaussian_epsilon(1.2, rounds, 1e-5), rel=0.01)


def test_coarse_quantization_costs_privacy():
    """A small scale makes the rounding slack (sqrt(d) in Delta_2) and, for dgauss, the
    sum's distance from a discrete Gaussian (tau) cost epsilon."""
    def eps(mech, scale):
        dp = DistributedDP(mech, noise_multiplier=1.0, clip=1.0, scale=scale, dim=10_000, nodes=100)
        return dp.account(100)["epsilon"]

    for mech in ("dgauss", "skellam"):
        assert eps(mech, 50.0) > 1.5 * eps(mech, 2.0 ** 16)


def test_dropouts_leave_less_noise_and_more_epsilon():
    dp = DistributedDP("skellam", noise_multiplier=1.0, clip=1.0, scale=2.0 ** 14, dim=100, nodes=10)
    full, half = dp.round_rdp(10), dp.round_rdp(5)
    assert np.all(half > full)


def test_rdp_formulas_against_hand_computed_values():
    # dgauss with n = 1: tau = 0, RDP = alpha * (l2/sigma)^2 / 2
    curve = ddg_rdp([2, 10], l2=3.0, dim=5, n=1, share_variance=9.0)
    assert curve.tolist() == pytest.approx([2 * 1 / 2, 10 * 1 / 2])
    # skellam at alpha = 2, l2 = 2, l1 = 4, mu = 10: 2*4/20 + min((3*4 + 24)/400, 12/20)
    assert skellam_rdp([2], l2=2.0, l1=4.0, variance=10.0)[0] == pytest.approx(0.4 + 36 / 400)
    l2, l1 = integer_sensitivity(clip=2.0, scale=10.0, dim=16)
    assert (l2, l1) == (24.0, min(24.0 ** 2, 4 * 24.0))


def test_bad_parameters_are_refused_by_name():
    with pytest.raises(ValueError, match="mechanism 'laplace'"):
        DistributedDP("laplace", noise_multiplier=1, clip=1, scale=1, dim=1, nodes=1)
    with pytest.raises(ValueError, match="noise_multiplier"):
        DistributedDP("dgauss", noise_multiplier=0, clip=1, scale=1, dim=1, nodes=1)
    with pytest.raises(ValueError, match="integer orders"):
        skellam_rdp([1.5], l2=1, l1=1, variance=1)
    with pytest.raises(ValueError, match="no surviving node"):
        DistributedDP("dgauss", noise_multiplier=1, clip=1, scale=1, dim=1, nodes=1).round_rdp(0)


def test_clip_l2_scales_to_the_clip_and_keeps_small_updates():
    from fedswarm.algorithms.privacy.distributed import clip_l2

    v = np.array([3.0, 4.0])
    assert np.allclose(clip_l2(v, 0.5), [0.3, 0.4])
    assert np.array_equal(clip_l2(v, 10.0), v)
