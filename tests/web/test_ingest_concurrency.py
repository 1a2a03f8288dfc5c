"""Ingest under concurrency and retries: every acknowledged row stored exactly once.

The faults a loaded dashboard meets, each made to happen on purpose: a round whose node rows
fail to commit and whose retry comes back; a run registered twice at once (a timed-out
request and its retry); a node's first heartbeat and its retry at once. And the real thing,
small: 20 reporters with their own tokens against a real dashboard process for a few seconds
(the load of ``fedswarm bench ingest``), counted in the store afterwards.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import event, select

from dashboard_helpers import make_token
from fedswarm.store import NodeRound, Store


def bearer(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


def _round(r: int, nodes: int = 3) -> dict:
    return {"round": r, "test_accuracy": 0.5, "bytes_up": 10 * nodes,
            "nodes": [{"node_id": f"p{k}", "bytes_up": 10, "status": "failed" if k == 0 else "ok"}
                      for k in range(nodes)]}


def test_round_retried_after_its_node_rows_failed_is_stored_whole(app):
    """The node rows fail to commit (the store refuses once); the reporter's retry must store
    the round with all its rows, not be told 409 about a round left without them."""
    store = app.state.ctx.store
    token = make_token(app, "reporter")
    with TestClient(app, raise_server_exceptions=False) as c:
        assert c.post("/api/ingest/runs", json={"run_id": "sw-1"}, headers=bearer(token)).status_code == 201
        fail = {"left": 1}

        def refuse_once(*_):
            if fail["left"]:
                fail["left"] -= 1
                raise RuntimeError("store refused the node rows")

        event.listen(NodeRound, "before_insert", refuse_once)
        try:
            first = c.post("/api/ingest/runs/sw-1/rounds", json=_round(1), headers=bearer(token))
            retry = c.post("/api/ingest/runs/sw-1/rounds", json=_round(1), headers=bearer(token))
        finally:
            event.remove(NodeRound, "before_insert", refuse_once)
    assert first.status_code == 500
    assert retry.status_code == 201, retry.text
    [row] = store.rounds("sw-1")
    assert sorted(n.node_id for n in store.node_rounds("sw-1")) == ["p0", "p1", "p2"]
    assert (row.node_rows, row.failed_node_rows) == (3, 1)


def test_a_node_twice_in_one_round_is_refused(app):
    token = make_token(app, "reporter")
    with TestClient(app) as c:
        assert c.post("/api/ingest/runs", json={"run_id": "sw-4"}, headers=bearer(token)).status_code == 201
        body = _round(1)
        body["nodes"].append(dict(body["nodes"][1]))
        r = c.post("/api/ingest/runs/sw-4/rounds", json=body, headers=bearer(token))
    assert r.status_code == 422 and "node 'p1' appears twice" in r.text
    assert app.state.ctx.store.rounds("sw-4") == [] and app.state.ctx.store.node_rounds("sw-4") == []


def test_a_round_over_node_rows_written_before_it(app):
    """Node rows an older fedswarm wrote before their round (its engines did): the round
    reported with the same rows is stored and counts them all; with a row that differs it is
    refused with 409 naming the node, and nothing changes."""
    store = app.state.ctx.store
    token = make_token(app, "reporter")
    with TestClient(app) as c:
        assert c.post("/api/ingest/runs", json={"run_id": "sw-5"}, headers=bearer(token)).status_code == 201
        body = _round(1)
        store.add_node_rounds("sw-5", 1, [n for n in body["nodes"] if n["node_id"] != "p2"])
        assert c.post("/api/ingest/runs/sw-5/rounds", json=body, headers=bearer(token)).status_code == 201
        [row] = store.rounds("sw-5")
        assert (row.node_rows, row.failed_node_rows) == (3, 1)
        store.add_node_rounds("sw-5", 2, [{**body["nodes"][1], "bytes_up": 11}])
        r = c.post("/api/ingest/runs/sw-5/rounds", json=_round(2), headers=bearer(token))
    assert r.status_code == 409 and "node 'p1' of round 2 of run 'sw-5'" in r.text and "bytes_up: 11 held" in r.text
    assert [x.round for x in store.rounds("sw-5")] == [1]
    assert sorted((n.round, n.node_id) for n in store.node_rounds("sw-5")) == [
        (1, "p0"), (1, "p1"), (1, "p2"), (2, "p1")]


def test_run_registered_twice_at_once_is_one_run_with_its_owner(app, monkeypatch):
    """A registration and its retry both pass the "does it exist" check before either commits
    (forced here: the check sees nothing); the loser must get 409, not 500, and the run must
    be owned by the token from its first commit on."""
    ctx = app.state.ctx
    token = make_token(app, "reporter")
    with TestClient(app, raise_server_exceptions=False) as c:
        assert c.post("/api/ingest/runs", json={"run_id": "sw-2"}, headers=bearer(token)).status_code == 201
        real_get = Store.get_run
        monkeypatch.setattr(Store, "get_run", lambda self, rid: None)  # the race: both see no run
        r = c.post("/api/ingest/runs", json={"run_id": "sw-2"}, headers=bearer(token))
        monkeypatch.setattr(Store, "get_run", real_get)
        assert r.status_code == 409, r.text
        assert c.post("/api/ingest/runs/sw-2/rounds", json=_round(1), headers=bearer(token)).status_code == 201
    run = ctx.store.get_run("sw-2")
    assert run.owner is not None and run.owner.startswith("token:")


def test_run_owner_written_with_the_run(app, monkeypatch):
    """A reader that finds the new run (a retry, a round) finds it owned: nothing writes the
    run without its owner, even for an instant."""
    store = app.state.ctx.store
    token = make_token(app, "reporter")
    seen: list = []
    real_create = Store.create_run

    def spy(self, *a, **kw):
        rid = real_create(self, *a, **kw)
        seen.append(self.get_run(rid).owner)  # what a request arriving now would see
        return rid

    monkeypatch.setattr(Store, "create_run", spy)
    with TestClient(app) as c:
        assert c.post("/api/ingest/runs", json={"run_id": "sw-3"}, headers=bearer(token)).status_code == 201
    assert seen and seen[0] == store.get_run("sw-3").owner and seen[0].startswith("token:")


def test_first_heartbeats_of_one_node_at_once(tmp_path):
    """Many threads report the same new node at the same moment; none may fail."""
    store = Store(tmp_path / "s.db")
    errors: list = []

    def beat(barrier: threading.Barrier, node_id: str, k: int) -> None:
        barrier.wait()
        try:
            store.upsert_node(node_id, kind="peer", status="online", info={"k": k})
        except Exception as exc:  # noqa: BLE001 (what we count)
            errors.append(repr(exc))

    for trial in range(15):
        barrier = threading.Barrier(8)
        threads = [threading.Thread(target=beat, args=(barrier, f"n{trial}", k)) for k in range(8)]
        [t.start() for t in threads]
        [t.join(30) for t in threads]
    assert errors == []
    assert len(store.list_nodes()) == 15
    store.close()


@pytest.fixture(scope="module")
def pg_port():
    pytest.importorskip("psycopg", reason="PostgreSQL driver missing: pip install 'psycopg[binary]'")
    from fedswarm.bench.postgres import pg_bindir, temp_postgres

    if pg_bindir() is None:
        pytest.skip("PostgreSQL server binaries missing: apt-get install -y postgresql")
    with temp_postgres(max_connections=120) as port:
        yield port


def _sessions_at_once(store: Store, n: int) -> bool:
    """Whether ``n`` threads were all inside a store session at one moment (each holds its
    connection until all are in, or 10 s pass)."""
    inside = threading.Barrier(n)
    reached: list = []

    def hold() -> None:
        with store.session() as s:
            s.execute(select(1))
            reached.append(1)
            try:
                inside.wait(timeout=10)
            except threading.BrokenBarrierError:
                pass

    threads = [threading.Thread(target=hold) for _ in range(n)]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    return len(reached) == n and not inside.broken


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_store_serves_the_dashboards_threads_at_once(backend, tmp_path, request):
    """The dashboard runs up to 40 sync routes at once (anyio's pool) plus its to_thread work:
    each must get a connection without queueing behind the others (the default pool of
    5 + 10 made the 16th wait, then fail with 500 after 30 s)."""
    if backend == "sqlite":
        url = str(tmp_path / "s.db")
    else:
        from fedswarm.bench.postgres import create_database

        url = create_database(request.getfixturevalue("pg_port"), "pool_test")
    store = Store(url)
    try:
        assert _sessions_at_once(store, 48), "48 threads could not hold a connection each at once"
    finally:
        store.close()


def _real_load(db_url: str, tmp_path) -> None:
    """20 reporters x 4 s (at least 2 rounds each) through a real dashboard process; exactly
    once, no 5xx."""
    from fedswarm.bench.ingest import ADMIN_PW, check, count_stored, start_dashboard
    from fedswarm.bench.dashboard_load import _stop
    from fedswarm.bench.ingest_load import issue_tokens, login, run_load

    proc, url = start_dashboard(db_url, tmp_path / "dashboard.log")
    try:
        cookies, csrf = login(url, "admin", ADMIN_PW)
        tokens = asyncio.run(issue_tokens(url, cookies, csrf, 20))
        assert len(set(tokens)) == 20
        # 4 s of load, and at least 2 rounds per reporter however loaded the machine is
        res = asyncio.run(run_load(url, tokens, cookies, seconds=4.0, round_every_s=0.3, min_rounds=2))
    finally:
        _stop(proc)
    got = check(res, *count_stored(db_url, res.run_ids))
    summary = res.summary()
    assert len(res.run_ids) == 20, res.unexpected
    assert summary["status_5xx"] == 0, summary["statuses"]
    assert res.unexpected == []
    assert got["acked_rounds"] >= 2 * 20 and got["acked_node_rows"] > got["acked_rounds"]
    assert got["duplicate_rows"] == 0 and got["lost_rows"] == 0 and got["stored_never_sent"] == 0, got
    assert summary["reads"] > 0 and set(res.read_statuses) == {200}, res.read_statuses


def test_twenty_reporters_against_a_real_dashboard_sqlite(tmp_path):
    _real_load(str(tmp_path / "ingest.db"), tmp_path)


def test_twenty_reporters_against_a_real_dashboard_postgres(tmp_path, pg_port):
    from fedswarm.bench.postgres import create_database

    _real_load(create_database(pg_port, "ingest_test"), tmp_path)
