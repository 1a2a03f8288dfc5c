"""A benchmark cell in a fresh interpreter, its process tree's resident memory sampled for the
peak (``fedswarm bench engines`` and its scale section)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from fedswarm.procs import processes

__all__ = ["sampled_cell", "tree_rss"]


def sampled_cell(args: list[str], timeout_s: float, env: dict | None = None, every_s: float = 0.2) -> dict:
    """Run ``python ARGS`` (``{out}`` in them: the path the cell writes its JSON figures to),
    sampling its process tree's RSS every ``every_s`` for the peak; return its figures with
    ``peak_rss_mb``, or a ``status`` saying why there are none. It runs in a folder of its own:
    from a checkout's root, ``python -c``/``-m`` would import that checkout's ``fedswarm`` first."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cell.json"
        proc = subprocess.Popen([sys.executable, *(a.replace("{out}", str(out)) for a in args)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                cwd=tmp)  # not the caller's folder: a checkout there would shadow PYTHONPATH
        peak = [0]
        done = threading.Event()

        def sample():  # a measurement, not a wait: every every_s until the cell exits
            while not done.is_set():
                peak[0] = max(peak[0], tree_rss(proc.pid))
                done.wait(every_s)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            log, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            log, _ = proc.communicate()
            done.set()
            return {"status": f"killed after {timeout_s:.0f} s", "peak_rss_mb": peak[0] / 2**20}
        finally:
            done.set()
            sampler.join()
        if proc.returncode != 0 or not out.exists():
            return {"status": f"failed: {log.strip().splitlines()[-1] if log.strip() else proc.returncode}",
                    "peak_rss_mb": peak[0] / 2**20}
        cell = json.loads(out.read_text())
        cell["peak_rss_mb"] = peak[0] / 2**20
        return cell


def tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and all its descendants (Ray's GCS, raylet and actors
    included), read from /proc."""
    children: dict[int, list[int]] = {}
    for p, fields in processes():
        children.setdefault(int(fields[1]), []).append(p)
    total, todo = 0, [pid]
    page = os.sysconf("SC_PAGE_SIZE")
    while todo:
        p = todo.pop()
        try:
            total += int(Path(f"/proc/{p}/statm").read_text().split()[1]) * page
        except (OSError, IndexError, ValueError):
            continue
        todo.extend(children.get(p, []))
    return total
