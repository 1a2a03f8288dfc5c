"""The cohort's draws as arrays: the one sampling of every engine (sample_positions) and the
per-node bytes of a cohort held as arrays (CohortBytes)."""

from __future__ import annotations

import random
from collections import defaultdict

import numpy as np
import pytest

from fedswarm.algorithms.selection.cohort import sample_positions
from fedswarm.server.metered_grid import Traffic
from fedswarm.sim.batched_round import CohortBytes, add_client, add_clients, cohort_nodes
from fedswarm.strategies.strategy_utils import sample_train_nodes


@pytest.mark.parametrize(("n", "k"), [(10, 0), (10, 3), (10, 10), (100_000, 100_000), (1_000_000, 10_000)])
def test_sample_positions_are_distinct_in_range_and_move_random_by_one_word(n, k):
    random.seed(7)
    pos = sample_positions(n, k)
    after = random.random()
    random.seed(7)
    word = random.getrandbits(64)
    assert after == random.random()  # exactly one 64-bit word taken from the random module, whatever n and k
    assert pos.dtype == np.int64 and pos.shape == (k,)
    assert len(np.unique(pos)) == k and (k == 0 or (pos.min() >= 0 and pos.max() < n))
    if k:  # the definition: numpy's choice without replacement, seeded with that word
        want = np.random.default_rng(word).choice(n, size=k, replace=False)
        assert np.array_equal(pos, want)


def test_sample_positions_is_the_same_for_a_seed_and_differs_between_seeds():
    draws = []
    for seed in (1, 1, 2):
        random.seed(seed)
        draws.append([sample_positions(1000, 50).tolist() for _ in range(3)])
    assert draws[0] == draws[1]
    assert draws[0] != draws[2]
    assert draws[0][0] != draws[0][1]  # successive rounds draw different cohorts


def test_sample_positions_refuses_more_than_the_population():
    with pytest.raises(ValueError, match="cannot draw 11 distinct positions out of 10"):
        sample_positions(10, 11)


class Grid:
    def __init__(self, ids):
        self.ids = ids

    def get_node_ids(self):
        return list(self.ids)


def test_strategies_sample_the_nodes_at_the_drawn_positions():
    """What the batched engine's FedAvg round relies on: the in-process strategy's nodes are
    the connected nodes at sample_positions' positions (node ids 1..N: positions + 1)."""
    nodes = list(range(1, 201))
    random.seed(3)
    got = [sample_train_nodes(Grid(nodes), 0.1, 1, 200)[0] for _ in range(3)]
    random.seed(3)
    want = [(sample_positions(200, 20) + 1).tolist() for _ in range(3)]
    assert got == want


def test_cohort_bytes_are_the_dict_add_client_builds():
    ids = np.array([5, 3, 9, 3], dtype=np.int64)  # node 3 twice: its bytes add up
    up, down = np.array([10, 20, 30, 40]), np.array([1, 2, 3, 4])
    want = Traffic()
    for node, u, d in zip(ids.tolist(), up.tolist(), down.tolist()):
        add_client(want, None, node, u, d, 1, 0.0, "c", {})
    got = Traffic()
    add_clients(got, ids, up, down)
    assert isinstance(got.node_up, CohortBytes)
    assert cohort_nodes(got.node_down).tolist() == [3, 5, 9]  # read without building the dict
    assert got.node_up._dict is None
    assert (got.bytes_up, got.bytes_down) == (want.bytes_up, want.bytes_down)
    assert dict(got.node_up) == dict(want.node_up) and dict(got.node_down) == dict(want.node_down)
    assert len(got.node_up) == 3 and got.node_up.get(4, 0) == 0
    got.node_up[3] += 1  # a later client's bytes go on top, as into a defaultdict(int)
    got.node_up[11] += 2
    assert got.node_up[3] == 61 and got.node_up[11] == 2
    assert cohort_nodes(got.node_up).tolist() == [3, 5, 9, 11]
    assert cohort_nodes(defaultdict(int, {4: 1, 2: 1})).tolist() == [2, 4]


def test_gtopk_rows_read_back_what_was_kept_and_the_empty_state_for_the_rest():
    import torch

    from fedswarm.sim.batched_gtopk import GTopKRows
    from fedswarm.strategies.federated.gtopk import GTopKClientState

    rows = GTopKRows(d=5, population=10)
    fresh = rows.state([3, 7])
    empty = GTopKClientState.empty(5)
    assert torch.equal(fresh.acc, torch.cat([empty.acc, empty.acc]))
    assert fresh.sent_round == (None, None) and fresh.sent_idx == (None, None)
    kept = GTopKClientState(torch.arange(10, dtype=torch.float32).view(2, 5), (4, 4),
                            (torch.tensor([0, 2]), torch.tensor([1, 3])))
    rows.keep([7, 2], kept)
    got = rows.state([2, 5, 7])
    assert torch.equal(got.acc, torch.stack([kept.acc[1], torch.zeros(5), kept.acc[0]]))
    assert got.sent_round == (4, None, 4)
    assert got.sent_idx[0].tolist() == [1, 3] and got.sent_idx[1] is None and got.sent_idx[2].tolist() == [0, 2]
    assert rows.nbytes() < 10 * 8 + 2 * (4 * 5 + 8 * 2) + 16 * (4 * 5 + 8 * 2)  # slots, rounds, rows (capacity 16)
    with pytest.raises(ValueError, match="3 indices a client, the run's clients send 2"):
        rows.keep([1], GTopKClientState(torch.zeros(1, 5), (5,), (torch.tensor([0, 1, 2]),)))
