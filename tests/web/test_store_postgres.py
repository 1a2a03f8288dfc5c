"""The run store and the dashboard against a real PostgreSQL started on loopback.

Needs Debian's ``postgresql`` package and ``psycopg[binary]`` (the server is
:func:`fedswarm.bench.postgres.temp_postgres`'s); skips with the reason when either is missing.
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from dashboard_helpers import ADMIN_PW, FAKE_CATALOG, FAKE_RUNNER, login, wait_for
from fedswarm.store import Store

pytest.importorskip("psycopg", reason="PostgreSQL driver missing: pip install 'psycopg[binary]'")


@pytest.fixture(scope="module")
def pg_server():
    from fedswarm.bench.postgres import temp_postgres

    try:
        with temp_postgres() as port:
            yield port
    except RuntimeError as exc:  # binaries or the user to run them as missing
        pytest.skip(str(exc))


@pytest.fixture()
def pg_url(pg_server):
    """A fresh database per test on the module's server, so repeated runs (pytest --count) start clean."""
    import uuid

    from fedswarm.bench.postgres import create_database

    yield create_database(pg_server, f"t_{uuid.uuid4().hex[:12]}")


def test_store_round_trip_on_postgres(pg_url):
    store = Store(pg_url)
    assert store.engine.dialect.name == "postgresql"
    rid = store.create_run({"strategy": "topk", "task": "digits-mlp", "rounds": 2, "seed": 3,
                            "params": {"k": 0.1}}, status="pending")
    store.set_status(rid, "running")
    store.add_round(rid, 0, test_accuracy=0.1, bytes_up=0)
    store.add_round(rid, 1, train_loss=1.2, test_loss=1.3, test_accuracy=0.5, bytes_up=2**40, bytes_down=7,
                    wall_s=0.5, sim_time_s=2.0, consensus_distance=0.25)
    store.add_round(rid, 2, test_accuracy=0.7, bytes_up=5, bytes_down=7, wall_s=0.5)
    store.add_node_rounds(rid, 1, [{"node_id": "a", "bytes_up": 3, "device_class": "edge-lte"},
                                   {"node_id": "b", "status": "rejected", "reason": "inf in update"}])
    store.upsert_node("a", kind="peer", run_id=rid, device_class="edge-lte", info={"arch": "arm64"})
    cid = store.add_control(rid, "policy", {"device_class": "edge-lte", "policy": {"local_steps": 2}}, actor="alice")
    assert [c.id for c in store.pending_controls(rid)] == [cid]
    store.mark_applied(cid)
    assert store.pending_controls(rid) == []
    store.set_status(rid, "finished")
    result = store.export_result(rid)
    assert result["config"]["params"] == {"k": 0.1}
    assert [r["round"] for r in result["rounds"]] == [0, 1, 2]
    assert result["rounds"][1]["consensus_distance"] == 0.25
    s = result["summary"]
    assert s["final_test_accuracy"] == 0.7 and s["best_test_accuracy"] == 0.7
    assert s["total_bytes_up"] == 2**40 + 5 and s["status"] == "finished"
    assert [n.node_id for n in store.node_rounds(rid)] == ["a", "b"]
    assert any(e.kind == "control.policy" and e.actor == "alice" for e in store.events(rid))
    store.close()


def test_dashboard_on_postgres(pg_url, tmp_path, monkeypatch):
    from fedswarm.web.app import create_app

    monkeypatch.setenv("FAKE_ROUND_S", "0.05")
    app = create_app(pg_url, runs_dir=tmp_path / "runs", admin_password=ADMIN_PW, runner=FAKE_RUNNER,
                     catalog_cmd=FAKE_CATALOG, poll_interval_s=0.1)
    with TestClient(app) as c:
        c.headers["X-CSRF-Token"] = login(c, "admin", ADMIN_PW)
        assert c.get("/api/health").json()["store"] == "postgresql"
        rid = c.post("/api/runs", json={"config": {"rounds": 3, "clients": 2}}).json()["id"]
        wait_for(lambda: c.get(f"/api/runs/{rid}").json()["display_status"] == "finished", timeout=120)
        run = c.get(f"/api/runs/{rid}").json()
        assert run["rounds_done"] == 3 and len(run["nodes"]) == 2
        assert [r["round"] for r in c.get(f"/api/runs/{rid}/rounds").json()] == [1, 2, 3]
        token = c.post("/api/tokens", json={"name": "peer", "role": "reporter"}).json()["token"]
        r = c.post("/api/ingest/nodes", json={"node_id": "pi-7", "kind": "peer"},
                   headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == 200
        assert c.get("/api/nodes?supernodes=false").json()["nodes"][0]["id"] == "pi-7"
    app.state.ctx.store.close()
