"""``fedswarm client --auth-key`` keeps starting a SuperNode that the SuperLink refuses to
activate (its key's previous session has not timed out yet), for up to ``--rejoin-wait``
seconds, and passes any other outcome through (client/rejoin.py ``run_supernode``). A fake
``flower-supernode`` stands in for Flower's: refused the first K times, then it runs and exits
with the status given; like Flower's, a refused one leaves a child behind (its SuperExec) that
holds the output pipe. ``run_supernode`` runs in its own interpreter here, since it adopts and
stops its descendants. The real thing, on a TLS + authentication SuperLink:
test_secure_rejoin.py."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.deployment_helpers import alive
from tests.helpers import wait_until


def fake_supernode(tmp_path, refusals: int, final_rc: int = 0, final_line: str = "SuperNode running") -> list[str]:
    script = tmp_path / "fake_supernode.py"
    script.write_text(textwrap.dedent(f"""
        import subprocess, sys
        from pathlib import Path
        counter = Path({str(tmp_path / "starts")!r})
        n = int(counter.read_text()) if counter.exists() else 0
        counter.write_text(str(n + 1))
        if n < {refusals}:
            # Flower's SuperExec: started before the refusal, outlives the SuperNode, keeps stdout
            kid = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])
            Path({str(tmp_path)!r}, f"leftover-{{n}}").write_text(str(kid.pid))
            print("ERROR: Exit Code: 305")  # what flower-supernode logs; it exits with 1
            print("Failed to initialize the connection to the SuperLink.")
            print("[code: 2004] Failed to activate SuperNode.")
            sys.exit(1)
        print({final_line!r})
        sys.exit({final_rc})
    """))
    return [sys.executable, str(script)]


def run(tmp_path, cmd: list[str], wait_s: float, every_s: float) -> subprocess.CompletedProcess:
    code = (f"import sys; from fedswarm.client.rejoin import run_supernode; "
            f"sys.exit(run_supernode({cmd!r}, rejoin_wait_s={wait_s}, retry_every_s={every_s}))")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def starts(tmp_path) -> int:
    return int((tmp_path / "starts").read_text())


def test_refused_node_is_started_again_until_it_is_accepted_and_leftovers_stopped(tmp_path):
    out = run(tmp_path, fake_supernode(tmp_path, refusals=2), wait_s=60, every_s=0.01)
    assert out.returncode == 0, out.stdout + out.stderr
    assert starts(tmp_path) == 3
    assert out.stdout.count("starting again in") == 2 and "SuperNode running" in out.stdout
    for leftover in tmp_path.glob("leftover-*"):  # each refused start's SuperExec was stopped
        pid = int(leftover.read_text())
        wait_until(lambda pid=pid: not alive(pid), 30, what=f"leftover {pid} stopped")


def test_refused_past_the_window_exits_with_flowers_status(tmp_path):
    out = run(tmp_path, fake_supernode(tmp_path, refusals=10**6), wait_s=1.0, every_s=0.05)
    assert out.returncode == 1, out.stdout + out.stderr  # flower-supernode's own status
    assert 1 <= starts(tmp_path) < 1000  # it gave up once the window closed


@pytest.mark.parametrize("final_rc, line", [(1, "Failed to connect: TLS handshake"), (3, "boom"), (0, "bye")])
def test_any_other_exit_is_passed_through_at_once(tmp_path, final_rc, line):
    out = run(tmp_path, fake_supernode(tmp_path, refusals=0, final_rc=final_rc, final_line=line), wait_s=60,
              every_s=0.01)
    assert out.returncode == final_rc and starts(tmp_path) == 1 and line in out.stdout



def test_the_supervisor_is_a_lean_process_without_the_checks_torch(tmp_path):
    """``fedswarm client`` loads torch (and the node's data) for its checks, then execs into the
    supervisor (``python -m fedswarm.client.rejoin``), which lives as long as the node: the
    SuperNode's parent must not map torch's library."""
    script = tmp_path / "fake_supernode.py"
    script.write_text(textwrap.dedent(f"""
        import os
        from pathlib import Path
        maps = Path(f"/proc/{{os.getppid()}}/maps").read_text()
        Path({str(tmp_path / "parent")!r}).write_text("torch" if "libtorch" in maps else "lean")
    """))
    cmd = [sys.executable, str(script)]
    code = ("import sys, torch; from fedswarm.client.rejoin import exec_supervisor; "
            f"assert 'libtorch' in open('/proc/self/maps').read(); exec_supervisor({cmd!r}, 5)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "parent").read_text() == "lean"
