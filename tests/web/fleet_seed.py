"""A store as an operator's would look after some work: finished simulated runs and a live
deployment run, their nodes written by the real run recorder (``RoundRecorder._seen_nodes``,
what every round does after ``Store.add_node_rounds``)."""

from __future__ import annotations

import datetime as dt

from fedswarm.server.recorder import RoundRecorder
from fedswarm.store import Store

SIM_RUNS = {"sim-a": 16, "sim-b": 18, "sim-c": 20}
DEPLOY_RUN = "deploy-1"
LIVE_NODES = ("6917529027641081857", "123")  # SuperNode ids are large integers


def telemetry(r: int, k: int) -> dict:
    return {"train_s": 1.5 + r + k, "peak_rss_mb": 300.0 + 10 * r, "battery_pct": 90.0 - r,
            "cpu_temp_c": 50.0 + r, "cpu_model": "Cortex-A72", "cpu_count": 4}


def record_round(store: Store, run_id: str, rnd: int, rows: list[dict], kind: str) -> None:
    """One round's node rows the way the recorder writes them."""
    store.add_round(run_id, rnd, num_clients=len(rows))
    store.add_node_rounds(run_id, rnd, rows)
    RoundRecorder(store, run_id, grid=None, evaluate=None, node_kind=kind)._seen_nodes(rows)


def seed_fleet(store: Store, rounds: int = 3) -> None:
    """Three finished simulated runs (16, 18 and 20 nodes: ids 1..n, stored as RUN:ID and left
    "online" by their last round) and a running deployment run with two SuperNodes that send
    telemetry, one with device class ``rpi4`` and one ``gpu``."""
    for rid, n in SIM_RUNS.items():
        store.create_run({"engine": "inprocess", "clients": n}, run_id=rid, status="running")
        for r in range(1, rounds + 1):
            record_round(store, rid, r, [{"node_id": str(k), "bytes_up": 100, "device_class": "sim-cpu"}
                                         for k in range(1, n + 1)], "sim")
        store.set_status(rid, "finished")
    store.create_run({"engine": "deployment"}, run_id=DEPLOY_RUN, status="running")
    for r in range(1, rounds + 1):
        rows = [{"node_id": nid, "bytes_up": 1000 * (k + 1), "bytes_down": 2000, "num_examples": 32,
                 "device_class": ("rpi4", "gpu")[k], "telemetry": telemetry(r, k)}
                for k, nid in enumerate(LIVE_NODES)]
        record_round(store, DEPLOY_RUN, r, rows, "supernode")


def age_node(store: Store, node_id: str, seconds: float) -> dt.datetime:
    """Set a node's last-seen time ``seconds`` ago; returns it."""
    from fedswarm.store import Node

    t = (dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=seconds)).replace(tzinfo=None, microsecond=0)
    with store.session() as s:
        s.get(Node, node_id).last_seen = t
    return t
