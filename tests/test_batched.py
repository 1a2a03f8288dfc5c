"""The batched engine: same models as the in-process engine (every round, to 1e-5), the
one-step shortcut equal to per-client training, chunking invisible in the result, the
vectorized partition equal to flwr-datasets', and one-line refusals for what it cannot run."""

import itertools
import subprocess
import sys

import numpy as np
import pytest
import torch

from fedswarm.config import RunConfig
from fedswarm.errors import ConfigError
from fedswarm.store import Store
from fedswarm.tasks import get_task
from fedswarm.tasks.partition import iid_offsets, partition_indices, partition_offsets
from fedswarm.train import task_data


def _models(cfg: RunConfig, tmp_path, monkeypatch) -> tuple[list[torch.Tensor], dict]:
    """Run ``cfg`` on its engine; return the global model of every round (as the server
    evaluates it) and the exported result."""
    import fedswarm.server.app as server_app
    import fedswarm.sim.batched as batched
    import fedswarm.sim.inprocess as inprocess
    from fedswarm.train import evaluate_flat

    seen: list[torch.Tensor] = []

    def spy(task, model, flat, *args, **kwargs):
        seen.append(flat.detach().clone().float())
        return evaluate_flat(task, model, flat, *args, **kwargs)

    monkeypatch.setattr(server_app, "evaluate_flat", spy)
    monkeypatch.setattr(batched, "evaluate_flat", spy)
    # Both engines number their runs from one process-wide counter, and the run id is a varint in
    # every message's metadata: the 127th and 128th runs of a test worker differ by a byte per
    # message. The engines under comparison get the same run id.
    monkeypatch.setattr(inprocess, "_run_ids", itertools.repeat(1))
    from fedswarm.sim.run import run_engine

    store = Store(tmp_path / f"{cfg.engine}.db")
    try:
        rid = store.create_run(cfg.model_dump())
        assert run_engine(cfg, store=store, run_id=rid) == "finished"
        return seen, store.export_result(rid)
    finally:
        store.close()


#: With ``ties``: at most this share of the coordinates may differ by more than 1e-5, and none by more than TIE_MAX.
TIE_SHARE, TIE_MAX = 0.01, 1e-2


def same_models_on_both_engines(kw: dict, tmp_path, monkeypatch, *, ties: bool = False, atol: float = 1e-5
                                ) -> tuple[dict, dict, list[tuple[dict, dict]]]:
    """Run ``kw`` on ``inprocess`` and on ``batched``; check that every round's global model
    agrees to 1e-5 and that training moved it. Returns both results and their round rows
    (after round 0) paired, for the caller's checks of what else must agree.

    ``ties``: the two engines' local training rounds differently (a vmap against a loop: the
    models differ by ~1e-7), so a codec that quantizes (1-bit's sign) can decide a value that
    close to its threshold differently; a flip moves that coordinate by its column's scale
    and its column's other coordinates by a little (seen on a Zen 4 CPU: round 2, one flip,
    64 coordinates off, the largest by 6e-4). Then every round's model must still agree to
    1e-5 on all but TIE_SHARE of the coordinates and to TIE_MAX on all, and be finite. ``atol``: the
    agreement asked of every coordinate otherwise (secure aggregation's quantizer: see its test)."""
    ref, ref_res = _models(RunConfig(engine="inprocess", **kw), tmp_path, monkeypatch)
    got, got_res = _models(RunConfig(engine="batched", **kw), tmp_path, monkeypatch)
    assert len(got) == len(ref) == kw["rounds"] + 1
    for rnd, (a, b) in enumerate(zip(ref, got)):
        diff = (a - b).abs()
        if ties:
            assert bool(torch.isfinite(b).all()) and float(diff.max()) <= TIE_MAX, (
                f"round {rnd}: max diff {diff.max():.3g}")
            off = float((diff > 1e-5).float().mean())
            assert off <= TIE_SHARE, f"round {rnd}: {off:.2%} of the coordinates differ by more than 1e-5"
        else:
            assert torch.allclose(a, b, atol=atol, rtol=0), f"round {rnd}: max diff {diff.max():.3g}"
    assert not torch.equal(ref[0], ref[-1])  # training moved the model
    return ref_res, got_res, list(zip(ref_res["rounds"][1:], got_res["rounds"][1:]))


EQUIVALENT = {
    # several local steps with short last batches (144/143 examples, batch 16: masking)
    "epochs-uneven": dict(clients=10, rounds=2, local_epochs=1),
    # the one-step shortcut, with sampling
    "one-step-sampled": dict(clients=12, rounds=3, fraction=0.5, local_steps=1),
    # momentum, a batch larger than some partitions
    "momentum": dict(clients=8, rounds=2, local_steps=3, momentum=0.9, batch_size=200, lr=0.05),
    # label-skewed, uneven partitions
    "dirichlet": dict(clients=10, rounds=2, local_steps=4, partition="dirichlet:0.3", seed=2),
    # per-class policies: other steps, batch size and learning rate on one class
    "policies": dict(clients=8, rounds=2, local_steps=2, devices="gpu:4,edge-wifi:4",
                     policies={"edge-wifi": {"local_steps": 5, "batch_size": 8, "lr": 0.1}}),
    # the convex task (ridge term outside the per-example mean)
    "logreg": dict(task="synthetic-logreg", clients=20, rounds=3, local_steps=2, lr=0.5),
    "logreg-one-step": dict(task="synthetic-logreg", clients=30, rounds=2, local_steps=1, fraction=0.3),
    # more clients than training examples: one cycled example each
    "clients-beyond-examples": dict(clients=1500, rounds=2, local_steps=1, fraction=0.01),
    # one-step rounds without per-node rows: one objective call per group of equal weights
    "one-step-grouped": dict(clients=12, rounds=2, local_steps=1, batch_size=50, partition="dirichlet:0.5"),
    "logreg-grouped": dict(task="synthetic-logreg", clients=25, rounds=2, local_steps=1, batch_size=40,
                           devices="gpu:5,edge-wifi:20", policies={"gpu": {"lr": 0.05}}),
    # DP-FedAvg: clipped changes (some clipped, some not), one noise draw per round, the
    # adaptive clip moving with the clipped fraction; one step (no shortcut under --dp) and several
    "dp-adaptive": dict(clients=10, rounds=3, local_steps=2, fraction=0.5,
                        dp="noise_multiplier=0.5,clip=0.3,adaptive=true"),
    "dp-one-step": dict(task="synthetic-logreg", clients=12, rounds=2, local_steps=1, lr=0.5,
                        dp="noise_multiplier=1.0,clip=0.3"),
}


@pytest.mark.parametrize("case", sorted(EQUIVALENT))
def test_batched_gives_the_inprocess_models(case, tmp_path, monkeypatch):
    kw = EQUIVALENT[case]
    if case.endswith("-grouped"):  # as for rounds too large for per-node rows: no per-client losses
        import fedswarm.sim.batched as batched

        monkeypatch.setattr(batched, "NODE_ROWS_MAX", 0)
    _, got_res, pairs = same_models_on_both_engines(kw, tmp_path, monkeypatch)
    for r_ref, r_got in pairs:
        assert r_got["num_clients"] == r_ref["num_clients"]
        assert r_got["train_loss"] == pytest.approx(r_ref["train_loss"], abs=1e-5)
        # replies are the same messages; the train message's config says 'batched' (2 bytes
        # shorter than 'inprocess') and nothing else differs
        assert r_got["bytes_up"] == r_ref["bytes_up"]
        assert r_ref["bytes_down"] - r_got["bytes_down"] == 2 * r_ref["num_clients"]
        if "dp" in kw:  # the same mechanism's figures: clip (adaptive: moved by the clipped fraction), epsilon
            for key in ("dp_clip", "dp_clipped_fraction", "dp_noise_multiplier", "epsilon"):
                assert r_got[key] == pytest.approx(r_ref[key], rel=1e-6), key
    if "dp" in kw:
        fractions = [r["dp_clipped_fraction"] for r, _ in pairs]
        assert any(0 < f < 1 for f in fractions) or len(set(fractions)) > 1, fractions  # clipping at work
        assert pairs[-1][1]["epsilon"] > pairs[0][1]["epsilon"] > 0


def _trainer(task_name="digits-mlp", clients=40, spec="iid"):
    from fedswarm.sim.batched import BatchedTrainer

    cfg = RunConfig(task=task_name, clients=clients, partition=spec)
    data = task_data(cfg)
    flat, offsets = partition_offsets(data.train_y.numpy(), spec, clients, cfg.seed)
    return BatchedTrainer(get_task(task_name), data.train_x, data.train_y, flat, offsets), cfg


def _schedule(pids, steps, bs, lr, seed=0):
    from fedswarm.sim.batched import ClientSchedule

    k = len(pids)
    return ClientSchedule(torch.tensor(pids), torch.full((k,), steps), torch.full((k,), bs),
                          torch.full((k,), lr, dtype=torch.float32), torch.arange(k) + seed)


def test_one_step_shortcut_equals_per_client_models():
    """``average`` with one step never forms the clients' models; its sum must equal the
    weighted sum of the models that ``fit`` trains one by one (and the numpy sum of them)."""
    trainer, _ = _trainer()
    start = torch.randn(trainer.layout.d) * 0.1
    sched = _schedule(list(range(0, 40, 3)), steps=1, bs=16, lr=0.3)
    weights = trainer.num_examples(sched.partitions).float()
    fitted = list(trainer.fit(start, sched, chunk_size=4))
    models = torch.cat([new for _, new, _, _ in fitted])
    losses = torch.cat([loss for _, _, loss, _ in fitted])
    oracle = (weights.double().numpy()[:, None] * models.double().numpy()).sum(axis=0)
    loss_oracle = float((weights.double() * losses.double()).sum())
    for per_client_loss in (True, False):  # vmap over examples, or one objective call per group
        out = list(trainer.average(start, sched, weights, chunk_size=5, per_client_loss=per_client_loss))
        np.testing.assert_allclose(sum(o[1] for o in out).numpy(), oracle, atol=2e-4)
        assert sum(o[4] for o in out) == pytest.approx(loss_oracle, rel=1e-5)
        if per_client_loss:
            assert torch.allclose(torch.cat([o[2] for o in out]), losses, atol=1e-5)
    assert trainer.layout.d == models.shape[1]


def test_chunking_does_not_change_the_result():
    trainer, _ = _trainer(clients=30, spec="dirichlet:0.5")
    start = torch.randn(trainer.layout.d) * 0.1
    sched = _schedule(list(range(30)), steps=3, bs=16, lr=0.2)
    whole = torch.cat([new for _, new, _, _ in trainer.fit(start, sched, chunk_size=30)])
    pieces = torch.cat([new for _, new, _, _ in trainer.fit(start, sched, chunk_size=7)])
    budget = torch.cat([new for _, new, _, _ in trainer.fit(start, sched, memory_budget=2_000_000)])
    assert torch.allclose(whole, pieces, atol=1e-6) and torch.allclose(whole, budget, atol=1e-6)


def test_minibatches_are_the_local_trainers():
    """The [K, S, B] draws must be the rows LocalTrainer.fit visits, step by step."""
    from fedswarm.params import get_flat
    from fedswarm.tasks.base import Task
    from fedswarm.train import LocalTrainer

    trainer, cfg = _trainer(clients=40)
    data = task_data(cfg)
    sched = _schedule([3, 17], steps=12, bs=16, lr=0.1, seed=5)  # 36 examples each: reshuffles
    idx, valid = trainer.minibatches(sched)
    for k, pid in enumerate([3, 17]):
        part = torch.from_numpy(partition_indices(data.train_y.numpy(), "iid", 40, cfg.seed)[pid])
        visited: list[torch.Tensor] = []

        def objective(model, x, y, visited=visited):
            visited.append(x.clone())
            return model(x).sum()

        spy = Task("spy", "records its batches", lambda: torch.nn.Linear(64, 1), lambda s, t: None, objective)
        lt = LocalTrainer(spy, data.train_x[part], data.train_y[part])
        lt.fit(get_flat(lt.model), steps=12, batch_size=16, seed=int(sched.seeds[k]))
        assert len(visited) == 12
        for s, xb in enumerate(visited):
            assert torch.equal(xb, data.train_x[idx[k, s][valid[k, s]]]), f"client {pid} step {s}"


def test_iid_partition_is_flwr_datasets_split():
    from fedswarm.tasks import partition as part_mod

    labels = np.random.default_rng(0).integers(0, 10, 1437)
    for k, seed in [(20, 0), (7, 3), (1437, 1)]:
        ref = part_mod._cached(part_mod._labels_key(labels), labels.tobytes(), str(labels.dtype), "iid", k, seed)
        got = partition_indices(labels, "iid", k, seed)
        assert all(np.array_equal(a, b) for a, b in zip(ref, got))


def test_iid_with_more_clients_than_examples_cycles_the_pool():
    flat, offsets = iid_offsets(10, 25, seed=4)
    assert np.array_equal(offsets, np.arange(26))
    perm = np.random.default_rng(4).permutation(10)
    assert np.array_equal(flat, perm[np.arange(25) % 10])
    flat, offsets = iid_offsets(1600, 100_000, seed=0)  # vectorized: no per-client work
    assert offsets[-1] == 100_000 and set(np.unique(flat)) == set(range(1600))


def test_unsupported_runs_say_so_in_one_line():
    from fedswarm.sim.batched import check_supported, parse_memory_budget

    with pytest.raises(ConfigError, match="inprocess") as exc:
        check_supported(RunConfig(strategy="draco", engine="batched"))
    assert "\n" not in str(exc.value) and "draco" in str(exc.value)
    with pytest.raises(ConfigError,
                       match="--dp with fedavg, compressed_fedavg, onebit, fedbuff; with 'krum' use --engine inpr"):
        check_supported(RunConfig(engine="batched", strategy="krum", dp="noise_multiplier=1.0"))
    check_supported(RunConfig(engine="batched", dp="noise_multiplier=1.0"))  # fedavg
    with pytest.raises(ConfigError, match="--dp-sgd"):
        check_supported(RunConfig(engine="batched", strategy="compressed_fedavg", dp_sgd="noise_multiplier=1.0"))
    assert parse_memory_budget("2GB") == 2_000_000_000 and parse_memory_budget("512MiB") == 512 * 2**20
    for bad in ("lots", "10", "3 parsecs"):
        with pytest.raises(ConfigError, match="memory_budget"):
            parse_memory_budget(bad)


def test_cli_runs_the_batched_engine(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "fedswarm", "sim", "--engine", "batched", "--clients", "300", "--rounds", "2",
         "--local-steps", "1", "--memory-budget", "64MB", "--db", str(tmp_path / "s.db"), "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "clients/s" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "fedswarm", "sim", "--engine", "batched", "--strategy", "draco",
                          "--db", str(tmp_path / "t.db")], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--engine inprocess" in bad.stdout + bad.stderr
