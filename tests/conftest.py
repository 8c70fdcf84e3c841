"""Shared pytest setup: what more than one subject folder uses (tests/README.md).

Subject folders keep their own fixtures in their own conftest.py. Here: ``cpp_build``, the
session's one build of cpp/, used by the GoogleTests (core/), the cross-language tests
(interop/), the codec differential (protocol/) and the C++ bench rows (project/).

Loading this file puts tests/ on ``sys.path`` (pytest's prepend import mode), so a subject
folder's conftest can import another's fixtures by package (``from api.conftest import ...``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CPP = ROOT / "cpp"


def _build_dir() -> Path:
    san = os.environ.get("DATADIST_CPP_SANITIZE", "")
    base = Path(os.environ.get("DATADIST_CPP_BUILD_DIR", ROOT / "build" / "cpp"))
    return base.with_name(base.name + "-" + san.replace(",", "-")) if san else base


@pytest.fixture(scope="session")
def cpp_build(request: pytest.FixtureRequest) -> Path:
    """Configure and build cpp/ once per session; returns the build directory.

    Into ``build/cpp`` (or ``$DATADIST_CPP_BUILD_DIR``), warnings as errors; with
    ``DATADIST_CPP_SANITIZE`` set (``address,undefined`` or ``thread``) with those sanitizers,
    into their own directory. Skips, saying why, without cmake or a C++ compiler. Says on the
    terminal when the build starts and ends (it takes minutes the first time)."""
    missing = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"C++ tests need {' and '.join(missing)} (not found on PATH)")
    build = _build_dir()
    san = os.environ.get("DATADIST_CPP_SANITIZE", "")
    configure = ["cmake", "-S", str(CPP), "-B", str(build), "-DDATADIST_WERROR=ON",
                 f"-DDATADIST_SANITIZE={san}", "-DCMAKE_BUILD_TYPE=RelWithDebInfo"]
    jobs = str(min(4, os.cpu_count() or 1))
    started = time.monotonic()
    _tell(request.config, f"building the C++ library and its tests in {build} (cmake, "
          f"-j{jobs}; the first build takes a minute or two, later ones only what changed) ...")
    for cmd in (configure, ["cmake", "--build", str(build), "-j", jobs]):
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        except subprocess.TimeoutExpired:
            _tell(request.config, f"C++ build stopped: not done within 900 s ({' '.join(cmd)})")
            raise
        if done.returncode:
            _tell(request.config, f"C++ build failed after {time.monotonic() - started:.0f} s")
            pytest.fail(f"{' '.join(cmd)} failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
    _tell(request.config, f"C++ build done in {time.monotonic() - started:.0f} s")
    return build


def _tell(config: pytest.Config, line: str) -> None:
    """One line on the terminal now, even under pytest's output capture (without -s): the
    first C++ test waits for the build, silently otherwise. Who calls: ``cpp_build``. Output
    capture is suspended for the write (pytest's capture manager), which goes through the
    terminal reporter (or the real stderr when there is none, e.g. under -p no:terminal)."""
    text = f"[datadist tests] {time.strftime('%H:%M:%S')} {line}"
    capman = config.pluginmanager.getplugin("capturemanager")
    reporter = config.pluginmanager.getplugin("terminalreporter")
    with capman.global_and_fixture_disabled() if capman else contextlib.nullcontext():
        if reporter is not None:
            reporter.write_line("")
            reporter.write_line(text)
        elif sys.__stderr__ is not None:
            sys.__stderr__.write(text + "\n")
            sys.__stderr__.flush()
