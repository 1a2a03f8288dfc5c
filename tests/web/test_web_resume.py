"""The dashboard's "Resume from checkpoint" button on a run that died, with the real runner.

A dashboard-owned run dies after round 2 (its process is gone; the store has its checkpoint);
in headless Chromium an admin clicks the button, which runs the real ``python -m fedswarm
resume RUN_ID --db URL``; the run finishes in the same run id with the model the same run
would have had uninterrupted, each round recorded once.
"""

from __future__ import annotations


import pytest
import torch

from dashboard_helpers import ADMIN_PW, CHROMIUM_ARGS, chromium_or_skip, kill_runs, start_server, wait_for
from fedswarm.config import RunConfig
from fedswarm.server.checkpoint import load_latest
from fedswarm.sim.run import run_engine
from fedswarm.store import Store
from fedswarm.wire import arrayrecord_to_vector


sync_api, CHROMIUM = chromium_or_skip()

pytestmark = [pytest.mark.integration, pytest.mark.slow]


class Died(Exception):
    pass


def _die_after(rnd: int):
    def listener(r: int, _row: dict) -> None:
        if r == rnd:
            raise Died(f"process died after round {r}")

    return listener


def _model(store: Store, run_id: str) -> torch.Tensor:
    return arrayrecord_to_vector(load_latest(store, run_id).arrays)


@pytest.mark.timeout(900)
def test_resume_button_continues_a_dead_run(tmp_path):
    server = start_server(tmp_path, fake=False, poll=0.3)
    store = Store(server.db)
    cfg = RunConfig.build({"strategy": "fedavg", "clients": 4, "rounds": 4, "local_steps": 2, "seed": 7})
    try:
        ref = store.create_run(cfg.model_dump())
        assert run_engine(cfg, store=store, run_id=ref) == "finished"
        rid = store.create_run(cfg.model_dump(), name="dies")
        store.update_run(rid, owner="dashboard")
        with pytest.raises(Died):
            run_engine(cfg, store=store, run_id=rid, listeners=[_die_after(2)])
        assert store.get_run(rid).status == "failed" and store.latest_checkpoint(rid).round == 2
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
            page = browser.new_page()
            page.set_default_timeout(20_000)
            page.goto(server.url + "/runs")
            page.fill("input[name=username]", "admin")
            page.fill("input[name=password]", ADMIN_PW)
            page.click("button:has-text('Log in')")
            page.wait_for_url(server.url + "/runs")

            def button_enabled() -> bool:  # the dashboard probes `fedswarm resume --help` at start
                page.goto(f"{server.url}/runs/{rid}")
                return not page.is_disabled("#btn-restart")

            wait_for(button_enabled, timeout=120, interval=0.5)
            with page.expect_navigation():  # the button posts a form; the run's page loads again
                page.click("#btn-restart")
            page.wait_for_function("() => { const b = document.querySelector('#status .badge');"  # null-safe
                                   " return !!b && b.textContent.trim() === 'finished'; }", timeout=300_000)
            browser.close()
        run = store.get_run(rid)
        assert run.status == "finished", run.error
        assert [r.round for r in store.rounds(rid)] == [0, 1, 2, 3, 4]
        torch.testing.assert_close(_model(store, rid), _model(store, ref), rtol=0, atol=1e-5)
        assert any(e.kind == "resumed" and "after round 2" in e.message for e in store.events(rid))
    finally:
        kill_runs(store)
        server.stop()
