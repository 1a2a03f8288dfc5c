"""The layering the tree promises: the algorithm layer imports no Flower, opens no sockets."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import fedswarm.algorithms

ROOT = Path(__file__).resolve().parents[1]


def _algorithm_modules() -> list[str]:
    return [m.name for m in pkgutil.walk_packages(fedswarm.algorithms.__path__, "fedswarm.algorithms.")]


def test_algorithms_import_without_flower_or_sockets():
    mods = _algorithm_modules()
    assert len(mods) > 15  # the walk found the tree
    code = (
        "import importlib, sys\n"
        f"for m in {mods!r}: importlib.import_module(m)\n"
        "bad = sorted({m.split('.')[0] for m in sys.modules} & {'flwr', 'sqlalchemy', 'fastapi', 'ray'})\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"fedswarm.algorithms pulls in: {out.stdout.strip()}"


def test_no_algorithm_source_names_flower_or_sockets():
    for path in (ROOT / "algorithms").rglob("*.py"):
        text = path.read_text()
        for word in ("flwr", "import socket", "asyncio"):
            assert word not in text, f"{path.relative_to(ROOT)} mentions {word!r}"
