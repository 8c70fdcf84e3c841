"""The native core's typed surface: its generated stub, and its test hooks kept apart.

``src/datadist/_core/*.pyi`` is what ``mypy --strict`` reads for every call into the core; it
is generated from the built module by ``tools/gen_stub.py`` (pybind11-stubgen, pinned in the
``test`` extra), so it can only be current or stale: stale fails here, with the diff and the
command that regenerates it. The generator is part of the ``test`` extra, so a missing one
fails too (CI installs ``.[test]``); only a checkout without the built core skips, where
DATADIST_ALLOW_NO_CORE=1 allows that (tests/project/test_native_build.py).

The hooks only tests and tools use live in ``datadist._core.testing`` and are reached through
``datadist.testing.engine``: the production ``Engine`` class has none of them, and nothing in
src/datadist outside ``datadist/testing`` imports either.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import re
from pathlib import Path
from types import ModuleType

import pytest

from datadist.core import native_build

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"

# Moved from Engine (and the module) to _core.testing: used by tests and tools only.
HOOKS = ("nixl_agent", "nixl_regions", "nixl_refusal", "nixl_leases", "link_nixl_leases",
         "set_nixl_options", "set_nixl_revoke_wait", "nixl_progress", "transport_settings")


def _core_or_skip() -> ModuleType:
    ok, why = native_build.native_available()
    if not ok:
        if os.environ.get("DATADIST_ALLOW_NO_CORE") == "1":
            pytest.skip(f"the core is not built (DATADIST_ALLOW_NO_CORE=1): {why}")
        pytest.fail(f"the core is not built: {why}")
    import datadist._core as core

    return core


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_stub", ROOT / "tools" / "gen_stub.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_stub_is_what_the_built_module_generates() -> None:
    _core_or_skip()
    gen = _generator()
    try:
        generated = gen.generate()
    except RuntimeError as e:  # not installed, another version, or it failed: never a skip
        pytest.fail(str(e))
    assert set(generated) == {"__init__.pyi", "testing.pyi"}
    diff = gen.differences(generated)
    assert not diff, (f"src/datadist/_core/*.pyi is stale: regenerate it with "
                      f"`{gen.REGENERATE}` and commit the result\n{diff}")


def test_the_stub_types_what_the_engine_calls() -> None:
    """The generated stub says real types at the boundary, not Any: a binding that returns
    py::object or a bare py::tuple / py::list / py::dict must say what is in it
    (py::typing::Optional<py::str>, py::typing::Tuple<bool, py::str>, ...), and the uint64
    arrays are typed as the arrays the core reads."""
    text = (SRC / "datadist" / "_core" / "__init__.pyi").read_text()
    testing = (SRC / "datadist" / "_core" / "testing.pyi").read_text()
    # Any only where a parameter takes several shapes on purpose (add_cache's shm: None or
    # the (fds, inodes, offsets) tuple).
    untyped = [line.strip() for line in (text + testing).splitlines()
               if re.search(r"typing\.Any|-> (tuple|list|dict):|: (tuple|list|dict)[,)]", line)
               and "shm: typing.Any" not in line]
    assert not untyped, "untyped in the binding (type its returns in cpp/python):\n" + \
        "\n".join(untyped)
    assert "ArrayLike" not in text  # tools/gen_stub.py's rewrite
    for expected in (
        "def error(self) -> datadist.core.errors.DatadistError | None",
        "def tls() -> tuple[bool, str]",
        "def check_option(key: str, value: str) -> bool | int | str",
        "def metrics_series() -> list[tuple[str, int, int, int, dict[str, int], list[int], int]]",
    ):
        assert expected in text, expected
    assert ("def nixl_agent(engine: datadist._core.Engine) -> "
            "tuple[str, int, int, int, int] | None") in testing


def test_test_hooks_are_not_on_the_production_engine() -> None:
    core = _core_or_skip()
    on_engine = [name for name in HOOKS if hasattr(core.Engine, name) or hasattr(core, name)]
    assert not on_engine, f"test hooks bound on the production module: {on_engine}"
    missing = [name for name in HOOKS if not hasattr(core.testing, name)]
    assert not missing, f"_core.testing lacks {missing}"
    # importable by name too, as the stub package (_core/testing.pyi) tells mypy it is
    assert importlib.import_module("datadist._core.testing") is core.testing


def _reaches_hooks(tree: ast.AST) -> list[str]:
    """Imports of the hooks (datadist._core.testing, datadist.testing.engine) and attribute
    reads ``<x>.testing.<hook>`` in ``tree``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in ("datadist._core",
                                                                "datadist.testing"):
            found += [f"from {node.module} import {a.name}" for a in node.names
                      if a.name in ("testing", "engine")]
        elif isinstance(node, ast.ImportFrom) and node.module in (
                "datadist._core.testing", "datadist.testing.engine"):
            found.append(f"from {node.module} import ...")
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names
                      if a.name in ("datadist._core.testing", "datadist.testing.engine")]
        elif (isinstance(node, ast.Attribute) and node.attr in HOOKS
              and isinstance(node.value, ast.Attribute) and node.value.attr == "testing"):
            found.append(f"... .testing.{node.attr}")
    return found


@pytest.mark.parametrize("source,reaches", [
    ("from datadist._core import testing", True),
    ("from datadist.testing import engine as hooks", True),
    ("import datadist.testing.engine", True),
    ("core.testing.nixl_leases(e)", True),
    ("from datadist.testing import peers", False),
    ("engine._core.link_path(1)", False),
])
def test_the_hook_check_sees_every_form(source: str, reaches: bool) -> None:
    assert bool(_reaches_hooks(ast.parse(source))) == reaches


def test_production_code_does_not_reach_the_hooks() -> None:
    offenders = {}
    for path in sorted((SRC / "datadist").rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel.startswith("datadist/testing/"):
            continue
        found = _reaches_hooks(ast.parse(path.read_text(), rel))
        if found:
            offenders[rel] = found
    assert not offenders, f"production modules reach the core's test hooks: {offenders}"


def test_the_generator_is_pinned_once() -> None:
    """tools/gen_stub.py, the `test` extra and CI's lint stage name one pybind11-stubgen
    version (another writes other text, and the check would fail for it, not for the code)."""
    gen = _generator()
    pins = re.findall(r'"pybind11-stubgen([^"]*)"', (ROOT / "pyproject.toml").read_text())
    assert pins and set(pins) == {f"=={gen.STUBGEN}"}, pins  # the test and dev extras
    assert f"'pybind11-stubgen=={gen.STUBGEN}'" in (ROOT / ".ci" / "run").read_text()
