"""scripts/import_cycles.py, the cycle check of scripts/lint-imports: it finds a cycle closed by an
import inside a function, leaves out imports made for annotations only, and lint-imports fails on a
cycle added to this tree."""

from __future__ import annotations

import importlib.util
import random
import shutil
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path, loader=None)
    if spec is None:  # no .py suffix: a command
        from importlib.machinery import SourceFileLoader

        loader = SourceFileLoader(name, str(path))
        spec = importlib.util.spec_from_loader(name, loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def cycles():
    return _load("fedswarm_import_cycles_under_test", ROOT / "scripts" / "import_cycles.py")


def _write(root: Path, files: dict[str, str]) -> Path:
    (root / "pyproject.toml").write_text('[tool.setuptools]\npackage-dir = { "toy" = "toy", "toy.sub" = "sub" }\n')
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def _members(found) -> list[list[str]]:
    return [sorted({e.source for e in edges}) for edges in found]


def test_a_cycle_closed_inside_a_function_is_found(tmp_path, cycles):
    tree = _write(tmp_path, {
        "toy/__init__.py": "",
        "toy/engine.py": "from toy.runner import Runner\n",
        # the runner reaches back for a constant inside a function: still a cycle at run time
        "toy/runner.py": """
            class Runner:
                def go(self):
                    from toy import engine
                    return engine
        """,
        # a subpackage mapped to a folder of its own, imported relatively
        "sub/__init__.py": "",
        "sub/a.py": "from . import b\n",
        "sub/b.py": "import toy.sub.c\n",
        "sub/c.py": "def f():\n    from ..sub.a import X\n",
        "toy/leaf.py": "import toy.engine\n",
    })
    found = cycles.find_cycles(tree)
    assert _members(found) == [["toy.engine", "toy.runner"], ["toy.sub.a", "toy.sub.b", "toy.sub.c"]]
    back = next(e for e in found[0] if e.source == "toy.runner")
    assert (back.target, back.line, back.local) == ("toy.engine", 4, True)
    assert cycles.main([str(tree)]) == 1


def test_annotation_only_imports_and_a_package_importing_its_parent_are_no_cycle(tmp_path, cycles):
    tree = _write(tmp_path, {
        "toy/__init__.py": "from toy.a import A\n",
        "toy/a.py": """
            from typing import TYPE_CHECKING
            import toy  # its own parent package: imported before it anyway
            if TYPE_CHECKING:
                from toy.b import B
            else:
                import json
            A = 1
        """,
        "toy/b.py": "from toy.a import A\nB = A\n",
        "sub/__init__.py": "",
    })
    assert cycles.find_cycles(tree) == []
    assert cycles.main([str(tree)]) == 0
    # the same import outside the TYPE_CHECKING block closes the cycle
    (tree / "toy" / "a.py").write_text("from toy.b import B\nA = 1\n")
    assert _members(cycles.find_cycles(tree)) == [["toy.a", "toy.b"]]


def test_components_match_mutual_reachability(cycles):
    """Oracle: two nodes share a strongly connected component iff each reaches the other."""
    rng = random.Random(7)
    for _ in range(40):
        n = rng.randint(1, 14)
        nodes = [f"m{i}" for i in range(n)]
        succ = {v: [w for w in nodes if w != v and rng.random() < 0.15] for v in nodes}

        def reach(v, succ=succ):
            seen, todo = {v}, [v]
            while todo:
                for w in succ[todo.pop()]:
                    if w not in seen:
                        seen.add(w)
                        todo.append(w)
            return seen

        r = {v: reach(v) for v in nodes}
        want = sorted({tuple(sorted(w for w in nodes if w in r[v] and v in r[w])) for v in nodes})
        got = sorted(tuple(c) for c in cycles.strongly_connected(nodes, succ))
        assert got == want


def test_lint_imports_fails_on_a_new_cycle(tmp_path, capfd):
    """This tree has none; an import added inside a function of sim/batched_round.py (which sim/batched.py
    imports) makes scripts/lint-imports fail and name both imports, with the contracts still kept."""
    lint = _load("fedswarm_lint_imports_under_test", ROOT / "scripts" / "lint-imports")
    pyproject = ROOT / "pyproject.toml"
    shutil.copy(pyproject, tmp_path / "pyproject.toml")
    for folder in tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["package-dir"].values():
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    assert lint.main([], root=tmp_path) == 0
    assert "no import cycle" in capfd.readouterr().out
    target = tmp_path / "sim" / "batched_round.py"
    target.write_text(target.read_text() + "\n\ndef _engine():\n    from fedswarm.sim import batched\n\n"
                      "    return batched\n")
    assert lint.main([], root=tmp_path) == 1
    out = capfd.readouterr().out
    assert ", 0 broken." in out, out  # the layers allow it: only the cycle check sees it
    assert "fedswarm.sim.batched_round -> fedswarm.sim.batched  (sim/batched_round.py:" in out, out
    assert "in a function" in out and "fedswarm.sim.batched -> fedswarm.sim.batched_round" in out, out
