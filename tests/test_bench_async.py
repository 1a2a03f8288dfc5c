"""`fedswarm bench async --quick`: the JSON's shape and what its figures are made of."""

from __future__ import annotations

import json


def test_bench_async_quick_writes_its_figures(tmp_path):
    from fedswarm.bench import async_fedbuff

    rows = async_fedbuff.run(tmp_path, quick=True)
    data = json.loads((tmp_path / "async.json").read_text())
    assert (tmp_path / "async.png").stat().st_size > 0
    assert data["target"] == async_fedbuff.TARGET and data["rows"] == rows
    arms = [r["arm"] for r in data["summary"]]
    assert arms[:2] == ["fedavg (sync)", "fedbuff"]
    assert [r["section"] for r in data["summary"]][0] == "always available"
    assert {r["section"] for r in rows} == set(data["sections"])
    # the same number of client updates for every arm where every node is always there, on simulated time
    assert len({r["client_updates"] for r in rows if r["section"] == "always available"}) == 1
    for r in rows:  # every arm stops after the first round whose folded updates reach the budget
        assert len(r["curve_t"]) == len(r["curve_acc"]) == len(r["curve_updates"]) == r["rounds"] <= data["max_rounds"]
        assert r["curve_updates"][-1] == r["client_updates"] >= data["budget"] > ([0] + r["curve_updates"])[-2]
        assert r["curve_t"] == sorted(r["curve_t"]) and r["sim_time_s"] == r["curve_t"][-1] > 0
        assert 0 <= r["final_acc"] <= 1
    for sync in (r for r in data["summary"] if r["arm"] == "fedavg (sync)"):  # each section's reference
        assert sync["acc_points_vs_sync"] == 0
    # an arm left out says why
    assert all(isinstance(m, str) and ":" in m for m in data["left_out"])
