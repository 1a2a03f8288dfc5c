"""Eligibility in a real deployment: a SuperLink and three SuperNodes (``fedswarm client``) on
loopback, one of them started with ``FEDSWARM_FAKE_BATTERY=5`` (its telemetry probe reads a 5 %
battery), the run with ``eligible='battery>=40'``: that node is never sampled after its first
report (the probe before round 1 when its ClientApp answers within the probe's 10 s, else its
round-1 train reply), every later round's row for it says why, and the two others train every
round. The machine's own nodes report no battery (or a real one above 40 %: the test then
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
        # the node on 5 %: its telemetry says so (in a train reply, or in the probe before round 1)
        low = {r.node_id for r in rows if r.telemetry and r.telemetry.get("battery_pct") == 5.0}
        assert len(low) == 1, [(r.round, r.node_id, r.status, r.reason) for r in rows]
        (node,) = low
        mine = sorted(by_node[node], key=lambda r: r.round)
        first = min(r.round for r in mine if r.telemetry)  # its first report: round 1's probe or train reply
        after = [r for r in mine if r.round > first]
        assert [r.round for r in after] == list(range(first + 1, 4)) and first <= 1  # a row every later round
        assert all(r.status == "ineligible" and "battery 5 fails battery>=40" in r.reason for r in after), after
        if mine[0].status == "ineligible":  # the probe's answer came in before round 1's sampling
            assert first == 1 and "battery 5" in mine[0].reason
        others = set(by_node) - {node}
        assert len(others) == 2 and all(r.status == "ok" for n in others for r in by_node[n])
        assert all(sum(r.status == "ok" and r.node_id in others for r in rows if r.round == k) == 2 for k in (1, 2, 3))
        from fedswarm.web.models import SuperNodesOut
        from fedswarm.web.services.fleet import FleetQuery, fleet

        assert {n.id: n for n in store.list_nodes()}[node].status == "ineligible"
        page = {n.id: n for n in fleet(store, SuperNodesOut(configured=False), FleetQuery()).nodes}
        assert page[node].state_detail.startswith(f"not picked in round 3 of run {run.id}: not eligible")
    finally:
        dep.stop()
