"""The JSON API against a temp SQLite store, with runs started by a fake runner process."""

from __future__ import annotations

import math
import subprocess
import sys
import tomllib

from dashboard_helpers import bearer, make_token, wait_for


def _start(admin, **config) -> str:
    r = admin.post("/api/runs", json={"config": {"rounds": 3, "clients": 4, **config}})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def _status(admin, rid: str) -> str:
    return admin.get(f"/api/runs/{rid}").json()["display_status"]


def test_web_app_never_imports_torch_or_flwr():
    code = ("import sys, fedswarm.web.app; "
            "bad = [m for m in ('torch', 'flwr') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_health_needs_no_login(anon):
    r = anon.get("/api/health")
    assert r.status_code == 200 and r.json()["status"] == "ok" and r.json()["store"] == "sqlite"


def test_openapi_lists_the_api(anon):
    paths = anon.get("/openapi.json").json()["paths"]
    for p in ("/api/health", "/api/runs", "/api/runs/{run_id}", "/api/runs/{run_id}/rounds",
              "/api/runs/{run_id}/pause", "/api/runs/{run_id}/resume", "/api/runs/{run_id}/stop",
              "/api/runs/{run_id}/add_rounds", "/api/nodes", "/api/policies", "/api/tokens",
              "/api/ingest/runs/{run_id}/rounds", "/api/ingest/nodes"):
        assert p in paths, p


def test_start_run_writes_store_toml_and_events(app, admin):
    rid = _start(admin, strategy="topk", params={"k": "0.05"}, name="my run")
    wait_for(lambda: _status(admin, rid) == "finished", timeout=120)
    run = admin.get(f"/api/runs/{rid}").json()
    assert run["name"] == "my run" and run["rounds_done"] == 3 and run["pid"]
    assert run["config"]["params"] == {"k": 0.05}  # coerced to the hyperparameter's type
    assert math.isclose(run["test_accuracy"], 1 - 0.9 * math.exp(-1))
    assert run["bytes_up"] == 3 * 4000 and len(run["nodes"]) == 4
    assert {n["device_class"] for n in run["nodes"]} == {"datacenter", "edge-wifi"}
    rounds = admin.get(f"/api/runs/{rid}/rounds").json()
    assert [r["round"] for r in rounds] == [1, 2, 3]
    assert [r["round"] for r in admin.get(f"/api/runs/{rid}/rounds?since=2").json()] == [3]
    toml = tomllib.loads((app.state.ctx.settings.runs_dir / rid / "config.toml").read_text())
    assert toml["strategy"] == "topk" and toml["params"] == {"k": 0.05} and toml["rounds"] == 3
    events = [(e["kind"], e["actor"]) for e in run["events"]]
    assert ("started", "admin") in events
    assert "fake runner" in admin.get(f"/api/runs/{rid}/log").json()["log"]
    listed = admin.get("/api/runs").json()
    assert listed[0]["id"] == rid and listed[0]["best_test_accuracy"] is not None


def test_bad_config_is_422_with_the_config_error_line(admin):
    cases = {
        "unknown key 'colour'": {"colour": "red"},
        "invalid value for 'rounds'": {"rounds": 0},
        "invalid value for 'partition'": {"partition": "zipf"},
        "unknown strategy 'nope'": {"strategy": "nope"},
        "unknown hyperparameter 'topk.kk'": {"strategy": "topk", "params": {"kk": 1}},
        "invalid value for 'topk.k'": {"strategy": "topk", "params": {"k": "lots"}},
        "unknown task 'mnist-huge'": {"task": "mnist-huge"},
    }
    for needle, config in cases.items():
        r = admin.post("/api/runs", json={"config": config})
        assert r.status_code == 422, (config, r.text)
        assert needle in r.json()["detail"], r.json()
    assert admin.post("/api/runs", json={"configs": {}}).status_code == 422
    assert admin.get("/api/runs").json() == []


def test_unknown_run_is_404_naming_it(admin):
    for method, path in (("get", "/api/runs/ghost42"), ("get", "/api/runs/ghost42/rounds"),
                         ("post", "/api/runs/ghost42/pause"), ("post", "/api/runs/ghost42/stop"),
                         ("post", "/api/runs/ghost42/resume"), ("get", "/api/runs/ghost42/log")):
        r = getattr(admin, method)(path)
        assert r.status_code == 404 and "ghost42" in r.json()["detail"], (path, r.text)
    r = admin.post("/api/runs/ghost42/add_rounds", json={"rounds": 2})
    assert r.status_code == 404 and "ghost42" in r.json()["detail"]
    assert admin.get("/runs/ghost42").status_code == 404


def test_pause_resume_add_rounds_stop(app, admin, monkeypatch):
    monkeypatch.setenv("FAKE_ROUND_S", "0.25")
    rid = _start(admin, rounds=40)
    wait_for(lambda: _status(admin, rid) == "running")
    assert admin.post(f"/api/runs/{rid}/pause").json()["action"] == "pause"
    wait_for(lambda: _status(admin, rid) == "paused")
    assert admin.post(f"/api/runs/{rid}/pause").status_code == 409  # already paused
    done = admin.get(f"/api/runs/{rid}").json()["rounds_done"]
    r = admin.post(f"/api/runs/{rid}/add_rounds", json={"rounds": 5})
    assert r.status_code == 200 and r.json()["control_id"]
    assert admin.post(f"/api/runs/{rid}/add_rounds", json={"rounds": 0}).status_code == 422
    assert admin.post(f"/api/runs/{rid}/resume").status_code == 200
    wait_for(lambda: admin.get(f"/api/runs/{rid}").json()["total_rounds"] == 45)
    wait_for(lambda: admin.get(f"/api/runs/{rid}").json()["rounds_done"] > done)
    assert admin.post(f"/api/runs/{rid}/stop").status_code == 200
    wait_for(lambda: _status(admin, rid) == "stopped")
    assert admin.post(f"/api/runs/{rid}/stop").status_code == 409
    kinds = [(e["kind"], e["actor"]) for e in admin.get(f"/api/events?run_id={rid}").json()]
    for k in ("control.pause", "control.resume", "control.add_rounds", "control.stop"):
        assert (k, "admin") in kinds


def test_force_stop_terminates_the_process(app, admin, monkeypatch):
    from fedswarm.web.services.launcher import pid_alive

    monkeypatch.setenv("FAKE_ROUND_S", "0.5")
    rid = _start(admin, rounds=100)
    wait_for(lambda: _status(admin, rid) == "running")
    pid = admin.get(f"/api/runs/{rid}").json()["pid"]
    r = admin.post(f"/api/runs/{rid}/stop?force=true")
    assert r.status_code == 200 and "terminated" in r.json()["detail"]
    wait_for(lambda: not pid_alive(pid), timeout=60)
    assert _status(admin, rid) == "stopped"


def test_dead_process_shows_as_lost_and_can_be_stopped(app, admin, monkeypatch):
    monkeypatch.setenv("FAKE_FAIL", "1")
    rid = _start(admin)
    wait_for(lambda: _status(admin, rid) == "lost")
    assert "failing on purpose" in admin.get(f"/api/runs/{rid}/log").json()["log"]
    r = admin.post(f"/api/runs/{rid}/pause")
    assert r.status_code == 409 and "lost" in r.json()["detail"]
    assert "marked stopped" in admin.post(f"/api/runs/{rid}/stop").json()["detail"]
    assert _status(admin, rid) == "stopped"


def test_policies(app, admin, monkeypatch):
    monkeypatch.setenv("FAKE_ROUND_S", "0.3")
    rid = _start(admin, rounds=50, strategy="topk")
    body = {"run_id": rid, "device_class": "edge-lte", "policy": {"local_steps": 2, "codec": "topk"}}
    r = admin.post("/api/policies", json=body)
    assert r.status_code == 200 and r.json()["action"] == "policy"
    admin.post("/api/policies", json={**body, "policy": {"codec_params": {"ratio": 0.5}}})
    got = admin.get(f"/api/policies?run_id={rid}").json()
    assert got[0]["device_class"] == "edge-lte"
    assert got[0]["policy"] == {"local_steps": 2, "codec": "topk", "codec_params": {"ratio": 0.5}}
    for bad in ({"policy": {"local_steps": 0}}, {"policy": {"warp": 9}}, {"policy": {}},
                {"device_class": "bad class!"}, {"policy": {"pvt_fraction": 1.5}}):
        r = admin.post("/api/policies", json={**body, **bad})
        assert r.status_code == 422, (bad, r.text)
    r = admin.post("/api/policies", json={**body, "run_id": "ghost"})
    assert r.status_code == 404
    # what reached the run: the two accepted changes as policy controls by the admin, none of
    # the refused ones (read from the table, not the pending list, which is empty once the
    # fake runner has applied them)
    from sqlalchemy import select

    from fedswarm.store import Control

    with app.state.ctx.store.session() as s:
        q = select(Control).where(Control.run_id == rid).order_by(Control.id)
        sent = [(c.kind, c.actor, c.payload) for c in s.scalars(q)]
    assert sent == [("policy", "admin", {"device_class": "edge-lte", "policy": {"local_steps": 2, "codec": "topk"}}),
                    ("policy", "admin", {"device_class": "edge-lte", "policy": {"codec_params": {"ratio": 0.5}}})]
    admin.post(f"/api/runs/{rid}/stop?force=true")
    assert admin.post("/api/policies", json=body).status_code == 409


def test_policy_checked_against_strategy_and_registry(app, admin, monkeypatch):
    """A policy the run cannot apply is refused before it is queued, naming the key."""
    monkeypatch.setenv("FAKE_ROUND_S", "0.3")
    fedavg = _start(admin, rounds=50)
    topk = _start(admin, rounds=50, strategy="topk")
    cases = [
        (fedavg, {"codec": "topk"}, "'codec'"),  # fedavg has no codec: it would be a silent no-op
        (fedavg, {"pvt_fraction": 0.5}, "'pvt_fraction'"),
        (topk, {"codec": "zip"}, "unknown codec 'zip'"),
        (topk, {"codec": "qsgd", "codec_params": {"levels": 0}}, "'codec_params.qsgd.levels'"),
        (topk, {"codec_params": {"bits": 3}}, "unknown hyperparameter 'codec_params.topk.bits'"),
    ]
    for rid, policy, needle in cases:
        r = admin.post("/api/policies", json={"run_id": rid, "device_class": "edge", "policy": policy})
        assert r.status_code == 422 and needle in r.json()["detail"], (policy, r.text)
    assert app.state.ctx.store.pending_controls(fedavg) == [] and app.state.ctx.store.pending_controls(topk) == []
    # The same check at start: a config's policies must suit its strategy.
    r = admin.post("/api/runs", json={"config": {"rounds": 2, "policies": {"edge": {"codec": "topk"}}}})
    assert r.status_code == 422 and "'codec'" in r.json()["detail"]


def test_ingest_with_reporter_tokens(app, anon, admin):
    reporter = make_token(app, "reporter")
    h = bearer(reporter)
    r = anon.post("/api/ingest/runs", json={"run_id": "swarm-1", "config": {"strategy": "dpsgd", "rounds": 3},
                                            "name": "swarm"}, headers=h)
    assert r.status_code == 201 and r.json()["run_id"] == "swarm-1"
    assert anon.post("/api/ingest/runs", json={"run_id": "swarm-1"}, headers=h).status_code == 409
    body = {"round": 1, "train_loss": 1.5, "test_accuracy": 0.4, "bytes_up": 100, "bytes_down": 50,
            "wall_s": 0.2, "metrics": {"consensus_distance": 0.3},
            "nodes": [{"node_id": "peer-a", "bytes_up": 60, "device_class": "edge-wifi"},
                      {"node_id": "peer-b", "bytes_up": 40, "status": "rejected", "reason": "NaN in update"}]}
    assert anon.post("/api/ingest/runs/swarm-1/rounds", json=body, headers=h).status_code == 201
    assert anon.post("/api/ingest/runs/swarm-1/rounds", json=body, headers=h).status_code == 409
    r = anon.post("/api/ingest/runs/swarm-1/rounds", content=b'{"round": 2, "train_loss": NaN}',
                  headers={**h, "content-type": "application/json"})
    assert r.status_code == 422
    assert anon.post("/api/ingest/runs/ghost/rounds", json={"round": 1}, headers=h).status_code == 404
    r = anon.post("/api/ingest/nodes", json={"node_id": "peer-a", "kind": "peer", "device_class": "edge-wifi",
                                             "run_id": "swarm-1", "info": {"cpu": "arm64"}}, headers=h)
    assert r.status_code == 200
    assert anon.post("/api/ingest/runs/swarm-1/status", json={"status": "running"}, headers=h).status_code == 200

    rounds = admin.get("/api/runs/swarm-1/rounds").json()
    assert rounds[0]["metrics"]["consensus_distance"] == 0.3
    detail = admin.get("/api/runs/swarm-1").json()
    assert detail["status"] == "running"
    nodes = {n["node_id"]: n for n in detail["nodes"]}
    assert nodes["peer-b"]["rejected"] == 1 and nodes["peer-b"]["last_reason"] == "NaN in update"
    listed = admin.get("/api/nodes?supernodes=false").json()
    assert listed["nodes"][0]["id"] == "peer-a" and listed["nodes"][0]["online"]
    assert listed["supernodes"]["configured"] is False

    # Controls reach remote runtimes through the same token.
    assert admin.post("/api/runs/swarm-1/pause").status_code == 200
    pending = anon.get("/api/ingest/runs/swarm-1/controls", headers=h).json()
    assert [c["kind"] for c in pending] == ["pause"]
    cid = pending[0]["id"]
    assert anon.post(f"/api/ingest/runs/swarm-1/controls/{cid}/applied", headers=h).status_code == 200
    assert anon.get("/api/ingest/runs/swarm-1/controls", headers=h).json() == []

    # A token bound to one run cannot write another.
    other = app.state.ctx.store.create_run({"rounds": 1}, run_id="other-run")
    bound = bearer(make_token(app, "reporter", run_id="swarm-1"))
    r = anon.post(f"/api/ingest/runs/{other}/rounds", json={"round": 1}, headers=bound)
    assert r.status_code == 403
    assert anon.post("/api/ingest/runs/swarm-1/rounds", json={"round": 2}, headers=bound).status_code == 201
    # Cookie sessions cannot ingest; only tokens.
    assert admin.post("/api/ingest/nodes", json={"node_id": "x"}).status_code == 403


def test_ingest_rejects_oversized_and_malformed(app, anon):
    h = bearer(make_token(app, "reporter"))
    big = {"node_id": "p", "info": {"blob": "x" * 10_000}}  # under the route's body cap, over info's
    r = anon.post("/api/ingest/nodes", json=big, headers=h)
    assert r.status_code == 422 and "8192 bytes" in r.text
    r = anon.post("/api/ingest/nodes", json={"node_id": "p", "info": {"blob": "x" * 70_000}}, headers=h)
    assert r.status_code == 413 and "16384" in r.json()["detail"]
    assert anon.post("/api/ingest/nodes", json={"node_id": "../etc"}, headers=h).status_code == 422
    huge = b'{"node_id": "p", "info": {"x": "' + b"y" * 2_100_000 + b'"}}'
    r = anon.post("/api/ingest/nodes", content=huge, headers={**h, "content-type": "application/json"})
    assert r.status_code == 413
    assert anon.post("/api/ingest/runs", json={"config": {"seed": "abc"}}, headers=h).status_code == 422


def test_nan_metrics_in_store_do_not_break_json(app, admin):
    store = app.state.ctx.store
    rid = store.create_run({"rounds": 2})
    store.add_round(rid, 1, train_loss=float("nan"), test_accuracy=float("inf"), weird=float("-inf"))
    r = admin.get(f"/api/runs/{rid}/rounds")
    assert r.status_code == 200 and r.json()[0]["train_loss"] is None and r.json()[0]["metrics"]["weird"] is None
    assert admin.get(f"/api/runs/{rid}").status_code == 200
    assert admin.get(f"/runs/{rid}").status_code == 200


def test_tokens_and_users_api(app, admin, anon):
    r = admin.post("/api/users", json={"username": "vera", "password": "vera-password", "role": "viewer"})
    assert r.status_code == 201 and r.json()["role"] == "viewer"
    assert admin.post("/api/users", json={"username": "vera", "password": "vera-password"}).status_code == 409
    assert admin.post("/api/users", json={"username": "x", "password": "short"}).status_code == 422
    assert {u["username"] for u in admin.get("/api/users").json()} == {"admin", "vera"}
    t = admin.post("/api/tokens", json={"name": "ci", "role": "admin"}).json()
    assert anon.get("/api/runs", headers=bearer(t["token"])).status_code == 200
    assert admin.delete(f"/api/tokens/{t['id']}").status_code == 200
    assert anon.get("/api/runs", headers=bearer(t["token"])).status_code == 401
    assert admin.delete("/api/tokens/9999").status_code == 404
    assert admin.post("/api/tokens", json={"name": "x", "run_id": "ghost"}).status_code == 404
    kinds = [e["kind"] for e in admin.get("/api/events").json()]
    assert "token.created" in kinds and "token.revoked" in kinds and "user.created" in kinds
