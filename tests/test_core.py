"""Core contracts: flat parameters, wire sizes, config validation, the store, partitions."""

import json

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

from fedswarm.config import RunConfig
from fedswarm.errors import ConfigError
from fedswarm.params import ParamLayout, get_flat, set_flat
from fedswarm.strategies import registry
from fedswarm.tasks import get_task
from fedswarm.tasks.partition import partition_indices
from fedswarm.payload import Payload, PayloadError
from fedswarm.wire import (arrayrecord_to_vector, message_nbytes, payload_from_records, payload_to_records,
                           vector_to_arrayrecord)
from fedswarm.server.metered_grid import serialized_size


def test_flat_round_trip_and_no_aliasing():
    model = get_task("digits-cnn").model(0)
    layout = ParamLayout.from_module(model)
    flat = get_flat(model)
    assert flat.shape == (layout.d,) == (sum(p.numel() for p in model.parameters()),)
    new = torch.randn(layout.d)
    set_flat(model, new)
    assert torch.equal(get_flat(model), new)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    assert not torch.equal(get_flat(model), new), "parameters must not alias the vector"
    # views agree with the module's own tensors, also with a leading client axis
    batch = torch.stack([new, 2 * new])
    for name, p in model.named_parameters():
        assert layout.view(batch, name).shape == (2, *p.shape)
    assert ParamLayout.from_dict(json.loads(json.dumps(layout.to_dict()))) == layout


def test_matrix_shapes():
    layout = ParamLayout.from_module(get_task("digits-cnn").model(0))
    conv = layout["0.weight"]
    assert conv.shape == (16, 1, 3, 3) and conv.matrix_shape == (16, 9)
    assert layout["0.bias"].matrix_shape == (16, 1)


def test_message_bytes_are_serialized_bytes():
    vec = torch.randn(10_000)
    content = RecordDict({"arrays": vector_to_arrayrecord(vec), "metrics": MetricRecord({"num-examples": 3})})
    msg = Message(content, dst_node_id=7, message_type="train")
    n = message_nbytes(msg)
    assert 40_000 < n < 40_000 + 1_000
    assert serialized_size(msg) == n
    assert serialized_size(msg, {}) == n


def test_vector_record_checks():
    rec = vector_to_arrayrecord(torch.arange(5.0))
    assert torch.equal(arrayrecord_to_vector(rec, 5), torch.arange(5.0))
    with pytest.raises(PayloadError, match="has 5 values, the model has 6"):
        arrayrecord_to_vector(rec, 6)
    with pytest.raises(PayloadError, match="non-finite"):
        arrayrecord_to_vector(vector_to_arrayrecord(torch.tensor([1.0, float("nan")])))


def test_payload_round_trip_and_rejection():
    p = Payload({"bits": np.arange(4, dtype=np.uint8), "scale": np.ones(2, np.float32)}, {"codec": "x", "d": 4})
    back = payload_from_records(payload_to_records(p))
    assert back.meta == {"codec": "x", "d": 4} and np.array_equal(back.arrays["bits"], p.arrays["bits"])
    bad = Payload({"v": np.array([1.0, np.inf], np.float32)}, {})
    with pytest.raises(PayloadError, match="non-finite"):
        payload_from_records(payload_to_records(bad))
    with pytest.raises(PayloadError, match="limit"):
        payload_from_records(payload_to_records(p), max_bytes=4)
    with pytest.raises(PayloadError, match="no 'payload'"):
        payload_from_records(RecordDict({"x": ConfigRecord({"a": 1})}))


@pytest.mark.parametrize("values, key", [
    ({"clients": 0}, "clients"),
    ({"rounds": -1}, "rounds"),
    ({"fraction": 1.5}, "fraction"),
    ({"partition": "dirichlet:0"}, "partition"),
    ({"partition": "banana"}, "partition"),
    ({"partition": "dominant:0"}, "partition"),
    ({"partition": "dominant:1.5"}, "partition"),
    ({"lr": 0}, "lr"),
    ({"engine": "warp"}, "engine"),
    ({"device": "tpu"}, "device"),
    ({"colour": "red"}, "colour"),
])
def test_config_errors_name_the_key(values, key):
    with pytest.raises(ConfigError) as err:
        RunConfig.build(values)
    assert f"'{key}'" in str(err.value) and "\n" not in str(err.value)


def test_config_flat_round_trip():
    cfg = RunConfig.build({"clients": 7, "partition": "dirichlet:0.3", "params": {"k": 2}})
    assert RunConfig.from_flat(cfg.to_flat()) == cfg


def test_registry_params():
    assert "fedavg" in registry.names()
    with pytest.raises(ConfigError, match="unknown strategy 'nope'"):
        registry.get("nope")
    with pytest.raises(ConfigError, match="unknown parameter 'x' for strategy 'fedavg'"):
        registry.resolve_params("fedavg", {"x": 1})
    hp = registry.HyperParam("ratio", 0.01, "fraction kept", gt=0.0, le=1.0)
    assert hp.check("0.5", "topk") == 0.5
    with pytest.raises(ConfigError, match="'topk.ratio'.*> 0.0"):
        hp.check(0, "topk")


def test_store_round_trip(store):
    rid = store.create_run(RunConfig(rounds=2).model_dump())
    store.set_status(rid, "running")
    store.add_round(rid, 0, test_accuracy=0.1, test_loss=2.0)
    store.add_round(rid, 1, test_accuracy=0.7, test_loss=1.0, train_loss=1.2, bytes_up=100, bytes_down=200,
                    wall_s=0.5, consensus_distance=0.25)
    store.add_node_rounds(rid, 1, [{"node_id": "1", "bytes_up": 100, "num_examples": 3}])
    cid = store.add_control(rid, "pause", actor="alice")
    assert [c.id for c in store.pending_controls(rid)] == [cid]
    store.mark_applied(cid)
    assert store.pending_controls(rid) == []
    store.set_status(rid, "finished")
    res = store.export_result(rid)
    assert res["rounds"][1]["consensus_distance"] == 0.25
    assert res["summary"]["final_test_accuracy"] == 0.7
    assert res["summary"]["total_bytes_up"] == 100 and res["summary"]["total_bytes_down"] == 200
    assert res["summary"]["rounds"] == 1
    assert {e.kind for e in store.events(rid)} >= {"created", "status", "control.pause"}
    with pytest.raises(ValueError, match="unknown control"):
        store.add_control(rid, "explode")


def test_store_opens_while_another_process_creates_its_tables(tmp_path):
    """A swarm's peers, a run and its poller open one new SQLite store at the same moment:
    a table that another process creates between the check and the CREATE must not make
    the open fail (it did: "table runs already exists")."""
    import sqlite3

    from sqlalchemy import event
    from sqlalchemy.schema import CreateTable

    from fedswarm.store import Base, Store

    path = tmp_path / "shared.db"
    runs = Base.metadata.tables["runs"]

    def another_process_creates_it_first(table, connection, **_):
        with sqlite3.connect(path) as other:
            other.execute(str(CreateTable(table).compile(dialect=connection.dialect)))

    event.listen(runs, "before_create", another_process_creates_it_first, once=True)
    try:
        store = Store(path)
    finally:
        if event.contains(runs, "before_create", another_process_creates_it_first):
            event.remove(runs, "before_create", another_process_creates_it_first)
    rid = store.create_run(RunConfig(rounds=1).model_dump())
    assert store.get_run(rid) is not None
    store.close()


def test_partitions_cover_the_pool():
    labels = np.random.default_rng(0).integers(0, 10, 1000)
    for spec in ("iid", "dirichlet:0.5", "dirichlet:0.05", "shards:2", "dominant:0.8"):
        parts = partition_indices(labels, spec, 20, seed=1)
        idx = np.concatenate(parts)
        assert len(parts) == 20 and all(len(p) > 0 for p in parts)
        assert len(np.unique(idx)) == len(idx) <= 1000
        if spec == "iid":
            assert len(idx) == 1000
    # label skew: dirichlet with small alpha concentrates labels
    skew = partition_indices(labels, "dirichlet:0.05", 20, seed=1)
    top_share = np.mean([np.bincount(labels[p], minlength=10).max() / len(p) for p in skew])
    assert top_share > 0.6
    assert partition_indices(labels, "iid", 20, seed=1)[0].tolist() == partition_indices(labels, "iid", 20,
                                                                                         1)[0].tolist()


@pytest.mark.parametrize("frac", [0.8, 0.5, 1.0])
@pytest.mark.parametrize("clients", [10, 25])
def test_dominant_partition_gives_each_client_its_class_share(frac, clients):
    """dominant:P (Homogeneous Learning's split): client k draws P of its examples from class
    k mod C (classes sorted) and the rest from the other classes, no example twice; on the
    uneven digits labels with P = 1 a class too small for its clients' equal sizes shrinks
    them instead of breaking the fraction."""
    from sklearn.datasets import load_digits

    labels = load_digits().target + 3  # classes 3..12: the dominant class is by rank, not by value
    classes = np.unique(labels)
    parts = partition_indices(labels, f"dominant:{frac}", clients, seed=4)
    idx = np.concatenate(parts)
    assert len(parts) == clients and len(np.unique(idx)) == len(idx)
    for k, part in enumerate(parts):
        own = int((labels[part] == classes[k % len(classes)]).sum())
        assert part.size > 0 and abs(own / part.size - frac) <= 1.0 / part.size, (k, own, part.size)
        assert part.size <= len(labels) // clients + 1
    if frac < 1:  # the classes' pools suffice: equal sizes, nearly every example used
        assert min(p.size for p in parts) >= len(labels) // clients - 1
        assert len(idx) >= len(labels) - clients
    assert [p.tolist() for p in parts] == [p.tolist() for p in partition_indices(labels, f"dominant:{frac}",
                                                                                 clients, seed=4)]
    assert parts[0].tolist() != partition_indices(labels, f"dominant:{frac}", clients, seed=5)[0].tolist()
    with pytest.raises(ValueError, match="cannot split"):
        partition_indices(labels[:5], f"dominant:{frac}", 6, seed=0)


def test_logreg_oracle_is_the_optimum():
    task = get_task("synthetic-logreg")
    data = task.load_data(0, 0.2)
    theta = torch.tensor(task.extra["optimum"](data.train_x.numpy(), data.train_y.numpy()), dtype=torch.float32)
    model = task.model(0)
    set_flat(model, theta)
    loss = task.objective(model, data.train_x, data.train_y)
    (grad,) = torch.autograd.grad(loss, [model.weight])
    assert grad.abs().max() < 1e-5


def test_digits_read_without_sklearn_are_sklearns_digits():
    """The digits CSV read directly (no scikit-learn import) is exactly what scikit-learn's loader gives,
    and loading a digits task leaves scikit-learn unimported (a fresh interpreter checks it)."""
    import subprocess
    import sys

    from sklearn.datasets import load_digits

    from fedswarm.tasks.builtin import digits_arrays

    data, target = digits_arrays()
    oracle = load_digits()
    assert data.shape == (1797, 64) and np.array_equal(data, oracle.data)
    assert target.dtype == np.int64 and np.array_equal(target, oracle.target)
    code = ("import sys; from fedswarm.tasks import get_task; d = get_task('digits-mlp').load_data(0, 0.2); "
            "assert d.train_x.shape[1] == 64; print('sklearn' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
