"""Robust aggregation rules against naive numpy re-derivations, and their tolerance bounds."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedswarm.algorithms.robust.aggregators import (Bulyan, CoordinateMedian, Krum, Mean, MultiKrum, ToleranceError,
                                                    TrimmedMean)
from fedswarm.algorithms.robust.signum import MajorityVote


def _x(n=11, d=7, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype(np.float32)
    x[-2:] *= 50.0  # two outliers
    return x


# -- oracles: loops over coordinates and clients, plain numpy --------------------------------

def np_median(x):
    out = []
    for c in range(x.shape[1]):
        col = sorted(float(v) for v in x[:, c])
        n = len(col)
        out.append(col[n // 2] if n % 2 else 0.5 * (col[n // 2 - 1] + col[n // 2]))
    return np.array(out)


def np_trimmed(x, f):
    return np.array([np.mean(sorted(x[:, c].tolist())[f:x.shape[0] - f]) for c in range(x.shape[1])])


def np_krum_scores(x, f):
    n = x.shape[0]
    scores = []
    for i in range(n):
        d = sorted(float(np.sum((x[i].astype(np.float64) - x[j]) ** 2)) for j in range(n) if j != i)
        scores.append(sum(d[:max(1, n - f - 2)]))
    return scores


def np_krum_order(x, f):
    s = np_krum_scores(x, f)
    return sorted(range(len(s)), key=lambda i: (s[i], i))


def np_bulyan(x, f):
    left = list(range(x.shape[0]))
    chosen = []
    theta = x.shape[0] - 2 * f
    while len(chosen) < theta:
        if len(left) == 1:
            chosen.append(left.pop())
            break
        sub = x[left]
        best = np_krum_order(sub, f)[0]
        chosen.append(left.pop(best))
    sel = x[chosen]
    beta = theta - 2 * f
    out = []
    for c in range(x.shape[1]):
        col = sel[:, c].astype(np.float64)
        med = np_median(sel[:, c:c + 1])[0]
        order = sorted(range(len(col)), key=lambda i: (abs(col[i] - med), i))
        out.append(np.mean(col[order[:beta]]))
    return np.array(out)


@pytest.mark.parametrize("n", [10, 11])
def test_median_matches_numpy(n):
    x = _x(n)
    np.testing.assert_allclose(CoordinateMedian(3)(torch.from_numpy(x)).numpy(), np_median(x), rtol=1e-6, atol=1e-6)


def test_trimmed_mean_matches_numpy():
    x = _x()
    np.testing.assert_allclose(TrimmedMean(2)(torch.from_numpy(x)).numpy(), np_trimmed(x, 2), rtol=1e-5, atol=1e-6)


def test_krum_and_multikrum_match_numpy():
    x = _x(11)
    f = 2
    order = np_krum_order(x, f)
    np.testing.assert_allclose(Krum(f)(torch.from_numpy(x)).numpy(), x[order[0]])
    np.testing.assert_allclose(MultiKrum(f, m=4)(torch.from_numpy(x)).numpy(), x[order[:4]].mean(axis=0), rtol=1e-5)
    # default m = n - f
    np.testing.assert_allclose(MultiKrum(f)(torch.from_numpy(x)).numpy(), x[order[:9]].mean(axis=0), rtol=1e-5)
    # the outliers are never picked
    assert set(order[:9]).isdisjoint({9, 10})


def test_bulyan_matches_numpy():
    x = _x(11)
    np.testing.assert_allclose(Bulyan(2)(torch.from_numpy(x)).numpy(), np_bulyan(x, 2), rtol=1e-5, atol=1e-6)


def test_majority_vote_matches_numpy():
    x = _x(11)
    want = np.sign(np.sign(x).sum(axis=0))
    np.testing.assert_array_equal(MajorityVote(3)(torch.from_numpy(x)).numpy(), want)


def test_mean_is_broken_by_one_outlier_and_median_is_not():
    x = torch.zeros(7, 3)
    x[0] = 1e6
    assert float(Mean(0).__class__(0)(x).abs().max()) > 1e5
    assert float(CoordinateMedian(1)(x).abs().max()) == 0.0
    assert float(Krum(1)(x).abs().max()) == 0.0
    assert float(Bulyan(1)(x).abs().max()) == 0.0


@pytest.mark.parametrize("rule,n,ok,bad", [
    (CoordinateMedian, 15, 7, 8), (TrimmedMean, 15, 7, 8), (Krum, 15, 6, 7), (MultiKrum, 15, 6, 7),
    (Bulyan, 15, 3, 4), (MajorityVote, 15, 7, 8),
])
def test_tolerance_bounds_are_the_papers(rule, n, ok, bad):
    rule(ok).check(n)
    with pytest.raises(ToleranceError) as exc:
        rule(bad).check(n)
    msg = str(exc.value)
    assert rule.bound in msg and f"at most {ok}" in msg and str(n) in msg


def test_rule_refuses_too_few_inputs_at_call():
    with pytest.raises(ToleranceError):
        Bulyan(3)(torch.zeros(10, 4))  # needs 4f+3 = 15


def test_bulyan_selection_is_iterated_krum():
    x = torch.from_numpy(_x(11))
    sel = Bulyan(2).selection(x)
    assert len(sel) == 7 and len(set(sel)) == 7
    # the first pick is Krum's choice on the full set
    assert sel[0] == int(Krum(2).select(x, 1)[0])
    # brute force: each later pick is Krum's choice among those left
    left = list(range(11))
    for pick in sel:
        sub = x[left].numpy()
        assert left[np_krum_order(sub, 2)[0]] == pick or len(left) == 1
        left.remove(pick)


def test_rules_ignore_row_order_where_they_should():
    x = _x(9)
    perm = np.random.default_rng(1).permutation(9)
    for rule in (CoordinateMedian(2), TrimmedMean(2), MajorityVote(2)):
        np.testing.assert_allclose(rule(torch.from_numpy(x)).numpy(), rule(torch.from_numpy(x[perm])).numpy(),
                                   rtol=1e-6, atol=1e-7)
