"""``fedswarm.params.all_finite``, the one finiteness check every runtime uses on models and
payloads (a swarm body as it arrives, a codec's decoded arrays, a Flower reply, an aggregate):
held to ``torch.isfinite(t).all()`` wherever a bad value sits, whatever the dtype and size,
and right when finite values are large enough for their sum to overflow."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedswarm.params import all_finite

BAD = (float("nan"), float("inf"), float("-inf"))
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _oracle(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all())


@settings(max_examples=300, deadline=None)
@given(n=st.integers(0, 70_000), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31 - 1),
       bad=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.sampled_from(BAD)), max_size=3),
       scale=st.sampled_from([1.0, 1e4, 1e30]))
def test_agrees_with_isfinite_wherever_the_bad_values_sit(n, dtype, seed, bad, scale):
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(n, generator=g, dtype=torch.float64) * scale).to(dtype)  # 1e30 is inf in float16
    for where, value in bad:
        if n:
            t[int(where * n)] = value
    assert all_finite(t) is _oracle(t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_finite_values_whose_sum_overflows_are_finite(dtype):
    big = torch.finfo(dtype).max
    t = torch.full((1_000,), big / 2, dtype=dtype)
    t[::3] = -big / 3
    assert not bool(torch.isfinite(t.sum()))  # the sum overflows: the exact test must decide
    assert all_finite(t)
    t[500] = float("nan")
    assert not all_finite(t)


def test_plus_and_minus_infinity_together_are_caught():
    t = torch.zeros(10_000)
    t[10], t[9_000] = float("inf"), float("-inf")  # their sum is NaN, never a finite number
    assert not all_finite(t)


def test_views_and_matrices():
    m = torch.randn(300, 257)
    assert all_finite(m) and all_finite(m.t()) and all_finite(m[:, ::2])
    m[7, 200] = float("nan")
    assert not all_finite(m.t()) and not all_finite(m[:, ::2])
    assert all_finite(m[:, 1::2])  # column 200 is not in this view


def test_a_finite_tensor_is_decided_by_its_sum_alone(monkeypatch):
    """The exact min/max pass runs only when the sum is not finite (the fast path is the point)."""
    def refuse(*_a, **_k):
        raise AssertionError("aminmax ran on a tensor whose sum is finite")

    monkeypatch.setattr(torch, "aminmax", refuse)
    assert all_finite(torch.randn(100_000))
    with pytest.raises(AssertionError, match="aminmax ran"):
        all_finite(torch.tensor([1.0, float("nan")]))
