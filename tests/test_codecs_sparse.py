"""Sparsifying codecs (topk, randk, countsketch) and their kernels (top-k selection, random
subsets) against plain-numpy oracles."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedswarm.params import ParamLayout
from fedswarm.algorithms.compression.kernels import random_subset, topk_abs_indices
from fedswarm.algorithms.compression.codecs import make_codec
from fedswarm.algorithms.compression.countsketch import CountSketch

from tests.codec_oracles import D, codec_for, np_countsketch_decode, np_countsketch_hashes, np_topk, randn, roundtrip


@pytest.mark.parametrize("k", [1, 5, 100, 1000, 12_000])
def test_topk_indices_sampled_path_is_exact(k):
    x = torch.from_numpy(randn(3, 100_000, seed=k))  # d >= 4·16384 takes the sampled path
    idx = topk_abs_indices(x, k)
    ref = np.sort(np.argsort(-np.abs(x.numpy()), axis=1, kind="stable")[:, :k], axis=1)
    np.testing.assert_array_equal(idx.numpy(), ref)


def test_topk_indices_fall_back_when_the_sample_misleads():
    from fedswarm.algorithms.compression.kernels import _sample_positions

    n, k = 100_000, 8000
    x = torch.full((2, n), 0.5)
    sample = _sample_positions(n, x.device)
    # the sampled coordinates are the only large ones, so the threshold sits at the
    # ~1800th largest value and fewer than k coordinates reach it
    x[0, sample] = 10.0 + torch.rand(sample.numel(), generator=torch.Generator().manual_seed(0))
    idx = topk_abs_indices(x, k)
    ref = x.abs().topk(k, dim=1).indices.sort(dim=1).values
    assert torch.equal(x.gather(1, idx).sort(dim=1).values, x.gather(1, ref).sort(dim=1).values)
    assert bool((idx[:, 1:] > idx[:, :-1]).all())


def test_topk_indices_with_ties_and_zeros():
    x = torch.zeros(2, 70_000)
    x[0, 5], x[1, 69_999] = 3.0, -2.0
    idx = topk_abs_indices(x, 10)  # the threshold is 0: every coordinate is a candidate
    assert idx.shape == (2, 10) and 5 in idx[0].tolist() and 69_999 in idx[1].tolist()
    assert bool((idx[:, 1:] > idx[:, :-1]).all())


def test_random_subset_is_uniform_and_reproducible():
    n, k, seeds = 50, 5, 4000
    counts = np.zeros(n)
    for s in range(seeds):
        idx = random_subset(n, k, s).numpy()
        assert len(set(idx.tolist())) == k and (np.diff(idx) > 0).all()
        counts[idx] += 1
    expected = seeds * k / n
    assert np.abs(counts - expected).max() < 6 * math.sqrt(expected)
    assert torch.equal(random_subset(10**6, 10**4, 3), random_subset(10**6, 10**4, 3))
    assert not torch.equal(random_subset(10**6, 10**4, 3), random_subset(10**6, 10**4, 4))
    big = random_subset(1000, 900, 1)  # the randperm path
    assert big.unique().numel() == 900


def test_topk_matches_oracle():
    x = randn(3)
    payload, got = roundtrip(codec_for("topk"), x)
    np.testing.assert_array_equal(got, np_topk(x, 0.05))
    idx = payload.arrays["indices"].numpy()
    assert idx.dtype == np.int32 and (np.diff(idx, axis=1) > 0).all()


@pytest.mark.parametrize("unbiased", [False, True])
def test_randk_keeps_the_seeded_coordinates(unbiased):
    x = randn(3)
    codec = codec_for("randk", unbiased=unbiased)
    payload, got = roundtrip(codec, x, seed=11)
    k = math.ceil(0.1 * D)
    support = np.flatnonzero(got[0])
    assert len(support) == k and all((np.flatnonzero(row) == support).all() for row in got)  # shared
    scale = D / k if unbiased else 1.0
    np.testing.assert_allclose(got[:, support], x[:, support] * np.float32(scale), rtol=1e-6)
    np.testing.assert_array_equal(payload.arrays["values"].numpy(), x[:, support])
    other = np.flatnonzero(roundtrip(codec, x, seed=12)[1][0])
    assert not np.array_equal(other, support)
    assert codec.unbiased is unbiased and codec.error_feedback is not unbiased


def test_countsketch_codec_matches_oracle():
    codec = codec_for("countsketch", rows=3)
    x = randn(2)
    _, got = roundtrip(codec, x, seed=9)
    k = math.ceil(0.1 * D)
    cs = CountSketch(D, 3, 10 * k, seed=9)
    buckets, signs = np_countsketch_hashes(D, cs)
    np.testing.assert_allclose(got, np_countsketch_decode(x, buckets, signs, 10 * k, k), rtol=1e-5, atol=1e-6)


def test_topk_batch_on_the_sampled_path():
    layout = ParamLayout.from_shapes([("w", (1000, 100))])
    x = torch.from_numpy(randn(3, 100_000, seed=4))
    codec = make_codec("topk", ratio=0.001)
    dec = codec.decode(codec.encode(x, layout), layout).numpy()
    np.testing.assert_array_equal(dec, np_topk(x.numpy(), 0.001))


def test_cpu_candidate_scan_equals_torch_nonzero():
    from fedswarm.algorithms.compression.kernels import _at_least_cpu

    x = torch.from_numpy(randn(3, 200_003, seed=5))
    thr = torch.tensor([[1.0], [2.5], [0.0]])
    rows, cols = _at_least_cpu(x, thr)
    ref = (x.abs() >= thr).nonzero(as_tuple=True)
    assert torch.equal(rows, ref[0]) and torch.equal(cols, ref[1])
