"""The dashboard in headless Chromium (Playwright's Python package driving Debian's chromium):
log in, start a simulation from the form, watch its chart fill as rounds finish, stop a run.
Screenshots go to test-artifacts/ at the repository root.

``test_real_simulation`` runs the real ``python -m fedswarm sim`` (digits-mlp, 4 clients,
5 rounds); ``test_controls_with_fake_runner`` drives pause/resume/stop on a slow fake run.
Install: ``apt-get install -y chromium`` and ``pip install playwright`` (no browser download).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dashboard_helpers import ADMIN_PW, start_server

CHROMIUM = os.environ.get("FEDSWARM_CHROMIUM", "/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]

sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
if not (os.path.exists(CHROMIUM) or shutil.which("chromium")):
    pytest.skip(f"Chromium missing at {CHROMIUM}: apt-get install -y chromium", allow_module_level=True)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def browser():
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM if os.path.exists(CHROMIUM) else shutil.which("chromium"),
                              args=ARGS, headless=True)
        yield b
        b.close()


@pytest.fixture
def page(browser):
    ctx = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = ctx.new_page()
    page.set_default_timeout(20_000)
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


def _wait_status(page, status: str, timeout_ms: int) -> None:
    page.wait_for_function(f"() => document.querySelector('#status .badge').textContent.trim() === '{status}'",
                           timeout=timeout_ms)


def _real_sim_available() -> str | None:
    r = subprocess.run([sys.executable, "-m", "fedswarm", "sim", "--help"], capture_output=True, text=True)
    return None if r.returncode == 0 else (r.stderr.strip().splitlines() or ["no output"])[-1]


def test_real_simulation(page, tmp_path):
    missing = _real_sim_available()
    assert missing is None, f"`python -m fedswarm sim` is not usable: {missing}"
    server = start_server(tmp_path, fake=False)
    try:
        _login(page, server.url)
        page.goto(server.url + "/runs/new")
        assert page.locator("select#task option[value='digits-mlp']").count() == 1, \
            "the strategy catalog did not load: " + (page.text_content(".warn") or "")
        rid = _start_from_form(page, server.url, "fedavg", task="digits-mlp", clients="4", rounds="5",
                               name="browser: digits-mlp")
        page.wait_for_function("() => +document.querySelector('#chart-acc').dataset.points >= 1", timeout=180_000)
        page.screenshot(path=str(ARTIFACTS / "dashboard-run-filling.png"), full_page=True)
        _wait_status(page, "finished", 240_000)
        page.wait_for_function("() => +document.querySelector('#chart-acc').dataset.points >= 5", timeout=10_000)
        assert _points(page, "chart-bytes") >= 5 and _points(page, "chart-loss") >= 5
        assert "5/5 rounds" in page.text_content("#progress-text")
        page.wait_for_function("() => document.querySelectorAll('#nodes-body tr').length === 4", timeout=10_000)
        page.screenshot(path=str(ARTIFACTS / "dashboard-run-finished.png"), full_page=True)

        # A long run, stopped from the page.
        rid2 = _start_from_form(page, server.url, "fedavg", task="digits-mlp", clients="4", rounds="500",
                                name="browser: to stop")
        page.wait_for_function("() => +document.querySelector('#chart-acc').dataset.points >= 2", timeout=180_000)
        page.click("#btn-stop")
        page.wait_for_url(f"{server.url}/runs/{rid2}?msg=*")
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
        page.wait_for_function("() => +document.querySelector('#chart-acc').dataset.points >= 3")
        page.click("#btn-pause")
        _wait_status(page, "paused", 10_000)
        n = _points(page)
        page.wait_for_timeout(1200)
        assert _points(page) == n, "rounds kept coming while paused"
        page.click("#btn-resume")
        page.wait_for_function(f"() => +document.querySelector('#chart-acc').dataset.points > {n}")
        page.click("#btn-stop")
        _wait_status(page, "stopped", 10_000)
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
        from fedswarm.web.accounts import Accounts

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
