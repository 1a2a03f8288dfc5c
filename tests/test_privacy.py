"""Differential privacy: the accountant against a published value, DP-FedAvg's clipping,
noise and adaptive clip against re-derivations, the budget checks, DP-SGD through opacus
against a naive per-example oracle."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedswarm.algorithms.privacy.accountant import (PrivacyAccountant, PrivacyBudgetExceeded, calibrate_noise,
                                                    classical_epsilon)
from fedswarm.algorithms.privacy.dp_fedavg import ClientLevelDP, clip_rows, parse_dp

# TensorFlow Privacy, tutorials/README.md, "Select Parameters" (MNIST, N = 60,000, batch
# 256, delta = 1e-5, RDP accountant): noise 1.12 for 60 epochs -> eps 2.92; noise 0.6 for
# 30 epochs -> eps 9.74; noise 1.2 for 10 epochs -> eps 1.20. Steps = ceil(epochs·N/B).
PUBLISHED = [(1.12, 60, 2.92), (0.6, 30, 9.74), (1.2, 10, 1.20)]


@pytest.mark.parametrize("z,epochs,eps", PUBLISHED)
def test_accountant_matches_tensorflow_privacy_published_epsilon(z, epochs, eps):
    q, steps = 256 / 60000, math.ceil(epochs * 60000 / 256)
    # the published figures used the classical RDP -> (eps, delta) conversion
    assert classical_epsilon(q, z, steps, 1e-5) == pytest.approx(eps, abs=0.025)
    # the accountant fedswarm reports uses dp-accounting's tighter conversion: never looser
    acc = PrivacyAccountant(1e-5)
    acc.step(q, z, steps)
    assert 0.7 * eps < acc.epsilon() <= eps + 0.025


def test_accountant_composes_rounds_and_round_trips():
    acc = PrivacyAccountant(1e-5)
    assert acc.epsilon() == 0.0
    eps = []
    for _ in range(5):
        acc.step(0.5, 1.0)
        eps.append(acc.epsilon())
    assert all(b > a for a, b in zip(eps, eps[1:]))  # more rounds, more privacy spent
    once = PrivacyAccountant(1e-5)
    once.step(0.5, 1.0, 5)
    assert once.epsilon() == pytest.approx(eps[-1], rel=1e-9)
    again = PrivacyAccountant(1e-3)
    again.load_state_dict(acc.state_dict())
    assert again.epsilon() == pytest.approx(eps[-1], rel=1e-9)
    assert acc.epsilon_after(0.5, 1.0, 1) > eps[-1] and acc.epsilon() == eps[-1]


def test_calibrate_noise_is_the_smallest_that_fits():
    z = calibrate_noise(2.0, 1e-5, 1.0, 20)
    for zz, ok in ((z, True), (z / 1.01, False)):
        acc = PrivacyAccountant(1e-5)
        acc.step(1.0, zz, 20)
        assert (acc.epsilon() <= 2.0) is ok


def test_clip_rows_oracle():
    x = torch.tensor([[3.0, 4.0], [0.3, 0.4], [0.0, 0.0]])
    y, within = clip_rows(x, 1.0)
    np.testing.assert_allclose(y.numpy(), [[0.6, 0.8], [0.3, 0.4], [0.0, 0.0]], rtol=1e-6)
    assert within.tolist() == [False, True, True]


def test_dp_fedavg_mean_is_clipped_mean_plus_calibrated_noise():
    spec = parse_dp("noise_multiplier=0.7,clip=2.0,delta=1e-5")
    dp = ClientLevelDP(spec, rounds=10, sample_rate=1.0, seed=3)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(6, 50)).astype(np.float32) * 3
    g = torch.Generator().manual_seed(3 * 7_777_777 + 12_345)  # the same stream, re-derived
    noise = torch.randn(50, generator=g, dtype=torch.float32).numpy() * 0.7 * 2.0
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    want = (x * np.minimum(1.0, 2.0 / norms)).sum(axis=0) / 6 + noise / 6
    got, metrics = dp.privatize(torch.from_numpy(x))
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)
    single = PrivacyAccountant(1e-5)
    single.step(1.0, 0.7, 1)
    assert metrics["epsilon"] == pytest.approx(single.epsilon()) and metrics["delta"] == 1e-5


def test_adaptive_clip_follows_andrew_et_al():
    spec = parse_dp("noise_multiplier=0.5,clip=1.0,adaptive=true,quantile=0.5,clip_lr=0.2,count_noise=2.0")
    dp = ClientLevelDP(spec, rounds=10, sample_rate=1.0, seed=5)
    x = torch.zeros(4, 3)
    x[:, 0] = torch.tensor([0.1, 0.2, 0.3, 5.0])  # 3 of 4 within the clip
    dp.privatize(x)
    g = torch.Generator().manual_seed(5 * 7_777_777 + 12_345)  # the mechanism's draws, re-derived
    torch.randn(3, generator=g)  # the update's noise
    b = (3 + float(torch.randn((), generator=g, dtype=torch.float64)) * 2.0) / 4
    assert dp.clip == pytest.approx(math.exp(-0.2 * (b - 0.5)), rel=1e-6)
    # the update's share of the noise: z_delta = (z^-2 - (2 sigma_b)^-2)^-1/2
    z_delta, sigma_b = ClientLevelDP(spec, rounds=1, sample_rate=1.0)._update_noise(10)
    assert z_delta == pytest.approx((0.5 ** -2 - 4.0 ** -2) ** -0.5) and sigma_b == 2.0
    with pytest.raises(ValueError, match="count noise"):
        ClientLevelDP(parse_dp("noise_multiplier=5,adaptive=true,count_noise=1"), rounds=1,
                      sample_rate=1.0)._update_noise(10)


def test_budget_refused_up_front_and_stopped_between_rounds():
    spec = parse_dp("noise_multiplier=3.0,target_epsilon=3.0")
    with pytest.raises(PrivacyBudgetExceeded, match="target_epsilon=3"):
        ClientLevelDP(spec, rounds=200, sample_rate=1.0)
    dp = ClientLevelDP(spec, rounds=3, sample_rate=1.0)
    n = 0
    with pytest.raises(PrivacyBudgetExceeded, match="one more round"):
        while True:
            dp.before_round()
            dp.privatize(torch.ones(3, 2))
            n += 1
    assert n >= 3 and dp.accountant.epsilon() <= 3.0
    calibrated = ClientLevelDP(parse_dp("target_epsilon=3.0"), rounds=7, sample_rate=1.0)
    assert calibrated.accountant.epsilon_after(1.0, calibrated.noise_multiplier, 7) <= 3.0


@pytest.mark.parametrize("bad", ["", "clip=1", "noise_multiplier=0", "noise_multiplier=1,delta=2", "sigma=1",
                                 "target_epsilon=-1", "noise_multiplier=1,adaptive=maybe"])
def test_bad_specs_name_the_problem(bad):
    with pytest.raises(ValueError, match="--dp"):
        parse_dp(bad)


def test_dp_sgd_step_matches_per_example_clipping_oracle():
    """One DP-SGD step through opacus equals a naive loop: per-example gradients, each
    clipped to C, summed, noise, divided by the expected batch size."""
    from fedswarm.algorithms.privacy.dp_sgd import dp_sgd_fit
    from fedswarm.config import RunConfig
    from fedswarm.params import get_flat, set_flat
    from fedswarm.train import trainer_for

    cfg = RunConfig(task="digits-mlp", clients=10)
    trainer = trainer_for(cfg, 0, 10)
    flat = get_flat(trainer.model).clone()
    spec = parse_dp("noise_multiplier=1e-6,clip=0.05")  # noise negligible, clipping binding
    new, _, q = dp_sgd_fit(trainer, flat, spec, steps=1, batch_size=16, lr=0.5, seed=11)
    g = torch.Generator().manual_seed(11)
    n = trainer.num_examples
    idx = (torch.rand(n, generator=g) < 16 / n).nonzero().flatten()
    model = trainer.task.model(0)
    total = torch.zeros_like(flat)
    for i in idx.tolist():
        set_flat(model, flat)
        model.zero_grad()
        trainer.task.objective(model, trainer.x[i:i + 1], trainer.y[i:i + 1]).backward()
        grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        total += grad * min(1.0, 0.05 / float(grad.norm()))
    want = flat - 0.5 * total / 16
    assert q == pytest.approx(16 / n)
    np.testing.assert_allclose(new.numpy(), want.numpy(), rtol=1e-4, atol=1e-5)
