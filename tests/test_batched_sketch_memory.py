"""The batched engine keeps the Count-Sketch clients' memories as arrays (SketchRows), only for
the clients that trained, and the run's memory estimate counts exactly those arrays."""

import numpy as np
import pytest
import torch

from fedswarm.config import RunConfig
from fedswarm.sim.batched_sketched import SketchRounds, SketchRows
from fedswarm.strategies.federated.sketched import SKETCH_CLIENTS

D = 4810  # digits-mlp: 64 -> 64 -> 10


def _run(tmp_path, monkeypatch, **kw) -> tuple[SketchRounds, set[int]]:
    """Run a batched sketch run; its round runner (its SketchRows) and the partition ids that trained."""
    from fedswarm.sim.run import run_engine
    from fedswarm.store import Store

    made: list[SketchRounds] = []
    init = SketchRounds.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(SketchRounds, "__init__", spy)
    cfg = RunConfig(engine="batched", local_steps=1, lr=0.1, **kw)
    store = Store(tmp_path / "run.db")
    try:
        rid = store.create_run(cfg.model_dump())
        assert run_engine(cfg, store=store, run_id=rid) == "finished"
        trained = {int(r.node_id) - 1 for r in store.node_rounds(rid)}
    finally:
        store.close()
    (runner,) = made
    return runner, trained


def _held_bytes(rows: SketchRows) -> int:
    """The bytes of the rows written (clients with state) and of the arrays over the population."""
    written = sum(len(r) * r.d * r._rows.element_size() + r._slot.nbytes
                  for r in (rows.error, rows.momentum, rows.sent_idx) if r is not None)
    return written + (rows.sent_round.nbytes if rows.sent_round is not None else 0)


@pytest.mark.parametrize("name", ["sketched_sgd", "gs_sgd"])
def test_memories_are_held_only_for_the_clients_that_trained(name, tmp_path, monkeypatch):
    runner, trained = _run(tmp_path, monkeypatch, strategy=name, clients=30, fraction=0.2, rounds=2)
    rows = runner.memory
    assert 0 < len(trained) < 30
    assert len(rows) == len(trained) and set(rows.error) == trained
    if rows.momentum is not None:
        assert set(rows.momentum) == trained
    assert set(rows.sent_idx) == trained  # every one answered the second exchange
    assert rows.error._rows.shape[0] < 2 * max(len(trained), 16)  # capacity: rows grow by doubling
    # the clients that trained: a memory that moved, their last sketch's round; the rest read as the
    # ClientApp starts (zero memories, no sketch sent, nothing the server used)
    assert bool((rows.state(sorted(trained)).error != 0).any(dim=1).all())
    assert set(np.flatnonzero(rows.sent_round >= 0).tolist()) == trained
    rest = sorted(set(range(30)) - trained)
    state = rows.state(rest)
    assert torch.equal(state.error, torch.zeros(len(rest), D))
    assert state.momentum is None or torch.equal(state.momentum, torch.zeros(len(rest), D))
    assert rows.taken(rest, [None] * len(rest)) is None
    from flwr.app import ConfigRecord

    stale = ConfigRecord({"round": 1, "indices": np.arange(5, dtype="<i4").tobytes()})  # about a sketch never sent
    assert rows.taken(rest, [stale] * len(rest)) is None


def test_fetchsgd_clients_keep_nothing(tmp_path, monkeypatch):
    runner, trained = _run(tmp_path, monkeypatch, strategy="fetchsgd", clients=12, fraction=0.5, rounds=2)
    assert trained and len(runner.memory) == 0 and runner.memory.nbytes() == 0


@pytest.mark.parametrize("name,params", [("sketched_sgd", {"candidates": 2, "density": 0.01}),
                                         ("gs_sgd", {"exact_values": False}), ("fetchsgd", {})])
def test_the_memory_estimate_counts_the_arrays_held(name, params, tmp_path, monkeypatch):
    """Every client trains (fraction 1): the estimate's client state is the arrays' bytes, exactly."""
    from fedswarm.sim.batched import memory_estimate

    kw = dict(strategy=name, clients=8, fraction=1.0, rounds=1, params=params)
    runner, trained = _run(tmp_path, monkeypatch, **kw)
    assert len(trained) == 8
    est = memory_estimate(RunConfig(engine="batched", local_steps=1, lr=0.1, **kw), available=10**12)
    assert est.parts["client state"] == _held_bytes(runner.memory)
    if SKETCH_CLIENTS[name].error_key is not None:
        assert est.parts["client state"] > 8 * 4 * D  # at least each client's error row


def test_a_million_client_sketch_run_is_sized_and_refused_with_the_fraction_that_fits():
    from fedswarm.errors import ConfigError
    from fedswarm.sim.batched import check_memory, memory_estimate

    cfg = RunConfig(engine="batched", task="digits-mlp", strategy="sketched_sgd", clients=1_000_000, fraction=0.05,
                    rounds=4, local_steps=1)
    est = memory_estimate(cfg, available=10**12)
    k = -(-D // 1000)  # density 0.001
    per_client = 4 * D * 2 + 4 * 4 * k  # v and u, and the 4k candidates it answered
    assert est.parts["client state"] == 200_000 * per_client + 1_000_000 * 16
    with pytest.raises(ConfigError, match=r"client state.*it fits with --fraction ") as e:
        check_memory(cfg, available=5 * 10**9)
    frac = float(str(e.value).split("--fraction ")[1].rstrip("."))
    assert memory_estimate(cfg.model_copy(update={"fraction": frac}), available=5 * 10**9).fits()
