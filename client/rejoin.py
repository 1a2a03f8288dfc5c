"""The supervisor of a SuperNode that rejoins: ``fedswarm client --rejoin-wait S`` runs
``flower-supernode`` under :func:`run_supernode`, which starts it again while the SuperLink
refuses to activate it.

Standard library only, and run in a process of its own (``python -m fedswarm.client.rejoin S
-- CMD...``, which ``fedswarm client`` execs into after its checks): the supervisor lives as
long as the node, so it must not keep the torch, Flower and data that the checks loaded (about
300 MB on a device where the SuperNode and its ClientApp need the memory).
"""

from __future__ import annotations

import os
import sys

from fedswarm.procs import processes

__all__ = ["run_supernode", "exec_supervisor"]

# Flower's SuperLink keeps a node "online" for HEARTBEAT_PATIENCE (2) x the SuperNode's
# heartbeat interval (30 s) after its last heartbeat. With node authentication the node id is
# bound to the key, so a node that died without signing off (killed, power lost) and comes back
# sooner is refused activation until then: flower-supernode logs "Exit Code: 305 ... Failed to
# activate SuperNode" and exits with status 1 (flwr_exit maps every error to 1).
# `fedswarm client --rejoin-wait` (default 75 s) waits that out.
_ACTIVATION_REFUSED = "Failed to activate SuperNode"


def run_supernode(cmd: list[str], *, rejoin_wait_s: float, retry_every_s: float = 5.0) -> int:
    """Run the ``flower-supernode`` command ``cmd`` and return its exit status, passing its
    output through. If it is refused activation (its key's previous session has not timed out
    on the SuperLink yet), start it again every ``retry_every_s`` seconds for up to
    ``rejoin_wait_s`` seconds, saying so in one line each time: a restarted device rejoins
    instead of exiting. A key the SuperLink does not know is refused the same way, so it exits
    only after ``rejoin_wait_s``. SIGTERM and SIGINT are passed on to the SuperNode.

    A refused SuperNode has already started its SuperExec, which outlives it and keeps
    retrying; this process makes itself the subreaper of its descendants (Linux) so that such
    leftovers become its children and are stopped before the next start."""
    import signal
    import subprocess
    import threading
    import time

    _become_subreaper()
    stop = threading.Event()
    child: list[subprocess.Popen] = []

    def forward(signum, _frame):
        stop.set()
        if child and child[0].poll() is None:
            child[0].send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    deadline = time.monotonic() + rejoin_wait_s
    while True:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        child[:] = [proc]
        refused = threading.Event()

        def relay(out=proc.stdout, refused=refused):
            for line in out:  # ends when every writer (the SuperNode and what it started) is gone
                sys.stdout.write(line)
                sys.stdout.flush()
                if _ACTIVATION_REFUSED in line:
                    refused.set()

        reader = threading.Thread(target=relay, daemon=True)
        reader.start()
        rc = proc.wait()
        _stop_descendants()
        reader.join(timeout=10)
        left = deadline - time.monotonic()
        if stop.is_set() or rc == 0 or not refused.is_set() or left <= 0:
            return rc
        print(f"fedswarm client: the SuperLink refused to activate this node: its previous session may not have "
              f"timed out yet (it ended without signing off); starting again in {retry_every_s:.0f} s "
              f"(for up to {left:.0f} s more)", flush=True)
        if stop.wait(min(retry_every_s, left)):
            return rc


def _become_subreaper() -> None:
    """Orphaned descendants become this process's children (Linux prctl PR_SET_CHILD_SUBREAPER)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _stop_descendants(grace_s: float = 5.0) -> None:
    """SIGTERM, then SIGKILL, every process whose parent is this one, and reap them."""
    import signal
    import time

    def children() -> list[int]:
        me = os.getpid()
        return [pid for pid, fields in processes() if len(fields) > 1 and int(fields[1]) == me and fields[0] != "Z"]

    for sig in (signal.SIGTERM, signal.SIGKILL):
        kids = children()
        if not kids:
            break
        for pid in kids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        end = time.monotonic() + grace_s
        while time.monotonic() < end and children():
            _reap()
            time.sleep(0.05)
    _reap()


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def exec_supervisor(cmd: list[str], rejoin_wait_s: float) -> None:
    """Replace this process by a lean one that runs :func:`run_supernode` on ``cmd``."""
    os.execv(sys.executable, [sys.executable, "-m", "fedswarm.client.rejoin", repr(float(rejoin_wait_s)), "--",
                              *cmd])


def main(argv: list[str]) -> int:
    """``python -m fedswarm.client.rejoin SECONDS -- CMD...``"""
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m fedswarm.client.rejoin SECONDS -- FLOWER_SUPERNODE_COMMAND...", file=sys.stderr)
        return 2
    return run_supernode(argv[2:], rejoin_wait_s=float(argv[0]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
