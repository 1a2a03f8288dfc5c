"""Availability windows as arrays over the nodes (issue 45: the first fleet round at 100,000 clients).

Oracles: the one-node queries (``session_end``, ``next_on``: a node's periods drawn one by one in
a loop) for the arrays (:meth:`Availability.at`, many nodes' periods drawn at once), on many
nodes, processes and seeds, forward and back in time; the definition written out again by hand
(splitmix64 in Python ints, tests/minibatch_oracle.py, each period from its draw); the laws the
periods must follow (on with probability on / (on + off), exponential lengths of the given means);
a trace's windows against the line-by-line reader and a hand merge of each node's windows.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedswarm.availability import Availability, OnOff, Trace, _parse_rows, _read_rows, load_trace
from fedswarm.errors import ConfigError
from tests.minibatch_oracle import MASK, splitmix_out, stream

PROCS = [OnOff(300.0, 200.0), OnOff(50.0, 900.0, diurnal=0.8, period=3000.0, dropout=0.1), None,
         OnOff(2000.0, 10.0, diurnal=0.3)]


def _one_node(av: Availability, pid: int, t: float, limit: float) -> tuple[bool, float]:
    end = av.session_end(pid, t)
    if end is not None:
        return True, end
    nxt = av.next_on(pid, t, limit)
    return False, math.inf if nxt is None else nxt


@pytest.mark.parametrize("seed", [0, 7, -3, 2**40 + 5])
def test_the_arrays_are_the_one_node_draws(seed):
    n = 240
    procs = [PROCS[i % len(PROCS)] for i in range(n)]
    arrays, one = Availability(n, processes=procs, seed=seed), Availability(n, processes=procs, seed=seed)
    times = [0.0, 0.0, 12.5, 400.0, 3_600.0, 1_000.0, 20_000.0, 20_000.0, 86_400.0, 7.0]  # back in time too
    for t in times:
        for limit in (365 * 86_400.0, 100.0):
            on, change = arrays.at(np.arange(n), t, limit)
            expect = [_one_node(one, pid, t, limit) for pid in range(n)]
            assert on.tolist() == [e[0] for e in expect], t
            assert change.tolist() == [e[1] for e in expect], t  # bit for bit
    # and every window drawn, in both
    assert [arrays._windows[p] for p in range(n)] == [one._windows[p] for p in range(n)]
    assert sum(len(arrays._windows[p]) for p in range(n)) > 20 * n  # many periods each


def test_a_subset_asked_in_any_order_gets_the_same_windows():
    n = 500
    procs = [PROCS[i % 2] for i in range(n)]
    whole, parts = Availability(n, processes=procs, seed=3), Availability(n, processes=procs, seed=3)
    order = np.random.default_rng(0).permutation(n)
    for t in (0.0, 5_000.0, 50_000.0):
        on, change = whole.at(np.arange(n), t)
        a_on, a_change = parts.at(order[:123], t)
        b_on, b_change = parts.at(order[123:], t)
        assert np.array_equal(on[order], np.concatenate([a_on, b_on]))
        assert np.array_equal(change[order], np.concatenate([a_change, b_change]))


def _u(seed: int, pid: int, k: int) -> float:
    """The definition's draw k of node pid, by hand: the counter-based hash of local SGD's sort keys
    (key(s, a, b) = output b of the stream at output a of the stream of s), over (seed, 0xA7A1, 0)."""
    def key(s, a, b):
        return stream(stream(splitmix_out(s & MASK), a), b)
    return ((key(key(seed, 0xA7A1, 0), pid, k) >> 11) + 0.5) * 2.0 ** -53


@pytest.mark.parametrize("seed", [0, 11, -1])
def test_the_windows_are_the_definition_written_by_hand(seed):
    n = 6
    procs = [OnOff(40.0, 60.0), OnOff(10.0, 30.0, diurnal=0.7, period=500.0), OnOff(5.0, 5.0)] * 2
    av = Availability(n, processes=procs, seed=seed)
    horizon = 2_000.0
    av.at(np.arange(n), horizon)
    for pid in range(n):
        p = procs[pid]
        on, t, k, windows = _u(seed, pid, 0) < p.on / (p.on + p.off), 0.0, 1, []
        while t <= horizon:
            mean = p.on if on else p.off * (1.0 + p.diurnal * float(np.cos(2 * math.pi * t / p.period)))
            end = t + mean * -float(np.log(_u(seed, pid, k)))
            if on:
                windows.append((t, end))
            on, t, k = not on, end, k + 1
        assert av._windows[pid] == windows, pid


def test_the_periods_follow_their_laws():
    n = 20_000
    av = Availability(n, processes=[OnOff(300.0, 700.0)] * n, seed=5)
    on, change = av.at(np.arange(n), 0.0)
    assert on.mean() == pytest.approx(0.3, abs=0.015)  # on at 0 with probability on / (on + off)
    # the first period is [0, change): exponential of mean on (on nodes) or off (off nodes)
    for lengths, mean in ((change[on], 300.0), (change[~on], 700.0)):
        sd = mean / math.sqrt(len(lengths))
        assert abs(lengths.mean() - mean) < 4 * sd
        assert (lengths > mean).mean() == pytest.approx(math.exp(-1), abs=0.025)  # P(X > mean) = 1/e
    # neighbouring nodes and seeds are not alike
    other = Availability(n, processes=[OnOff(300.0, 700.0)] * n, seed=6).at(np.arange(n), 0.0)[1]
    assert abs(np.corrcoef(change[:-1], change[1:])[0, 1]) < 0.05
    assert abs(np.corrcoef(change, other)[0, 1]) < 0.05


def _hand_merge(rows) -> dict[int, list[tuple[float, float]]]:
    out: dict[int, list[tuple[float, float]]] = {}
    for node, s, e in sorted(rows):
        ws = out.setdefault(node, [])
        if ws and s <= ws[-1][1]:
            ws[-1] = (ws[-1][0], max(ws[-1][1], e))
        else:
            ws.append((s, e))
    return out


def test_a_trace_is_read_in_one_parse_sorted_and_merged(tmp_path):
    rng = np.random.default_rng(1)
    n, rows = 40, []
    for _ in range(400):
        s = float(rng.integers(0, 500)) if rng.random() < 0.5 else float(rng.uniform(0, 500))
        rows.append((int(rng.integers(0, n - 3)), s, s + float(rng.choice([1.0, 2.5, rng.uniform(0.1, 30)]))))
    rows.append((5, 10.0, 20.0))
    rows.append((5, 20.0, 30.0))  # touching: one window
    path = tmp_path / "trace.csv"
    path.write_text("node,start_s,end_s\n" + "\n".join(f"{a},{b!r},{c!r}" for a, b, c in rows) + "\n\n")
    assert _parse_rows(path, n) is not None  # the one-parse path
    trace = load_trace(path, n)
    assert trace.windows() == _hand_merge(rows)
    assert any(a <= 10.0 and b >= 30.0 for a, b in trace.windows()[5])  # the touching pair is one
    # what numpy's parse does not take plainly goes line by line, to the same windows
    messy = tmp_path / "messy.csv"
    messy.write_text('node,start_s,end_s\n"3",1,2\n 3 , 2 ,4\n1_0,5,6\n')
    assert _parse_rows(messy, n) is None
    assert load_trace(messy, n).windows() == _hand_merge(zip(*_read_rows(messy, n))) == {3: [(1.0, 4.0)],
                                                                                          10: [(5.0, 6.0)]}
    empty = tmp_path / "empty.csv"
    empty.write_text("node,start_s,end_s\n")
    with pytest.raises(ConfigError, match="has no windows"):  # (refused: every node would be off for ever)
        load_trace(empty, n)


def test_a_trace_at_many_nodes_is_its_one_node_queries(tmp_path):
    windows = {0: [(10.0, 20.0), (30.0, 40.0)], 2: [(0.0, 5.0)], 3: [(100.0, 1e9)]}
    av = Availability(5, trace=windows)
    assert isinstance(av.trace, Trace) and av.trace.windows() == windows
    for t in (0.0, 4.9, 5.0, 10.0, 19.99, 20.0, 25.0, 40.0, 99.0, 100.0, 5e8, 2e9):
        for limit in (365 * 86_400.0, 10.0):
            on, change = av.at(np.arange(5), t, limit)
            assert list(zip(on.tolist(), change.tolist())) == [_one_node(av, p, t, limit) for p in range(5)], t


def test_a_batched_round_waits_for_the_first_node_to_come_on_as_inprocess(tmp_path):
    """No node on at the start: the round waits, in simulated time, for the first to come on (the
    batched fleet asks every node's next on-time at once), the in-process fleet grid's wait."""
    from fedswarm.config import RunConfig
    from fedswarm.sim.engines import run_engine
    from fedswarm.store import Store

    trace = tmp_path / "late.csv"
    trace.write_text("node,start_s,end_s\n0,400,1e9\n1,250,1e9\n2,900,1e9\n")
    waited = {}
    for engine in ("inprocess", "batched"):
        cfg = RunConfig(task="synthetic-logreg", clients=4, rounds=1, seed=0, local_steps=1, devices="edge-wifi:4",
                        availability=str(trace), engine=engine)
        store = Store(tmp_path / f"{engine}.db")
        rid = store.create_run(cfg.model_dump())
        run_engine(cfg, store=store, run_id=rid)
        (first,) = [r for r in store.rounds(rid) if r.round == 1]
        rows = {(r.node_id, r.status) for r in store.node_rounds(rid) if r.round == 1}
        waited[engine] = (first.sim_time_s, rows)
    assert waited["batched"][1] == waited["inprocess"][1]
    assert ("2", "ok") in waited["batched"][1]  # node 1 (partition 1), the first on, at 250 s
    assert waited["batched"][0] == pytest.approx(waited["inprocess"][0], rel=1e-6)  # (its own part: float32 sizes)
    assert 250.0 < waited["batched"][0] < 400.0
