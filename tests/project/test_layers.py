"""The package's import structure (imports go one way): no import cycle at module level, no
two modules importing each other even inside functions (a lazy import hides a cycle, it does
not remove it), and the lower layers never import the api."""

from __future__ import annotations

import ast
from pathlib import Path

import datadist

ROOT = Path(datadist.__file__).parent


def _imports(anywhere: bool = False) -> dict[str, set[str]]:
    """Module name -> the datadist modules it imports at module level (``anywhere``: also
    inside functions; never under ``if TYPE_CHECKING``, which runs no import)."""
    names = {}
    for f in ROOT.rglob("*.py"):
        name = ".".join(("datadist", *f.relative_to(ROOT).with_suffix("").parts))
        names[f] = name.removesuffix(".__init__")
    known = set(names.values())
    out: dict[str, set[str]] = {}
    for f, name in names.items():
        deps: set[str] = set()
        tree = ast.parse(f.read_text())
        nodes = _runtime_nodes(tree) if anywhere else tree.body
        for node in nodes:
            if isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    deps.add(full if full in known else node.module)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
        out[name] = {d for d in deps if d in known and d != name and d != "datadist"}
    return out


def _runtime_nodes(tree: ast.Module) -> list[ast.AST]:
    """Every node of ``tree`` outside ``if TYPE_CHECKING:`` blocks."""
    out: list[ast.AST] = []

    def walk(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                walk(child)
            return
        out.append(node)
        for child in ast.iter_child_nodes(node):
            walk(child)

    walk(tree)
    return out


def test_no_two_modules_import_each_other_even_lazily():
    graph = _imports(anywhere=True)
    mutual = sorted({tuple(sorted((a, b))) for a in graph for b in graph[a]
                     if a in graph.get(b, set())})
    assert not mutual, f"modules importing each other: {mutual}"


def test_no_module_level_import_cycles():
    graph = _imports()
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycle = path[path.index(d):] + [d]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if d not in state:
                visit(d, [*path, d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_lower_layers_do_not_import_the_api():
    for name, deps in _imports().items():
        layer = name.split(".")[1] if "." in name else ""
        if layer in ("core", "wire", "memory"):
            upward = sorted(d for d in deps if d.startswith("datadist.api"))
            assert not upward, f"{name} imports {upward}"
        if layer == "wire":
            # the reference codec: itself, the error classes, and the keys and flags it shares
            # with production code (core/keys.py)
            assert all(d.startswith(("datadist.wire", "datadist.core.errors", "datadist.core.keys"))
                       for d in deps), f"wire imports {sorted(deps)}"
