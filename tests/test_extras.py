"""The base install is what a device needs; server-side parts are extras, and a command whose
extra is missing says which in one line (pyproject.toml, fedswarm.extras)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from fedswarm.extras import EXTRAS, MissingExtra, missing, require

CLIENT_SIDE = ("fedswarm.client.app", "fedswarm.client.supernode", "fedswarm.swarm.peer")
SERVER_SIDE = ("fedswarm.store", "fedswarm.web", "sqlalchemy", "scipy", "dp_accounting", "fastapi", "sklearn")


def _run_blocked(blocked: tuple[str, ...], code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter where the ``blocked`` modules cannot be imported,
    as in an install without their extra."""
    prelude = "import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in blocked)
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120)


def test_client_app_imports_nothing_server_side():
    """A device's ClientApp (and the swarm peer) must not load the store, the dashboard,
    SciPy or scikit-learn: a fresh interpreter lists what they pulled in."""
    code = f"""
        import sys
        for m in {CLIENT_SIDE!r}:
            __import__(m)
        print(",".join(m for m in {SERVER_SIDE!r} if m in sys.modules))
    """
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"the client side imported {out.stdout.strip()}"


def test_missing_and_require_name_the_extra():
    assert missing("server") == [] and missing("dashboard") == []  # the test install has every extra
    assert missing("sim", ("no_such_module_here",)) == ["no_such_module_here"]
    with pytest.raises(MissingExtra, match=r"needs the \[sim\] extra \(no_such_module_here not installed\)"):
        require("sim", "a thing", modules=("no_such_module_here",))
    assert set(EXTRAS) >= {"server", "dashboard", "sim"}


def test_dashboard_without_its_extra_prints_one_line():
    out = _run_blocked(("limits",), """
        sys.argv = ["fedswarm", "dashboard", "--port", "1"]
        from fedswarm.cli import main
        main()
    """)
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert out.returncode == 1, out.stderr
    assert len(lines) == 1, out.stderr
    assert "fedswarm dashboard needs the [dashboard] extra (limits not installed)" in lines[0]
    assert "pip install 'fedswarm[dashboard]'" in lines[0]


def test_dp_without_the_server_extra_is_one_line_exit_2():
    out = _run_blocked(("dp_accounting",), """
        sys.argv = ["fedswarm", "sim", "--dp", "noise_multiplier=1.0", "--rounds", "1", "--clients", "2"]
        from fedswarm.cli import main
        main()
    """)
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert out.returncode == 2, out.stderr
    assert len(lines) == 1 and "needs the [server] extra (dp_accounting not installed)" in lines[0], out.stderr


def test_client_help_works_without_server_extras():
    out = _run_blocked(("dp_accounting", "limits", "swagger_ui", "sklearn", "scipy"), """
        sys.argv = ["fedswarm", "client", "--help"]
        from fedswarm.cli import main
        main()
    """)
    assert out.returncode == 0, out.stderr
    assert "--superlink" in out.stdout
