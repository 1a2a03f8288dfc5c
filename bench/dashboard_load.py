"""What the dashboard benchmarks share (:mod:`fedswarm.bench.dashboard`, its operator row
:mod:`fedswarm.bench.dashboard_runs` and :mod:`fedswarm.bench.ingest`): the seeded store, a free
port, waiting for a server to be healthy and stopping it, the load generators (wrk, or an httpx
load process) and their parsing, and a server's CPU clock read from /proc."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import time
from pathlib import Path

import httpx

__all__ = ["seed_store", "wait_healthy", "parse_wrk", "stop_all", "RUNS", "ROUNDS", "NODES"]

RUNS, ROUNDS, NODES = 50, 101, 10
CLIENTS = 50  # concurrent connections of a load
SIM_NODES = 10_000  # simulated nodes of the live run: what /metrics counts by state and class


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(q / 100 * (len(xs) - 1)))))] if xs else float("nan")


def seed_store(db: str, runs: int = RUNS, rounds: int = ROUNDS, nodes: int = NODES) -> tuple[list[str], str, str]:
    """``runs`` finished runs of ``rounds`` rounds (0..rounds-1) with ``nodes`` per-node rows
    each, one live run, and an admin token. Returns (run ids, live run id, token)."""
    from fedswarm.store import Node, NodeRound, Round, Store
    from fedswarm.web import tables  # noqa: F401  (creates the token table with the store)
    from fedswarm.web.services.accounts import Accounts

    store = Store(db)
    ids = []
    for i in range(runs):
        strategy = ("fedavg", "topk", "onebit", "dpsgd", "qsgd")[i % 5]
        ids.append(store.create_run({"strategy": strategy, "task": "digits-mlp", "rounds": rounds - 1,
                                     "clients": nodes}, name=f"bench {i}", status="finished"))
    with store.session() as s:
        for rid in ids:
            for r in range(rounds):
                s.add(Round(run_id=rid, round=r, train_loss=1 / (r + 1), test_loss=1.1 / (r + 1),
                            test_accuracy=1 - 1 / (r + 2), bytes_up=10**6, bytes_down=2 * 10**6,
                            wall_s=0.5, sim_time_s=2.0, num_clients=nodes,
                            metrics={"consensus_distance": 0.1 / (r + 1)}))
                if r > 0:
                    s.add_all([NodeRound(run_id=rid, round=r, node_id=f"n{k}", bytes_up=10**5,
                                         bytes_down=2 * 10**5, device_class=("gpu", "edge-wifi")[k % 2])
                               for k in range(nodes)])
    live = store.create_run({"strategy": "fedavg", "rounds": 100_000}, name="bench live", status="running")
    with store.session() as s:
        s.add_all([Node(id=f"{live}:{k}", kind="sim", run_id=live, device_class=("gpu", "edge-wifi")[k % 2])
                   for k in range(SIM_NODES)])
    _, token = Accounts(store).create_token("bench", "admin", None, "bench")
    store.close()
    return ids, live, token


def _cores() -> tuple[set[int] | None, set[int] | None]:
    """(server cores, load-generator cores): the first usable core and the rest, or (None, None)
    on a one-core machine or where affinity cannot be set."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None, None
    return ({cpus[0]}, set(cpus[1:])) if len(cpus) >= 2 else (None, None)


def wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float, output) -> None:
    """Wait until the dashboard at ``url`` answers /api/health; RuntimeError with the tail of
    ``output()`` if its process exits first, and (after killing it) if ``timeout_s`` pass."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("dashboard exited: " + output()[-2000:])
        try:
            if httpx.get(url + "/api/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    proc.wait()
    raise RuntimeError(f"dashboard did not answer /api/health in {timeout_s:g} s")


def parse_wrk(out: str) -> dict:
    """p50, p99 (ms), requests/s, requests and errors (socket errors and non-2xx) from wrk's
    ``--latency`` output."""
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


def _server_clock(pid: int) -> tuple[float, float] | None:
    """(CPU seconds of the whole server process, seconds its event-loop thread spent runnable but
    waiting for a core), from /proc (Linux); None elsewhere."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        wait = int(Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()[1]) / 1e9
        return cpu, wait
    except (OSError, ValueError, IndexError):
        return None


def stop_all(servers, own_cores: set[int] | None, tmp: str | Path) -> None:
    """After a benchmark: this process back on ``own_cores``, each (process, url) of ``servers``
    stopped, ``tmp`` removed."""
    if own_cores:
        os.sched_setaffinity(0, own_cores)
    for proc, _ in servers:
        _stop(proc)
    shutil.rmtree(tmp, ignore_errors=True)


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
