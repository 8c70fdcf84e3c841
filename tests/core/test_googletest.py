"""The C++ unit tests (GoogleTest, cpp/tests/*_test.cc), one pytest item per GoogleTest.

Who runs this: pytest, in the session's build of cpp/ (``cpp_build``, tests/conftest.py: built
once). The tests are read from the sources at collection (``TEST`` / ``TEST_F`` lines); each
item runs its one test (``--gtest_filter``), so a failure reruns nothing else and a
GoogleTest skip (``GTEST_SKIP``) is a pytest skip with its reason. ``test_every_googletest_is
_collected`` fails when a binary lists a test the sources did not show (a macro this file
does not read), so none runs unseen.

The NIXL tests (cpp/tests/nixl_test.cc) load NIXL's C API from ``DATADIST_NIXL_LIBRARY``: set
it to point them at a libnixl; unset, it is taken from the nixl-cu12 wheel where that is
installed, and without either they skip, saying so.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "cpp" / "tests"
# Binary per source (cpp/CMakeLists.txt): the codec against the golden frames has its own.
OWN_BINARY = {"wire_vectors_test.cc": "wire_vectors_test"}
DEFAULT_BINARY = "llm_datadist_tests"
_TEST = re.compile(r"^\s*TEST(?:_F)?\(\s*(\w+)\s*,\s*(\w+)\s*\)", re.M)
# Value-parameterized tests: TEST_P(Suite, Name) runs once per INSTANTIATE_TEST_SUITE_P(Prefix,
# Suite, ...) and value, as Prefix/Suite.Name/<value's name>; one item runs all its values.
_TEST_P = re.compile(r"^\s*TEST_P\(\s*(\w+)\s*,\s*(\w+)\s*\)", re.M)
_INSTANCES = re.compile(r"^\s*INSTANTIATE_TEST_SUITE_P\(\s*(\w+)\s*,\s*(\w+)\s*,", re.M)

# The first test of a session builds cpp/ (minutes on a busy machine).
pytestmark = pytest.mark.timeout(900)


def _declared() -> list[tuple[str, str]]:
    """(binary, Suite.Name) of every GoogleTest in cpp/tests, in source order."""
    found = []
    for src in sorted(TESTS.glob("*_test.cc")):
        binary = OWN_BINARY.get(src.name, DEFAULT_BINARY)
        text = src.read_text()
        found += [(binary, f"{suite}.{name}") for suite, name in _TEST.findall(text)]
        instances = _INSTANCES.findall(text)
        found += [(binary, f"{prefix}/{suite}.{name}/*") for suite, name in _TEST_P.findall(text)
                  for prefix, of in instances if of == suite]
    return found


DECLARED = _declared()


def _env() -> dict[str, str]:
    env = dict(os.environ)
    if "DATADIST_NIXL_LIBRARY" not in env:
        from datadist.core import nixl_wheel

        lib = nixl_wheel.library()
        if lib is not None:
            env["DATADIST_NIXL_LIBRARY"] = lib
    return env


def _binary(cpp_build: Path, name: str) -> Path:
    path = cpp_build / name
    if not path.exists():
        pytest.skip(f"{name} not built: GoogleTest not found when cpp/ was configured "
                    "(apt-get install libgtest-dev)")
    return path


def _skip_reason(out: str, test: str) -> str:
    """GoogleTest prints ``<file>:<line>: Skipped`` then the message, before ``[  SKIPPED ]``."""
    m = re.search(r": Skipped\n(.*?)\n\[  SKIPPED \]", out, re.S)
    return f"GoogleTest {test} skipped: " + (m.group(1).strip() if m else "(no reason given)")


@pytest.mark.parametrize(("binary", "test"), DECLARED, ids=[t for _, t in DECLARED])
def test_googletest(cpp_build: Path, binary: str, test: str) -> None:
    done = subprocess.run([str(_binary(cpp_build, binary)), f"--gtest_filter={test}",
                           "--gtest_color=no"],
                          capture_output=True, text=True, timeout=300, env=_env())
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-8000:]
    if f"[  SKIPPED ] {test}" in out:
        pytest.skip(_skip_reason(out, test))
    ran = f"[       OK ] {test[:-1]}" if test.endswith("/*") else f"[       OK ] {test}"
    assert ran in out, f"{test} did not run:\n{out[-4000:]}"


@pytest.mark.parametrize("binary", sorted({b for b, _ in DECLARED}))
def test_every_googletest_is_collected(cpp_build: Path, binary: str) -> None:
    """What the binary would run equals what the items above run."""
    done = subprocess.run([str(_binary(cpp_build, binary)), "--gtest_list_tests"],
                          capture_output=True, text=True, timeout=60, check=True)
    listed, suite = set(), ""
    for line in done.stdout.splitlines():
        if not line.startswith(" "):
            suite = line.split("#")[0].strip()
        else:
            listed.add(suite + line.split("#")[0].strip())
    declared = {t for b, t in DECLARED if b == binary}
    patterns = {t for t in declared if t.endswith("/*")}
    listed = {t for t in listed if not any(t.startswith(p[:-1]) for p in patterns)} | {
        p for p in patterns if any(t.startswith(p[:-1]) for t in listed)}
    assert listed == declared, (f"only in the binary: {sorted(listed - declared)}; "
                                f"only in the sources: {sorted(declared - listed)}")
