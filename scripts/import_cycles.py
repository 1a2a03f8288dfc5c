"""Import cycles between the modules of a source tree, function-local imports included.

    python scripts/import_cycles.py [ROOT]   # exit status 1 and each cycle's imports when there is one

import-linter's layers contract sees only one module's imports against another layer's: two modules of
one layer (``sim.batched`` and its round runners) may import each other, and an import inside a function
hides the cycle from a reader, not from the interpreter. Here every ``import`` in a module counts, at
module level or in a function body, except those under ``if TYPE_CHECKING:`` (annotations only: no
import at run time). A cycle is a strongly connected component of the module graph of more than one
module; the tree keeps none (scripts/lint-imports runs this after the contracts).

The modules are found as they are installed: ``[tool.setuptools] package-dir`` of ROOT/pyproject.toml maps
each package to its folder (``fedswarm.sim`` is ``sim/``).
"""

from __future__ import annotations

import ast
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Edge:
    """``source`` imports ``target`` at ``path:line`` (``local``: inside a function)."""

    source: str
    target: str
    path: Path
    line: int
    local: bool


def find_modules(root: Path) -> dict[str, Path]:
    """Every module of the packages in ROOT/pyproject.toml's package-dir: dotted name -> file."""
    package_dir = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    modules: dict[str, Path] = {}
    # Parents first: a package mapped to a folder of its own ("fedswarm.sim" = "sim") wins over a
    # folder of the same name inside its parent's folder.
    for package in sorted(package_dir, key=lambda n: n.count(".")):
        folder = root / package_dir[package]
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


class _Imports(ast.NodeVisitor):
    """The imports of one module, resolved to modules of the tree, with their lines."""

    def __init__(self, name: str, is_package: bool, modules: dict[str, Path]):
        self.name = name
        self.package = name if is_package else name.rpartition(".")[0]
        self.modules = modules
        self.found: set[tuple[str, int, bool]] = set()
        self._depth = 0  # functions entered

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        self._depth += 1
        self.generic_visit(node)
        self._depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def _known(self, dotted: str) -> str | None:
        """The longest prefix of ``dotted`` that is a module of the tree."""
        while dotted and dotted not in self.modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):
            for child in node.orelse:  # `else:` of TYPE_CHECKING runs
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            target = self._known(alias.name)
            if target:
                self.found.add((target, node.lineno, self._depth > 0))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:  # relative: from . import x, from ..a import b
            base = self.package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            base = f"{base}.{node.module}" if node.module else base
        else:
            base = node.module or ""
        for alias in node.names:
            # `from pkg import mod` imports the submodule pkg.mod; `from mod import name` imports mod.
            target = f"{base}.{alias.name}" if f"{base}.{alias.name}" in self.modules else self._known(base)
            if target:
                self.found.add((target, node.lineno, self._depth > 0))


def import_graph(root: Path) -> list[Edge]:
    """Every import between two modules of the tree (a module's import of its own parent package
    left out: importing ``fedswarm.sim.batched`` runs ``fedswarm.sim`` first anyway)."""
    modules = find_modules(root)
    edges: list[Edge] = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        visitor = _Imports(name, path.name == "__init__.py", modules)
        visitor.visit(tree)
        for target, line, local in sorted(visitor.found):
            if target != name and not name.startswith(target + "."):
                edges.append(Edge(name, target, path, line, local))
    return edges


def strongly_connected(nodes: list[str], succ: dict[str, list[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components, iteratively (no recursion limit on deep graphs)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(succ.get(start, ())))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(succ.get(w, ()))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                components.append(sorted(component))
    return components


def find_cycles(root: Path) -> list[list[Edge]]:
    """Each import cycle of the tree at ``root``: the imports among the modules of one strongly
    connected component of more than one module, sorted."""
    edges = import_graph(root)
    succ: dict[str, list[str]] = {}
    for e in edges:
        succ.setdefault(e.source, []).append(e.target)
    nodes = sorted({e.source for e in edges} | {e.target for e in edges})
    cycles = []
    for component in strongly_connected(nodes, succ):
        if len(component) > 1:
            members = set(component)
            inside = [e for e in edges if e.source in members and e.target in members]
            cycles.append(sorted(inside, key=lambda e: (e.source, e.target, e.line)))
    return sorted(cycles, key=lambda c: c[0].source)


def report(cycles: list[list[Edge]], root: Path) -> str:
    lines = []
    for edges in cycles:
        names = sorted({e.source for e in edges})
        lines.append(f"import cycle among {', '.join(names)}:")
        for e in edges:
            where = f"{e.path.relative_to(root)}:{e.line}{', in a function' if e.local else ''}"
            lines.append(f"  {e.source} -> {e.target}  ({where})")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    root = Path(argv[0]).resolve() if argv else Path(__file__).resolve().parents[1]
    cycles = find_cycles(root)
    if cycles:
        print(report(cycles, root))
        print(f"{len(cycles)} import cycle(s): make the dependency go one way (move what both need into a module "
              "both import); an import inside a function counts")
        return 1
    print("no import cycle")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
