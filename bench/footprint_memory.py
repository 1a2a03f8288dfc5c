"""The memory rows of ``fedswarm bench footprint`` (:mod:`fedswarm.bench.footprint`): one
SuperNode on loopback runs fedswarm's ClientApp, then a bare Flower App written here, and every
program of the node is sampled for its peak resident set (VmHWM)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

__all__ = ["memory_rows", "PROGRAMS", "TOTAL", "REPO", "HOST_BIN", "RSS_TARGET"]

REPO = Path(__file__).resolve().parents[1]
HOST_BIN = Path(sys.executable).parent
RSS_TARGET = 1.10


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
