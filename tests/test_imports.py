"""The package's imports go one way: no module imports, directly or through others, a module that imports
it back, and the layers at the bottom (the tree, the pools, the page stores) import nothing above them.

Read from the source with ``ast``: every ``import`` counts, at module level or inside a function (a
function-level import is still a dependency, and the usual way to hide a circle), and so does
``importlib.import_module("tierkv....")`` with a literal name; an import under ``if TYPE_CHECKING:`` is
left out (it never runs; annotations may name a type from anywhere). Compiled
modules (``_radix``, ``_pageio``, ``copy._rowcopy``) import nothing: they are leaves.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tierkv._moved import MOVED

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tierkv"
NATIVE = {"tierkv._radix", "tierkv._pageio", "tierkv.copy._rowcopy"}  # C extensions: no imports of their own
BOTTOM = ("tierkv.storage", "tierkv.pools", "tierkv.radix")  # the tree is radix, radix_key, radix_frontiers
ABOVE = ("tierkv.cache", "tierkv.copy", "tierkv.engine", "tierkv.replay", "tierkv.integrations", "tierkv.cli")
# The slot allocator's native checks share the copy's compiled module (one extension, no Python imports).
ALLOWED_UPWARD = {("tierkv.pools.allocator", "tierkv.copy._rowcopy"), ("tierkv.pools.allocator", "tierkv.copy")}


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _is_import_module_call(node: ast.AST) -> bool:
    """``importlib.import_module("tierkv.x")`` with a literal name: an import like any other."""
    if not isinstance(node, ast.Call) or not node.args or not isinstance(node.args[0], ast.Constant):
        return False
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    return name == "import_module" and isinstance(node.args[0].value, str)


def imported_names(path: Path, name: str, known: set[str]) -> list[str]:
    """The tierkv modules ``path`` imports, outside TYPE_CHECKING: ``from a import b`` names ``a.b`` when
    that is a module, else ``a``. Importing ``a.b.c`` also runs ``a/__init__`` and ``a/b/__init__``: those
    count too, unless they are the importer's own packages (already run before it)."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 2)}
    found: list[str] = []

    def add(target: str) -> None:
        parts = target.split(".")
        found.extend(p for p in (".".join(parts[:i]) for i in range(1, len(parts) + 1)) if p not in own)

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif _is_import_module_call(node):
            add(node.args[0].value)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against this module's package
                package = name.split(".") if is_package else name.split(".")[:-1]
                anchor = package[: len(package) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return [t for t in found if t in known and t != name]


def import_graph() -> dict[str, set[str]]:
    """Module -> the tierkv modules it imports."""
    modules = package_modules()
    known = set(modules) | NATIVE
    graph: dict[str, set[str]] = {m: set() for m in known}
    for name, path in modules.items():
        graph[name].update(imported_names(path, name, known))
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as [a, b, ..., a], or None (depth-first search, iterative)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if start in state:
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def reachable(graph: dict[str, set[str]], start: str) -> dict[str, str]:
    """Every module ``start`` imports, directly or not, each with the module that imports it."""
    via, todo = {}, [start]
    while todo:
        node = todo.pop()
        for nxt in graph[node]:
            if nxt not in via and nxt != start:
                via[nxt] = node
                todo.append(nxt)
    return via


def _in(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") or name.startswith(p + "_") for p in prefixes)


def test_the_graph_sees_the_cache_and_its_parts():
    """A check of the checker: known edges are found, function-level ones included."""
    graph = import_graph()
    assert {"tierkv.cache.eviction", "tierkv.cache.l3.controller", "tierkv.copy.transfer"} <= \
        graph["tierkv.cache.hicache"]
    assert "tierkv.cache.l3.controller" in graph["tierkv.engine.prefetch"]  # imported inside a function
    assert "tierkv.engine.cli" in graph["tierkv.cli"]  # importlib.import_module("tierkv.engine.cli")
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]


def test_the_package_imports_are_acyclic():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_no_part_of_the_cache_imports_the_facade():
    graph = import_graph()
    importers = sorted(m for m, targets in graph.items() if "tierkv.cache.hicache" in targets and
                       _in(m, ("tierkv.cache", "tierkv.copy")))
    assert importers == [], f"parts that import the facade: {importers}"


@pytest.mark.parametrize("bottom", BOTTOM)
def test_the_bottom_layers_import_nothing_above_them(bottom):
    graph = import_graph()
    bad = []
    for module in sorted(m for m in graph if _in(m, (bottom,))):
        for target, importer in sorted(reachable(graph, module).items()):
            if _in(target, ABOVE) and (importer, target) not in ALLOWED_UPWARD:
                bad.append(f"{module} imports {target} (through {importer})")
    assert bad == [], "\n".join(bad)


def test_nothing_imports_an_old_module_path():
    """The old paths (tierkv.hicache, ...) are for code outside this repository; inside, new paths only
    (the old tierkv.cache.l3 module's names come from tierkv.cache.l3.controller)."""
    submodules = set(package_modules())
    bad = []
    for folder in ("tierkv", "tests", "bench", "scripts"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name == "test_moved_modules.py":
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names
                                             if node.module == "tierkv"]
                    if node.module == "tierkv.cache.l3":
                        names += [f"tierkv.cache.l3 (name {alias.name})" for alias in node.names
                                  if f"tierkv.cache.l3.{alias.name}" not in submodules]
                else:
                    continue
                bad += [f"{path.relative_to(ROOT)}:{node.lineno} imports {n}" for n in names
                        if n in MOVED or n.startswith("tierkv.cache.l3 (")]
    assert bad == [], "\n".join(bad)
