"""The compressed strategies end to end and against plain re-derivations: FedAvg as an
oracle, exact inputs for 1-bit SGD, gTop-k's selection and FetchSGD's server step in
numpy, measured bytes against the codecs' formulas, rejected payloads."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

import fedswarm.server.app as server_app
from fedswarm.config import RunConfig
from fedswarm.params import ParamLayout
from fedswarm.sim.inprocess import run_inprocess
from fedswarm.strategies import registry
from fedswarm.algorithms.compression.codecs import make_codec
from fedswarm.strategies.federated.compressed_fedavg import CompressedFedAvg, OneBitSGD, parse_codec_params
from fedswarm.algorithms.compression.countsketch import CountSketch
from fedswarm.algorithms.compression.error_feedback import ErrorFeedback
from fedswarm.algorithms.compression.gtopk import merge_topk, tree_merge
from fedswarm.strategies.federated.gtopk import GlobalTopK
from fedswarm.algorithms.compression.sketched import fetchsgd_step
from fedswarm.store import Store
from fedswarm.wire import payload_to_records, vector_to_arrayrecord

D = 4810  # digits-mlp
PARAMS = {  # settings that learn in a few rounds at d = 4810 (the defaults target bigger models)
    "compressed_fedavg": {"codec": "topk", "codec_params": "ratio=0.1"},
    "onebit": {},
    "gtopk": {"density": 0.05},
    "sketched_sgd": {"density": 0.05, "rows": 3, "cols": 500, "momentum": 0.5},
    "fetchsgd": {"density": 0.05, "rows": 3, "cols": 600, "momentum": 0.0},
    # gs-SGD with 3 x 500 cells (c = 2.1 k) learned to 0.57-0.85 in 4 rounds, 0.745 on average
    # over seeds 1-24 (either pi of the sketch: uniform or with line structure); 5 x 1000
    # cells: 0.82-0.93 over seeds 1-12
    "gs_sgd": {"density": 0.05, "rows": 5, "cols": 1000},
}


def run(store, strategy: str, *, clients: int = 4, rounds: int = 4, capture: bool = False, monkeypatch=None,
        **kw) -> tuple[dict, list[torch.Tensor]]:
    """Run on the in-process engine; return the exported result and (if ``capture``) the
    global model evaluated after every round (round 0 first)."""
    models: list[torch.Tensor] = []
    if capture:
        real = getattr(server_app.evaluate_flat, "__wrapped__", server_app.evaluate_flat)

        def spy(task, model, flat, *args, **kwargs):
            models.append(flat.clone())
            return real(task, model, flat, *args, **kwargs)

        spy.__wrapped__ = real
        monkeypatch.setattr(server_app, "evaluate_flat", spy)
    cfg = RunConfig(strategy=strategy, clients=clients, rounds=rounds, seed=1, **kw)
    rid = store.create_run(cfg.model_dump())
    assert run_inprocess(cfg, store=store, run_id=rid) == "finished", store.get_run(rid).error
    return store.export_result(rid) | {"run_id": rid}, models


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One short run per strategy, shared by the learning and byte tests."""
    torch.set_num_threads(1)
    store = Store(tmp_path_factory.mktemp("runs") / "s.db")
    out = {name: run(store, name, params=p)[0] for name, p in PARAMS.items()}
    yield out
    store.close()


# -- end to end --------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(PARAMS))
def test_each_strategy_learns(runs, name):
    res = runs[name]
    assert [r["round"] for r in res["rounds"]] == list(range(5))
    # chance is 0.1; fetchsgd at seed 1 reaches 0.783 with the counter-based minibatch draw (0.858 and 0.830
    # at seeds 2 and 3), above 0.8 with the earlier randperm draw
    assert res["summary"]["final_test_accuracy"] > 0.75
    assert all(r["rejected"] == 0 for r in res["rounds"][1:])


def test_compressed_fedavg_without_compression_is_fedavg(store, monkeypatch):
    """The oracle: codec none + error feedback + server_lr 1 is FedAvg, round for round."""
    kw = dict(clients=3, rounds=3, partition="dirichlet:0.5", monkeypatch=monkeypatch, capture=True)
    _, ref = run(store, "fedavg", **kw)
    _, got = run(store, "compressed_fedavg", params={"codec": "none", "error_feedback": True}, **kw)
    assert len(ref) == len(got) == 4
    for a, b in zip(ref, got):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
    assert not torch.equal(ref[0], ref[-1])


def _formula(name: str, layout: ParamLayout) -> int:
    p = PARAMS[name]
    if name == "compressed_fedavg":
        return make_codec(p["codec"], **parse_codec_params(p["codec_params"])).wire_bytes(layout)
    if name == "onebit":
        return make_codec("onebit", scale="auto").wire_bytes(layout)  # the strategy's default
    if name == "gtopk":
        return make_codec("topk", ratio=p["density"]).wire_bytes(layout)
    sketch = 4 * p["rows"] * p["cols"]
    k = math.ceil(p["density"] * layout.d)
    exact = {"sketched_sgd": 4 * 4 * k, "gs_sgd": 4 * k}.get(name, 0)  # phase 2: p2·k (p2 = 4) or k values
    return sketch + exact


@pytest.mark.parametrize("name", list(PARAMS))
def test_uplink_bytes_match_the_formula(runs, name):
    from fedswarm.tasks import get_task

    layout = ParamLayout.from_module(get_task("digits-mlp").model(0))
    per_client = _formula(name, layout)
    header = 1600 if name in ("sketched_sgd", "gs_sgd") else 800  # framing per client (two replies if two phases)
    for r in runs[name]["rounds"][1:]:
        assert 4 * per_client <= r["bytes_up"] <= 1.05 * 4 * per_client + 4 * header, (r["bytes_up"], per_client)


def test_partial_participation_keeps_replicas_in_step(store):
    """Half the clients per round, 1-bit aggregates down: stale nodes catch up (missed
    payloads or changed coordinates) and no client ever reports a replica out of step."""
    res, _ = run(store, "compressed_fedavg", clients=6, rounds=5, fraction=0.5,
                 params={"codec": "sign", "downlink_codec": "onebit"})
    rows = store.node_rounds(res["run_id"])
    assert len(rows) == 15 and all(r.status == "ok" for r in rows)
    assert res["summary"]["final_test_accuracy"] > 0.7
    full = 19240  # a node new to the run gets the full model; later ones get 1-bit payloads
    assert res["rounds"][-1]["bytes_down"] < 3 * full


def test_device_class_policy_chooses_the_codec(store):
    res, _ = run(store, "compressed_fedavg", clients=2, rounds=1, params={"codec": "topk"},
                 policies={"default": {"codec": "fp16"}})
    assert 2 * 2 * D <= res["rounds"][1]["bytes_up"] <= 2 * (2 * D + 800)


# -- exact inputs and numpy re-derivations --------------------------------------------------


LAYOUT = ParamLayout.from_shapes([("w", (4, 3)), ("b", (4,))])


def _reply(node_id: int, content: RecordDict) -> Message:
    down = Message(RecordDict(), dst_node_id=node_id, message_type="train.x")
    return Message(content, reply_to=down)


def _payload_reply(node_id: int, payload, n: int = 10) -> Message:
    content = payload_to_records(payload, RecordDict())
    content["metrics"] = MetricRecord({"num-examples": n, "train_loss": 0.5})
    content["node"] = ConfigRecord({"device_class": "default", "policy": "{}"})
    return _reply(node_id, content)


def _start(strategy, x0: torch.Tensor) -> None:
    strategy._ensure_model(vector_to_arrayrecord(x0))


def test_onebit_with_error_feedback_is_exact_on_two_valued_columns():
    """Every column of every client's update holds one value >= 0 and one < 0, with the
    same sign pattern: 1-bit is exact on the clients, their average is again two-valued
    per column, so the server's second quantization is exact too and no residual is left."""
    rng = np.random.default_rng(0)
    pattern = rng.random(LAYOUT.d) < 0.5
    strategy = OneBitSGD(LAYOUT, scale="column")  # the paper's per-column pairs (the test's premise)
    x0 = torch.from_numpy(rng.standard_normal(LAYOUT.d).astype(np.float32))
    _start(strategy, x0)
    codec, ef, replies, deltas, weights = make_codec("onebit"), ErrorFeedback(), [], [], [3, 5, 8]
    for i, n in enumerate(weights):
        col = np.empty(LAYOUT.d, np.float32)
        for off, rows, cols in ((0, 4, 3), (12, 4, 1)):
            m = np.zeros((rows, cols), np.float32)
            for j in range(cols):
                pos, neg = 0.25 * (i + 1) * (j + 1), -0.5 * (i + 2)
                m[:, j] = np.where(pattern[off:off + rows * cols].reshape(rows, cols)[:, j], pos, neg)
            col[off:off + rows * cols] = m.reshape(-1)
        delta = torch.from_numpy(col)[None]
        payload, residual = ef.step(codec, delta, None, LAYOUT)
        assert torch.equal(residual, torch.zeros_like(residual))
        deltas.append(delta[0])
        replies.append(_payload_reply(i + 1, payload, n))
    arrays, _ = strategy.aggregate_train(1, replies)
    w = np.array(weights, np.float64) / sum(weights)
    expect = x0.double() + sum(wi * d.double() for wi, d in zip(w, deltas))
    np.testing.assert_allclose(strategy.model.double().numpy(), expect.numpy(), rtol=0, atol=1e-6)
    assert float(strategy.server_residual.abs().max()) < 1e-6
    assert strategy.sync.history[1][0].meta["codec"] == "onebit"  # the 1-bit aggregate is what goes down


def np_tree_merge(parts: list[dict[int, float]], k: int) -> dict[int, float]:
    """gTop-k's reduction, naively: dicts of index -> value, pairwise by position."""
    level = [dict(p) for p in parts]
    while len(level) > 1:
        nxt = []
        for i in range(0, len(level), 2):
            if i + 1 == len(level):
                nxt.append(level[i])
                continue
            merged = dict(level[i])
            for j, v in level[i + 1].items():
                merged[j] = merged.get(j, 0.0) + v
            best = sorted(merged, key=lambda j: -abs(merged[j]))[:k]
            nxt.append({j: merged[j] for j in best})
        level = nxt
    return level[0]


def test_gtopk_selection_matches_a_numpy_rederivation():
    rng = np.random.default_rng(7)
    d, k, P = 40, 5, 5
    layout = ParamLayout.from_shapes([("w", (d,))])
    accs = rng.permutation(np.linspace(0.1, 4.0, P * d)).reshape(P, d) * rng.choice([-1, 1], (P, d))
    accs = accs.astype(np.float32)
    weights = [10, 20, 30, 15, 25]
    codec = make_codec("topk", ratio=k / d)
    sent = []
    for i in range(P):
        idx = np.sort(np.argsort(-np.abs(accs[i]))[:k])
        sent.append({int(j): float(accs[i, j]) * weights[i] / sum(weights) for j in idx})
    expect = np_tree_merge(sent, k)
    for merge in ("tree", "exact"):
        strategy = GlobalTopK(layout, density=k / d, merge=merge, server_lr=0.5)
        _start(strategy, torch.zeros(d))
        replies = [_payload_reply(i + 1, codec.encode(torch.from_numpy(accs[i])[None], layout), weights[i])
                   for i in range(P)]
        strategy.aggregate_train(1, replies)
        if merge == "exact":
            total: dict[int, float] = {}
            for s in sent:
                for j, v in s.items():
                    total[j] = total.get(j, 0.0) + v
            expect = {j: total[j] for j in sorted(total, key=lambda j: -abs(total[j]))[:k]}
        got = strategy.model.numpy()
        assert sorted(np.nonzero(got)[0].tolist()) == sorted(expect)
        for j, v in expect.items():
            assert got[j] == pytest.approx(0.5 * v, rel=1e-6)
        for i in range(P):  # each client is told which of its k coordinates were used
            _, kind, data = strategy.pending[i + 1]
            mask = np.unpackbits(np.frombuffer(data, np.uint8), bitorder="little")[:k].astype(bool)
            assert [j for j, m in zip(sorted(sent[i]), mask) if m] == sorted(set(sent[i]) & set(expect))


def test_tree_merge_of_one_and_merge_of_disjoint_sets():
    a = (torch.tensor([1, 5]), torch.tensor([1.0, -3.0]))
    assert tree_merge([a], 1)[0].tolist() == [1, 5]
    idx, vals = merge_topk(a, (torch.tensor([2, 5]), torch.tensor([2.5, 1.0])), 2)
    assert idx.tolist() == [2, 5] and vals.tolist() == [2.5, -2.0]


def test_fetchsgd_server_step_matches_a_numpy_rederivation():
    d, r, c, k, rho, lr = 30, 3, 53, 3, 0.9, 0.5
    sketch = CountSketch(d, r, c, seed=11)
    buckets, signs = sketch.buckets().numpy(), sketch.signs.numpy().astype(np.float64)
    rng = np.random.default_rng(3)
    s_u, s_e = torch.zeros(r, c), torch.zeros(r, c)
    n_u, n_e = np.zeros((r, c)), np.zeros((r, c))
    for _ in range(4):
        g = rng.standard_normal(d) * (rng.random(d) < 0.3) * 5
        table = np.zeros((r, c))
        for j in range(r):
            np.add.at(table[j], buckets[j], signs[j] * g)
        idx, vals = fetchsgd_step(sketch, s_u, s_e, torch.from_numpy(table.astype(np.float32)), rho=rho, lr=lr, k=k)
        n_u = rho * n_u + table
        n_e = n_e + lr * n_u
        est = np.median(np.stack([signs[j] * n_e[j, buckets[j]] for j in range(r)]), axis=0)
        top = np.sort(np.argsort(-np.abs(est))[:k])
        assert idx.tolist() == top.tolist()
        np.testing.assert_allclose(vals.numpy(), est[top], rtol=1e-5, atol=1e-5)
        for j in range(r):
            n_u[j, buckets[j, top]] = 0.0
            n_e[j, buckets[j, top]] = 0.0
        np.testing.assert_allclose(s_u.numpy(), n_u, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(s_e.numpy(), n_e, rtol=1e-5, atol=1e-5)


# -- rejected payloads ----------------------------------------------------------------------


def _corrupt(kind: str):
    def mutate(reply: RecordDict) -> None:
        rec = reply.array_records["payload"]
        key = next(iter(rec.keys()))
        arr = rec[key].numpy().copy()
        if kind == "nan":
            arr.reshape(-1)[0] = np.nan
        elif kind == "shape":
            arr = arr.reshape(-1)[:-1].copy()
        elif kind == "codec":
            reply.config_records["payload.meta"]["codec"] = "zip"
        elif kind == "examples":
            reply.metric_records["metrics"]["num-examples"] = -5
        from flwr.app import Array

        rec[key] = Array(np.ascontiguousarray(arr))

    return mutate


@pytest.mark.parametrize("strategy, module, kind, needle", [
    ("compressed_fedavg", "compressed_fedavg", "nan", "non-finite"),
    ("compressed_fedavg", "compressed_fedavg", "shape", "shape"),
    ("onebit", "compressed_fedavg", "codec", "codec"),
    ("gtopk", "gtopk", "examples", "num-examples"),
    ("fetchsgd", "sketch_base", "shape", "sketch table"),  # its client step (SketchClient) lives there
])
def test_a_bad_payload_is_rejected_and_leaves_the_model_untouched(store, monkeypatch, strategy, module, kind,
                                                                  needle):
    import importlib

    mod = importlib.import_module(f"fedswarm.strategies.federated.{module}")
    real_finish = mod.finish
    mutate = _corrupt(kind)

    def bad_finish(cr, fit, reply, **metrics):
        out = real_finish(cr, fit, reply, **metrics)
        mutate(out)
        return out

    monkeypatch.setattr(mod, "finish", bad_finish)
    res, models = run(store, strategy, clients=1, rounds=1, params=PARAMS.get(strategy, {}), capture=True,
                      monkeypatch=monkeypatch)
    assert torch.equal(models[0], models[1])  # the only client was rejected: nothing moved
    row = res["rounds"][1]
    assert row["rejected"] == 1 and needle in row["rejected_reasons"]["1"]
    nodes = store.node_rounds(res["run_id"])
    assert [n.status for n in nodes] == ["rejected"]


def test_gs_sgd_with_sketch_estimates_applies_the_unsketched_top_k():
    from fedswarm.strategies.federated.sketched import GlobalSketchSGD

    d = 200
    layout = ParamLayout.from_shapes([("w", (d,))])
    strategy = GlobalSketchSGD(layout, exact_values=False, density=0.02, rows=3, cols=400, server_lr=0.5)
    _start(strategy, torch.zeros(d))
    codec = make_codec("countsketch", rows=3, cols=400, k_ratio=0.02)
    vecs = torch.zeros(2, d)
    vecs[0, [5, 50, 150]] = torch.tensor([4.0, -2.0, 1.0])
    vecs[1, [5, 60, 199]] = torch.tensor([2.0, 3.0, -6.0])
    replies = [_payload_reply(i + 1, codec.encode(vecs[i:i + 1], layout, seed=strategy.hash_seed), n)
               for i, n in enumerate((1, 3))]
    strategy.aggregate_train(1, replies)
    avg = 0.25 * vecs[0] + 0.75 * vecs[1]
    idx, vals = strategy.sketch.unsketch(strategy.sketch.sketch(avg), strategy.k)
    expect = torch.zeros(d)
    expect[idx] = 0.5 * vals
    torch.testing.assert_close(strategy.model, expect)
    assert strategy.model[199] == pytest.approx(0.5 * 0.75 * -6.0, rel=1e-5)  # a big sketch is exact
    assert strategy.pending[1][1] == "indices"


def test_a_nonfinite_aggregate_is_never_committed():
    strategy = CompressedFedAvg(LAYOUT, codec="none", server_lr=1e30)
    _start(strategy, torch.zeros(LAYOUT.d))
    p = make_codec("none").encode(torch.full((1, LAYOUT.d), 1e10), LAYOUT)
    _, metrics = strategy.aggregate_train(1, [_payload_reply(1, p)])
    assert metrics["nonfinite_aggregate"] == 1 and torch.equal(strategy.model, torch.zeros(LAYOUT.d))


# -- registry and CLI ----------------------------------------------------------------------


def test_registered_with_hyperparameters():
    for name in PARAMS:
        entry = registry.get(name)
        assert entry.client_update is not None and entry.message_type == f"train.{name}"
    with pytest.raises(Exception, match="unknown parameter"):
        registry.resolve_params("gtopk", {"ratio": 0.1})
    assert parse_codec_params("ratio=0.05,unbiased=true") == {"ratio": 0.05, "unbiased": True}
    assert parse_codec_params('{"levels": 4}') == {"levels": 4}


def test_cli_sim_runs_a_compressed_strategy(tmp_path):
    r = subprocess.run([sys.executable, "-m", "fedswarm", "sim", "--strategy", "onebit", "--clients", "3",
                        "--rounds", "2", "--set", "server_lr=1.0", "--out", str(tmp_path / "o"),
                        "--db", str(tmp_path / "s.db")], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    res = json.loads((tmp_path / "o" / "result.json").read_text())
    assert res["config"]["strategy"] == "onebit" and len(res["rounds"]) == 3
    assert res["summary"]["total_bytes_up"] < 3 * 2 * 19240 / 5


# -- replica sync ------------------------------------------------------------------------------


def test_replica_sync_picks_the_smallest_body_and_stays_bit_exact():
    from fedswarm.strategies.federated.compressed_sync import REPLICA_LOST, SYNC, ReplicaSync, client_sync, save_replica

    d = 2000
    layout = ParamLayout.from_shapes([("w", (d,))])
    gen = torch.Generator().manual_seed(0)
    sync, state = ReplicaSync(history=2), RecordDict()
    sync.reset(torch.randn(d, generator=gen))

    def step(node=1, st=state):
        content = RecordDict()
        sync.write(content, node)
        x, version, epoch = client_sync(content, st, layout)
        save_replica(st, x, version, epoch)
        sync.ack(node)
        assert torch.equal(x, sync.x) and version == sync.version
        return content[SYNC]["mode"]

    assert step() == "full"
    assert step() == "none"
    sparse = torch.zeros(d)
    sparse[[3, 77, 1999]] = torch.tensor([0.5, -1.0, 2.0])
    sync.commit(sparse)
    assert step() == "sparse"
    codec = make_codec("sign")
    for _ in range(2):  # dense 1-bit coded updates: replaying the payloads is cheapest
        payload = codec.encode(torch.randn(1, d, generator=gen), layout)
        sync.commit(codec.decode(payload, layout)[0], payload)
    assert step() == "updates"
    for _ in range(3):  # more updates than the history keeps: the full model again
        payload = codec.encode(torch.randn(1, d, generator=gen), layout)
        sync.commit(codec.decode(payload, layout)[0], payload)
    assert step() == "full"
    sync.commit(sparse)
    with pytest.raises(RuntimeError, match=REPLICA_LOST):  # a node that lost its state
        step(st=RecordDict())
    sync.forget(1)
    assert step(st=RecordDict()) == "full"


def test_the_model_comes_back_shaped_like_the_input():
    from flwr.app import Array, ArrayRecord

    strategy = CompressedFedAvg(LAYOUT, codec="none")
    rec = ArrayRecord({"w": Array(np.arange(12, dtype=np.float32).reshape(4, 3)),
                       "b": Array(np.ones(4, np.float32))})
    strategy._ensure_model(rec)
    out = strategy.model_arrays()
    assert list(out.keys()) == ["w", "b"] and out["w"].numpy().shape == (4, 3)
    assert np.array_equal(out["w"].numpy(), rec["w"].numpy())


@pytest.mark.integration
@pytest.mark.slow
def test_two_phase_round_on_flowers_simulation_engine(store):
    """Sketched-SGD's second exchange inside a round goes through Flower's own Grid (Ray)."""
    from fedswarm.sim.flower_engine import run_flower

    cfg = RunConfig(strategy="sketched_sgd", clients=2, rounds=2, seed=1, engine="flower",
                    params=PARAMS["sketched_sgd"])
    rid = store.create_run(cfg.model_dump())
    assert run_flower(cfg, store=store, run_id=rid) == "finished", store.get_run(rid).error
    rounds = store.export_result(rid)["rounds"]
    assert rounds[-1]["test_accuracy"] > 0.5 and all(r["rejected"] == 0 for r in rounds[1:])


def test_bench_compression_writes_its_table(tmp_path, monkeypatch):
    from fedswarm.bench import compression as bench

    monkeypatch.setattr(bench, "TASK", "digits-mlp")  # a miniature of the quick run
    monkeypatch.setattr(bench, "CLIENTS", 3)
    monkeypatch.setattr(bench, "QUICK_ROUNDS", 1)
    monkeypatch.setattr(bench, "QUICK_ARMS", ("FedAvg fp32", "1-bit + EF"))
    rows = bench.run(tmp_path, quick=True)
    assert [r["arm"] for r in rows] == ["FedAvg fp32", "1-bit + EF"]
    assert json.loads((tmp_path / "compression.json").read_text())[1]["uplink_ratio_vs_fedavg"] > 5
    assert (tmp_path / "compression.png").stat().st_size > 1000
