"""The package's native core, ``datadist._core`` (CMakeLists.txt over cpp/, built by
``pip install [-e] .``; docs/native-build.md): built and loadable where the tests run, built
as the build says, and never needed by ``import datadist``.

A checkout whose core is not built fails :func:`test_the_native_core_is_built` unless
DATADIST_ALLOW_NO_CORE=1 (a developer's choice; CI never sets it, so a broken build fails CI).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import datadist
from datadist import cli
from datadist.core import native_build
from datadist.wire.protocol import VERSION

SRC = Path(datadist.__file__).resolve().parents[1]


def _core_or_skip() -> None:
    ok, why = native_build.native_available()
    if not ok and os.environ.get("DATADIST_ALLOW_NO_CORE") == "1":
        pytest.skip(f"{why} (DATADIST_ALLOW_NO_CORE=1)")
    assert ok, f"{why}; DATADIST_ALLOW_NO_CORE=1 skips the native core's tests"


def test_the_native_core_is_built() -> None:
    _core_or_skip()
    import datadist._core as core

    # The module beside the package imported, of the package's version.
    assert Path(core.__file__).resolve().parent == Path(datadist.__file__).resolve().parent
    assert core.__version__ == datadist.__version__


def test_build_info_says_how_it_was_built() -> None:
    _core_or_skip()
    info = native_build.build_info()
    assert {"compiler", "build_type", "pybind11", "protocol"} <= set(info)
    assert all(isinstance(value, str) for value in info.values())
    assert re.fullmatch(r"(GNU|Clang|AppleClang|IntelLLVM) \d+(\.\d+)+", info["compiler"]), info
    # pip builds Release (pyproject's cmake.build-type), as does the plain CMake build.
    assert info["build_type"] == "Release", info
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", info["pybind11"]), info
    # Written by the linked C++ core's codec: the version the Python codec speaks.
    assert info["protocol"] == str(VERSION), info


def test_info_says_whether_the_core_is_built(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["info"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines()
             if line.startswith("native core: ")]
    assert len(lines) == 1
    ok, why = native_build.native_available()
    if ok:
        info = native_build.build_info()
        assert lines[0].startswith(f"native core: built, {why}: ")
        assert f"compiler {info['compiler']}" in lines[0]
        assert f"build_type {info['build_type']}" in lines[0]
    else:
        assert lines[0] == f"native core: not available ({why})"


# A process in which datadist._core cannot be imported, as in a checkout with nothing built.
_NO_CORE = """
import sys

class NotBuilt:
    def find_spec(self, name, path=None, target=None):
        if name == "datadist._core":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NotBuilt())
"""


def _run_without_core(code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    return subprocess.run([sys.executable, "-c", _NO_CORE + code], capture_output=True,
                          text=True, timeout=100, env=env)


def test_datadist_imports_and_runs_without_the_core() -> None:
    done = _run_without_core("""
import datadist
import datadist.cli, datadist.core.native, datadist.api.llm_datadist
assert "datadist._core" not in sys.modules, "imported at import time"
from datadist.core.native_build import native_available
ok, why = native_available()
assert not ok and why.startswith("datadist._core is not built (pip install -e ."), why
sys.exit(datadist.cli.main(["info"]))
""")
    assert done.returncode == 0, done.stderr
    assert "native core: not available (datadist._core is not built" in done.stdout


def test_a_core_that_does_not_load_says_why() -> None:
    done = _run_without_core("""
class Broken:
    def find_spec(self, name, path=None, target=None):
        if name == "datadist._core":
            raise ImportError("undefined symbol: _ZN8datadist4Core")
        return None

sys.meta_path.insert(0, Broken())
from datadist.core.native_build import native_available
ok, why = native_available()
assert not ok, why
print(why)
""")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("datadist._core does not load: undefined symbol")
    assert "rebuild it" in done.stdout


_INIT = """
import datadist as llm
cfg = llm.LLMConfig()
cfg.device_id = 0
options = cfg.generate_options()
options.update(EXTRA)
dd = llm.LLMDataDist(llm.LLMRole.DECODER, 1)
try:
    dd.init(options)
except llm.LLMException as e:
    print(e.status_code.name, e)
else:
    print("INITIALIZED", type(dd.engine).__name__)
    dd.finalize()
"""


def test_without_the_core_init_is_feature_not_enabled_saying_why() -> None:
    """The core is the only engine: where it is not built, init fails at once, saying so
    (docs/native-build.md), instead of running anything else."""
    done = _run_without_core("EXTRA = {}\n" + _INIT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("LLM_FEATURE_NOT_ENABLED"), done.stdout
    assert "native core is not available" in done.stdout and "not built" in done.stdout

