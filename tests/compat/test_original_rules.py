"""Rules of the original read from its source, one test each (issue 10, items 7-12).

hixl = GitHub hicann/hixl src/python/llm_datadist/llm_datadist/; GE = mirror-cann/ge
api/python/llm_datadist_v1/. Each test names the file and the definition its rule comes from.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

import datadist as llm
from datadist import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    KvCache,
    LLMConfig,
    LLMException,
    MemInfo,
    Memtype,
    Placement,
    TransferConfig,
    TransferWithCacheKeyConfig,
)
from datadist import LLMStatusCode as S

pytestmark = pytest.mark.timeout(60)


def param_invalid():
    return pytest.raises(LLMException, check=lambda e: e.status_code is S.LLM_PARAM_INVALID)


# ------------------------------------------------------------------ item 7: generate_options


def test_options_set_to_empty_strings_are_emitted():
    # hixl configs.py LlmConfig._add_connect_options: local_comm_res, transfer_backend and
    # global_resource_config are emitted once set ("is not None"), even to "".
    cfg = LLMConfig()
    cfg.transfer_backend = ""
    cfg.global_resource_config = ""
    cfg.local_comm_res = ""
    assert cfg.generate_options() == {"llm.LocalCommRes": "", "llm.TransferBackend": "",
                                      "llm.GlobalResourceConfig": "",
                                      "llm.MemoryUtilization": "0.95"}
    assert (cfg.transfer_backend, cfg.global_resource_config) == ("", "")


def test_options_left_unset_or_empty_where_the_original_tests_truth():
    # hixl configs.py LlmConfig.gen_options / _add_memory_options: listen_ip_info,
    # deploy_res_path, buf/mem/host pool configs and cluster_info are emitted only when
    # non-empty; unset backends are not emitted.
    cfg = LLMConfig()
    cfg.listen_ip_info = ""
    cfg.deploy_res_path = ""
    cfg.mem_pool_cfg = ""
    assert cfg.generate_options() == {"llm.MemoryUtilization": "0.95"}


def test_options_come_in_the_originals_order():
    # hixl configs.py LlmConfig.gen_options: ge_options, device id, sync timeout, deploy path,
    # memory options, connection options, cluster info, output size, switch role, memory
    # utilization.
    cfg = LLMConfig()
    cfg.enable_switch_role = True
    cfg.global_resource_config = "{}"
    cfg.listen_ip_info = "127.0.0.1:26000"
    cfg.enable_cache_manager = True
    cfg.sync_kv_timeout = 100
    cfg.device_id = 1
    cfg.ge_options = {"ge.x": "y"}
    cfg.output_max_size = 5
    assert list(cfg.generate_options()) == [
        "ge.x", "ge.exec.deviceId", "ge.session_device_id", "llm.SyncKvCacheWaitTime",
        "llm.EnableCacheManager", "llm.listenIpInfo", "llm.GlobalResourceConfig",
        "llm.OutputMaxSize", "llm.EnableSwitchRole", "llm.MemoryUtilization"]


# ------------------------------------------------------------------ item 8: key configs


def test_transfer_with_cache_key_config_checks_at_construction():
    # hixl v2/llm_types.py TransferWithCacheKeyConfig.__init__: both ranges required
    # (check_layer_range with allow_none=False: TypeError), equal lengths (PARAM_INVALID),
    # src_batch_index uint32, and 0 for a BlocksCacheKey.
    by_id = CacheKeyByIdAndIndex(2, 1)
    with pytest.raises(TypeError):
        TransferWithCacheKeyConfig(by_id)
    with pytest.raises(TypeError):
        TransferWithCacheKeyConfig(by_id, range(2))
    with pytest.raises(TypeError):
        TransferWithCacheKeyConfig(by_id, None, range(2))
    with param_invalid():
        TransferWithCacheKeyConfig(by_id, range(2), range(3))
    with pytest.raises(ValueError):
        TransferWithCacheKeyConfig(by_id, range(1), range(1), -1)
    with param_invalid():
        TransferWithCacheKeyConfig(BlocksCacheKey(2), range(1), range(1), 1)
    with pytest.raises(TypeError):
        TransferWithCacheKeyConfig(CacheKey(2, 1), range(1), range(1))
    cfg = TransferWithCacheKeyConfig(by_id, range(0, 2), range(3, 5), 4)
    assert (cfg.cache_key, cfg.src_layer_range, cfg.dst_layer_range, cfg.src_batch_index) == \
        (by_id, range(0, 2), range(3, 5), 4)
    assert cfg.dst_cluster_id == 2


def test_transfer_with_cache_key_config_properties_validate():
    # hixl v2/llm_types.py TransferWithCacheKeyConfig setters: cache_key by type, the ranges by
    # check_layer_range (None allowed there), src_batch_index uint32 and 0 for blocks.
    cfg = TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(2, 1), range(1), range(1))
    with pytest.raises(TypeError):
        cfg.cache_key = CacheKey(2, 1)
    with pytest.raises(TypeError):
        cfg.src_layer_range = (0, 1)
    with param_invalid():
        cfg.dst_layer_range = range(0, 4, 2)
    with pytest.raises(ValueError):
        cfg.src_batch_index = 2**32
    cfg.src_batch_index = 3
    cfg.dst_layer_range = range(2, 3)
    assert (cfg.src_batch_index, cfg.dst_layer_range) == (3, range(2, 3))
    cfg.cache_key = BlocksCacheKey(2)
    with param_invalid():
        cfg.src_batch_index = 1
    cfg.src_layer_range = None  # the setters allow None; transfer_cache_async checks again
    assert cfg.src_layer_range is None


# ------------------------------------------------------------------ item 9: smaller checks


def test_mem_utilization_is_a_float():
    # hixl configs.py LlmConfig.mem_utilization setter: check_isinstance(float), then [0, 1].
    cfg = LLMConfig()
    with pytest.raises(TypeError):
        cfg.mem_utilization = 1
    with pytest.raises(TypeError):
        cfg.mem_utilization = True
    with param_invalid():
        cfg.mem_utilization = 1.5
    cfg.mem_utilization = 1.0
    assert cfg.generate_options()["llm.MemoryUtilization"] == "1.0"


@pytest.fixture
def cm():
    d = llm.LLMDataDist(llm.LLMRole.PROMPT, 11)
    d.init({"llm.EnableCacheManager": "1"})
    try:
        yield d.cache_manager
    finally:
        d.finalize()


def test_register_takes_a_list_of_addresses(cm):
    # hixl v2/cache_manager.py CacheManager.register_cache / register_blocks_cache:
    # check_isinstance("addrs", addrs, list, int).
    mem = np.zeros((2, 64), dtype=np.uint8)
    addrs = [int(mem[i].ctypes.data) for i in range(2)]
    desc = CacheDesc(2, [4, 16], DataType.DT_UINT8, Placement.HOST)
    with pytest.raises(TypeError):
        cm.register_cache(desc, tuple(addrs))
    with pytest.raises(TypeError):
        cm.register_blocks_cache(desc, tuple(addrs))
    cache = cm.register_cache(desc, addrs)
    assert cache.tensor_addrs == addrs
    cm.unregister_cache(cache.cache_id)


def test_kv_cache_create_cpu_cache_checks():
    # hixl v2/llm_types.py KvCache.create_cpu_cache: placement HOST, a non-empty list, items
    # all ints or all lists, each list num_tensors long.
    host = CacheDesc(2, [4, 8], DataType.DT_FLOAT16, Placement.HOST)
    with param_invalid():
        KvCache.create_cpu_cache(CacheDesc(2, [4, 8], DataType.DT_FLOAT16), [4096, 8192])
    with param_invalid():
        KvCache.create_cpu_cache(host, [4096])
    with param_invalid():
        KvCache.create_cpu_cache(host, [])
    with param_invalid():
        KvCache.create_cpu_cache(host, [[4096, 8192], [4096]])
    with param_invalid():
        KvCache.create_cpu_cache(host, [[4096, 8192], 4096])
    with pytest.raises(TypeError):
        KvCache.create_cpu_cache(host, (4096, 8192))
    with pytest.raises(TypeError):
        KvCache.create_cpu_cache(host, [4096, "8192"])
    flat = KvCache.create_cpu_cache(host, [4096, 8192])
    assert (flat.cache_id, flat.per_device_tensor_addrs) == (-1, [[4096, 8192]])
    nested = KvCache.create_cpu_cache(host, [[4096, 8192], [12288, 16384]])
    assert nested.per_device_tensor_addrs == [[4096, 8192], [12288, 16384]]


def test_cache_create_cpu_cache_checks():
    # hixl v2/llm_types.py Cache.create_cpu_cache: a list of ints, placement HOST,
    # len(addrs) == num_tensors.
    host = CacheDesc(2, [4, 8], DataType.DT_FLOAT16, Placement.HOST)
    with pytest.raises(TypeError):
        Cache.create_cpu_cache(host, (4096, 8192))
    with param_invalid():
        Cache.create_cpu_cache(CacheDesc(2, [4, 8], DataType.DT_FLOAT16), [4096, 8192])
    with param_invalid():
        Cache.create_cpu_cache(host, [4096])
    c = Cache.create_cpu_cache(host, [4096, 8192])
    assert (c.cache_id, c.is_blocks_cache, c.tensor_addrs) == (-1, True, [4096, 8192])


# ------------------------------------------------------------------ item 11: str / repr


def test_value_type_texts():
    # hixl v2/llm_types.py: MemInfo.__str__, TransferConfig.__repr__ / __str__,
    # TransferWithCacheKeyConfig.__repr__, Cache.__str__, KvCache.__str__, CacheDesc.__repr__,
    # CacheKey.__repr__, BlocksCacheKey.__repr__, CacheKeyByIdAndIndex.__repr__.
    m = MemInfo(Memtype.MEM_TYPE_DEVICE, 4096, 64)
    assert str(m) == repr(m) == "MemInfo(mem_type=Memtype.MEM_TYPE_DEVICE, addr=4096, size=64)"
    t = TransferConfig(2, (8, 16), range(0, 1))
    assert str(t) == repr(t) == ("TransferConfig(dst_cluster_id=2, dst_addrs=(8, 16), "
                                 "src_layer_range=range(0, 1), src_batch_index=0)")
    k = TransferWithCacheKeyConfig(BlocksCacheKey(prompt_cluster_id=2, model_id=1), range(1),
                                   range(2, 3))
    assert str(k) == repr(k) == (
        "TransferWithCacheKeyConfig(cache_key=BlocksCacheKey(prompt_cluster_id=2, model_id=1),"
        " src_layer_range=range(0, 1), dst_layer_range=range(2, 3), src_batch_index=0)")
    desc = CacheDesc(2, (4, 8), DataType.DT_BF16, Placement.HOST, 0, 1, "BSND")
    assert repr(desc) == ("CacheDesc(num_tensors=2, shape=(4, 8), data_type=DataType.DT_BF16, "
                          "placement=Placement.HOST, batch_dim_index=0, seq_len_dim_index=1,"
                          "kv_tensor_format=BSND)")
    c = Cache.create_cpu_cache(desc, [4096, 8192])
    assert str(c) == repr(c) == \
        "Cache(cache_id = -1, device_tensor_addrs = 2, is_blocks_cache = True)"
    kv = KvCache.create_cpu_cache(desc, [[4096, 8192], [12288, 16384]])
    assert str(kv) == repr(kv) == "KvCache(cache_id = -1, num_devices = 2)"
    assert repr(CacheKey(1, 2, 3)) == \
        f"CacheKey(cluster_id=1, req_id=2, prefix_id={2**64 - 1}, model_id=3)"
    assert repr(BlocksCacheKey(5)) == "BlocksCacheKey(cluster_id=5, model_id=0)"
    assert repr(BlocksCacheKey(prompt_cluster_id=5)) == \
        "BlocksCacheKey(prompt_cluster_id=5, model_id=0)"
    assert repr(CacheKeyByIdAndIndex(1, 2, 3)) == \
        "CacheKeyByIdAndIndex(cluster_id=1, cache_id=2, batch_index=3)"


def test_cache_desc_keeps_the_callers_shape():
    # hixl v2/llm_types.py CacheDesc.__init__ stores shape as given; update_dim writes into it.
    shape = [4, 8]
    desc = CacheDesc(1, shape, DataType.DT_UINT8)
    assert desc.shape is shape
    desc.update_dim(0, 6)
    assert shape == [6, 8] and desc.size == 48
    with pytest.raises(TypeError):  # a tuple cannot be written into, there either
        CacheDesc(1, (4, 8), DataType.DT_UINT8).update_dim(0, 6)


def test_keys_compare_by_identity():
    # hixl v2/llm_types.py CacheKey defines no __eq__ / __hash__.
    a, b = CacheKey(1, 2), CacheKey(1, 2)
    assert a != b and a == a
    assert len({a, b}) == 2


# ------------------------------------------------------------------ item 12: missing methods


def test_kv_cache_manager_check_cache_key():
    # GE kv_cache_manager.py KvCacheManager.check_cache_key (a staticmethod): exactly one of
    # req_id and prefix_id valid, else PARAM_INVALID.
    from datadist import KvCacheManager

    KvCacheManager.check_cache_key(CacheKey(1, 2))
    KvCacheManager.check_cache_key(CacheKey(1, 2**64 - 1, 0, 3))
    with param_invalid():
        KvCacheManager.check_cache_key(CacheKey(1, 2**64 - 1))
    with param_invalid():
        KvCacheManager.check_cache_key(CacheKey(1, 2, 0, 3))


def test_tensor_from_tensor_tuple():
    # GE tensor.py Tensor.from_tensor_tuple((data, wrapper dtype, shape)); here data is an
    # address, as in Tensor(int, desc).
    from datadist import Tensor

    arr = np.arange(6, dtype=np.float16).reshape(2, 3)
    t = Tensor.from_tensor_tuple((int(arr.ctypes.data), DataType.DT_FLOAT16.value, [2, 3]))
    np.testing.assert_array_equal(t.numpy(), arr)
    ctypes.memset(arr.ctypes.data, 0, 2)
    assert t.numpy()[0, 0] == 0  # a view, not a copy
    assert str(t).endswith(",tensor_desc=TensorDesc(dtype=DataType.DT_FLOAT16, shape=[2, 3]))")
    with pytest.raises(ValueError):
        Tensor.from_tensor_tuple((int(arr.ctypes.data), 999, [2, 3]))


# ------------------------------------------------------------------ item 10: module contents


def test_status_helpers():
    # hixl status.py code_2_status, handle_llm_status, raise_if_false / raise_if_true.
    from datadist import status

    assert status.code_2_status(0x5010B005) is S.LLM_PARAM_INVALID
    assert status.code_2_status(12345) is S.LLM_FAILED
    status.handle_llm_status(0, "f", "x")
    with pytest.raises(LLMException, match=r"^\[f\] failed, error code is LLMStatusCode.LLM_"
                                           r"TIMEOUT, x\.$") as e:
        status.handle_llm_status(int(S.LLM_TIMEOUT), "[f]", "x")
    assert e.value.status_code is S.LLM_TIMEOUT
    with param_invalid():
        status.raise_if_false(False, "{0} {k}", 1, k=2)
    with pytest.raises(LLMException, check=lambda e: e.status_code is S.LLM_FAILED):
        status.raise_if_true(True, "x", status_code=S.LLM_FAILED)


def test_configs_and_data_type_helpers():
    # hixl configs.py trans_str_ip; hixl data_type.py tables and
    # get_python_dtype_from_wrapper_dtype.
    from datadist import configs, data_type

    assert configs.trans_str_ip("192.168.1.2") == 0x0201A8C0
    assert configs.trans_str_ip(7) == 7
    with pytest.raises(RuntimeError, match="Can not parse ip str"):
        configs.trans_str_ip("300.1.1.1")
    assert data_type.dtype_to_np_dtype[DataType.DT_BF16] is np.float16
    assert data_type.dtype_to_np_dtype[DataType.DT_STRING] is np.bytes_
    assert data_type.np_dtype_to_dtype[np.dtype(np.float16)] is DataType.DT_FLOAT16
    assert data_type.python_dtype_2_dwrapper_dtype[DataType.DT_BF16] == 27
    assert data_type.get_python_dtype_from_wrapper_dtype(9) is DataType.DT_INT64
    with pytest.raises(ValueError):
        data_type.get_python_dtype_from_wrapper_dtype(99)
    assert len(data_type.valid_np_dtypes) == 14


def test_utils_checks():
    # hixl utils/utils.py: TypeError for a type, ValueError for a range, None never allowed by
    # the integer checks, a list of classes and an inner class for check_isinstance.
    from datadist.utils import utils

    utils.check_isinstance("x", [1, 2], [list, tuple], int)
    utils.check_isinstance("x", None, [list])
    with pytest.raises(TypeError, match="^The first param x only support"):
        utils.check_isinstance("x", "a", [list, tuple], extra_fmt="The first param ")
    with pytest.raises(TypeError):
        utils.check_isinstance("x", [1, "a"], list, int)
    with pytest.raises(TypeError):
        utils.check_uint64("x", None)
    with pytest.raises(ValueError):
        utils.check_uint8("x", 256)
    with pytest.raises(TypeError):
        utils.check_dict("d", {1: "a"}, int, list)
    assert utils.check_positive_or_set_default("o", None) == -1
    with pytest.raises(ValueError):
        utils.check_positive_or_set_default("o", -2)


def test_llm_utils_helpers():
    # hixl v2/llm_utils.py clone_cache_desc, to_data_type, is_valid_id / is_invalid_id,
    # calc_tensor_size, parse_listen_ip_info, verify_cache_shape.
    from datadist.v2 import llm_utils

    desc = CacheDesc(2, [4, 8], DataType.DT_BF16, Placement.HOST, 0, 1, "ND")
    clone = llm_utils.clone_cache_desc(desc)
    assert repr(clone) == repr(desc) and clone.shape is not desc.shape
    assert llm_utils.to_data_type("27") is DataType.DT_BF16
    with param_invalid():
        llm_utils.to_data_type("x")
    assert llm_utils.is_invalid_id(2**64 - 1) and llm_utils.is_invalid_id(-1)
    assert llm_utils.is_valid_id(0)
    assert llm_utils.calc_tensor_size([2, 3], DataType.DT_FLOAT) == 24
    assert llm_utils.parse_listen_ip_info("10.0.0.1:26000") == ("10.0.0.1", 26000)
    with param_invalid():
        llm_utils.parse_listen_ip_info("10.0.0.1")
    with param_invalid():
        llm_utils.verify_cache_shape([4, 0])
    llm_utils.verify_cache_shape([4, -1])


def test_a_dropped_kv_cache_is_deallocated():
    # hixl v2/llm_types.py KvCache.__del__: a pool cache whose object goes away without
    # deallocate_cache is deallocated (while its manager is initialized). A client that
    # allocates a cache per step and drops the last one (vllm-ascend's V0 connector) must not
    # run the pool dry.
    import gc

    d = llm.LLMDataDist(llm.LLMRole.DECODER, 12)
    d.init({"ge.flowGraphMemMaxSize": str(1 << 20)})
    try:
        kv = d.kv_cache_manager
        desc = CacheDesc(2, [4, 32 * 1024], DataType.DT_UINT8)  # 2 x 128 KiB of a 1 MiB pool
        for _ in range(20):
            cache = kv.allocate_cache(desc)
            del cache
            gc.collect()
        kept = [kv.allocate_cache(desc) for _ in range(3)]
        with pytest.raises(LLMException):  # the pool is finite: kept caches stay allocated
            [kv.allocate_cache(desc) for _ in range(8)]
        kv.deallocate_cache(kept[0])  # deallocated explicitly: the finalizer is off
        del kept[0]
        assert len(kv._dropped) == 0
    finally:
        d.finalize()


def test_bf16_tensor_reads_as_float32():
    # GE tensor.py Tensor.numpy: DT_BF16 data comes back as float32 values (numpy has no
    # bfloat16), the bits shifted into the high half.
    from datadist import Tensor, TensorDesc

    values = np.array([1.5, -2.0, 0.15625], dtype=np.float32)
    bits = (values.view(np.uint32) >> 16).astype(np.uint16)
    t = Tensor(int(bits.ctypes.data), TensorDesc(DataType.DT_BF16, [3]))
    out = t.numpy()
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, values)


def test_cache_desc_rules():
    # hixl v2/llm_types.py CacheDesc.__init__: batch_dim_index is type-checked only, then
    # range-checked (PARAM_INVALID); CacheDesc.size fails (LLMException) for a dynamic dim.
    with param_invalid():
        CacheDesc(1, [4, 8], DataType.DT_UINT8, Placement.HOST, 2**40)
    with pytest.raises(TypeError):
        CacheDesc(1, [4, 8], DataType.DT_UINT8, Placement.HOST, 0.0)
    with pytest.raises(LLMException, match="Failed to calc tensor size"):
        _ = CacheDesc(1, [4, -1], DataType.DT_UINT8).size


def test_cache_task_timeout_is_uint32():
    # hixl v2/llm_types.py CacheTask.synchronize / get_results: check_uint32(timeout_in_millis).
    from datadist.api.tasks import CacheTask

    task = CacheTask(1)
    with pytest.raises(ValueError):
        task.synchronize(-1)
    with pytest.raises(TypeError):
        task.get_results(1.5)
    assert task.synchronize(0) is S.LLM_TIMEOUT  # not finished: the default error


# configs.py, LlmConfig: the string and bool setters run utils.utils.check_isinstance, whose
# allow_none defaults to True, so None is accepted and leaves the option unset (gen_options
# skips a falsy or None value); the numeric setters compare the value and fail on None.
@pytest.mark.parametrize("name", [
    "listen_ip_info", "local_comm_res", "transfer_backend", "global_resource_config",
    "deploy_res_path", "enable_cache_manager", "enable_remote_cache_accessible",
    "enable_switch_role", "mem_pool_cfg", "host_mem_pool_cfg", "buf_pool_cfg",
    "output_max_size"])
def test_config_setters_take_none_as_unset(name):
    cfg = llm.LLMConfig()
    setattr(cfg, name, None)
    opts = cfg.generate_options()
    assert opts == {"llm.MemoryUtilization": "0.95"}, opts


@pytest.mark.parametrize("name", ["sync_kv_timeout", "mem_utilization", "link_total_time",
                                  "link_retry_count", "device_id", "cluster_info"])
def test_numeric_config_setters_refuse_none(name):
    with pytest.raises(TypeError):
        setattr(llm.LLMConfig(), name, None)
