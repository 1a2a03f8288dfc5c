"""The batched engine serves the Count-Sketch strategies (sketched_sgd, fetchsgd, gs_sgd):
every round's global model equals the in-process engine's to 1e-5 (same seed and config),
bytes up equal to the byte (both exchanges of a two-phase round, per node too), for each
with its default settings and with another sketch, k or second exchange."""

import pytest

from fedswarm.config import RunConfig
from fedswarm.errors import ConfigError
from tests.test_batched import same_models_on_both_engines

BASE = dict(clients=10, rounds=3, local_steps=2, fraction=0.6, lr=0.1)
CASES = {
    "sketched-default": dict(strategy="sketched_sgd"),
    "sketched-k-momentum": dict(strategy="sketched_sgd", params={"density": 0.02, "rows": 3, "cols": 400,
                                                                  "momentum": 0.5, "candidates": 2}),
    "fetchsgd-default": dict(strategy="fetchsgd"),
    "fetchsgd-sketch": dict(strategy="fetchsgd", params={"density": 0.01, "rows": 3, "cols": 300,
                                                         "momentum": 0.5, "server_lr": 0.5}),
    "gs-default": dict(strategy="gs_sgd"),
    "gs-estimates": dict(strategy="gs_sgd", params={"density": 0.02, "cols": 600, "exact_values": False}),
    "gs-all-clients": dict(strategy="gs_sgd", clients=6, fraction=1.0, params={"density": 0.01, "rows": 7}),
}


def _node_bytes(db) -> dict:
    """Every node's bytes up and examples, per round, from a run's store."""
    from fedswarm.store import Store

    store = Store(db)
    try:
        (run,) = store.list_runs()
        return {(r.round, r.node_id): (r.bytes_up, r.num_examples) for r in store.node_rounds(run.id)}
    finally:
        store.close()


@pytest.mark.parametrize("case", sorted(CASES))
def test_batched_serves_sketch_strategies(case, tmp_path, monkeypatch):
    kw = {**BASE, **CASES[case]}
    ref_res, got_res, pairs = same_models_on_both_engines(kw, tmp_path, monkeypatch)
    for r_ref, r_got in pairs:
        assert r_got["num_clients"] == r_ref["num_clients"]
        assert r_got["train_loss"] == pytest.approx(r_ref["train_loss"], abs=1e-5)
        assert r_got["bytes_up"] == r_ref["bytes_up"]
        assert r_got.get("rejected") == r_ref.get("rejected") == 0
        # The train config names the engine ('batched' is 2 bytes shorter than 'inprocess'),
        # and each sync record carries a CRC-32 of the model (1 to 5 bytes as a varint).
        extra = r_ref["bytes_down"] - r_got["bytes_down"] - 2 * r_ref["num_clients"]
        assert abs(extra) <= 4 * r_ref["num_clients"], extra
    nodes = _node_bytes(tmp_path / "batched.db")
    assert len(nodes) == sum(r["num_clients"] for r in got_res["rounds"][1:])
    assert nodes == _node_bytes(tmp_path / "inprocess.db")


def test_a_second_exchange_is_counted(tmp_path, monkeypatch):
    """Sketched-SGD's round costs its second reply: p2·k float32 values per client more
    than FetchSGD's one sketch per client, on the batched engine as on the in-process one."""
    kw = {**BASE, "rounds": 1, "params": {"density": 0.01, "rows": 3, "cols": 200}}
    (tmp_path / "f").mkdir()
    (tmp_path / "s").mkdir()
    _, one, _ = same_models_on_both_engines({**kw, "strategy": "fetchsgd"}, tmp_path / "f", monkeypatch)
    _, two, _ = same_models_on_both_engines({**kw, "strategy": "sketched_sgd"}, tmp_path / "s", monkeypatch)
    k = -(-4810 // 100)  # ceil(0.01 · d), digits-mlp
    per_client = (two["rounds"][1]["bytes_up"] - one["rounds"][1]["bytes_up"]) / two["rounds"][1]["num_clients"]
    assert 4 * 4 * k < per_client < 4 * 4 * k + 500  # the values, and a reply's framing (ids, metadata)


def test_sketch_strategies_refuse_byzantine_in_one_line():
    from fedswarm.sim.batched import check_supported

    for name in ("sketched_sgd", "fetchsgd", "gs_sgd"):
        check_supported(RunConfig(engine="batched", strategy=name))  # served
        with pytest.raises(ConfigError, match="--engine inprocess") as exc:
            check_supported(RunConfig(engine="batched", strategy=name, byzantine=1))
        assert "\n" not in str(exc.value)


def test_chunks_of_one_client_give_the_same_models(tmp_path, monkeypatch):
    """The client axis cut into chunks (here of one client each): per-chunk sketches and
    state steps, the same models and bytes as in-process."""
    from fedswarm.sim.batched_trainer import BatchedTrainer

    monkeypatch.setattr(BatchedTrainer, "bytes_per_client", lambda self, *a: 2**62)
    kw = {**BASE, "strategy": "sketched_sgd", "params": {"density": 0.01, "momentum": 0.5}}
    _, _, pairs = same_models_on_both_engines(kw, tmp_path, monkeypatch)
    assert all(r_got["bytes_up"] == r_ref["bytes_up"] for r_ref, r_got in pairs)
