"""fedswarm.procs' /proc readers, on real processes: the one place that parses /proc/PID/stat for
the liveness checks, the benchmarks' process-tree memory and Ray sessions, and the SuperNode
supervisor's cleanup."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from fedswarm.procs import pid_alive, processes, stat_fields
from tests.helpers import wait_until

# a child that holds 64 MB, and its child, a sleep whose command name has a space and a parenthesis
_CHILD = ("import subprocess, sys, time; x = bytearray(64 << 20); "
          "c = subprocess.Popen([sys.argv[1], '60']); print(c.pid, flush=True); time.sleep(60)")


def test_processes_read_state_and_parent_past_odd_command_names(tmp_path):
    from fedswarm.bench.cells import tree_rss
    from fedswarm.bench.ray_cluster import session_alive

    odd = tmp_path / "odd )name"
    odd.symlink_to(shutil.which("sleep"))
    p = subprocess.Popen([sys.executable, "-c", _CHILD, str(odd)], stdout=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        grandchild = int(p.stdout.readline())
        wait_until(lambda: Path(f"/proc/{grandchild}/comm").read_text().strip() == odd.name, 30, what="the odd name")
        table = dict(processes())
        assert table[p.pid][1] == str(os.getpid()) and table[grandchild][1] == str(p.pid)
        assert table[grandchild][0] in "SR"  # its state, past the ')' in its command name
        assert tree_rss(p.pid) >= 64 << 20  # the child's bytearray counts, its own child's memory with it
        assert session_alive(p.pid)
    finally:
        os.killpg(p.pid, 9)
        p.wait()
    wait_until(lambda: not session_alive(p.pid), 30, what="the session's end")
    assert stat_fields(p.pid) is None and not pid_alive(p.pid)
