"""The array engine through ``run_engine``: the store gets the rows the other engines
write, bytes are the serialized payloads, and what it cannot run fails in one line."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedswarm.config import RunConfig
from fedswarm.errors import ConfigError
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
    with pytest.raises(ConfigError, match="virtual-clock engine.*schedule=fixed"):
        check_config(_cfg("adpsgd"))  # timed by a clock
    check_config(_cfg("adpsgd", params={"schedule": "fixed"}))
    check_config(_cfg("lsgd", params={"mode": "single"}))


@pytest.mark.parametrize("name,params", [
    ("adpsgd", {"schedule": "fixed", "max_staleness": 2}),
    ("prague", {"schedule": "fixed", "group_size": 3, "max_staleness": 2}),
])
def test_fixed_schedule_iterations_match_a_numpy_oracle(name, params):
    """AD-PSGD: x_{t+1} = (pair average of x_t) − η g(x_{t−s}); Prague:
    x_{t+1} = (group average of x_t − η g(x_{t−s})), with the schedule's groups and
    staleness, re-implemented in numpy (float64) on quadratic losses g_i(x) = a_i x − b_i."""
    from fedswarm.algorithms.decentralized import make_algorithm, make_schedule
    from fedswarm.algorithms.decentralized.topology import make_topology

    n, d, lr, T = 7, 5, 0.1, 12
    rng = np.random.default_rng(0)
    a, b = rng.uniform(0.5, 2.0, (n, 1)), rng.normal(size=(n, d))
    x0 = rng.normal(size=(n, d))
    algo = make_algorithm(name, **params)
    sched = make_schedule(algo, make_topology("ring", n), seed=5)
    state = algo.init_state(torch.tensor(x0, dtype=torch.float32))
    hist = [x0.copy()]  # numpy: x_1, x_2, ...
    stale_seen = 0
    for t in range(1, T + 1):
        s = [sched.staleness(i, t) for i in range(n)]
        stale_seen += sum(v > 0 for v in s)
        points = torch.stack([algo.gradient_point(state, i, s[i]) for i in range(n)]).double()
        grads = torch.tensor(a) * points - torch.tensor(b)
        algo.local_step(state, grads.float(), lr)
        algo.mix(state, algo.message(state), sched.mixing_matrix(t))
        x = hist[-1]
        g = np.stack([a[i] * hist[max(0, len(hist) - 1 - s[i])][i] - b[i] for i in range(n)])
        y = x.copy() if name == "adpsgd" else x - lr * g
        for grp in sched.groups(t):
            y[list(grp)] = y[list(grp)].mean(axis=0)
        hist.append(y - lr * g if name == "adpsgd" else y)
        np.testing.assert_allclose(state.x.numpy(), hist[-1], atol=1e-5, rtol=0)
    assert stale_seen > 0

