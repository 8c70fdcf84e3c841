"""The C++ unit tests (GoogleTest, cpp/tests/*_test.cc), run by ctest in the session's build."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

# The first test of a session builds cpp/ (tens of seconds on a busy machine).
pytestmark = pytest.mark.timeout(600)


def test_ctest_passes(cpp_build: Path) -> None:
    if not (cpp_build / "llm_datadist_tests").exists():
        pytest.skip("GoogleTest not found when cpp/ was configured (apt-get install libgtest-dev)")
    # The NIXL tests (cpp/tests/nixl_test.cc) load the nixl-cu12 wheel's C API where it is here.
    from datadist.core import nixl_wheel

    env = dict(os.environ)
    lib = nixl_wheel.library()
    if lib is not None:
        env.setdefault("DATADIST_NIXL_LIBRARY", lib)
    done = subprocess.run(["ctest", "--output-on-failure", "--timeout", "300"], cwd=cpp_build,
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
