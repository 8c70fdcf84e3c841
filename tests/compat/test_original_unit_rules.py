"""Rules of the original that its own unit tests read (issue 22, items 3-6 and 10).

hixl = GitHub hicann/hixl; the Python layer is src/python/llm_datadist/llm_datadist/. Each test
names the file and the definition its rule comes from. Messages: the original's text starts
the message (datadist may add its own detail after it).
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import datadist as llm
from datadist import BlocksCacheKey, CacheDesc, CacheKey, DataType, LLMConfig, LLMException
from datadist import LLMStatusCode as S

pytestmark = pytest.mark.timeout(60)


def param_invalid(starts: str):
    """LLMException(LLM_PARAM_INVALID) whose message begins with the original's text."""
    return pytest.raises(
        LLMException,
        check=lambda e: e.status_code is S.LLM_PARAM_INVALID and str(e).startswith(starts))


@pytest.fixture
def fresh():
    """An LLMDataDist not yet initialized; finalized afterwards whatever happened."""
    made = []

    def make(role=llm.LLMRole.PROMPT, cluster_id=31):
        d = llm.LLMDataDist(role, cluster_id)
        made.append(d)
        return d

    yield make
    for d in made:
        d.finalize()


def cm_config() -> LLMConfig:
    c = LLMConfig()
    c.enable_cache_manager = True
    return c


# ------------------------------------------------------------------ item 10: update_dim


def test_update_dim_keeps_batch_size():
    # hixl v2/llm_types.py CacheDesc.__init__ reads _batch_size = shape[batch_dim_index]
    # once; update_dim sets the shape and resets _size only.
    desc = CacheDesc(2, [4, 8], DataType.DT_UINT8)
    desc.update_dim(0, 6)
    assert desc.shape == [6, 8] and desc.size == 48
    assert desc.batch_size == 4
    other = CacheDesc(1, [3, 5], DataType.DT_FLOAT16, batch_dim_index=1)
    other.update_dim(1, 9)
    assert other.batch_size == 5


# ------------------------------------------------------------------ item 4: flowGraphMemMaxSize


def test_flow_graph_max_size_must_be_a_str(fresh):
    # hixl v2/llm_datadist.py LLMDataDist._check_flow_graph_max_size: check_isinstance(str);
    # the original's test_flow_graph_max_size_non_str passes the int 123.
    options = cm_config().generate_options()
    options["ge.flowGraphMemMaxSize"] = 123
    d = fresh()
    with pytest.raises(TypeError):
        d.init(options)
    with pytest.raises(RuntimeError):  # nothing was started
        _ = d.cache_manager


def test_flow_graph_max_size_one_pool_of_digits(fresh):
    # ... then one pool ("1024,2048" refused) of digits, each LLM_PARAM_INVALID.
    d = fresh()
    for value, text in (("1024,2048",
                         "ge.flowGraphMemMaxSize only support one mem pool in llm datadist"),
                        ("12a", "ge.flowGraphMemMaxSize must be digit, config value=12a")):
        options = cm_config().generate_options()
        options["ge.flowGraphMemMaxSize"] = value
        with param_invalid(text):
            d.init(options)
    options = cm_config().generate_options()
    options["ge.flowGraphMemMaxSize"] = "1024"
    d.init(options)


# ------------------------------------------------------------------ item 5: GlobalResourceConfig


def hixl_config(global_resource_config: str) -> dict[str, str]:
    c = cm_config()
    c.transfer_backend = "hixl"
    c.listen_ip_info = "127.0.0.1:0"
    c.global_resource_config = global_resource_config
    return c.generate_options()


@pytest.mark.parametrize("value", ["not json", "{", "[1, 2]", '"text"', "12", "NaN"])
def test_global_resource_config_must_be_a_json_object(fresh, value):
    # hixl src/hixl/engine/hixl_options.cc HixlOptions::ParseGlobalResourceConfig: with the
    # HIXL backend, a non-empty value that does not parse, or is not an object, fails init.
    d = fresh()
    with pytest.raises(LLMException, check=lambda e: e.status_code is S.LLM_PARAM_INVALID):
        d.init(hixl_config(value))


@pytest.mark.parametrize("value", ["", '{"connect_pool.thread_num": "4"}'])
def test_global_resource_config_empty_or_an_object(fresh, value):
    d = fresh()
    d.init(hixl_config(value))
    assert d.cache_manager is not None


def test_global_resource_config_is_not_read_without_hixl(fresh):
    # Only the HIXL engine parses it (the default engine ignores the option).
    options = cm_config().generate_options()
    options["llm.GlobalResourceConfig"] = "not json"
    fresh().init(options)


# ------------------------------------------------------------------ item 6: the original's texts


def test_cache_key_texts():
    # hixl v2/llm_types.py CacheKey.__init__ / BlocksCacheKey.__init__ (raise_if_false).
    with param_invalid("Param req_id is required"):
        CacheKey(1)
    with param_invalid("Param prompt_cluster_id or cluster_id is required"):
        CacheKey(req_id=1)
    with param_invalid("Param prompt_cluster_id or cluster_id is required"):
        BlocksCacheKey(model_id=1)
    with param_invalid("Param num is over limit"):
        BlocksCacheKey(1, 2, 3)
    with param_invalid("Param num is over limit"):
        CacheKey(1, 2, 3, 4, 5)
    with param_invalid("Unsupported param:foo"):
        CacheKey(1, 2, foo=3)
    with param_invalid("Unsupported param:foo"):
        BlocksCacheKey(1, foo=3)


def test_transfer_backend_texts(fresh):
    # hixl v2/llm_datadist.py LLMDataDist._setup_engine_option: the original's tests assert
    # "EnableCacheManager" / "listenIpInfo" in the message.
    c = LLMConfig()
    c.transfer_backend = "hixl"
    c.listen_ip_info = "127.0.0.1:0"
    with param_invalid("llm.TransferBackend is not supported when llm.EnableCacheManager "
                       "is not configured."):
        fresh().init(c.generate_options())
    c = cm_config()
    c.transfer_backend = "hixl"
    c.enable_remote_cache_accessible = False
    c.listen_ip_info = "127.0.0.1:0"
    with param_invalid("llm.TransferBackend is not supported when "
                       "llm.EnableRemoteCacheAccessible is not enable."):
        fresh().init(c.generate_options())
    c = cm_config()
    c.transfer_backend = "hixl"
    c.enable_remote_cache_accessible = True
    with param_invalid("llm.TransferBackend is not supported when llm.listenIpInfo is not "
                       "configured."):
        fresh().init(c.generate_options())


def test_local_comm_res_without_cache_manager_text(fresh):
    # _setup_engine_option: _check_is_cache_mgr_mode("llm.LocalCommRes") when
    # llm.EnableCacheManager is given as "0".
    with param_invalid("llm.LocalCommRes is not supported when llm.EnableCacheManager is not "
                       "configured."):
        fresh().init({"llm.LocalCommRes": "", "llm.EnableCacheManager": "0"})


def test_mode_texts(fresh):
    # hixl v2/llm_datadist.py _check_is_cache_mgr_mode / _check_is_not_cache_mgr_mode.
    cm = fresh(cluster_id=32)
    cm.init(cm_config().generate_options())
    with param_invalid("kv_cache_manager is not supported when llm.EnableCacheManager is "
                       "configured."):
        _ = cm.kv_cache_manager
    with param_invalid("check_link_status is not supported when llm.EnableCacheManager is "
                       "configured."):
        cm.check_link_status(1)
    cm.finalize()
    v1 = fresh(role=llm.LLMRole.DECODER, cluster_id=33)
    v1.init({})
    for what, call in (("cache_manager", lambda: v1.cache_manager),
                       ("link", lambda: v1.link("c", {33: 0, 1: 1}, "{}")),
                       ("unlink", lambda: v1.unlink(1)),
                       ("query_register_mem_status", lambda: v1.query_register_mem_status(1))):
        with param_invalid(f"{what} is not supported when llm.EnableCacheManager is not "
                           "configured."):
            call()


def test_link_clusters_texts(fresh):
    # hixl v2/llm_datadist.py link_clusters: local ip info needed without local_comm_res
    # (the original's test asserts "local_ip_info_list is empty"); timeout > 0.
    d = fresh(cluster_id=34)
    d.init(cm_config().generate_options())
    cluster = llm.LLMClusterInfo()
    cluster.remote_cluster_id = 1
    cluster.append_remote_ip_info("127.0.0.1", 1)
    with param_invalid("local_ip_info_list is empty. Call append_local_ip_info to add "
                       "local_ip_info when local_comm_res option is unspecified or empty."):
        d.link_clusters([cluster], 1000)
    for call in (d.link_clusters, d.unlink_clusters):
        with param_invalid("Param timeout should be greater than 0."):
            call([cluster], 0)


def test_link_texts(fresh):
    # hixl v2/llm_datadist.py LLMDataDist.link: its checks, in its order.
    d = fresh(cluster_id=35)
    d.init(cm_config().generate_options())
    for args, text in (
        (("", {35: 0, 1: 1}, "{}"), "comm_name can not be empty"),
        (("x" * 128, {35: 0, 1: 1}, "{}"), "comm_name length should be smaller than 128."),
        (("c", {35: 0, 1: 1, 2: 2, 3: 3, 4: 4}, "{}"),
         "cluster_rank_info size can not be greater than 4."),
        (("c", {35: 0}, "{}"), "cluster num must be bigger than 1."),
        (("c", {35: 1, 1: 0}, "{}"), "rank in cluster_rank_info must be ordered"),
    ):
        with param_invalid(text):
            d.link(*args)


def test_switch_role_texts(fresh):
    # hixl v2/llm_datadist.py switch_role without cache-manager mode.
    d = fresh(role=llm.LLMRole.DECODER, cluster_id=36)
    d.init({"llm.EnableSwitchRole": "1"})
    with param_invalid("role not changed, role = DECODER"):
        d.switch_role(llm.LLMRole.DECODER)
    with param_invalid('Failed to switch to Prompt, option "llm.listenIpInfo" must be '
                       'specified'):
        d.switch_role(llm.LLMRole.PROMPT, {})


# ------------------------------------------------------------------ item 3: pull geometry


def test_layer_ranged_pull_into_a_cache_not_of_whole_layers(fresh):
    # hixl src/llm_datadist/cache_mgr/data_cache_engine.cc DataCacheEngine::CheckTensorIndices:
    # with a layer range, the destination's tensor count must be a multiple of
    # tensor_num_per_layer (LLM_PARAM_INVALID), checked before any link is looked up.
    d = fresh(cluster_id=37)
    d.init(cm_config().generate_options())
    mem = np.zeros((3, 4, 16), dtype=np.uint8)
    desc = CacheDesc(3, [4, 16], DataType.DT_UINT8, llm.Placement.HOST)
    cache = d.cache_manager.register_blocks_cache(desc, [int(m.ctypes.data) for m in mem],
                                                   BlocksCacheKey(37, 0))
    with pytest.raises(LLMException, check=lambda e: e.status_code is S.LLM_PARAM_INVALID):
        d.cache_manager.pull_blocks(BlocksCacheKey(1, 0), cache, [0], [0],
                                    src_layer_range=range(0, 1), dst_layer_range=range(0, 1))
    # without a range the rule does not apply: the pull goes as far as the link
    with pytest.raises(LLMException, check=lambda e: e.status_code is S.LLM_NOT_YET_LINK):
        d.cache_manager.pull_blocks(BlocksCacheKey(1, 0), cache, [0], [0])


def test_value_type_check_texts():
    # hixl v2/llm_types.py: CacheDesc.__init__, check_layer_range, TransferWithCacheKeyConfig
    # (its spelling "shoulde" included).
    with param_invalid("seq_len_dim_index 3 is invalid, should be -1 or in range [0, 2)"):
        CacheDesc(1, [4, 8], DataType.DT_UINT8, seq_len_dim_index=3)
    with param_invalid("batch_dim_index 2 out of range, [0, 2)"):
        CacheDesc(1, [4, 8], DataType.DT_UINT8, batch_dim_index=2)
    key = BlocksCacheKey(1, 0)
    with param_invalid("check src_layer_range.step == 1 failed"):
        llm.TransferWithCacheKeyConfig(key, range(0, 4, 2), range(0, 2))
    with param_invalid("check 0 <= range.start < range.stop failed, dst_layer_range = "
                       "range(2, 2)"):
        llm.TransferWithCacheKeyConfig(key, range(0, 1), range(2, 2))
    with param_invalid("src_layer_range size shoulde be equal to dst_layer_range size"):
        llm.TransferWithCacheKeyConfig(key, range(0, 1), range(0, 2))
    with param_invalid("src_batch_index shoulde be 0 when cache_key is BlocksCacheKey."):
        llm.TransferWithCacheKeyConfig(key, range(0, 1), range(0, 1), 1)


def test_cache_manager_texts(fresh):
    # hixl v2/cache_manager.py: its raise_if_false / raise_if_true texts.
    d = fresh(cluster_id=38)
    d.init(cm_config().generate_options())
    cm = d.cache_manager
    desc = CacheDesc(2, [4, 16], DataType.DT_UINT8, llm.Placement.HOST)
    mem = np.zeros((2, 64), dtype=np.uint8)
    addrs = [int(m.ctypes.data) for m in mem]
    with param_invalid("addrs can not be empty."):
        cm.register_cache(desc, [])
    with param_invalid("addrs length should be equal to num_tensors."):
        cm.register_cache(desc, addrs[:1])
    with param_invalid("addr can not be zero."):
        cm.register_cache(desc, [addrs[0], 0])
    contiguous = cm.register_cache(desc, addrs)
    blocks_mem = np.zeros((2, 64), dtype=np.uint8)
    blocks = cm.register_blocks_cache(desc, [int(m.ctypes.data) for m in blocks_mem])
    key = llm.CacheKeyByIdAndIndex(1, 1)
    with param_invalid("param check failed, cache can not be blocks cache."):
        cm.pull_cache(key, blocks)
    with param_invalid("[pull_cache] param check failed, size (0) is invalid, should be = -1 "
                       "or > 0"):
        cm.pull_cache(key, contiguous, size=0)
    with param_invalid("param check failed, dst_cache should be blocks cache."):
        cm.pull_blocks(BlocksCacheKey(1, 0), contiguous, [0], [0])
    with param_invalid("dst_blocks can not be empty."):
        cm.pull_blocks(BlocksCacheKey(1, 0), blocks, [0], [])
    with param_invalid("src_blocks can not be empty."):
        cm.pull_blocks(BlocksCacheKey(1, 0), blocks, [], [0])
    with param_invalid("src_blocks should be empty when src_cache_key is not instance of "
                       "BlocksCacheKey."):
        cm.pull_blocks(key, blocks, [0], [0])
    with param_invalid("push_cache is only supported while enable_remote_cache_accessible "
                       "is True"):
        cm.push_cache(key, contiguous)
    with param_invalid("param check failed, cache can not be blocks cache."):
        cm.deallocate_cache(blocks)
    with param_invalid("param check failed, cache should be blocks cache."):
        cm.deallocate_blocks_cache(contiguous)
    with param_invalid("check mem_info.addr failed, addr can not be zero, index=0."):
        cm.remap_registered_memory(llm.MemInfo(llm.Memtype.MEM_TYPE_DEVICE, 0, 1))


def test_llm_config_texts():
    # hixl configs.py LlmConfig setters: their raise_if_false texts.
    c = LLMConfig()
    with param_invalid("device_id should be greater than or equal to zero."):
        c.device_id = -1
    with param_invalid("device_id should be greater than or equal to zero."):
        c.device_id = [0, -2]
    with param_invalid("sync_kv_timeout must be digit."):
        c.sync_kv_timeout = "1s"
    with param_invalid("sync_kv_timeout should be greater than zero."):
        c.sync_kv_timeout = 0
    with param_invalid("link_total_time should be an integer between [0, 2^32-1], given value "
                       "is -1"):
        c.link_total_time = -1
    with param_invalid("link_retry_count should be an integer between [1, 100], given value "
                       "is 101"):
        c.link_retry_count = 101
    with param_invalid("mem_utilization must be in range [0,1], current:1.5"):
        c.mem_utilization = 1.5


def test_int_range_texts():
    # hixl utils/utils.py check_uint64 / check_int64 / check_int32 / check_uint32: ValueError
    # "<name>'s value is out of range,<value> is not a <kind> value."
    for call, text in (
        (lambda: CacheKey(-1, 1), "cluster_id's value is out of range,-1 is not a uint64 value."),
        (lambda: llm.CacheKeyByIdAndIndex(1, 2**63),
         f"cache_id's value is out of range,{2**63} is not a int64 value."),
        (lambda: llm.CacheKeyByIdAndIndex(1, 1, -1),
         "batch_index's value is out of range,-1 is not a uint32 value."),
        (lambda: CacheDesc(1, [4], DataType.DT_UINT8, seq_len_dim_index=2**31),
         f"seq_len_dim_index's value is out of range,{2**31} is not a int32 value."),
    ):
        with pytest.raises(ValueError, match="^" + re.escape(text)):
            call()


def test_tensor_num_per_layer_zero_text(fresh):
    # hixl v2/cache_manager.py pull_cache / pull_blocks: "[<func>] param check failed,
    # tensor_num_per_layer (0) is invalid, should [1, <the cache's num_tensors>]".
    d = fresh(cluster_id=39)
    d.init(cm_config().generate_options())
    cm = d.cache_manager
    desc = CacheDesc(2, [4, 16], DataType.DT_UINT8, llm.Placement.HOST)
    mem = np.zeros((4, 64), dtype=np.uint8)
    contiguous = cm.register_cache(desc, [int(m.ctypes.data) for m in mem[:2]])
    blocks = cm.register_blocks_cache(desc, [int(m.ctypes.data) for m in mem[2:]])
    with param_invalid("[pull_cache] param check failed, tensor_num_per_layer (0) is invalid, "
                       "should [1, 2]"):
        cm.pull_cache(llm.CacheKeyByIdAndIndex(1, 1), contiguous, tensor_num_per_layer=0)
    with param_invalid("[pull_blocks] param check failed, tensor_num_per_layer (0) is invalid, "
                       "should [1, 2]"):
        cm.pull_blocks(BlocksCacheKey(1, 0), blocks, [0], [0], tensor_num_per_layer=0)
