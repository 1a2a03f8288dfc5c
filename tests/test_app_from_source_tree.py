"""A Flower App run on a SuperNode or SuperLink (`flwr run .`) is unpacked as this project's
source tree and put first on sys.path, so its `fedswarm/` folder shadows the installed package.
In the source tree the subpackages live beside that folder (pyproject.toml's package-dir):
`fedswarm.client`, `fedswarm.server` must still import from it. A non-editable install (what a
device gets, `pip install .`) has no editable finder to fall back on; found by
scripts/edge-arm64-check, where the arm64 node's ClientApp failed with "No module named
'fedswarm.client'" on every message. The interpreter here runs without site (-S), so no
editable finder can mask the shadowing either."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_clientapp_and_serverapp_import_from_an_unpacked_app_tree(tmp_path):
    fab = tmp_path / "fab"
    for name in ("fedswarm", "algorithms", "strategies", "server", "client"):
        shutil.copytree(ROOT / name, fab / name, ignore=shutil.ignore_patterns("__pycache__"))
    site_packages = sysconfig.get_paths()["purelib"]
    code = (f"import sys; sys.path[:0] = [{str(fab)!r}]; sys.path.append({site_packages!r}); "
            "import fedswarm.client.app as c, fedswarm.server.app as s; print(c.__file__); print(s.__file__)")
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [str(fab / "client" / "app.py"), str(fab / "server" / "app.py")]
