"""Dashboard benchmark: API latency with 50 concurrent clients on a store of 50 runs x 101
rounds, and live-update fan-out to 100 viewers, against the real app served by uvicorn; and the
fleet's pages for one user with 10,000 simulated nodes in the store (:mod:`fedswarm.bench.dashboard_fleet`).

``run(out_dir, quick)`` seeds a temp SQLite store (50 finished runs, rounds 0..100, 10 nodes a
round, so 50,500 per-node rows; 10,000 simulated nodes of a live run), starts the dashboard in
its own process, then

* **API latency**: 50 closed-loop clients (no think time) for a fixed time per endpoint, with
  ``wrk`` (Debian package ``wrk``) when installed, else an asyncio httpx client; median, p99 and
  requests/s per endpoint. Each endpoint is measured twice: on a quiet store, and while a run
  writes a round (with 10 per-node rows) every 0.1 s, so answers cannot all come from a cache.
* **SSE fan-out**: 100 viewers hold ``/api/runs/{id}/stream`` open while rounds are written;
  for each (viewer, round) the time from the write to the viewer receiving it.

Side by side in one run: two servers over the same store take turns on each endpoint, ``now``
(the app as shipped) and ``plain`` (the same code with the cached-read fast path,
:class:`fedswarm.web.hot_reads.CachedReads`, and the post-start ``gc.freeze`` turned off), so
their ratio is measured under the same machine load. On a machine with 2 or more usable cores
the servers are pinned to the first core and the load generator (this process, wrk) to the
others, so they do not fight for one core; a single uvicorn worker uses one core anyway. Each
row also gives the server's CPU time per request and how many seconds its event loop waited,
runnable, for a core (Linux /proc): on a loaded machine that wait, not the app, makes the tail.

It writes ``dashboard.json`` (the rows) and ``dashboard.png``. When
``BASELINE`` (``dashboard_baseline.json`` beside this file: the same benchmark run on the
code before issue 16's changes, an older run on a differently loaded machine) exists, its
figures are printed and plotted beside the new ones. The load average is recorded with the
rows: on a machine shared with other work, figures are a floor on what the app can do.

First of all, on the 50 runs alone, the operator's ``/api/runs`` rows
(:mod:`fedswarm.bench.dashboard_runs`): ``fedswarm dashboard`` itself, as an operator starts it,
pinned to one core with ``wrk -t1 -c50`` and a viewer token on another. With
``FEDSWARM_BENCH_BEFORE=CHECKOUT`` (another clone, e.g. ``main``'s), that checkout's code runs
beside this one in those rows and in the fleet rows, the two servers taking turns.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from fedswarm.bench import dashboard_fleet, dashboard_runs
from fedswarm.bench.dashboard_load import (CLIENTS, NODES, ROUNDS, RUNS, _cores, _free_port, _httpx_load,
                                          _pct, _server_clock, parse_wrk, seed_store, stop_all, wait_healthy)

__all__ = ["run", "seed_store", "wait_healthy", "parse_wrk", "stop_all"]

VIEWERS = 100
BASELINE = Path(__file__).with_name("dashboard_baseline.json")
VARIANTS = ("plain", "now")  # measured in this order on each endpoint
_SERVE = ("import sys, uvicorn; from fedswarm.web.app import create_app; "
          "now = sys.argv[4] == 'now'; "
          "app = create_app(sys.argv[1], admin_password='bench-password-1', catalog_cmd=['true'], "
          "poll_interval_s=float(sys.argv[3]), freeze_gc=now, cached_reads=now); "
          "uvicorn.run(app, host='127.0.0.1', port=int(sys.argv[2]), log_level='warning', "
          "timeout_graceful_shutdown=2, proxy_headers=False)")  # as `fedswarm dashboard` without --behind-proxy


def _start_server(db: str, poll_s: float, variant: str = "now",
                  cores: set[int] | None = None, tree: Path | None = None) -> tuple[subprocess.Popen, str]:
    """A server of ``variant`` (``plain`` or ``now``); ``tree``: import fedswarm from there
    (:func:`fedswarm.bench.dashboard_runs.source_tree`), another checkout's code."""
    port = _free_port()
    pin = (lambda: os.sched_setaffinity(0, cores)) if cores else None
    # the webhook key file beside the bench's store, not the user's; an environment variable, not an
    # argument, so that a checkout from before sealed secrets (FEDSWARM_BENCH_BEFORE) starts too
    env = {**os.environ, "FEDSWARM_SECRET_KEY_FILE": db + ".secret-key"}
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    proc = subprocess.Popen([sys.executable, "-c", _SERVE, db, str(port), str(poll_s), variant],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=pin, env=env,
                            cwd=str(tree) if tree is not None else None)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, 30, lambda: proc.stderr.read().decode())
    return proc, url


def _wrk(url: str, token: str, seconds: int) -> dict:
    out = subprocess.run(["wrk", "-t2", f"-c{CLIENTS}", f"-d{seconds}s", "--latency", "--timeout", "10s",
                          "-H", f"Authorization: Bearer {token}", url],
                         capture_output=True, text=True, timeout=seconds + 60).stdout
    return parse_wrk(out)


class _Writer:
    """Writes a round (with per-node rows) to the live run every ``gap_s`` in a thread."""

    def __init__(self, db: str, run_id: str, gap_s: float = 0.1):
        from fedswarm.store import Store

        self.store, self.run_id, self.gap_s = Store(db), run_id, gap_s
        self.round = max((r.round for r in self.store.rounds(run_id)), default=0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.gap_s):
            self.round += 1
            self.store.add_round(self.run_id, self.round, test_accuracy=0.5, bytes_up=1000, wall_s=self.gap_s)
            self.store.add_node_rounds(self.run_id, self.round,
                                       [{"node_id": f"w{k}", "bytes_up": 100} for k in range(NODES)])

    def __enter__(self) -> "_Writer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.store.close()


async def _fanout(url: str, token: str, run_id: str, db: str, rounds: int, gap_s: float,
                  first_round: int) -> list[float]:
    """Write ``rounds`` rounds; return every viewer's delay (s) from write to receipt."""
    from fedswarm.store import Store

    written: dict[int, float] = {}
    received: list[tuple[int, float]] = []
    ready = asyncio.Semaphore(0)
    limits = httpx.Limits(max_connections=VIEWERS + 5)
    wanted = set(range(first_round, first_round + rounds))
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {token}"}, limits=limits,
                                 timeout=httpx.Timeout(60, read=60)) as c:
        async def viewer() -> None:
            got = 0
            async with c.stream("GET", f"{url}/api/runs/{run_id}/stream?since={first_round - 1}") as r:
                kind = None
                async for line in r.aiter_lines():
                    if line.startswith("event: "):
                        kind = line[7:]
                        if kind == "status":
                            ready.release()
                    elif line.startswith("data: ") and kind == "round":
                        rnd = json.loads(line[6:])["round"]
                        if rnd in wanted:
                            received.append((rnd, time.time()))
                            got += 1
                        if got == rounds:
                            return

        tasks = [asyncio.create_task(viewer()) for _ in range(VIEWERS)]
        for _ in range(VIEWERS):
            await asyncio.wait_for(ready.acquire(), 60)
        store = Store(db)
        for r in sorted(wanted):
            await asyncio.sleep(gap_s)
            written[r] = time.time()
            await asyncio.to_thread(store.add_round, run_id, r, test_accuracy=0.5, bytes_up=1000, wall_s=gap_s)
        await asyncio.wait_for(asyncio.gather(*tasks), 60)
        store.close()
    return [t - written[r] for r, t in received]


def _load(url: str, token: str, seconds: int, pid: int | None = None) -> dict:
    """Load ``url``; with the server's ``pid``, also its CPU time per request and how long its
    event loop waited for a core (a loaded machine shows here, not in the app)."""
    before = _server_clock(pid) if pid else None
    res = _wrk(url, token, seconds) if shutil.which("wrk") else asyncio.run(_httpx_load(url, token, seconds))
    after = _server_clock(pid) if pid else None
    if before and after and res["requests"]:
        res["server_cpu_ms_per_request"] = round((after[0] - before[0]) * 1e3 / res["requests"], 3)
        res["loop_waiting_for_cpu_s"] = round(after[1] - before[1], 2)
    return res


def _baseline() -> list[dict]:
    try:
        return json.loads(BASELINE.read_text())["rows"]
    except (OSError, ValueError, KeyError):
        return []


def _plot(rows: list[dict], base: list[dict], delays_ms: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    api = [r for r in rows if r["test"] == "api" and r.get("server") == "now"]
    plain = {(r["endpoint"], r["store"]): r["p99_ms"] for r in rows
             if r["test"] == "api" and r.get("server") == "plain"}
    fig, (a, b, f) = plt.subplots(1, 3, figsize=(20, 5))
    labels = [f"{r['endpoint'].replace('/api/', '')}\n{r['store']}" for r in api]
    xs = list(range(len(api)))

    def before(r: dict) -> float:
        m = next((x for x in base if x["test"] == "api" and x["endpoint"] == r["endpoint"]
                  and x["store"] == r["store"]), None)
        return m["p99_ms"] if m else float("nan")

    a.bar([x - 0.27 for x in xs], [before(r) for r in api], 0.27, label="p99 before issue 16 (baseline file)",
          color="#94a3b8")
    a.bar(xs, [plain.get((r["endpoint"], r["store"]), float("nan")) for r in api], 0.27,
          label="p99 plain (this run, no cached reads)", color="#f59e0b")
    a.bar([x + 0.27 for x in xs], [r["p99_ms"] for r in api], 0.27, label="p99 now (this run)", color="#2563eb")
    a.axhline(50, color="r", ls="--", label="target 50 ms")
    a.set_yscale("log")
    a.set_xticks(xs, labels, rotation=20, fontsize=7)
    a.set_ylabel("p99 latency (ms, log scale)")
    a.set_title(f"{CLIENTS} concurrent clients, {RUNS} runs x {ROUNDS} rounds ({api[0]['tool'] if api else ''})")
    a.legend(fontsize=8)
    if delays_ms:
        b.hist(delays_ms, bins=40, color="#0d9488")
        b.axvline(statistics.median(delays_ms), color="k", ls="--", label="median")
        b.axvline(_pct(delays_ms, 99), color="r", ls="--", label="p99")
        b.legend()
    b.set_xlabel("round written → viewer received (ms)")
    b.set_ylabel("(viewer, round) pairs")
    b.set_title(f"SSE fan-out to {VIEWERS} viewers")
    dashboard_fleet.plot(f, [r for r in rows if r["test"] == "fleet" and r.get("server") == "now"])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(out_dir: Path, quick: bool = False, profile: bool = False) -> list[dict]:
    """Run the benchmark; write ``dashboard.json`` and ``dashboard.png`` to ``out_dir`` (and with
    ``profile``, the operator row's server profiles, :mod:`fedswarm.bench.dashboard_runs`)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    seconds, rounds, poll_s = (5, 8, 0.3) if quick else (15, 30, 0.3)
    tmp = tempfile.mkdtemp(prefix="fedswarm-bench-")
    db = os.path.join(tmp, "bench.db")
    ids, live, token = seed_store(db)
    before = os.environ.get(dashboard_runs.BEFORE_ENV) or None
    rows: list[dict] = dashboard_runs.operator_rows(  # first, on the 50 runs alone and no other server up
        db, dashboard_runs.viewer_token(db), seconds=5 if quick else 8, repeats=1 if quick else 3,
        before=before, profile_dir=out_dir if profile else None, log_dir=Path(tmp))
    fleet_endpoints = dashboard_fleet.seed_fleet(db)  # + 10,000 simulated nodes and a fleet of 200
    server_cores, client_cores = _cores()
    own_cores = os.sched_getaffinity(0) if client_cores else None
    servers: dict[str, tuple[subprocess.Popen, str]] = {}
    load = os.getloadavg()[0]
    d_ms: list[float] = []
    try:
        for variant in VARIANTS:
            servers[variant] = _start_server(db, poll_s, variant, server_cores)
        if client_cores:
            os.sched_setaffinity(0, client_cores)  # this process and the wrk it starts
        pinning = (f"server on core {sorted(server_cores)}, load generator on {sorted(client_cores)}"
                   if client_cores else "not pinned")
        endpoints = ["/api/health", "/api/runs", f"/api/runs/{ids[0]}", f"/api/runs/{ids[0]}/rounds", "/metrics"]
        for store_state in ("quiet", "writing"):
            for ep in endpoints:
                if store_state == "writing" and ep == "/api/health":
                    continue
                for variant in VARIANTS:
                    proc, url = servers[variant]
                    if store_state == "writing":
                        with _Writer(db, live):
                            res = _load(url + ep, token, seconds, proc.pid)
                    else:
                        res = _load(url + ep, token, seconds, proc.pid)
                    rows.append({"test": "api", "endpoint": ep.replace(ids[0], "{id}"), "store": store_state,
                                 "server": variant, "concurrency": CLIENTS, "duration_s": seconds,
                                 "pinning": pinning, "loadavg_1m": round(os.getloadavg()[0], 2), **res})
        url = servers["now"][1]
        first = len(_fetch_rounds(url, token, live)) + 1
        delays = asyncio.run(_fanout(url, token, live, db, rounds, gap_s=0.5, first_round=first))
        d_ms = [d * 1e3 for d in delays]
        rows.append({"test": "sse", "endpoint": "/api/runs/{id}/stream", "store": "writing", "server": "now",
                     "viewers": VIEWERS, "rounds": rounds, "delivered": len(d_ms), "expected": VIEWERS * rounds,
                     "poll_interval_s": poll_s, "median_ms": statistics.median(d_ms) if d_ms else float("nan"),
                     "p99_ms": _pct(d_ms, 99), "max_ms": max(d_ms, default=float("nan")),
                     "under_1s": sum(d < 1000 for d in d_ms) / max(1, len(d_ms))})
        fleet = {"now": servers["now"]}
        if before:  # another checkout's code beside this one, the two taking turns on each endpoint, both
            # started afresh (the 'now' above has served the loads: a bigger heap, a warmer cache)
            fleet = {"before": _start_server(db, poll_s, "now", server_cores,
                                             dashboard_runs.source_tree(Path(before), Path(tmp) / "before")),
                     "now": _start_server(db, poll_s, "now", server_cores)}
            servers["before"], servers["fleet-now"] = fleet["before"], fleet["now"]
        for label, path in fleet_endpoints.items():
            for name, (proc, furl) in fleet.items():
                for row in dashboard_fleet.fleet_rows(furl, token, {label: path}, requests=50 if quick else 200,
                                                      server_cpu_s=lambda pid=proc.pid: (_server_clock(pid)
                                                                                         or (None,))[0]):
                    rows.append({**row, "server": name})
    finally:
        stop_all(servers.values(), own_cores, tmp)
    for r in rows:
        r["loadavg_1m_at_start"] = round(load, 2)
    (out_dir / "dashboard.json").write_text(json.dumps(rows, indent=2))
    base = _baseline()
    _plot(rows, base, d_ms, out_dir / "dashboard.png")
    _print(rows, base)
    dashboard_runs.print_rows(rows)
    return rows


def _fetch_rounds(url: str, token: str, run_id: str) -> list:
    r = httpx.get(f"{url}/api/runs/{run_id}/rounds", headers={"Authorization": f"Bearer {token}"}, timeout=30)
    return r.json() if r.status_code == 200 else []


def _print(rows: list[dict], base: list[dict]) -> None:
    if base:
        print(f"baseline: {BASELINE.name} ({json.loads(BASELINE.read_text()).get('note', '')})")
    pin = next((r["pinning"] for r in rows if r["test"] == "api"), "")
    print(f"server 'now': as shipped; 'plain': without cached reads and gc.freeze; {pin}; "
          f"1-min load at start {rows[0]['loadavg_1m_at_start'] if rows else float('nan')}")
    print(f"{'test':5} {'endpoint':24} {'store':8} {'server':6} {'p50 ms':>8} {'p99 ms':>8} {'req/s':>7} "
          f"{'errors':>6} {'load':>5} {'cpu ms/req':>10} {'loop wait s':>11} | {'base p50':>8} {'base p99':>8} "
          f"{'base req/s':>10}")
    for r in rows:
        b = next((x for x in base if x["test"] == r["test"] and x["endpoint"] == r["endpoint"]
                  and x.get("store") == r.get("store")), {})
        errors = r.get("errors", r.get("expected", 0) - r.get("delivered", 0))
        print(f"{r['test']:5} {r['endpoint']:24} {r.get('store', ''):8} {r.get('server', ''):6} "
              f"{r['median_ms']:8.1f} {r['p99_ms']:8.1f} {r.get('rps', float('nan')):7.0f} {errors:6d} "
              f"{r.get('loadavg_1m', float('nan')):5.1f} {r.get('server_cpu_ms_per_request', float('nan')):10.3f} "
              f"{r.get('loop_waiting_for_cpu_s', float('nan')):11.2f} | {b.get('median_ms', float('nan')):8.1f} "
              f"{b.get('p99_ms', float('nan')):8.1f} {b.get('rps', float('nan')):10.0f}")
    nan = float("nan")
    now = {(r["endpoint"], r["store"]): r for r in rows if r["test"] == "api" and r.get("server") == "now"}
    for r in rows:
        if r["test"] == "api" and r.get("server") == "plain" and (r["endpoint"], r["store"]) in now:
            n = now[(r["endpoint"], r["store"])]
            b_cpu = n.get("server_cpu_ms_per_request", nan)
            cpu = r.get("server_cpu_ms_per_request", nan) / b_cpu if b_cpu else nan
            print(f"ratio plain/now {r['endpoint']:24} {r['store']:8} p50 x{r['median_ms'] / n['median_ms']:.1f}  "
                  f"p99 x{r['p99_ms'] / n['p99_ms']:.1f}  req/s x{n['rps'] / r['rps']:.1f}  "
                  f"CPU/request x{cpu:.1f}; "
                  f"now p99 {'<' if n['p99_ms'] < 50 else '>='} 50 ms")
