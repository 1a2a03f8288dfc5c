"""``fedswarm client --auth-key`` keeps starting a SuperNode that the SuperLink refuses to
activate (its key's previous session has not timed out yet), for up to ``--rejoin-wait``
seconds, and passes any other outcome through (client/supernode.py ``run_supernode``). A fake
``flower-supernode`` stands in for Flower's: refused the first K times, then it runs and exits
with the status given. The real thing, on a TLS + authentication SuperLink: test_secure_rejoin.py."""

from __future__ import annotations

import sys
import textwrap

import pytest

from fedswarm.client.supernode import run_supernode


def fake_supernode(tmp_path, refusals: int, final_rc: int = 0, final_line: str = "SuperNode running") -> list[str]:
    script = tmp_path / "fake_supernode.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        from pathlib import Path
        counter = Path({str(tmp_path / "starts")!r})
        n = int(counter.read_text()) if counter.exists() else 0
        counter.write_text(str(n + 1))
        if n < {refusals}:
            print("ERROR: Failed to initialize the connection to the SuperLink.")
            print("[code: 2004] Failed to activate SuperNode.")
            sys.exit(305)
        print({final_line!r})
        sys.exit({final_rc})
    """))
    return [sys.executable, str(script)]


def starts(tmp_path) -> int:
    return int((tmp_path / "starts").read_text())


def test_refused_node_is_started_again_until_it_is_accepted(tmp_path, capsys):
    rc = run_supernode(fake_supernode(tmp_path, refusals=2), rejoin_wait_s=60, retry_every_s=0.01)
    assert rc == 0 and starts(tmp_path) == 3
    out = capsys.readouterr().out
    assert out.count("starting again in") == 2 and "SuperNode running" in out


def test_refused_past_the_window_exits_with_flowers_status(tmp_path):
    rc = run_supernode(fake_supernode(tmp_path, refusals=10**6), rejoin_wait_s=1.0, retry_every_s=0.05)
    assert rc == 305 % 256  # Flower's status 305; an exit status keeps its low 8 bits
    assert 1 <= starts(tmp_path) < 1000  # it gave up once the window closed


@pytest.mark.parametrize("final_rc, line", [(305, "Failed to connect: TLS handshake"), (1, "boom"), (0, "bye")])
def test_any_other_exit_is_passed_through_at_once(tmp_path, final_rc, line):
    rc = run_supernode(fake_supernode(tmp_path, refusals=0, final_rc=final_rc, final_line=line), rejoin_wait_s=60,
                       retry_every_s=0.01)
    assert rc == final_rc % 256 and starts(tmp_path) == 1
