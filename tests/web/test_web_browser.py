"""The dashboard in headless Chromium (Playwright's Python package driving Debian's chromium):
log in, start a simulation from the form, watch its chart fill as rounds finish, stop a run.
Screenshots go to test-artifacts/ at the repository root.

``test_real_simulation`` runs the real ``python -m fedswarm sim`` (digits-mlp, 4 clients,
5 rounds); ``test_controls_with_fake_runner`` drives pause/resume/stop on a slow fake run.
Install: ``apt-get install -y chromium`` and ``pip install playwright`` (no browser download).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dashboard_helpers import ADMIN_PW, CHROMIUM_ARGS, chromium_or_skip, start_server, wait_for

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"

sync_api, CHROMIUM = chromium_or_skip()

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def browser():
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield b
        b.close()


@pytest.fixture
def page(browser):
    ctx = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = ctx.new_page()
    page.set_default_timeout(90_000)  # a deadline, not a wait: generous for loaded CI machines
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    yield page
    ctx.close()
    assert not [e for e in errors if "EventSource" not in e and "ERR_" not in e], errors


def _login(page, url: str) -> None:
    page.goto(url + "/runs")
    assert "/login" in page.url
    page.fill("input[name=username]", "admin")
    page.fill("input[name=password]", ADMIN_PW)
    page.click("button:has-text('Log in')")
    page.wait_for_url(url + "/runs")


def _start_from_form(page, url: str, strategy: str, **fields: str) -> str:
    page.goto(url + "/runs/new")
    page.select_option("#strategy", strategy)
    for name, value in fields.items():
        sel = f"[name='{name}']"
        if page.eval_on_selector(sel, "el => el.tagName") == "SELECT":
            page.select_option(sel, value)
        else:
            page.fill(sel, value)
    page.click("#start-run")
    page.wait_for_url(url + "/runs/*")
    return page.url.rsplit("/", 1)[1]


def _points(page, chart: str = "chart-acc") -> int:
    return int(page.get_attribute(f"#{chart}", "data-points") or 0)


def _rounds_and_controls(db, rid: str) -> tuple[list[tuple[int, object]], dict[str, object]]:
    """The run's rounds as (round, recorded at) and when each kind of control was applied."""
    from sqlalchemy import select

    from fedswarm.store import Store
    from fedswarm.store.schema import Control

    store = Store(db)
    try:
        with store.session() as s:
            applied = {c.kind: c.applied_at for c in s.scalars(select(Control).where(Control.run_id == rid))}
        return [(r.round, r.created_at) for r in store.rounds(rid)], applied
    finally:
        store.close()


def _wait_status(page, status: str, timeout_ms: int) -> None:
    page.wait_for_function("() => { const b = document.querySelector('#status .badge');"
                           f" return !!b && b.textContent.trim() === '{status}'; }}", timeout=timeout_ms)


def _wait_points(page, cond: str, timeout_ms: float | None = None, chart: str = "chart-acc") -> None:
    """Until the chart's point count meets ``cond`` (e.g. ``">= 3"``). Null-safe: a control
    button posts a form and the page reloads, and a predicate that throws on the half-loaded
    page (no chart yet) fails the wait instead of retrying."""
    page.wait_for_function(f"() => {{ const c = document.querySelector('#{chart}');"
                           f" return !!c && +c.dataset.points {cond}; }}", timeout=timeout_ms)


def _control(page, action: str, back_to: str | None = None) -> None:
    """Click a run control and wait for the page its form post loads (``back_to``: its URL)."""
    with page.expect_navigation():
        page.click(f"#btn-{action}")
    assert back_to is None or page.url == back_to, page.url


def _real_sim_available() -> str | None:
    r = subprocess.run([sys.executable, "-m", "fedswarm", "sim", "--help"], capture_output=True, text=True)
    return None if r.returncode == 0 else (r.stderr.strip().splitlines() or ["no output"])[-1]


def test_real_simulation(page, tmp_path):
    missing = _real_sim_available()
    assert missing is None, f"`python -m fedswarm sim` is not usable: {missing}"
    server = start_server(tmp_path, fake=False)
    try:
        _login(page, server.url)
        # The catalog comes from a `fedswarm strategies --json` subprocess; on a loaded machine it can take
        # longer than the page's own 30 s wait. The page says "reload in a few seconds": do so, to a deadline.
        def catalog_loaded() -> bool:
            page.goto(server.url + "/runs/new")
            return page.locator("select#task option[value='digits-mlp']").count() == 1
        assert wait_for(catalog_loaded, 240, interval=1.0), \
            "the strategy catalog did not load: " + (page.text_content(".warn") or "")
        rid = _start_from_form(page, server.url, "fedavg", task="digits-mlp", clients="4", rounds="5",
                               name="browser: digits-mlp")
        _wait_points(page, ">= 1", 180_000)
        page.screenshot(path=str(ARTIFACTS / "dashboard-run-filling.png"), full_page=True)
        _wait_status(page, "finished", 240_000)
        _wait_points(page, ">= 5", 10_000)
        assert _points(page, "chart-bytes") >= 5 and _points(page, "chart-loss") >= 5
        assert "round 5 of 5" in page.text_content("#progress-text")
        page.wait_for_function("() => document.querySelectorAll('#nodes-body tr').length === 4", timeout=10_000)
        page.screenshot(path=str(ARTIFACTS / "dashboard-run-finished.png"), full_page=True)

        # A long run, stopped from the page.
        rid2 = _start_from_form(page, server.url, "fedavg", task="digits-mlp", clients="4", rounds="500",
                                name="browser: to stop")
        _wait_points(page, ">= 2", 180_000)
        _control(page, "stop", f"{server.url}/runs/{rid2}")
        assert "stop requested" in page.text_content(".flash")
        _wait_status(page, "stopped", 120_000)
        assert _points(page) < 500
        page.screenshot(path=str(ARTIFACTS / "dashboard-run-stopped.png"), full_page=True)
        page.goto(server.url + "/runs")
        assert page.locator(f"tr[data-run-id='{rid}'] .badge").text_content() == "finished"
        assert page.locator(f"tr[data-run-id='{rid2}'] .badge").text_content() == "stopped"
        page.screenshot(path=str(ARTIFACTS / "dashboard-runs.png"), full_page=True)
    finally:
        server.stop()


def test_controls_with_fake_runner(page, tmp_path):
    server = start_server(tmp_path, fake=True, poll=0.3, env={"FAKE_ROUND_S": "0.5"})
    try:
        _login(page, server.url)
        page.goto(server.url + "/runs/new")
        page.select_option("#strategy", "topk")
        assert page.is_visible("fieldset[data-strategy='topk']")
        assert not page.is_visible("fieldset[data-strategy='fedavg']")
        page.screenshot(path=str(ARTIFACTS / "dashboard-new-run.png"), full_page=True)
        rid = _start_from_form(page, server.url, "topk", clients="4", rounds="40", **{"p.topk.k": "0.05"})
        _wait_points(page, ">= 3")
        _control(page, "pause")
        _wait_status(page, "paused", 60_000)
        # the runner records the round in flight, then pauses: while paused the store holds n rounds,
        # and the chart (its own poll) shows exactly those once it has caught up
        n = len(_rounds_and_controls(server.db, rid)[0])
        _wait_points(page, f">= {n}")
        assert _points(page) == n, "the chart shows a round the paused run never recorded"
        _control(page, "resume")
        _wait_points(page, f"> {n}")
        _control(page, "stop")
        _wait_status(page, "stopped", 60_000)
        rounds, applied = _rounds_and_controls(server.db, rid)
        paused = [r for r, t in rounds if applied["pause"] < t < applied["resume"]]
        assert not paused, f"rounds {paused} were recorded while the run was paused"
        page.screenshot(path=str(ARTIFACTS / "dashboard-controls.png"), full_page=True)
        page.reload()
        events = page.text_content("ul.events")
        for kind in ("control.pause", "control.resume", "control.stop"):
            assert kind in events
        page.goto(server.url + "/runs")
        assert page.locator(f"tr[data-run-id='{rid}'] .badge").text_content() == "stopped"
    finally:
        server.stop()


def test_viewer_sees_no_controls(page, tmp_path):
    server = start_server(tmp_path, fake=True)
    try:
        import httpx

        from fedswarm.store import Store
        from fedswarm.web.services.accounts import Accounts

        Accounts(Store(server.db)).create_user("vic", "vic-password", "viewer")
        page.goto(server.url + "/login")
        page.fill("input[name=username]", "vic")
        page.fill("input[name=password]", "vic-password")
        page.click("button:has-text('Log in')")
        page.wait_for_url(server.url + "/runs")
        assert page.locator("a:has-text('New run')").count() == 0
        page.goto(server.url + "/runs/new")
        assert page.is_disabled("#start-run")
        assert httpx.post(server.url + "/api/runs", json={"config": {}}).status_code == 401
    finally:
        server.stop()


# -- the operator's console: refused policies, lost reporters, compared runs, docs, phones --
def _ingest(url: str, token: str, path: str, body: dict) -> int:
    import httpx

    return httpx.post(url + path, json=body, headers={"Authorization": f"Bearer {token}"}, timeout=10).status_code


def _reporter_token(server) -> str:
    from fedswarm.store import Store
    from fedswarm.web.services.accounts import Accounts

    store = Store(server.db)
    try:
        return Accounts(store).create_token("browser-reporter", "reporter", None, "test")[1]
    finally:
        store.close()


def _console_errors(page) -> list[str]:
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    return errors


def test_bad_policy_refused_with_its_reason(page, tmp_path):
    server = start_server(tmp_path, fake=True, poll=0.2, env={"FAKE_ROUND_S": "0.5"})
    try:
        _login(page, server.url)
        rid = _start_from_form(page, server.url, "fedavg", clients="4", rounds="200")
        _wait_points(page, ">= 1")
        assert "fedavg applies these policy keys" in page.text_content("#policy-keys")
        page.fill("#policy-form [name=device_class]", "edge-lte")
        page.select_option("#policy-form [name=codec]", "topk")
        _control(page, "policy", f"{server.url}/runs/{rid}")
        banner = page.text_content(".flash")
        assert "policy refused" in banner and "'codec'" in banner and "fedavg" in banner, banner
        assert page.is_hidden("#pending")  # nothing was queued
        page.screenshot(path=str(ARTIFACTS / "console-policy-refused.png"), full_page=True)
        # A valid one is queued and shown as pending until the run applies it.
        page.fill("#policy-form [name=device_class]", "edge-lte")
        page.fill("#policy-form [name=local_steps]", "2")
        _control(page, "policy", f"{server.url}/runs/{rid}")
        assert "policy requested" in page.text_content(".flash")
        _control(page, "kill")
        _wait_status(page, "stopped", 60_000)
        page.wait_for_function("() => document.getElementById('btn-add_rounds').disabled")
        assert page.is_disabled("#btn-pause") and page.is_disabled("#btn-resume")
    finally:
        server.stop()


def test_dead_reporter_run_marked_lost(page, tmp_path):
    server = start_server(tmp_path, fake=True, poll=0.2)
    try:
        token = _reporter_token(server)
        assert _ingest(server.url, token, "/api/ingest/runs",
                       {"run_id": "swarm-far", "name": "far swarm", "lost_after_s": 15,
                        "config": {"strategy": "dpsgd", "rounds": 50}}) == 201
        for r in (1, 2):
            assert _ingest(server.url, token, "/api/ingest/runs/swarm-far/rounds",
                           {"round": r, "test_accuracy": 0.3 + r / 10, "metrics": {"consensus_distance": 0.5 / r},
                            "nodes": [{"node_id": "peer-0", "device_class": "edge-wifi"},
                                      {"node_id": "peer-1", "device_class": "gpu"}]}) == 201
        _login(page, server.url)
        page.goto(server.url + "/runs/swarm-far")
        _wait_status(page, "running", 60_000)
        assert "lost after 15 s without a report" in page.text_content("#liveness")
        # The reporter dies: nothing more arrives. The page turns to lost by itself.
        _wait_status(page, "lost", 60_000)
        assert "no report for over 15 s" in page.text_content("#lost-note")
        assert page.is_disabled("#btn-pause") and page.is_enabled("#btn-stop")
        assert "edge-wifi" in page.text_content("#classes-body") and "gpu" in page.text_content("#classes-body")
        page.screenshot(path=str(ARTIFACTS / "console-run-lost.png"), full_page=True)
    finally:
        server.stop()


def _seed_comparison(server) -> list[str]:
    token = _reporter_token(server)
    runs = {"cmp-fedavg": ("fedavg", 0.0), "cmp-topk": ("topk", 0.05), "cmp-dpsgd": ("dpsgd", -0.1)}
    for rid, (strategy, shift) in runs.items():
        assert _ingest(server.url, token, "/api/ingest/runs",
                       {"run_id": rid, "name": rid, "config": {"strategy": strategy, "rounds": 20}}) == 201
        for r in range(0, 21):
            body = {"round": r, "test_accuracy": min(1.0, max(0.0, 0.2 + 0.035 * r + shift)),
                    "train_loss": 2.0 / (r + 1), "bytes_up": 10**6 * (1 if strategy == "fedavg" else 0.1),
                    "wall_s": 0.5, "sim_time_s": 2.0}
            if strategy == "dpsgd":  # round 0 has no consensus distance yet: a gap, not a 0
                body["metrics"] = {"consensus_distance": None if r == 0 else 1.0 / r}
                if r == 7:
                    body["train_loss"] = 5000.0  # one wild round must not flatten the loss chart
            assert _ingest(server.url, token, f"/api/ingest/runs/{rid}/rounds", body) == 201
        assert _ingest(server.url, token, f"/api/ingest/runs/{rid}/status", {"status": "finished"}) == 200
    return list(runs)


def test_overlaid_multi_run_chart(page, tmp_path):
    server = start_server(tmp_path, fake=True, poll=0.2)
    try:
        ids = _seed_comparison(server)
        _login(page, server.url)
        page.goto(server.url + "/runs")
        assert page.is_disabled("#compare-btn")
        for rid in ids:
            page.check(f"tr[data-run-id='{rid}'] input.pick")
        page.click("#compare-btn")
        page.wait_for_url(f"{server.url}/compare?runs=*")
        _wait_points(page, "=== 63", chart="cmp-acc")
        assert page.locator("#compare-table tbody tr").count() == 3
        assert int(page.get_attribute("#cmp-bytes", "data-points")) == 63
        # Consensus distance only for the decentralized run, its round 0 a gap (20 points, not 21).
        assert page.is_visible("#cmp-fig-consensus")
        assert int(page.get_attribute("#cmp-consensus", "data-points")) == 20
        assert int(page.get_attribute("#cmp-loss", "data-offscale")) == 1  # the wild round, on the edge
        page.screenshot(path=str(ARTIFACTS / "console-compare.png"), full_page=True)
        page.select_option("#cmp-x", "bytes")
        page.wait_for_timeout(200)
        page.screenshot(path=str(ARTIFACTS / "console-compare-vs-bytes.png"), full_page=True)
    finally:
        server.stop()


def test_docs_render_offline_under_the_csp(page, tmp_path):
    server = start_server(tmp_path, fake=True)
    outside: list[str] = []

    def only_local(route):
        if route.request.url.startswith(server.url):
            route.continue_()
        else:  # no network: anything else fails, and is recorded
            outside.append(route.request.url)
            route.abort()

    try:
        errors = _console_errors(page)
        page.route("**/*", only_local)
        page.goto(server.url + "/docs")
        page.wait_for_selector(".swagger-ui .opblock", timeout=90_000)
        assert page.locator(".swagger-ui .opblock").count() >= 20
        assert "fedswarm dashboard" in page.text_content(".swagger-ui .title")
        assert outside == [] and not [e for e in errors if "Content Security Policy" in e], (outside, errors)
        page.screenshot(path=str(ARTIFACTS / "console-docs.png"))
    finally:
        server.stop()


def test_phone_layout_has_no_horizontal_scroll(browser, tmp_path):
    server = start_server(tmp_path, fake=True, poll=0.2)
    ctx = browser.new_context(viewport={"width": 390, "height": 844}, device_scale_factor=2, is_mobile=True,
                              has_touch=True)
    page = ctx.new_page()
    page.set_default_timeout(90_000)  # a deadline, not a wait: generous for loaded CI machines
    try:
        ids = _seed_comparison(server)
        _login(page, server.url)
        for path in ("/runs", f"/runs/{ids[2]}", "/compare?runs=" + ",".join(ids), "/runs/new", "/nodes",
                     "/admin", "/federation", "/docs"):
            page.goto(server.url + path)
            page.wait_for_load_state("load")
            if path == "/docs":
                page.wait_for_selector(".swagger-ui .opblock")
            width = page.evaluate("() => document.documentElement.scrollWidth")
            assert width <= 390, (path, width)
            name = path.strip("/").split("?")[0].replace("/", "-") or "home"
            page.screenshot(path=str(ARTIFACTS / f"phone-{name}.png"), full_page=True)
    finally:
        ctx.close()
        server.stop()


def test_fleet_nodes_page_and_node_charts(page, tmp_path):
    """Three finished simulated runs (54 nodes) and a deployment run whose two SuperNodes are
    live, recorded by the real recorder: the Nodes page lists those two, in the training state,
    and no simulated node at all; a node's page draws its telemetry."""
    from fleet_seed import LIVE_NODES, seed_fleet

    from fedswarm.store import Store

    server = start_server(tmp_path, fake=True)
    try:
        store = Store(server.db)
        seed_fleet(store)
        store.close()
        _login(page, server.url)
        page.goto(server.url + "/nodes")
        rows = page.locator("#nodes tbody tr")
        assert rows.count() == 2
        assert {rows.nth(i).get_attribute("data-node-id") for i in range(2)} == set(LIVE_NODES)
        assert {rows.nth(i).get_attribute("data-state") for i in range(2)} == {"training"}
        assert page.locator("#nodes tbody tr:has-text('sim-')").count() == 0
        assert "54 simulated nodes" in page.text_content("main")
        page.screenshot(path=str(ARTIFACTS / "fleet-nodes.png"), full_page=True)
        page.click(f"#nodes a:text-is('{LIVE_NODES[0]}')")
        page.wait_for_url(f"{server.url}/nodes/{LIVE_NODES[0]}")
        for chart in ("chart-train", "chart-mem", "chart-battery", "chart-temp"):
            _wait_points(page, "== 3", chart=chart)  # one point per recorded round
        page.screenshot(path=str(ARTIFACTS / "fleet-node.png"), full_page=True)
    finally:
        server.stop()


def test_secure_aggregation_card(page, tmp_path):
    """A run that reports secure rounds: the run page's card shows, per round, participants,
    dropouts recovered and the protocol's byte overhead, and says secure aggregation was on."""
    server = start_server(tmp_path, fake=True, poll=0.2)
    try:
        token = _reporter_token(server)
        assert _ingest(server.url, token, "/api/ingest/runs",
                       {"run_id": "secure-run", "name": "secure", "config": {"strategy": "fedavg", "rounds": 2,
                                                                            "secagg": True}}) == 201
        stages = {"advertise": {"down": 1000, "up": 500}, "share_keys": {"down": 2000, "up": 2500},
                  "masked_input": {"down": 40000, "up": 40000}, "unmask": {"down": 700, "up": 1300}}
        sa = {"participants": 10, "nodes": {"masked_input": 9}, "bytes": stages, "dropped_after_sharing": 1,
              "recovered": 1, "threshold": 6, "field_bits": 32}
        assert _ingest(server.url, token, "/api/ingest/runs/secure-run/rounds",
                       {"round": 1, "test_accuracy": 0.5, "metrics": {"secagg": sa, "epsilon": 0.8}}) == 201
        _login(page, server.url)
        page.goto(server.url + "/runs/secure-run")
        assert "is on" in page.text_content("#secagg-note")
        cells = [c.strip() for c in page.locator("#secagg-table tbody tr").first.locator("td").all_text_contents()]
        assert cells[:7] == ["1", "10", "9", "1", "1", "6", "32"] and cells[8:10] == ["10.0%", "0.800"]
        page.screenshot(path=str(ARTIFACTS / "console-run-secagg.png"), full_page=True)
    finally:
        server.stop()
