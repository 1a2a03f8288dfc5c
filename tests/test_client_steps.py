"""The federated client steps written once on the client axis (compressed FedAvg's and
gTop-k's): a step on C clients equals the C steps of one client each (what a Flower client
runs, C = 1, against what the batched engine runs, C = the cohort), and small cases
computed by hand."""

import json

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord

from fedswarm.algorithms.compression.codecs import decode_payload
from fedswarm.algorithms.compression.error_feedback import ErrorFeedbackState
from fedswarm.algorithms.compression.gtopk import accumulate
from fedswarm.params import ParamLayout
from fedswarm.strategies.federated import compressed_fedavg as cfa
from fedswarm.strategies.federated import gtopk

LAYOUT = ParamLayout.from_shapes([("w", (6, 5)), ("b", (6,)), ("v", (4,))])  # d = 40
C = 5


def _changes(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(C, LAYOUT.d, generator=g)


# Codecs whose randomness is shared by the rows of one encode (qsgd's is per row: one client a call)
SHARED_SEED = [("topk", {"ratio": 0.2}), ("randk", {"ratio": 0.3}), ("sign", {}), ("onebit", {}), ("fp16", {}),
               ("countsketch", {"rows": 3, "cols": 8}), ("none", {})]


@pytest.mark.parametrize("ef", [True, False])
@pytest.mark.parametrize("dp_clip", [None, 0.5])
@pytest.mark.parametrize("codec,params", SHARED_SEED, ids=[c for c, _ in SHARED_SEED])
def test_compressed_step_on_c_clients_is_c_steps_of_one(codec, params, ef, dp_clip):
    uplink = cfa.Uplink(codec, json.dumps(params, sort_keys=True), 1234, ef, dp_clip)
    delta, residual = _changes(0), 0.3 * _changes(1)
    payload, state = cfa.client_step(uplink, ErrorFeedbackState(residual), delta, LAYOUT)
    got = decode_payload(payload, LAYOUT)
    for i in range(C):
        one, one_state = cfa.client_step(uplink, ErrorFeedbackState(residual[i]), delta[i:i + 1], LAYOUT)
        assert torch.equal(got[i:i + 1], decode_payload(one, LAYOUT)), i
        for name, arr in payload.arrays.items():
            assert torch.equal(arr[i:i + 1], one.arrays[name]), (i, name)
        want = one_state.residual if ef else residual[i]
        assert torch.equal(state.residual[i], want.reshape(-1)), i
    # nothing is lost, only delayed: what is sent plus what is kept is what was to be sent
    clipped = delta if dp_clip is None else delta * (dp_clip / delta.norm(dim=1, keepdim=True)).clamp(max=1.0)
    if ef:
        torch.testing.assert_close(got + state.residual, clipped + residual, rtol=0, atol=1e-5)
    else:
        assert state.residual is residual  # without error feedback the memory is left as it was


def test_compressed_step_by_hand():
    layout = ParamLayout.from_shapes([("v", (4,))])
    uplink = cfa.Uplink("topk", json.dumps({"ratio": 0.5}), 0, True, 2.5)
    delta = torch.tensor([[3.0, 0.0, -4.0, 0.0],  # norm 5, clipped to 2.5: [1.5, 0, -2, 0]
                          [0.1, 0.2, 0.0, -0.3]])  # norm < 2.5: as it is
    residual = torch.tensor([[0.0, 1.0, 0.25, -0.5], [1.0, 0.0, 0.0, 0.0]])
    payload, state = cfa.client_step(uplink, ErrorFeedbackState(residual), delta, layout)
    # corrected rows [1.5, 1, -1.75, -0.5] and [1.1, 0.2, 0, -0.3]; the top 2 of each sent
    assert payload.arrays["indices"].tolist() == [[0, 2], [0, 3]]
    torch.testing.assert_close(payload.arrays["values"], torch.tensor([[1.5, -1.75], [1.1, -0.3]]))
    torch.testing.assert_close(state.residual, torch.tensor([[0.0, 1.0, 0.0, -0.5], [0.0, 0.2, 0.0, 0.0]]))


def test_uplink_reads_the_knobs_and_the_policy():
    knobs = ConfigRecord({"round": 3, "codec": "topk", "codec_params": '{"ratio": 0.1}', "error_feedback": False,
                          "dp_clip": 0.7})
    up = cfa.uplink_of(knobs, {}, 5, 9)
    assert up == cfa.Uplink("topk", '{"ratio": 0.1}', cfa.uplink_seed(5, 3, "topk", 9), False, 0.7)
    assert up.seed == cfa.uplink_of(knobs, {}, 5, 2).seed  # one seed a round for topk's clients ...
    q = ConfigRecord({"round": 3, "codec": "qsgd", "codec_params": "{}"})
    assert cfa.uplink_of(q, {}, 5, 9).seed == cfa.uplink_of(q, {}, 5, 2).seed + 7  # ... qsgd's per client
    policy = {"codec": "randk", "codec_params": {"ratio": 0.3}}
    assert cfa.uplink_of(knobs, policy, 5, 9).params == '{"ratio": 0.3}'
    assert cfa.uplink_of(ConfigRecord({"round": 1, "codec": "sign"}), {}, 0, 0).error_feedback  # the default


def test_compressed_step_refuses_a_vector():
    uplink = cfa.Uplink("none", "{}", 0)
    with pytest.raises(ValueError, match=r"\[C, d\]"):
        cfa.client_step(uplink, ErrorFeedbackState(), torch.zeros(LAYOUT.d), LAYOUT)


def _select(rnd: int, bits: list[bool]) -> ConfigRecord:
    return ConfigRecord({"round": rnd, "mask": np.packbits(np.array(bits), bitorder="little").tobytes()})


def test_gtopk_step_by_hand():
    layout = ParamLayout.from_shapes([("v", (6,))])  # density 1/3: k = 2
    acc = torch.tensor([[1.0, -5.0, 0.0, 3.0, 0.0, 0.0],
                        [1.0, -5.0, 0.0, 3.0, 0.0, 0.0],
                        [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    state = gtopk.GTopKClientState(acc, (4, 3, None), (torch.tensor([1, 3]), torch.tensor([1, 3]), None))
    delta = torch.tensor([[0.0, 0.0, 2.0, 0.0, 0.0, -0.5]] * 2 + [[0.5, 0.0, 0.0, 0.0, -1.0, 2.0]])
    # row 0: the server used index 1 of its round-4 message; row 1's note is about another round;
    # row 2 sent nothing yet
    selects = [_select(4, [True, False]), _select(4, [True, False]), None]
    payload, new = gtopk.client_step(state, selects, delta, 1 / 3, 5, layout)
    torch.testing.assert_close(new.acc, torch.tensor([[1.0, 0.0, 2.0, 3.0, 0.0, -0.5],
                                                      [1.0, -5.0, 2.0, 3.0, 0.0, -0.5],
                                                      [0.5, 0.0, 0.0, 0.0, -1.0, 2.0]]))
    assert payload.arrays["indices"].tolist() == [[2, 3], [1, 3], [4, 5]]
    torch.testing.assert_close(payload.arrays["values"], torch.tensor([[2.0, 3.0], [-5.0, 3.0], [-1.0, 2.0]]))
    assert new.sent_round == (5, 5, 5)
    assert [t.tolist() for t in new.sent_idx] == [[2, 3], [1, 3], [4, 5]]
    assert torch.equal(state.acc, acc)  # the old state is left as it was (a failed round keeps it)


def _gtopk_rows(state: gtopk.GTopKClientState) -> list[gtopk.GTopKClientState]:
    """Each client's own state of a batch (C = 1), as a Flower client holds it."""
    return [gtopk.GTopKClientState(state.acc[i:i + 1].clone(), state.sent_round[i:i + 1], (idx,))
            for i, idx in enumerate(state.sent_idx)]


def test_gtopk_step_on_c_clients_is_c_steps_of_one():
    layout, density = LAYOUT, 0.1
    empty = gtopk.GTopKClientState.empty(layout.d)
    state = gtopk.GTopKClientState(empty.acc.repeat(C, 1), empty.sent_round * C, empty.sent_idx * C)
    for rnd in (1, 2, 3):
        delta = _changes(rnd)
        # the server used a different part of each client's last message (none before the first)
        selects = [None if r is None else _select(r, [(i + j) % 3 == 0 for j in range(idx.numel())])
                   for i, (r, idx) in enumerate(zip(state.sent_round, state.sent_idx))]
        if rnd == 3:
            selects[1] = _select(1, [True] * 4)  # a note about an older message: nothing cleared
        payload, new = gtopk.client_step(state, selects, delta, density, rnd, layout)
        rows = _gtopk_rows(state)
        for i in range(C):
            one, one_new = gtopk.client_step(rows[i], selects[i:i + 1], delta[i:i + 1], density, rnd, layout)
            for name, arr in payload.arrays.items():
                assert torch.equal(arr[i:i + 1], one.arrays[name]), (rnd, i, name)
            assert torch.equal(new.acc[i:i + 1], one_new.acc), (rnd, i)
            assert torch.equal(new.sent_idx[i], one_new.sent_idx[0]), (rnd, i)
        state = new
    assert not torch.equal(state.acc, _changes(1) + _changes(2) + _changes(3))  # the selections did clear some


def test_gtopk_state_and_accumulate_name_bad_shapes():
    with pytest.raises(ValueError, match="acc \\[C, d\\]"):
        gtopk.GTopKClientState(torch.zeros(2, 3), (None,), (None,))
    with pytest.raises(ValueError, match="C index sets"):
        accumulate(torch.zeros(2, 3), [None], torch.zeros(2, 3))
    state = gtopk.GTopKClientState.empty(LAYOUT.d)
    with pytest.raises(ValueError, match="got 2 for 1 clients"):
        gtopk.client_step(state, [None, None], torch.zeros(1, LAYOUT.d), 0.1, 1, LAYOUT)
