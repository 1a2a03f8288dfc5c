"""SecAgg+'s algorithm layer (fedswarm.algorithms.secagg), against independent oracles:
numpy's own sums mod 2^b, the weighted mean of the clipped updates, brute-force wrap checks."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from fedswarm.algorithms.secagg import (STAGES, Quantizer, SecAggClient, SecAggFailed, SecAggParams, SecAggRefused,
                                        SecAggServer, UnmaskRequest, field_bits, neighbours, run_round, to_signed)
from fedswarm.algorithms.secagg import crypto, shamir
from fedswarm.errors import ConfigError

IDS = [11, 23, 35, 47, 59, 61, 73, 85]


def _updates(ids=IDS, d=300, seed=0):
    rng = np.random.default_rng(seed)
    return {i: rng.normal(0.0, 0.4, d) for i in ids}


def _field_sum(vectors, bits):
    """The oracle: Python-int sum of the survivors' encoded inputs mod 2^bits."""
    acc = [0] * len(next(iter(vectors)))
    for v in vectors:
        acc = [a + int(x) for a, x in zip(acc, v, strict=True)]
    return np.array([a % (1 << bits) for a in acc], dtype=np.uint64)


PARAMS = SecAggParams(threshold=0.6, clip=1.0, bits=32)


@pytest.mark.parametrize("dropped", [set(), {35}, {11, 35, 85}])
def test_unmasked_sum_is_the_exact_sum_of_survivors_inputs(dropped):
    ups = _updates()
    res = run_round(ups, PARAMS, drop={"masked_input": dropped}, weights=dict.fromkeys(IDS, 3))
    t = res.report.threshold
    assert len(IDS) - len(dropped) >= t
    assert set(res.encoded) == set(IDS) - dropped
    np.testing.assert_array_equal(res.total, _field_sum(res.encoded.values(), 32))
    assert res.report.dropped_after_sharing == len(dropped) == res.report.recovered
    assert res.decoded.total_weight == 3 * (len(IDS) - len(dropped))


def test_n_minus_t_dropouts_after_sharing_still_exact():
    ups = _updates()
    t = SecAggServer(IDS, 300, PARAMS).threshold
    dropped = set(IDS[: len(IDS) - t])
    res = run_round(ups, PARAMS, drop={"masked_input": dropped})
    np.testing.assert_array_equal(res.total, _field_sum(res.encoded.values(), 32))
    assert res.report.recovered == len(IDS) - t


def test_past_the_threshold_the_round_fails_with_the_reason():
    t = SecAggServer(IDS, 300, PARAMS).threshold
    with pytest.raises(SecAggFailed, match=f"fewer than the threshold {t}") as err:
        run_round(_updates(), PARAMS, drop={"masked_input": set(IDS[: len(IDS) - t + 1])})
    assert err.value.stage == "masked_input"
    # Enough masked inputs, but too few nodes answer the unmask stage to rebuild the seeds.
    with pytest.raises(SecAggFailed, match="shares back, fewer than the threshold") as err:
        run_round(_updates(), PARAMS, drop={"unmask": set(IDS[: len(IDS) - t + 1])})
    assert err.value.stage == "unmask"


def test_sparse_graph_with_dropouts_at_every_stage():
    ids = list(range(100, 140))
    params = dataclasses.replace(PARAMS, bits=40, degree=10)
    res = run_round(_updates(ids, d=50), params, drop={"advertise": {100}, "share_keys": {101},
                                                      "masked_input": {102, 120}, "unmask": {103}})
    assert res.report.degree == 10 and res.report.recovered == 2
    np.testing.assert_array_equal(res.total, _field_sum(res.encoded.values(), 40))


def test_decoded_mean_within_quantization_error_of_the_weighted_mean():
    ups = _updates(d=2000)
    weights = {i: w for i, w in zip(IDS, [5, 9, 1, 30, 7, 7, 12, 2], strict=True)}
    q = Quantizer(clip=1.0, bits=32, n_max=len(IDS), weight_max=1 << 16)
    res = run_round(ups, PARAMS, weights=weights)
    clipped = {i: np.clip(v, -1, 1) for i, v in ups.items()}
    oracle = sum(weights[i] * clipped[i] for i in IDS) / sum(weights.values())
    bound = len(IDS) / (sum(weights.values()) * q.scale)  # one rounding unit per node
    assert np.max(np.abs(res.decoded.mean - oracle)) <= bound
    assert res.decoded.total_weight == sum(weights.values())


def test_field_bits_formula_is_tight():
    n, levels, w = 7, 1000, 13
    b = field_bits(n, levels, w)
    top = n * w * levels  # every node at +max or -max
    assert 2 * top + 1 <= 2 ** b and 2 * top + 1 > 2 ** (b - 1)
    for sign in (1, -1):
        s = (sign * top) % (1 << b)
        assert to_signed(np.array([s], dtype=np.uint64), b)[0] == sign * top
    # One bit less and +top and -(top - (2^(b-1) ... )) collide: the sign is lost.
    assert to_signed(np.array([top % (1 << (b - 1))], dtype=np.uint64), b - 1)[0] != top
    q = Quantizer(clip=1.0, bits=b, n_max=n, weight_max=w)
    assert q.levels >= levels
    # Every node at the extremes (+clip on half the coordinates, -clip on the others), with the
    # largest weight: the sum's coordinates are +-n*w*levels, the most the field must hold.
    x = {i: np.concatenate([np.full(25, 5.0), np.full(25, -5.0)]) for i in range(n)}
    res = run_round(x, SecAggParams(threshold=0.6, clip=1.0, bits=b, weight_max=w), weights=dict.fromkeys(range(n), w))
    np.testing.assert_allclose(res.decoded.mean, np.clip(x[0], -1, 1), atol=1e-3)
    with pytest.raises(ConfigError, match="too small"):
        Quantizer(clip=1.0, bits=8, n_max=1000, weight_max=10)


def test_shamir_threshold():
    secret = bytes(range(32))
    xs = [1, 2, 3, 4, 5]
    sh = shamir.split(secret, xs, 3)
    assert shamir.combine([(1, sh[0]), (4, sh[3]), (5, sh[4])]) == secret
    assert shamir.combine(list(zip(xs, sh, strict=True))) == secret
    lead0 = b"\0\0" + secret[2:]
    assert shamir.combine(list(zip(xs, shamir.split(lead0, xs, 3), strict=True))[:3]) == lead0
    # below the threshold the shares say nothing of the secret: mostly they do not decode at all, but
    # about 1 draw in 570 decodes to some other value that passes the length prefix
    try:
        below = shamir.combine([(1, sh[0]), (2, sh[1])])
    except ValueError as err:
        assert "do not reconstruct" in str(err)
    else:
        assert below != secret


def test_graph_is_regular_symmetric_and_seeded():
    ids = list(range(1, 31))
    g = neighbours(ids, 8, seed=5)
    assert all(len(v) == 8 for v in g.values())
    assert all(i in g[j] for i in ids for j in g[i])
    assert g == neighbours(ids, 8, seed=5) and g != neighbours(ids, 8, seed=6)
    assert neighbours(ids[:5], 8, seed=5) == {i: [j for j in ids[:5] if j != i] for i in ids[:5]}


def test_prg_mask_is_deterministic_uniform_and_in_field():
    a = crypto.prg_mask(b"k" * 32, 100_000, 20)
    assert np.array_equal(a, crypto.prg_mask(b"k" * 32, 100_000, 20))
    assert not np.array_equal(a, crypto.prg_mask(b"j" * 32, 100_000, 20))
    assert int(a.max()) < 2 ** 20
    assert abs(a.mean() / 2 ** 20 - 0.5) < 0.01


# -- a server that breaks the protocol --------------------------------------------------------

def _to_unmask(drop=()):
    """Drive a round to the unmask stage; return the server, the clients and the requests."""
    ids = IDS[:5]
    srv = SecAggServer(ids, 10, PARAMS)
    cs = {i: SecAggClient(i) for i in ids}
    keys = {i: cs[i].advertise(m) for i, m in srv.setup().items()}
    shares = {i: cs[i].share_keys(m) for i, m in srv.collect_keys(keys).items()}
    reqs = srv.collect_shares(shares)
    inputs = {i: cs[i].masked_input(m, cs[i].quantizer().encode(np.zeros(10), np.random.default_rng(0)))
              for i, m in reqs.items() if i not in drop}
    return srv, cs, reqs, srv.collect_masked(inputs)


def test_node_refuses_a_request_for_both_shares_of_one_neighbour():
    srv, cs, _, unmask = _to_unmask(drop={35})
    req = unmask[11]
    assert 35 in req.dropped
    greedy = UnmaskRequest(req.round_id, tuple(sorted({*req.survivors, 35})), req.dropped)
    with pytest.raises(SecAggRefused, match=r"both the self-mask share and the mask-key share of node\(s\) \[35\]"):
        cs[11].unmask(greedy)
    # Refused, it still answers the honest request (nothing was revealed), and only once.
    assert 35 in cs[11].unmask(req).key_shares
    with pytest.raises(SecAggRefused, match="replayed 'unmask'"):
        cs[11].unmask(req)


def test_replayed_reordered_and_foreign_stage_messages_are_refused():
    srv = SecAggServer(IDS[:4], 10, PARAMS)
    cs = {i: SecAggClient(i) for i in IDS[:4]}
    setup = srv.setup()
    keys = {i: cs[i].advertise(m) for i, m in setup.items()}
    with pytest.raises(SecAggRefused, match="replayed 'advertise'"):
        cs[11].advertise(setup[11])
    share_reqs = srv.collect_keys(keys)
    early = UnmaskRequest(srv.round_id, tuple(IDS[:4]), ())
    with pytest.raises(SecAggRefused, match="out-of-order 'unmask'"):
        cs[11].unmask(early)
    other = SecAggServer(IDS[:4], 10, PARAMS)
    with pytest.raises(SecAggRefused, match="another round"):
        cs[11].share_keys(other.collect_keys(keys)[11])
    shares = {i: cs[i].share_keys(m) for i, m in share_reqs.items()}
    with pytest.raises(SecAggRefused, match="replayed 'share_keys'"):
        cs[11].share_keys(share_reqs[11])
    # A node whose own keys come back replaced refuses the key list.
    srv2 = SecAggServer(IDS[:4], 10, PARAMS)
    c2 = {i: SecAggClient(i) for i in IDS[:4]}
    k2 = {i: c2[i].advertise(m) for i, m in srv2.setup().items()}
    swapped = srv2.collect_keys({**k2, 11: k2[23]})[11]
    with pytest.raises(SecAggRefused, match="own keys are missing or replaced"):
        c2[11].share_keys(swapped)
    assert shares and STAGES[0] == "advertise"


def test_masked_input_is_uncorrelated_with_the_plain_update():
    ups = _updates(d=5000)
    srv = SecAggServer(IDS, 5000, PARAMS)
    captured: dict[int, np.ndarray] = {}
    cs = [SecAggClient(i) for i in IDS]
    orig = SecAggServer.collect_masked

    def capture(self, replies):
        captured.update(replies)
        return orig(self, replies)

    srv.collect_masked = capture.__get__(srv)
    res = run_round(ups, PARAMS, server=srv, clients=cs)
    for i in IDS:
        seen = to_signed(captured[i], 32)[:-1].astype(np.float64)
        plain = to_signed(res.encoded[i], 32)[:-1].astype(np.float64)
        assert abs(np.corrcoef(seen, ups[i])[0, 1]) < 0.05
        assert np.corrcoef(plain, ups[i])[0, 1] > 0.99  # the same capture, unmasked, would be the update


def test_client_state_round_trips_through_a_plain_dict():
    """The Flower mod keeps a node's state in context.state between messages: a fresh object on
    the dumped state must carry on."""
    srv = SecAggServer(IDS[:3], 4, PARAMS)
    cs = {i: SecAggClient(i) for i in IDS[:3]}
    keys = {i: cs[i].advertise(m) for i, m in srv.setup().items()}
    cs = {i: SecAggClient(i, c.to_state()) for i, c in cs.items()}
    reqs = srv.collect_keys(keys)
    shares = {i: cs[i].share_keys(m) for i, m in reqs.items()}
    for v in cs[11].to_state().values():
        assert isinstance(v, bytes | int | float | list)
    assert srv.collect_shares(shares)


def test_a_stage_run_twice_on_a_node_still_gives_the_exact_sum():
    """Flower pushes a ClientApp's reply before it saves the node's context, and a task can be run
    again: a server may hold the shares of one run of stage 1 while the node keeps the state of
    another. Both runs must share the same secrets the same way."""
    ids = IDS[:5]
    srv = SecAggServer(ids, 40, PARAMS)
    cs = {i: SecAggClient(i) for i in ids}
    keys = {i: cs[i].advertise(m) for i, m in srv.setup().items()}
    reqs = srv.collect_keys(keys)
    before = cs[35].to_state()
    shares = {i: cs[i].share_keys(m) for i, m in reqs.items()}  # the server keeps these replies...
    cs[35] = SecAggClient(35, before)
    cs[35].share_keys(reqs[35])  # ...the node keeps the state of its second run
    ups = _updates(ids, d=40)
    rng = np.random.default_rng(0)
    enc = {i: cs[i].quantizer().encode(ups[i], rng) for i in ids}
    masked = {i: cs[i].masked_input(m, enc[i]) for i, m in srv.collect_shares(shares).items() if i != 11}
    unmask = {i: cs[i].unmask(m) for i, m in srv.collect_masked(masked).items()}
    total = srv.collect_unmask(unmask)
    np.testing.assert_array_equal(total, _field_sum([enc[i] for i in ids if i != 11], 32))
