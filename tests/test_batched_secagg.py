"""The batched engine's secure sum against the protocol itself (algorithms/secagg's
run_round, every node's state machine, masks, shares and recovery): the same unmasked
integer vector bit for bit on the same seed, with distributed DP noise and with dropouts at
every stage, and the same failure past the threshold."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedswarm.algorithms.privacy.distributed import node_rng, secagg_with_dp
from fedswarm.algorithms.secagg import SecAggFailed, SecAggParams, SecAggServer, run_round
from fedswarm.algorithms.secagg.quantize import LOSS_MAX, split_loss, with_loss
from fedswarm.sim.batched_secagg import DROP_STAGES, draw_dropouts, secure_sum

SEED, ROUND, GRAPH = 5, 3, 1234


def _updates(n: int, d: int) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(0)
    return {100 + i: rng.normal(0, 0.05, d) for i in range(n)}


def _both(updates, params, *, drop=None, weights=None, noise=None):
    ids = sorted(updates)
    protocol = run_round(updates, params, drop=drop, graph_seed=GRAPH, noise=noise,
                         weights=None if weights is None else dict(zip(ids, weights)),
                         rngs={i: node_rng(SEED, ROUND, i) for i in ids})
    direct = secure_sum(np.stack([updates[i] for i in ids]), ids, params, seed=SEED, round_=ROUND, graph_seed=GRAPH,
                        drop=drop, weights=weights, noise=noise)
    return protocol, direct


def test_same_sum_bit_for_bit_with_weights():
    updates = _updates(8, 500)
    weights = [3, 1, 7, 2, 2, 9, 4, 1]
    protocol, direct = _both(updates, SecAggParams(clip=0.2, bits=32, weight_max=16), weights=weights)
    assert protocol.total.dtype == direct.total.dtype == np.uint64
    assert np.array_equal(protocol.total, direct.total)
    assert direct.decoded.total_weight == sum(weights)
    assert np.array_equal(protocol.decoded.weighted_sum, direct.decoded.weighted_sum)


def test_the_loss_coordinate_gives_the_survivors_weighted_mean_loss_bit_for_bit_on_both():
    """Each node appends its train loss (with_loss); the protocol and the direct sum unmask the
    same integers, and the decoded last coordinate is the survivors' weighted mean loss (losses
    clipped to [0, LOSS_MAX], a non-finite one counted as LOSS_MAX) within the rounding bound."""
    updates = _updates(8, 300)
    ids = sorted(updates)
    weights = [3, 1, 7, 2, 2, 9, 4, 1]
    losses = [0.31, 2.5, 0.02, 1e4, 0.7, float("nan"), -1.0, 1.9]
    params = SecAggParams(clip=0.2, bits=32, weight_max=16)
    rows = {i: with_loss(updates[i], loss, params.clip) for i, loss in zip(ids, losses)}
    drop = {"masked_input": {ids[2]}}
    protocol, direct = _both(rows, params, weights=weights, drop=drop)
    assert np.array_equal(protocol.total, direct.total)
    mean, loss = split_loss(direct.decoded.mean, params.clip)
    assert mean.shape == (300,)
    kept = [k for k, i in enumerate(ids) if i != ids[2]]
    clipped = [LOSS_MAX if not math.isfinite(v) else min(max(v, 0.0), LOSS_MAX) for v in losses]
    oracle = sum(weights[k] * clipped[k] for k in kept) / sum(weights[k] for k in kept)
    scale = direct.report.masked * LOSS_MAX / (direct.decoded.total_weight * protocol_levels(params, len(ids)))
    assert abs(loss - oracle) <= scale, (loss, oracle, scale)


def protocol_levels(params: SecAggParams, n: int) -> int:
    return SecAggServer(list(range(1, n + 1)), 1, params).quantizer.levels


def test_same_sum_with_dp_noise_and_dropouts_at_every_stage():
    updates = _updates(12, 400)
    ids = sorted(updates)
    params, dp = secagg_with_dp(SecAggParams(clip=0.2, bits=40, threshold=0.6), len(ids), 400, mechanism="dgauss",
                                noise_multiplier=0.5, dp_clip=1.0, seed=SEED)
    drop = {"share_keys": {ids[1]}, "masked_input": {ids[4]}, "unmask": {ids[7]}}
    protocol, direct = _both(updates, params, drop=drop, noise=dp.noise_hook())
    assert np.array_equal(protocol.total, direct.total)
    for key in ("participants", "advertised", "shared", "masked", "dropped_after_sharing", "recovered", "threshold",
                "field_bits"):
        assert getattr(protocol.report, key) == getattr(direct.report, key), key
    assert direct.report.dropped_after_sharing == 1 and direct.report.masked == 10


def test_the_sum_carries_the_nodes_noise_shares():
    """The unmasked sum minus the survivors' noiseless quantized updates is the sum of their
    noise shares: in float units its spread is z * clip (what central DP-FedAvg would add)."""
    n, d, z = 10, 20_000, 0.5
    updates = _updates(n, d)
    ids = sorted(updates)
    params, dp = secagg_with_dp(SecAggParams(clip=0.2, bits=32), n, d, mechanism="skellam", noise_multiplier=z,
                                dp_clip=1.0, seed=SEED)
    noised = secure_sum(np.stack([updates[i] for i in ids]), ids, params, seed=SEED, round_=ROUND, graph_seed=GRAPH,
                        noise=dp.noise_hook())
    plain = secure_sum(np.stack([updates[i] for i in ids]), ids, params, seed=SEED, round_=ROUND, graph_seed=GRAPH)
    noise = noised.decoded.weighted_sum - plain.decoded.weighted_sum  # same rounding draws, then the noise
    assert noise.std() == pytest.approx(z * 1.0, rel=4 * math.sqrt(2 / d))
    assert abs(noise.mean()) < 4 * z / math.sqrt(d)


@pytest.mark.parametrize("stage", ["masked_input", "unmask"])
def test_past_the_threshold_both_fail_at_the_same_stage(stage):
    updates = _updates(6, 50)
    ids = sorted(updates)
    drop = {stage: set(ids[:4])}
    with pytest.raises(SecAggFailed) as a:
        run_round(updates, SecAggParams(), drop=drop, graph_seed=GRAPH, rngs={i: node_rng(SEED, ROUND, i) for i in ids})
    with pytest.raises(SecAggFailed) as b:
        secure_sum(np.stack([updates[i] for i in ids]), ids, SecAggParams(), seed=SEED, round_=ROUND,
                   graph_seed=GRAPH, drop=drop)
    assert a.value.stage == b.value.stage == stage


def test_n_minus_t_dropouts_after_sharing_still_sum_exactly():
    updates = _updates(10, 64)
    ids = sorted(updates)
    params = SecAggParams(threshold=0.6)
    t = 6  # threshold_for(10, 0.6) on the full graph of 10 nodes
    drop = {"masked_input": set(ids[: len(ids) - t])}
    protocol, direct = _both(updates, params, drop=drop)
    assert np.array_equal(protocol.total, direct.total)
    assert direct.report.threshold == t and direct.report.recovered == len(ids) - t


def test_dropout_draws_are_seeded_and_cover_the_stages():
    ids = list(range(2000))
    a = draw_dropouts(ids, 0.2, seed=1, round_=4)
    assert a == draw_dropouts(ids, 0.2, seed=1, round_=4)
    assert a != draw_dropouts(ids, 0.2, seed=1, round_=5)
    gone = sum(len(v) for v in a.values())
    assert abs(gone - 400) < 4 * math.sqrt(2000 * 0.2 * 0.8)
    assert all(len(a[s]) > 50 for s in DROP_STAGES)
    with pytest.raises(ValueError, match="secagg_dropout"):
        draw_dropouts(ids, 1.0, seed=1, round_=1)
