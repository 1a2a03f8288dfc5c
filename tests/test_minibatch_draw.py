"""The minibatch draw of every runtime (fedswarm.algorithms.local_sgd.minibatch_plans and its
one-client row minibatch_plan): the cohort form against the one-client form and against the
plain-Python oracle (tests/minibatch_oracle.py), each permutation a permutation, a client's draw
independent of who else is in the cohort, and the draws uniform over a fixed set of seeds
(chi-square against the expected counts)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from scipy.stats import chi2

from fedswarm.algorithms.local_sgd import minibatch_plan, minibatch_plans
from tests.minibatch_oracle import batches

P_MIN = 1e-4  # the least p-value a uniformity test accepts (fixed seeds: a pass or fail is reproducible)


def _cohort(k: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    n = rng.integers(0, 70, k)
    n[:5] = [0, 1, 2, 64, 65]  # the edges: no example, one, the smallest sort, a power of two and one past it
    steps = rng.integers(0, 12, k)
    bs = rng.integers(1, 20, k)
    seeds = rng.integers(-2**63, 2**63 - 1, k, dtype=np.int64)
    return n, steps, bs, seeds


def _rows(pos, size, k, steps):
    return [pos[k, s, :int(size[k, s])].tolist() for s in range(steps)]


def test_cohort_rows_are_the_one_client_plans_bit_for_bit():
    n, steps, bs, seeds = _cohort(300)
    pos, size = minibatch_plans(n, steps, bs, seeds)
    assert pos.shape == (300, steps.max(), np.minimum(bs, n).max()) and size.shape == (300, steps.max())
    for k in range(300):
        p1, s1 = minibatch_plan(int(n[k]), int(steps[k]), int(bs[k]), int(seeds[k]))
        b = p1.shape[1]
        assert torch.equal(pos[k, :steps[k], :b], p1) and torch.equal(size[k, :steps[k]], s1), k
        assert not pos[k, steps[k]:].any() and not pos[k, :, b:].any() and not size[k, steps[k]:].any()


def test_plans_are_the_oracle_loop():
    n, steps, bs, seeds = _cohort(60, seed=1)
    pos, size = minibatch_plans(n, steps, bs, seeds)
    for k in range(60):
        assert _rows(pos, size, k, int(steps[k])) == batches(int(n[k]), int(steps[k]), int(bs[k]), int(seeds[k])), k


def test_a_seed_is_taken_mod_2_to_the_64():
    for seed in (-1, 2**63, 12345):
        pos, size = minibatch_plan(9, 7, 4, seed)
        assert torch.equal(pos, minibatch_plan(9, 7, 4, seed + 2**64)[0])
        assert _rows(pos[None], size[None], 0, 7) == batches(9, 7, 4, seed)


def test_a_clients_draw_does_not_depend_on_the_cohort():
    n, steps, bs, seeds = _cohort(200, seed=2)
    pos, size = minibatch_plans(n, steps, bs, seeds)
    rng = np.random.default_rng(3)
    pick = rng.permutation(200)[:37]  # another order, a subset
    others = _cohort(50, seed=4)  # joined by clients of other sizes, steps and batches
    mix = [np.concatenate([a[pick], o]) for a, o in zip((n, steps, bs, seeds), others, strict=True)]
    pos2, size2 = minibatch_plans(*mix)
    for j, k in enumerate(pick):
        assert _rows(pos2, size2, j, int(steps[k])) == _rows(pos, size, k, int(steps[k]))


def test_each_permutation_is_a_permutation():
    """Every full pass (per_perm batches) is a permutation of 0..n-1, batches cut in order, the
    last one short; a fresh permutation after it."""
    n, steps, bs, seeds = _cohort(400, seed=5)
    steps = steps * 4  # several permutations each
    pos, size = minibatch_plans(n, steps, bs, seeds)
    for k in range(400):
        nk, bk = int(n[k]), int(bs[k])
        flat = [i for row in _rows(pos, size, k, int(steps[k])) for i in row]
        if nk == 0:
            assert flat == []
            continue
        per_perm = -(-nk // bk)
        sizes = size[k, :steps[k]].tolist()
        assert sizes == [min(bk, nk - (s % per_perm) * bk) for s in range(int(steps[k]))]
        for lo in range(0, len(flat), nk):
            chunk = flat[lo:lo + nk]
            assert len(set(chunk)) == len(chunk) and set(chunk) <= set(range(nk))
            if len(chunk) == nk:
                assert sorted(chunk) == list(range(nk))


def test_bad_cohorts_are_named():
    with pytest.raises(ValueError, match="one n, steps, batch_size and seed per client"):
        minibatch_plans([3, 4], [1], [2, 2], [0, 1])
    with pytest.raises(ValueError, match=r"batch_size=0 \(client 1\)"):
        minibatch_plans([3, 4], [1, 1], [2, 0], [0, 1])
    with pytest.raises(ValueError, match="seeds must be integers"):
        minibatch_plans([3], [1], [2], [0.5])


# uniformity: consecutive seeds, as a round's clients get them (round_seed adds the partition id)
SEEDS = np.arange(1_000_003, 1_000_003 + 24_000, dtype=np.int64)


def _p_value(counts: np.ndarray, expected: np.ndarray, df: int) -> float:
    stat = float(((counts - expected) ** 2 / expected).sum())
    return float(chi2.sf(stat, df))


def _perms(n: int, e: int) -> np.ndarray:
    """Permutation ``e`` of ``n`` examples for every seed of SEEDS: ``[len(SEEDS), n]``."""
    pos, _ = minibatch_plans(np.full(SEEDS.size, n), np.full(SEEDS.size, e + 1), np.full(SEEDS.size, n), SEEDS)
    return pos[:, e].numpy()


@pytest.mark.parametrize("e", [0, 1])
def test_every_ordering_is_equally_likely(e):
    """n = 4: the 24 orderings over 24,000 seeds, 1,000 expected each."""
    index = {p: i for i, p in enumerate(itertools.permutations(range(4)))}
    counts = np.bincount([index[tuple(r)] for r in _perms(4, e).tolist()], minlength=24)
    assert _p_value(counts, np.full(24, SEEDS.size / 24), 23) > P_MIN, counts


@pytest.mark.parametrize("n", [7, 33])
def test_every_example_is_equally_likely_at_every_place(n):
    """Which example lands at each place of the first permutation: ``[place, example]`` counts
    against ``len(SEEDS) / n`` each (df ``(n - 1)^2``, the rows and columns sum to fixed totals)."""
    perms = _perms(n, 0)
    counts = np.zeros((n, n))
    np.add.at(counts, (np.broadcast_to(np.arange(n), perms.shape), perms), 1)
    assert _p_value(counts, np.full((n, n), SEEDS.size / n), (n - 1) ** 2) > P_MIN


def test_neighbouring_seeds_and_successive_permutations_are_independent():
    """The first example of seed s against seed s + 1's, and of permutation 0 against
    permutation 1 of the same seed: n = 5, 25 joint cells, 24,000 / 25 expected each."""
    first = _perms(5, 0)[:, 0]
    for a, b in ((first[:-1:2], first[1::2]), (first, _perms(5, 1)[:, 0])):
        counts = np.bincount(a * 5 + b, minlength=25)
        assert _p_value(counts, np.full(25, a.size / 25), 24) > P_MIN, counts


def test_the_first_batch_of_a_large_client_is_uniform():
    """n = 1,000, batch 10: how often each example is in the first batch over 4,000 seeds (10 x
    4,000 / 1,000 = 40 expected each); a draw that favoured low or high positions fails."""
    k = 4_000
    pos, _ = minibatch_plans(np.full(k, 1000), np.ones(k), np.full(k, 10), SEEDS[:k])
    counts = np.bincount(pos[:, 0].reshape(-1).numpy(), minlength=1000)
    expected = 10 * k / 1000
    # not quite multinomial (a batch has no repeats): the variance is a little smaller, so the test is conservative
    assert _p_value(counts, np.full(1000, expected), 999) > P_MIN
    assert math.isclose(counts.mean(), expected)
