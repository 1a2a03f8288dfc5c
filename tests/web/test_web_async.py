"""An asynchronous run's page in headless Chromium: a FedBuff run shows model versions instead of
rounds, a staleness chart and the number of nodes in flight; a synchronous run's page does not."""

from __future__ import annotations

import pytest

from dashboard_helpers import ADMIN_PW, CHROMIUM_ARGS, chromium_or_skip, start_server

sync_api, CHROMIUM = chromium_or_skip()

pytestmark = pytest.mark.integration


def _record(db, strategy: str, **kw) -> str:
    """A finished run of ``strategy`` recorded into the dashboard's store (in-process engine)."""
    from fedswarm.config import RunConfig
    from tests.helpers import record_run

    cfg = RunConfig.model_validate(dict(strategy=strategy, task="synthetic-logreg", clients=6, rounds=5,
                                        local_steps=2, eval_every=1000, **kw))
    return record_run(cfg, db, name=f"browser: {strategy}")[0]


def test_async_run_page_shows_versions_staleness_and_in_flight(tmp_path):
    server = start_server(tmp_path, fake=True)
    try:
        fedbuff = _record(server.db, "fedbuff", params={"buffer_size": 2, "concurrency": 5},
                          devices="edge-wifi:4,straggler:2")
        fedavg = _record(server.db, "fedavg")
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.set_default_timeout(60_000)
                errors: list[str] = []
                page.on("pageerror", lambda e: errors.append(str(e)))
                page.goto(server.url + "/runs")
                page.fill("input[name=username]", "admin")
                page.fill("input[name=password]", ADMIN_PW)
                page.click("button:has-text('Log in')")
                page.wait_for_url(server.url + "/runs")

                page.goto(server.url + f"/runs/{fedbuff}")
                page.wait_for_function("() => +document.querySelector('#chart-staleness').dataset.points >= 15")
                assert page.is_visible("#fig-staleness") and page.is_visible("#fig-inflight")
                assert int(page.get_attribute("#chart-inflight", "data-points")) == 5
                page.wait_for_function("() => document.querySelector('#progress-text').textContent"
                                       ".includes('model version 5 of 5')")
                assert page.text_content("#acc-x-round") == "model version"
                assert "per model version" in page.text_content("#cap-failed")
                page.screenshot(path=str(tmp_path / "async-run.png"), full_page=True)

                page.goto(server.url + f"/runs/{fedavg}")
                page.wait_for_function("() => +document.querySelector('#chart-acc').dataset.points >= 6")
                assert not page.is_visible("#fig-staleness") and not page.is_visible("#fig-inflight")
                assert "round 5 of 5" in page.text_content("#progress-text")
                assert page.text_content("#acc-x-round") == "round"
                assert not errors, errors
            finally:
                browser.close()
    finally:
        server.stop()
