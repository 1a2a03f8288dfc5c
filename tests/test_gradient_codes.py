"""Draco's and Solon's gradient codes: exact decoding whatever up to s liars send, a clear
failure when more lie, erasures, and the structure (each worker uses only its partitions)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from fedswarm.algorithms.robust.aggregators import ToleranceError
from fedswarm.algorithms.robust.coding import PolynomialCode, RepetitionCode, cyclic_assignment, make_code

P, D = 15, 1001  # d not a multiple of m: the padding is exercised


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def solon3():
    return PolynomialCode(P, 3, 3)


def _lies(kind, honest_rows, rng):
    """What the liars send instead of ``honest_rows [B, ℓ]``."""
    b, ell = honest_rows.shape
    if kind == "random":
        return rng.normal(size=(b, ell)) * 100
    if kind == "signflip":
        return -10 * honest_rows
    if kind == "zeros":
        return np.zeros((b, ell))
    if kind == "huge":
        return np.full((b, ell), 1e30)
    if kind == "tiny":  # a lie barely above rounding: still found, still harmless
        return honest_rows + 1e-3 * np.abs(honest_rows).max()
    if kind == "same":  # colluders agreeing on one vector
        return np.repeat(rng.normal(size=(1, ell)), b, axis=0)
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["random", "signflip", "zeros", "huge", "tiny", "same"])
def test_solon_decodes_the_exact_sum_despite_s_liars(solon3, kind):
    rng = np.random.default_rng(0)
    G = rng.normal(size=(P, D))
    Z = solon3.encode_all(G).astype(np.float32).astype(np.float64)  # what travels: float32
    for trial in range(3):
        liars = rng.choice(P, 3, replace=False)
        Zb = Z.copy()
        Zb[liars] = _lies(kind, Z[liars], rng)
        res = solon3.decode(Zb, D, rng=np.random.default_rng(trial))
        assert res.ok, res.message
        assert sorted(res.liars) == sorted(liars.tolist())
        assert _rel(res.total, G.sum(axis=0)) < 1e-5


def test_solon_every_support_of_s_liars(solon3):
    """Every one of the C(15, 3) = 455 placements of three liars: located and corrected."""
    rng = np.random.default_rng(1)
    G = rng.normal(size=(P, 300))
    Z = solon3.encode_all(G).astype(np.float32).astype(np.float64)
    worst = 0.0
    for liars in itertools.combinations(range(P), 3):
        Zb = Z.copy()
        Zb[list(liars)] += rng.normal(size=(3, Z.shape[1]))
        res = solon3.decode(Zb, 300, rng=rng)
        assert res.ok and sorted(res.liars) == list(liars)
        worst = max(worst, _rel(res.total, G.sum(axis=0)))
    assert worst < 1e-5


@pytest.mark.parametrize("s,m", [(1, 1), (1, 3), (2, 4), (3, 1), (3, 5)])
def test_codes_across_parameters(s, m):
    code = PolynomialCode(P, s, m)
    assert code.r == 2 * s + m and code.message_size(D) == -(-D // m)
    rng = np.random.default_rng(s * 10 + m)
    G = rng.normal(size=(P, D))
    Z = code.encode_all(G).astype(np.float32).astype(np.float64)
    liars = rng.choice(P, s, replace=False)
    Z[liars] = rng.normal(size=(s, Z.shape[1])) * 1e3
    res = code.decode(Z, D, rng=rng)
    assert res.ok and _rel(res.total, G.sum(axis=0)) < 1e-5


@pytest.mark.parametrize("kind", ["random", "signflip", "same"])
def test_solon_says_so_when_more_than_s_lie(solon3, kind):
    rng = np.random.default_rng(2)
    G = rng.normal(size=(P, D))
    Z = solon3.encode_all(G)
    for n_liars in (4, 5, 6):
        liars = rng.choice(P, n_liars, replace=False)
        Zb = Z.copy()
        Zb[liars] = _lies(kind, Z[liars], rng)
        res = solon3.decode(Zb, D, rng=rng)
        assert not res.ok and res.total is None
        assert "more than" in res.message and "lied" in res.message


def test_erasures_cost_half_a_lie(solon3):
    """r - m = 6: two missing rows leave room to correct two liars (2 + 2·2 = 6)."""
    rng = np.random.default_rng(3)
    G = rng.normal(size=(P, D))
    Z = solon3.encode_all(G)
    present = np.ones(P, bool)
    present[[0, 7]] = False
    Z[[3, 11]] = rng.normal(size=(2, Z.shape[1]))
    res = solon3.decode(Z, D, present, rng=rng)
    assert res.ok and sorted(res.liars) == [3, 11] and res.missing == (0, 7)
    assert _rel(res.total, G.sum(axis=0)) < 1e-8
    Z[5] = 0.0  # a third liar: 2 + 2·3 > 6
    assert not solon3.decode(Z, D, present, rng=rng).ok


def test_each_worker_uses_only_its_partitions(solon3):
    rng = np.random.default_rng(4)
    G = rng.normal(size=(P, 50))
    Z = solon3.encode_all(G)
    for i in range(P):
        held = list(solon3.assignment[i])
        np.testing.assert_allclose(solon3.encode(i, G[held]), Z[i], rtol=1e-12, atol=1e-12)
        G2 = G.copy()
        G2[[j for j in range(P) if j not in held]] = rng.normal(size=(P - len(held), 50))
        np.testing.assert_allclose(solon3.encode_all(G2)[i], Z[i], rtol=1e-12, atol=1e-12)
    assert solon3.assignment == cyclic_assignment(P, 9)
    assert all(sum(j in a for a in solon3.assignment) == 9 for j in range(P))  # each partition held r times


def test_float64_messages_decode_to_rounding():
    code = PolynomialCode(P, 2, 2)
    rng = np.random.default_rng(5)
    G = rng.normal(size=(P, 64))
    Z = code.encode_all(G)
    Z[[1, 9]] = 7.0
    res = code.decode(Z, 64, rng=rng)
    assert res.ok and _rel(res.total, G.sum(axis=0)) < 1e-10


def test_draco_repetition_majority():
    code = RepetitionCode(P, 2)  # groups of 5
    assert code.r == 5 and len(code.groups) == 3
    rng = np.random.default_rng(6)
    G = rng.normal(size=(P, D))
    Z = code.encode_all(G).astype(np.float32).astype(np.float64)
    Z[[0, 1, 5, 10, 14]] = rng.normal(size=(5, D))  # at most 2 liars in each group
    res = code.decode(Z, D)
    assert res.ok and sorted(res.liars) == [0, 1, 5, 10, 14]
    assert _rel(res.total, G.sum(axis=0)) < 1e-6
    Z[2] = rng.normal(size=D)  # a third liar in group 0: no value has s+1 = 3 votes
    res = code.decode(Z, D)
    assert not res.ok and "more than 2" in res.message
    # The limit of any code of this distance: three liars who *agree* outvote two honest
    # members, and the decoder cannot tell (it returns their value).
    Z[[0, 1]] = Z[2]
    res = code.decode(Z, D)
    assert res.ok and _rel(res.total, G.sum(axis=0)) > 1e-2


def test_bounds_are_named():
    with pytest.raises(ToleranceError, match="r >= 2s \\+ m"):
        PolynomialCode(P, 3, 3, r=8)
    with pytest.raises(ToleranceError, match="P >= 2s \\+ m"):
        PolynomialCode(P, 6, 4)
    with pytest.raises(ToleranceError, match="dividing"):
        RepetitionCode(P, 3)  # 7 does not divide 15
    assert make_code("auto", P, 3).scheme == "polynomial" and make_code("auto", P, 1).scheme == "repetition"


def test_a_worker_whose_node_left_is_taken_over_by_a_new_node():
    """A SuperNode that restarts comes back under a new node id: its worker index (its
    data partitions) goes to the new node, the round names the change, the other workers
    keep theirs, and a node with no free index sits out."""
    import torch
    from flwr.app import ConfigRecord

    from fedswarm.params import ParamLayout
    from fedswarm.strategies.federated.coded import CODE, CodedStrategy
    from fedswarm.strategies.strategy_utils import RoundNotes
    from fedswarm.wire import vector_to_arrayrecord

    class Nodes:
        def __init__(self, ids):
            self.ids = list(ids)

        def get_node_ids(self):
            return list(self.ids)

    layout = ParamLayout.from_shapes([("w", (6,))])
    strategy = CodedStrategy(layout, 3, 1, scheme="repetition", name="draco")
    notes = RoundNotes()
    strategy.bind_notes(notes)
    arrays = vector_to_arrayrecord(torch.zeros(6), "w")

    def round_(grid):
        msgs = strategy.configure_train(1, arrays, ConfigRecord(), grid)
        return {m.metadata.dst_node_id: int(m.content.config_records[CODE]["worker"]) for m in msgs}

    assert round_(Nodes([5, 7, 9])) == {5: 0, 7: 1, 9: 2}
    assert notes.take()[0] == {}
    assert round_(Nodes([5, 9, 12])) == {5: 0, 12: 1, 9: 2}  # node 7 restarted as 12
    assert notes.take()[0]["workers_reassigned"] == [{"worker": 1, "from": 7, "to": 12}]
    assert round_(Nodes([5, 9, 12, 13])) == {5: 0, 12: 1, 9: 2}  # a spare: no message
    assert notes.take()[0] == {}
