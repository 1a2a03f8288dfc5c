"""Error feedback telescopes for every biased codec, and its residual survives in
Flower's Context.state."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from fedswarm.params import ParamLayout
from fedswarm.algorithms.compression.codecs import CODECS, make_codec
from fedswarm.algorithms.compression.error_feedback import ErrorFeedback
from fedswarm.strategies.strategy_utils import load_vector, save_vector

LAYOUT = ParamLayout.from_shapes([("w", (20, 30)), ("b", (20,)), ("v", (7,))])  # d = 627
SMALL = {"topk": {"ratio": 0.02}, "randk": {"ratio": 0.05}, "countsketch": {"k_ratio": 0.02}}
BIASED = [name for name, cls in CODECS.items() if not cls(**SMALL.get(name, {})).unbiased]


def test_biased_list_is_what_we_think():
    assert BIASED == ["fp16", "onebit", "sign", "topk", "randk", "countsketch"]


@pytest.mark.parametrize("name", BIASED)
def test_error_feedback_telescopes(name):
    codec, ef = make_codec(name, **SMALL.get(name, {})), ErrorFeedback()
    gen = torch.Generator().manual_seed(0)
    residual = None
    sent = torch.zeros(3, LAYOUT.d, dtype=torch.float64)
    total = torch.zeros(3, LAYOUT.d, dtype=torch.float64)
    for t in range(20):
        x = torch.randn(3, LAYOUT.d, generator=gen)
        payload, residual = ef.step(codec, x, residual, LAYOUT, seed=t)
        sent += codec.decode(payload, LAYOUT).double()
        total += x.double()
    # nothing is lost, only delayed: sum of what was received + what is held back = sum of inputs
    torch.testing.assert_close(sent + residual.double(), total, rtol=0, atol=1e-4)
    if name != "fp16":
        assert float(residual.abs().max()) > 1e-2  # the codec did hold something back


def test_error_feedback_makes_topk_transmit_everything_eventually():
    codec, ef = make_codec("topk", ratio=0.1), ErrorFeedback()
    x = torch.randn(1, LAYOUT.d, generator=torch.Generator().manual_seed(3))
    residual, received = None, torch.zeros_like(x)
    for t in range(10):  # send x once, then nothing: the memory drains at k per round
        payload, residual = ef.step(codec, x if t == 0 else torch.zeros_like(x), residual, LAYOUT)
        received += codec.decode(payload, LAYOUT)
    assert torch.equal(received, x) and float(residual.abs().max()) == 0


def test_compensate_and_update():
    x, e = torch.tensor([[1.0, 2.0]]), torch.tensor([0.5, -1.0])
    assert torch.equal(ErrorFeedback.compensate(x, e), torch.tensor([[1.5, 1.0]]))
    assert ErrorFeedback.compensate(x, None) is x
    assert torch.equal(ErrorFeedback.update(torch.tensor([1.5, 1.0]), torch.tensor([1.0, 1.0])),
                       torch.tensor([0.5, 0.0]))


def test_residual_round_trips_through_context_state():
    state = RecordDict()
    assert torch.equal(load_vector(state, "ef.onebit", 5), torch.zeros(5))
    residual = torch.tensor([[0.5, -1.0, 2.0, 0.0, 3.0]])
    save_vector(state, "ef.onebit", residual)
    assert isinstance(state["ef.onebit"], ArrayRecord)
    loaded = load_vector(state, "ef.onebit", 5)
    assert torch.equal(loaded, residual[0]) and loaded.dtype == torch.float32
    loaded.add_(1.0)  # a copy, not a view of the state
    assert torch.equal(load_vector(state, "ef.onebit", 5), residual[0])


def test_stale_or_corrupt_residuals_load_as_zeros():
    state = RecordDict()
    save_vector(state, "ef", torch.ones(4))
    assert torch.equal(load_vector(state, "ef", 6), torch.zeros(6))  # the model changed
    state["ef"] = ArrayRecord({"residual": Array(np.array([1.0, np.nan], np.float32))})
    assert torch.equal(load_vector(state, "ef", 2), torch.zeros(2))
    state["ef"] = ArrayRecord({"residual": Array(np.ones(2, np.int32))})
    assert torch.equal(load_vector(state, "ef", 2), torch.zeros(2))
    state["cfg"] = ConfigRecord({"a": 1})
    assert torch.equal(load_vector(state, "cfg", 2), torch.zeros(2))
    with pytest.raises(ValueError, match=r"\[d\] or \[1, d\]"):
        save_vector(state, "ef", torch.ones(2, 3))


# -- the explicit state object ------------------------------------------------------------


def test_state_step_is_pure_and_telescopes_for_one_node():
    from fedswarm.algorithms.compression.error_feedback import ErrorFeedbackState, error_feedback_step

    codec = make_codec("topk", ratio=0.05)
    gen = torch.Generator().manual_seed(1)
    state, sent, total = ErrorFeedbackState(), torch.zeros(LAYOUT.d, dtype=torch.float64), 0
    for t in range(8):
        x = torch.randn(LAYOUT.d, generator=gen)
        before = None if state.residual is None else state.residual.clone()
        payload, new = error_feedback_step(state, codec, x, LAYOUT, seed=t)
        # pure: the old state is untouched, the new one is a new object
        assert new is not state and (before is None or torch.equal(state.residual, before))
        # the oracle: e_t = (x_t + e_{t-1}) - D(C(x_t + e_{t-1})), computed by hand
        corrected = x + (before if before is not None else 0)
        assert torch.equal(new.residual, corrected - codec.decode(codec.encode(corrected[None], LAYOUT, seed=t),
                                                                  LAYOUT)[0])
        sent += codec.decode(payload, LAYOUT)[0].double()
        total = total + x.double()
        state = new
    torch.testing.assert_close(sent + state.residual.double(), total, rtol=0, atol=1e-4)


def test_state_refuses_bad_residuals_and_persists_in_context_state():
    from fedswarm.algorithms.compression.error_feedback import ErrorFeedbackState
    from fedswarm.strategies.strategy_utils import load_error_feedback, save_error_feedback

    with pytest.raises(ValueError, match="finite"):
        ErrorFeedbackState(torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="float"):
        ErrorFeedbackState(torch.tensor([1, 2]))
    state = RecordDict()
    assert load_error_feedback(state, "ef", 3).residual is None
    save_error_feedback(state, "ef", ErrorFeedbackState(torch.tensor([0.5, -1.0, 2.0])))
    assert torch.equal(load_error_feedback(state, "ef", 3).residual, torch.tensor([0.5, -1.0, 2.0]))
    assert load_error_feedback(state, "ef", 4).residual is None  # the model changed: start over
