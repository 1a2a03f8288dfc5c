"""The array engine through ``run_engine``: the store gets the rows the other engines
write, bytes are the serialized payloads, and what it cannot run fails in one line."""

from __future__ import annotations

import pytest
import torch

from fedswarm.config import ConfigError, RunConfig
from fedswarm.sim.array_engine import ArraySimulation, check_config, payload_nbytes
from fedswarm.sim.run import run_engine
from fedswarm.store import Store

torch.set_num_threads(1)


def _cfg(strategy: str, **kw) -> RunConfig:
    base = dict(strategy=strategy, task="digits-mlp", clients=6, rounds=3, lr=0.1, batch_size=8, seed=1,
                local_steps=1, engine="array")
    base.update(kw)
    return RunConfig(**base)


@pytest.mark.parametrize("strategy,kw", [
    ("squarm", {"params": {"period": 2, "ratio": 0.05}}),
    ("lsgd", {"params": {"mode": "async", "tau_local": 2, "tau_global": 3}, "topology": "complete"}),
])
def test_array_engine_records_like_the_other_engines(tmp_path, strategy, kw):
    cfg = _cfg(strategy, **kw)
    store = Store(tmp_path / "a.db")
    run_id = store.create_run(cfg.model_dump())
    assert run_engine(cfg, store=store, run_id=run_id) == "finished"
    result = store.export_result(run_id)
    rounds = result["rounds"]
    assert [r["round"] for r in rounds] == [0, 1, 2, 3]
    assert rounds[0]["consensus_distance"] is None
    for r in rounds[1:]:
        assert 0.0 <= r["test_accuracy"] <= 1.0 and r["consensus_distance"] > 0
        assert r["bytes_up"] == r["bytes_down"] == r["p2p_bytes"]
        assert r["num_clients"] == cfg.clients
    assert store.get_run(run_id).status == "finished"
    if strategy == "squarm":  # bytes only on the sync round (2), each a real serialized codec payload
        sim = ArraySimulation(cfg)
        sim.step()
        sim.step()
        expected = sum(payload_nbytes(sim.algo.payload(sim.state, i)) * 2 for i in range(cfg.clients))
        assert [r["bytes_up"] for r in rounds[1:]][1] == expected
        assert rounds[1]["bytes_up"] < rounds[2]["bytes_up"]  # round 1 sends only 'skip' messages
        assert rounds[2]["bytes_up"] < cfg.clients * 2 * 4 * 4810 / 4  # far below dense models


def test_array_engine_refuses_what_it_cannot_run():
    with pytest.raises(ConfigError, match="array engine runs"):
        check_config(_cfg("fedavg"))
    with pytest.raises(ConfigError, match="D²"):
        check_config(_cfg("d2", topology="ring"))
    with pytest.raises(ConfigError, match="array engine runs"):
        check_config(_cfg("adpsgd"))
    check_config(_cfg("lsgd", params={"mode": "single"}))
