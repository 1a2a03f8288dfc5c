"""What fedswarm costs a device: install size, import time and memory, beside Flower alone.

    fedswarm bench footprint [--quick] --out DIR

1. **Install** (one fresh venv in a temp folder, grown step by step, every step pinned by
   ``requirements/lock.txt``): torch + flwr alone; then fedswarm's base install
   (``pip install .``: what a device gets); then the extras the base used to carry before the
   install was split by role (``.[server,dashboard]``: the run store's and the dashboard's
   dependencies and privacy accounting, i.e. the old ``pip install .``). Each row: the MB of
   site-packages, the MB beyond torch + flwr (target for the base: at most 20), the packages
   installed. The base install's ``import fedswarm.client.app`` time (best of 5 fresh
   interpreters) sits beside Flower's own ``import flwr.clientapp``.
2. **Memory of a SuperNode** (skipped by ``--quick``): a real ``flower-superlink`` on
   127.0.0.1, and one SuperNode from the grown venv (the base install plus the server and
   dashboard extras, none of which ``import fedswarm.client.app`` loads) training ``digits-cnn4`` on its own data
   (``fedswarm client --data``, 2 rounds); then the same SuperNode setup running a bare Flower
   App (a ClientApp of ~40 lines that trains the same model, traced to TorchScript so it
   imports nothing of fedswarm, on the same examples with the same batch size and steps).
   The bare ServerApp sends no evaluate messages; fedswarm's does (one lighter ClientApp
   process per round). Every process of the node's process group is sampled every 20 ms for
   its peak resident set (``VmHWM``), grouped by program: ``flower-supernode`` (the SuperNode),
   ``flower-superexec`` (its SuperExec, which starts the ClientApps), ``flwr-clientapp`` (the
   largest of the ClientApp processes, one per message), ``fedswarm client (wrapper)`` (the
   CLI that checks the node's data and device, then starts fedswarm's SuperNode: its peak is that
   of the checks), ``fedswarm client (supervisor)`` (what the CLI execs into when it watches a
   SuperNode that rejoins: standard library only), and the node's total (largest sum of VmRSS at one
   sample). Target: fedswarm's ClientApp within 10% of the bare one.

Writes ``DIR/footprint.json`` (rows) and ``DIR/footprint.png``; prints the table. The grown venv
and its install rows are cached under ``~/.cache/fedswarm/footprint``, keyed by the pins, the
interpreter and fedswarm's code: a rerun of the same tree measures memory only.
``FEDSWARM_FOOTPRINT_KEEP=1`` keeps the work folder (data, apps, each process's log); a process
that exits, a failed run or a timeout is an error that prints the tail of every log.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

__all__ = ["run"]

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "requirements" / "lock.txt"
HOST_BIN = Path(sys.executable).parent
BASE_TARGET_MB = 20.0
RSS_TARGET = 1.10


# -- install ---------------------------------------------------------------------------------
def _site_packages(venv: Path) -> Path:
    return next((venv / "lib").glob("python3*/site-packages"))


def _du_mb(path: Path) -> float:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total / 1e6


def _packages(venv: Path) -> int:
    return len(list(_site_packages(venv).glob("*.dist-info")))


def _pip(venv: Path, *args: str) -> None:
    done = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--disable-pip-version-check", *args],
                          capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"pip install {' '.join(args)} failed:\n{done.stderr[-2000:]}")


def _torch_pin() -> str:
    for line in (REPO / "requirements" / "torch.txt").read_text().splitlines():
        if line.strip().startswith("torch"):
            return line.strip()
    return "torch"


def _import_s(venv: Path, module: str, reps: int = 5) -> float:
    code = f"import time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"
    best = float("inf")
    for _ in range(reps):
        # cwd: the venv, not the checkout (its fedswarm/ folder would shadow the installed package)
        out = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True, timeout=300,
                             cwd=venv)
        if out.returncode != 0:
            raise RuntimeError(f"import {module} failed in {venv}:\n{out.stderr[-2000:]}")
        best = min(best, float(out.stdout.strip().splitlines()[-1]))
    return best


def install_rows(venv: Path) -> list[dict]:
    """Grow one venv: torch + flwr, + fedswarm base, + the extras of the old base install."""
    print(f"footprint: a fresh venv in {venv}, grown step by step (pip, a few minutes)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    _pip(venv, "--upgrade", "pip")
    rows: list[dict] = []

    def measure(label: str, what: str, baseline: float | None) -> float:
        mb = _du_mb(_site_packages(venv))
        print(f"  {label}: {mb:.1f} MB of site-packages", flush=True)
        rows.append({"benchmark": "install", "install": label, "what": what, "site_packages_mb": round(mb, 1),
                     "beyond_torch_flwr_mb": None if baseline is None else round(mb - baseline, 1),
                     "packages": _packages(venv)})
        return mb

    _pip(venv, _torch_pin())
    _pip(venv, "-c", str(LOCK), "flwr")
    base = measure("torch + flwr", "pip install torch; pip install -c lock flwr", None)
    rows[-1]["import_s"] = round(_import_s(venv, "flwr.clientapp"), 3)
    rows[-1]["import_module"] = "flwr.clientapp"
    _pip(venv, "-c", str(LOCK), str(REPO))
    measure("fedswarm base (after the split)", "pip install -c lock .", base)
    rows[-1]["import_s"] = round(_import_s(venv, "fedswarm.client.app"), 3)
    rows[-1]["import_module"] = "fedswarm.client.app"
    rows[-1]["target_mb"] = BASE_TARGET_MB
    rows[-1]["meets_target"] = rows[-1]["beyond_torch_flwr_mb"] <= BASE_TARGET_MB
    _pip(venv, "-c", str(LOCK), f"{REPO}[server,dashboard]")
    measure("fedswarm before the split (base + server + dashboard)", "pip install -c lock '.[server,dashboard]'",
            base)
    return rows


# -- memory of a SuperNode ---------------------------------------------------------------------
BARE_CLIENT = '''"""A bare Flower App: train a TorchScript model on this node's own .npz, nothing else."""
import numpy as np
import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    model = torch.jit.load(str(context.node_config["model-path"]))
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    data = np.load(str(context.node_config["data-path"]))
    x, y = torch.from_numpy(data["x"]).float(), torch.from_numpy(data["y"]).long()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    order, pos = torch.randperm(len(y), generator=g), 0
    steps = int(context.node_config["steps"])
    model.train()
    for _ in range(steps):
        if pos >= len(y):
            order, pos = torch.randperm(len(y), generator=g), 0
        idx = order[pos:pos + 16]
        pos += 16
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()),
                          "metrics": MetricRecord({"num-examples": int(len(y))})})
    return Message(content, reply_to=msg)


server = ServerApp()


@server.main()
def main(grid: Grid, context: Context) -> None:
    model = torch.jit.load(str(context.run_config["model-path"]))
    # One node: FedAvg's defaults wait for two nodes, so the run would never start its first round.
    strategy = FedAvg(fraction_evaluate=0.0, min_train_nodes=1, min_evaluate_nodes=1, min_available_nodes=1)
    strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()),
                   num_rounds=int(context.run_config["rounds"]))
'''

BARE_PYPROJECT = '''[project]
name = "bareapp"
version = "0.1.0"
dependencies = []

[tool.flwr.app]
publisher = "bench"

[tool.flwr.app.components]
serverapp = "bareapp:server"
clientapp = "bareapp:app"

[tool.flwr.app.config]
rounds = 2
model-path = ""
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PROGRAMS = ("flower-supernode", "flower-superexec", "flwr-clientapp", "fedswarm client (wrapper)",
            "fedswarm client (supervisor)")
TOTAL = "node total (sum of VmRSS)"


class PeakSampler:
    """Peak VmHWM of the node's programs (``PROGRAMS``) in a process group, sampled every 20 ms.

    A program's peak is the largest VmHWM of any one of its processes (one ClientApp process
    per message). ``TOTAL`` is the largest sum of VmRSS over every process of the group at
    one sample, helpers (``file`` and the like) included: what the node held at once.
    """

    def __init__(self, pgid: int):
        self.pgid, self.peaks, self._stop = pgid, {}, threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            total = 0.0
            for pid in os.listdir("/proc"):
                if not pid.isdigit():
                    continue
                try:
                    if os.getpgid(int(pid)) != self.pgid:
                        continue
                    status = Path(f"/proc/{pid}/status").read_text()
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                except (OSError, ProcessLookupError):
                    continue
                hwm, rss = re.search(r"VmHWM:\s+(\d+) kB", status), re.search(r"VmRSS:\s+(\d+) kB", status)
                total += int(rss.group(1)) / 1024 if rss else 0.0
                name = _program(cmd)
                if hwm and name in PROGRAMS:
                    self.peaks[name] = max(self.peaks.get(name, 0.0), int(hwm.group(1)) / 1024)
            self.peaks[TOTAL] = max(self.peaks.get(TOTAL, 0.0), total)
            self._stop.wait(0.02)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=5)


def _program(cmd: list[bytes]) -> str:
    """flower-supernode, flower-superexec, flwr-clientapp, fedswarm client (wrapper: its checks, before it
    execs), fedswarm client (supervisor: what the wrapper becomes, python -m fedswarm.client.rejoin), or
    another program's name."""
    words = [Path(c.decode(errors="replace")).name for c in cmd if c]
    for w in words[:3]:
        if w.startswith(("flower-", "flwr-")):
            return w
    if "fedswarm.client.rejoin" in words[:3]:
        return "fedswarm client (supervisor)"
    if "fedswarm" in words[:3]:
        return "fedswarm client (wrapper)"
    return words[0] if words else "?"


def _make_data(work: Path) -> tuple[Path, int]:
    import numpy as np

    from fedswarm.tasks.builtin import digits_arrays

    x, y = digits_arrays()
    keep = np.random.default_rng(0).random(len(y)) < 0.5
    path = work / "node.npz"
    np.savez(path, x=(x[keep] / 16.0).astype(np.float32).reshape(-1, 1, 8, 8), y=y[keep].astype(np.int64))
    return path, int(keep.sum())


def memory_rows(venv: Path, work: Path, rounds: int = 2) -> list[dict]:
    """One SuperNode from the grown venv: fedswarm's App, then the bare Flower App."""
    import torch

    from fedswarm.tasks import get_task

    data, n = _make_data(work)
    task = get_task("digits-cnn4")
    model = task.model(0)
    traced = torch.jit.trace(model, torch.zeros(2, 1, 8, 8))
    traced.save(str(work / "model.pt"))
    bare = work / "bare"
    bare.mkdir()
    (bare / "bareapp.py").write_text(BARE_CLIENT)
    (bare / "pyproject.toml").write_text(BARE_PYPROJECT)
    # The same local work on both: fedswarm's default is local_epochs=2, batch 16 on the
    # node's training split; the bare app is told the same number of steps.
    train_n = n - max(1, round(0.2 * n))
    steps = 2 * -(-train_n // 16)
    rows = []
    for i, label in enumerate(("fedswarm ClientApp", "bare Flower ClientApp")):
        rows.append(_one_node(label, venv, work / f"node-{i}", data, steps, bare, work / "model.pt", rounds))
    fed, plain = rows[0]["peaks_mb"].get("flwr-clientapp"), rows[1]["peaks_mb"].get("flwr-clientapp")
    if fed and plain:
        rows[0]["clientapp_vs_bare"] = round(fed / plain, 3)
        rows[0]["target_ratio"] = RSS_TARGET
        rows[0]["meets_target"] = fed / plain <= RSS_TARGET
    return rows


def _one_node(label: str, venv: Path, work: Path, data: Path, steps: int, bare: Path, model_path: Path,
              rounds: int, run_timeout: float = 900) -> dict:
    work.mkdir(parents=True)
    port = _free_port()
    (work / "flwr").mkdir()
    (work / "flwr" / "config.toml").write_text(
        f'[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = "127.0.0.1:{port}"\ninsecure = true\n')
    env = dict(os.environ, FLWR_HOME=str(work / "flwr"), PYTHONUNBUFFERED="1",
               PATH=f"{HOST_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    node_env = dict(env, PATH=f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
    procs: dict[str, subprocess.Popen] = {}
    logs = {name: work / f"{name}.log" for name in ("superlink", "supernode", "flwr", "serverapp")}

    def spawn(name: str, cmd: list[str], e: dict) -> subprocess.Popen:
        with open(logs[name], "w") as log:
            procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=e, start_new_session=True)
        return procs[name]

    def explain() -> str:
        _save_run_logs(env, logs["serverapp"])
        return _tails(logs)

    def wait(pred, timeout: float, what: str) -> None:
        _wait(pred, timeout, what, procs, explain)

    try:
        spawn("superlink", [str(HOST_BIN / "flower-superlink"), "--insecure", "--host", "127.0.0.1", "--port",
                            str(port), "--database", str(work / "state.db"),
                            "--disable-runtime-dependency-installation"], env)
        wait(lambda: _listening(port), 120, "the SuperLink")
        if label.startswith("fedswarm"):
            node = spawn("supernode", [str(venv / "bin" / "fedswarm"), "client", "--superlink", f"127.0.0.1:{port}",
                                       "--insecure", "--data", str(data), "--partition-id", "0",
                                       "--num-partitions", "1", "--clientappio-port", str(_free_port()),
                                       "--state-dir", str(work / "state")], node_env)
            app, config = REPO, f"rounds={rounds} clients=1 task='digits-cnn4' db='{work / 'store.db'}'"
        else:
            node = spawn("supernode", [str(venv / "bin" / "flower-supernode"), "--superlink", f"127.0.0.1:{port}",
                                       "--insecure", "--port", str(_free_port()), "--node-config",
                                       f'data-path="{data}" model-path="{model_path}" steps={steps}'], node_env)
            app, config = bare, f"rounds={rounds} model-path='{model_path}'"
        t = time.monotonic()
        with PeakSampler(node.pid) as sampler:
            started = subprocess.run([str(HOST_BIN / "flwr"), "run", str(app), "local", "--run-config", config],
                                     capture_output=True, text=True, env=env, timeout=600)
            logs["flwr"].write_text(started.stdout + started.stderr)
            if started.returncode != 0:
                raise RuntimeError(f"flwr run failed:\n{explain()}")
            wait(lambda: _run_finished(env), run_timeout, "the run to finish")
        _save_run_logs(env, logs["serverapp"])
        return {"benchmark": "memory", "app": label, "rounds": rounds, "wall_s": round(time.monotonic() - t, 1),
                "peaks_mb": {k: round(v, 1) for k, v in sorted(sampler.peaks.items())}}
    finally:
        for p in procs.values():
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for p in procs.values():
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def _run_finished(env: dict) -> bool:
    """True once the SuperLink lists the (only) run as completed; a failed or stopped run is an error."""
    out = subprocess.run([str(HOST_BIN / "flwr"), "ls", "local", "--format", "json"], capture_output=True, text=True,
                         env=env, timeout=120)
    try:
        runs = json.loads(out.stdout).get("runs", [])
    except (json.JSONDecodeError, AttributeError):
        return False
    status = [str(r.get("status", "")) for r in runs]
    ended = [st for st in status if st.startswith("finished") and st != "finished:completed"]
    if ended:
        raise RuntimeError(f"the run ended {ended[0]}")
    return bool(status) and all(st == "finished:completed" for st in status)


def _save_run_logs(env: dict, path: Path) -> None:
    """The ServerApp's log of every run on the SuperLink (``flwr log --show``): not in the SuperLink's own."""
    flwr = str(HOST_BIN / "flwr")
    try:
        listed = subprocess.run([flwr, "ls", "local", "--format", "json"], capture_output=True, text=True, env=env,
                                timeout=120)
        ids = [str(r["run-id"]) for r in json.loads(listed.stdout).get("runs", [])]
        text = "".join(subprocess.run([flwr, "log", i, "local", "--show"], capture_output=True, text=True, env=env,
                                      timeout=120).stdout for i in ids)
    except (OSError, subprocess.SubprocessError, json.JSONDecodeError, AttributeError, KeyError) as exc:
        text = f"(flwr log failed: {exc})"
    path.write_text(text)


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


POLL_LINES = ("ListRuns", "list-runs")  # the SuperLink logging this bench's own `flwr ls` polls


def _tails(logs: dict[str, Path], lines: int = 25) -> str:
    """The last lines of each log (less the bench's own polls), named, so that a failure explains itself."""
    parts = []
    for name, path in logs.items():
        text = [line for line in (path.read_text(errors="replace").splitlines() if path.is_file() else ["(no log)"])
                if not any(poll in line for poll in POLL_LINES)][-lines:]
        parts.append(f"--- {name} ({path}), last {len(text)} lines:\n" + "\n".join(text))
    return "\n".join(parts)


def _wait(pred, timeout: float, what: str, procs: dict[str, subprocess.Popen], explain) -> None:
    """Poll ``pred`` until true; a process that exits, or the deadline, is an error with ``explain()`` (the logs)."""
    end = time.monotonic() + timeout
    pause = threading.Event()
    while time.monotonic() < end:
        try:
            if pred():
                return
        except RuntimeError as exc:
            raise RuntimeError(f"{exc} (waiting for {what})\n{explain()}") from None
        for name, p in procs.items():
            if p.poll() is not None:
                raise RuntimeError(f"the {name} exited with code {p.returncode} while waiting for {what}\n"
                                   f"{explain()}")
        pause.wait(1.0)
    raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}\n{explain()}")


# -- report ------------------------------------------------------------------------------------
CACHE = Path.home() / ".cache" / "fedswarm" / "footprint"
PACKAGE_DIRS = ("fedswarm", "algorithms", "strategies", "server", "client", "sim", "swarm", "bench", "web")


def _cache_key() -> str | None:
    """What the grown venv is made of: the pins, the interpreter, and fedswarm's code as installed.

    The bench's own results (``bench/*.json``, ``*.png``) are package data but not code: left out,
    so writing this bench's output does not invalidate its cache. None outside a git checkout.
    """
    try:
        files = subprocess.run(["git", "-C", str(REPO), "ls-files", "pyproject.toml", *PACKAGE_DIRS],
                               capture_output=True, text=True, check=True, timeout=60).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    h = hashlib.sha256(sys.version.encode())
    for rel in ["requirements/lock.txt", "requirements/torch.txt", *sorted(files)]:
        if rel.startswith("bench/") and not rel.endswith(".py"):
            continue
        path = REPO / rel
        h.update(rel.encode() + b"\0" + (path.read_bytes() if path.is_file() else b"") + b"\0")
    return h.hexdigest()[:16]


def _grown_venv(work: Path) -> tuple[Path, list[dict]]:
    """The grown venv and its install rows: from the cache when the same inputs built one before.

    A cached venv was measured when it was built from exactly these inputs (pins, interpreter,
    fedswarm's code), so its rows stand; they say ``cached`` and when. The venv is grown in place
    under the cache (venvs do not move), its rows written last, so a half-built one is rebuilt;
    building one removes the others.
    """
    key = _cache_key()
    if key is None:
        return work / "venv", install_rows(work / "venv")
    entry = CACHE / key
    rows_file = entry / "install.json"
    if rows_file.is_file():
        cached = json.loads(rows_file.read_text())
        print(f"footprint: the venv grown from these pins and this code is cached: {entry}", flush=True)
        return entry / "venv", [dict(r, cached=cached["built"]) for r in cached["rows"]]
    for old in CACHE.glob("*"):  # one venv is over a GB: keep only the one for this tree
        shutil.rmtree(old, ignore_errors=True)
    entry.mkdir(parents=True)
    rows = install_rows(entry / "venv")
    rows_file.write_text(json.dumps({"built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": rows}))
    return entry / "venv", rows


def run(out_dir: Path, quick: bool = False) -> list[dict]:
    """``FEDSWARM_FOOTPRINT_KEEP=1`` keeps the work folder (data, apps, every process's log)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="fedswarm-footprint-"))
    keep = os.environ.get("FEDSWARM_FOOTPRINT_KEEP", "") not in ("", "0")
    try:
        venv, rows = _grown_venv(work)
        if not quick:
            rows += memory_rows(venv, work)
    finally:
        if keep:
            print(f"footprint: work folder kept: {work}", flush=True)
        else:
            shutil.rmtree(work, ignore_errors=True)
    (out_dir / "footprint.json").write_text(json.dumps(rows, indent=2))
    _table(rows)
    _plot(rows, out_dir / "footprint.png")
    return rows


def _table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    inst = [r for r in rows if r["benchmark"] == "install"]
    cached = f", cached venv built {inst[0]['cached']}" if inst and "cached" in inst[0] else ""
    t = Table(title=f"fedswarm on a device: install (this machine{cached})")
    for col in ("install", "site-packages MB", "beyond torch+flwr MB", "packages", "import s"):
        t.add_column(col, justify="left" if col == "install" else "right")
    for r in inst:
        beyond = "-" if r["beyond_torch_flwr_mb"] is None else f"{r['beyond_torch_flwr_mb']:.1f}"
        if "meets_target" in r:
            beyond += f" (target <= {r['target_mb']:.0f}: {'met' if r['meets_target'] else 'MISSED'})"
        imp = f"{r['import_s']:.2f} ({r['import_module']})" if "import_s" in r else "-"
        t.add_row(r["install"], f"{r['site_packages_mb']:.1f}", beyond, str(r["packages"]), imp)
    console.print(t)
    mem = [r for r in rows if r["benchmark"] == "memory"]
    if not mem:
        return
    t = Table(title="one SuperNode: peak MB (VmHWM of flower-supernode, flower-superexec, the largest "
                    "flwr-clientapp, the fedswarm client CLI; node total: largest summed VmRSS)")
    t.add_column("app")
    for name in ("SuperNode", "SuperExec", "ClientApp", "fedswarm CLI", "node total"):
        t.add_column(name, justify="right")
    t.add_column("ClientApp vs bare", justify="right")
    for r in mem:
        ratio = "-"
        if "clientapp_vs_bare" in r:
            ratio = (f"{r['clientapp_vs_bare']:.2f}x (target <= {r['target_ratio']:.2f}: "
                     f"{'met' if r['meets_target'] else 'MISSED'})")
        t.add_row(r["app"], *(f"{r['peaks_mb'][k]:.1f}" if k in r["peaks_mb"] else "-" for k in (*PROGRAMS, TOTAL)),
                  ratio)
    console.print(t)


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    inst = [r for r in rows if r["benchmark"] == "install"]
    mem = [r for r in rows if r["benchmark"] == "memory"]
    fig, axes = plt.subplots(1, 2 if mem else 1, figsize=(14 if mem else 6, 5), squeeze=False)
    ax = axes[0][0]
    ax.barh([r["install"] for r in inst], [r["site_packages_mb"] for r in inst], color="tab:blue")
    ax.set_xlabel("site-packages MB")
    ax.set_title("install size")
    if mem:
        ax = axes[0][1]
        names = sorted({k for r in mem for k in r["peaks_mb"]})
        width = 0.8 / len(mem)
        for i, r in enumerate(mem):
            ax.bar([j + i * width for j in range(len(names))], [r["peaks_mb"].get(k, 0) for k in names], width,
                   label=r["app"])
        ax.set_xticks([j + width * (len(mem) - 1) / 2 for j in range(len(names))], names, rotation=30, ha="right")
        ax.set_ylabel("peak MB")
        ax.set_title("one SuperNode (digits-cnn4): VmHWM per program")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
