"""A client whose local SGD diverges (non-finite model) on the batched engine: its reply is
rejected as on the in-process engine (the same rejections, the same reason, its node row
marked and without a loss), the others' aggregate goes on, and every round's model equals
the in-process engine's to 1e-5 (for the codecs that quantize or select, on all but the
coordinates a tie decided the other way: ``same_models_on_both_engines``' ``ties``).

The divergence: two clients' partitions hold infinite features (a task like digits-cnn4
whose training rows of partitions 6 and 7 of the 8-client iid split are inf), so their
first step's loss is NaN on both engines, every round, whatever the model. (lr 100 on a
device class also makes digits-cnn4 diverge, but from a trained model the overflow is
chaotic: one engine's client may reach NaN while the other's stays huge and finite.)"""

import dataclasses

import numpy as np
import pytest
import torch

from fedswarm.config import RunConfig
from fedswarm.store import Store
from fedswarm.tasks import TASKS
from fedswarm.tasks.partition import partition_indices
from fedswarm.tasks.staged import STAGED_TASKS
from tests.test_batched import _schedule, _trainer, same_models_on_both_engines


CLIENTS, POISONED = 8, (6, 7)


def _poisoned(task):
    """``task`` with the training rows of partitions ``POISONED`` (iid, ``CLIENTS``) set to inf."""
    def load_data(seed, test_fraction):
        data = task.load_data(seed, test_fraction)
        parts = partition_indices(data.train_y.numpy(), "iid", CLIENTS, seed)
        x = data.train_x.clone()
        for p in POISONED:
            x[parts[p]] = float("inf")
        assert bool(torch.isfinite(x[0]).all())  # the batched trainer pads batches with row 0
        return dataclasses.replace(data, train_x=x)

    return dataclasses.replace(task, name=task.name + "-inf", load_data=load_data)


@pytest.fixture(autouse=True)
def _tasks(monkeypatch):
    for name, task in STAGED_TASKS.items():
        monkeypatch.setitem(TASKS, name, task)
    monkeypatch.setitem(TASKS, "digits-cnn4-inf", _poisoned(STAGED_TASKS["digits-cnn4"]))


DIVERGING = dict(task="digits-cnn4-inf", clients=CLIENTS, rounds=2, local_steps=3, lr=0.1)
CASES = {
    "fedavg": dict(strategy="fedavg"),
    "fedavg-sampled-policy": dict(strategy="fedavg", fraction=0.5, rounds=3, devices="gpu:4,edge-wifi:4",
                                  policies={"edge-wifi": {"local_steps": 5, "batch_size": 8}}),
    "fedavg-one-step": dict(strategy="fedavg", local_steps=1),
    "fedavg-dp": dict(strategy="fedavg", dp="noise_multiplier=0.5,clip=0.5"),  # left out of the clipped sum too
    "progfed": dict(strategy="progfed", rounds=3, params={"stage_rounds": 1}),
    "pvt": dict(strategy="pvt", params={"fraction": 0.5}),
}


def _node_rows(engine: str, tmp_path) -> list[tuple]:
    store = Store(tmp_path / f"{engine}.db")
    try:
        (rid,) = [r.id for r in store.list_runs()]
        rows = [(n.round, n.node_id, n.status, n.reason, n.train_loss is None, n.bytes_up, n.num_examples)
                for n in store.node_rounds(rid)]
    finally:
        store.close()
    return sorted(rows)


@pytest.mark.parametrize("case", sorted(CASES))
def test_diverged_clients_are_rejected_as_inprocess_rejects_them(case, tmp_path, monkeypatch):
    kw = {**DIVERGING, **CASES[case]}
    _, _, pairs = same_models_on_both_engines(kw, tmp_path, monkeypatch)
    for r_ref, r_got in pairs:
        assert r_got["rejected_reasons"] == r_ref["rejected_reasons"]
        assert r_got["rejected"] == r_ref["rejected"]
        assert r_got["bytes_up"] == r_ref["bytes_up"]
        if r_ref["train_loss"] is not None:
            assert r_got["train_loss"] == pytest.approx(r_ref["train_loss"], abs=1e-5)
        else:
            assert r_got["train_loss"] is None
    assert sum(r["rejected"] for r, _ in pairs) > 0  # the edge-wifi clients did diverge
    assert all(set(r["rejected_reasons"].values()) <= {"parameter vector has non-finite values"} for r, _ in pairs)
    assert _node_rows("batched", tmp_path) == _node_rows("inprocess", tmp_path)


#: The compressed family: a diverged client's own codec step raises (its node fails, as a client
#: whose code raises does) or it sends a non-finite payload that the server refuses.
COMPRESSED = {
    "topk-fails": (dict(strategy="compressed_fedavg", params={"codec": "topk"}), "failed"),
    "onebit-codec-fails": (dict(strategy="compressed_fedavg", params={"codec": "onebit"}), "failed"),
    "onebit-fails": (dict(strategy="onebit"), "failed"),
    "gtopk-rejected": (dict(strategy="gtopk"), "rejected"),
    "fetchsgd-rejected": (dict(strategy="fetchsgd"), "rejected"),
    "median-rejected": (dict(strategy="median"), "rejected"),  # no error feedback: the server reads the NaNs
}


@pytest.mark.parametrize("case", sorted(COMPRESSED))
def test_diverged_clients_of_the_compressed_family_fail_or_are_refused_as_inprocess(case, tmp_path, monkeypatch):
    """The batched run goes on without them (it used to stop), with every round's model equal to
    the in-process one (to 1e-5 but where a quantizer's tie went the other way: see
    ``same_models_on_both_engines``' ``ties``), the same node statuses and reasons, the round's nodes_failed, and the
    others' bytes equal. (A failed node's error reply carries a traceback of the engine's own
    frames: its bytes are the batched engine's, a few dozen off the in-process reply's.)"""
    extra, status = COMPRESSED[case]
    # every codec here but the median's quantizes or selects: a tie may go either way (see ties)
    ref_res, got_res, pairs = same_models_on_both_engines({**DIVERGING, **extra}, tmp_path, monkeypatch,
                                                          ties=case != "median-rejected")
    ref_rows, got_rows = _node_rows("inprocess", tmp_path), _node_rows("batched", tmp_path)
    bad = {(rnd, node) for rnd, node, st, *_ in ref_rows if st != "ok"}
    assert {node for _, node in bad} == {str(p + 1) for p in POISONED} and {st for _, _, st, *_ in ref_rows} == {
        "ok", status}
    for a, b in zip(ref_rows, got_rows, strict=True):
        if (a[0], a[1]) in bad:  # round, node, status, the reason's first line; no loss
            assert b[:3] == a[:3] and b[3].splitlines()[0] == a[3].splitlines()[0] and b[4] == a[4]
            assert status == "failed" or b == a
        else:
            assert b == a
    for r_ref, r_got in pairs:
        assert r_got.get("nodes_failed") == r_ref.get("nodes_failed")
        assert r_got["rejected_reasons"] == r_ref["rejected_reasons"]
        assert r_got["train_loss"] == pytest.approx(r_ref["train_loss"], abs=1e-5)
        if status == "rejected":
            assert r_got["bytes_up"] == r_ref["bytes_up"]


@pytest.mark.parametrize("steps", [1, 3])
def test_average_leaves_out_a_diverged_client(steps):
    """``average``: a client whose model overflows (lr inf) is out of both sums and
    reported with its model; the rest equals the weighted sum of ``fit``'s finite models,
    also on the one-step shortcut (which redoes that chunk client by client)."""
    trainer, _ = _trainer()
    start = torch.randn(trainer.layout.d) * 0.1
    sched = _schedule(list(range(0, 40, 4)), steps=steps, bs=16, lr=0.3)
    sched.lr[3] = float("inf")
    weights = trainer.num_examples(sched.partitions).float()
    models = torch.cat([new for _, new, _, _ in trainer.fit(start, sched, chunk_size=4)])
    losses = torch.cat([loss for _, _, loss, _ in trainer.fit(start, sched, chunk_size=4)])
    finite = torch.isfinite(models).all(dim=1)
    assert finite.tolist() == [k != 3 for k in range(10)]
    w = weights.double() * finite
    oracle = (w.numpy()[:, None] * np.nan_to_num(models.double().numpy())).sum(axis=0)
    out = list(trainer.average(start, sched, weights, chunk_size=5))
    assert [sorted(o[5]) for o in out] == [[3], []]
    assert not bool(torch.isfinite(out[0][5][3]).all())
    np.testing.assert_allclose(sum(o[1] for o in out).numpy(), oracle, atol=2e-4)
    assert sum(o[4] for o in out) == pytest.approx(float((w * losses.double().nan_to_num()).sum()), rel=1e-5)


def test_a_run_where_every_client_diverges_keeps_its_model(tmp_path, monkeypatch):
    # seed 1: at seed 0 (and 2) one client of the counter-based minibatch draw stays finite (~2.5e7) at lr 100
    kw = dict(DIVERGING, task="digits-cnn4", strategy="fedavg", lr=100.0, local_steps=30, rounds=1, seed=1)
    ref = RunConfig(engine="inprocess", **kw)
    got = RunConfig(engine="batched", **kw)
    from tests.test_batched import _models

    a, ref_res = _models(ref, tmp_path, monkeypatch)
    b, got_res = _models(got, tmp_path, monkeypatch)
    assert torch.equal(b[0], b[1]) and torch.equal(a[1], b[1])
    assert got_res["rounds"][1]["rejected"] == ref_res["rounds"][1]["rejected"] == 8
