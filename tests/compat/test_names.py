"""The module surface of ``llm_datadist`` (spec §2-§4, checklist §14.1): names, kinds, aliases,
enum values and ``str`` forms, and what importing the package does (and does not) pull in."""

from __future__ import annotations

import abc
import enum
import subprocess
import sys
import textwrap

import pytest

import datadist
import datadist as llm_datadist

pytestmark = pytest.mark.timeout(60)

# llm_datadist's __all__, in its order (spec §2).
SPEC_ALL = [
    "LLMClusterInfo", "LLMStatusCode", "LLMException", "LLMRole", "LlmConfig", "LLMConfig",
    "DataType", "Status", "CacheDesc", "CacheKey", "CacheKeyByIdAndIndex", "KvCache", "Cache",
    "BlocksCacheKey", "LLMDataDist", "Placement", "RegisterMemStatus", "LayerSynchronizer",
    "TransferConfig", "CacheTask", "TransferWithCacheKeyConfig", "Memtype", "MemInfo",
    "TensorDesc", "Tensor", "KvCacheManager",
]

INT_ENUMS = {"LLMStatusCode", "LLMRole", "Placement"}
PLAIN_ENUMS = {"DataType", "RegisterMemStatus", "Memtype"}
LAZY = {"TensorDesc", "Tensor", "KvCacheManager"}


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=30)


# ---------------------------------------------------------------------------------- names


def test_all_is_llm_datadists_all():
    assert list(llm_datadist.__all__) == SPEC_ALL


@pytest.mark.parametrize("name", SPEC_ALL)
def test_every_name_resolves_to_a_class(name):
    obj = getattr(llm_datadist, name)
    assert isinstance(obj, type), f"{name} is {obj!r}"
    assert obj.__name__ in (name, "LLMConfig")  # LlmConfig is the same class as LLMConfig


@pytest.mark.parametrize("name", sorted(INT_ENUMS))
def test_int_enums_are_int_enums(name):
    assert issubclass(getattr(llm_datadist, name), enum.IntEnum)


@pytest.mark.parametrize("name", sorted(PLAIN_ENUMS))
def test_plain_enums_are_enums(name):
    cls = getattr(llm_datadist, name)
    assert issubclass(cls, enum.Enum)
    assert not issubclass(cls, int)


@pytest.mark.parametrize("name", sorted(set(SPEC_ALL) - INT_ENUMS - PLAIN_ENUMS))
def test_other_names_are_not_enums(name):
    assert not issubclass(getattr(llm_datadist, name), enum.Enum)


def test_star_import_gives_every_name():
    ns: dict[str, object] = {}
    exec("from datadist import *", ns)
    assert set(SPEC_ALL) <= set(ns)
    assert ns["KvCacheManager"] is datadist.KvCacheManager


def test_llmconfig_is_llmconfig_alias():
    assert llm_datadist.LLMConfig is llm_datadist.LlmConfig


def test_memtype_keeps_its_spelling():
    assert hasattr(llm_datadist, "Memtype")
    assert not hasattr(llm_datadist, "MemType")
    assert [m.name for m in llm_datadist.Memtype] == ["MEM_TYPE_DEVICE", "MEM_TYPE_HOST"]


def test_llm_exception_is_a_runtime_error_with_a_status_code():
    assert issubclass(llm_datadist.LLMException, RuntimeError)
    e = llm_datadist.LLMException("boom", status_code=llm_datadist.LLMStatusCode.LLM_TIMEOUT)
    assert e.status_code is llm_datadist.LLMStatusCode.LLM_TIMEOUT
    assert str(e) == "boom"
    assert llm_datadist.LLMException("x").status_code is llm_datadist.LLMStatusCode.LLM_SUCCESS
    with pytest.raises(AttributeError):
        e.status_code = llm_datadist.LLMStatusCode.LLM_FAILED  # read-only


def test_status_wraps_a_code():
    ok = llm_datadist.Status(llm_datadist.LLMStatusCode.LLM_SUCCESS)
    assert ok.is_ok() and ok.status_code is llm_datadist.LLMStatusCode.LLM_SUCCESS
    bad = llm_datadist.Status(llm_datadist.LLMStatusCode.LLM_PARAM_INVALID)
    assert not bad.is_ok() and bad.status_code is llm_datadist.LLMStatusCode.LLM_PARAM_INVALID


def test_layer_synchronizer_is_abstract():
    assert issubclass(llm_datadist.LayerSynchronizer, abc.ABC)
    with pytest.raises(TypeError):
        llm_datadist.LayerSynchronizer()

    class Sync(llm_datadist.LayerSynchronizer):
        def synchronize_layer(self, layer_index, timeout_in_millis):
            return layer_index < 2

    assert Sync().synchronize_layer(1, None) is True


@pytest.mark.parametrize("prop", ["cache_manager", "kv_cache_manager", "cluster_id"])
def test_llmdatadist_accessors_are_properties(prop):
    assert isinstance(getattr(llm_datadist.LLMDataDist, prop), property)


# ---------------------------------------------------------------------------------- lazy names


@pytest.mark.parametrize("name", sorted(LAZY))
def test_lazy_v1_names_are_stable(name):
    assert getattr(datadist, name) is getattr(datadist, name)
    assert getattr(datadist, name).__name__ == name


def test_lazy_v1_names_load_on_first_use():
    r = _run("""
        import sys
        import datadist
        lazy = ("TensorDesc", "Tensor", "KvCacheManager")
        # Not bound at import: the module's __getattr__ supplies them on first use.
        assert not set(lazy) & set(vars(datadist)), "v1 names bound eagerly"
        assert "datadist.api.v1" not in sys.modules, "v1 loaded eagerly"
        assert callable(datadist.__getattr__)
        datadist.TensorDesc
        assert "datadist.api.v1" in sys.modules
    """)
    assert r.returncode == 0, r.stderr


def test_unknown_attribute_raises_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        datadist.NoSuchThing  # noqa: B018
    assert not hasattr(datadist, "KvCacheManagerV2")
    assert getattr(datadist, "NoSuchThing", 42) == 42


def test_tensor_desc_and_tensor_work():
    import numpy as np

    desc = datadist.TensorDesc(datadist.DataType.DT_FLOAT16, [2, 3])
    assert desc.dtype is datadist.DataType.DT_FLOAT16 and desc.shape == [2, 3]
    arr = np.arange(6, dtype=np.float16).reshape(2, 3)
    t = datadist.Tensor(arr)
    assert t.numpy() is arr
    # GE tensor.py Tensor.__str__: the data, then the desc (no public desc getter there).
    assert str(t).endswith(",tensor_desc=TensorDesc(dtype=DataType.DT_FLOAT16, shape=[2, 3]))")
    from_addr = datadist.Tensor(arr.ctypes.data, desc)
    np.testing.assert_array_equal(from_addr.numpy(copy=True), arr)
    with pytest.raises(TypeError):
        datadist.TensorDesc(1, [2])
    with pytest.raises(TypeError):
        datadist.Tensor("not data")


# ---------------------------------------------------------------------------------- imports


def test_import_does_not_import_torch(tmp_path):
    """A stand-in ``torch`` that leaves a mark when imported: importing datadist and running a
    host-only flow must never touch it (importing real torch costs about a second)."""
    fake = tmp_path / "torch"
    fake.mkdir()
    mark = tmp_path / "torch-was-imported"
    (fake / "__init__.py").write_text(f"open({str(mark)!r}, 'w').close()\n")
    r = _run(f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        import datadist
        from datadist import *
        assert "torch" not in sys.modules
        dd = datadist.LLMDataDist(datadist.LLMRole.DECODER, 7)
        dd.init({{"llm.EnableCacheManager": "1",
                 "llm.HostMemPoolConfig": '{{"memory_size": 1048576, "page_shift": 12}}'}})
        cm = dd.cache_manager
        desc = datadist.CacheDesc(2, [4, 8], datadist.DataType.DT_FLOAT16,
                                  datadist.Placement.HOST)
        cm.deallocate_cache(cm.allocate_cache(desc))
        dd.finalize()
        assert "torch" not in sys.modules
    """)
    assert r.returncode == 0, r.stderr
    assert not mark.exists()

