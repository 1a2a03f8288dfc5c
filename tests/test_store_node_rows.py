"""One row per node per round, kept by the database; a round and its node rows in one commit.

On SQLite and on a real PostgreSQL (started on loopback by :mod:`fedswarm.bench.postgres`;
those cases skip, saying why, without the server binaries or ``psycopg``): the unique index
refuses a duplicate written by raw SQL, the migration of a store from before it deletes the
duplicates it finds (the oldest row of each kept, the count logged), the store's writes are
idempotent under it, and a crash injected into the node-row insert of the recorder's round
leaves neither the round nor its rows.
"""

from __future__ import annotations

import logging
import uuid

import pytest
from flwr.app import Message, MetricRecord, RecordDict
from sqlalchemy import event
from sqlalchemy.exc import IntegrityError

from fedswarm.config import RunConfig
from fedswarm.server.metered_grid import Traffic
from fedswarm.server.recorder import RoundRecorder
from fedswarm.store import NodeRound, RowConflict, Store
from fedswarm.store.schema import NODE_ROUND_KEY


@pytest.fixture(scope="module")
def pg_port():
    pytest.importorskip("psycopg", reason="PostgreSQL driver missing: pip install 'psycopg[binary]'")
    from fedswarm.bench.postgres import pg_bindir, temp_postgres

    if pg_bindir() is None:
        pytest.skip("PostgreSQL server binaries missing: apt-get install -y postgresql")
    with temp_postgres() as port:
        yield port


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request, tmp_path) -> str:
    """A fresh store's URL on each backend."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'store.db'}"
    from fedswarm.bench.postgres import create_database

    return create_database(request.getfixturevalue("pg_port"), f"t_{uuid.uuid4().hex[:12]}")


def _raw_insert(store: Store, run_id: str, round: int, node_id: str, bytes_up: int) -> None:
    """A node row written past the store's methods (as an old fedswarm or another tool would)."""
    with store.engine.begin() as conn:
        conn.exec_driver_sql(
            "INSERT INTO node_rounds (run_id, round, node_id, bytes_up, bytes_down, policy, status) "
            f"VALUES ('{run_id}', {round}, '{node_id}', {bytes_up}, 0, '{{}}', 'ok')")


def _run(store: Store) -> str:
    rid = store.create_run(RunConfig(rounds=2).model_dump())
    store.add_round(rid, 1, test_accuracy=0.5)
    return rid


def test_the_database_refuses_a_second_row_of_a_node_in_a_round(url):
    store = Store(url)
    try:
        rid = _run(store)
        _raw_insert(store, rid, 1, "a", 10)
        _raw_insert(store, rid, 2, "a", 10)  # the same node in another round,
        _raw_insert(store, rid, 1, "b", 10)  # another node in the same round: both fine
        with pytest.raises(IntegrityError):
            _raw_insert(store, rid, 1, "a", 11)
        assert sorted((n.round, n.node_id) for n in store.node_rounds(rid)) == [(1, "a"), (1, "b"), (2, "a")]
    finally:
        store.close()


def test_migration_of_an_old_store_keeps_one_row_of_each_and_logs_the_rest(url, caplog):
    store = Store(url)
    rid = _run(store)
    with store.engine.begin() as conn:  # the store as an older fedswarm left it: no unique index
        conn.exec_driver_sql(f"DROP INDEX {NODE_ROUND_KEY}")
    for node_id, bytes_up in [("a", 1), ("a", 2), ("b", 3), ("a", 4), ("c", 5), ("b", 6)]:
        _raw_insert(store, rid, 1, node_id, bytes_up)
    _raw_insert(store, rid, 2, "a", 7)
    store.close()
    with caplog.at_level(logging.WARNING, logger="fedswarm.store"):
        store = Store(url)
    try:
        [msg] = [r.getMessage() for r in caplog.records if r.name == "fedswarm.store"]
        assert "deleted 3 duplicate node_rounds rows" in msg
        # the oldest row of each (run, round, node) is the one kept
        assert sorted((n.round, n.node_id, n.bytes_up) for n in store.node_rounds(rid)) == [
            (1, "a", 1), (1, "b", 3), (1, "c", 5), (2, "a", 7)]
        with pytest.raises(IntegrityError):
            _raw_insert(store, rid, 1, "c", 8)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="fedswarm.store"):
            Store(url).close()  # a second open finds the index and changes nothing
        assert not [r for r in caplog.records if r.name == "fedswarm.store"]
    finally:
        store.close()


def test_node_rows_sent_again_are_done_and_a_conflicting_one_is_named(url):
    store = Store(url)
    try:
        rid = _run(store)
        rows = [{"node_id": "a", "bytes_up": 3, "train_loss": 0.25, "policy": {"local_steps": 2}},
                {"node_id": "b", "status": "failed", "reason": "timeout"}]
        store.add_node_rounds(rid, 1, rows)
        store.add_node_rounds(rid, 1, rows)  # a retry of a write that had in fact succeeded
        store.add_node_rounds(rid, 1, rows[:1] + [{"node_id": "c"}])  # one held, one new
        [rnd] = store.rounds(rid)
        assert (rnd.node_rows, rnd.failed_node_rows) == (3, 1)  # counted once each
        with pytest.raises(RowConflict, match=r"node 'a' of round 1 of run '\w+'.*train_loss: 0\.25 held, 0\.5 sent"):
            store.add_node_rounds(rid, 1, [{"node_id": "d"}, {**rows[0], "train_loss": 0.5}])
        with pytest.raises(RowConflict, match="node 'e' of round 1"):  # twice in one write, differing
            store.add_node_rounds(rid, 1, [{"node_id": "e", "bytes_up": 1}, {"node_id": "e", "bytes_up": 2}])
        assert sorted((n.node_id, n.train_loss) for n in store.node_rounds(rid)) == [
            ("a", 0.25), ("b", None), ("c", None)]  # the refused writes left nothing, "d" included
        assert store.rounds(rid)[0].node_rows == 3
    finally:
        store.close()


def _reply(node: int, loss: float) -> Message:
    sent = Message(RecordDict({}), dst_node_id=node, message_type="train")
    reply = Message(RecordDict({"metrics": MetricRecord({"num-examples": 5, "train_loss": loss})}), reply_to=sent)
    reply.metadata.__dict__["_src_node_id"] = node
    return reply


class _Grid:
    """The recorder's grid: one round's replies from nodes 1 and 2."""

    def take(self) -> Traffic:
        return Traffic(replies=[_reply(1, 0.5), _reply(2, 0.7)], node_up={1: 10, 2: 20})


def test_a_crash_in_the_node_rows_leaves_neither_the_round_nor_its_rows(url):
    """The recorder writes a round, its node rows and its rejections in one transaction: a
    node-row insert that fails (the process dying there) leaves none of them; the round
    recorded again afterwards is whole."""
    store = Store(url)
    try:
        rid = store.create_run(RunConfig(rounds=2).model_dump())
        rec = RoundRecorder(store, rid, _Grid(), None)  # type: ignore[arg-type]

        def crash(*_):
            raise RuntimeError("crashed while writing the node rows")

        rec.reject("2", "too large")
        event.listen(NodeRound, "before_insert", crash)
        try:
            with pytest.raises(RuntimeError, match="crashed while writing"):
                rec(1, None)  # type: ignore[arg-type]
        finally:
            event.remove(NodeRound, "before_insert", crash)
        assert store.rounds(rid) == [] and store.node_rounds(rid) == [] and store.rejections(rid) == []
        rec.reject("2", "too large")
        rec(1, None)  # type: ignore[arg-type]
        [rnd] = store.rounds(rid)
        assert (rnd.node_rows, rnd.failed_node_rows) == (2, 1)
        assert [(n.node_id, n.bytes_up, n.status) for n in store.node_rounds(rid)] == [
            ("1", 10, "ok"), ("2", 20, "rejected")]
        assert [(r.node_id, r.reason) for r in store.rejections(rid)] == [("2", "too large")]
    finally:
        store.close()


@pytest.mark.parametrize("cfg", [
    dict(engine="batched", strategy="fedavg", clients=12, local_steps=1),
    dict(engine="array", strategy="squarm", clients=4, params={"period": 2, "ratio": 0.05}),
    dict(engine="clock", strategy="lsgd", clients=4, topology="complete",
         params={"mode": "async", "groups": 2, "tau_local": 2, "tau_global": 3}),
], ids=lambda c: c["engine"])
def test_engines_that_make_their_own_node_rows_write_them_with_their_round(cfg, tmp_path):
    """The batched, array and virtual-clock engines build each round's node rows themselves
    and hand them to the recorder, which writes them in the round's transaction: every
    round's counters (set only when its row exists as the rows are written) match its rows."""
    from fedswarm.sim.run import run_engine

    config = RunConfig(task="digits-mlp", rounds=2, lr=0.1, batch_size=8, seed=1, **cfg)
    store = Store(tmp_path / "store.db")
    try:
        rid = store.create_run(config.model_dump())
        assert run_engine(config, store=store, run_id=rid) == "finished"
        per_round = {r: sum(1 for n in store.node_rounds(rid) if n.round == r) for r in (1, 2)}
        assert per_round == {1: config.clients, 2: config.clients}
        assert {r.round: r.node_rows for r in store.rounds(rid) if r.round > 0} == per_round
    finally:
        store.close()
