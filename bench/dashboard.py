"""Dashboard benchmark: API latency under 100 concurrent clients and live-update fan-out to
100 viewers, against the real app served by uvicorn on loopback.

``run(out_dir, quick)`` starts the dashboard in its own process over a temp SQLite store
seeded with a 50-round run, then

* **API latency**: 100 concurrent connections for a fixed time per endpoint, with ``wrk``
  (Debian package) when installed, else an asyncio httpx client; median and p99 per endpoint.
* **SSE fan-out**: 100 viewers hold ``/api/runs/{id}/stream`` open while rounds are written
  to the store; for each (viewer, round) the time from the write to the viewer receiving it.

It writes ``dashboard.json`` (the rows) and ``dashboard.png``. The load generator shares the
machine's cores with the server, so figures are a floor on what the app can do.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

__all__ = ["run"]

CLIENTS = 100
VIEWERS = 100
_SERVE = ("import sys, uvicorn; from fedswarm.web.app import create_app; "
          "app = create_app(sys.argv[1], admin_password='bench-password-1', catalog_cmd=['true'], "
          "poll_interval_s=float(sys.argv[3])); "
          "uvicorn.run(app, host='127.0.0.1', port=int(sys.argv[2]), log_level='warning', "
          "timeout_graceful_shutdown=2)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(q / 100 * (len(xs) - 1)))))] if xs else float("nan")


def _seed(db: str) -> tuple[str, str]:
    """A finished 50-round run with 20 nodes, a live run to stream, and an admin token."""
    from fedswarm.store import Store
    from fedswarm.web import auth_models  # noqa: F401  (creates the token table with the store)
    from fedswarm.web.accounts import Accounts

    store = Store(db)
    rid = store.create_run({"strategy": "fedavg", "task": "digits-mlp", "rounds": 50, "clients": 20},
                           name="bench seeded", status="finished")
    for r in range(1, 51):
        store.add_round(rid, r, train_loss=1 / r, test_loss=1.1 / r, test_accuracy=1 - 1 / (r + 1),
                        bytes_up=10**6, bytes_down=2 * 10**6, wall_s=0.5, sim_time_s=2.0, num_clients=20)
        store.add_node_rounds(rid, r, [{"node_id": f"n{i}", "bytes_up": 50_000, "bytes_down": 100_000,
                                        "device_class": "edge-wifi"} for i in range(20)])
    for i in range(10):
        store.create_run({"strategy": "topk", "rounds": 10}, name=f"bench {i}", status="finished")
    live = store.create_run({"strategy": "fedavg", "rounds": 1000}, name="bench live", status="running")
    Accounts(store)  # tables exist
    _, token = Accounts(store).create_token("bench", "admin", None, "bench")
    store.close()
    return rid, live + "|" + token


def _start_server(db: str, poll_s: float) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-c", _SERVE, db, str(port), str(poll_s)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        if proc.poll() is not None:
            raise RuntimeError("dashboard exited: " + proc.stderr.read().decode()[-2000:])
        try:
            if httpx.get(url + "/api/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("dashboard did not start in 30 s")


def _wrk(url: str, token: str, seconds: int) -> dict:
    out = subprocess.run(["wrk", "-t2", f"-c{CLIENTS}", f"-d{seconds}s", "--latency", "--timeout", "10s",
                          "-H", f"Authorization: Bearer {token}", url],
                         capture_output=True, text=True, timeout=seconds + 60).stdout

    def ms(label: str) -> float:
        m = re.search(rf"^\s*{label}%\s+([\d.]+)(us|ms|s)\s*$", out, re.M)
        if not m:
            return float("nan")
        return float(m.group(1)) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[m.group(2)]

    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    total = re.search(r"(\d+) requests in", out)
    errors = sum(int(x) for x in re.findall(r"(?:connect|read|write|timeout) (\d+)", out))
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return {"median_ms": ms("50"), "p99_ms": ms("99"), "rps": float(rps.group(1)) if rps else float("nan"),
            "requests": int(total.group(1)) if total else 0,
            "errors": errors + (int(non2xx.group(1)) if non2xx else 0), "tool": "wrk"}


async def _httpx_load(url: str, token: str, seconds: float) -> dict:
    lat: list[float] = []
    errors = 0
    end = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {token}"}, limits=limits, timeout=30) as c:
        async def worker() -> None:
            nonlocal errors
            while time.monotonic() < end:
                t0 = time.perf_counter()
                try:
                    r = await c.get(url)
                    ok = r.status_code == 200
                except httpx.HTTPError:
                    ok = False
                lat.append((time.perf_counter() - t0) * 1e3)
                errors += not ok
        t0 = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(CLIENTS)))
        wall = time.monotonic() - t0
    return {"median_ms": statistics.median(lat), "p99_ms": _pct(lat, 99), "rps": len(lat) / wall,
            "requests": len(lat), "errors": errors, "tool": "httpx-asyncio"}


async def _fanout(url: str, token: str, run_id: str, db: str, rounds: int, gap_s: float) -> list[float]:
    """Write ``rounds`` rounds; return every viewer's delay (s) from write to receipt."""
    from fedswarm.store import Store

    written: dict[int, float] = {}
    received: list[tuple[int, float]] = []
    ready = asyncio.Semaphore(0)
    limits = httpx.Limits(max_connections=VIEWERS + 5)
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {token}"}, limits=limits,
                                 timeout=httpx.Timeout(60, read=60)) as c:
        async def viewer() -> None:
            got = 0
            async with c.stream("GET", f"{url}/api/runs/{run_id}/stream") as r:
                kind = None
                async for line in r.aiter_lines():
                    if line.startswith("event: "):
                        kind = line[7:]
                        if kind == "status":
                            ready.release()
                    elif line.startswith("data: ") and kind == "round":
                        received.append((json.loads(line[6:])["round"], time.time()))
                        got += 1
                        if got == rounds:
                            return

        tasks = [asyncio.create_task(viewer()) for _ in range(VIEWERS)]
        for _ in range(VIEWERS):
            await asyncio.wait_for(ready.acquire(), 60)
        store = Store(db)
        for r in range(1, rounds + 1):
            await asyncio.sleep(gap_s)
            written[r] = time.time()
            await asyncio.to_thread(store.add_round, run_id, r, test_accuracy=0.5, bytes_up=1000, wall_s=gap_s)
        await asyncio.wait_for(asyncio.gather(*tasks), 60)
        store.close()
    return [t - written[r] for r, t in received]


def _plot(rows: list[dict], delays_ms: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    api = [r for r in rows if r["test"] == "api"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    xs = range(len(api))
    a.bar([x - 0.2 for x in xs], [r["median_ms"] for r in api], 0.4, label="median")
    a.bar([x + 0.2 for x in xs], [r["p99_ms"] for r in api], 0.4, label="p99")
    a.set_xticks(list(xs), [r["endpoint"].replace("/api/", "") for r in api], rotation=15, fontsize=8)
    a.set_ylabel("latency (ms)")
    a.set_title(f"API latency, {CLIENTS} concurrent clients ({api[0]['tool'] if api else ''})")
    a.legend()
    if delays_ms:
        b.hist(delays_ms, bins=40, color="#0d9488")
        b.axvline(statistics.median(delays_ms), color="k", ls="--", label="median")
        b.axvline(_pct(delays_ms, 99), color="r", ls="--", label="p99")
        b.legend()
    b.set_xlabel("round written → viewer received (ms)")
    b.set_ylabel("(viewer, round) pairs")
    b.set_title(f"SSE fan-out to {VIEWERS} viewers")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(out_dir: Path, quick: bool = False) -> list[dict]:
    """Run the benchmark; write ``dashboard.json`` and ``dashboard.png`` to ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    seconds, rounds, poll_s = (5, 8, 0.3) if quick else (20, 30, 0.3)
    tmp = tempfile.mkdtemp(prefix="fedswarm-bench-")
    db = os.path.join(tmp, "bench.db")
    seeded, rest = _seed(db)
    live, token = rest.split("|")
    proc, url = _start_server(db, poll_s)
    rows: list[dict] = []
    try:
        endpoints = ["/api/health", "/api/runs", f"/api/runs/{seeded}", f"/api/runs/{seeded}/rounds"]
        for ep in endpoints:
            res = _wrk(url + ep, token, seconds) if shutil.which("wrk") else \
                asyncio.run(_httpx_load(url + ep, token, seconds))
            name = ep.replace(seeded, "{id}")
            rows.append({"test": "api", "endpoint": name, "concurrency": CLIENTS, "duration_s": seconds, **res})
        delays = asyncio.run(_fanout(url, token, live, db, rounds, gap_s=0.5))
        d_ms = [d * 1e3 for d in delays]
        rows.append({"test": "sse", "endpoint": "/api/runs/{id}/stream", "viewers": VIEWERS, "rounds": rounds,
                     "delivered": len(d_ms), "expected": VIEWERS * rounds, "poll_interval_s": poll_s,
                     "median_ms": statistics.median(d_ms), "p99_ms": _pct(d_ms, 99), "max_ms": max(d_ms),
                     "under_1s": sum(d < 1000 for d in d_ms) / len(d_ms)})
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    (out_dir / "dashboard.json").write_text(json.dumps(rows, indent=2))
    _plot(rows, d_ms, out_dir / "dashboard.png")
    _print(rows)
    return rows


def _print(rows: list[dict]) -> None:
    print(f"{'test':5} {'endpoint':28} {'median ms':>10} {'p99 ms':>9} {'req/s':>8} {'n':>7} {'errors':>6}")
    for r in rows:
        n = r.get("requests", r.get("delivered"))
        print(f"{r['test']:5} {r['endpoint']:28} {r['median_ms']:10.1f} {r['p99_ms']:9.1f} "
              f"{r.get('rps', float('nan')):8.0f} {n:7d} {r.get('errors', r.get('expected', 0) - n):6d}")
