"""Pages, the new-run form, the catalog fallback, TOML config files and the Flower federation."""

from __future__ import annotations

import json
import math
import re
import sys
import tomllib

from fastapi.testclient import TestClient

from dashboard_helpers import ADMIN_PW, HERE, login, wait_for
from fedswarm.web.services.launcher import to_toml


def _csrf(client) -> str:
    return client.headers["X-CSRF-Token"]


def test_pages_render_for_admin(app, admin):
    rid = app.state.ctx.store.create_run({"rounds": 2, "strategy": "fedavg"}, name="<script>x</script>")
    for path in ("/runs", "/runs/new", f"/runs/{rid}", "/nodes", "/federation", "/admin"):
        r = admin.get(path)
        assert r.status_code == 200, path
        assert "text/html" in r.headers["content-type"]
        assert "Content-Security-Policy" in r.headers
    assert "<script>x</script>" not in admin.get("/runs").text  # escaped
    assert "&lt;script&gt;" in admin.get("/runs").text
    assert admin.get("/static/charts.js").status_code == 200
    assert admin.get("/", follow_redirects=False).headers["location"] == "/runs"


def test_pages_redirect_to_login(anon):
    r = anon.get("/runs/new", follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/login?next=/runs/new"


def test_new_run_form_is_generated_from_the_catalog(admin):
    page = admin.get("/runs/new").text
    assert 'name="p.topk.k"' in page and 'name="p.topk.error_feedback"' in page
    for field in ("clients", "rounds", "partition", "engine", "lr", "seed"):
        assert f'name="{field}"' in page, field
    assert '<option value="digits-mlp"' in page
    assert re.search(r'<select name="p.topk.error_feedback"><option value="true" selected>', page)
    assert '<option value="async" >async</option>' in page and '<option value="sync" selected>' in page


def test_start_from_form(app, admin):
    form = {"csrf_token": _csrf(admin), "task": "digits-mlp", "strategy": "topk", "p.topk.k": "0.2",
            "p.topk.error_feedback": "false", "p.topk.mode": "sync", "p.fedavg.ignored": "1",
            "clients": "4", "rounds": "2",
            "partition": "dirichlet:0.5", "engine": "inprocess", "local_steps": "", "name": "from form"}
    r = admin.post("/runs/new", data=form, follow_redirects=False)
    assert r.status_code == 303, r.text
    rid = r.headers["location"].rsplit("/", 1)[1]
    run = app.state.ctx.store.get_run(rid)
    assert run.config["params"] == {"k": 0.2, "error_feedback": False, "mode": "sync"}
    assert run.config["partition"] == "dirichlet:0.5" and "local_steps" not in run.config
    wait_for(lambda: app.state.ctx.store.get_run(rid).status == "finished", timeout=120)


def test_form_errors_are_shown_with_the_values_kept(app, admin):
    form = {"csrf_token": _csrf(admin), "strategy": "fedavg", "rounds": "-3", "clients": "7"}
    r = admin.post("/runs/new", data=form)
    assert r.status_code == 422
    assert "invalid value for &#39;rounds&#39;" in r.text and 'value="7"' in r.text
    assert app.state.ctx.store.list_runs() == []


def test_a_strategy_s_run_defaults_fill_what_the_form_leaves(app, admin):
    """The form pre-fills topology 'ring'; EASGD's registry entry asks for 'complete' where the
    user did not choose, and a topology the user typed still wins (and is checked by the run)."""
    store = app.state.ctx.store
    for topology, want in (("ring", "complete"), ("", "complete"), ("torus", "torus")):
        form = {"csrf_token": _csrf(admin), "strategy": "easgd", "rounds": "1", "topology": topology}
        r = admin.post("/runs/new", data=form, follow_redirects=False)
        assert r.status_code == 303, r.text
        assert store.get_run(r.headers["location"].rsplit("/", 1)[1]).config["topology"] == want
    for run in store.list_runs():
        admin.post(f"/api/runs/{run.id}/stop?force=true")


def test_catalog_fallback_still_offers_the_generic_fields(make_app):
    app = make_app(catalog_cmd=[sys.executable, "-c", "import sys; sys.exit('no registry here')"])
    with TestClient(app) as c:
        c.headers["X-CSRF-Token"] = login(c, "admin", ADMIN_PW)
        page = c.get("/runs/new").text
        assert "could not read the strategy catalog" in page and "no registry here" in page
        assert 'name="rounds"' in page and 'name="params_extra"' in page
        form = {"csrf_token": c.headers["X-CSRF-Token"], "strategy": "whatever", "rounds": "2",
                "params_extra": "k=0.5\nname=top"}
        r = c.post("/runs/new", data=form, follow_redirects=False)
        assert r.status_code == 303
        rid = r.headers["location"].rsplit("/", 1)[1]
        assert app.state.ctx.store.get_run(rid).config["params"] == {"k": 0.5, "name": "top"}
        for run in app.state.ctx.store.list_runs():
            c.post(f"/api/runs/{run.id}/stop?force=true")


def _banner(client, response) -> str:
    """The flash banner the page after a form's redirect shows."""
    assert response.status_code == 303, response.text
    page = client.get(response.headers["location"]).text
    m = re.search(r'<p class="flash" role="status">(.*?)</p>', page, re.S)
    return m.group(1) if m else ""


def test_control_and_policy_forms(app, admin, monkeypatch):
    monkeypatch.setenv("FAKE_ROUND_S", "0.3")
    store = app.state.ctx.store
    rid = admin.post("/api/runs", json={"config": {"rounds": 50, "strategy": "topk"}}).json()["id"]
    wait_for(lambda: store.get_run(rid).status == "running")
    r = admin.post(f"/runs/{rid}/policy", data={"csrf_token": _csrf(admin), "device_class": "edge-lte",
                                                "local_steps": "3", "codec": "topk", "lr": "",
                                                "codec_params": '{"ratio": 0.1}'}, follow_redirects=False)
    assert "policy requested" in _banner(admin, r)
    pol = admin.get(f"/api/policies?run_id={rid}").json()[0]
    assert pol["policy"] == {"local_steps": 3, "codec": "topk", "codec_params": {"ratio": 0.1}}
    r = admin.post(f"/runs/{rid}/policy", data={"csrf_token": _csrf(admin), "device_class": "edge-lte",
                                                "local_steps": "zero"}, follow_redirects=False)
    assert "policy refused" in _banner(admin, r)
    r = admin.post(f"/runs/{rid}/control", data={"csrf_token": _csrf(admin), "action": "add_rounds",
                                                 "rounds": "4"}, follow_redirects=False)
    assert "add_rounds requested" in _banner(admin, r)
    r = admin.post(f"/runs/{rid}/control", data={"csrf_token": _csrf(admin), "action": "stop"},
                   follow_redirects=True)
    assert r.status_code == 200 and "stop requested" in r.text
    wait_for(lambda: store.get_run(rid).status == "stopped")


def test_banner_shows_only_server_messages(app, admin):
    """?msg= in a link puts nothing on the page; a forged or foreign flash cookie is ignored."""
    rid = app.state.ctx.store.create_run({"rounds": 2})
    page = admin.get(f"/runs/{rid}?msg=Your+session+expired,+log+in+at+evil.example").text
    assert "evil.example" not in page
    admin.cookies.set("fedswarm_flash", "flash:WW91IHdlcmUgaGFja2Vk.forgedmac")
    assert 'class="flash"' not in admin.get(f"/runs/{rid}").text


def test_admin_pages_create_user_and_show_token_once(app, admin):
    r = admin.post("/admin/users", data={"csrf_token": _csrf(admin), "username": "val", "password": "val-password",
                                         "role": "viewer"})
    assert "user &#39;val&#39; added" in r.text
    r = admin.post("/admin/tokens", data={"csrf_token": _csrf(admin), "name": "peer", "role": "reporter"})
    token = re.search(r'<pre class="token">(fst_[^<]+)</pre>', r.text).group(1)
    assert token not in admin.get("/admin").text
    tid = token.split("_")[1]
    r = admin.post(f"/admin/tokens/{tid}/revoke", data={"csrf_token": _csrf(admin)})
    assert "token revoked" in r.text


def test_toml_round_trip():
    cfg = {"name": 'quote " and \\ back ✓', "rounds": 3, "lr": 0.1, "fraction": 1e-05, "flag": True,
           "params": {"k": 0.5, "codec": "top\nk", "layers": [1, 2], "unset": None}, "device_mix": {"edge-wifi": 0.5},
           "policies": {"edge-lte": {"local_steps": 2, "lr": None}}, "skip": None}
    back = tomllib.loads(to_toml(cfg))
    assert back == {**{k: v for k, v in cfg.items() if v is not None},
                    "params": {"k": 0.5, "codec": "top\nk", "layers": [1, 2]},
                    "policies": {"edge-lte": {"local_steps": 2}}}
    assert math.isinf(tomllib.loads(to_toml({"x": float("inf")}))["x"])


def test_federation_through_the_flwr_cli(make_app, tmp_path, monkeypatch):
    calls = tmp_path / "flwr.log"
    monkeypatch.setenv("FAKE_FLWR_LOG", str(calls))
    app = make_app(superlink="lab")
    app.state.ctx.federation.flwr = [sys.executable, str(HERE / "fake_flwr.py")]
    with TestClient(app) as c:
        c.headers["X-CSRF-Token"] = login(c, "admin", ADMIN_PW)
        sn = c.get("/api/nodes").json()["supernodes"]
        assert sn["configured"] and sn["superlink"] == "lab" and sn["nodes"][0]["node-id"] == 4242
        assert "pi-1" in c.get("/nodes").text
        page = c.get("/federation?log_run=7").text
        assert "fedswarm==0.1.0" in page and "round 1 done" in page
        r = c.post("/federation/start", data={"csrf_token": c.headers["X-CSRF-Token"],
                                              "run_config": 'strategy="topk"\nrounds=3'})
        assert "started on the SuperLink" in r.text
        r = c.post("/federation/stop", data={"csrf_token": c.headers["X-CSRF-Token"], "run_id": "7"})
        assert "stop sent for Flower run 7" in r.text
    lines = [json.loads(x) for x in calls.read_text().splitlines()]
    assert ["supernode", "list", "lab", "--format", "json"] in lines
    run = next(x for x in lines if x[0] == "run")
    assert run[2] == "lab" and run[-1] == 'strategy="topk" rounds=3'
    assert ["stop", "7", "lab"] in lines


def test_federation_not_configured_says_so(admin):
    assert "No SuperLink is configured" in admin.get("/federation").text
    assert admin.get("/api/nodes").json()["supernodes"] == {"configured": False, "superlink": None, "nodes": [],
                                                             "error": "no SuperLink configured"}


def test_run_page_shows_rejected_replies_with_their_reason(app, admin):
    store = app.state.ctx.store
    rid = store.create_run({"rounds": 2, "strategy": "pvt"})
    assert "No reply was rejected." in admin.get(f"/runs/{rid}").text
    store.add_round(rid, 1, bytes_up=1)
    store.add_rejections(rid, 1, {"17": "values must be finite <b>"})
    page = admin.get(f"/runs/{rid}").text
    assert 'id="rejections-table"' in page and "values must be finite &lt;b&gt;" in page
    detail = admin.get(f"/api/runs/{rid}").json()
    assert detail["rejections"] == [{"round": 1, "node_id": "17", "reason": "values must be finite <b>"}]


def test_run_page_shows_federated_accuracy_and_each_nodes_device(app, admin):
    store = app.state.ctx.store
    rid = store.create_run({"rounds": 2, "strategy": "fedavg"})
    store.add_round(rid, 1, bytes_up=1, test_accuracy=None, fed_accuracy=0.75, fed_loss=0.5, fed_examples=40)
    store.add_node_rounds(rid, 1, [
        {"node_id": "3", "fed_accuracy": 0.8, "fed_examples": 20,
         "telemetry": {"train_s": 1.5, "examples_per_s": 640.0, "peak_rss_mb": 512.4, "battery_pct": 87.0,
                       "power_source": "battery", "cpu_temp_c": 61.5}},
        {"node_id": "4", "fed_accuracy": 0.7, "fed_examples": 20, "telemetry": {"train_s": 2.0}}])
    rows = admin.get(f"/api/runs/{rid}/rounds").json()
    assert rows[0]["fed_accuracy"] == 0.75 and rows[0]["fed_examples"] == 40 and rows[0]["test_accuracy"] is None
    nodes = {n["node_id"]: n for n in admin.get(f"/api/runs/{rid}").json()["nodes"]}
    assert nodes["3"]["fed_accuracy"] == 0.8 and nodes["3"]["telemetry"]["cpu_temp_c"] == 61.5
    assert nodes["3"]["device"] == "1.50 s · 640 ex/s · 512 MB · battery 87% (battery) · 62 °C"
    assert nodes["4"]["device"] == "2.00 s"  # what it did not report is left out, not guessed
    page = admin.get(f"/runs/{rid}").text
    assert "80.0%" in page and "640 ex/s" in page
