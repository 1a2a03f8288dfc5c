"""--engine flower --ray-address: a real Ray cluster on loopback (``ray start --head``),
a simulation attached to it from another process, then the cluster stopped."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import free_port
from tests.ray_helpers import ray_cluster as _cluster


@pytest.fixture
def ray_cluster():
    """A one-node Ray cluster of our own (tests/ray_helpers.py), stopped at the end."""
    with _cluster() as cluster:
        yield cluster


@pytest.mark.integration
@pytest.mark.slow
def test_flower_engine_attaches_to_a_running_ray_cluster(ray_cluster, tmp_path):
    address, temp_dir = ray_cluster
    out = subprocess.run(
        [sys.executable, "-m", "fedswarm", "sim", "--engine", "flower", "--ray-address", address,
         "--clients", "4", "--rounds", "2", "--local-steps", "2", "--db", str(tmp_path / "s.db"),
         "--out", str(tmp_path), "--verbose"],
        capture_output=True, text=True, timeout=600)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert [r["round"] for r in result["rounds"]] == [0, 1, 2]
    assert result["rounds"][-1]["num_clients"] == 4
    assert result["summary"]["final_test_accuracy"] > result["rounds"][0]["test_accuracy"]
    # the actors ran inside the cluster we started (a private cluster would log under
    # /tmp/ray instead): its session holds their worker logs
    logs = list(Path(temp_dir).glob("session_*/logs/worker-*"))
    assert logs, f"no worker logs under {temp_dir}: the run did not use this cluster"


def test_unreachable_ray_address_fails_with_the_address(tmp_path):
    port = free_port()  # nothing listens there
    out = subprocess.run(
        [sys.executable, "-m", "fedswarm", "sim", "--engine", "flower", "--ray-address", f"127.0.0.1:{port}",
         "--clients", "2", "--rounds", "1", "--db", str(tmp_path / "s.db")],
        capture_output=True, text=True, timeout=600)
    assert out.returncode != 0
    assert f"no Ray cluster answers at 127.0.0.1:{port}" in " ".join((out.stdout + out.stderr).split())
