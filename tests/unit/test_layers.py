"""The package's import structure (DESIGN: imports go one way): no two modules import each
other at module level, and the lower layers never import the api."""

from __future__ import annotations

import ast
from pathlib import Path

import datadist

ROOT = Path(datadist.__file__).parent


def _imports() -> dict[str, set[str]]:
    """Module name -> the datadist modules it imports at module level."""
    names = {}
    for f in ROOT.rglob("*.py"):
        name = ".".join(("datadist", *f.relative_to(ROOT).with_suffix("").parts))
        names[f] = name.removesuffix(".__init__")
    known = set(names.values())
    out: dict[str, set[str]] = {}
    for f, name in names.items():
        deps: set[str] = set()
        for node in ast.parse(f.read_text()).body:
            if isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    deps.add(full if full in known else node.module)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
        out[name] = {d for d in deps if d in known and d != name and d != "datadist"}
    return out


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
        if layer in ("core", "wire", "transport", "memory"):
            upward = sorted(d for d in deps if d.startswith("datadist.api"))
            assert not upward, f"{name} imports {upward}"
        if layer == "wire":
            assert all(d.startswith("datadist.wire") or d.startswith("datadist.core.errors")
                       for d in deps), f"wire imports {sorted(deps)}"
