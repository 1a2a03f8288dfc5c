"""--engine flower --ray-address: a real Ray cluster on loopback (``ray start --head``),
a simulation attached to it from another process, then the cluster stopped."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.helpers import free_port, port_open, wait_until

RAY = shutil.which("ray", path=str(Path(sys.executable).parent)) or shutil.which("ray")


@pytest.fixture
def ray_cluster():
    """A one-node Ray cluster of our own: its own session (killed as a group at the end, so
    no other user's Ray processes are touched, as ``ray stop`` would) and temp dir."""
    if RAY is None:
        pytest.fail("the 'ray' command is missing: install fedswarm with the 'sim' extra")
    port = free_port()
    temp_dir = tempfile.mkdtemp(prefix="fsray", dir="/tmp")  # short: Ray's socket paths have a length limit
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    proc = subprocess.Popen(
        [RAY, "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(port),
         "--num-cpus", "2", "--include-dashboard", "false", "--disable-usage-stats", "--temp-dir", temp_dir],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    try:
        wait_until(lambda: port_open("127.0.0.1", port) or proc.poll() is not None, timeout=180,
                   what="Ray's GCS to listen")
        if proc.poll() is not None:
            pytest.fail(f"ray start --head exited: {proc.stdout.read()[-3000:]}")
        yield f"127.0.0.1:{port}", temp_dir
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=30)
                break
            except subprocess.TimeoutExpired:
                continue
        # every process of the cluster ran in our session; none may outlive the test
        wait_until(lambda: not _session_alive(proc.pid), timeout=60, what="the Ray cluster to stop")
        shutil.rmtree(temp_dir, ignore_errors=True)


def _session_alive(sid: int) -> bool:
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if os.getsid(int(pid)) == sid:
                stat = Path(f"/proc/{pid}/stat").read_text()
                if stat.rsplit(")", 1)[1].split()[0] != "Z":
                    return True
        except (ProcessLookupError, FileNotFoundError, PermissionError):
            continue
    return False


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
