"""``scripts/gpu-check --smoke``: every section of the GPU check at tiny sizes on the CPU, so
the script cannot rot between the sessions that have a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.integration, pytest.mark.slow]  # a SuperLink and two SuperNodes on loopback


def test_gpu_check_smoke_runs_every_section(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu-check"), "--smoke", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    secs = report["sections"]
    assert list(secs) == ["tests", "engine", "codecs", "deployment", "swarm"], secs
    assert all(s["ok"] for s in secs.values()), secs
    # the CUDA tests were collected and skipped here, none silently deselected
    assert secs["tests"].get("skipped", 0) >= 5 and not secs["tests"].get("passed"), secs["tests"]
    for r in secs["engine"]["rows"]:  # CPU against CPU: the very same model, figures present
        assert r["same_model"] and r["max_abs_diff"] == 0.0 and r["client_rounds_per_s"] > 0
        assert r["flops"] > 0 and r["bytes"] > 0 and r["examples"] > 0
    from fedswarm.algorithms.compression.codecs import CODECS

    assert {r["codec"] for r in secs["codecs"]["rows"]} == set(CODECS) | {"memcpy", "copy_"}
    assert all(r["ms"] > 0 and r["vs_copy_"] > 0 for r in secs["codecs"]["rows"])
    dep = secs["deployment"]
    assert dep["status"] == "finished" and dep["clients_per_round"] == [2, 2, 2] and dep["train_devices"] == [
        "cpu", "cpu"]
    from fedswarm.bench.swarm_exchange import EXCHANGE_PATHS

    assert [r["path"] for r in secs["swarm"]["rows"]] == list(EXCHANGE_PATHS)  # both Noise rows among them
    assert "pipelined x" in secs["swarm"]["summary"] and "handshake apart" in secs["swarm"]["summary"]
    table = (tmp_path / "gpu-check.md").read_text()
    assert "## batched engine" in table and "## codecs" in table and "## deployment on loopback" in table
    assert "## swarm exchange on loopback" in table
