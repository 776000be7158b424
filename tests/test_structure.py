"""The house shows its floors: a reader finds each concept in one place.

Read from the source (module- and function-level imports alike):

* the package's top level holds only public modules; the private machinery several features
  share is one package, ``axolotl_dist._runtime``, whose docstring maps every module in it; a
  feature's own private parts (``launch._report``, ``tracing._merge``, ``hf_data._parts``...)
  sit in its package and are imported by it alone;
* no import cycle between the package's modules;
* no module takes another module's underscore names (``from .env import _raw``,
  ``ranks._WORLD``); importing a private *module* (``from ._runtime import store``) is fine;
* no ``sys.modules`` lookup of a sibling (a dependency no import shows); the one module that
  asks whether the user imported a library the kit must not import is listed, with why;
* runtime modules import only runtime modules and the vocabulary (``errors``, ``env``,
  ``ranks``), never the public layer built on them;
* one function turns a ``group=`` argument into the kit's ``Group`` (``group_of``); public
  modules' ``__all__`` list only names the docs name; building a public exception changes no
  state;
* no module of the package is longer than 500 lines;
* every ``docs/...`` reference in the code, the tests and the benchmarks names a file that
  exists, and the heading (``docs/design/<page>.md, "Heading"``) or decision
  (``docs/design/decisions.md, decision 4``) it cites exists in it; every docstring cross-reference
  (``:func:`...```) in the package names something that exists;
* no test reaches into the runtime: tests use the public modules, and the project's own test
  plumbing (``reset_process_state``, ``store_of``...) through ``tests/probes.py`` alone.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import re
import types
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "axolotl_dist"
RUNTIME = f"{PACKAGE}._runtime"
#: The vocabulary every floor speaks, the runtime included: the public exceptions, the
#: launcher's variables (a package: how the kit reads variables, SLURM's lists), the rank
#: queries. They are the lowest floor: they import one another and nothing else of the kit
#: (checked below).
VOCABULARY = (f"{PACKAGE}.errors", f"{PACKAGE}.env", f"{PACKAGE}.ranks")
MAX_LINES = 500


def _modules() -> Dict[str, Path]:
    found = {}
    for path in (ROOT / PACKAGE).rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _told(found: object, rule: str, fix: str) -> str:
    """A failing architecture check's message: the rule (with its limit), how to fix it, and
    what broke it, one item a line."""
    items = found if isinstance(found, (list, tuple)) else [found]
    return f"{rule}. Fix: {fix}.\n" + "\n".join(str(item) for item in items)


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


def _runtime(name: str) -> bool:
    return name == RUNTIME or name.startswith(RUNTIME + ".")


class _Scan(ast.NodeVisitor):
    """Imports, private-name uses and ``sys.modules`` uses of one module."""

    def __init__(self, module: str, typing: bool = False) -> None:
        self.module = module
        self.typing = typing  # `if TYPE_CHECKING:` imports are edges too
        self.edges: Set[str] = set()
        self.problems: List[str] = []
        self.aliases: Dict[str, str] = {}  # local name -> package module

    def _edge(self, target: str, line: int) -> None:
        if target in MODULES and target != self.module:
            self.edges.add(target)

    def visit_If(self, node: ast.If) -> None:
        # `if TYPE_CHECKING:` imports exist for annotations only: no edge at run time
        if isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING" and not self.typing:
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

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


def _scan(typing: bool = False) -> Tuple[Dict[str, Set[str]], List[str]]:
    graph, problems = {}, []
    for module, path in MODULES.items():
        scan = _Scan(module, typing)
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
    # annotations' imports count: a state module typed by its users' classes is a cycle too
    graph, _ = _scan(typing=True)
    cycles = _cycles(graph)
    assert cycles == [], _told(cycles, "no import cycle between the package's modules",
                               "move what both sides need into the lower module, or import "
                               "the higher one's function where it is called")


#: The modules that may read ``sys.modules``, and why: never for a module of the kit.
READS_SYS_MODULES = {
    f"{RUNTIME}.protocols.map_cache": "whether the user's script imported datasets, which the "
                                      "kit never imports itself",
    f"{RUNTIME}.protocols.zero_first": "the same look before calling map_cache.watch, which a "
                                       "block on a loop's hot path then skips",
    "axolotl_dist.partial_state": "whether the user's script imported accelerate, whose own "
                                  "DistributedType member distributed_type then returns",
    "axolotl_dist.errors": "whether the user's script imported accelerate's operations, whose "
                           "DistributedOperationException a shape mismatch then also is",
}


def test_no_private_names_or_sys_modules_lookups_across_modules():
    _, problems = _scan()
    allowed = tuple(f"{m}:" for m in READS_SYS_MODULES)
    wrong = [p for p in problems if not (p.startswith(allowed) and p.endswith("sys.modules"))]
    assert wrong == [], _told(wrong, "no module takes another module's underscore names or "
                              "looks a sibling up in sys.modules",
                              "make the name public in its module (and its __all__), or "
                              "import the module; a needed sys.modules read goes in "
                              "READS_SYS_MODULES with why")


def _vocabulary(name: str) -> bool:
    return any(name == v or name.startswith(v + ".") for v in VOCABULARY)


def test_the_vocabulary_imports_nothing_else_of_the_kit():
    graph, _ = _scan()
    wrong = sorted(f"{m} imports {t}" for m, targets in graph.items() if _vocabulary(m)
                   for t in targets if not _vocabulary(t))
    assert wrong == [], _told(wrong, "errors, env and ranks import one another and nothing "
                              "else of the kit (the runtime included)",
                              "move what they need into them, or move the code that needs "
                              "the runtime up into the runtime or a public module above it")


def test_the_runtime_never_imports_the_public_layer():
    graph, _ = _scan()
    wrong = sorted(f"{m} imports {t}" for m, targets in graph.items() if _runtime(m)
                   for t in targets if not _runtime(t) and not _vocabulary(t))
    assert wrong == [], _told(wrong, "the runtime imports only the runtime and the "
                              "vocabulary (errors, env, ranks)",
                              "move what the runtime needs down into _runtime, or pass it in "
                              "from the public module that calls")


def test_the_top_level_holds_only_public_modules():
    private = sorted(p.name for p in (ROOT / PACKAGE).glob("_*.py") if p.name != "__init__.py")
    assert private == [], _told(private, "the package's top level holds public modules only",
                                "move a shared private module into _runtime/<room>, a "
                                "feature's into its package")
    packages = sorted(p.name for p in (ROOT / PACKAGE).iterdir()
                      if p.is_dir() and p.name.startswith("_") and p.name != "__pycache__")
    assert packages == ["_runtime"]


#: The runtime's rooms, lowest first: a room imports itself and the rooms before it only.
ROOMS = ("base", "store", "liveness", "protocols", "lifecycle")


def _room(module: str) -> str:
    return module[len(RUNTIME) + 1:].split(".")[0]


def test_the_runtime_is_a_few_rooms_that_import_one_way():
    top = ROOT / PACKAGE / "_runtime"
    files = sorted(p.name for p in top.iterdir() if p.name != "__pycache__")
    assert len([f for f in files if f.endswith(".py")]) <= 8, files
    assert sorted(p.name for p in top.iterdir() if p.is_dir() and p.name != "__pycache__") \
        == sorted(ROOMS)
    graph, _ = _scan()
    wrong = sorted(f"{m} imports {t}" for m, targets in graph.items()
                   if _runtime(m) and m != RUNTIME for t in targets
                   if _runtime(t) and t != RUNTIME
                   and ROOMS.index(_room(t)) > ROOMS.index(_room(m)))
    assert wrong == [], _told(wrong, f"a room imports itself and the rooms before it in "
                              f"{ROOMS} only", "move the shared part into the lower room")


def test_each_room_docstring_maps_its_modules():
    for room in ROOMS:
        folder = ROOT / PACKAGE / "_runtime" / room
        doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""
        unmapped = [p.stem for p in folder.glob("*.py")
                    if p.stem != "__init__" and f":mod:`.{p.stem}`" not in doc]
        assert unmapped == [], _told(unmapped, f"_runtime/{room}/__init__.py's docstring maps "
                                     "every module of the room", "add a line "
                                     "':mod:`.<module>`: what it holds' for each")


def test_the_rooms_page_names_every_module_of_each_room():
    # docs/design/rooms.md, a room's bullet: what the room holds, each module by its name
    page = (ROOT / "docs" / "design" / "rooms.md").read_text()
    for room in ROOMS:
        found = re.search(rf"^- \*\*`{room}/`\*\*(.*?)(?=^- \*\*|^$)", page, re.M | re.S)
        assert found, f"docs/design/rooms.md has no bullet '- **`{room}/`**'"
        named = set(re.findall(r"`(\w+)`", found.group(1)))
        folder = ROOT / PACKAGE / "_runtime" / room
        unnamed = sorted(p.stem for p in folder.glob("*.py")
                         if p.stem != "__init__" and p.stem not in named)
        assert unnamed == [], _told(unnamed, f"docs/design/rooms.md's bullet of {room}/ names "
                                    "each module of the room", "add `<module>` with what it "
                                    "holds")


def test_no_two_modules_share_a_name():
    # a reader finds a module by its name: no _runtime/x.py beside launch/_x.py
    stems: Dict[str, List[str]] = {}
    for path in (ROOT / PACKAGE).rglob("*.py"):
        if path.stem not in ("__init__", "__main__"):
            stems.setdefault(path.stem.lstrip("_"), []).append(str(path.relative_to(ROOT)))
    shared = [f"{s}: {p}" for s, p in stems.items() if len(p) > 1]
    assert shared == [], _told(shared, "no two modules share a name (a leading underscore "
                               "aside)", "rename one for what it holds")


#: Private metaphors a newcomer had to decode, replaced by the field's words (issue #57):
#: a wake key and its waiter (not a bell to ring or arm), a lent connection (not a spare),
#: a known failure (not one learnt), the where report (not whereabouts), a heartbeat task
#: (not a rider), an exclusive scope (not a guard), the stall detector and its report (not a
#: judge's verdicts), a peer checker (not a watch). No identifier of the package may use them
#: again, as a whole name or as a word of a snake_case one.
RETIRED_WORDS = frozenset({
    "bell", "bells", "ring", "arm", "spare", "learn", "learnt", "whereabouts", "crossed",
    "rider", "riders", "ride", "rides", "judge", "judged", "verdict", "verdicts",
    "noted", "account",
})
RETIRED_NAMES = frozenset({"Bell", "Spare", "Rider", "Guard", "Watch", "Folding", "Judge",
                           "RankZeroJudge", "ASLEEP_LOOKS", "VERDICTS", "linger_timeout",
                           # issue #80: words a newcomer had to look up
                           "party_error", "deadlock_part", "lendable", "propose", "_Tally",
                           "_BLAMED"})


def _identifiers(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.lineno, node.name
        elif isinstance(node, ast.Name):
            yield node.lineno, node.id
        elif isinstance(node, ast.Attribute):
            yield node.lineno, node.attr
        elif isinstance(node, ast.arg):
            yield node.lineno, node.arg
        elif isinstance(node, ast.alias):
            yield 0, node.asname or node.name.rsplit(".", 1)[-1]


def test_no_identifier_uses_a_retired_metaphor():
    found = []
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        names = [(0, path.stem)] + list(_identifiers(ast.parse(path.read_text())))
        for line, name in names:
            words = {w.lower() for w in name.strip("_").split("_") if w}
            if name in RETIRED_NAMES or words & RETIRED_WORDS:
                found.append(f"{path.relative_to(ROOT)}:{line} {name}")
    found = sorted(set(found))
    assert found == [], _told(found, "no identifier uses a retired metaphor (RETIRED_WORDS, "
                              "RETIRED_NAMES)", "name it with the field's word, as the "
                              "comment above RETIRED_WORDS lists")


def test_no_import_renames_a_module_of_the_package():
    # `from . import recorder as trace` made a reader look up two names for one file; a
    # leading underscore (a public module keeping its namespace clean) is the one alias allowed
    renamed = []
    for module, path in sorted(MODULES.items()):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = _resolve(module, node)
            for alias in node.names:
                if alias.asname and alias.asname.lstrip("_") != alias.name and \
                        f"{base}.{alias.name}" in MODULES:
                    renamed.append(f"{path.relative_to(ROOT)}: {alias.name} as {alias.asname}")
    assert renamed == [], _told(renamed, "an import keeps a module's name (a leading "
                                "underscore the one alias)", "import it under its own name")


#: Methods that change the container they are called on.
_MUTATORS = frozenset({"append", "extend", "insert", "remove", "pop", "popitem", "clear",
                       "update", "setdefault", "add", "discard"})


def _written(node: ast.AST, containers: Optional[Set[str]] = None) -> List[ast.AST]:
    """What ``node`` writes: the targets of an assignment or deletion, or the container a
    mutating call changes (``x.append(...)``; with ``containers``, only ``a.field.append``
    where ``field`` is one of them)."""
    if isinstance(node, (ast.Assign, ast.Delete)):
        return list(node.targets)
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        return [node.target]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
            node.func.attr in _MUTATORS and (containers is None or (
                isinstance(node.func.value, ast.Attribute)
                and node.func.value.attr in containers)):
        return [node.func.value]
    return []


def _state_objects() -> Dict[str, str]:
    """``module.NAME`` -> room of every registered state object (``NAME = register(...)``)."""
    found = {}
    for module, path in MODULES.items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and \
                    getattr(node.value.func, "id", None) == "register":
                for target in node.targets:
                    found[f"{module}.{target.id}"] = _room(module) if _runtime(module) else module
    return found


def _state_writes(module: str, tree: ast.AST, objects: Dict[str, str]) -> List[Tuple[int, str]]:
    """``(line, module.NAME)`` of each write this module makes to a state object: an
    assignment to or deletion of its field, or a mutating call on a field."""
    bound = {}  # local name -> module.NAME, from `from x import NAME`
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = _resolve(module, node)
            for alias in node.names:
                if f"{source}.{alias.name}" in objects:
                    bound[alias.asname or alias.name] = f"{source}.{alias.name}"

    def owner(node: ast.AST) -> str:
        while isinstance(node, (ast.Attribute, ast.Subscript)):
            node = node.value
        return bound.get(node.id, "") if isinstance(node, ast.Name) else ""

    found = []
    aliases = {}  # (function, local name) -> module.NAME: `pending = BLOCKS.unconfirmed`
    for func in ast.walk(tree):
        if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(func):
                if isinstance(node, ast.Assign) and isinstance(node.value, ast.Attribute) \
                        and isinstance(node.value.value, ast.Name) and node.value.value.id in bound:
                    for target in node.targets:
                        if isinstance(target, ast.Name):
                            aliases[(func, target.id)] = bound[node.value.value.id]
    for (func, name), obj in aliases.items():  # a mutating call on the alias
        for node in ast.walk(func):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr in _MUTATORS and isinstance(node.func.value, ast.Name) and \
                    node.func.value.id == name:
                found.append((node.lineno, obj))
    for node in ast.walk(tree):
        for target in _written(node):
            for part in ast.walk(target):
                if isinstance(part, (ast.Attribute, ast.Subscript)) and owner(part):
                    found.append((node.lineno, owner(part)))
                    break
    return found


def test_each_room_writes_only_its_own_state():
    # state owned by its room: a module writes the state objects of its own room (a public
    # module, only its own); another room asks through a function of the owner
    objects = _state_objects()
    assert {"base", "store", "liveness", "protocols", "lifecycle"} <= set(objects.values())
    wrong = []
    for module, path in sorted(MODULES.items()):
        mine = _room(module) if _runtime(module) else module
        for line, obj in _state_writes(module, ast.parse(path.read_text()), objects):
            if objects[obj] != mine:
                wrong.append(f"{path.relative_to(ROOT)}:{line} writes {obj} ({objects[obj]})")
    assert wrong == [], _told(wrong, "a module writes only its own room's state objects",
                              "call a function of the owning room that makes the change")


def test_the_state_write_scan_sees_writes():
    objects = _state_objects()
    code = ("from axolotl_dist._runtime.base.state import GROUPS\n"
            "GROUPS.last_group = None\nGROUPS.groups.clear()\ndel GROUPS.groups[1]\n"
            "x = GROUPS.groups.get(1)\ndef f():\n    alias = GROUPS.groups\n    alias.clear()\n")
    found = _state_writes(f"{RUNTIME}.store.sweep", ast.parse(code), objects)
    assert sorted(line for line, _ in found) == [2, 3, 4, 8]


def _home(module: str) -> str:
    """Who owns what a module defines: its room (runtime), else its top-level public module
    or feature package."""
    if _runtime(module) and module != RUNTIME:
        return f"{RUNTIME}.{_room(module)}"
    return ".".join(module.split(".")[:2])


_CONTAINERS = frozenset({"dict", "list", "set", "deque", "defaultdict", "OrderedDict", "PerGroup",
                         "WeakSet", "WeakKeyDictionary", "WeakValueDictionary"})


def _class_fields_by_home() -> Tuple[Dict[str, Set[str]], Set[str]]:
    """``field -> the homes of the classes that have it`` for every class of the package (its
    ``self.x = ...`` and ``__slots__``), and the fields set to a container somewhere."""
    homes: Dict[str, Set[str]] = {}
    containers: Set[str] = set()
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            for item in node.body:  # a dataclass's fields, class attributes
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    homes.setdefault(item.target.id, set()).add(_home(module))
            for item in ast.walk(node):
                if isinstance(item, ast.Assign) and isinstance(item.targets[0], ast.Name) \
                        and item.targets[0].id == "__slots__":
                    for name in ast.literal_eval(item.value):
                        homes.setdefault(name, set()).add(_home(module))
                targets = item.targets if isinstance(item, ast.Assign) else \
                    [item.target] if isinstance(item, ast.AnnAssign) else []
                value = getattr(item, "value", None)
                for target in targets:
                    if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) \
                            and target.value.id == "self":
                        homes.setdefault(target.attr, set()).add(_home(module))
                        maker = value.func if isinstance(value, ast.Call) else None
                        if isinstance(value, (ast.Dict, ast.List, ast.Set)) or \
                                getattr(maker, "id", getattr(maker, "attr", None)) in _CONTAINERS:
                            containers.add(target.attr)
    return homes, containers


#: Writes to fields no class of the writer's home has that are no kit object's: what they
#: write, and why it is not another room's state.
FOREIGN_WRITES = {
    ("axolotl_dist/collectives.py", "device"): "torch's BarrierOptions, built once",
    ("axolotl_dist/launch/_options.py", "default"): "argparse's actions",
    ("axolotl_dist/_runtime/protocols/checkpointing.py", "args"): "an exception's args (Python's)",
    ("axolotl_dist/_runtime/protocols/exchange.py", "backend_error"):
        "the public error it builds and raises (errors.RankFailedError.backend_error)",
}


def _foreign_writes(module: str, tree: ast.AST, homes: Dict[str, Set[str]],
                    containers: Set[str]) -> List[Tuple[int, str]]:
    """``(line, field)`` of each write of ``module`` to a field that only classes of other
    homes have: an assignment, deletion or augmented assignment of ``x.field`` (``x`` any
    name or expression but ``self``/``cls`` or an imported module: an alias too), or a
    mutating call on a container field (``x.field.append(...)``)."""
    modules = {alias.asname or alias.name.split(".")[0] for node in ast.walk(tree)
               if isinstance(node, ast.Import) for alias in node.names}
    mine = _home(module)
    found = []

    def field_of(node: ast.AST) -> Optional[Tuple[str, ast.AST]]:
        while isinstance(node, ast.Subscript):
            node = node.value
        return (node.attr, node.value) if isinstance(node, ast.Attribute) else None

    for node in ast.walk(tree):
        for target in _written(node, containers):
            found_field = field_of(target)
            if found_field is None:
                continue
            name, base = found_field
            if isinstance(base, ast.Name) and (base.id in ("self", "cls") or base.id in modules):
                continue
            if name in homes and mine not in homes[name]:
                found.append((node.lineno, name))
    return found


def test_no_module_writes_an_object_another_room_owns():
    # a Group, a Heartbeat, a Block, a room's state or per-group object is written by its own
    # room alone, through any name (an alias included); another room calls the owner
    homes, containers = _class_fields_by_home()
    wrong = []
    for module, path in sorted(MODULES.items()):
        rel = str(path.relative_to(ROOT))
        for line, name in _foreign_writes(module, ast.parse(path.read_text()), homes, containers):
            if (rel, name) not in FOREIGN_WRITES:
                wrong.append(f"{rel}:{line} writes .{name} (a field of "
                             f"{', '.join(sorted(homes[name]))})")
    assert wrong == [], _told(wrong, "a module writes only objects its own room (or public "
                              "module) defines", "call a function of the owning room that makes "
                              "the change, or keep the state in this room")


def test_the_foreign_write_scan_sees_writes_through_any_name():
    homes, containers = _class_fields_by_home()
    code = ("import sys\nsys.path[0] = ''\nblock = BLOCKS.unconfirmed[0]\n"
            "block.timeout = 3\nbeat.warned += 1\nself.timeout = 1\n"
            "g.channel = None\nx.ranks.append(1)\n")
    found = _foreign_writes(f"{RUNTIME}.lifecycle.teardown", ast.parse(code), homes, containers)
    assert found == [(4, "timeout"), (5, "warned"), (7, "channel"), (8, "ranks")], found


def _class_fields() -> Dict[str, int]:
    """``path::Class`` -> how many fields (``self.x = ...``) the class sets."""
    counts = {}
    for module, path in sorted(MODULES.items()):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                fields = {t.attr for item in ast.walk(node)
                          for t in (item.targets if isinstance(item, ast.Assign) else
                                    [item.target] if isinstance(item, ast.AnnAssign) else [])
                          for t in ast.walk(t)
                          if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                          and t.value.id == "self"}
                counts[f"{path.relative_to(ROOT)}::{node.name}"] = len(fields)
    return counts


def test_no_class_holds_more_than_twenty_fields():
    # a class with more is several concerns in one (issue #57): split it
    big = [f"{name}: {n}" for name, n in _class_fields().items() if n > MAX_FIELDS]
    assert big == [], _told(big, f"a class sets at most {MAX_FIELDS} fields (self.x = ...)",
                            "split it by concern into small objects it holds")


#: The most fields (``self.x = ...``) a class of the package may set.
MAX_FIELDS = 20


def test_no_module_is_longer_than_the_limit():
    long = sorted(f"{p.relative_to(ROOT)}: {n} lines" for p in (ROOT / PACKAGE).rglob("*.py")
                  if (n := len(p.read_text().splitlines())) > MAX_LINES)
    assert long == [], _told(long, f"a module of the package has at most {MAX_LINES} lines",
                             "split it by concern, into modules of the same room")


#: The most decision points a function of the package may have (radon's cyclomatic
#: complexity): past it, split the function (issue #57).
MAX_COMPLEXITY = 15


def _complexities() -> Dict[str, int]:
    """``path::Class.function`` -> its cyclomatic complexity (radon), the package's and the
    pytest plugin's functions."""
    cc_visit = pytest.importorskip("radon.complexity").cc_visit
    found: Dict[str, int] = {}
    for path in sorted([*(ROOT / PACKAGE).rglob("*.py"), ROOT / "pytest_axolotl_dist.py"]):
        for block in cc_visit(path.read_text()):
            for item in [block, *getattr(block, "methods", [])]:
                name = f"{path.relative_to(ROOT)}::{item.fullname}"
                found[name] = max(found.get(name, 0), item.complexity)
    return found


def test_no_function_is_more_complex_than_the_limit():
    found = [f"{name}: {n}" for name, n in _complexities().items() if n > MAX_COMPLEXITY]
    assert found == [], _told(found, f"a function's cyclomatic complexity (radon) is at most "
                              f"{MAX_COMPLEXITY}", "split it: give each decision's branch a "
                              "function of its own, or a table")


def _module_lines() -> Dict[str, int]:
    return {str(p.relative_to(ROOT)): len(p.read_text().splitlines())
            for p in sorted((ROOT / PACKAGE).rglob("*.py"))}


#: What the ratchet watches: a measure, the floor from which it is recorded, and the file's
#: table of it (tests/limits_baseline.py).
RATCHETS = (("function's complexity", 13, "COMPLEXITY", _complexities),
            ("class's field count", 18, "FIELDS", _class_fields),
            ("module's line count", 450, "LINES", _module_lines))


@pytest.mark.parametrize("measure, floor, table, measured", RATCHETS,
                         ids=["complexity", "fields", "lines"])
def test_the_limits_only_go_down(measure, floor, table, measured):
    """Near a limit, the recorded value is a ceiling that only goes down: a function, class or
    module at the floor or above is in tests/limits_baseline.py and at most its value there; a
    new one, or one that grew, fails; one that shrank fails until its entry is lowered (or
    removed, below the floor), so it cannot grow back."""
    import limits_baseline

    recorded: Dict[str, int] = getattr(limits_baseline, table)
    now = {name: n for name, n in measured().items() if n >= floor}
    grew = [f"{name}: {n} (recorded: {recorded.get(name, 'none')})" for name, n in now.items()
            if n > recorded.get(name, floor - 1)]
    assert grew == [], _told(grew, f"a {measure} at {floor} or more never grows nor appears "
                             "(tests/limits_baseline.py)", "split the code so it is below "
                             "its recorded value (or below the floor)")
    shrank = [f"    {name!r}: {now[name]}," if name in now else f"    remove {name!r}"
              for name, n in recorded.items() if now.get(name, 0) < n]
    assert shrank == [], _told(shrank, f"the record of each {measure} follows the code down",
                               f"write these entries into {table} in tests/limits_baseline.py")


def test_the_scan_sees_what_it_should():
    # guard against a scanner that finds nothing: these edges exist by design
    graph, _ = _scan()
    assert f"{RUNTIME}.protocols.rounds" in graph[f"{PACKAGE}.ordering"]
    assert f"{RUNTIME}.liveness.polls" in graph[f"{RUNTIME}.protocols.blocks"]
    assert f"{PACKAGE}.errors" in graph[f"{RUNTIME}.liveness.peers"]
    assert {f"{RUNTIME}.store.access", f"{RUNTIME}.liveness.peers"} \
        <= graph[f"{RUNTIME}.liveness.stalls"]
    assert len(graph) > 40


def test_the_signalling_floors_depend_one_way():
    # store access <- peers <- judge <- heartbeat, judge <- waits: no floor imports one above
    graph, _ = _scan()
    floors = [f"{RUNTIME}.{n}" for n in ("store.access", "liveness.peers", "liveness.stalls",
                                         "liveness.heartbeat", "liveness.waits")]
    for i, floor in enumerate(floors):
        assert not graph[floor] & set(floors[i + 1:]), (floor, graph[floor])


#: ``docs/<page>.md`` or ``docs/<folder>/<page>.md`` (``docs/design/store.md``) optionally
#: followed by ``, "Heading"`` or ``, decision N``.
DOC_REF = re.compile(r'docs/((?:[\w-]+/)*[\w-]+\.md)(?:,\s+"([^"]+)"|,\s+decisions?\s+(\d+))?')


def _headings(page: Path) -> List[str]:
    return [line.lstrip("#").strip() for line in page.read_text().splitlines()
            if line.startswith("#")]


def _doc_refs() -> List[Tuple[str, str, str, str]]:
    """``(where, page, heading, decision)`` of every docs reference in code, tests, benchmarks."""
    refs = []
    for folder in (PACKAGE, "tests", "benchmarks", "examples"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.name == "test_structure.py":
                continue  # its examples are not references
            text = " ".join(path.read_text().split())  # references may wrap across lines
            for m in DOC_REF.finditer(text):
                refs.append((str(path.relative_to(ROOT)), m.group(1), m.group(2) or "",
                             m.group(3) or ""))
    return refs


def test_every_docs_reference_in_the_code_resolves():
    refs = _doc_refs()
    assert len(refs) > 10  # the runtime cites the design doc throughout
    broken = []
    for where, page, heading, decision in refs:
        path = ROOT / "docs" / page
        if not path.is_file():
            broken.append(f"{where}: docs/{page} does not exist")
            continue
        titles = _headings(path)
        if heading and heading not in titles:
            broken.append(f"{where}: docs/{page} has no heading {heading!r}")
        if decision and not any(t.startswith(f"{decision}. ") for t in titles):
            broken.append(f"{where}: docs/{page} has no decision {decision}")
    assert broken == [], _told(broken, "a docs reference names a page, heading and decision "
                               "that exist", "cite the heading as it reads now")


#: A docstring's cross-reference (``:func:`name```, ``:class:``, ``:mod:``, ``:data:``, ...).
XREF = re.compile(r":(?:func|class|mod|data|meth|attr|exc|obj):`([^`]+)`")


def _walk(obj: object, parts: List[str]) -> bool:
    """Whether ``obj.a.b...`` exists; a class's annotated or slotted field counts."""
    for part in parts:
        if not hasattr(obj, part):
            fields = set(getattr(obj, "__annotations__", {})) | set(getattr(obj, "__slots__", ()))
            return isinstance(obj, type) and part in fields and part == parts[-1]
        obj = getattr(obj, part)
    return True


def _importable(dotted: str) -> bool:
    """Whether ``dotted`` is a module, or a name inside the longest module prefix of it."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            module = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        return _walk(module, parts[i:])
    return False


def _xref_resolves(module: types.ModuleType, target: str) -> bool:
    """Resolve a cross-reference written in ``module``, the way its readers follow it: leading
    dots are relative to the module's package as in an import (``..store.keys.WAITERS``); a
    name without them is the module's own or imported name, a member of one of its classes
    (``Heartbeat.own``, or ``own`` inside it), a public name of the package, a builtin, or an
    absolute dotted path (``torch.distributed.barrier``). ``~`` and a trailing ``()`` are
    presentation only."""
    name = target.strip().lstrip("~!").removesuffix("()")
    if name.startswith("."):  # as an import from this module would name it
        dots = len(name) - len(name.lstrip("."))
        relative = ast.ImportFrom(module=name[dots:], names=[], level=dots)
        return _importable(_resolve(module.__name__, relative))
    parts = name.split(".")
    if parts[0] in vars(module):
        return _walk(module, parts)
    classes = [c for c in vars(module).values()
               if isinstance(c, type) and c.__module__ == module.__name__]
    if any(_walk(c, parts) for c in classes):
        return True
    assigned = re.compile(rf"\bself\.{re.escape(name)}\s*[:=]")
    if len(parts) == 1 and assigned.search(MODULES[module.__name__].read_text()):
        return True  # an attribute its instances set
    return _walk(importlib.import_module(PACKAGE), parts) or _walk(builtins, parts) \
        or _importable(name)


def _broken_xrefs() -> List[str]:
    broken = []
    for name, path in sorted(MODULES.items()):
        if name.endswith("__main__"):
            continue  # importing it runs the CLI; it has no cross-reference
        module = importlib.import_module(name)
        for n, line in enumerate(path.read_text().splitlines(), 1):
            broken += [f"{path.relative_to(ROOT)}:{n}: {m[0]}" for m in XREF.finditer(line)
                       if not _xref_resolves(module, m[1])]
    return broken


def test_every_docstring_cross_reference_resolves():
    """Every ``:func:`` / ``:class:`` / ``:mod:`` / ``:data:`` / ... target in the package
    names something that exists (rules: :func:`_xref_resolves`). Fix a failure by naming
    what the text means as it is now (a renamed key, a module that moved), e.g.
    ``:data:`..store.keys.WAITERS``` from a module of ``_runtime/liveness``."""
    broken = _broken_xrefs()
    assert broken == [], (
        "docstring cross-references that name nothing: name what the text means as it is now "
        "(leading dots are relative to the module's package, as in an import):\n"
        + "\n".join(broken))


def test_the_cross_reference_check_sees_a_wrong_name():
    heartbeat = importlib.import_module(f"{RUNTIME}.liveness.heartbeat")
    assert _xref_resolves(heartbeat, "..store.keys.WAITERS")
    assert _xref_resolves(heartbeat, "~.peers.store_lost_error()")
    assert _xref_resolves(heartbeat, "torch.distributed.barrier")
    assert _xref_resolves(heartbeat, "axolotl_dist.zero_first")
    for wrong in ("WAITERS_KEY", ".store.keys.WAITERS", "..store.keys.NO_SUCH_KEY",
                  "torch.distributed.no_such_function", ".stall detector.waiting_key"):
        assert not _xref_resolves(heartbeat, wrong), wrong


def test_no_reference_to_files_outside_the_repository():
    # DESIGN.md and REFERENCE.md were the project's starting documents, not files in it
    stale = []
    for folder in (PACKAGE, "tests", "benchmarks", "examples"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.name == "test_structure.py":
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if re.search(r"\b(DESIGN|REFERENCE)(\.md)?\b", line):
                    stale.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert stale == [], _told(stale, "the code cites only files in this repository",
                              "cite docs/design/README.md or the page that took the text over")


#: The unit tests of internal modules, in trees that mirror the sources (``tests/runtime/...``
#: for ``axolotl_dist/_runtime/...``, ``tests/launch/`` for the launcher's private modules):
#: the only tests that import them.
UNIT_TREES = ("runtime", "launch", "env")


def test_tests_use_only_public_modules():
    # a test that reaches into the runtime pins internals instead of behaviour; the doors are
    # the public modules, and tests/probes.py for the project's own plumbing (reset_process_state,
    # store_of, known_peers...: kept out of the public axolotl_dist.testing); the unit tests of
    # pure algorithms live in UNIT_TREES, which may import what they test
    found = []
    for path in (ROOT / "tests").rglob("*.py"):
        if path.relative_to(ROOT / "tests").parts[0] in UNIT_TREES:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"axolotl_dist\._|from axolotl_dist(\.\w+)? import _(?!_)"
                         r"|\b(ad|ad_debug|debug|values|launch|env|ranks|ordering)\._(?!_)", line) \
                    and path.name != "test_structure.py":
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert found == [], _told(found, "tests outside tests/runtime and tests/launch use public "
                              "modules only", "test through the public API, reach the "
                              "project's plumbing through tests/probes.py, or move a pure "
                              "algorithm's unit test into the tree that mirrors its module")


def test_unit_trees_mirror_the_sources():
    # tests/runtime/liveness/test_deadlock.py tests axolotl_dist/_runtime/liveness/deadlock.py:
    # a maintainer finds a module's unit tests from its name
    sources = {"runtime": ROOT / PACKAGE / "_runtime", "launch": ROOT / PACKAGE / "launch",
               "env": ROOT / PACKAGE / "env"}
    wrong = []
    for tree in UNIT_TREES:
        for path in (ROOT / "tests" / tree).rglob("test_*.py"):
            rel = path.relative_to(ROOT / "tests" / tree)
            module = sources[tree] / rel.parent / (rel.name[len("test_"):])
            if not module.exists() and not module.with_name("_" + module.name).exists():
                wrong.append(f"{path.relative_to(ROOT)}: no module {module.relative_to(ROOT)}")
    assert wrong == [], _told(wrong, "a unit test file mirrors its module's path",
                              "name it tests/<tree>/<room>/test_<module>.py")


def test_every_module_has_a_quick_test_going_through_it():
    # the quick set (`pytest -m quick`, tests/quick.py) goes through every module of the
    # package; scripts/quick_cover.py measures which modules each of its integration tests goes
    # through (coverage.py, forked ranks and launched processes included) into tests/quick_map.py
    from quick import INTEGRATION, STATIC
    from quick_map import GOES_THROUGH

    fix = ("add an integration test that goes through it to INTEGRATION in tests/quick.py, then "
           "run `python scripts/quick_cover.py` (it measures each quick test and rewrites "
           "tests/quick_map.py)")
    modules = {path.relative_to(ROOT).as_posix() for path in MODULES.values()}
    modules.add("pytest_axolotl_dist.py")
    missing = sorted(modules - set(GOES_THROUGH))
    assert missing == [], f"no quick test goes through {', '.join(missing)}: {fix}"
    gone = sorted(set(GOES_THROUGH) - modules)
    assert gone == [], f"tests/quick_map.py names modules that are gone ({gone}): {fix}"
    listed = {test for tests in GOES_THROUGH.values() for test in tests}
    stale = sorted(listed - set(INTEGRATION))
    assert stale == [], f"tests/quick_map.py names tests not in tests/quick.py ({stale}): {fix}"
    for entry in (*INTEGRATION, *STATIC):
        path, _, name = entry.partition("::")
        assert (ROOT / path).is_file(), f"tests/quick.py: {entry}: no file {path}"
        function = name.split("[")[0]
        assert not function or re.search(rf"^\s*def {function}\(", (ROOT / path).read_text(),
                                         re.M), f"tests/quick.py: {entry}: no test {function}"


def test_the_projects_probes_come_through_one_file():
    # axolotl_dist.testing._probes is the testing feature's private module: the project's tests
    # and benchmarks take it through tests/probes.py, and the public testing module does not
    # export it
    import axolotl_dist.testing as public

    takers = sorted(str(p.relative_to(ROOT)) for folder in ("tests", "benchmarks", "examples")
                    for p in (ROOT / folder).rglob("*.py")
                    if "testing._probes" in p.read_text() and p.name != "test_structure.py")
    assert takers == ["tests/probes.py"]
    import probes

    assert not set(probes.__all__) & set(public.__all__)
    assert all(not hasattr(public, name) for name in probes.__all__)


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


# ---------------------------------------------------------------- one way through the house

#: The API sections a public name must be listed in: each docs page's "Names", the README's "API".
API_SECTIONS = re.compile(r"^#{2,3} (Names|API)\b[^\n]*\n(.*?)(?=^#{1,3} |\Z)", re.S | re.M)


def _documented_names(text: str = "") -> Set[str]:
    """Every identifier inside an inline code span of an API section (:data:`API_SECTIONS`)
    of the README or a docs page (``text``: of that text alone): a name met only in prose,
    a table or an example is not documented as an API name."""
    pages = [text] if text else [p.read_text() for p in [ROOT / "README.md",
                                                          *sorted((ROOT / "docs").glob("*.md"))]]
    words: Set[str] = set()
    for page in pages:
        page = re.sub(r"```.*?```", "", page, flags=re.S)
        for match in API_SECTIONS.finditer(page):
            for span in re.findall(r"`([^`\n]+)`", match.group(2)):
                words |= set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", span))
    return words


def test_a_name_in_prose_is_not_documented_only_one_in_an_api_section():
    page = ("# P\n\nUse `shared_thing` here.\n\n## Names\n\n`listed_name`\n\n## Later\n\n"
            "`after_name`\n")
    assert _documented_names(page) == {"listed_name"}


def _public_modules() -> List[str]:
    return sorted(m for m in MODULES if not any(part.startswith("_") for part in m.split(".")))


def test_public_modules_export_only_documented_names():
    # a public module's __all__ is its API: each name is in the README or a docs page (their
    # "Names" sections), so internals live in the runtime or in a feature's private modules
    import importlib

    documented = _documented_names()
    undocumented = []
    for module in [*_public_modules(), "pytest_axolotl_dist"]:  # and the pytest plugin's
        for name in getattr(importlib.import_module(module), "__all__", ()):
            if not name.startswith("__") and name not in documented:
                undocumented.append(f"{module}.{name}")
    assert undocumented == [], _told(undocumented, "a public module exports only names the "
                                     "README or a docs page documents",
                                     "document it in the page's Names section, or keep it "
                                     "out of __all__")


def _construct_every_public_exception():
    import axolotl_dist as ad
    from probes import failure_report, known_failure, read_failure_report

    assert ad.is_distributed()  # under a process group, where a failure could be recorded
    before = known_failure()
    made = [ad.RankFailedError(1, "ValueError", "boom", "tb", where="barrier", ranks=(1, 2)),
            read_failure_report(failure_report(ad.RankFailedError(3, "KeyError", "k"))),
            ad.RankTimeoutError("slow", (1,)), ad.CollectiveMismatchError("m", {0: "a"}, (1,)),
            ad.ThreadConflictError("t"), ad.DistributedEnvError("e"),
            ad.DistributedConfigError("c"), ad.errors.MeshUsageError("u"), ad.AxolotlDistError("x"),
            ad.TensorMismatchError("s"), ad.errors.tensor_mismatch("s")]
    return before, known_failure(), all(isinstance(e, ad.AxolotlDistError) for e in made)


def test_constructing_a_public_exception_changes_no_state():
    # exceptions are plain values: the kit records a failure where it relays one
    from axolotl_dist.testing import run_distributed

    assert run_distributed(_construct_every_public_exception, 1, timeout=60) == [(None, None, True)]


def test_one_function_resolves_a_group():
    # group=... becomes the kit's Group in _runtime/base/groups.py alone (group_of): nothing else
    # builds one, looks one up, or reads torch's default group itself
    patterns = {"builds a Group": r"\bGroup\(", "looks up STATE.groups": r"STATE\.groups(\[|\.get\()",
                "reads torch's default group":
                    r"\b_?world\.default_pg\b(?! is (not )?None)|_get_default_group\(",
                "an old resolver": r"\b(state_of|group_cache|require_group|resolve)\("}
    found = []
    for module, path in MODULES.items():
        if module == f"{RUNTIME}.base.groups":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for what, pattern in patterns.items():
                if re.search(pattern, line):
                    found.append(f"{path.relative_to(ROOT)}:{n} {what}: {line.strip()}")
    assert found == [], _told(found, "one function turns a group= argument into the kit's "
                              "Group", "call _runtime.base.groups.group_of")


def test_a_features_private_modules_stay_in_its_package():
    # launch/, tracing/, hf_data/, tensors/, testing/: their underscore modules serve them only
    graph, _ = _scan()
    wrong = []
    for module, targets in graph.items():
        for target in targets:
            parts = target.split(".")
            private = [i for i, p in enumerate(parts) if p.startswith("_") and p != "_runtime"]
            if not private:
                continue
            home = ".".join(parts[:private[0]])
            if module != home and not module.startswith(home + "."):
                wrong.append(f"{module} imports {target}")
    assert wrong == [], _told(wrong, "a feature's underscore modules serve that feature only",
                              "move what is shared into _runtime/<room>")


# ---------------------------------------------------------------- one owner per protocol fact

def _code_strings(tree: ast.AST) -> List[ast.Constant]:
    """The string constants of a module that are not docstrings."""
    docs = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docs.add(id(first.value))
    return [n for n in ast.walk(tree) if isinstance(n, ast.Constant)
            and isinstance(n.value, str) and id(n) not in docs]


def test_one_module_spells_the_store_keys():
    # every key the kit keeps in the c10d store is built in _runtime/store/keys.py: a restarted
    # attempt's prefix, a new key's place in docs/design/store.md, all in one file
    owner = f"{RUNTIME}.store.keys"
    found = [f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}"
             for module, path in MODULES.items() if module != owner
             for node in _code_strings(ast.parse(path.read_text()))
             if "axd/" in node.value or node.value.startswith("axolotl_dist/")]
    assert found == [], _told(found, "every store key is spelled in _runtime/store/keys.py",
                              "add a builder there (and its entry in docs/design/store.md's "
                              "key list), and call it")


def test_the_design_docs_key_table_is_the_keys_module():
    from axolotl_dist._runtime.store import keys

    text = (ROOT / "docs" / "design" / "store.md").read_text()
    entries = text.split("## Store keys", 1)[1].split("\n## ", 1)[0]
    documented = set()
    for line in entries.splitlines():
        if line.startswith("- `"):  # an entry's first line names its keys and nothing else
            documented |= {k for k in re.findall(r"`([^`]+)`", line)
                           if k.startswith(("axd/", "axolotl_dist/"))}
    assert documented == set(keys.DOCUMENTED)


#: The modules that may import pickle or json, and why: what crosses the store is encoded in
#: one module, and the others write files or carry values the user handed over.
SERIALIZERS = {
    f"{RUNTIME}.store.records": "every record the kit keeps in the c10d store",
    f"{RUNTIME}.protocols.encoding": "the value helpers' values, across collectives",
    f"{RUNTIME}.protocols.timeline": "the timeline's rank files",
    f"{RUNTIME}.protocols.leases": "the leases on checkpoint roots",
    f"{RUNTIME}.protocols.checkpointing": "the ranks' notes of the save they are in, for the launcher",
    f"{RUNTIME}.liveness.runs": "this host's run directory",
    f"{PACKAGE}.tracing._merge": "the merged trace",
    f"{PACKAGE}.hf_data._parts": "shared_map's part files",
    f"{PACKAGE}.launch._watch": "the ranks' notes to the launcher",
    f"{PACKAGE}.launch._report": "the ranks' error files",
    f"{PACKAGE}.launch._rank_main": "the ranks' error files and end notes",
    f"{PACKAGE}.testing._harness": "the ranks' results, through a pipe",
    f"{PACKAGE}.testing._rank": "the ranks' results, through a pipe",
    f"{PACKAGE}.testing._marked": "a marked test's notes from its ranks, through files",
}


def _importers_outside(tops: Sequence[str], allowed: Mapping[str, str]) -> List[str]:
    """``path:line`` of each import of a top-level module in ``tops`` (``import re``,
    ``from json import dumps``) by a package module not in ``allowed``."""
    found = []
    for module, path in MODULES.items():
        if module in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                     else [])
            if any(n.split(".")[0] in tops for n in names):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_one_module_encodes_what_crosses_the_store():
    found = _importers_outside(("pickle", "json"), SERIALIZERS)
    assert found == [], _told(found, "only SERIALIZERS import pickle or json",
                              "encode through _runtime/store/records.py")


#: The modules that may use ``re``, and what their patterns read: text the kit does not write
#: (torch's, a launcher's, the user's), or a name format written in the same module. The kit's
#: own messages and log lines are never parsed back: a fact another part needs travels as a
#: record, and a line's rank tag is read by ``_runtime/base/text.py``, beside its writer.
READS_TEXT_BY_REGEX = {
    f"{RUNTIME}.base.torch_messages": "torch's error messages",
    "axolotl_dist.launch._fold": "torch's C++ log prefixes and frames, a leading time of day",
    "axolotl_dist.launch._options": "the user's --local-ranks-filter/--tee values",
    "axolotl_dist.env.slurm": "SLURM's node lists and task counts",
    f"{RUNTIME}.lifecycle.repeat_failure": "torch elastic's attempt_<n> log directories",
    f"{RUNTIME}.protocols.checkpointing": "step-<n> directory names (written here; users make "
                                         "them too) and the job id's allowed characters",
    f"{RUNTIME}.protocols.leases": "staging directory names, written here (staging_dir)",
    f"{RUNTIME}.liveness.runs": "the host and run names' allowed characters",
    f"{RUNTIME}.liveness.deadlock": "a packed rank list, written here (_pack)",
    f"{RUNTIME}.store.keys": "store key names, written here",
}


def test_regexes_read_foreign_text_or_a_format_written_beside_them():
    found = _importers_outside(("re",), READS_TEXT_BY_REGEX)
    assert found == [], _told(found, "only READS_TEXT_BY_REGEX use re, each on text the kit "
                              "does not write or on a format written in the same module",
                              "send the fact as a record (not a message to parse), or read "
                              "the format beside its writer and list the module with what it "
                              "reads")
    assert not set(READS_TEXT_BY_REGEX) - set(MODULES), "a listed module is gone: drop its entry"


def _module_level_containers() -> List[str]:
    """``module.NAME`` of every module-level mutable value (a dict, list, set, lock,
    thread-local...) in the package, but ``__all__``."""
    makers = {"dict", "list", "set", "defaultdict", "OrderedDict", "deque", "local", "Lock",
              "RLock", "Event", "WeakKeyDictionary", "WeakValueDictionary"}
    found = []
    for module, path in MODULES.items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                targets, value = [node.target], node.value
            else:
                continue
            call = value.func if isinstance(value, ast.Call) else None
            maker = getattr(call, "id", None) or getattr(call, "attr", None)
            if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp,
                                  ast.SetComp)) or maker in makers:
                name = f"{module}.__init__" if _is_package(module) else module
                found += [f"{name}.{t.id}" for t in targets
                          if isinstance(t, ast.Name) and t.id != "__all__"]
    return found


def test_per_process_state_is_on_STATE_or_said_to_survive_its_reset():
    # what a process learns lives on _runtime.base.state.STATE, which reset() forgets (a forked
    # rank starts as a fresh process would); anything else module-level is a table, a cache of
    # a pure function, a registry filled at import, a lock: listed, with why, in SURVIVES_RESET
    from axolotl_dist._runtime.base.state import SURVIVES_RESET

    loose = sorted(set(_module_level_containers()) - set(SURVIVES_RESET))
    assert loose == [], _told(loose, "per-process state lives on a room's registered state "
                              "object, which reset() forgets", "move it onto its room's "
                              "state object, or list it in SURVIVES_RESET with why it stays")
    assert sorted(set(SURVIVES_RESET) - set(_module_level_containers())) == []  # no stale entry
