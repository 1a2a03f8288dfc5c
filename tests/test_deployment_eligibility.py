"""Eligibility in a real deployment: a SuperLink and three SuperNodes (``fedswarm client``) on
loopback, one of them started with ``FEDSWARM_FAKE_BATTERY=5`` (its telemetry probe reads a 5 %
battery), the run with ``eligible='battery>=40'``: that node is never sampled after its first
report (the probe before round 1), every round's row for it says why, and the two others train
every round. The machine's own nodes report no battery (or a real one above 40 %: the test then
says so rather than pass or fail on the host's charge)."""

from __future__ import annotations

import pytest

from fedswarm.store import Store
from tests.deployment_helpers import ROOT, Deployment, status_of
from tests.helpers import port_open, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.timeout(600)
def test_a_node_on_5_percent_battery_is_never_sampled(tmp_path):
    from fedswarm.telemetry import battery

    real = battery().get("battery_pct")
    if real is not None and real < 40:
        pytest.skip(f"this machine's own battery is at {real} %: every node would be ineligible")
    db = tmp_path / "store.db"
    dep = Deployment(tmp_path, hold="")
    try:
        dep._spawn(dep.superlink_command())
        wait_until(lambda: port_open("127.0.0.1", dep.port), 60, interval=0.2, what="the SuperLink listening")
        for i in range(3):
            dep.start_node(i, 3, env={"FEDSWARM_FAKE_BATTERY": "5"} if i == 2 else None)
        dep.flwr("run", str(ROOT), "test", "--run-config",
                 f"rounds=3 clients=3 local_epochs=1 task='synthetic-logreg' db='{db}' eligible='battery>=40'")
        run = dep.wait(lambda: status_of(db, "finished", "failed", "stopped"), 420, what="the run ending")
        assert run.status == "finished", f"{run.error}\n{dep.logs()}"
        store = Store(db)
        rows = [r for r in store.node_rounds(run.id) if r.round > 0]
        by_node: dict[str, list] = {}
        for r in rows:
            by_node.setdefault(r.node_id, []).append(r)
        low = [n for n, rs in by_node.items() if all(r.status == "ineligible" for r in rs)]
        assert len(low) == 1, [(r.round, r.node_id, r.status, r.reason) for r in rows]
        (node,) = low
        assert sorted(r.round for r in by_node[node]) == [1, 2, 3]  # one row a round, none 'ok'
        assert all("battery 5 fails battery>=40" in r.reason for r in by_node[node])
        assert all(r.telemetry and r.telemetry.get("battery_pct") == 5.0 for r in by_node[node])
        trained = {n for n, rs in by_node.items() if any(r.status == "ok" for r in rs)}
        assert len(trained) == 2 and node not in trained
        assert all(sum(r.status == "ok" for r in rows if r.round == k) == 2 for k in (1, 2, 3))
        from fedswarm.web.models import SuperNodesOut
        from fedswarm.web.services.fleet import FleetQuery, fleet

        assert {n.id: n for n in store.list_nodes()}[node].status == "ineligible"
        page = {n.id: n for n in fleet(store, SuperNodesOut(configured=False), FleetQuery()).nodes}
        assert page[node].state_detail.startswith(f"not picked in round 3 of run {run.id}: not eligible")
    finally:
        dep.stop()
