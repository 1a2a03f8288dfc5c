"""The layering of docs/architecture.md: the import-linter contracts in pyproject.toml
(scripts/lint-imports, run by CI) catch an import that breaks them, and the algorithm layer
stays free of Flower, databases, web and sockets in ways the static import graph cannot see."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import pkgutil
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import fedswarm.algorithms

ROOT = Path(__file__).resolve().parents[1]


def _lint_imports():
    """scripts/lint-imports as a module (the file has no .py suffix: it is a command)."""
    loader = importlib.machinery.SourceFileLoader("fedswarm_lint_imports", str(ROOT / "scripts" / "lint-imports"))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    loader.exec_module(module)
    return module


def _copy_tree(dest: Path) -> Path:
    """pyproject.toml and every package-dir folder of this tree, as a source tree in dest."""
    pyproject = ROOT / "pyproject.toml"
    shutil.copy(pyproject, dest / "pyproject.toml")
    folders = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["package-dir"].values()
    for folder in folders:
        shutil.copytree(ROOT / folder, dest / folder, ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def _append(path: Path, line: str) -> None:
    path.write_text(path.read_text() + line + "\n")


def test_contracts_hold_and_an_import_against_them_breaks_them(tmp_path, capfd):
    lint = _lint_imports()
    tree = _copy_tree(tmp_path)
    assert lint.main([], root=tree) == 0
    out = capfd.readouterr().out
    assert ", 0 broken." in out, out
    # Upward through the layers (a strategy reaching into the ServerApp), and Flower in the algorithms.
    _append(tree / "strategies" / "decentralized" / "node.py", "from fedswarm.server import metered_grid  # noqa")
    _append(tree / "algorithms" / "decentralized" / "mixing.py", "import flwr  # noqa")
    assert lint.main([], root=tree) == 1
    out = capfd.readouterr().out
    assert "fedswarm.strategies.decentralized.node -> fedswarm.server.metered_grid" in out, out
    assert "fedswarm.algorithms.decentralized.mixing -> flwr" in out, out


def _algorithm_modules() -> list[str]:
    return [m.name for m in pkgutil.walk_packages(fedswarm.algorithms.__path__, "fedswarm.algorithms.")]


def test_algorithms_import_without_flower_or_servers_at_run_time():
    """What the static graph misses: imports made inside third-party packages the layer uses."""
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


def test_algorithms_import_nothing_by_name():
    """An import by a string (importlib, __import__) is invisible to import-linter: the layer has none,
    so its contracts see every import it makes."""
    for path in (ROOT / "algorithms").rglob("*.py"):
        text = path.read_text()
        for word in ("import_module(", "__import__(", "importlib"):
            assert word not in text, f"{path.relative_to(ROOT)} imports by name ({word!r})"
