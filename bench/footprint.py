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
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fedswarm.bench.footprint_memory import PROGRAMS, REPO, TOTAL, memory_rows

__all__ = ["run"]

CACHE = Path.home() / ".cache" / "fedswarm" / "footprint"
PACKAGE_DIRS = ("fedswarm", "algorithms", "strategies", "server", "client", "sim", "swarm", "bench", "web")

LOCK = REPO / "requirements" / "lock.txt"
BASE_TARGET_MB = 20.0


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
