"""Shared pytest setup: what more than one subject folder uses (tests/README.md).

Subject folders keep their own fixtures in their own conftest.py. Here: ``cpp_build``, the
session's one build of cpp/, used by the GoogleTests (core/), the cross-language tests
(interop/), the codec differential (protocol/) and the C++ bench rows (project/).

Loading this file puts tests/ on ``sys.path`` (pytest's prepend import mode), so a subject
folder's conftest can import another's fixtures by package (``from api.conftest import ...``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CPP = ROOT / "cpp"


def _build_dir() -> Path:
    san = os.environ.get("DATADIST_CPP_SANITIZE", "")
    base = Path(os.environ.get("DATADIST_CPP_BUILD_DIR", ROOT / "build" / "cpp"))
    return base.with_name(base.name + "-" + san.replace(",", "-")) if san else base


@pytest.fixture(scope="session")
def cpp_build() -> Path:
    """Configure and build cpp/ once per session; returns the build directory.

    Into ``build/cpp`` (or ``$DATADIST_CPP_BUILD_DIR``), warnings as errors; with
    ``DATADIST_CPP_SANITIZE`` set (``address,undefined`` or ``thread``) with those sanitizers,
    into their own directory. Skips, saying why, without cmake or a C++ compiler."""
    missing = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"C++ tests need {' and '.join(missing)} (not found on PATH)")
    build = _build_dir()
    san = os.environ.get("DATADIST_CPP_SANITIZE", "")
    configure = ["cmake", "-S", str(CPP), "-B", str(build), "-DDATADIST_WERROR=ON",
                 f"-DDATADIST_SANITIZE={san}", "-DCMAKE_BUILD_TYPE=RelWithDebInfo"]
    jobs = str(min(4, os.cpu_count() or 1))
    for cmd in (configure, ["cmake", "--build", str(build), "-j", jobs]):
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if done.returncode:
            pytest.fail(f"{' '.join(cmd)} failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
    return build
