"""The package's import graph stays simple: a reader finds each concept in one place.

Read from the source (module- and function-level imports alike):

* no import cycle between the package's modules;
* no module takes another module's underscore names (``from .env import _raw``,
  ``ranks._WORLD``); importing a private *module* (``from . import _signals``) is fine;
* no ``sys.modules`` lookup of a sibling (a dependency no import shows);
* plumbing modules (``_name.py``) import only plumbing modules and :mod:`axolotl_dist.errors`,
  never the functional layer built on them.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set, Tuple

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "axolotl_dist"
#: Imported by everything, plumbing included: the public exceptions.
SHARED_LEAVES = {f"{PACKAGE}.errors"}


def _modules() -> Dict[str, Path]:
    found = {}
    for path in (ROOT / PACKAGE).rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _resolve(module: str, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` names (before its imported names)."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    if not _is_package(module):
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _plumbing(name: str) -> bool:
    return name.rsplit(".", 1)[-1].startswith("_")


class _Scan(ast.NodeVisitor):
    """Imports, private-name uses and ``sys.modules`` uses of one module."""

    def __init__(self, module: str) -> None:
        self.module = module
        self.edges: Set[str] = set()
        self.problems: List[str] = []
        self.aliases: Dict[str, str] = {}  # local name -> package module

    def _edge(self, target: str, line: int) -> None:
        if target in MODULES and target != self.module:
            self.edges.add(target)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name.startswith(PACKAGE):
                self._edge(alias.name, node.lineno)
                if alias.asname:
                    self.aliases[alias.asname] = alias.name

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        source = _resolve(self.module, node)
        if not source.startswith(PACKAGE):
            return
        for alias in node.names:
            sub = f"{source}.{alias.name}"
            if sub in MODULES:  # a module: `from . import _signals`
                self._edge(sub, node.lineno)
                self.aliases[alias.asname or alias.name] = sub
                continue
            self._edge(source, node.lineno)
            if alias.name.startswith("_") and not alias.name.startswith("__"):
                self.problems.append(f"{self.module}:{node.lineno} takes {source}.{alias.name}")

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if isinstance(node.value, ast.Name) and node.value.id in self.aliases:
            target = self.aliases[node.value.id]
            if node.attr.startswith("_") and not node.attr.startswith("__") \
                    and f"{target}.{node.attr}" not in MODULES:
                self.problems.append(f"{self.module}:{node.lineno} takes {target}.{node.attr}")
        if isinstance(node.value, ast.Name) and node.value.id == "sys" and node.attr == "modules":
            self.problems.append(f"{self.module}:{node.lineno} looks up sys.modules")
        self.generic_visit(node)


def _scan() -> Tuple[Dict[str, Set[str]], List[str]]:
    graph, problems = {}, []
    for module, path in MODULES.items():
        scan = _Scan(module)
        scan.visit(ast.parse(path.read_text(), str(path)))
        graph[module] = scan.edges
        problems += scan.problems
    return graph, problems


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Every cycle found by a depth-first search (each reported once, from its first node)."""
    found, state, stack = [], {}, []

    def visit(node: str) -> None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if _is_package(nxt) and node.startswith(nxt + "."):
                continue  # a submodule importing its own package's __init__ (re-exports)
            if state.get(nxt) == "open":
                found.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def test_no_import_cycle():
    graph, _ = _scan()
    assert _cycles(graph) == []


def test_no_private_names_or_sys_modules_lookups_across_modules():
    _, problems = _scan()
    assert problems == []


def test_plumbing_never_imports_the_functional_layer():
    graph, _ = _scan()
    wrong = sorted(f"{m} imports {t}" for m, targets in graph.items() if _plumbing(m)
                   for t in targets if not _plumbing(t) and t not in SHARED_LEAVES)
    assert wrong == []


def test_the_scan_sees_what_it_should():
    # guard against a scanner that finds nothing: these edges exist by design
    graph, _ = _scan()
    assert f"{PACKAGE}._signals" in graph[f"{PACKAGE}.ordering"] | graph[f"{PACKAGE}._blocks"]
    assert f"{PACKAGE}.errors" in graph[f"{PACKAGE}._signals"]
    assert len(graph) > 25


def test_the_harness_imports_without_pytest():
    # users of axolotl_dist.testing (their own scripts, other test runners) need no pytest;
    # its pytest markers are built on first use
    import subprocess
    import sys

    from fixtures import subprocess_env

    code = ("import sys; sys.modules['pytest'] = None\n"
            "import axolotl_dist.testing as t\n"
            "print(t.run_distributed(lambda: 1 + 1, 1, init=False))\n"
            "try:\n    t.GPU_MARKS\nexcept ImportError:\n    print('markers need pytest')\n")
    done = subprocess.run([sys.executable, "-c", code], env=subprocess_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["[2]", "markers", "need", "pytest"]
