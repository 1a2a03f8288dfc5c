"""``fedswarm bench engines``'s scale section: the evaluated run's own share of federated evaluation."""

from __future__ import annotations

import pytest

from fedswarm.bench.engines_scale import BASE, _cell, _ratios, _steady


def test_steady_figures_and_the_in_run_ratio_against_hand_arithmetic():
    cell = _steady({"walls": [9.0, 2.0, 4.0, 3.0], "cpu": [1.0, 0.5, 0.6, 0.4], "eval_cpu": [0.5, 0.1, 0.2, 0.1]})
    assert cell["steady_round_s"] == 3.0 and cell["steady_cpu_s"] == 0.5  # the first round left out
    # steady rounds: 0.5 / 0.4, 0.6 / 0.4, 0.4 / 0.3 -> the median 4/3
    assert cell["steady_x_without_fed_eval"] == pytest.approx(4 / 3)
    assert "steady_x_without_fed_eval" not in _steady({"cpu": [1.0, 0.5], "eval_cpu": []})
    rows = [{"row": "now", "cpu_s_per_round": 0.5},
            {"row": "now + fed eval", "cpu_s_per_round": 0.6,
             "runs": [cell, {"steady_x_without_fed_eval": 1.1}, {"steady_x_without_fed_eval": 1.2}]}]
    _ratios(rows)
    assert rows[1]["cpu_x_without_fed_eval"] == pytest.approx(1.2)
    assert rows[1]["cpu_x_without_fed_eval_in_run"] == pytest.approx(1.2)  # median of 4/3, 1.1, 1.2


@pytest.mark.slow  # a fresh interpreter running the engine (~6 s, more on a loaded machine)
def test_a_cell_times_each_rounds_federated_evaluation_and_only_then():
    cell = _cell(dict(BASE, clients=40, rounds=2, eval_every=2), None, timeout_s=120)  # evaluated: round 2 only
    assert cell["status"] == "finished", cell
    assert len(cell["cpu"]) == 2 and len(cell["eval_cpu"]) == 1
    assert 0 < cell["eval_cpu"][0] < cell["cpu"][1]
    assert "steady_x_without_fed_eval" not in cell  # not every round evaluated: no per-round share
