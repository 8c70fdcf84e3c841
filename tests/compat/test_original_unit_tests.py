"""The original's own unit tests, round 3: assertions of hicann/hixl tests/python and
tests/cpp/llm_datadist that a host-memory implementation can honour, run against datadist,
and the original's source rules behind them.

hixl = GitHub hicann/hixl (the mirror's HEAD, 9ed283b). A test that follows one of the
original's tests names it (file and test, as they are there); one that follows the original's
source names the file and function; a rule the original does not have is called datadist's
own. (The original has no tests/python/test_cache_manager_lifecycle.py, no
test_check_bool_rejected and no AsyncCacheBatchBoundsUt, in any revision: earlier citations
of them here were wrong.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

import datadist as llm
from datadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    LLMException,
    MemInfo,
    Memtype,
    Placement,
    TransferConfig,
)
from datadist import LLMStatusCode as S

pytestmark = pytest.mark.timeout(60)


class Synchronizer(llm.LayerSynchronizer):
    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        return True

POOL = '{"memory_size": 1048576, "page_shift": 12}'
OPTIONS = {"llm.EnableCacheManager": "1", "llm.MemPoolConfig": POOL,
           "llm.HostMemPoolConfig": POOL, "llm.EnableRemoteCacheAccessible": "1"}


@pytest.fixture
def datadists():
    """Make LLMDataDist instances; every one is finalized afterwards."""
    made: list[Any] = []

    def make(role=llm.LLMRole.PROMPT, cluster_id=0):
        d = llm.LLMDataDist(role, cluster_id)
        made.append(d)
        return d

    yield make
    for d in made:
        d.finalize()


# ------------------------------------------------------------------ CacheManager lifecycle


def manager_operations(cm: Any) -> dict[str, Callable[[], Any]]:
    """Every CacheManager operation (hixl v2/cache_manager.py), with arguments that are
    valid while ``cm`` is live (its caches made beforehand)."""
    desc = CacheDesc(2, [4, 2], DataType.DT_INT8, Placement.DEVICE)
    host_desc = CacheDesc(2, [4, 2], DataType.DT_INT8, Placement.HOST)
    regular = cm.allocate_cache(desc)
    blocks = cm.allocate_blocks_cache(desc)
    host = cm.allocate_blocks_cache(host_desc)
    addrs = list(regular.tensor_addrs)
    return {
        "allocate_cache": lambda: cm.allocate_cache(desc),
        "allocate_blocks_cache": lambda: cm.allocate_blocks_cache(desc),
        "register_cache": lambda: cm.register_cache(desc, addrs),
        "register_blocks_cache": lambda: cm.register_blocks_cache(desc, addrs),
        "deallocate_cache": lambda: cm.deallocate_cache(regular),
        "deallocate_blocks_cache": lambda: cm.deallocate_blocks_cache(blocks),
        "copy_cache": lambda: cm.copy_cache(regular, regular),
        "copy_blocks": lambda: cm.copy_blocks(blocks, {0: [1]}),
        "pull_cache": lambda: cm.pull_cache(CacheKeyByIdAndIndex(1, 7), regular),
        "pull_blocks": lambda: cm.pull_blocks(BlocksCacheKey(1), blocks, [0], [1]),
        "push_cache": lambda: cm.push_cache(CacheKeyByIdAndIndex(1, 7), regular),
        "push_blocks": lambda: cm.push_blocks(BlocksCacheKey(1), blocks, [0], [1]),
        "unregister_cache": lambda: cm.unregister_cache(7),
        "remove_cache_key": lambda: cm.remove_cache_key(CacheKey(prompt_cluster_id=1, req_id=2)),
        "remap_registered_memory": lambda: cm.remap_registered_memory(
            [MemInfo(Memtype.MEM_TYPE_DEVICE, addrs[0], 8)]),
        "swap_blocks": lambda: cm.swap_blocks(blocks, host, {0: 1}),
        "transfer_cache_async": lambda: cm.transfer_cache_async(
            regular, Synchronizer(), [TransferConfig(1, addrs)]),
    }


# The original's wrapper after finalize_v2 (src/python/llm_wrapper/
# llm_datadist_v2_wrapper.cc, llm_data_dist reset to null): AllocateCache / RegisterCache /
# UnregisterCache return ge::FAILED (LLM_FAILED through status.py code_2_status); the others
# return LLM_CHECK_NOTNULL's ge::LLM_PARAM_INVALID (src/llm_datadist/common/llm_log.h).
# transfer_cache_async: the original's task reports LLM_PARAM_INVALID; datadist raises it at
# the call (its argument errors are raised at the call too: docs/compatibility.md).
ORIGINAL_CODE_AFTER_FINALIZE = {
    "allocate_cache": S.LLM_FAILED, "allocate_blocks_cache": S.LLM_FAILED,
    "register_cache": S.LLM_FAILED, "register_blocks_cache": S.LLM_FAILED,
    "unregister_cache": S.LLM_FAILED,
    "deallocate_cache": S.LLM_PARAM_INVALID, "deallocate_blocks_cache": S.LLM_PARAM_INVALID,
    "copy_cache": S.LLM_PARAM_INVALID, "copy_blocks": S.LLM_PARAM_INVALID,
    "pull_cache": S.LLM_PARAM_INVALID, "pull_blocks": S.LLM_PARAM_INVALID,
    "push_cache": S.LLM_PARAM_INVALID, "push_blocks": S.LLM_PARAM_INVALID,
    "remove_cache_key": S.LLM_PARAM_INVALID, "remap_registered_memory": S.LLM_PARAM_INVALID,
    "swap_blocks": S.LLM_PARAM_INVALID, "transfer_cache_async": S.LLM_PARAM_INVALID,
}


def assert_expired(ops: dict[str, Callable[[], Any]]) -> None:
    assert set(ops) == set(ORIGINAL_CODE_AFTER_FINALIZE)
    for name, op in ops.items():
        with pytest.raises(LLMException) as caught:
            op()
        assert caught.value.status_code is ORIGINAL_CODE_AFTER_FINALIZE[name], name
        assert "finalized" in str(caught.value), name


def test_manager_operations_after_finalize_fail_with_the_originals_codes(datadists):
    # The original's CacheManager after finalize (v2/cache_manager.py never reads
    # _initialized): its wrapper, whose engine is gone, fails with the codes above
    # (handle_llm_status raises LLMException). datadist refuses before the arguments are
    # checked (the original's Python checks run first) and says why.
    d = datadists()
    d.init(dict(OPTIONS))
    cm = d.cache_manager
    ops = manager_operations(cm)
    d.finalize()
    assert cm._initialized is False
    assert_expired(ops)
    d.finalize()
    assert_expired(ops)


def test_old_manager_of_a_reinitialized_engine_is_refused(datadists):
    # datadist's own rule: init() after finalize() makes a new manager; the old one stays
    # refused (the codes above), the new one works. The original's old manager would act on
    # the new engine (its wrapper, src/python/llm_wrapper/llm_datadist_v2_wrapper.cc, holds
    # one static LLMDataDistV2 for the process) with the cache ids of the finished one;
    # refusing it is datadist's extension.
    d = datadists()
    d.init(dict(OPTIONS))
    old = d.cache_manager
    ops = manager_operations(old)
    d.finalize()
    d.init(dict(OPTIONS))
    assert d.cache_manager is not old
    assert_expired(ops)
    d.cache_manager.allocate_cache(CacheDesc(2, [4, 2], DataType.DT_INT8, Placement.DEVICE))
    d.finalize()
    replacement = datadists(cluster_id=1)
    replacement.init(dict(OPTIONS))
    assert_expired(ops)
    assert replacement.cache_manager._initialized is True


# ------------------------------------------------------------------ LLMDataDist helpers


def test_shutdown_handler_finalizes_the_instance(datadists):
    # hixl tests/python/test_llm_datadist_coverage.py test_shutdown_handler_no_instance /
    # test_shutdown_handler_with_instance / test_shutdown_handler_finalize_exception: the atexit
    # hook v2.llm_datadist._shutdown_handler finalizes LLMDataDist.llm_engine_instance, is a
    # no-op without one and swallows an LLMException from finalize.
    from datadist.v2.llm_datadist import _shutdown_handler

    assert llm.LLMDataDist.llm_engine_instance is None
    _shutdown_handler()
    d = datadists(cluster_id=3)
    d.init(dict(OPTIONS))
    assert llm.LLMDataDist.llm_engine_instance is d
    _shutdown_handler()
    assert llm.LLMDataDist.llm_engine_instance is None

    class Failing:
        def finalize(self) -> None:
            raise LLMException("test error")

    llm.LLMDataDist.llm_engine_instance = Failing()  # type: ignore[assignment]
    try:
        _shutdown_handler()
    finally:
        llm.LLMDataDist.llm_engine_instance = None


def test_role_to_str():
    # hixl tests/python/test_llm_datadist_coverage.py test_role_to_str_all_roles.
    assert llm.LLMDataDist._role_to_str(llm.LLMRole.PROMPT) == "Prompt"
    assert llm.LLMDataDist._role_to_str(llm.LLMRole.DECODER) == "Decoder"
    assert llm.LLMDataDist._role_to_str(llm.LLMRole.MIX) == "Mix"


def test_v1_switch_role_checks_come_first(datadists):
    # hixl v2/llm_datadist.py switch_role, v1 branch (tests/python/test_llm_datadist_coverage.py
    # test_v1_switch_role_same_role / _to_prompt_without_listen_ip): the role's type, then
    # "role not changed" (before the options' type), then the options' type, then a PROMPT
    # needs llm.listenIpInfo; all of them before the native layer (which refuses a datadist
    # without enable_switch_role, LLM_FEATURE_NOT_ENABLED).
    d = datadists(llm.LLMRole.MIX, 100)
    d.init({"ge.exec.deviceId": "0"})
    with pytest.raises(TypeError):
        d.switch_role("not_a_role")
    for options in (None, "not_dict"):
        with pytest.raises(LLMException, check=lambda e: e.status_code is S.LLM_PARAM_INVALID
                           and str(e).startswith("role not changed, role = MIX")):
            d.switch_role(llm.LLMRole.MIX, options)
    with pytest.raises(TypeError):
        d.switch_role(llm.LLMRole.DECODER, "not_dict")
    with pytest.raises(LLMException, check=lambda e: e.status_code is S.LLM_PARAM_INVALID
                       and str(e).startswith('Failed to switch to Prompt, option '
                                             '"llm.listenIpInfo" must be specified')):
        d.switch_role(llm.LLMRole.PROMPT, {})
    with pytest.raises(LLMException,
                       check=lambda e: e.status_code is S.LLM_FEATURE_NOT_ENABLED):
        d.switch_role(llm.LLMRole.DECODER)


# ------------------------------------------------------------------ a bool is an int


@pytest.mark.parametrize("name", ["check_uint64", "check_int64", "check_int32", "check_uint32",
                                  "check_uint16", "check_uint8"])
@pytest.mark.parametrize("value", [True, False])
def test_integer_checks_take_a_bool(name, value):
    # hixl utils/utils.py check_uint64 / check_int64 / check_int32 / check_uint32 (lines 61-92):
    # check_isinstance(arg_name, arg_value, [int]), i.e. plain isinstance; bool subclasses int
    # in Python, so True (1) and False (0) pass, in range of every integer kind.
    from datadist.utils import utils

    assert getattr(utils, name)("cluster", value) is None


def test_type_checks_take_a_bool_for_an_int():
    # hixl utils/utils.py check_isinstance / check_inner / check_dict (lines 25-58): isinstance
    # for the value, each inner item and each dict key and value, so a bool is an int there;
    # a str is not.
    from datadist.utils.utils import check_dict, check_isinstance

    assert check_isinstance("cluster", True, [int], allow_none=False) is True
    check_isinstance("device_id", [0, True], [list, tuple], int)
    check_dict("cluster_rank_info", {0: True}, int, int)
    check_dict("cluster_rank_info", {True: 0}, int, int)
    assert check_isinstance("enable_switch_role", True, [bool]) is True
    assert check_isinstance("cluster", 1, [int]) == 1
    with pytest.raises(TypeError):
        check_isinstance("cluster", "1", [int], allow_none=False)
    with pytest.raises(TypeError):
        check_dict("cluster_rank_info", {0: "1"}, int, int)


def test_api_arguments_take_a_bool_for_an_int(datadists):
    # The same rule where the API checks its arguments. hixl v2/llm_datadist.py
    # LLMDataDist.__init__ (line 58): check_uint64("cluster_id", cluster_id), then keeps the
    # value as given (cluster_id returns it; its wrapper's uint64_t cluster_id gets 1).
    # link_clusters (lines 263-264): check_int32("timeout", timeout) and timeout > 0, both
    # passed by True (a 1 ms timeout). LLMConfig.device_id takes a bool too (configs.py,
    # tests/api/test_device_id_bool.py), and so does an ip (configs.py
    # LLMClusterInfo._check_inputs: check_isinstance(ip, [str, int]); trans_str_ip keeps an
    # int as given).
    info = llm.LLMClusterInfo()
    info.append_local_ip_info(True, 26000)
    info.append_remote_ip_info(1, True)
    assert info.local_ip_info_list == [(True, 26000)]
    assert info.remote_ip_info_list == [(1, True)]
    d = datadists(llm.LLMRole.PROMPT, True)
    assert d.cluster_id is True
    d.init(dict(OPTIONS))
    ret, rets = d.link_clusters([], timeout=True)
    assert isinstance(ret, S) and rets == []
    with pytest.raises(LLMException, check=lambda e: e.status_code is S.LLM_PARAM_INVALID):
        d.link_clusters([], timeout=False)  # 0: "Param timeout should be greater than 0."


@pytest.mark.parametrize("kind", ["uint64", "int64", "uint32", "int32"])
def test_a_list_of_bools_is_a_list_of_ints(kind):
    # The original checks a list of block indices item by item with isinstance
    # (utils/utils.py check_list_uint64 / check_inner and the like): True is 1, False 0,
    # also in a list of bools only (which numpy would make a bool array of).
    from datadist.api.checks import int_list

    assert int_list("src_blocks", [True, False, True], kind).tolist() == [1, 0, 1]
    assert int_list("src_blocks", (2, True), kind).tolist() == [2, 1]
    with pytest.raises(TypeError):
        int_list("src_blocks", [True, "1"], kind)


# ------------------------------------------------------------------ transfer_cache_async


def async_manager(datadists, remote: bool = False):
    d = datadists()
    opts = dict(OPTIONS)
    if not remote:
        del opts["llm.EnableRemoteCacheAccessible"]
    d.init(opts)
    return d.cache_manager


def test_transfer_cache_async_batch_index_texts(datadists):
    # hixl v2/llm_utils.py TransferCacheJob.check_transfer_config (lines 219-226): with
    # source blocks, src_batch_index must be 0, "Invalid TransferConfig, src_batch_index (1)
    # != 0 while src is blocks". A contiguous source's src_batch_index the original checks
    # natively, in the transfer (the task's result); refusing one outside the source's batch
    # at the call, with the text check_transfer_config has for the range ("out of range:
    # [0, 2)"), is datadist's own rule (docs/compatibility.md, "Errors of
    # transfer_cache_async arguments are raised at the call").
    for remote in (False, True):
        cm = async_manager(datadists, remote)
        desc = CacheDesc(4, [2, 4], DataType.DT_INT8, Placement.DEVICE)
        cache = cm.allocate_cache(desc)
        for index in (2, 3, 2**32 - 1):
            cfg = (llm.TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(1, 0, 0), range(0, 2),
                                                  range(0, 2), index) if remote
                   else TransferConfig(1, [10, 11, 12, 13], src_batch_index=index))
            with pytest.raises(LLMException, match=r"src_batch_index .* out of range: \[0, 2\)"):
                cm.transfer_cache_async(cache, Synchronizer(), [cfg])
        if not remote:
            blocks = cm.allocate_blocks_cache(desc)
            for index in (1, 2):
                cfg = TransferConfig(1, [10, 11, 12, 13], src_batch_index=index)
                with pytest.raises(LLMException, match="!= 0 while src is blocks"):
                    cm.transfer_cache_async(blocks, Synchronizer(), [cfg], [0], [0], 16)
        llm.LLMDataDist.llm_engine_instance.finalize()


def test_transfer_cache_async_texts(datadists):
    # hixl v2/llm_utils.py transfer_cache_async / TransferCacheJob: the original's texts start
    # each message (datadist's detail may follow).
    cm = async_manager(datadists)
    desc = CacheDesc(4, [2, 4], DataType.DT_INT8, Placement.DEVICE)
    cache = cm.allocate_cache(desc)
    blocks = cm.allocate_blocks_cache(desc)
    odd = cm.allocate_cache(CacheDesc(3, [2, 4], DataType.DT_INT8, Placement.DEVICE))
    cfg = TransferConfig(1, [10, 11, 12, 13])
    sync = Synchronizer()
    with pytest.raises(TypeError, match="dst_block_indices"):  # dst's checked before src's
        cm.transfer_cache_async(blocks, sync, [cfg], ["0"], ["0"], 16)
    cases = [
        (lambda: cm.transfer_cache_async(blocks, sync, [cfg], [0]),
         "transfer from blocks to cache is not supported"),
        (lambda: cm.transfer_cache_async(blocks, sync, [cfg], [0, 1], [0], 16),
         "num_block_indices mismatches, src_num = 2, dst_num = 1"),
        (lambda: cm.transfer_cache_async(cache, sync, [cfg], None, [0]),
         "dst_block_memory_size must be set when transfer from cache to blocks"),
        (lambda: cm.transfer_cache_async(cache, sync, [cfg], None, None, 16),
         "dst_block_memory_size (16) is neither None nor 0 while dst is not blocks"),
        (lambda: cm.transfer_cache_async(odd, sync, [cfg]),
         "cache_desc.num_tensors (3) is not even"),
        (lambda: cm.transfer_cache_async(
            cache, sync, [TransferConfig(1, [10, 11], src_layer_range=range(1, 3))]),
         "src_layer_range: range(1, 3) out of range, src_layer_num = 2"),
        (lambda: cm.transfer_cache_async(cache, sync, [TransferConfig(1, [10, 11])]),
         "expect 4 dst_addrs, but len(dst_addrs) = 2, range = range(0, 2)"),
        # the original's checks come before datadist's own check of a contiguous source's
        # batch index: the layer range, then the number of addresses
        (lambda: cm.transfer_cache_async(
            cache, sync, [TransferConfig(1, [10], src_layer_range=range(5, 6),
                                         src_batch_index=2)]),
         "src_layer_range: range(5, 6) out of range, src_layer_num = 2"),
        (lambda: cm.transfer_cache_async(
            cache, sync, [TransferConfig(1, [10], src_batch_index=2)]),
         "expect 4 dst_addrs, but len(dst_addrs) = 1, range = range(0, 2)"),
        (lambda: cm.transfer_cache_async(
            cache, sync, [TransferConfig(1, [10, 11, 12, 13], src_batch_index=2)]),
         "Invalid TransferConfig, src_batch_index (2) out of range: [0, 2)"),
    ]
    for call, text in cases:
        with pytest.raises(LLMException, check=lambda e, text=text: e.status_code is
                           S.LLM_PARAM_INVALID and str(e).startswith(text)):
            call()


# ------------------------------------------------------------------ which error wins


def cm_engine(datadists, cluster_id=3):
    d = datadists(cluster_id=cluster_id)
    d.init({"llm.EnableCacheManager": "1", "llm.MemPoolConfig": POOL})
    return d


def param_invalid(starts: str = ""):
    return pytest.raises(LLMException, check=lambda e: e.status_code is S.LLM_PARAM_INVALID
                         and str(e).startswith(starts))


def test_init_checks_another_instance_before_the_options(datadists):
    # hixl v2/llm_datadist.py init: already initialized (a no-op), then "Cannot init multiple
    # LLMDataDists" (LLM_FAILED), then the options' type (tests/python/
    # test_llm_datadist_coverage.py test_init_multiple_instances).
    d = cm_engine(datadists)
    d.init("not a dict")  # already initialized: nothing is looked at
    with pytest.raises(LLMException, check=lambda e: e.status_code is S.LLM_FAILED):
        datadists(cluster_id=4).init("not a dict")


def test_cluster_calls_check_the_timeout_first(datadists):
    # hixl v2/llm_datadist.py link_clusters / unlink_clusters: check_int32(timeout), then
    # timeout > 0, then the clusters' type, then force's.
    d = cm_engine(datadists)
    for call in (d.link_clusters, d.unlink_clusters):
        with param_invalid("Param timeout should be greater than 0."):
            call("not_list", 0)
        with pytest.raises(TypeError, match="timeout"):
            call("not_list", "not_int")
    with pytest.raises(TypeError, match="clusters"):
        d.unlink_clusters("not_list", 5000, force="not_bool")


def test_link_checks_in_the_originals_order(datadists):
    # hixl v2/llm_datadist.py link: comm_name's type, emptiness and length; cluster_rank_info's
    # type, its items' types, its size (<= 4), its items' ranges; rank_table's type; then two
    # ranks or more, ascending.
    d = cm_engine(datadists)
    with param_invalid("comm_name can not be empty"):
        d.link("", [3, 2], 123)
    with param_invalid("comm_name length should be smaller than 128."):
        d.link("a" * 128, [3, 2], 123)
    with pytest.raises(TypeError, match="cluster_rank_info"):
        d.link("link", {3: "0", 2: 1}, 123)
    with param_invalid("cluster_rank_info size can not be greater than 4."):
        d.link("link", {1: -1, 2: 1, 3: 2, 4: 3, 5: 4}, 123)
    with pytest.raises(ValueError, match="cluster_rank_info"):
        d.link("link", {3: -1, 2: 1}, 123)
    with pytest.raises(TypeError, match="rank_table"):
        d.link("link", {3: 0}, 123)
    with param_invalid("cluster num must be bigger than 1."):
        d.link("link", {3: 0}, "{}")
    with param_invalid("rank in cluster_rank_info must be ordered"):
        d.link("link", {3: 1, 2: 0}, "{}")


def test_mode_checks_come_before_argument_checks(datadists):
    # hixl v2/llm_datadist.py check_link_status: _check_is_not_cache_mgr_mode, then
    # check_uint64(remote_cluster_id).
    d = cm_engine(datadists)
    with param_invalid("check_link_status is not supported when llm.EnableCacheManager is "
                       "configured."):
        d.check_link_status("not_int")


def test_comm_ids_are_uint64(datadists):
    # hixl v2/llm_datadist.py unlink / query_register_mem_status: check_uint64(comm_id), a
    # ValueError for a negative id, before the native layer looks it up.
    d = cm_engine(datadists)
    for call in (d.unlink, d.query_register_mem_status):
        with pytest.raises(ValueError, match="comm_id"):
            call(-1)
        with pytest.raises(TypeError, match="comm_id"):
            call("not_int")
        with pytest.raises(LLMException, check=lambda e: e.status_code is S.LLM_NOT_YET_LINK):
            call(2**64 - 1)


# ------------------------------------------------------------------ CacheManager texts


def test_cache_manager_local_op_texts(datadists):
    # hixl v2/cache_manager.py allocate_cache / allocate_blocks_cache, copy_cache,
    # copy_blocks, _verify_caches + swap_blocks and transfer_cache_async: their raise_if_false
    # texts, in their order.
    d = datadists()
    d.init({"llm.EnableCacheManager": "1", "llm.MemPoolConfig": POOL,
            "llm.HostMemPoolConfig": POOL})
    cm = d.cache_manager
    desc = CacheDesc(2, [4, 8], DataType.DT_INT8, Placement.DEVICE)
    host_desc = CacheDesc(2, [4, 8], DataType.DT_INT8, Placement.HOST)
    cache, blocks = cm.allocate_cache(desc), cm.allocate_blocks_cache(desc)
    host_blocks = cm.allocate_blocks_cache(host_desc)
    wide = cm.allocate_blocks_cache(CacheDesc(2, [4, 16], DataType.DT_INT8, Placement.HOST))
    four = cm.allocate_blocks_cache(CacheDesc(4, [4, 8], DataType.DT_INT8, Placement.HOST))
    cases = [
        (lambda: cm.allocate_cache(CacheDesc(0, [4, 8], DataType.DT_INT8)),
         "num_tensors should be bigger than zero."),
        (lambda: cm.allocate_blocks_cache(CacheDesc(0, [4, 8], DataType.DT_INT8)),
         "num_tensors should be bigger than zero."),
        (lambda: cm.copy_cache(cache, blocks), "param check failed, src cache can not be "
         "blocks cache."),
        (lambda: cm.copy_cache(blocks, cache), "param check failed, dst cache can not be "
         "blocks cache."),
        (lambda: cm.copy_cache(cache, cache, size=0), "[copy_cache] param check failed, size "
         "(0) is invalid, should be = -1 or > 0"),
        (lambda: cm.copy_blocks(cache, {0: [1]}), "param check failed, cache should be blocks "
         "cache."),
        (lambda: cm.swap_blocks(cache, host_blocks, {0: 1}), "param check failed, src cache "
         "should be blocks cache."),
        (lambda: cm.swap_blocks(blocks, cache, {0: 1}), "param check failed, dst cache should "
         "be blocks cache."),
        (lambda: cm.swap_blocks(blocks, wide, {0: 1}), "src block size:8 and dst block "
         "size:16 must be equal"),
        (lambda: cm.swap_blocks(blocks, four, {0: 1}), "src num_tensors:2 and dst "
         "num_tensors:4 must be equal"),
        (lambda: cm.swap_blocks(blocks, host_blocks, {4: 1}), "src_block_index:4 must be in "
         "[0, 4)"),
        (lambda: cm.swap_blocks(blocks, host_blocks, {-1: 1}), "src_block_index:-1 must be in "
         "[0, 4)"),
        (lambda: cm.swap_blocks(blocks, host_blocks, {0: 4}), "dst_block_index:4 must be in "
         "[0, 4)"),
        (lambda: cm.swap_blocks(blocks, blocks, {0: 1}), "swap src placement:"),
        (lambda: cm.transfer_cache_async(cm.allocate_cache(host_desc), Synchronizer(), []),
         "src cache not support placement HOST"),
    ]
    for call, text in cases:
        with param_invalid(text):
            call()
    # the caches' kind before the size; the size before req_id
    with param_invalid("param check failed, src cache can not be blocks cache."):
        cm.copy_cache(cache, blocks, size=0, req_id=-1)
    with param_invalid("[copy_cache] param check failed, size (0)"):
        cm.copy_cache(cache, cache, size=0, req_id=-1)


def test_allocate_needs_a_pool_for_the_placement(datadists):
    # hixl v2/cache_manager.py allocate_cache / allocate_blocks_cache: "you should config
    # memory pool firstly and then set placement that matches it." before the native layer.
    d = datadists()
    d.init({"llm.EnableCacheManager": "1", "llm.MemPoolConfig": POOL})
    cm = d.cache_manager
    text = "you should config memory pool firstly and then set placement that matches it."
    desc = CacheDesc(2, [4, 8], DataType.DT_INT8, Placement.HOST)
    with param_invalid(text):
        cm.allocate_cache(desc)
    with param_invalid(text):
        cm.allocate_blocks_cache(desc)
    cm.allocate_cache(CacheDesc(2, [4, 8], DataType.DT_INT8, Placement.DEVICE))


def test_register_checks_remote_accessible_before_the_addresses(datadists):
    # hixl v2/cache_manager.py register_cache / register_blocks_cache: the types (addrs,
    # cache_keys / blocks_cache_key, remote_accessible) and the after-link rule come before
    # "addrs can not be empty.".
    d = datadists()
    d.init(dict(OPTIONS))
    cm = d.cache_manager
    desc = CacheDesc(2, [4, 8], DataType.DT_INT8, Placement.DEVICE)
    for register in (cm.register_cache, cm.register_blocks_cache):
        with pytest.raises(TypeError, match="remote_accessible"):
            register(desc, [], remote_accessible=1)
    with pytest.raises(TypeError, match="cache_key"):
        cm.register_cache(desc, [], [1])
    with pytest.raises(TypeError, match="blocks_cache_key"):
        cm.register_blocks_cache(desc, [], 1)
    cm.set_is_call_linked()
    with param_invalid("you can not register remote accessible cache after link."):
        cm.register_cache(desc, [], remote_accessible=True)


# ------------------------------------------------------------------ pulls and pushes


def ra_manager(datadists):
    d = datadists()
    d.init(dict(OPTIONS))
    return d.cache_manager


def test_push_checks_in_the_originals_order(datadists):
    # hixl v2/cache_manager.py push_cache / push_blocks: the mode first (before the types),
    # then the types, the kind of cache, dst_blocks, tensor_num_per_layer, the layer ranges
    # and their lengths, then (push_cache) the size; the registry after them all.
    d = datadists()
    d.init({"llm.EnableCacheManager": "1", "llm.MemPoolConfig": POOL})
    with param_invalid("push_cache is only supported while enable_remote_cache_accessible is "
                       "True"):
        d.cache_manager.push_cache("not a key", "not a cache")
    with param_invalid("push_blocks is only supported while enable_remote_cache_accessible is "
                       "True"):
        d.cache_manager.push_blocks("not a key", "not a cache")
    d.finalize()
    cm = ra_manager(datadists)
    desc = CacheDesc(4, [4, 8], DataType.DT_INT8, Placement.DEVICE)
    cache, blocks = cm.allocate_cache(desc), cm.allocate_blocks_cache(desc)
    key, bkey = CacheKeyByIdAndIndex(9, 1), BlocksCacheKey(9, 0)
    with param_invalid("src_layer_range size should be equal to size of dst_layer_range size."):
        cm.push_cache(key, cache, src_layer_range=range(0, 1), dst_layer_range=range(0, 2),
                      size=5)
    with param_invalid("[push_cache] param check failed, tensor_num_per_layer (0) is invalid, "
                       "should [1, 4]"):
        cm.push_cache(key, cache, src_layer_range=range(0, 2, 2), tensor_num_per_layer=0)
    with param_invalid("param check failed, cache can not be blocks cache."):
        cm.push_cache(key, blocks, tensor_num_per_layer=0)
    with param_invalid("dst_blocks can not be empty."):
        cm.push_blocks(bkey, blocks, [0], [], tensor_num_per_layer=0)
    with param_invalid("param check failed, cache should be blocks cache."):
        cm.push_blocks(bkey, cache, [0], [])
    with param_invalid("src_layer_range size should be equal to size of dst_layer_range size."):
        cm.push_blocks(bkey, blocks, [0], [0], src_layer_range=range(0, 1))
    # the registry comes last: a cache this manager never made is refused after the checks
    gone = cm.allocate_cache(desc)
    cm.deallocate_cache(gone)
    with param_invalid("[push_cache] param check failed, size (5)"):
        cm.push_cache(key, gone, size=5)


def test_pull_checks_in_the_originals_order(datadists):
    # hixl v2/cache_manager.py pull_cache / pull_blocks and v2/llm_utils.py
    # layer_range_to_tensor_indices: the key's type for the mode first; tensor_num_per_layer
    # before the layer ranges; the ranges' texts; other keywords ignored.
    cm = ra_manager(datadists)
    desc = CacheDesc(4, [4, 8], DataType.DT_INT8, Placement.DEVICE)
    cache, blocks = cm.allocate_cache(desc), cm.allocate_blocks_cache(desc)
    key = CacheKeyByIdAndIndex(9, 1)
    with pytest.raises(TypeError, match="cache_key"):
        cm.pull_cache(CacheKey(9, 1), cache, size=0)
    with param_invalid("[pull_cache] param check failed, tensor_num_per_layer (0)"):
        cm.pull_cache(key, cache, src_layer_range=range(0, 2, 2), tensor_num_per_layer=0)
    with param_invalid("param check failed, src_layer_range step must be 1."):
        cm.pull_cache(key, cache, src_layer_range=range(0, 2, 2))
    with param_invalid("param check failed, dst_layer_range step must be 1."):
        cm.pull_cache(key, cache, src_layer_range=range(-1, 1), dst_layer_range=range(0, 2, 2))
    with param_invalid("src_layer_range is invalid, the start value:-1 is < 0"):
        cm.pull_cache(key, cache, src_layer_range=range(-1, 1))
    with param_invalid("dst_layer_range is invalid, the start value:-2 is < 0"):
        cm.pull_blocks(key, blocks, [], [0], dst_layer_range=range(-2, 1))
    with param_invalid("[pull_blocks] param check failed, tensor_num_per_layer (0)"):
        cm.pull_blocks(key, blocks, [0], [0], tensor_num_per_layer=0)
    with param_invalid("one of req id and prefix id should contain valid value"):
        cm.pull_blocks(CacheKey(9, 2**64 - 1), blocks, [0], [0])
    with pytest.raises(LLMException, check=lambda e: e.status_code is S.LLM_NOT_YET_LINK):
        cm.pull_cache(key, cache, src_cache_offset=0)  # not a keyword of v2's pull: ignored


def test_listen_ip_info_without_a_port_text(datadists):
    # hixl v2/llm_utils.py parse_listen_ip_info (init in cache-manager mode, switch_role):
    # 'llm.listenIpInfo "<value>" is invalid, format should be "ip:port"'.
    text = 'llm.listenIpInfo "127.0.0.1" is invalid, format should be "ip:port"'
    with param_invalid(text):
        datadists().init({"llm.EnableCacheManager": "1", "llm.listenIpInfo": "127.0.0.1"})
    d = cm_engine(datadists)
    with param_invalid(text):
        d.switch_role(llm.LLMRole.DECODER, {"llm.listenIpInfo": "127.0.0.1"})


# ------------------------------------------------------------------ utils/log.py


def test_find_caller_thread_stack_top():
    # hixl tests/python/test_log.py TestLogUtils.test_find_caller_thread_stack_top, as there:
    # _find_caller called at the top of a thread's stack returns (no frame left to walk).
    import threading

    from datadist.utils.log import _find_caller

    result_holder = []

    def target():
        def inner():
            result_holder.append(_find_caller())

        inner()

    t = threading.Thread(target=target)
    t.start()
    t.join()
    assert len(result_holder) == 1


def test_find_caller_names_the_caller_of_the_log_helpers(monkeypatch):
    # hixl utils/log.py _find_caller, installed as the logger's findCaller there: a record
    # made through the module's helpers (log.error) names the helper's caller.
    import logging
    import sys

    from datadist.utils import log

    logger = log.get_logger()
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    monkeypatch.setattr(logger, "findCaller", log._find_caller)
    logger.addHandler(handler)
    try:
        line = sys._getframe().f_lineno + 1
        log.error("where from")
        log.error("with its stack", stack_info=True)
    finally:
        logger.removeHandler(handler)
    name = "test_find_caller_names_the_caller_of_the_log_helpers"
    assert [(r.pathname, r.lineno, r.funcName) for r in records] == [
        (__file__, line, name), (__file__, line + 1, name)]
    assert records[0].stack_info is None
    assert records[1].stack_info.startswith("Stack (most recent call last):\n")
    assert name in records[1].stack_info
