"""A node's own state on its disk (fedswarm.client.state_store, fedswarm.client.persist).

- a snapshot round-trips every record type bit for bit, and the newest one of a round at most
  the one asked for is the one loaded;
- writes are atomic: a temporary file left by a node killed mid-write is never read (and is
  cleared later); a truncated, altered, foreign or non-snapshot file is refused with a log
  line naming it, and the node then has no state;
- only the newest ``keep`` snapshots stay;
- the ClientApp's two halves: save after a train reply (keyed by the fedswarm run in the
  message's config), restore on the resume query, and say so when there is nothing.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict

from fedswarm.client.persist import answer_resume, save_after_train
from fedswarm.protocol import RESUME_ACTION, RESUME_RECORD, RUN_KEY
from fedswarm.client.state_store import STATE_DIR_ENV, ClientStateStore, state_dir_of


def _state(seed: int) -> RecordDict:
    rng = np.random.default_rng(seed)
    return RecordDict({
        "compressed.replica": ArrayRecord({"vector": Array(rng.standard_normal(257).astype(np.float32))}),
        "ef.residual": ArrayRecord({"r": Array(rng.standard_normal((3, 5)))}),
        "compressed.replica.meta": ConfigRecord({"version": seed, "epoch": "abc", "blob": b"\x00\x01",
                                                 "flags": [True, False]}),
        "stats": MetricRecord({"loss": 0.25 * seed, "n": 7}),
    })


def _same(a: RecordDict, b: RecordDict) -> None:
    assert list(a.keys()) == list(b.keys())
    for key in a.keys():
        ra, rb = a[key], b[key]
        if isinstance(ra, ArrayRecord):
            assert list(ra.keys()) == list(rb.keys())
            for k in ra.keys():
                x, y = ra[k].numpy(), rb[k].numpy()
                assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), (key, k)
        else:
            assert dict(ra) == dict(rb), key


def test_round_trip_and_the_newest_snapshot_at_most_the_round(tmp_path):
    store = ClientStateStore(tmp_path, "run/1", partition=2, keep=5)
    for rnd in (1, 2, 4):
        store.save(rnd, _state(rnd), node_id=100 + rnd)
    assert store.rounds() == [1, 2, 4]
    snap = store.load(3)  # the node sat out round 3: its state after round 3 is round 2's
    assert (snap.round, snap.node_id) == (2, 102)
    _same(snap.state, _state(2))
    assert store.load(4).round == 4 and store.load(99).round == 4
    assert store.load(0) is None
    assert ClientStateStore(tmp_path, "run/1", partition=1).load(4) is None  # another partition's folder
    assert ClientStateStore(tmp_path, "run-2", partition=2).load(4) is None  # another run's


def test_old_snapshots_are_pruned(tmp_path):
    store = ClientStateStore(tmp_path, "r", partition=0, keep=3)
    for rnd in range(1, 8):
        store.save(rnd, _state(rnd))
    assert store.rounds() == [5, 6, 7]
    assert sorted(p.name for p in store.folder.iterdir()) == [f"round-{r:08d}.state" for r in (5, 6, 7)]


def test_old_runs_state_is_removed_when_a_run_first_saves(tmp_path):
    """All but the keep_runs most recently written runs go when a run saves its first snapshot
    (this run counted, and kept); later saves of the run remove nothing more; 0 keeps all."""
    for age, run in enumerate(["r4", "r3", "r2", "r1"]):  # r1 written longest ago
        old = ClientStateStore(tmp_path, run, partition=0, keep_runs=0)
        path = old.save(1, _state(age))
        when = 1_000_000 - 1000 * age
        os.utime(path, (when, when))
    new = ClientStateStore(tmp_path, "new", partition=3, keep=3, keep_runs=3)
    new.save(1, _state(9))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new", "r3", "r4"]
    assert ClientStateStore(tmp_path, "r4", partition=0).load(1).round == 1  # what stays is intact
    stale = ClientStateStore(tmp_path, "r0", partition=0, keep_runs=0).save(1, _state(1))
    os.utime(stale, (1, 1))
    new.save(2, _state(10))  # not the run's first save: nothing removed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new", "r0", "r3", "r4"]
    ClientStateStore(tmp_path, "another", partition=0, keep_runs=0).save(1, _state(2))
    assert len(list(tmp_path.iterdir())) == 5
    with pytest.raises(ValueError, match="keep_runs"):
        ClientStateStore(tmp_path, "x", partition=0, keep_runs=-1)
    from fedswarm.client.persist import store_for  # the node config's state-keep-runs reaches the store

    ctx = Context(run_id=1, node_id=5, node_config={"state-dir": str(tmp_path), "partition-id": 0,
                                                    "state-keep-runs": 2}, state=RecordDict(), run_config={})
    assert store_for(ctx, "y").keep_runs == 2


def test_a_partial_temporary_file_is_never_read_and_is_cleared(tmp_path):
    store = ClientStateStore(tmp_path, "r", partition=0)
    store.save(1, _state(1))
    good = (store.folder / "round-00000001.state").read_bytes()
    # a node killed while writing round 2: a half-written temporary file of a dead process
    tmp = store.folder / ".tmp-999999999-round-00000002.state"
    tmp.write_bytes(good[: len(good) // 2])
    assert store.rounds() == [1]
    assert store.load(2).round == 1
    store.save(2, _state(2))
    assert not tmp.exists() and store.rounds() == [1, 2]


@pytest.mark.parametrize("damage", ["truncated", "flipped", "foreign", "not-a-snapshot", "bad-header"])
def test_a_corrupt_or_foreign_file_is_refused_with_a_log_line(tmp_path, caplog, damage):
    store = ClientStateStore(tmp_path, "r", partition=0)
    path = store.save(3, _state(3))
    data = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(data[:-10])
    elif damage == "flipped":
        path.write_bytes(data[:-5] + bytes([data[-5] ^ 0xFF]) + data[-4:])
    elif damage == "foreign":  # a whole, valid snapshot of another run, copied in
        other = ClientStateStore(tmp_path / "other", "q", partition=0).save(3, _state(3))
        path.write_bytes(other.read_bytes())
    elif damage == "not-a-snapshot":
        path.write_bytes(b"hello")
    else:
        path.write_bytes(data.split(b"\n", 1)[0] + b"\n{not json\n" + data.split(b"\n", 2)[2])
    with caplog.at_level(logging.WARNING, logger="fedswarm.client"):
        assert store.load(3) is None
    (line,) = [r.getMessage() for r in caplog.records]
    assert "refusing client state file" in line and str(path) in line
    expected = {"truncated": "truncated", "flipped": "checksum", "foreign": "belongs to run 'q'",
                "not-a-snapshot": "bad magic", "bad-header": "not JSON"}[damage]
    assert expected in line


def test_state_dir_comes_from_the_node_config_then_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(STATE_DIR_ENV, raising=False)
    assert state_dir_of({}) is None
    monkeypatch.setenv(STATE_DIR_ENV, str(tmp_path / "env"))
    assert state_dir_of({}) == tmp_path / "env"
    assert state_dir_of({"state-dir": str(tmp_path / "nc")}) == tmp_path / "nc"


def _context(tmp_path, partition: int = 1, node_id: int = 7) -> Context:
    return Context(run_id=1, node_id=node_id, node_config={"partition-id": partition, "num-partitions": 2,
                                                           "state-dir": str(tmp_path)},
                   state=RecordDict(), run_config={})


def _train_msg(rnd: int, run: str | None = "run-a") -> Message:
    conf = ConfigRecord({"server-round": rnd, "checkpoint_every": 1})
    if run is not None:
        conf[RUN_KEY] = run
    return Message(RecordDict({"config": conf}), dst_node_id=7, message_type="train")


def _resume_msg(rnd: int, run: str = "run-a") -> Message:
    return Message(RecordDict({RESUME_RECORD: ConfigRecord({"run": run, "round": rnd})}), dst_node_id=7,
                   message_type=f"query.{RESUME_ACTION}")


def _answer(msg: Message, ctx: Context) -> tuple[dict, dict]:
    reply = answer_resume(msg, ctx)
    return dict(reply.content.metric_records["metrics"]), dict(reply.content.config_records[RESUME_RECORD])


def test_the_clientapp_saves_after_each_round_and_restores_the_asked_round(tmp_path):
    ctx = _context(tmp_path)
    for rnd in (1, 2, 3):
        for key, rec in _state(rnd).items():
            ctx.state[key] = rec
        save_after_train(_train_msg(rnd), ctx)
    store = ClientStateStore(tmp_path, "run-a", 1)
    assert store.rounds() == [1, 2, 3]  # checkpoint_every=1: keep 3
    save_after_train(_train_msg(4, run=None), ctx)  # a run that keeps no node state (in-process engine)
    assert store.rounds() == [1, 2, 3]
    fresh = _context(tmp_path, node_id=8)  # the resumed run: a new Flower run, an empty Context.state
    info, extra = _answer(_resume_msg(2), fresh)
    assert info == {"partition-id": 1, "restored": 1, "round": 2} and extra["old-node-id"] == "7"
    _same(fresh.state, _state(2))
    info, extra = _answer(_resume_msg(2, run="run-b"), _context(tmp_path))
    assert info["restored"] == 0 and "no usable snapshot of a round <= 2" in extra["why"]
    no_dir = Context(run_id=1, node_id=9, node_config={"partition-id": 0}, state=RecordDict(), run_config={})
    os.environ.pop(STATE_DIR_ENV, None)
    info, extra = _answer(_resume_msg(2), no_dir)
    assert info["restored"] == 0 and "keeps no state on disk" in extra["why"]


def test_fedswarm_client_passes_its_state_dir_in_the_node_config(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from fedswarm.cli import app

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    args = ["client", "--superlink", "127.0.0.1:9093", "--insecure", "--device-class", "cpu", "--dry-run"]
    res = CliRunner().invoke(app, [*args, "--state-dir", str(tmp_path / "mine")])
    assert res.exit_code == 0, res.output
    assert f'state-dir="{tmp_path / "mine"}"' in res.output
    res = CliRunner().invoke(app, args)  # default: the per-user data folder
    assert f'state-dir="{tmp_path / "data" / "fedswarm" / "client-state"}"' in res.output
    assert "state-keep-runs=5" in res.output
    res = CliRunner().invoke(app, [*args, "--state-keep-runs", "0"])
    assert res.exit_code == 0 and "state-keep-runs=0" in res.output
    res = CliRunner().invoke(app, [*args, "--state-keep-runs", "-1"])
    assert res.exit_code != 0
