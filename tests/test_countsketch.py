"""Count Sketch algebra (after csvec's tests), its block-shift hashes against their
definition, and its fast paths against plain loops."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedswarm.algorithms.compression.kernels import median_small
from fedswarm.algorithms.compression import countsketch as cs_module
from fedswarm.algorithms.compression import native
from fedswarm.algorithms.compression.countsketch import CountSketch


def test_same_seed_same_hashes_other_seed_other_hashes():
    a, b, c = CountSketch(1000, 5, 64, seed=3), CountSketch(1000, 5, 64, seed=3), CountSketch(1000, 5, 64, seed=4)
    assert torch.equal(a.buckets(), b.buckets()) and torch.equal(a.signs, b.signs)
    assert not torch.equal(a.buckets(), c.buckets())
    x = torch.randn(2, 1000)
    assert torch.equal(a.sketch(x), b.sketch(x))


def oracle_hash(cs: CountSketch, j: int, i: int) -> tuple[int, int]:
    """h_j(i), s_j(i) by the module's definition, in Python ints."""
    block, pos = divmod(i, cs.cols)
    h = (int(cs.perm[pos]) + int(cs.shifts[j, block])) % cs.cols
    return h, int(cs.block_signs[j, block]) * int(cs.bucket_signs[j, h])


@pytest.mark.parametrize("c", [1, 7, 16, 100, 4096, 100_003])
def test_pi_is_a_permutation_with_line_structure(c):
    """pi permutes [c]; whole lines of 16 positions go to whole lines of slots, every line
    shuffled by the same tau, the tail c % 16 among itself; and lines / tau_inv, what
    fs_sketch reads (y[16·lines[P] + l] = x[16·P + tau_inv[l]]), say the same as pi."""
    pi, lines, tau_inv = cs_module._line_permutation(c, torch.Generator().manual_seed(c))
    assert torch.equal(pi.sort().values, torch.arange(c))
    n = c // 16
    p = torch.arange(16 * n)
    assert torch.equal(pi[16 * (p // 16) + tau_inv[p % 16]], 16 * lines[p // 16] + p % 16)
    assert bool((pi[16 * n :] >= 16 * n).all())
    if n > 1:  # the lines are shuffled: not the identity, and the in-line order is not either
        assert not torch.equal(lines, torch.arange(n))
        assert len({tuple((pi[16 * q : 16 * q + 16] % 16).tolist()) for q in range(n)}) == 1


def test_hashes_match_the_definition_for_large_coordinates():
    d = (1 << 21) + 3  # a short last block
    cs = CountSketch(d, 3, 1000, seed=7)
    idx = torch.tensor([0, 1, 999, 1000, 12345, d // 2, d - 4, d - 2, d - 1])
    h, s = cs.hashes(idx)
    for n, i in enumerate(idx.tolist()):
        for j in range(3):
            assert (int(h[j, n]), int(s[j, n])) == oracle_hash(cs, j, i)


def test_collision_and_sign_properties():
    """What Count Sketch's analysis needs: P[h(i) = h(i')] <= 1/c (never inside a block),
    and E[s(i) s(i')] = 0 for i != i', over seeds."""
    d, c, seeds = 40, 8, 4000
    coll = np.zeros((d, d))
    sign = np.zeros((d, d))
    for seed in range(seeds):
        cs = CountSketch(d, 1, c, seed=seed)
        h, s = cs.buckets()[0].numpy(), cs.signs[0].numpy().astype(np.float64)
        coll += h[:, None] == h[None, :]
        sign += s[:, None] * s[None, :]
    coll /= seeds
    sign /= seeds
    off = ~np.eye(d, dtype=bool)
    same_block = (np.arange(d)[:, None] // c) == (np.arange(d)[None, :] // c)
    assert coll[off & same_block].max() == 0
    p = 1 / c  # different blocks: exactly 1/c; 6 sigma of a mean of `seeds` Bernoullis
    assert np.abs(coll[off & ~same_block] - p).max() < 6 * np.sqrt(p * (1 - p) / seeds)
    assert np.abs(sign[off]).max() < 6 / np.sqrt(seeds)


def test_estimate_is_unbiased_over_seeds():
    d, c, seeds = 60, 32, 3000
    x = torch.randn(d, generator=torch.Generator().manual_seed(2))
    total = torch.zeros(d, dtype=torch.float64)
    for seed in range(seeds):
        cs = CountSketch(d, 1, c, seed=seed)  # one row: the estimate is s(i)·S[h(i)]
        total += cs.estimate(cs.sketch(x)).double()
    # per-coordinate variance <= ||x||^2 / c
    bound = 6 * float(x.norm()) / np.sqrt(c * seeds)
    assert float((total / seeds - x.double()).abs().max()) < bound
    # and the bound is tight enough to see a bias of 1/4 of a coordinate's size
    assert bound < 0.25 * float(x.abs().mean())


def test_hashes_look_uniform():
    cs = CountSketch(200_000, 4, 50, seed=1)
    counts = torch.stack([torch.bincount(b, minlength=50) for b in cs.buckets()]).float()
    expected = 200_000 / 50
    assert float((counts - expected).abs().max()) < 6 * expected**0.5
    assert abs(float(cs.signs.float().mean())) < 0.01


def test_one_hot_gives_one_signed_unit_per_row():
    cs = CountSketch(100, 7, 20, seed=0)
    for i in (0, 17, 99):
        x = torch.zeros(100)
        x[i] = 1.0
        table = cs.sketch(x)
        assert table.shape == (7, 20)
        assert torch.equal(table.abs().sum(dim=1), torch.ones(7))
        assert torch.equal(table.abs().max(dim=1).values, torch.ones(7))
        assert torch.equal(table[torch.arange(7), cs.buckets()[:, i]], cs.signs[:, i].float())


def test_huge_sketch_recovers_a_small_vector_exactly():
    cs = CountSketch(5, 20, 10_000, seed=2)  # csvec's test: r = 20, c = 10 000, d = 5
    x = torch.tensor([[1.5, -2.0, 0.0, 3.25, -0.5]])
    table = cs.sketch(x)
    assert torch.equal(cs.estimate(table), x)
    idx, vals = cs.unsketch(table, 5)
    assert torch.equal(idx[0], torch.arange(5)) and torch.equal(vals, x)
    assert abs(float(cs.l2_estimate(table)[0]) - float(x.norm())) < 1e-6


def test_sketch_is_linear():
    cs = CountSketch(3000, 5, 100, seed=5)
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(-50, 50, (3, 3000), generator=gen).float()  # integers: sums are exact
    b = torch.randint(-50, 50, (3, 3000), generator=gen).float()
    assert torch.equal(cs.sketch(a) + cs.sketch(b), cs.sketch(a + b))
    assert torch.equal(cs.sketch(a).sum(0), cs.sketch(a.sum(0)))  # a server summing client tables
    x, y = torch.randn(2, 3000, generator=gen), torch.randn(2, 3000, generator=gen)
    torch.testing.assert_close(cs.sketch(2 * x - y), 2 * cs.sketch(x) - cs.sketch(y), rtol=1e-5, atol=1e-5)


def test_l2_estimate_is_accurate():
    cs = CountSketch(20_000, 9, 2000, seed=3)
    x = torch.randn(4, 20_000, generator=torch.Generator().manual_seed(1))
    est = cs.l2_estimate(cs.sketch(x))
    rel = (est / x.norm(dim=1) - 1).abs()
    assert float(rel.max()) < 0.1  # relative std of one row's estimate is ~sqrt(2/c) = 3%


def test_heavy_hitters_are_recovered():
    d, k = 100_000, 20
    gen = torch.Generator().manual_seed(4)
    x = 0.01 * torch.randn(2, d, generator=gen)
    heavy = torch.stack([torch.randperm(d, generator=gen)[:k].sort().values for _ in range(2)])
    x.scatter_(1, heavy, 5.0 + torch.rand(2, k, generator=gen))
    # a light coordinate looks heavy only if it shares a bucket with a heavy one in most
    # rows: about d·C(7,4)·(k/c)^4 = 0.002 such coordinates expected with c = 4000
    cs = CountSketch(d, 7, 4000, seed=8)
    idx, vals = cs.unsketch(cs.sketch(x), k)
    assert torch.equal(idx, heavy)
    torch.testing.assert_close(vals, x.gather(1, heavy), atol=0.1, rtol=0)


def test_estimate_of_a_batch_equals_separate_estimates():
    cs = CountSketch(5000, 4, 300, seed=6)  # even r: lower median, like torch.median
    x = torch.randn(3, 5000)
    table = cs.sketch(x)
    est = cs.estimate(table)
    for i in range(3):
        assert torch.equal(cs.estimate(table[i]), est[i])
        per_row = table[i][torch.arange(4)[:, None], cs.buckets()] * cs.signs
        assert torch.equal(est[i], per_row.median(dim=0).values)


def test_zero_cells_zeroes_exactly_the_touched_cells():
    cs = CountSketch(1000, 3, 50, seed=9)
    x = torch.randn(2, 1000)
    table = cs.sketch(x)
    touched = torch.tensor([4, 500, 999])
    expected = table.clone()
    for i in touched.tolist():
        expected[:, torch.arange(3), cs.buckets()[:, i]] = 0
    assert cs.zero_cells(table, touched) is table
    assert torch.equal(table, expected)

    table = cs.sketch(x)
    per_client = torch.tensor([[1, 2], [3, 4]])
    cs.zero_cells(table, per_client)
    assert float(table[0, torch.arange(3), cs.buckets()[:, 1]].abs().sum()) == 0
    assert float(table[1, torch.arange(3), cs.buckets()[:, 3]].abs().sum()) == 0
    with pytest.raises(ValueError, match="indices"):
        cs.zero_cells(table, torch.tensor([1000]))


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="d must be"):
        CountSketch(0, 1, 1)
    with pytest.raises(ValueError, match="rows and cols"):
        CountSketch(10, 0, 5)
    cs = CountSketch(10, 2, 5)
    with pytest.raises(ValueError, match=r"\[K, 10\]"):
        cs.sketch(torch.zeros(1, 11))
    with pytest.raises(ValueError, match=r"\[K, 2, 5\]"):
        cs.estimate(torch.zeros(1, 3, 5))


@pytest.mark.parametrize("r", range(1, 18))
def test_median_network_matches_torch_median(r):
    parts = [torch.randn(2, 500) for _ in range(r)]
    parts[0][0, :10] = parts[-1][0, :10]  # ties
    assert torch.equal(median_small(parts), torch.stack(parts).median(dim=0).values)


def test_sketch_of_numpy_oracle():
    d, rows, cols = 300, 3, 17
    cs = CountSketch(d, rows, cols, seed=11)
    x = np.random.default_rng(0).standard_normal((2, d))
    table = np.zeros((2, rows, cols))
    b, s = cs.buckets().numpy(), cs.signs.numpy()
    for k in range(2):
        for j in range(rows):
            for i in range(d):
                table[k, j, b[j, i]] += s[j, i] * x[k, i]
    got = cs.sketch(torch.from_numpy(x).float())
    np.testing.assert_allclose(got.numpy(), table, rtol=1e-5, atol=1e-5)


def np_sketch(cs: CountSketch, x: np.ndarray) -> np.ndarray:
    """The sketch by the definition, one coordinate at a time (float64)."""
    table = np.zeros((x.shape[0], cs.rows, cs.cols))
    for j in range(cs.rows):
        for i in range(cs.d):
            h, s = oracle_hash(cs, j, i)
            table[:, j, h] += s * x[:, i]
    return table


@pytest.mark.parametrize("d, rows, cols", [(300, 3, 17), (1000, 5, 37), (999, 2, 1000), (5, 3, 100), (3000, 3, 10)])
@pytest.mark.parametrize("loop", [True, False])
def test_sketch_and_estimate_match_the_definition(d, rows, cols, loop):
    """Both kernels (a loop of slices over blocks; index_add_/gathers for many short
    blocks) against a plain Python loop over coordinates."""
    cs = CountSketch(d, rows, cols, seed=11)
    cs._loop = loop
    x = np.random.default_rng(0).standard_normal((2, d))
    with native.disabled():  # the eager kernels (the C loop is checked below and in test_codecs_native)
        eager = cs.sketch(torch.from_numpy(x).float())
    table = cs.sketch(torch.from_numpy(x).float())
    np.testing.assert_allclose(eager.numpy(), np_sketch(cs, x), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(table.numpy(), np_sketch(cs, x), rtol=1e-5, atol=1e-5)
    t = table.double().numpy()
    est = np.zeros((2, d))
    for i in range(d):
        vals = [oracle_hash(cs, j, i)[1] * t[:, j, oracle_hash(cs, j, i)[0]] for j in range(rows)]
        est[:, i] = np.sort(np.stack(vals), axis=0)[(rows - 1) // 2]
    got = cs.estimate(table)
    np.testing.assert_allclose(got.numpy(), est, rtol=1e-6, atol=1e-6)
    idx = torch.tensor([0, d // 2, d - 1, d // 3])
    assert torch.equal(cs.estimate_at(table, idx), got[:, idx])


@pytest.mark.parametrize("loop", [True, False])
@pytest.mark.parametrize("d, k, rows, cols", [(200_000, 200, 5, 2000), (300_001, 50, 4, 500), (100_000, 1000, 3, 5000)])
def test_unsketch_through_candidates_equals_the_dense_top_k(d, k, rows, cols, loop):
    gen = torch.Generator().manual_seed(d)
    x = torch.randn(3, d, generator=gen)
    x[:, torch.randperm(d, generator=gen)[:20]] *= 50
    cs = CountSketch(d, rows, cols, seed=1)
    cs._loop = loop
    table = cs.sketch(x)
    assert cs._unsketch_sparse(table, k) is not None  # the candidate path is taken
    idx, vals = cs.unsketch(table, k)
    est = cs.estimate(table)
    ref = est.abs().topk(k, dim=1).values
    # estimates tie often (coordinates sharing their median cell): compare magnitudes
    assert torch.equal(vals.abs().sort(dim=1, descending=True).values, ref)
    assert torch.equal(vals, est.gather(1, idx)) and bool((idx[:, 1:] > idx[:, :-1]).all())


def test_unsketch_falls_back_to_the_dense_estimate():
    d, k = 100_000, 100
    x = torch.zeros(1, d)
    x[0, :10] = 1.0  # the sampled estimates are all 0 or tiny: fewer than k candidates
    cs = CountSketch(d, 5, 1000, seed=2)
    table = cs.sketch(x)
    assert cs._unsketch_sparse(table, k) is None
    idx, vals = cs.unsketch(table, k)
    assert set(range(10)) <= set(idx[0].tolist()) and torch.equal(vals, cs.estimate(table).gather(1, idx))


def test_many_blocks_sketch_path_is_chosen_for_narrow_tables():
    assert not CountSketch(10**6, 3, 100)._loop and CountSketch(10**6, 3, 10**4)._loop
    assert cs_module._LOOP_COLS > 100
