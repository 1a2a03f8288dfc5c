"""Strategies sample the train fraction of the nodes connected *after* waiting for enough.

A round that starts while SuperNodes are still registering must not train on fewer nodes
than asked (CI once saw Flower's simulation engine sample 1 of 3 nodes in round 1).
"""

from __future__ import annotations

import pytest
import torch

from fedswarm.strategies.strategy_utils import sample_train_nodes, wait_for_nodes


class RegisteringGrid:
    """Nodes that register late: one is connected at the first look, all of them afterwards."""

    def __init__(self, nodes: list[int]):
        self.nodes, self.looks = nodes, 0

    def get_node_ids(self):
        self.looks += 1
        return self.nodes[:1] if self.looks == 1 else list(self.nodes)


@pytest.mark.parametrize(("fraction", "min_train", "expected"), [(1.0, 1, 3), (0.5, 1, 1), (0.34, 2, 2)])
def test_fraction_is_counted_after_the_wait(fraction, min_train, expected):
    grid = RegisteringGrid([7, 8, 9])
    sampled, available = sample_train_nodes(grid, fraction, min_train, min_available_nodes=3)
    assert sorted(available) == [7, 8, 9]
    assert len(sampled) == expected and len(set(sampled)) == expected and set(sampled) <= {7, 8, 9}


def test_wait_for_nodes_returns_once_enough_have_registered():
    grid = RegisteringGrid([9, 7, 8])
    assert wait_for_nodes(grid, 3, timeout_s=60) == [7, 8, 9]
    assert grid.looks == 2


def test_wait_for_nodes_names_how_many_came_when_time_runs_out():
    with pytest.raises(RuntimeError, match="only 1 of 3 nodes connected within 0 s"):
        wait_for_nodes(RegisteringGrid([5]), 3, timeout_s=0)


@pytest.mark.parametrize("name", ["fedavg", "dp"])
def test_fedavg_strategies_sample_after_the_wait_a_rejoining_node_included(name):
    """Flower's FedAvg counts the fraction before it waits: with 1 of 2 nodes connected at the
    round's start it samples 1 and may leave out the node that (re)joins during the wait."""
    from flwr.app import ArrayRecord, ConfigRecord

    from fedswarm.strategies.federated.dp import DPFedAvg, client_dp
    from fedswarm.strategies.federated.fedavg import CheckedFedAvg
    from fedswarm.config import RunConfig

    kwargs = dict(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=1, min_evaluate_nodes=0,
                  min_available_nodes=2)
    strategy = CheckedFedAvg(**kwargs) if name == "fedavg" else DPFedAvg(
        client_dp(RunConfig(dp="noise_multiplier=1.0", clients=2, rounds=100)), **kwargs)
    msgs = strategy.configure_train(1, ArrayRecord({"x": torch.zeros(3)}), ConfigRecord({}), RegisteringGrid([7, 8]))
    assert sorted(m.metadata.dst_node_id for m in msgs) == [7, 8]  # Flower's sampling sends 1 message
    assert all(m.content["config"]["server-round"] == 1 for m in msgs)
