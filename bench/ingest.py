"""Ingest benchmark: many reporters, each with its own token, against one dashboard.

``run(out_dir, quick)`` does, for each store (SQLite in a temp file; PostgreSQL started here
from Debian's binaries in a temp dir on loopback, see :mod:`fedswarm.bench.postgres`):

1. starts the real ``fedswarm dashboard`` in its own process on 127.0.0.1;
2. logs in as admin through the login form and issues one reporter token per reporter with
   ``POST /api/tokens`` (the path an operator uses);
3. from this process (asyncio + httpx; :mod:`fedswarm.bench.ingest_load`), runs the
   reporters for the set time: swarm peers (3 node rows a round) and remote ServerApps (10
   node rows a round) register their run, post a round every few seconds and a node heartbeat
   every other round, and retry timeouts and connection errors with the same body as a real
   peer would. A reader polls the runs list and a run's page API all along (the dashboard's
   read latency *during* the load);
4. counts what the store holds against what the reporters were acknowledged: every acked round
   and node row stored exactly once, nothing lost, no 5xx.

It prints a table, writes ``ingest.json`` (the rows) and ``ingest.png``. Full: 1,000 reporters
for 3 minutes per store; ``--quick``: 100 reporters for 20 s per store. The load average and the
CPU seconds of the server and of the load generator are recorded: on 2 shared cores the load
generator's own CPU bounds the rate it can drive, and the rows say so.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path


from fedswarm.bench.dashboard_load import _free_port, _server_clock, _stop, wait_healthy
from fedswarm.bench.ingest_load import LoadResult, issue_tokens, login, run_load
from fedswarm.bench.postgres import create_database, temp_postgres

__all__ = ["run", "count_stored", "start_dashboard"]

ADMIN_PW = "bench-ingest-password"
FULL = {"reporters": 1000, "seconds": 180.0, "round_every_s": 5.0}
QUICK = {"reporters": 100, "seconds": 20.0, "round_every_s": 2.0}


def start_dashboard(db_url: str, log_path: Path) -> tuple[subprocess.Popen, str]:
    """``fedswarm dashboard`` on a free loopback port, its log (with the access log, which
    :func:`server_log` counts answers from) in ``log_path``; (process, url)."""
    port = _free_port()
    env = {**os.environ, "FEDSWARM_ADMIN_PASSWORD": ADMIN_PW}
    log = open(log_path, "wb")  # noqa: SIM115 (closed with the process)
    proc = subprocess.Popen([sys.executable, "-m", "fedswarm", "dashboard", "--db", db_url, "--port", str(port),
                             "--host", "127.0.0.1", "--access-log"], stdout=log, stderr=subprocess.STDOUT, env=env)
    log.close()
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, 90, lambda: log_path.read_text(errors="replace"))
    return proc, url


def server_log(path: Path) -> dict:
    """What the dashboard itself answered (its access log: a 5xx the reporter had stopped
    waiting for shows here only) and the errors it logged."""
    text = path.read_text(errors="replace")
    statuses = Counter(re.findall(r'HTTP/1\.1" (\d{3})', text))
    return {"server_statuses": dict(sorted(statuses.items())),
            "server_5xx": sum(c for s, c in statuses.items() if s.startswith("5")),
            "server_tracebacks": text.count("Traceback (most recent call last)"),
            "server_errors": sorted(set(re.findall(r"^(\w+(?:\.\w+)*(?:Error|Exception|Timeout)\b.*)$", text,
                                                   re.M)))[:5]}


def count_stored(db_url: str, run_ids: list[str]) -> tuple[dict, dict]:
    """What the store holds for ``run_ids``: ``{(run, round): copies}`` and
    ``{(run, round, node_id): copies}``, read straight from the tables."""
    from sqlalchemy import func, select

    from fedswarm.store import NodeRound, Round, Store

    store = Store(db_url)
    rounds: dict = {}
    nodes: dict = {}
    try:
        with store.session() as s:
            for i in range(0, len(run_ids), 500):
                chunk = run_ids[i:i + 500]
                q = (select(Round.run_id, Round.round, func.count()).where(Round.run_id.in_(chunk))
                     .group_by(Round.run_id, Round.round))
                rounds.update({(r, n): c for r, n, c in s.execute(q)})
                q = (select(NodeRound.run_id, NodeRound.round, NodeRound.node_id, func.count())
                     .where(NodeRound.run_id.in_(chunk))
                     .group_by(NodeRound.run_id, NodeRound.round, NodeRound.node_id))
                nodes.update({(r, n, k): c for r, n, k, c in s.execute(q)})
    finally:
        store.close()
    return rounds, nodes


def check(res: LoadResult, rounds: dict, nodes: dict) -> dict:
    """Exactly-once, against what the reporters were acknowledged and what they sent."""
    acked_nodes = {(r, n, k) for (r, n), ks in res.acked.items() for k in ks}
    sent_nodes = {(r, n, k) for (r, n), ks in res.sent.items() for k in ks}
    return {
        "acked_rounds": len(res.acked),
        "acked_node_rows": len(acked_nodes),
        "stored_rounds": sum(rounds.values()),
        "stored_node_rows": sum(nodes.values()),
        "duplicate_rows": sum(c - 1 for c in rounds.values() if c > 1) + sum(c - 1 for c in nodes.values() if c > 1),
        "lost_rows": sum(k not in rounds for k in res.acked) + sum(k not in nodes for k in acked_nodes),
        "stored_unacked_rows": (sum(k not in res.acked for k in rounds)
                                + sum(k not in acked_nodes for k in nodes)),  # the reporter gave up, it landed
        "stored_never_sent": sum(k not in res.sent for k in rounds) + sum(k not in sent_nodes for k in nodes),
    }


def bench_store(store: str, db_url: str, tmp: Path, cfg: dict, out_dir: Path) -> dict:
    proc, url = start_dashboard(db_url, tmp / f"dashboard-{store}.log")
    try:
        cookies, csrf = login(url, "admin", ADMIN_PW)
        t0 = time.monotonic()
        tokens = asyncio.run(issue_tokens(url, cookies, csrf, cfg["reporters"]))
        tokens_s = time.monotonic() - t0
        before = _server_clock(proc.pid)
        load1 = os.getloadavg()[0]
        res = asyncio.run(run_load(url, tokens, cookies, seconds=cfg["seconds"], round_every_s=cfg["round_every_s"]))
        after = _server_clock(proc.pid)
        load2 = os.getloadavg()[0]
    finally:
        _stop(proc)
    log = server_log(tmp / f"dashboard-{store}.log")
    shutil.copy(tmp / f"dashboard-{store}.log", out_dir / f"ingest-dashboard-{store}.log")
    rounds, nodes = count_stored(db_url, res.run_ids)
    row = {"store": store, "reporters": cfg["reporters"], "duration_s": round(res.wall_s, 1),
           "round_every_s": cfg["round_every_s"], "tokens_issued_s": round(tokens_s, 1),
           **res.summary(), **check(res, rounds, nodes), **log,
           "loadavg_1m_start": round(load1, 2), "loadavg_1m_end": round(load2, 2)}
    if before and after:
        row["server_cpu_s"] = round(after[0] - before[0], 1)
        row["server_loop_waiting_for_cpu_s"] = round(after[1] - before[1], 1)
    # The access log holds every answer; reporters missed those that came after they timed out.
    row["client_5xx"], row["status_5xx"] = row["status_5xx"], max(row["status_5xx"], row["server_5xx"])
    row["exactly_once"] = row["duplicate_rows"] == 0 and row["lost_rows"] == 0 and row["stored_never_sent"] == 0
    return row


def run(out_dir: Path, quick: bool = False) -> list[dict]:
    """Run the benchmark on SQLite and on PostgreSQL; write ``ingest.json`` and ``ingest.png``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = QUICK if quick else FULL
    tmp = Path(tempfile.mkdtemp(prefix="fedswarm-ingest-"))
    rows: list[dict] = []
    try:
        rows.append(bench_store("sqlite", str(tmp / "ingest.db"), tmp, cfg, out_dir))
        with temp_postgres(max_connections=200) as port:
            rows.append(bench_store("postgresql", create_database(port, "ingest"), tmp, cfg, out_dir))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    (out_dir / "ingest.json").write_text(json.dumps(rows, indent=2))
    _plot(rows, out_dir / "ingest.png")
    _print(rows)
    return rows


COLS = [("store", "store", "10s"), ("reporters", "reporters", "9d"), ("req/s", "requests_per_s", "7.1f"),
        ("rows/s", "rows_per_s", "7.0f"), ("ingest p50 ms", "ingest_p50_ms", "13.1f"),
        ("ingest p99 ms", "ingest_p99_ms", "13.1f"), ("read p50 ms", "read_p50_ms", "11.1f"),
        ("read p99 ms", "read_p99_ms", "11.1f"), ("5xx", "status_5xx", "5d"), ("retries", "retries", "7d"),
        ("acked rows", "acked_rows", "10d"), ("dup", "duplicate_rows", "4d"), ("lost", "lost_rows", "4d"),
        ("exactly once", "exactly_once", "12s"), ("srv cpu s", "server_cpu_s", "9.1f"),
        ("gen cpu s", "loadgen_cpu_s", "9.1f"), ("load", "loadavg_1m_end", "5.1f")]


def _width(fmt: str) -> int:
    return int(fmt.split(".")[0].rstrip("dfs") or 0)


def _print(rows: list[dict]) -> None:
    print(" ".join(f"{h:>{max(_width(f), len(h))}}" for h, _, f in COLS))
    for r in rows:
        r["acked_rows"] = r["acked_rounds"] + r["acked_node_rows"]
        cells = []
        for h, key, f in COLS:
            v = r.get(key, float("nan"))
            text = format(v, f) if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)
            cells.append(f"{text:>{max(_width(f), len(h))}}")
        print(" ".join(cells))
    for r in rows:
        print(f"{r['store']}: reporters got {r['statuses']}; the server answered {r['server_statuses']}, "
              f"logged {r['server_tracebacks']} tracebacks {r['server_errors']}; reads {r['reads']}; "
              f"read p99 by endpoint "
              f"{r['read_p99_by_endpoint_ms']}; stored-unacked rows (reporter gave up, row landed) "
              f"{r['stored_unacked_rows']}; tokens issued in {r['tokens_issued_s']} s")


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    xs = range(len(rows))
    labels = [r["store"] for r in rows]
    w = 0.2
    for j, (key, label) in enumerate([("ingest_p50_ms", "ingest p50"), ("ingest_p99_ms", "ingest p99"),
                                      ("read_p50_ms", "read p50 (during load)"),
                                      ("read_p99_ms", "read p99 (during load)")]):
        a.bar([x + (j - 1.5) * w for x in xs], [r.get(key, float("nan")) for r in rows], w, label=label)
    a.set_xticks(list(xs), labels)
    a.set_yscale("log")
    a.set_ylabel("latency (ms, log scale)")
    a.set_title(f"{rows[0]['reporters'] if rows else 0} reporters, each its own token")
    a.legend(fontsize=8)
    b.bar(labels, [r["rows_per_s"] for r in rows], color="#2563eb")
    for x, r in zip(xs, rows):
        b.text(x, r["rows_per_s"], f"dup {r['duplicate_rows']} lost {r['lost_rows']} 5xx {r['status_5xx']}",
               ha="center", va="bottom", fontsize=8)
    b.set_ylabel("acknowledged rows stored per second")
    b.set_title("ingest throughput (rounds + node rows)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
