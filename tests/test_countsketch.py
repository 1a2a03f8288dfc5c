"""Count Sketch algebra (after csvec's tests) and its hashes against exact integer math."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedswarm.algorithms.compression.kernels import median_small
from fedswarm.algorithms.compression.countsketch import PRIME, CountSketch, poly_mod_prime


def test_same_seed_same_hashes_other_seed_other_hashes():
    a, b, c = CountSketch(1000, 5, 64, seed=3), CountSketch(1000, 5, 64, seed=3), CountSketch(1000, 5, 64, seed=4)
    assert torch.equal(a.index, b.index) and torch.equal(a.signs, b.signs)
    assert not torch.equal(a.index, c.index)
    x = torch.randn(2, 1000)
    assert torch.equal(a.sketch(x), b.sketch(x))


def test_hashes_match_exact_integer_arithmetic_for_large_coordinates():
    d = 1 << 21  # a cubic of i ~ 2^21 overflows int64 unless reduced mod p at each step
    cs = CountSketch(d, 3, 1000, seed=7)
    buckets, signs = cs.buckets(), cs.signs
    for i in [0, 1, 2, 12345, d // 2, d - 2, d - 1]:
        for j in range(3):
            a, b, c3, c2, c1, c0 = (int(v) for v in cs.coefficients[j])
            assert int(buckets[j, i]) == ((a * i + b) % PRIME) % 1000
            h = (c3 * i**3 + c2 * i**2 + c1 * i + c0) % PRIME
            assert int(signs[j, i]) == (-1 if h % 2 else 1)


def test_polynomial_hash_does_not_overflow_at_the_extremes():
    i = torch.tensor([0, 1, 2, 1 << 20, PRIME - 2, PRIME - 1])
    for coef in [(PRIME - 1, PRIME - 1, PRIME - 1, PRIME - 1), (123456789, 0, 987654321, 5), (7, 3)]:
        expected = [sum(c * v ** (len(coef) - 1 - n) for n, c in enumerate(coef)) % PRIME for v in i.tolist()]
        assert poly_mod_prime(i, coef).tolist() == expected


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
        CountSketch(PRIME, 1, 1)
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
