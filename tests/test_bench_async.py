"""`fedswarm bench async --quick`: the JSON's shape and what its figures are made of."""

from __future__ import annotations

import json

import pytest


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


def test_summary_spreads_are_the_seeds_and_the_paired_differences_by_hand():
    """Two seeds: sync 0.90, 0.94; FedBuff 0.89, 0.95 (differences -1 and +1 points). By hand:
    FedBuff's mean 0.92 with std sqrt(2 * 0.03^2) = 0.0424, -0.00 points against sync with paired
    std sqrt(2) = 1.414 (the unpaired spreads would not say that)."""
    from fedswarm.bench.async_fedbuff import _summarize

    def row(arm, seed, acc):
        return {"section": "s", "arm": arm, "seed": seed, "final_acc": acc, "time_to_target_s": 1.0,
                "client_updates": 4, "sim_time_s": 2.0}

    rows = [row("fedavg (sync)", 0, 0.90), row("fedavg (sync)", 1, 0.94), row("fedbuff", 1, 0.95),
            row("fedbuff", 0, 0.89)]
    sync, buff = _summarize(rows)
    assert sync["final_acc_std"] == pytest.approx(0.02 * 2 ** 0.5) and sync["acc_points_vs_sync_std"] == 0
    assert buff["final_acc"] == pytest.approx(0.92) and buff["final_acc_std"] == pytest.approx(0.03 * 2 ** 0.5)
    assert buff["acc_points_vs_sync"] == pytest.approx(0.0, abs=1e-9)
    assert buff["acc_points_vs_sync_std"] == pytest.approx(2 ** 0.5)


def test_seeds_and_arms_from_the_environment(monkeypatch):
    from fedswarm.bench.async_fedbuff import _arms_from_env, arms, seeds_from_env

    assert seeds_from_env([0, 1, 2]) == [0, 1, 2]
    monkeypatch.setenv("FEDSWARM_ASYNC_SEEDS", "3-6")
    assert seeds_from_env([0]) == [3, 4, 5, 6]
    monkeypatch.setenv("FEDSWARM_ASYNC_SEEDS", "0,7")
    assert seeds_from_env([0]) == [0, 7]
    for bad in ("x", "5-", "-1,2"):
        monkeypatch.setenv("FEDSWARM_ASYNC_SEEDS", bad)
        with pytest.raises(SystemExit, match="FEDSWARM_ASYNC_SEEDS"):
            seeds_from_env([0])
    options, _ = arms(quick=True)
    monkeypatch.setenv("FEDSWARM_ASYNC_ARMS", "fedbuff")
    assert list(_arms_from_env(options)) == ["fedavg (sync)", "fedbuff"]
    monkeypatch.setenv("FEDSWARM_ASYNC_ARMS", "fedbuf")
    with pytest.raises(SystemExit, match="no arm 'fedbuf'"):
        _arms_from_env(options)


def test_server_learning_rate_sweep_from_the_environment(monkeypatch):
    """FEDSWARM_ASYNC_SERVER_LRS adds one FedBuff arm per rate (at the main arm's concurrency), kept by
    FEDSWARM_ASYNC_ARMS; a bad value is refused naming the variable; the main arm runs at SERVER_LR."""
    from fedswarm.bench.async_fedbuff import SERVER_LR, _arms_from_env, arms

    options, _ = arms(quick=True)
    assert options["fedbuff"]["params"]["server_lr"] == SERVER_LR
    assert not any(name.startswith("fedbuff (server_lr") for name in options)
    monkeypatch.setenv("FEDSWARM_ASYNC_SERVER_LRS", "1,2.5")
    options, _ = arms(quick=True)
    sweep = {k: v["params"] for k, v in options.items() if k.startswith("fedbuff (server_lr")}
    main = options["fedbuff"]["params"]
    assert sweep == {"fedbuff (server_lr 1)": {**main, "server_lr": 1.0},
                     "fedbuff (server_lr 2.5)": {**main, "server_lr": 2.5}}
    monkeypatch.setenv("FEDSWARM_ASYNC_ARMS", "fedbuff")
    assert list(_arms_from_env(options)) == ["fedavg (sync)", "fedbuff", "fedbuff (server_lr 1)",
                                             "fedbuff (server_lr 2.5)"]
    for bad in ("x", "0", "1,-2", "inf"):
        monkeypatch.setenv("FEDSWARM_ASYNC_SERVER_LRS", bad)
        with pytest.raises(SystemExit, match="FEDSWARM_ASYNC_SERVER_LRS"):
            arms(quick=True)
