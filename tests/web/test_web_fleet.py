"""The Nodes page as a fleet console: real nodes only, honest states, server-side filters,
sorting (ids as numbers) and paging, the SuperLink's view merged in, a node's history and
telemetry, and telemetry through ingest."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from fastapi.testclient import TestClient

from dashboard_helpers import ADMIN_PW, bearer, login, make_token
from fleet_seed import DEPLOY_RUN, LIVE_NODES, SIM_RUNS, age_node, record_round, seed_fleet
from fedswarm.store import Node, NodeRound
from fedswarm.web.services.fleet import natural_key

HERE = Path(__file__).resolve().parent


def _fleet(client, **params) -> dict:
    r = client.get("/api/nodes", params={"supernodes": "false", **params})
    assert r.status_code == 200, r.text
    return r.json()


def test_natural_key_orders_numbers_by_value():
    ids = ["10", "2", "run:15", "run:4", "peer-b", "peer-a10", "peer-a9", "6917529027641081857", "123"]
    assert sorted(ids, key=natural_key) == ["2", "10", "123", "6917529027641081857", "peer-a9", "peer-a10",
                                            "peer-b", "run:4", "run:15"]


def test_fleet_lists_real_nodes_in_honest_states_and_no_simulated_node(app, admin):
    store = app.state.ctx.store
    seed_fleet(store)
    store.create_run({}, run_id="old-deploy", status="finished")
    record_round(store, "old-deploy", 1, [{"node_id": "77", "device_class": "rpi4"}], "supernode")
    gone = age_node(store, "77", 3 * 3600)
    record_round(store, DEPLOY_RUN, 4, [{"node_id": "55", "status": "failed", "reason": "OOM"}], "supernode")
    out = _fleet(admin)
    by = {n["id"]: n for n in out["nodes"]}
    assert set(by) == {*LIVE_NODES, "77", "55"}  # 54 simulated nodes, none listed
    assert out["simulated_nodes"] == sum(SIM_RUNS.values()) and out["total"] == 4
    for nid in LIVE_NODES:
        assert by[nid]["state"] == "training" and by[nid]["state_detail"] == f"training in run {DEPLOY_RUN}"
    assert by[LIVE_NODES[0]]["telemetry"]["train_s"] == 1.5 + 3 and by[LIVE_NODES[1]]["device_class"] == "gpu"
    assert by["77"]["state"] == "offline" and by["77"]["since"] == gone.isoformat()
    assert by["77"]["state_detail"] == f"offline since {gone:%Y-%m-%d %H:%M:%S} UTC"
    assert by["55"]["state"] == "failed" and DEPLOY_RUN in by["55"]["state_detail"]
    assert out["counts"] == {"training": 2, "online": 0, "failed": 1, "offline": 1}
    # Default order: live states first, then ids as numbers.
    assert [n["id"] for n in out["nodes"]] == ["123", "6917529027641081857", "55", "77"]
    # Node 77 comes back in another round: seen again, online (its run has ended: not training).
    record_round(store, "old-deploy", 2, [{"node_id": "77"}], "supernode")
    back = {n["id"]: n for n in _fleet(admin)["nodes"]}["77"]
    assert back["state"] == "online" and back["online"] and back["since"] is None
    assert by[LIVE_NODES[0]]["online"] and not by["77"]["online"]
    # The deployment run ends: its nodes are no longer training (seen just now: online).
    store.set_status(DEPLOY_RUN, "finished")
    assert {n["id"]: n["state"] for n in _fleet(admin)["nodes"]}[LIVE_NODES[0]] == "online"
    page = admin.get("/nodes").text
    assert "sim-a:" not in page and LIVE_NODES[0] in page and "54 simulated nodes" in page


def test_fleet_is_filtered_sorted_and_paged_on_the_server(app, admin):
    store = app.state.ctx.store
    store.create_run({}, run_id="r1", status="finished")
    store.create_run({}, run_id="r2", status="finished")
    ids = ["2", "10", "1", "33", "123456789012345678", "9"]
    for i, nid in enumerate(ids):
        record_round(store, ("r1", "r2")[i % 2], i + 1, [{"node_id": nid, "device_class": ("gpu", "rpi4")[i % 3 == 0]}],
                     "supernode")
    age_node(store, "33", 600)
    numeric = sorted(ids, key=int)
    assert [n["id"] for n in _fleet(admin, sort="id")["nodes"]] == numeric
    assert [n["id"] for n in _fleet(admin, sort="id", order="desc")["nodes"]] == numeric[::-1]
    page = _fleet(admin, sort="id", limit=2, offset=2)
    assert [n["id"] for n in page["nodes"]] == numeric[2:4] and page["total"] == 6
    assert {n["id"] for n in _fleet(admin, run_id="r2")["nodes"]} == {"10", "33", "9"}
    assert {n["id"] for n in _fleet(admin, device_class="rpi4")["nodes"]} == {"2", "33"}
    offline = _fleet(admin, state="offline")
    assert [n["id"] for n in offline["nodes"]] == ["33"] and offline["total"] == 1
    assert offline["counts"] == {"training": 0, "online": 5, "failed": 0, "offline": 1}  # before the state filter
    assert [n["id"] for n in _fleet(admin, q="12345")["nodes"]] == ["123456789012345678"]
    assert _fleet(admin, kind="peer")["total"] == 0
    assert admin.get("/api/nodes", params={"state": "asleep"}).status_code == 422
    assert admin.get("/api/nodes", params={"sort": "cpu"}).status_code == 422
    html = admin.get("/nodes", params={"sort": "id", "state": "online"}).text
    rows = [line.split('data-node-id="')[1].split('"')[0] for line in html.splitlines() if 'data-node-id="' in line]
    assert rows == [i for i in numeric if i != "33"]


def test_superlink_view_decides_reachability(make_app, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_FLWR_LOG", str(tmp_path / "flwr.log"))
    monkeypatch.setenv("FAKE_FLWR_NODES", json.dumps([
        {"node-id": LIVE_NODES[0], "owner-name": "pi-1", "status": "offline", "offline-at": "2026-01-02 03:04:05Z"},
        {"node-id": 4242, "owner-name": "pi-2", "status": "online", "online-at": "2026-01-02 01:00:00Z"},
        {"node-id": 8, "status": "registered"}, {"node-id": 9, "status": "unregistered"}]))
    monkeypatch.setattr("fedswarm.web.routers.api.nodes.SUPERNODES_MAX_AGE_S", 3600.0)
    app = make_app(superlink="lab")
    app.state.ctx.federation.flwr = [sys.executable, str(HERE / "fake_flwr.py")]
    seed_fleet(app.state.ctx.store, rounds=1)
    with TestClient(app) as c:
        c.headers["X-CSRF-Token"] = login(c, "admin", ADMIN_PW)
        by = {n["id"]: n for n in c.get("/api/nodes").json()["nodes"]}
        assert set(by) == {*LIVE_NODES, "4242", "8"}
        # The SuperLink says the node left, though its run is live: offline since then.
        assert by[LIVE_NODES[0]]["state"] == "offline" and by[LIVE_NODES[0]]["since"] == "2026-01-02T03:04:05"
        assert by[LIVE_NODES[0]]["owner_name"] == "pi-1"
        assert by[LIVE_NODES[1]]["state"] == "training"  # not on this SuperLink: the store's evidence
        assert by["4242"]["state"] == "online" and by["4242"]["state_detail"] == "online since 2026-01-02 01:00:00 UTC"
        assert by["8"]["state"] == "offline" and "never connected" in by["8"]["state_detail"]
        detail = c.get("/api/nodes/4242").json()
        assert detail["node"]["owner_name"] == "pi-2" and detail["runs"] == []
        assert "pi-2" in c.get("/nodes").text
    asked = [x for x in (tmp_path / "flwr.log").read_text().splitlines() if '"supernode", "list"' in x]
    assert len(asked) == 1  # three views, one `flwr supernode list`: the answer was reused


def test_node_history_across_runs_with_telemetry(app, admin):
    store = app.state.ctx.store
    seed_fleet(store)
    nid = LIVE_NODES[1]
    store.create_run({}, run_id="deploy-2", status="finished")
    record_round(store, "deploy-2", 1, [{"node_id": nid, "status": "rejected", "reason": "NaN", "bytes_up": 5}],
                 "supernode")
    record_round(store, "deploy-2", 2, [{"node_id": nid, "status": "failed", "reason": "lost", "bytes_up": 7}],
                 "supernode")
    # A simulated run whose node "123" is another node altogether: not in this node's history.
    record_round(store, "sim-a", 9, [{"node_id": nid, "bytes_up": 999}], "sim")
    d = admin.get(f"/api/nodes/{nid}").json()
    runs = {r["run_id"]: r for r in d["runs"]}
    assert set(runs) == {DEPLOY_RUN, "deploy-2"}
    assert {k: runs[DEPLOY_RUN][k] for k in ("rounds", "failed", "rejected", "bytes_up", "bytes_down",
                                              "first_round", "last_round")} == {
        "rounds": 3, "failed": 0, "rejected": 0, "bytes_up": 3 * 2000, "bytes_down": 3 * 2000, "first_round": 1,
        "last_round": 3}
    assert (runs["deploy-2"]["rounds"], runs["deploy-2"]["failed"], runs["deploy-2"]["rejected"],
            runs["deploy-2"]["bytes_up"]) == (2, 1, 1, 12)
    assert [(r["run_id"], r["round"]) for r in d["rounds"]] == [(DEPLOY_RUN, 1), (DEPLOY_RUN, 2), (DEPLOY_RUN, 3),
                                                               ("deploy-2", 1), ("deploy-2", 2)]
    assert [r["telemetry"]["battery_pct"] for r in d["rounds"]] == [89.0, 88.0, 87.0, None, None]
    assert d["rounds"][3]["reason"] == "NaN" and d["node"]["state"] == "failed"
    sim = admin.get("/api/nodes/sim-b:7").json()
    assert sim["simulated"] and sim["node"] is None and [r["run_id"] for r in sim["runs"]] == ["sim-b"]
    assert admin.get("/api/nodes/nobody").status_code == 404
    page = admin.get(f"/nodes/{nid}")
    assert page.status_code == 200 and 'id="chart-battery"' in page.text and "/runs/deploy-2" in page.text
    assert admin.get("/nodes/nobody").status_code == 404


def test_run_page_node_table_sorts_ids_as_numbers(app, admin):
    store = app.state.ctx.store
    store.create_run({}, run_id="many", status="finished")
    record_round(store, "many", 1, [{"node_id": str(k)} for k in (3, 11, 1, 10, 2, 100, 20)], "sim")
    assert [n["node_id"] for n in admin.get("/api/runs/many").json()["nodes"]] == ["1", "2", "3", "10", "11", "20",
                                                                                   "100"]
    # Over the table's 2000 rows: the 2000 lowest ids (a text order would keep "1000" and drop "200").
    store.create_run({}, run_id="big", status="finished")
    record_round(store, "big", 1, [{"node_id": str(k)} for k in range(2005, 0, -1)], "sim")
    assert [n["node_id"] for n in admin.get("/api/runs/big").json()["nodes"]] == [str(k) for k in range(1, 2001)]
    store.create_run({}, run_id="mixed", status="finished")
    record_round(store, "mixed", 1, [{"node_id": k} for k in ("b2", "a10", "a9", "pi-10", "pi-9")], "sim")
    assert [n["node_id"] for n in admin.get("/api/runs/mixed").json()["nodes"]] == ["a9", "a10", "b2", "pi-9",
                                                                                    "pi-10"]


def test_ingest_carries_validated_telemetry(app, anon, admin):
    store = app.state.ctx.store
    h = bearer(make_token(app, "reporter"))
    assert anon.post("/api/ingest/runs", json={"run_id": "swarm-t", "config": {}}, headers=h).status_code == 201
    tel = {"train_s": 2.5, "peak_rss_mb": 512, "battery_pct": 40, "power_source": "battery", "cpu_temp_c": 61.5}
    r = anon.post("/api/ingest/nodes", json={"node_id": "peer-a", "run_id": "swarm-t", "telemetry": tel}, headers=h)
    assert r.status_code == 200, r.text
    listed = {n["id"]: n for n in _fleet(admin)["nodes"]}
    assert listed["peer-a"]["telemetry"] == {**dict.fromkeys(listed["peer-a"]["telemetry"]), **tel,
                                             "peak_rss_mb": 512.0, "battery_pct": 40.0}
    assert listed["peer-a"]["state"] == "training"
    # A heartbeat without telemetry (or with none measured) keeps the last values.
    assert anon.post("/api/ingest/nodes", json={"node_id": "peer-a"}, headers=h).status_code == 200
    assert anon.post("/api/ingest/nodes", json={"node_id": "peer-a", "telemetry": {}}, headers=h).status_code == 200
    with store.session() as s:
        assert s.get(Node, "peer-a").telemetry == tel
    body = {"round": 1, "nodes": [{"node_id": "peer-a", "telemetry": {"train_s": 3.0}}, {"node_id": "peer-b"}]}
    assert anon.post("/api/ingest/runs/swarm-t/rounds", json=body, headers=h).status_code == 201
    with store.session() as s:
        rows = {n.node_id: n.telemetry for n in s.query(NodeRound).filter_by(run_id="swarm-t")}
    assert rows == {"peer-a": {"train_s": 3.0}, "peer-b": None}
    for bad, word in (({"train_s": 1, "gpu_util": 3}, "gpu_util"), ({"battery_pct": 150}, "battery_pct"),
                      ({"cpu_model": "x" * 201}, "cpu_model"), ({"cpu_count": 0}, "cpu_count")):
        r = anon.post("/api/ingest/nodes", json={"node_id": "peer-a", "telemetry": bad}, headers=h)
        assert r.status_code == 422 and word in r.text, (bad, r.text)
    r = anon.post("/api/ingest/nodes", content=b'{"node_id": "peer-a", "telemetry": {"train_s": NaN}}',
                  headers={**h, "content-type": "application/json"})
    assert r.status_code == 422
    with store.session() as s:
        assert s.get(Node, "peer-a").telemetry == tel  # nothing of the refused reports was stored


def test_api_reference_documents_the_fleet_routes(anon):
    schema = anon.get("/openapi.json").json()
    listed = schema["paths"]["/api/nodes"]["get"]
    assert {p["name"] for p in listed["parameters"]} >= {"state", "device_class", "run_id", "kind", "q", "sort",
                                                          "order", "limit", "offset"}
    one = schema["paths"]["/api/nodes/{node_id}"]["get"]
    assert one["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/NodeDetailOut")
    assert set(schema["components"]["schemas"]["Telemetry"]["properties"]) == {
        "train_s", "examples_per_s", "peak_rss_mb", "cpu_count", "cpu_model", "accelerator", "accelerator_mem_mb",
        "battery_pct", "power_source", "cpu_temp_c"}
