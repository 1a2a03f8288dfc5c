"""The Nodes page of an operator's dashboard, all parts real: three finished simulations
(``fedswarm sim`` into the dashboard's store) and a deployment on loopback (a real
``flower-superlink`` and two ``fedswarm client`` SuperNodes, ``flwr run`` recording into the same
store). While the deployment holds in its second round, headless Chromium finds exactly the two
SuperNodes live on the Nodes page, no simulated node in the fleet, and a node page that draws the
telemetry its device reported in round 1. The seeded twin of this test, with thousands of rows,
is ``test_fleet_nodes_page_and_node_charts`` in test_web_browser.py."""

from __future__ import annotations

import subprocess
import sys

import pytest
from dashboard_helpers import start_server, wait_for
from test_web_browser import _login, _wait_points, browser, page  # noqa: F401  (fixtures)

from fedswarm.store import Store
from tests.deployment_helpers import ROOT, Deployment

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]
SIMS = 3
SIM_CLIENTS = 4


def _simulate(db, out) -> None:
    """Three short simulations, one after another, recorded into the dashboard's store."""
    for i in range(SIMS):
        done = subprocess.run([sys.executable, "-m", "fedswarm", "sim", "--rounds", "1", "--clients", str(SIM_CLIENTS),
                               "--db", str(db), "--out", str(out / f"sim-{i}"), "--seed", str(i)],
                              capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


def _states(server_db) -> dict:
    """Every node of the store by id: (kind, status)."""
    store = Store(server_db)
    try:
        return {n.id: (n.kind, n.status) for n in store.list_nodes()}
    finally:
        store.close()


def test_nodes_page_shows_the_two_live_supernodes_of_a_real_deployment(page, tmp_path, hold_dir):  # noqa: F811
    server = start_server(tmp_path, fake=False)
    (tmp_path / "dep").mkdir()
    dep = Deployment(tmp_path / "dep", f"{2 * 3}:{hold_dir}")  # round 1 runs; round 2 holds on both nodes
    try:
        _simulate(server.db, tmp_path)
        sims = [k for k, (kind, _) in _states(server.db).items() if kind == "sim"]
        assert len(sims) == SIMS * SIM_CLIENTS, sims
        dep.run_until_round_2_holds(2, server.db, hold_dir)
        live = sorted(k for k, (kind, _) in _states(server.db).items() if kind == "supernode")
        assert len(live) == 2, _states(server.db)

        _login(page, server.url)
        page.goto(server.url + "/nodes")
        rows = page.locator("#nodes tbody tr")
        assert rows.count() == 2, page.text_content("#nodes")
        assert sorted(rows.nth(i).get_attribute("data-node-id") for i in range(2)) == live
        states = {rows.nth(i).get_attribute("data-state") for i in range(2)}
        assert states <= {"training", "online"} and states, states  # live: in a running run, heard from
        assert f"{SIMS * SIM_CLIENTS} simulated nodes" in page.text_content("main")
        page.click(f"#nodes a:text-is('{live[0]}')")
        page.wait_for_url(f"{server.url}/nodes/{live[0]}")
        for chart in ("chart-train", "chart-mem"):  # what every device measures; battery/thermal may be absent
            _wait_points(page, "== 1", chart=chart)  # round 1's telemetry

        (hold_dir / "release").write_text("")
        wait_for(lambda: _all_finished(server.db), timeout=600, interval=0.5)
    finally:
        (hold_dir / "release").write_text("")
        dep.stop()
        server.stop()


def _all_finished(db) -> bool:
    """The three simulations and the released deployment have all finished."""
    store = Store(db)
    try:
        runs = store.list_runs()
        return len(runs) == SIMS + 1 and all(r.status == "finished" for r in runs)
    finally:
        store.close()
