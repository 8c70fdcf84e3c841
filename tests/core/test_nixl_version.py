"""NIXL's version checked at load (cpp/src/nixl.h, Load): the core refuses, saying why, a NIXL
release outside the range whose C API it was written against, before calling any of it.

No NIXL is needed: a stand-in library (any shared object: it is never called) is laid out as
the nixl-cu12 wheel lays out libnixl_capi.so, beside a dist-info naming the version. Each case
runs in a process of its own (the core loads NIXL once per process).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from datadist.core import native

pytestmark = pytest.mark.skipif(not native.available()[0], reason="the C++ core is not built here")

_LOAD = """
import json, sys
from datadist.core import native
ok, why = native.core_module().nixl_load(sys.argv[1])
print(json.dumps([bool(ok), str(why)]))
"""


def _shared_object() -> str:
    """A shared library this interpreter has loaded (libm or libc), to stand in for NIXL."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.split()[-1]
        if "/libm.so" in path or "/libc.so" in path:
            return path
    pytest.skip("no libm / libc mapped to copy")


def _wheel(site: Path, version: str | None) -> Path:
    libs = site / ".nixl_cu12.mesonpy.libs"
    libs.mkdir(parents=True)
    lib = libs / "libnixl_capi.so"
    shutil.copy(_shared_object(), lib)
    if version is not None:
        dist = site / f"nixl_cu12-{version}.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text(
            f"Metadata-Version: 2.4\nName: nixl-cu12\nVersion: {version}\n")
    return lib


def _load(lib: Path, **env: str) -> tuple[bool, str]:
    environ = {k: v for k, v in os.environ.items() if k != "DATADIST_NIXL_VERSION"}
    done = subprocess.run([sys.executable, "-c", _LOAD, str(lib)], capture_output=True, text=True,
                          timeout=60, env={**environ, **env})
    assert done.returncode == 0, done.stderr
    ok, why = json.loads(done.stdout.strip().splitlines()[-1])
    return ok, why


@pytest.mark.parametrize("version", ["1.4.1", "1.6.0", "2.0.0", "0.10.1"])
def test_a_release_outside_the_range_is_refused_saying_which_are_taken(tmp_path: Path,
                                                                        version: str) -> None:
    ok, why = _load(_wheel(tmp_path, version))
    assert not ok
    assert f"NIXL {version} is outside" in why and ">= 1.5.0, < 1.6.0" in why, why
    assert "lacks" not in why  # refused before any function was looked up


def test_a_release_in_the_range_goes_on_to_the_functions(tmp_path: Path) -> None:
    """1.5.1 passes the version check; the stand-in then lacks NIXL's functions (the check
    that follows), which a real 1.5.1 has."""
    ok, why = _load(_wheel(tmp_path, "1.5.1"))
    assert not ok and "lacks nixl_capi_" in why, why


def test_without_a_wheel_the_version_must_be_stated(tmp_path: Path) -> None:
    lib = _wheel(tmp_path, None)
    ok, why = _load(lib)
    assert not ok and "cannot tell the version" in why and "DATADIST_NIXL_VERSION" in why, why
    ok, why = _load(lib, DATADIST_NIXL_VERSION="1.4.0")
    assert not ok and "NIXL 1.4.0 is outside" in why, why
    ok, why = _load(lib, DATADIST_NIXL_VERSION="1.5.1")
    assert not ok and "lacks nixl_capi_" in why, why


def test_a_refused_release_is_never_loaded(tmp_path: Path) -> None:
    """The version is read before the library is: a file that is no shared object at all is
    refused for its version, not for failing to load (nothing of it ran)."""
    lib = _wheel(tmp_path, "1.4.1")
    lib.write_bytes(b"")
    ok, why = _load(lib)
    assert not ok and "NIXL 1.4.1 is outside" in why, why
    (tmp_path / "nixl_cu12-1.4.1.dist-info" / "METADATA").write_text("Version: 1.5.1\n")
    ok, why = _load(lib)
    assert not ok and "cannot load NIXL's C API" in why, why
