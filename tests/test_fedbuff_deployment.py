"""FedBuff on a real deployment: a SuperLink and 5 SuperNodes on loopback, one of them slowed
about 10x by the test-only node config ``test-step-delay-s``. With K = 2 the run makes its 10
aggregations from whatever arrives: the slow node's updates come in stale and no aggregation
waits for it (read from the recorded staleness and node ids, not from timings). The fifth node is
started with ``FEDSWARM_FAKE_BATTERY=5`` and the run asks ``eligible='battery>=40'``: FedBuff's
dispatch probes the nodes' telemetry and never sends that node a model (not before its probe
answer either: :mod:`fedswarm.strategies.federated.fedbuff_eligibility`); it has an ``ineligible``
row in every aggregation, naming the clause from its first answer on."""

from __future__ import annotations

import time

import pytest

from fedswarm.client.app import TEST_STEP_DELAY_KEY
from fedswarm.client.supernode import supernode_command
from fedswarm.store import Store
from tests.deployment_helpers import ROOT, Deployment, status_of
from tests.helpers import free_port, port_open, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # a ClientApp process per message: slow when loaded

BATCH = 120  # digits-mlp's 4 partitions of about 360 examples: 3 local steps a round
#: The slow node's wait per local step. A train round trip on loopback costs a few seconds (the
#: SuperNode starts a ClientApp process per message: seconds of imports, more on a loaded machine),
#: so 3 steps of this make the slow node several times slower than the others.
DELAY_S = 5.0


def test_fedbuff_does_not_wait_for_a_slow_supernode(tmp_path):
    from fedswarm.telemetry import battery

    real = battery().get("battery_pct")
    if real is not None and real < 40:
        pytest.skip(f"this machine's own battery is at {real} %: every node would be ineligible")
    dep = Deployment(tmp_path, hold="")
    db = tmp_path / "store.db"
    t0 = time.perf_counter()
    try:
        dep._spawn(dep.superlink_command())
        wait_until(lambda: port_open("127.0.0.1", dep.port), 60, interval=0.2, what="the SuperLink listening")
        for i in range(3):
            dep.start_node(i, 5)
        dep.start_node(4, 5, env={"FEDSWARM_FAKE_BATTERY": "5"})  # its telemetry says 5 % battery
        slow = supernode_command(f"127.0.0.1:{dep.port}", 3, 5, device_class="straggler", insecure=True,
                                 clientappio_port=free_port(), state_dir=tmp_path / "node-state-3")
        at = slow.index("--node-config") + 1
        slow[at] += f" {TEST_STEP_DELAY_KEY}={DELAY_S}"
        dep.nodes[3] = dep._spawn(slow)
        dep.flwr("run", str(ROOT), "test", "--run-config",
                 "rounds=10 clients=5 strategy='fedbuff' params='{\"buffer_size\": 2, \"concurrency\": 4}' "
                 f"local_epochs=1 batch_size={BATCH} seed=5 eval_every=1000 eligible='battery>=40' db='{db}'")
        run = dep.wait(lambda: status_of(db, "finished", "failed", "stopped"), 600, what="the run ending")
        wall = time.perf_counter() - t0
        assert run.status == "finished", dep.logs()
        store = Store(db)
        try:
            rounds = [r for r in store.rounds(run.id) if r.round > 0]
            nodes = store.node_rounds(run.id)
        finally:
            store.close()
    finally:
        dep.stop()
    assert [r.metrics["model_version"] for r in rounds] == list(range(1, 11))
    assert all(r.metrics["updates"] == 2 for r in rounds)
    slow_ids = {n.node_id for n in nodes if n.device_class == "straggler"}  # its rows name its class
    assert len(slow_ids) == 1, [(n.node_id, n.device_class) for n in nodes]
    slow_id = slow_ids.pop()
    by_node: dict[str, list[int]] = {}
    for r in rounds:
        for node, stal in r.metrics["staleness_by_node"].items():
            by_node.setdefault(node, []).extend(stal)
    # the node on 5 %: never dispatched, an ineligible row in every aggregation (no telemetry yet, until
    # its probe's answer came in; then its battery, naming the clause)
    low = {n.node_id for n in nodes if n.telemetry and n.telemetry.get("battery_pct") == 5.0}
    assert len(low) == 1, [(n.round, n.node_id, n.status, n.reason, n.telemetry) for n in nodes]
    low_id = low.pop()
    assert low_id not in by_node, by_node
    mine = sorted((n for n in nodes if n.node_id == low_id), key=lambda n: n.round)
    assert [n.round for n in mine] == list(range(1, 11)) and all(n.status == "ineligible" for n in mine), mine
    first = min(n.round for n in mine if n.telemetry)
    assert all("no telemetry yet" in n.reason for n in mine if n.round < first), mine
    assert all("battery 5 fails battery>=40" in n.reason for n in mine if n.round >= first), mine
    contributions = {n: len(s) for n, s in by_node.items()}
    fast = [n for n in by_node if n != slow_id]
    # the slow node contributes, and every one of its updates is stale: aggregations were made from
    # the fast nodes while it trained, none waiting for it (a barrier would make each of them fresh)
    assert slow_id in by_node and min(by_node[slow_id]) >= 1, by_node
    mean = {n: sum(s) / len(s) for n, s in by_node.items()}
    assert mean[slow_id] > max(mean[n] for n in fast), by_node
    assert contributions[slow_id] < min(contributions[n] for n in fast), contributions
    fast_only = [r for r in rounds if slow_id not in r.metrics["staleness_by_node"]]
    assert len(fast_only) >= 5, by_node
    assert not [n for n in nodes if n.status == "failed"], [(n.round, n.node_id, n.reason) for n in nodes]
    print(f"fedbuff deployment: 10 aggregations in {wall:.1f} s wall (whole test), staleness by node {by_node}")
