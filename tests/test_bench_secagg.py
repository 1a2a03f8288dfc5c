"""``fedswarm bench secagg`` at tiny sizes: the JSON's shape, and that fedswarm's and Flower's
SecAgg+ both ran a round whose result is the true mean of the survivors' updates."""

from __future__ import annotations

import json

import pytest

from fedswarm.bench import secagg


def test_bench_secagg_tiny(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDSWARM_SECAGG_GRID", "10:300")
    rows = secagg.run(tmp_path, quick=True)
    data = json.loads((tmp_path / "secagg.json").read_text())
    assert (tmp_path / "secagg.png").stat().st_size > 0
    assert data["rows"] == rows and data["meta"]["grid"] == [[10, 300]]
    arms = {r["arm"]: r for r in rows}
    assert set(arms) == {"fedswarm", "flower", "fedswarm-plain", "flower-plain"}
    for name in ("fedswarm", "flower"):
        r = arms[name]
        assert r["dropped"] == 1 and r["threshold"] >= 2
        # both protocols ran all four stages on the nodes and recovered the survivors' mean
        assert set(r["stage_cpu_s"]) == {"0", "1", "2", "3"}
        assert r["max_error"] < 1e-4, r
        assert r["bytes_up_per_node"] > 300 * 4 * 0.5 and r["round_s"] > 0 and r["round_cpu_s"] > 0
        # the round's CPU splits into the nodes', the transport's and the server's
        assert r["client_cpu_s"] + r["wire_cpu_s"] + r["server_cpu_s"] == pytest.approx(r["round_cpu_s"], abs=1e-3)
    for name in ("fedswarm-plain", "flower-plain"):
        assert arms[name]["dropped"] == 0 and arms[name]["max_error"] < 1e-6
    fs = arms["fedswarm"]
    for key in ("speedup_vs_flower", "speedup_vs_flower_cpu", "mask_over_serialize", "overhead_time_x",
                "overhead_bytes_x", "aes_floor_over_serialize", "aes_ctr_gb_per_s"):
        assert fs[key] is not None and fs[key] > 0, key
    # the masking figure is quantize + masked-input over serialization, its keystream k + 1 masks of d + 1 words
    assert fs["mask_node_s"] == pytest.approx(fs["encode_node_s"] + fs["masked_input_node_s"], abs=1e-6)
    assert fs["mask_over_serialize"] == pytest.approx(fs["mask_node_s"] / fs["serialize_node_s"], rel=0.02)
    assert fs["keystream_bytes_per_node"] == (fs["degree"] + 1) * 4 * 301


def test_bench_secagg_before_must_be_a_checkout(tmp_path):
    from fedswarm.bench.secagg_cost import mask_cost_before_after

    with pytest.raises(SystemExit, match="not a fedswarm checkout"):
        mask_cost_before_after(10, 300, tmp_path)
