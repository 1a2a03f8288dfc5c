"""The batched engine's cohort sharded across workers (fedswarm.sim.batched_ray), without Ray:
the in-process pool runs the same workers and the same reduction as the Ray actors, so the
sharded runs must give the single-process models (to 1e-5) and bytes (to the byte); the shard
assignment is checked against a loop, client state against where its client lives, and the
refusals and the absence of Ray without --ray-address."""

import subprocess
import sys

import numpy as np
import pytest
import torch

from fedswarm.config import RunConfig
from fedswarm.errors import ConfigError
from tests.test_batched import _models, _schedule, _trainer

BASE = dict(clients=10, rounds=3, local_steps=2, fraction=0.6, lr=0.1)
CASES = {
    "fedavg": dict(strategy="fedavg"),
    "fedavg-one-step": dict(strategy="fedavg", clients=12, local_steps=1, fraction=0.5),
    # no per-client losses: each shard's examples grouped by weight (the path of rounds too large for node rows)
    "fedavg-grouped": dict(strategy="fedavg", clients=12, local_steps=1, fraction=0.5, grouped=True),
    "topk-ef": dict(strategy="compressed_fedavg", params={"codec": "topk", "codec_params": "ratio=0.1"}),
    "median": dict(strategy="median", clients=9, fraction=1.0),  # a robust rule: every vector gathered
    # --byzantine on the driver: the gathered replies rewritten by the attack, then the robust rule
    "median-signflip": dict(strategy="median", clients=9, fraction=1.0, byzantine=2),
    # a data attack: the chosen clients train on flipped labels on the workers that own them
    "krum-labelflip": dict(strategy="krum", clients=9, fraction=1.0, byzantine=2, attack="labelflip"),
    # --dp: the workers clip and count, the driver noises the summed clipped changes (adaptive: the counts steer it)
    "fedavg-dp-adaptive": dict(strategy="fedavg", dp="noise_multiplier=0.5,clip=0.3,adaptive=true"),
    # the clients clip before they compress (on the workers), the strategy object noises (on the driver)
    "topk-dp": dict(strategy="compressed_fedavg", params={"codec": "topk", "codec_params": "ratio=0.1"},
                    dp="noise_multiplier=0.5,clip=0.02,adaptive=true"),
    # gTop-k: the selection the server sent each client goes to the worker that keeps its accumulator
    "gtopk": dict(strategy="gtopk", rounds=4),
    "fetchsgd": dict(strategy="fetchsgd"),
    "fetchsgd-3-workers": dict(strategy="fetchsgd", workers=3, clients=11, fraction=0.8),
    # --secagg: the driver's secure sum of the payloads the shards sent back (sim/batched_secagg_codec.py)
    "randk-secagg": dict(strategy="compressed_fedavg", secagg=True,
                         params={"codec": "randk", "codec_params": "ratio=0.1"}),
    "fetchsgd-secagg": dict(strategy="fetchsgd", secagg=True),
}


def local_pools(monkeypatch) -> list:
    """Make --ray-address runs use in-process pools; returns the pools made, in order."""
    import fedswarm.sim.batched_ray as batched_ray

    made = []

    def pool(cfg, workers, **kw):
        made.append(batched_ray.LocalPool(workers, **kw))
        return made[-1]

    monkeypatch.setattr(batched_ray, "RayPool", pool)
    return made


@pytest.mark.parametrize("case", sorted(CASES))
def test_sharded_runs_give_the_single_process_models(case, tmp_path, monkeypatch):
    kw = {**BASE, **CASES[case]}
    workers = kw.pop("workers", 2)
    if kw.pop("grouped", False):
        import fedswarm.sim.batched as batched

        monkeypatch.setattr(batched, "NODE_ROWS_MAX", 0)
    pools = local_pools(monkeypatch)
    for sub in ("one", "sharded"):  # both runs are the batched engine's: a store each
        (tmp_path / sub).mkdir()
    ref, ref_res = _models(RunConfig(engine="batched", **kw), tmp_path / "one", monkeypatch)
    got, got_res = _models(RunConfig(engine="batched", ray_address="127.0.0.1:1", workers=workers, **kw),
                           tmp_path / "sharded", monkeypatch)
    assert len(pools) == 1 and pools[0].workers == workers
    assert len(got) == len(ref) == kw["rounds"] + 1
    for rnd, (a, b) in enumerate(zip(ref, got)):
        assert torch.allclose(a, b, atol=1e-5, rtol=0), f"round {rnd}: max diff {(a - b).abs().max():.3g}"
    assert not torch.equal(ref[0], ref[-1])  # training moved the model
    per_client = set()
    for r_ref, r_got in zip(ref_res["rounds"][1:], got_res["rounds"][1:]):
        assert r_got["num_clients"] == r_ref["num_clients"]
        assert r_got["bytes_up"] == r_ref["bytes_up"]
        # every train message carries the run's config, here with ray_address and workers: the same
        # few bytes more per message, nothing else differs
        per_client.add((r_got["bytes_down"] - r_ref["bytes_down"]) / r_ref["num_clients"])
        assert r_got["train_loss"] == pytest.approx(r_ref["train_loss"], abs=1e-5)
        # the model went out to the workers, their sums or payloads came back
        assert r_got["shard_bytes_out"] > 4 * ref[0].numel() and r_got["shard_bytes_in"] > 0
        assert r_got["shard_wait_s"] >= r_got["shard_compute_s"] > 0
        # federated evaluation: each worker scored the clients it owns (their arrays came back)
        assert r_ref["fed_examples"] > 0 and r_got["fed_examples"] == r_ref["fed_examples"]
        for key in ("fed_loss", "fed_accuracy"):
            assert r_got[key] == pytest.approx(r_ref[key], abs=1e-6), key
        assert r_got["eval_shard_bytes_in"] > 0 and "eval_shard_bytes_in" not in r_ref
    assert len(per_client) == 1 and 10 < per_client.pop() < 60
    ref_nodes, got_nodes = (_fed_by_node(tmp_path / sub / "batched.db") for sub in ("one", "sharded"))
    assert got_nodes.keys() == ref_nodes.keys()
    for key, values in ref_nodes.items():  # each node's own scores, where node rows are kept
        assert got_nodes[key] == pytest.approx(values, abs=1e-6), key


def _fed_by_node(db) -> dict:
    """(round, node) -> (fed_loss, fed_accuracy) of every node row of the store's one run."""
    from fedswarm.store import Store

    store = Store(db)
    try:
        return {(n.round, n.node_id): (n.fed_loss, n.fed_accuracy) for n in store.node_rounds(store.list_runs()[0].id)
                if n.fed_loss is not None}
    finally:
        store.close()


def test_client_state_stays_on_the_worker_that_owns_the_client(tmp_path):
    """Error-feedback residuals of top-k: each worker holds those of its clients (p mod 2) only,
    and every client that trained has one, on its worker."""
    from fedswarm.sim.batched_ray import LocalPool, run_batched_ray
    from fedswarm.store import Store

    cfg = RunConfig(engine="batched", strategy="compressed_fedavg", clients=9, rounds=3, local_steps=1,
                    fraction=0.6, params={"codec": "topk", "codec_params": "ratio=0.1"})
    pool = LocalPool(2)
    store = Store(tmp_path / "s.db")
    try:
        rid = store.create_run(cfg.model_dump())
        assert run_batched_ray(cfg, store=store, run_id=rid, pool=pool) == "finished"
        trained = {int(n.node_id) - 1 for n in store.node_rounds(rid)}
    finally:
        store.close()
    held = [set(w._half.residuals) for w in pool.members]
    assert held[0] and held[1]
    assert all(p % 2 == 0 for p in held[0]) and all(p % 2 == 1 for p in held[1])
    assert held[0] | held[1] == trained
    assert all(bool(w._half.residuals[p].abs().sum() > 0) for w in pool.members for p in w._half.residuals)


def test_shards_are_the_cohort_split_by_owner():
    from fedswarm.sim.batched_ray import owner_of, shard_positions

    rng = np.random.default_rng(0)
    for workers in (1, 2, 3, 7):
        cohort = rng.choice(1000, size=50, replace=False)
        shards = shard_positions(cohort, workers)
        expect = [[i for i, p in enumerate(cohort.tolist()) if p % workers == w] for w in range(workers)]
        assert [s.tolist() for s in shards] == expect
        # sticky: a client's worker is the same whatever cohort it is sampled in
        assert owner_of(cohort, workers).tolist() == owner_of(cohort[::-1], workers)[::-1].tolist()


def test_sharded_average_reduces_to_one_trainers_average():
    """FedAvg's numerator over two shards, a client diverging in one: the same sum, losses,
    examples and diverged positions as one trainer over the whole cohort."""
    from fedswarm.sim.batched_ray import LocalPool, ShardedTrainer, ShardWorker

    trainer, cfg = _trainer(clients=12)
    pool = LocalPool(2)
    for w in pool.members:  # the trainer the test made (a worker builds its own from a config)
        ShardWorker.begin(w, cfg)
        w.trainer = w.run.trainer = trainer
    start = torch.randn(trainer.layout.d, generator=torch.Generator().manual_seed(0)) * 0.1
    sched = _schedule([7, 2, 5, 10, 3, 0, 11], steps=2, bs=16, lr=0.3)
    sched.lr[3] = 1e30  # client 10 (a worker-0 client, 3rd of the cohort) diverges
    weights = trainer.num_examples(sched.partitions).to(torch.float32)
    ((rows, ref_sum, ref_loss, ref_n, ref_lw, ref_div),) = list(trainer.average(start, sched, weights, chunk_size=64))
    ((rows, got_sum, got_loss, got_n, got_lw, got_div),) = list(
        ShardedTrainer(trainer, pool).average(start, sched, weights))
    assert rows == slice(0, 7)
    assert sorted(got_div) == sorted(ref_div) == [3]
    total = float(weights.sum())  # the mean is what FedAvg takes: float32 products added in another order
    torch.testing.assert_close(got_sum / total, ref_sum / total, atol=1e-6, rtol=0)
    finite = torch.isfinite(ref_loss)
    torch.testing.assert_close(got_loss[finite], ref_loss[finite])
    # the loss-weighted sum: float32 terms added in another order (two shards' partial sums), as the mean above
    assert torch.equal(got_n, ref_n) and got_lw == pytest.approx(ref_lw, rel=1e-6)


@pytest.mark.parametrize("kw, words", [
    (dict(strategy="progfed"), "runs fedavg, compressed_fedavg"),
    (dict(strategy="sketched_sgd"), "strategy 'sketched_sgd' runs on --engine batched without --ray-address (it "
                                    "asks the round's clients a second time"),
    (dict(strategy="pvt"), "strategy 'pvt' runs on --engine batched without --ray-address (its clients train sub-"),
    (dict(strategy="fedbuff"), "(its asynchronous aggregations"),
    (dict(secagg=True), "FedAvg's shards send back only their sums"),
    (dict(byzantine=1), "does not run --byzantine with fedavg"),  # the batched engine's own refusal
    (dict(device="cuda"), "trains on the actors' CPUs"),
    (dict(workers=2, ray_address=None), "give --ray-address"),
    (dict(workers=2, engine="inprocess"), "the inprocess engine takes none"),
])
def test_what_the_sharded_engine_cannot_run_is_refused_in_one_line(kw, words):
    from fedswarm.sim.engines import check_config

    cfg = RunConfig(**{"engine": "batched", "ray_address": "127.0.0.1:1", **kw})
    with pytest.raises(ConfigError) as exc:
        check_config(cfg)
    assert words in str(exc.value) and "\n" not in str(exc.value)


def test_without_ray_address_nothing_of_ray_is_imported(tmp_path):
    code = f"""
import atexit, runpy, sys
atexit.register(lambda: print("RAY-IMPORTED", sorted(m for m in sys.modules if m == "ray" or m.startswith("ray."))))
from fedswarm.sim.batched_ray import check_sharded  # the module itself and its checks load no Ray
sys.argv = ["fedswarm", "sim", "--engine", "batched", "--strategy", "compressed_fedavg", "--clients", "6",
            "--rounds", "1", "--local-steps", "1", "--db", {str(tmp_path / "s.db")!r}]
runpy.run_module("fedswarm", run_name="__main__")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "RAY-IMPORTED []" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]


@pytest.mark.parametrize("strategy, params, status", [
    ("compressed_fedavg", {"codec": "topk"}, "failed"),  # its codec step raises on the worker: the node fails
    ("fetchsgd", {}, "rejected"),
])
def test_diverged_clients_fail_or_are_refused_as_in_one_process(strategy, params, status, tmp_path, monkeypatch):
    """Clients whose partitions hold inf (tests/test_batched_diverged.py's task): on the workers
    they fail or are refused with the same reasons as in one process, and the models agree."""
    from fedswarm.store import Store
    from fedswarm.tasks import TASKS
    from fedswarm.tasks.staged import STAGED_TASKS
    from tests.test_batched_diverged import DIVERGING, POISONED, _poisoned

    monkeypatch.setitem(TASKS, "digits-cnn4-inf", _poisoned(STAGED_TASKS["digits-cnn4"]))
    local_pools(monkeypatch)
    kw = {**DIVERGING, "strategy": strategy, "params": params, "rounds": 1}
    seen = {}
    for sub, extra in (("one", {}), ("sharded", {"ray_address": "127.0.0.1:1", "workers": 2})):
        (tmp_path / sub).mkdir()
        models, res = _models(RunConfig(engine="batched", **kw, **extra), tmp_path / sub, monkeypatch)
        store = Store(tmp_path / sub / "batched.db")
        try:
            rows = {(n.round, n.node_id): (n.status, (n.reason or "").splitlines()[:1]) for n in
                    store.node_rounds(store.list_runs()[0].id)}
        finally:
            store.close()
        seen[sub] = models, rows
    (ref, ref_rows), (got, got_rows) = seen["one"], seen["sharded"]
    assert got_rows == ref_rows
    assert {node for (_, node), (st, _) in ref_rows.items() if st == status} == {str(p + 1) for p in POISONED}
    for a, b in zip(ref, got):
        assert torch.allclose(a, b, atol=1e-5, rtol=0)
