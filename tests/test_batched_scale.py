"""The batched engine at scale: the cohort's bookkeeping as arrays gives what the per-client
definitions give (round seeds, varint lengths, schedules, measured byte sizes, traffic and
node rows), the batched federated evaluation gives each node's own scoring
(:func:`fedswarm.train.evaluate_flat` on :func:`fedswarm.train.node_validation`, node by node),
and a large population runs with nothing per client of the population."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord

from fedswarm.config import RunConfig, round_seed
from fedswarm.policy import PolicyBook
from fedswarm.server.fed_eval import aggregate
from fedswarm.server.metered_grid import Traffic
from fedswarm.sim.batched_round import (ByteCounter, add_client, add_clients, cohort_rows, cohort_schedule,
                                        round_schedule, round_seeds, varint_len, varint_lens)
from fedswarm.wire import vector_to_arrayrecord


def _train_config(cfg: RunConfig) -> ConfigRecord:
    tc = ConfigRecord({k: v for k, v in cfg.to_flat().items() if k != "policies"})
    PolicyBook(cfg.policies).write(tc)
    return tc


def test_round_seeds_and_varint_lengths_are_the_scalar_definitions():
    pids = np.array([0, 1, 126, 127, 128, 16383, 16384, 999_999, 2**31 - 2, 2**40, 2**62], dtype=np.int64)
    for seed, rnd in [(0, 1), (7, 3), (123_456, 999), (2**40, 12)]:
        got = round_seeds(seed, rnd, pids).tolist()
        assert got == [round_seed(seed, rnd, int(p)) for p in pids]
    assert varint_lens(pids).tolist() == [varint_len(int(p)) for p in pids]


def _per_client_schedule(cfg, node_ids, tc, n_examples, rnd):
    """round_schedule's per-client reading, written out one client at a time (the oracle)."""
    from fedswarm.policy import DEFAULT_CLASS, policy_for
    from fedswarm.timemodel import parse_devices

    every = parse_devices(cfg.devices, cfg.clients) if cfg.devices else [DEFAULT_CLASS] * cfg.clients
    out = []
    for node in node_ids:
        pid = node - 1
        pol = policy_for(tc, every[pid])
        bs = int(pol.get("batch_size", cfg.batch_size))
        fixed = pol.get("local_steps", None if "local_epochs" in pol else cfg.local_steps)
        n = int(n_examples[pid])
        steps = fixed if fixed is not None else int(pol.get("local_epochs", cfg.local_epochs)) * max(1, -(-n // bs))
        out.append((pid, steps, bs, float(np.float32(pol.get("lr", cfg.lr))), round_seed(cfg.seed, rnd, pid),
                    every[pid], pol))
    return out


@pytest.mark.parametrize("devices", [None, "gpu:3,edge-lte:5,edge-wifi"])
def test_cohort_schedule_is_each_clients_reading_of_its_policy(devices):
    cfg = RunConfig(clients=20, seed=5, local_steps=None, local_epochs=2, batch_size=4, devices=devices,
                    policies={"edge-lte": {"local_steps": 3, "lr": 0.05}, "gpu": {"batch_size": 8}})
    tc = _train_config(cfg)
    n_examples = np.arange(20) % 7 + 1
    nodes = random.Random(1).sample(range(1, 21), 12)
    sched, classes, pols = round_schedule(cfg, nodes, tc, n_examples, 4)
    want = _per_client_schedule(cfg, nodes, tc, n_examples, 4)
    got = list(zip(sched.partitions.tolist(), sched.steps.tolist(), sched.batch_size.tolist(), sched.lr.tolist(),
                   sched.seeds.tolist(), classes, pols))
    assert got == want
    if devices:
        assert len(set(classes)) == 3


def test_cohort_sizes_are_the_sizes_measured_client_by_client():
    cfg = RunConfig(clients=300, seed=1, devices="gpu:100,edge-lte", policies={"edge-lte": {"local_steps": 2}})
    tc = _train_config(cfg)
    n_examples = np.arange(300) % 5 + 1
    nodes = list(range(1, 301))[::-1][:250]  # ids across the one- and two-byte varints
    cohort = cohort_schedule(cfg, nodes, tc, n_examples, 130)
    vec = torch.zeros(50)
    arrays = vector_to_arrayrecord(vec)
    down, up = ByteCounter(tc).cohort_sizes(arrays, vec, np.array(nodes), n_examples[np.array(nodes) - 1],
                                            cohort.sched.steps.numpy(), cohort, 130)
    oracle = ByteCounter(tc)
    want = [oracle.sizes(arrays, vec, node, node - 1, int(n_examples[node - 1]), int(s), 0.5, c,
                         json.dumps(p, sort_keys=True), 130)
            for node, s, c, p in zip(nodes, cohort.sched.steps.tolist(), cohort.classes(), cohort.policies())]
    assert list(zip(down.tolist(), up.tolist())) == want
    assert len({w for w in want}) > 2  # the keys do tell sizes apart


def test_bulk_traffic_and_rows_are_add_client_one_by_one():
    nodes = [5, 3, 9, 1]
    up, down = np.array([10, 20, 30, 40]), np.array([1, 2, 3, 4])
    n, loss, classes = [1, 2, 3, 4], [0.1, 0.2, 0.3, 0.4], ["a", "b", "a", "b"]
    pols = [{"x": 1}, {}, {"x": 1}, {}]
    want_t, want_rows = Traffic(), []
    for i in range(4):
        add_client(want_t, want_rows, nodes[i], int(up[i]), int(down[i]), n[i], loss[i], classes[i], pols[i])
    got_t = Traffic()
    add_clients(got_t, nodes, up, down)
    assert (got_t.bytes_up, got_t.bytes_down, dict(got_t.node_up), dict(got_t.node_down)) == \
        (want_t.bytes_up, want_t.bytes_down, dict(want_t.node_up), dict(want_t.node_down))
    assert cohort_rows(nodes, up, down, n, loss, classes, pols) == want_rows
    add_clients(got_t, [5], np.array([1]), np.array([1]))  # a node seen again adds up
    assert got_t.node_up[5] == 11 and got_t.bytes_up == 101


def _evaluator(cfg):
    from fedswarm.params import get_flat
    from fedswarm.sim.batched_eval import CohortEvaluator
    from fedswarm.tasks import get_task
    from fedswarm.train import evaluate_flat, node_validation, task_data

    task = get_task(cfg.task)
    model = task.model(cfg.seed)
    data = task_data(cfg)

    def on_partition(pid, vec):
        x, y = node_validation(cfg, pid, cfg.clients)
        return (*evaluate_flat(task, model, vec, x, y, torch.device("cpu")), int(x.shape[0]))

    vec = get_flat(model) + 0.3 * torch.randn(get_flat(model).shape, generator=torch.Generator().manual_seed(0))
    return CohortEvaluator(cfg, task, model, torch.device("cpu"), data.test_x, data.test_y, on_partition), \
        on_partition, vec


@pytest.mark.parametrize("task,clients", [("digits-mlp", 7), ("synthetic-logreg", 13), ("digits-mlp", 1000)])
def test_batched_federated_evaluation_is_each_nodes_own_scoring(task, clients):
    cfg = RunConfig(task=task, clients=clients, seed=3)
    ev, on_partition, vec = _evaluator(cfg)
    assert ev.batched
    cohort = sorted(random.Random(2).sample(range(1, clients + 1), min(clients, 300) - 2))
    want = {str(c): on_partition(c - 1, vec) for c in cohort}
    got = ev(1, vec, cohort)
    assert set(got) == set(want)
    for node, (loss, acc, n) in want.items():
        g = got[node]
        assert g["fed_examples"] == n
        assert abs(g["fed_accuracy"] - acc) <= 1e-6 and abs(g["fed_loss"] - loss) <= 1e-5 * max(1.0, abs(loss))
    # a cohort too large for node rows: the round's figures from arrays, aggregate()'s
    ref = aggregate({k: {"fed_loss": lo, "fed_accuracy": a, "fed_examples": n} for k, (lo, a, n) in want.items()})
    figures = ev.round_figures(1, vec, np.array(cohort), None)
    assert figures["fed_examples"] == ref["fed_examples"]
    assert figures["fed_accuracy"] == pytest.approx(ref["fed_accuracy"], abs=1e-6)  # evaluate_flat: float32 means
    assert figures["fed_loss"] == pytest.approx(ref["fed_loss"], rel=1e-6)
    rows = [{"node_id": str(c)} for c in cohort]  # with rows: each node's values in its row
    assert ev.round_figures(1, vec, np.array(cohort), rows) == pytest.approx(figures)
    assert all(r["fed_examples"] == want[r["node_id"]][2] for r in rows)


def test_a_run_that_cannot_fit_is_refused_before_it_starts_with_the_fraction_that_fits():
    from fedswarm.errors import ConfigError
    from fedswarm.sim.batched import check_memory, memory_estimate

    cfg = RunConfig(engine="batched", task="digits-mlp", strategy="compressed_fedavg", clients=1_000_000,
                    fraction=0.5, rounds=4, local_steps=1)
    est = memory_estimate(cfg, available=10**12)
    d = 4810  # digits-mlp: 64 -> 64 -> 10, the residual a client keeps: d floats
    assert est.parts["client state"] == 1_000_000 * (4 * d + 16)  # every client has trained after 2 rounds
    refusal = r"needs an estimated 2\d\.\d GB .*client state.*it fits with --fraction "
    with pytest.raises(ConfigError, match=refusal) as e:
        check_memory(cfg, available=8 * 10**9)
    frac = float(str(e.value).split("--fraction ")[1].rstrip("."))
    assert memory_estimate(cfg.model_copy(update={"fraction": frac}), available=8 * 10**9).fits()
    assert not memory_estimate(cfg.model_copy(update={"fraction": 2 * frac}), available=8 * 10**9).fits()
    check_memory(cfg.model_copy(update={"fraction": frac}), available=8 * 10**9)  # passes
    # FedAvg keeps nothing per client: a million clients fit in a few hundred MB
    small = RunConfig(engine="batched", task="digits-mlp", clients=1_000_000, fraction=0.01, rounds=4, local_steps=1)
    assert memory_estimate(small, available=10**12).total < 10**9


def test_client_rows_hold_only_the_clients_with_state_and_read_back_what_was_kept():
    from fedswarm.sim.batched_round import ClientRows

    d, population = 6, 1_000_000
    rows, oracle = ClientRows(d, population), {}  # the oracle: each client's row by partition id, zeros when absent
    gen = torch.Generator().manual_seed(0)
    rng = random.Random(0)
    for _ in range(40):  # rounds of random cohorts, some clients seen again
        pids = rng.sample(range(0, 3000), rng.randint(1, 50)) + [population - 1]
        before = torch.stack([oracle.get(pid, torch.zeros(d)) for pid in pids])
        assert torch.equal(rows.stack(pids), before)
        after = before + torch.randn(len(pids), d, generator=gen)
        rows.keep_stacked(pids, after)
        oracle.update(zip(pids, after.clone()))
    assert len(rows) == len(oracle)  # only the clients that have state
    assert rows.nbytes() <= 4 * population + 2 * 4 * d * max(len(oracle), 16)
    assert torch.equal(rows.stack([population - 1, 5_000]), torch.stack([oracle[population - 1], torch.zeros(d)]))
    assert 5_000 not in rows and (population - 1) in rows
    with pytest.raises(ValueError, match="twice"):
        rows.keep_stacked([1, 1], torch.zeros(2, d))
