"""The operator's ``/api/runs`` row of ``fedswarm bench dashboard`` (also alone as ``fedswarm bench
dashboard-runs``): ``fedswarm dashboard`` exactly as an operator starts it (default logging, its
output to a file), pinned to one core, and ``wrk -t1 -c50`` with a viewer token pinned to another
(else a separate load process pinned there), on a store of 50 runs x 101 rounds. Rows: p50, p99,
requests/s, and the server's CPU time per request (``/proc`` of the server process).

Side by side: with ``FEDSWARM_BENCH_BEFORE=/path/to/other/checkout`` (e.g. ``/work/main``) a second
server runs that checkout's code (``before``) beside this one (``now``), both on the same core,
and the two are loaded in turn, ``repeats`` times each, so both see the same machine load.

Profile mode (``fedswarm bench dashboard-runs --profile``): after the rows, each server is loaded
once more while ``py-spy`` (if installed) samples it; ``DIR/dashboard-runs-profile-<server>.txt``
gives where the event-loop thread's busy samples go (inclusive and own time per function) and
the other threads' busy samples apart. Without py-spy the profile mode says so and is skipped.
"""

from __future__ import annotations

import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["run", "operator_rows", "viewer_token", "source_tree", "summarize_profile", "BEFORE_ENV"]

BEFORE_ENV = "FEDSWARM_BENCH_BEFORE"
CLIENTS = 50
ENDPOINT = "/api/runs"
P99_TARGET_MS, P50_TARGET_MS = 25.0, 6.0
_PASSWORD = "bench-password-1"


def viewer_token(db: str) -> str:
    """A viewer token (reads only, as a watching operator's) in the store at ``db``."""
    from fedswarm.store import Store
    from fedswarm.web import tables  # noqa: F401  (creates the token table with the store)
    from fedswarm.web.services.accounts import Accounts

    store = Store(db)
    try:
        return Accounts(store).create_token("bench-viewer", "viewer", None, "bench")[1]
    finally:
        store.close()


def source_tree(checkout: Path, into: Path) -> Path:
    """A directory that, first on ``PYTHONPATH``, imports ``fedswarm`` from ``checkout`` (another
    clone of this repository) instead of the installed one: ``fedswarm/`` holds links to the
    checkout's ``fedswarm/*`` and to each subpackage directory its pyproject maps
    (``fedswarm.web`` -> ``web/``, ...). ValueError naming the checkout if it has no fedswarm."""
    import tomllib

    checkout = Path(checkout).resolve()
    try:
        project = tomllib.loads((checkout / "pyproject.toml").read_text())
        mapping = project["tool"]["setuptools"]["package-dir"]
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"{BEFORE_ENV}={checkout}: not a fedswarm checkout ({exc})") from None
    pkg = into / "fedswarm"
    pkg.mkdir(parents=True)
    for entry in (checkout / mapping.get("fedswarm", "fedswarm")).iterdir():
        if entry.name != "__pycache__":
            (pkg / entry.name).symlink_to(entry)
    for name, rel in mapping.items():
        if name.startswith("fedswarm.") and name.count(".") == 1 and not (pkg / name[9:]).exists():
            (pkg / name[9:]).symlink_to(checkout / rel)
    return into


def _pin(cores: set[int] | None) -> list[str]:
    if not cores:
        return []
    spec = ",".join(map(str, sorted(cores)))
    return ["taskset", "-c", spec] if shutil.which("taskset") else []


def _start(db: str, cores: set[int] | None, log_path: Path, tree: Path | None) -> tuple[subprocess.Popen, str]:
    from fedswarm.bench.dashboard_load import _free_port, wait_healthy

    port = _free_port()
    env = {**os.environ, "FEDSWARM_ADMIN_PASSWORD": _PASSWORD}
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(tree), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    pin = _pin(cores)
    preexec = (lambda: os.sched_setaffinity(0, cores)) if cores and not pin else None
    log = log_path.open("wb")
    proc = subprocess.Popen([*pin, sys.executable, "-m", "fedswarm", "dashboard", "--db", db, "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=preexec,
                            cwd=str(tree) if tree is not None else None)
    log.close()
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, 60, lambda: log_path.read_text(errors="replace"))
    return proc, url


_LOAD_PROCESS = ("import asyncio, json, sys; from fedswarm.bench.dashboard_load import _httpx_load; "
                 "print(json.dumps(asyncio.run(_httpx_load(sys.argv[1], sys.argv[2], float(sys.argv[3])))))")


def _load_command(url: str, token: str, seconds: int, pin: list[str]) -> list[str]:
    """A closed-loop load of ``CLIENTS`` connections, pinned with ``pin``: wrk with one thread,
    else an asyncio httpx client in its own process (prints its figures as JSON)."""
    if shutil.which("wrk"):
        return [*pin, "wrk", "-t1", f"-c{CLIENTS}", f"-d{seconds}s", "--latency", "--timeout", "10s",
                "-H", f"Authorization: Bearer {token}", url]
    return [*pin, sys.executable, "-c", _LOAD_PROCESS, url, token, str(seconds)]


def _load_once(url: str, token: str, seconds: int, pin: list[str]) -> dict:
    from fedswarm.bench.dashboard_load import parse_wrk

    cmd = _load_command(url, token, seconds, pin)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 120)
    if "wrk" in cmd:
        res = parse_wrk(out.stdout)
        if not res["requests"]:
            raise RuntimeError(f"wrk measured nothing: {(out.stderr or out.stdout)[-500:]}")
        return res
    if out.returncode != 0:
        raise RuntimeError(f"the load process failed: {out.stderr[-1000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _measure(pid: int, url: str, token: str, seconds: int, pin: list[str]) -> dict:
    from fedswarm.bench.dashboard_load import _server_clock

    before = _server_clock(pid)
    res = _load_once(url, token, seconds, pin)
    after = _server_clock(pid)
    if before and after and res["requests"]:
        res["server_cpu_ms_per_request"] = round((after[0] - before[0]) * 1e3 / res["requests"], 3)
        res["loop_waiting_for_cpu_s"] = round(after[1] - before[1], 2)
    return res


def _profile(pid: int, url: str, token: str, seconds: int, pin: list[str], raw: Path) -> str:
    """Load ``url`` while py-spy samples the server ``pid`` for ``seconds`` (raw stacks to ``raw``);
    the summary (:func:`summarize_profile`), or why there is none."""
    if not shutil.which("py-spy"):
        return "py-spy is not installed (pip install py-spy): no profile\n"
    load = subprocess.Popen(_load_command(url, token, seconds + 2, pin), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        time.sleep(1)  # sample the steady state, not the connections opening
        out = subprocess.run(["py-spy", "record", "-p", str(pid), "-d", str(seconds), "-r", "250", "--threads",
                              "-f", "raw", "-o", str(raw), "--nonblocking"],
                             capture_output=True, text=True, timeout=seconds + 60)
    finally:
        load.wait(seconds + 60)
    if out.returncode != 0 or not raw.exists():
        return f"py-spy failed (exit {out.returncode}): {(out.stderr or out.stdout)[-500:]}\n"
    return summarize_profile(raw.read_text())


_FRAME = re.compile(r"^(?P<fn>.*?) \((?P<file>[^()]*?)(?::\d+)?\)$")


def _short(frame: str) -> str:
    m = _FRAME.match(frame)
    if not m:
        return frame
    return f"{m.group('fn')} ({'/'.join(m.group('file').split('/')[-2:])})"  # e.g. web/middleware.py


def summarize_profile(raw_text: str, top: int = 40) -> str:
    """A plain-text summary of py-spy ``--threads -f raw`` output: the event-loop thread's busy
    samples (the thread that runs uvicorn's ``Server.run``) by function, inclusive and own (the
    start-up chain down to ``Runner.run`` left out), then each other thread's busy samples."""
    stacks: list[tuple[str, list[str], int]] = []
    loop_threads: set[str] = set()
    for line in raw_text.splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        thread, *frames = stack.split(";")
        if any(f.startswith("Server.run ") for f in frames):
            loop_threads.add(thread)
        stacks.append((thread, frames, int(n)))
    incl: collections.Counter = collections.Counter()
    own: collections.Counter = collections.Counter()
    others: collections.Counter = collections.Counter()
    total = 0
    for thread, frames, n in stacks:
        if thread in loop_threads:
            start = next((i + 1 for i, f in enumerate(frames) if f.startswith("Runner.run ")), 0)
            mine = [_short(f) for f in frames[start:]] or ["(the event loop itself)"]
            total += n
            for f in set(mine):
                incl[f] += n
            own[mine[-1]] += n
        else:
            named = [f for f in frames if not f.startswith("Thread.")]
            others[f"{thread.split(': ')[-1]}: {_short(named[-1]) if named else '-'}"] += n
    lines = [f"event-loop thread: {total} busy samples (py-spy, idle time left out)", "inclusive:"]
    lines += [f"  {100 * n / max(1, total):5.1f}%  {f}" for f, n in incl.most_common(top)]
    lines += ["own time (the function itself, not its callees):"]
    lines += [f"  {100 * n / max(1, total):5.1f}%  {f}" for f, n in own.most_common(top // 2)]
    lines += [f"other threads, busy samples by where they were (the loop thread had {total}):"]
    lines += [f"  {n:7d}  {t}" for t, n in others.most_common(15)]
    return "\n".join(lines) + "\n"


def operator_rows(db: str, token: str, *, seconds: int = 8, repeats: int = 3, before: str | None = None,
                  profile_dir: Path | None = None, log_dir: Path) -> list[dict]:
    """The ``/api/runs`` rows on the store at ``db`` (seeded by the caller), ``repeats`` loads of
    ``seconds`` per server, servers taking turns; ``before``: another checkout to run beside."""
    from fedswarm.bench.dashboard_load import _cores, stop_all

    server_cores, load_cores = _cores()
    pin = _pin(load_cores)
    own = os.sched_getaffinity(0) if load_cores else None
    pinning = (f"server on core {sorted(server_cores)} (taskset), load generator on {sorted(load_cores)}"
               if load_cores else "not pinned (fewer than 2 usable cores)")
    servers: dict[str, tuple[subprocess.Popen, str]] = {}
    rows: list[dict] = []
    trees = Path(tempfile.mkdtemp(prefix="fedswarm-bench-src-"))
    try:
        variants = {"now": None}
        if before:
            variants = {"before": source_tree(Path(before), trees / "before"), "now": None}
        for name, tree in variants.items():
            servers[name] = _start(db, server_cores, log_dir / f"dashboard-{name}.log", tree)
        if load_cores and not pin:  # no taskset: the loads this process starts inherit its affinity
            os.sched_setaffinity(0, load_cores)
        for _, url in servers.values():  # warm-up: caches, first queries
            _load_once(url + ENDPOINT, token, 2, pin)
        for i in range(repeats):
            for name in (list(servers) if i % 2 == 0 else list(reversed(servers))):  # neither always first
                proc, url = servers[name]
                res = _measure(proc.pid, url + ENDPOINT, token, seconds, pin)
                rows.append({"test": "operator", "endpoint": ENDPOINT, "store": "quiet", "server": name,
                             "repeat": i + 1, "concurrency": CLIENTS, "duration_s": seconds, "token": "viewer",
                             "command": "fedswarm dashboard (default options)", "pinning": pinning,
                             "source": before if name == "before" else "this checkout",
                             "loadavg_1m": round(os.getloadavg()[0], 2), **res})
        if profile_dir is not None:
            for name, (proc, url) in servers.items():
                path = profile_dir / f"dashboard-runs-profile-{name}.txt"
                path.write_text(_profile(proc.pid, url + ENDPOINT, token, seconds, pin, path.with_suffix(".raw")))
                print(f"profile of '{name}': {path}")
    finally:
        stop_all(servers.values(), own, trees)
    return rows


def summary(rows: list[dict]) -> list[dict]:
    """Per server: the median over repeats of p50, p99, requests/s and CPU per request."""
    import statistics

    out = []
    for name in dict.fromkeys(r["server"] for r in rows if r["test"] == "operator"):
        mine = [r for r in rows if r["test"] == "operator" and r["server"] == name]

        def med(k: str, mine: list[dict] = mine) -> float:
            xs = [r[k] for r in mine if k in r]
            return statistics.median(xs) if xs else float("nan")
        out.append({"server": name, "p50_ms": med("median_ms"), "p99_ms": med("p99_ms"), "rps": med("rps"),
                    "cpu_ms": med("server_cpu_ms_per_request"), "repeats": len(mine)})
    return out


def print_rows(rows: list[dict]) -> None:
    op = [r for r in rows if r["test"] == "operator"]
    if not op:
        return
    tool = "wrk -t1" if op[0]["tool"] == "wrk" else f"{op[0]['tool']} in its own process"
    print(f"/api/runs, {CLIENTS} connections ({tool}), viewer token, `fedswarm dashboard`: {op[0]['pinning']}")
    print(f"{'server':7} {'#':>2} {'p50 ms':>7} {'p99 ms':>7} {'req/s':>7} {'cpu ms/req':>10} {'loop wait s':>11} "
          f"{'errors':>6} {'load':>5}")
    for r in sorted(op, key=lambda r: (r["repeat"], r["server"])):
        print(f"{r['server']:7} {r['repeat']:2d} {r['median_ms']:7.2f} {r['p99_ms']:7.2f} {r['rps']:7.0f} "
              f"{r.get('server_cpu_ms_per_request', float('nan')):10.3f} "
              f"{r.get('loop_waiting_for_cpu_s', float('nan')):11.2f} {r['errors']:6d} {r['loadavg_1m']:5.1f}")
    for s in summary(rows):
        ok = s["p99_ms"] < P99_TARGET_MS and s["p50_ms"] < P50_TARGET_MS
        print(f"median of {s['repeats']}: {s['server']:7} p50 {s['p50_ms']:.2f} ms, p99 {s['p99_ms']:.2f} ms, "
              f"{s['rps']:.0f} req/s, {s['cpu_ms']:.3f} ms CPU/request; target p99 < {P99_TARGET_MS:g} ms and "
              f"p50 < {P50_TARGET_MS:g} ms {'met' if ok else 'NOT met'}")


def plot(ax: Any, rows: list[dict]) -> None:
    """p50 and p99 of each operator row beside the targets, on one matplotlib axis."""
    op = [r for r in rows if r["test"] == "operator"]
    xs = list(range(len(op)))
    ax.bar([x - 0.2 for x in xs], [r["median_ms"] for r in op], 0.4, label="p50", color="#94a3b8")
    ax.bar([x + 0.2 for x in xs], [r["p99_ms"] for r in op], 0.4, label="p99", color="#2563eb")
    ax.axhline(P99_TARGET_MS, color="r", ls="--", label=f"target p99 {P99_TARGET_MS:g} ms")
    ax.axhline(P50_TARGET_MS, color="k", ls=":", label=f"target p50 {P50_TARGET_MS:g} ms")
    ax.set_xticks(xs, [f"{r['server']} #{r['repeat']}" for r in op], fontsize=8)
    ax.set_ylabel("latency (ms)")
    ax.set_title(f"GET /api/runs, {CLIENTS} connections, `fedswarm dashboard` on its own core")
    ax.legend(fontsize=8)


def run(out_dir: Path, quick: bool = False, profile: bool = False) -> list[dict]:
    """Seed the store, measure, write ``dashboard-runs.json`` and ``.png`` (and the profiles)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fedswarm.bench.dashboard_load import seed_store

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="fedswarm-bench-"))
    try:
        db = str(tmp / "bench.db")
        seed_store(db)
        rows = operator_rows(db, viewer_token(db), seconds=5 if quick else 8, repeats=2 if quick else 3,
                             before=os.environ.get(BEFORE_ENV) or None, profile_dir=out_dir if profile else None,
                             log_dir=tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    (out_dir / "dashboard-runs.json").write_text(json.dumps(rows, indent=2))
    fig, ax = plt.subplots(figsize=(9, 5))
    plot(ax, rows)
    fig.tight_layout()
    fig.savefig(out_dir / "dashboard-runs.png", dpi=110)
    plt.close(fig)
    print_rows(rows)
    return rows

