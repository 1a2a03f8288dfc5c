"""The fleet rows of ``fedswarm bench dashboard``: the Nodes page, ``/api/nodes`` (default, and
filtered + sorted by id), one node's ``/api/nodes/{id}`` and ``/metrics``, for one user (requests one after
another), on the benchmark's store of 50 runs x 101 rounds plus one finished run of 10,000
simulated nodes (each in the nodes table and in every round's per-node rows) and a fleet of
200 SuperNodes of a live deployment run, each with 20 rounds of telemetry. Targets: p99 under
200 ms, and ``/metrics`` (one scraper) under 100 ms. The run page of the 10,000-node run is
measured beside them (its node table)."""

from __future__ import annotations

import datetime as dt
import os
import statistics
import time
from typing import Callable

import httpx

__all__ = ["seed_fleet", "fleet_rows", "plot", "SIM_NODES", "FLEET_NODES", "TARGET_MS", "METRICS_TARGET_MS",
           "target_ms"]

SIM_NODES, SIM_ROUNDS = 10_000, 3
FLEET_NODES, FLEET_ROUNDS = 200, 20
TARGET_MS = 200.0  # p99 for one user: the Nodes page and /api/nodes
METRICS_TARGET_MS = 100.0  # p99 for one scraper: /metrics


def target_ms(label: str) -> float:
    """The p99 target of a fleet row."""
    return METRICS_TARGET_MS if label == "/metrics" else TARGET_MS


def seed_fleet(db: str) -> dict[str, str]:
    """Add the 10,000-node simulated run and the live fleet; returns the endpoints to measure."""
    from sqlalchemy import insert

    from fedswarm.store import Node, NodeRound, Round, Store

    store = Store(db)
    now = dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)
    sim = store.create_run({"engine": "batched", "clients": SIM_NODES}, name="bench 10k nodes", status="finished")
    live = store.create_run({"engine": "deployment"}, name="bench fleet", status="running")
    with store.session() as s:
        s.execute(insert(Node), [{"id": f"{sim}:{k}", "kind": "sim", "run_id": sim, "device_class": "sim-cpu",
                                  "status": "online", "info": {}, "last_seen": now} for k in range(SIM_NODES)])
        for r in range(1, SIM_ROUNDS + 1):
            s.add(Round(run_id=sim, round=r, num_clients=SIM_NODES, node_rows=SIM_NODES))
            s.execute(insert(NodeRound), [{"run_id": sim, "round": r, "node_id": str(k), "bytes_up": 1000,
                                           "status": "ok", "policy": {}} for k in range(SIM_NODES)])
        fleet_ids = [str(6917529027641081857 + 7919 * k) for k in range(FLEET_NODES)]
        s.execute(insert(Node), [{"id": nid, "kind": "supernode", "run_id": live,
                                  "device_class": ("rpi4", "jetson", "gpu")[k % 3], "status": "online", "info": {},
                                  "last_seen": now, "telemetry": {"train_s": 2.0, "peak_rss_mb": 400.0}}
                                 for k, nid in enumerate(fleet_ids)])
        for r in range(1, FLEET_ROUNDS + 1):
            s.add(Round(run_id=live, round=r, num_clients=FLEET_NODES, node_rows=FLEET_NODES))
            s.execute(insert(NodeRound), [
                {"run_id": live, "round": r, "node_id": nid, "bytes_up": 10**5, "status": "ok", "policy": {},
                 "telemetry": {"train_s": 2.0 + r / 10, "peak_rss_mb": 400.0 + k, "battery_pct": 100.0 - r,
                               "cpu_temp_c": 50.0 + r / 2}} for k, nid in enumerate(fleet_ids)])
    store.close()
    return {"/nodes (page)": "/nodes", "/api/nodes": "/api/nodes",
            "/api/nodes?class&sort=id": "/api/nodes?device_class=rpi4&sort=id&order=desc",
            "/api/nodes/{id}": f"/api/nodes/{fleet_ids[7]}", "/api/runs/{10k-node run}": f"/api/runs/{sim}",
            "/metrics": "/metrics"}


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(q / 100 * (len(xs) - 1)))))] if xs else float("nan")


def fleet_rows(url: str, token: str, endpoints: dict[str, str], requests: int = 200,
               server_cpu_s: Callable[[], float | None] | None = None) -> list[dict]:
    """p50/p99 of each endpoint for one user: ``requests`` sequential requests after 5 warm-up ones.
    ``server_cpu_s()``: the server's CPU seconds so far, for its CPU time per request (what a
    loaded machine does not inflate, unlike the latency)."""
    rows = []
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as c:
        for label, path in endpoints.items():
            ms, errors, cpu0 = [], 0, None
            for i in range(requests + 5):
                if i == 5 and server_cpu_s is not None:
                    cpu0 = server_cpu_s()
                t = time.perf_counter()
                r = c.get(path)
                if i >= 5:
                    ms.append((time.perf_counter() - t) * 1e3)
                    errors += r.status_code != 200
            cpu1 = server_cpu_s() if cpu0 is not None and server_cpu_s is not None else None
            cpu = {"server_cpu_ms_per_request": round((cpu1 - cpu0) * 1e3 / requests, 2)} if cpu1 is not None else {}
            rows.append({"test": "fleet", "endpoint": label, "store": "quiet", "server": "now", "concurrency": 1,
                         "requests": requests, "errors": errors, "median_ms": statistics.median(ms),
                         "p99_ms": _pct(ms, 99), "rps": 1e3 / statistics.mean(ms), "target_p99_ms": target_ms(label),
                         "sim_nodes_in_store": SIM_NODES, "fleet_nodes": FLEET_NODES,
                         "loadavg_1m": round(os.getloadavg()[0], 2), **cpu})
    return rows


def plot(ax, rows: list[dict]) -> None:
    """The fleet rows' p50 and p99 as bars beside the target, on one matplotlib axis."""
    xs = list(range(len(rows)))
    ax.bar([x - 0.2 for x in xs], [r["median_ms"] for r in rows], 0.4, label="p50", color="#94a3b8")
    ax.bar([x + 0.2 for x in xs], [r["p99_ms"] for r in rows], 0.4, label="p99", color="#2563eb")
    for x, r in zip(xs, rows):  # each row's own target (the Nodes page's, or /metrics')
        ax.hlines(r["target_p99_ms"], x - 0.45, x + 0.45, colors="r", linestyles="--",
                  label="target p99" if x == 0 else None)
    ax.set_xticks(xs, [r["endpoint"] for r in rows], rotation=20, fontsize=7)
    ax.set_ylabel("latency (ms), one user")
    ax.set_title(f"Fleet: {SIM_NODES:,} simulated nodes in the store, {FLEET_NODES} fleet nodes")
    ax.legend(fontsize=8)
