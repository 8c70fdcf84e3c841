"""The opt-in ``llm_datadist`` package (compat/llm_datadist): unmodified client code, i.e. the
import lines of llm_datadist's own samples and of the real connectors, runs on datadist, every
module path is datadist's module itself, it says it is datadist, and it refuses to hide a
real llm_datadist.

Each case runs in a fresh interpreter whose path holds the package's source (or a copy pip
installed into a temporary --target): the test process has no ``llm_datadist`` to import.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
COMPAT = ROOT / "compat" / "llm_datadist"
SRC = ROOT / "src"

# hixl src/python/llm_datadist/llm_datadist/__init__.py imports these modules (and they import
# the rest): every path a client can import.
MODULE_PATHS = ["status", "configs", "data_type", "utils", "utils.log", "utils.utils", "v2",
                "v2.cache_manager", "v2.config", "v2.llm_datadist", "v2.llm_types",
                "v2.llm_utils"]


def _run(code: str, *path: Path | str, env: dict[str, str] | None = None
         ) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if k != "DATADIST_SHADOW_LLM_DATADIST"}
    full_env["PYTHONPATH"] = os.pathsep.join(str(p) for p in path)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=90, env=full_env, cwd=str(ROOT))


def _ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, result.stderr
    return result.stdout


# The import lines of real client code, unchanged: hixl examples/python/llm_datadist
# (pull_blocks sample and others), vllm-ascend llmdatadist_c_mgr_connector.py, MindIE-LLM
# separate_deployment_engine.py (``from llm_datadist.v2.llm_types import ...``).
CLIENT_IMPORTS = """
import llm_datadist
from llm_datadist import (LLMDataDist, LLMRole, LLMConfig, CacheDesc, DataType, BlocksCacheKey,
                          Placement, LLMClusterInfo, LLMStatusCode, LLMException,
                          RegisterMemStatus, CacheKey, CacheKeyByIdAndIndex, Cache,
                          LayerSynchronizer, TransferConfig, TransferWithCacheKeyConfig)
from llm_datadist.v2.llm_types import Cache, CacheDesc, BlocksCacheKey
from llm_datadist import KvCacheManager, Tensor, TensorDesc
import llm_datadist.v2.llm_types
"""


def test_client_import_lines_run_and_name_datadists_objects():
    # hixl llm_datadist/__init__.py: __all__, v2_list and the lazy v1 names.
    out = _ok(_run(CLIENT_IMPORTS + """
import datadist
assert llm_datadist.__datadist__ is True
assert llm_datadist.__version__ == datadist.__version__
assert list(llm_datadist.__all__) == list(datadist.__all__)
assert llm_datadist.v2_list == datadist.v2_list
for name in llm_datadist.__all__:
    assert getattr(llm_datadist, name) is getattr(datadist, name), name
assert Cache is datadist.Cache and BlocksCacheKey is datadist.BlocksCacheKey
assert KvCacheManager is datadist.KvCacheManager
ns = {}
exec("from llm_datadist import *", ns)
assert set(llm_datadist.__all__) <= set(ns)
try:
    llm_datadist.NoSuchThing
except AttributeError as e:
    assert "no attribute 'NoSuchThing'" in str(e)
else:
    raise SystemExit("no AttributeError")
print(llm_datadist.__file__)
""", COMPAT, SRC))
    assert out.strip() == str(COMPAT / "llm_datadist" / "__init__.py")


@pytest.mark.parametrize("path", MODULE_PATHS)
def test_every_module_path_is_datadists_module(path):
    # The module paths of hixl src/python/llm_datadist/llm_datadist/**.
    _ok(_run(f"""
import importlib, sys
import llm_datadist.{path}
import datadist.{path}
mine = sys.modules["llm_datadist.{path}"]
assert mine is sys.modules["datadist.{path}"]
assert importlib.import_module("llm_datadist.{path}") is mine
parent, _, leaf = "llm_datadist.{path}".rpartition(".")
assert getattr(sys.modules[parent], leaf) is mine
""", COMPAT, SRC))


def test_a_client_flow_runs_under_the_llm_datadist_name():
    # The cache-manager samples' opening (hixl examples/python/llm_datadist: LLMConfig ->
    # generate_options -> init -> register_blocks_cache), written against llm_datadist only.
    out = _ok(_run("""
import numpy as np
import llm_datadist
from llm_datadist import LLMDataDist, LLMRole, LLMConfig, CacheDesc, DataType, Placement
from llm_datadist.v2.llm_types import BlocksCacheKey

cfg = LLMConfig()
cfg.device_id = 0
cfg.enable_cache_manager = True
cfg.local_comm_res = ""
d = LLMDataDist(LLMRole.PROMPT, 7)
d.init(cfg.generate_options())
mem = np.zeros((2, 4 * 64), dtype=np.uint8)
desc = CacheDesc(2, [4, 64], DataType.DT_UINT8, Placement.HOST)
cache = d.cache_manager.register_blocks_cache(desc, [int(mem[i].ctypes.data) for i in range(2)],
                                             BlocksCacheKey(7, 0))
print(cache)
d.finalize()
""", COMPAT, SRC))
    assert out.strip() == "Cache(cache_id = 1, device_tensor_addrs = 2, is_blocks_cache = True)"


def _fake_real_llm_datadist(where: Path) -> Path:
    """A stand-in for CANN's llm_datadist: a package with a v2 subpackage that says so."""
    pkg = where / "llm_datadist"
    (pkg / "v2").mkdir(parents=True)
    (pkg / "__init__.py").write_text("REAL = True\n")
    (pkg / "v2" / "__init__.py").write_text("")
    return pkg


def test_refuses_to_hide_a_real_llm_datadist(tmp_path):
    real = _fake_real_llm_datadist(tmp_path / "cann")
    result = _run("import llm_datadist", COMPAT, SRC, tmp_path / "cann")
    assert result.returncode != 0
    assert "ImportError" in result.stderr and str(real) in result.stderr
    # Opting in loads datadist anyway.
    out = _ok(_run("import llm_datadist; print(llm_datadist.__datadist__)", COMPAT, SRC,
                   tmp_path / "cann", env={"DATADIST_SHADOW_LLM_DATADIST": "1"}))
    assert out.strip() == "True"
    # A real one earlier on the path is the one imported: the compatibility package is never
    # reached, and the real one has no __datadist__.
    out = _ok(_run("import llm_datadist; print(llm_datadist.REAL,"
                   " getattr(llm_datadist, '__datadist__', False))",
                   tmp_path / "cann", COMPAT, SRC))
    assert out.strip() == "True False"


def test_pip_installs_it(tmp_path):
    """``pip install ./compat/llm_datadist`` (here into a --target, offline, from a copy so the
    build leaves nothing in the repository) gives a package that works the same."""
    pytest.importorskip("setuptools")
    source = tmp_path / "source"
    shutil.copytree(COMPAT, source)
    target = tmp_path / "target"
    pip = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
         "--no-build-isolation", "--target", str(target), str(source)],
        capture_output=True, text=True, timeout=110)
    assert pip.returncode == 0, pip.stderr
    assert (target / "llm_datadist" / "__init__.py").is_file()
    assert list(target.glob("datadist_llm_datadist-*.dist-info"))
    out = _ok(_run(CLIENT_IMPORTS + """
import datadist
assert llm_datadist.__datadist__ and llm_datadist.v2.llm_types is datadist.v2.llm_types
print(llm_datadist.__file__)
""", target, SRC))
    assert out.strip() == str(target / "llm_datadist" / "__init__.py")
