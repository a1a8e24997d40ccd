"""The layout explains itself: no import circles, no arrow from a layer back up to one that imports it, a module
table (docs/architecture.md) that names exactly the modules there are, and no reference to files outside the
repository."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "edgecache"
CLI = ROOT / "cli"  # installed as edgecache.cli


def modules() -> dict[str, Path]:
    """Every module of the installed package, by dotted name (cli/ as edgecache.cli)."""
    found: dict[str, Path] = {}
    for base, prefix in ((PACKAGE, ["edgecache"]), (CLI, ["edgecache", "cli"])):
        for path in base.rglob("*.py"):
            parts = prefix + list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (at any depth of the file, lazy imports included)."""
    mods = modules()
    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            for target in targets:
                if target in mods and target != name:
                    edges[name].add(target)
                    break
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in edges.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in list(edges):
        if node not in index:
            visit(node)
    return found


def floor(module: str) -> str:
    """The floor a module stands on: its subpackage (``edgecache.semantic``, ``edgecache.http``, ...), or the module
    itself for the modules at the top of the package, which every layer shares."""
    parts = module.split(".")
    if len(parts) >= 3 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()):
        return ".".join(parts[:2])
    return module


def test_no_import_circles() -> None:
    assert cycles(import_graph()) == []


def test_no_arrow_runs_back_up() -> None:
    # Between floors (a subpackage, or a top module) the imports form no circle either: a layer that imports
    # another is never imported back by it, through any module of either.
    floors: dict[str, set[str]] = defaultdict(set)
    for source, targets in import_graph().items():
        for target in targets:
            if floor(source) != floor(target):
                floors[floor(source)].add(floor(target))
    assert cycles(floors) == []


def test_every_import_of_the_package_names_a_module_there_is() -> None:
    # The graph above skips imports of modules that do not exist; an import left behind by a move would then fail
    # only at run time (or, with another checkout on the path, import the other checkout's module).
    mods = modules()
    missing = []
    for name, path in mods.items():
        if name.startswith("edgecache.cli"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "edgecache":
                base = node.module or ""
                if base in mods:
                    continue
                missing += [f"{name}: {base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" not in mods]
            elif isinstance(node, ast.Import):
                missing += [f"{name}: {alias.name}" for alias in node.names
                            if alias.name.split(".")[0] == "edgecache" and alias.name not in mods
                            and alias.name != "edgecache"]
    assert missing == []


def test_the_checks_see_a_circle() -> None:
    # The two checks above would pass on a graph they could not read; this one shows they read it.
    assert cycles({"a": {"b"}, "b": {"a"}}) == [["a", "b"]]
    edges = import_graph()
    assert "edgecache.pipeline" in edges["edgecache.runtime"]
    assert floor("edgecache.semantic.cache") == "edgecache.semantic" and floor("edgecache.pipeline") == \
        "edgecache.pipeline"


def test_the_measurement_package_is_a_top_floor() -> None:
    # edgecache.bench holds what scripts/ measures with: it imports the package, and nothing in the package imports
    # it (a server never carries benchmark code).
    importers = {source for source, targets in import_graph().items()
                 if floor(source) != "edgecache.bench" and any(floor(t) == "edgecache.bench" for t in targets)}
    assert importers == set()
    assert "edgecache.bench.semantic_eval" in import_graph()["edgecache.bench.verifier_fit"]


def architecture_module_table() -> list[str]:
    """The module paths docs/architecture.md's "Modules" table names (relative to edgecache/)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Modules\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([\w/]+\.py)` \|", section, flags=re.MULTILINE)


def defines_something(path: Path) -> bool:
    """A module with more than a docstring (a package's ``__init__.py`` that only describes it is not a module)."""
    body = ast.parse(path.read_text()).body
    return any(not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)) for node in body)


def test_the_architecture_module_table_names_every_module_and_no_other() -> None:
    named = architecture_module_table()
    assert len(named) == len(set(named)), "a module is named twice"
    there = {str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
             if path.name != "__init__.py" or defines_something(path)}
    assert sorted(there - set(named)) == [], "modules missing from docs/architecture.md's table"
    assert sorted(set(named) - there) == [], "docs/architecture.md's table names modules that do not exist"


def test_nothing_points_outside_the_repository() -> None:
    # The repository explains itself: no reader is sent to the design notes or data that live beside it.
    outside = re.compile(r"\.\./shared|DESIGN\.md|STYLE\.md")
    files = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *PACKAGE.rglob("*.py"), *CLI.rglob("*.py")]
    offenders = [str(path.relative_to(ROOT)) for path in files if outside.search(path.read_text())]
    assert offenders == []
