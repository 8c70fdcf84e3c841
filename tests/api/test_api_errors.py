"""Every documented error of the public API (spec §4.4, §7-§9), and the registry semantics a
single process can see through it.

Kinds, as in llm_datadist: TypeError for a wrong type, ValueError for an int out of its C range,
LLMException with ``status_code`` for everything semantic; plain RuntimeError when the instance
is not initialized; ``link_clusters``/``unlink_clusters`` return codes instead of raising.

Only one LLMDataDist may be initialized per process, so every test gets its instance from
``make_datadist``, which always finalizes. Where a linked peer is needed, it is a bare core
``NativeEngine`` in this process (the one-per-process rule is LLMDataDist's, not the engine's).
"""

from __future__ import annotations

import ctypes
import socket

import numpy as np
import pytest

from datadist import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    LayerSynchronizer,
    LLMClusterInfo,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    MemInfo,
    Memtype,
    Placement,
    TransferConfig,
    TransferWithCacheKeyConfig,
)
from datadist.core.config import EngineConfig
from datadist.core.keys import key_id
from datadist.core.layout import Geometry
from datadist.core.native import NativeEngine
from datadist.memory.pool import PoolConfig

# Some tests open sockets (listeners, refused connects, an in-process peer): bound them all.
pytestmark = pytest.mark.timeout(60)

S = LLMStatusCode
U64 = 2**64 - 1
POOL = 1 << 20
ME, PEER = 1, 99
HOST, DEVICE = Placement.HOST, Placement.DEVICE
F16 = DataType.DT_FLOAT16

CM_OPTS = {
    "llm.EnableCacheManager": "1",
    "llm.MemPoolConfig": f'{{"memory_size": {POOL}, "page_shift": 12}}',
    "llm.HostMemPoolConfig": f'{{"memory_size": {POOL}, "page_shift": 12}}',
}
RA_OPTS = {**CM_OPTS, "llm.EnableRemoteCacheAccessible": "1"}
NO_POOL_OPTS = {"llm.EnableCacheManager": "1"}
V1_OPTS: dict[str, str] = {}  # DECODER without llm.EnableCacheManager: KvCacheManager mode


def code(status: LLMStatusCode):
    """pytest.raises for an LLMException carrying exactly ``status``."""
    return pytest.raises(LLMException, check=lambda e: e.status_code is status)


def not_initialized():
    return pytest.raises(RuntimeError, match="^llm datadist is not initialized$",
                         check=lambda e: type(e) is RuntimeError)


def contiguous_desc(num_tensors=4, batch=2, width=64, placement=HOST):
    return CacheDesc(num_tensors, [batch, width], F16, placement)


def blocks_desc(num_tensors=4, blocks=8, width=16, placement=HOST):
    return CacheDesc(num_tensors, [blocks, width], F16, placement)


def host_memory(desc: CacheDesc) -> tuple[np.ndarray, list[int]]:
    """User memory for ``desc``: the array (keep it alive) and one address per tensor."""
    arr = np.zeros((desc.num_tensors, *desc.shape), np.float16)
    return arr, [int(arr[i].ctypes.data) for i in range(desc.num_tensors)]


def cluster(remote_id: int, port: int, *, local_ip: bool = True) -> LLMClusterInfo:
    c = LLMClusterInfo()
    c.remote_cluster_id = remote_id
    if local_ip:
        c.append_local_ip_info("127.0.0.1", 0)
    c.append_remote_ip_info("127.0.0.1", port)
    return c


@pytest.fixture
def make_datadist():
    """Build and init LLMDataDist instances; every one is finalized afterwards."""
    leftover = LLMDataDist.llm_engine_instance
    if leftover is not None:  # a test elsewhere leaked one: don't fail for its sake
        leftover.finalize()
    made: list[LLMDataDist] = []

    def make(options=None, role=LLMRole.DECODER, cluster_id=ME) -> LLMDataDist:
        dd = LLMDataDist(role, cluster_id)
        made.append(dd)
        dd.init(dict(CM_OPTS if options is None else options))
        return dd

    yield make
    for dd in made:
        dd.finalize()
    assert LLMDataDist.llm_engine_instance is None


@pytest.fixture
def datadist(make_datadist):
    return make_datadist()


@pytest.fixture
def cm(datadist):
    return datadist.cache_manager


@pytest.fixture
def registered(cm):
    """A registered contiguous HOST cache (4 tensors, batch 2) and its memory."""
    desc = contiguous_desc()
    arr, addrs = host_memory(desc)
    return cm.register_cache(desc, addrs), arr


@pytest.fixture
def blocks(cm):
    """A registered blocks HOST cache (4 tensors, 8 blocks) and its memory."""
    desc = blocks_desc()
    arr, addrs = host_memory(desc)
    return cm.register_blocks_cache(desc, addrs, BlocksCacheKey(ME, 0)), arr


@pytest.fixture
def peer():
    """A bare engine listening on loopback, with a host pool, as the remote cluster."""
    eng = NativeEngine(EngineConfig(cluster_id=PEER, role=int(LLMRole.PROMPT),
                                          listen=("127.0.0.1", 0), host_pool=PoolConfig(POOL, 12)))
    yield eng
    eng.close()


@pytest.fixture
def linked(datadist, peer):
    port = peer.listen_address[1]
    assert datadist.link_clusters([cluster(PEER, port)], 5000) == (S.LLM_SUCCESS,
                                                                   [S.LLM_SUCCESS])
    return peer


@pytest.fixture
def refused_port():
    """A port that is bound but not listening: a connect to it is refused at once."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    yield s.getsockname()[1]
    s.close()


# ================================================================================ LLMDataDist


class TestConstructor:
    @pytest.mark.parametrize("role", [1, "PROMPT", None])
    def test_role_must_be_llm_role(self, role):
        with pytest.raises(TypeError):
            LLMDataDist(role, 1)

    @pytest.mark.parametrize(("cluster_id", "error"), [
        (-1, ValueError), (2**64, ValueError), ("1", TypeError), (1.0, TypeError),
        (None, TypeError),
    ])
    def test_cluster_id_is_uint64(self, cluster_id, error):
        with pytest.raises(error):
            LLMDataDist(LLMRole.PROMPT, cluster_id)

    def test_constructor_does_nothing_else(self):
        dd = LLMDataDist(LLMRole.MIX, U64)
        assert dd.cluster_id == U64
        assert LLMDataDist.llm_engine_instance is None


class TestNotInitialized:
    CALLS = {
        "cache_manager": lambda dd: dd.cache_manager,
        "kv_cache_manager": lambda dd: dd.kv_cache_manager,
        "link_clusters": lambda dd: dd.link_clusters([cluster(PEER, 1)]),
        "unlink_clusters": lambda dd: dd.unlink_clusters([cluster(PEER, 1)]),
        "switch_role": lambda dd: dd.switch_role(LLMRole.PROMPT),
        "check_link_status": lambda dd: dd.check_link_status(PEER),
        "link": lambda dd: dd.link("comm", {ME: 0, PEER: 1}, "{}"),
        "unlink": lambda dd: dd.unlink(1),
        "query_register_mem_status": lambda dd: dd.query_register_mem_status(1),
    }

    @pytest.mark.parametrize("call", sorted(CALLS))
    def test_before_init(self, call):
        with not_initialized():
            self.CALLS[call](LLMDataDist(LLMRole.DECODER, ME))

    @pytest.mark.parametrize("call", sorted(CALLS))
    def test_after_finalize(self, make_datadist, call):
        # Issue 38 item 7: says "finalized" and what to do, LLM_ENGINE_FINALIZED; still a
        # RuntimeError as the original's (tests/api/test_facade_notices.py).
        dd = make_datadist()
        dd.finalize()
        with pytest.raises(RuntimeError, match="^llm datadist was finalized .*init",
                           check=lambda e: getattr(e, "status_code", None)
                           is LLMStatusCode.LLM_ENGINE_FINALIZED):
            self.CALLS[call](dd)

    def test_finalize_without_init_is_a_noop(self):
        dd = LLMDataDist(LLMRole.DECODER, ME)
        dd.finalize()
        dd.finalize()

    def test_cache_manager_after_finalize_refuses(self, make_datadist):
        dd = make_datadist()
        cm = dd.cache_manager
        desc = contiguous_desc()
        arr, addrs = host_memory(desc)
        dd.finalize()
        with pytest.raises(RuntimeError):
            cm.register_cache(desc, addrs)
        with pytest.raises(RuntimeError):
            cm.allocate_cache(desc)

    def test_kv_cache_manager_after_finalize_is_not_initialized(self, make_datadist):
        dd = make_datadist(V1_OPTS)
        kv = dd.kv_cache_manager
        assert kv.is_initialized()
        dd.finalize()
        assert not kv.is_initialized()


class TestInit:
    @pytest.mark.parametrize("options", [None, [("llm.EnableCacheManager", "1")], "x"])
    def test_options_must_be_a_dict(self, options):
        with pytest.raises(TypeError):
            LLMDataDist(LLMRole.DECODER, ME).init(options)
        assert LLMDataDist.llm_engine_instance is None

    def test_second_instance_is_llm_failed(self, make_datadist):
        first = make_datadist()
        with code(S.LLM_FAILED):
            make_datadist(cluster_id=2)
        assert LLMDataDist.llm_engine_instance is first

    def test_init_again_is_a_noop(self, make_datadist):
        dd = make_datadist()
        engine = dd.engine
        dd.init({"something": "else"})
        assert dd.engine is engine
        assert LLMDataDist.llm_engine_instance is dd

    def test_after_finalize_another_instance_may_init(self, make_datadist):
        make_datadist().finalize()
        second = make_datadist(cluster_id=2)
        assert LLMDataDist.llm_engine_instance is second

    @pytest.mark.parametrize("options", [
        {**CM_OPTS, "ge.flowGraphMemMaxSize": "1024,2048"},
        {**CM_OPTS, "ge.flowGraphMemMaxSize": "abc"},
        {"llm.EnableCacheManager": "0", "llm.LocalCommRes": ""},
        {"llm.TransferBackend": "hixl", "llm.listenIpInfo": "127.0.0.1:0"},
        {"llm.EnableCacheManager": "1", "llm.TransferBackend": "hixl"},
        {"llm.EnableCacheManager": "1", "llm.TransferBackend": "hixl",
         "llm.EnableRemoteCacheAccessible": "0", "llm.listenIpInfo": "127.0.0.1:0"},
        {"llm.EnableCacheManager": "1", "llm.listenIpInfo": "nonsense"},
        {"llm.EnableCacheManager": "1", "llm.listenIpInfo": "127.0.0.1:99999"},
        {"llm.EnableCacheManager": "1", "llm.SyncKvCacheWaitTime": "abc"},
        {"llm.EnableCacheManager": "1", "llm.SyncKvCacheWaitTime": "0"},
        {"llm.EnableCacheManager": "1", "llm.MemPoolConfig": '{"memory_size": 0}'},
        {"llm.EnableCacheManager": "1", "llm.MemPoolConfig": "not json"},
        {"llm.EnableCacheManager": "1",
         "llm.HostMemPoolConfig": '{"memory_size": 1048576, "page_shift": 9}'},
        {"llm.EnableCacheManager": "1",
         "llm.HostMemPoolConfig": '{"memory_size": 1048576, "page_shift": 31}'},
    ])
    def test_bad_options_are_param_invalid(self, make_datadist, options):
        with code(S.LLM_PARAM_INVALID):
            make_datadist(options)
        assert LLMDataDist.llm_engine_instance is None
        make_datadist()  # nothing half-initialized is left behind

    def test_v1_prompt_needs_listen_ip_info(self, make_datadist):
        with code(S.LLM_PARAM_INVALID):
            make_datadist(V1_OPTS, role=LLMRole.PROMPT)

    def test_listen_port_in_use_is_an_llm_exception(self, make_datadist):
        busy = socket.socket()
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        try:
            port = busy.getsockname()[1]
            with pytest.raises(LLMException):
                make_datadist({"llm.EnableCacheManager": "1",
                               "llm.listenIpInfo": f"127.0.0.1:{port}"})
        finally:
            busy.close()
        assert LLMDataDist.llm_engine_instance is None

    def test_local_comm_res_selects_cache_manager_mode(self, make_datadist):
        dd = make_datadist({"llm.LocalCommRes": ""})
        assert dd.cache_manager is not None
        with code(S.LLM_PARAM_INVALID):
            dd.kv_cache_manager  # noqa: B018

    def test_user_options_are_not_modified(self, make_datadist):
        options = {"llm.LocalCommRes": "", "llm.listenIpInfo": "127.0.0.1:0"}
        snapshot = dict(options)
        dd = LLMDataDist(LLMRole.PROMPT, ME)
        try:
            dd.init(options)
            assert options == snapshot
        finally:
            dd.finalize()


class TestModes:
    def test_cache_manager_without_cache_manager_mode(self, make_datadist):
        dd = make_datadist(V1_OPTS)
        with code(S.LLM_PARAM_INVALID):
            dd.cache_manager  # noqa: B018

    def test_kv_cache_manager_in_cache_manager_mode(self, datadist):
        with code(S.LLM_PARAM_INVALID):
            datadist.kv_cache_manager  # noqa: B018

    def test_check_link_status_in_cache_manager_mode(self, datadist):
        with code(S.LLM_PARAM_INVALID):
            datadist.check_link_status(PEER)

    def test_check_link_status_checks_its_argument(self, make_datadist):
        dd = make_datadist(V1_OPTS)
        with pytest.raises(ValueError):
            dd.check_link_status(-1)
        with pytest.raises(TypeError):
            dd.check_link_status("99")

    def test_check_link_status_of_an_unlinked_cluster(self, make_datadist):
        dd = make_datadist(V1_OPTS)
        with code(S.LLM_NOT_YET_LINK):
            dd.check_link_status(PEER)


class TestLinkClusters:
    @pytest.mark.parametrize("clusters", [None, "x", cluster(PEER, 1), {cluster(PEER, 1)}])
    def test_clusters_must_be_a_list_or_tuple(self, datadist, clusters):
        with pytest.raises(TypeError):
            datadist.link_clusters(clusters)

    def test_items_must_be_cluster_infos(self, datadist):
        with pytest.raises(TypeError):
            datadist.link_clusters([cluster(PEER, 1), PEER])

    @pytest.mark.parametrize(("timeout", "expect"), [
        ("1000", pytest.raises(TypeError)), (1.5, pytest.raises(TypeError)),
        (2**31, pytest.raises(ValueError)), (0, code(S.LLM_PARAM_INVALID)),
        (-5, code(S.LLM_PARAM_INVALID)),
    ])
    @pytest.mark.parametrize("method", ["link_clusters", "unlink_clusters"])
    def test_timeout(self, datadist, method, timeout, expect):
        with expect:
            getattr(datadist, method)([cluster(PEER, 1)], timeout)

    def test_remote_cluster_id_is_required(self, datadist):
        # hixl v2/llm_datadist.py LLMDataDist.link_clusters / unlink_clusters:
        # check_uint64("remote_cluster_id", None) is a TypeError.
        c = LLMClusterInfo()
        c.append_local_ip_info("127.0.0.1", 0)
        c.append_remote_ip_info("127.0.0.1", 1)
        with pytest.raises(TypeError):
            datadist.link_clusters([c])
        with pytest.raises(TypeError):
            datadist.unlink_clusters([c])

    def test_local_ip_info_is_required_in_cache_manager_mode(self, datadist, refused_port):
        with code(S.LLM_PARAM_INVALID):
            datadist.link_clusters([cluster(PEER, refused_port, local_ip=False)])

    @pytest.mark.timeout(30)
    def test_local_ip_info_not_required_with_local_comm_res(self, make_datadist, peer):
        dd = make_datadist({"llm.LocalCommRes": '{"version": "1.2"}'})
        c = cluster(PEER, peer.listen_address[1], local_ip=False)
        assert dd.link_clusters([c], 5000) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])

    def test_empty_list_is_param_invalid(self, datadist):
        # hixl link_mgr/llm_link_manager.cc LLMLinkManager::LinkClusters / UnlinkClusters:
        # "clusters size must > 0" -> LLM_PARAM_INVALID, returned (not raised) by the Python
        # link_clusters / unlink_clusters, with no per-cluster codes.
        assert datadist.link_clusters([]) == (S.LLM_PARAM_INVALID, [])
        assert datadist.unlink_clusters(()) == (S.LLM_PARAM_INVALID, [])
        assert datadist.unlink_clusters([], force=True) == (S.LLM_PARAM_INVALID, [])

    @pytest.mark.timeout(30)
    def test_nobody_listening_returns_link_failed(self, datadist, refused_port):
        result = datadist.link_clusters([cluster(PEER, refused_port)], 2000)
        assert result == (S.LLM_LINK_FAILED, [S.LLM_LINK_FAILED])
        # and nothing was half-linked: a pull still says "not linked"
        desc = contiguous_desc()
        arr, addrs = host_memory(desc)
        cache = datadist.cache_manager.register_cache(desc, addrs)
        with code(S.LLM_NOT_YET_LINK):
            datadist.cache_manager.pull_cache(CacheKeyByIdAndIndex(PEER, 1), cache)

    @pytest.mark.timeout(30)
    def test_per_cluster_codes_are_in_order(self, datadist, peer, refused_port):
        good = cluster(PEER, peer.listen_address[1])
        bad = cluster(PEER + 1, refused_port)
        overall, codes = datadist.link_clusters((bad, good), 5000)
        assert codes == [S.LLM_LINK_FAILED, S.LLM_SUCCESS]
        assert overall is S.LLM_LINK_FAILED

    @pytest.mark.timeout(30)
    def test_peer_with_another_cluster_id_is_linked_under_its_own(self, datadist, peer):
        # hicann/hixl link_msg_handler.cc: the link is filed under the id the peer reports
        # (tests/api/test_link_ids.py has the transfers)
        result = datadist.link_clusters([cluster(PEER + 1, peer.listen_address[1])], 5000)
        assert result == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        assert datadist.engine.get_link(PEER).cluster_id == PEER
        again = datadist.link_clusters([cluster(PEER, peer.listen_address[1])], 5000)
        assert again == (S.LLM_ALREADY_LINK, [S.LLM_ALREADY_LINK])

    @pytest.mark.timeout(30)
    def test_link_twice_is_already_link(self, datadist, linked):
        again = datadist.link_clusters([cluster(PEER, linked.listen_address[1])], 5000)
        assert again == (S.LLM_ALREADY_LINK, [S.LLM_ALREADY_LINK])

    def test_more_than_16_clusters_is_reported_not_raised(self, datadist, refused_port):
        clusters = [cluster(1000 + i, refused_port) for i in range(17)]
        overall, codes = datadist.link_clusters(clusters, 2000)
        assert overall is S.LLM_CLUSTER_NUM_EXCEED_LIMIT
        assert codes == [S.LLM_CLUSTER_NUM_EXCEED_LIMIT] * 17
        overall, codes = datadist.unlink_clusters(clusters, 2000)
        assert overall is S.LLM_CLUSTER_NUM_EXCEED_LIMIT

    def test_unlink_of_an_unknown_cluster_returns_a_code(self, datadist):
        # As LinkMsgHandler::UnlinkCluster: without force the original dials the cluster's
        # listener to tell it; nobody answers at port 1
        overall, codes = datadist.unlink_clusters([cluster(PEER, 1)], 1000)
        assert codes == [S.LLM_UNLINK_FAILED]
        assert overall is S.LLM_UNLINK_FAILED
        # forced: nothing is left behind either way, so SUCCESS (issue 10, item 1)
        assert datadist.unlink_clusters([cluster(PEER, 1)], 1000, force=True) \
            == (S.LLM_SUCCESS, [S.LLM_SUCCESS])

    @pytest.mark.timeout(30)
    def test_the_overall_code_is_the_last_failure(self, datadist, linked, refused_port):
        """LLMLinkManager::LinkClusters / UnlinkClusters: ``ret = fut_ret != SUCCESS ?
        fut_ret : ret`` over the clusters in order."""
        live, dead = cluster(PEER, linked.listen_address[1]), cluster(PEER + 1, refused_port)
        assert datadist.link_clusters([live, dead], 2000) == (
            S.LLM_LINK_FAILED, [S.LLM_ALREADY_LINK, S.LLM_LINK_FAILED])
        assert datadist.link_clusters([dead, live], 2000) == (
            S.LLM_ALREADY_LINK, [S.LLM_LINK_FAILED, S.LLM_ALREADY_LINK])

    @pytest.mark.timeout(30)
    def test_unlink_of_a_peer_that_cannot_be_told(self, datadist, linked):
        """LinkMsgHandler::UnlinkCluster reports LLM_UNLINK_FAILED when it cannot reach the
        peer; our end is closed all the same, so a relink to a new peer works."""
        c = cluster(PEER, linked.listen_address[1])
        linked.close()
        assert datadist.unlink_clusters([c], 1000) == (S.LLM_UNLINK_FAILED,
                                                        [S.LLM_UNLINK_FAILED])
        assert datadist.engine.links() == []
        again = NativeEngine(EngineConfig(cluster_id=PEER, role=int(LLMRole.PROMPT),
                                          listen=("127.0.0.1", 0)))
        try:
            c = cluster(PEER, again.listen_address[1])
            assert datadist.link_clusters([c], 5000) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        finally:
            again.close()

    def test_unlink_without_force_needs_one_remote_address(self, datadist, linked):
        c = cluster(PEER, linked.listen_address[1])
        c.append_remote_ip_info("127.0.0.1", linked.listen_address[1])
        assert datadist.unlink_clusters([c], 1000) == (S.LLM_PARAM_INVALID,
                                                        [S.LLM_PARAM_INVALID])
        assert datadist.unlink_clusters([c], 1000, force=True) == (S.LLM_SUCCESS,
                                                                    [S.LLM_SUCCESS])

    def test_unlink_force_must_be_bool(self, datadist):
        with pytest.raises(TypeError):
            datadist.unlink_clusters([cluster(PEER, 1)], 1000, force=1)

    @pytest.mark.timeout(30)
    def test_unlink_then_unlink_again(self, datadist, linked):
        c = cluster(PEER, linked.listen_address[1])
        assert datadist.unlink_clusters([c], 5000) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        # nothing left to drop, and the peer's listener answers: as the original, SUCCESS
        assert datadist.unlink_clusters([c], 5000) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])


class TestSwitchRole:
    def test_role_must_be_llm_role(self, datadist):
        with pytest.raises(TypeError):
            datadist.switch_role(1)

    def test_switch_options_must_be_a_dict(self, datadist):
        with pytest.raises(TypeError):
            datadist.switch_role(LLMRole.PROMPT, [("llm.listenIpInfo", "127.0.0.1:0")])

    def test_bad_listen_ip_info(self, datadist):
        with code(S.LLM_PARAM_INVALID):
            datadist.switch_role(LLMRole.PROMPT, {"llm.listenIpInfo": "nonsense"})

    @pytest.mark.timeout(30)
    def test_with_a_live_link_is_exist_link(self, datadist, linked):
        with code(S.LLM_EXIST_LINK):
            datadist.switch_role(LLMRole.PROMPT, {"llm.listenIpInfo": "127.0.0.1:0"})
        assert datadist.listen_address is None  # nothing changed
        c = cluster(PEER, linked.listen_address[1])
        assert datadist.unlink_clusters([c], 5000)[0] is S.LLM_SUCCESS
        datadist.switch_role(LLMRole.PROMPT, {"llm.listenIpInfo": "127.0.0.1:0"})
        assert datadist.listen_address is not None

    def test_start_and_stop_listening(self, datadist):
        datadist.switch_role(LLMRole.PROMPT, {"llm.listenIpInfo": "127.0.0.1:0"})
        host, port = datadist.listen_address
        assert host == "127.0.0.1" and port > 0
        datadist.switch_role(LLMRole.DECODER)
        assert datadist.listen_address is None

    def test_v1_needs_enable_switch_role(self, make_datadist):
        dd = make_datadist(V1_OPTS)
        with code(S.LLM_FEATURE_NOT_ENABLED):
            dd.switch_role(LLMRole.MIX)

    def test_v1_role_must_change(self, make_datadist):
        dd = make_datadist({"llm.EnableSwitchRole": "1"})
        with code(S.LLM_PARAM_INVALID):
            dd.switch_role(LLMRole.DECODER)

    def test_v1_to_prompt_needs_listen_ip_info(self, make_datadist):
        dd = make_datadist({"llm.EnableSwitchRole": "1"})
        with code(S.LLM_PARAM_INVALID):
            dd.switch_role(LLMRole.PROMPT)
        dd.switch_role(LLMRole.PROMPT, {"llm.listenIpInfo": "127.0.0.1:0"})
        assert dd.listen_address is not None


class TestTwoSidedLink:
    """``link`` / ``unlink`` / ``query_register_mem_status``: the checks of spec §7."""

    @pytest.mark.parametrize("call", [
        lambda dd: dd.link("comm", {ME: 0, PEER: 1}, "{}"),
        lambda dd: dd.unlink(1),
        lambda dd: dd.query_register_mem_status(1),
    ])
    def test_cache_manager_mode_only(self, make_datadist, call):
        dd = make_datadist(V1_OPTS)
        with code(S.LLM_PARAM_INVALID):
            call(dd)

    @pytest.mark.parametrize(("args", "expect"), [
        ((1, {ME: 0, PEER: 1}, "{}"), pytest.raises(TypeError)),
        (("comm", [(ME, 0), (PEER, 1)], "{}"), pytest.raises(TypeError)),
        (("comm", {ME: 0, PEER: 1}, {}), pytest.raises(TypeError)),
        (("comm", {ME: 0, "99": 1}, "{}"), pytest.raises(TypeError)),
        (("comm", {ME: 0, PEER: -1}, "{}"), pytest.raises(ValueError)),
        (("", {ME: 0, PEER: 1}, "{}"), code(S.LLM_PARAM_INVALID)),
        (("c" * 128, {ME: 0, PEER: 1}, "{}"), code(S.LLM_PARAM_INVALID)),
        (("comm", {ME: 0}, "{}"), code(S.LLM_PARAM_INVALID)),  # fewer than 2
        (("comm", {ME: 0, 2: 1, 3: 2, 4: 3, 5: 4}, "{}"), code(S.LLM_PARAM_INVALID)),  # > 4
        (("comm", {ME: 1, PEER: 0}, "{}"), code(S.LLM_PARAM_INVALID)),  # not ascending
    ])
    def test_link_arguments(self, datadist, args, expect):
        with expect:
            datadist.link(*args)

    @pytest.mark.parametrize("method", ["unlink", "query_register_mem_status"])
    def test_comm_id_type(self, datadist, method):
        with pytest.raises(TypeError):
            getattr(datadist, method)("1")


class TestLocalOps:
    """The argument rules of copy_cache, copy_blocks, swap_blocks (spec §9)."""

    def test_copy_cache(self, cm, registered, blocks):
        cache, _ = registered
        with pytest.raises(TypeError):
            cm.copy_cache("dst", cache)
        with pytest.raises(TypeError):
            cm.copy_cache(cache, None)
        with pytest.raises(ValueError):
            cm.copy_cache(cache, cache, offset=-1)
        with pytest.raises(ValueError):
            cm.copy_cache(cache, cache, dst_batch_index=-1)
        with pytest.raises(ValueError):
            cm.copy_cache(cache, cache, req_id=-1)
        with code(S.LLM_PARAM_INVALID):
            cm.copy_cache(blocks[0], cache)
        with code(S.LLM_PARAM_INVALID):
            cm.copy_cache(cache, blocks[0])
        with code(S.LLM_PARAM_INVALID):
            cm.copy_cache(cache, cache, size=0)

    def test_copy_blocks(self, cm, registered, blocks):
        with pytest.raises(TypeError):
            cm.copy_blocks(blocks[0], [(0, [1])])
        with pytest.raises(TypeError):
            cm.copy_blocks(None, {0: [1]})
        with code(S.LLM_PARAM_INVALID):
            cm.copy_blocks(registered[0], {0: [1]})

    def test_swap_blocks(self, cm, registered, blocks):
        host = blocks[0]
        desc = blocks_desc()
        arr, addrs = host_memory(desc)
        cpu = Cache.create_cpu_cache(desc, addrs)  # HOST too: same placement
        with pytest.raises(TypeError):
            cm.swap_blocks(host, "dst", {0: 1})
        with code(S.LLM_PARAM_INVALID):
            cm.swap_blocks(cpu, host, {0: 1})
        with code(S.LLM_PARAM_INVALID):
            cm.swap_blocks(registered[0], host, {0: 1})

    @pytest.mark.parametrize("mem_infos", [
        MemInfo(Memtype.MEM_TYPE_HOST, 4096, 4096),
        MemInfo(Memtype.MEM_TYPE_DEVICE, 0, 4096),
        MemInfo(Memtype.MEM_TYPE_DEVICE, 4096, 0),
        [MemInfo(Memtype.MEM_TYPE_DEVICE, 4096, 4096), "x"],
        (MemInfo(Memtype.MEM_TYPE_DEVICE, 4096, 4096),),
    ])
    def test_remap_registered_memory(self, cm, mem_infos):
        with code(S.LLM_PARAM_INVALID):
            cm.remap_registered_memory(mem_infos)

    def test_transfer_cache_async_source(self, cm, registered):
        class Sync(LayerSynchronizer):
            def synchronize_layer(self, layer_index, timeout_in_millis):
                return True

        with pytest.raises(TypeError):
            cm.transfer_cache_async("cache", Sync(), [TransferConfig(PEER, [4096] * 4)])
        with code(S.LLM_PARAM_INVALID):  # a HOST source is not supported
            cm.transfer_cache_async(registered[0], Sync(), [TransferConfig(PEER, [4096] * 4)])


class TestPushMode:
    def test_push_needs_remote_cache_accessible(self, cm, registered, blocks):
        # llm_datadist's own check: raise_if_false, i.e. PARAM_INVALID
        with code(S.LLM_PARAM_INVALID):
            cm.push_cache(CacheKeyByIdAndIndex(PEER, 1), registered[0])
        with code(S.LLM_PARAM_INVALID):
            cm.push_blocks(BlocksCacheKey(PEER), blocks[0], [0], [0])


# ================================================================================ CacheManager


class TestRegister:
    @pytest.mark.parametrize("method", ["register_cache", "register_blocks_cache"])
    def test_cache_desc_must_be_a_cache_desc(self, cm, method):
        with pytest.raises(TypeError):
            getattr(cm, method)(None, [4096])
        with pytest.raises(TypeError):
            getattr(cm, method)((4, [2, 64], F16), [4096] * 4)

    @pytest.mark.parametrize(("addrs", "expect"), [
        ("4096", pytest.raises(TypeError)), (4096, pytest.raises(TypeError)),
        (None, pytest.raises(TypeError)), ([4096, "8192", 1, 2], pytest.raises(TypeError)),
        ([4096, 1.0, 1, 2], pytest.raises(TypeError)),
        ([4096, -1, 1, 2], pytest.raises(ValueError)), ([4096, 2**64, 1, 2],
                                                        pytest.raises(ValueError)),
        ([], code(S.LLM_PARAM_INVALID)), ([4096, 0, 1, 2], code(S.LLM_PARAM_INVALID)),
        ([4096, 8192], code(S.LLM_PARAM_INVALID)),  # len != num_tensors
    ])
    @pytest.mark.parametrize("method", ["register_cache", "register_blocks_cache"])
    def test_addrs(self, cm, method, addrs, expect):
        with expect:
            getattr(cm, method)(contiguous_desc(), addrs)

    @pytest.mark.parametrize("method", ["register_cache", "register_blocks_cache"])
    def test_remote_accessible_must_be_bool(self, cm, method):
        desc = contiguous_desc()
        arr, addrs = host_memory(desc)
        with pytest.raises(TypeError):
            getattr(cm, method)(desc, addrs, remote_accessible=1)

    @pytest.mark.parametrize("method", ["register_cache", "register_blocks_cache"])
    def test_remote_accessible_after_link_is_param_invalid(self, cm, method):
        desc = contiguous_desc()
        arr, addrs = host_memory(desc)
        cm.set_is_call_linked()
        with code(S.LLM_PARAM_INVALID):
            getattr(cm, method)(desc, addrs, remote_accessible=True)
        assert getattr(cm, method)(desc, addrs, remote_accessible=False).cache_id == 1

    @pytest.mark.parametrize("cache_keys", [None, CacheKey(ME, 1), [BlocksCacheKey(ME)],
                                            [CacheKey(ME, 1), (ME, 2)]])
    def test_cache_keys_must_be_a_list_of_cache_keys(self, cm, cache_keys):
        desc = contiguous_desc()
        arr, addrs = host_memory(desc)
        with pytest.raises(TypeError):
            cm.register_cache(desc, addrs, cache_keys)

    def test_blocks_cache_key_must_be_a_blocks_cache_key(self, cm):
        desc = blocks_desc()
        arr, addrs = host_memory(desc)
        with pytest.raises(TypeError):
            cm.register_blocks_cache(desc, addrs, CacheKey(ME, 1))

    @pytest.mark.parametrize("desc", [
        CacheDesc(4, [2, 0], F16, HOST),  # an empty dim
        CacheDesc(4, [1] * 33, F16, HOST),  # more than 32 dims
        CacheDesc(4, [2, 64], DataType.DT_STRING, HOST),
    ])
    @pytest.mark.parametrize("method", ["register_cache", "register_blocks_cache"])
    def test_unusable_desc_is_param_invalid(self, cm, method, desc):
        with code(S.LLM_PARAM_INVALID):
            getattr(cm, method)(desc, [4096 * (i + 1) for i in range(4)])

    def test_scalar_desc_is_refused_when_built(self):
        # hixl v2/llm_types.py CacheDesc.__init__: 0 <= batch_dim_index < len(shape).
        with code(S.LLM_PARAM_INVALID):
            CacheDesc(4, [], F16, HOST)

    def test_key_errors(self, cm):
        desc = contiguous_desc(batch=2)
        arr, addrs = host_memory(desc)
        with code(S.LLM_PARAM_INVALID):  # duplicates
            cm.register_cache(desc, addrs, [CacheKey(ME, 5), CacheKey(ME, 5)])
        with code(S.LLM_PARAM_INVALID):  # more keys than batch slots
            cm.register_cache(desc, addrs, [CacheKey(ME, i) for i in range(3)])
        cm.register_cache(desc, addrs, [CacheKey(ME, 5)])
        with code(S.LLM_PARAM_INVALID):  # already bound (the cluster id is not part)
            cm.register_cache(desc, addrs, [CacheKey(ME + 7, 5)])
        # another model_id is another key
        cm.register_cache(desc, addrs, [CacheKey(ME, 5, 1)])

    def test_unregister_checks_its_argument(self, cm):
        with pytest.raises(TypeError):
            cm.unregister_cache("1")
        with pytest.raises(ValueError):
            cm.unregister_cache(2**63)


class TestAllocate:
    @pytest.mark.parametrize("method", ["allocate_cache", "allocate_blocks_cache"])
    @pytest.mark.parametrize("placement", [HOST, DEVICE])
    def test_without_a_pool_is_param_invalid(self, make_datadist, method, placement):
        cm = make_datadist(NO_POOL_OPTS).cache_manager
        with code(S.LLM_PARAM_INVALID):
            getattr(cm, method)(contiguous_desc(placement=placement))

    def test_pool_must_match_placement(self, make_datadist):
        only_host = {"llm.EnableCacheManager": "1",
                     "llm.HostMemPoolConfig": CM_OPTS["llm.HostMemPoolConfig"]}
        cm = make_datadist(only_host).cache_manager
        with code(S.LLM_PARAM_INVALID):
            cm.allocate_cache(contiguous_desc(placement=DEVICE))
        assert cm.allocate_cache(contiguous_desc(placement=HOST)).cache_id == 1

    @pytest.mark.parametrize(("placement", "status"), [
        (HOST, S.LLM_OUT_OF_MEMORY), (DEVICE, S.LLM_DEVICE_OUT_OF_MEMORY),
    ])
    @pytest.mark.parametrize("method", ["allocate_cache", "allocate_blocks_cache"])
    def test_pool_exhaustion(self, cm, method, placement, status):
        too_big = CacheDesc(2, [POOL // 4, 2], F16, placement)  # 2 x POOL bytes
        with code(status):
            getattr(cm, method)(too_big)
        half = CacheDesc(2, [POOL // 8, 2], F16, placement)  # 2 x POOL/2 bytes: fits once
        first = getattr(cm, method)(half)
        with code(status):
            getattr(cm, method)(half)
        assert first.cache_id == 1  # failed allocations take no cache id

    def test_desc_and_keys_types(self, cm):
        with pytest.raises(TypeError):
            cm.allocate_cache("desc")
        with pytest.raises(TypeError):
            cm.allocate_cache(contiguous_desc(), CacheKey(ME, 1))
        with pytest.raises(TypeError):
            cm.allocate_cache(contiguous_desc(), [1, 2])
        with pytest.raises(TypeError):
            cm.allocate_blocks_cache(blocks_desc(), CacheKey(ME, 1))

    def test_num_tensors_zero_is_param_invalid(self, cm):
        with code(S.LLM_PARAM_INVALID):
            cm.allocate_cache(CacheDesc(0, [2, 64], F16, HOST))

    def test_key_errors_leave_nothing_behind(self, cm):
        desc = CacheDesc(2, [2, POOL // 8], F16, HOST)  # needs the whole pool
        with code(S.LLM_PARAM_INVALID):
            cm.allocate_cache(desc, [CacheKey(ME, 5), CacheKey(ME, 5)])
        with code(S.LLM_PARAM_INVALID):
            cm.allocate_cache(desc, [CacheKey(ME, i) for i in range(3)])
        # neither the memory nor key 5 is held by the failed calls
        cache = cm.allocate_cache(desc, [CacheKey(ME, 5)])
        assert cache.cache_id == 1

    def test_padding_key_binds_nothing(self, cm):
        pad = CacheKey(ME, U64)
        a = cm.allocate_cache(contiguous_desc(), [pad, CacheKey(ME, 1)])
        b = cm.allocate_cache(contiguous_desc(), [pad])  # the padding key is never "bound"
        assert (a.cache_id, b.cache_id) == (1, 2)


class TestDeallocate:
    def test_types(self, cm):
        with pytest.raises(TypeError):
            cm.deallocate_cache(1)
        with pytest.raises(TypeError):
            cm.deallocate_blocks_cache(None)

    def test_wrong_kind_is_param_invalid(self, cm):
        contiguous = cm.allocate_cache(contiguous_desc())
        paged = cm.allocate_blocks_cache(blocks_desc())
        with code(S.LLM_PARAM_INVALID):
            cm.deallocate_cache(paged)
        with code(S.LLM_PARAM_INVALID):
            cm.deallocate_blocks_cache(contiguous)

    def test_deallocate_twice_is_a_noop(self, cm):
        cache = cm.allocate_cache(contiguous_desc())
        assert len(cache.tensor_addrs) == 4
        cm.deallocate_cache(cache)
        assert cache.tensor_addrs == []
        cm.deallocate_cache(cache)
        paged = cm.allocate_blocks_cache(blocks_desc())
        cm.deallocate_blocks_cache(paged)
        cm.deallocate_blocks_cache(paged)

    def test_deallocate_of_a_cpu_cache_is_a_noop(self, cm):
        desc = contiguous_desc()
        arr, addrs = host_memory(desc)
        cm.deallocate_blocks_cache(Cache.create_cpu_cache(desc, addrs))

    def test_deallocate_frees_pool_memory(self, cm):
        whole = CacheDesc(2, [2, POOL // 8], F16, HOST)
        for _ in range(3):
            cm.deallocate_cache(cm.allocate_cache(whole))
        for _ in range(3):
            cm.deallocate_blocks_cache(cm.allocate_blocks_cache(whole))

    def test_a_bound_key_holds_memory_until_removed(self, cm):
        whole = CacheDesc(2, [2, POOL // 8], F16, HOST)
        cache = cm.allocate_cache(whole, [CacheKey(ME, 9)])
        cm.deallocate_cache(cache)
        with code(S.LLM_OUT_OF_MEMORY):  # key 9 still holds the memory
            cm.allocate_cache(whole)
        cm.remove_cache_key(CacheKey(PEER, 9))  # the cluster id is not part of the key
        cm.allocate_cache(whole)

    def test_deallocate_of_registered_memory_is_a_noop(self, cm, registered):
        cache, _ = registered
        cm.deallocate_cache(cache)
        assert len(cache.tensor_addrs) == 4
        # still registered: a pull into it gets past the local-cache check
        with code(S.LLM_NOT_YET_LINK):
            cm.pull_cache(CacheKeyByIdAndIndex(PEER, 1), cache)


class TestRemoveCacheKey:
    @pytest.mark.parametrize("key", [None, BlocksCacheKey(ME), CacheKeyByIdAndIndex(ME, 1), 5])
    def test_type(self, cm, key):
        with pytest.raises(TypeError):
            cm.remove_cache_key(key)

    def test_unknown_key_is_a_noop(self, cm):
        cm.remove_cache_key(CacheKey(ME, 12345))
        cm.remove_cache_key(CacheKey(ME, U64))  # the padding key

    def test_keys_on_registered_memory_are_kept(self, cm):
        desc = contiguous_desc()
        arr, addrs = host_memory(desc)
        cm.register_cache(desc, addrs, [CacheKey(ME, 3)])
        cm.remove_cache_key(CacheKey(ME, 3))
        with code(S.LLM_PARAM_INVALID):  # still bound
            cm.allocate_cache(contiguous_desc(), [CacheKey(ME, 3)])

    def test_removed_key_can_be_bound_again(self, cm):
        cm.allocate_cache(contiguous_desc(), [CacheKey(ME, 3)])
        cm.remove_cache_key(CacheKey(ME, 3))
        cm.allocate_cache(contiguous_desc(), [CacheKey(ME, 3)])


class TestRegistrySemantics:
    def test_cache_ids_count_from_one_per_init(self, make_datadist):
        dd = make_datadist()
        cm = dd.cache_manager
        desc = contiguous_desc()
        arr, addrs = host_memory(desc)
        barr, baddrs = host_memory(blocks_desc())
        ids = [cm.register_cache(desc, addrs).cache_id,
               cm.allocate_cache(desc).cache_id,
               cm.register_blocks_cache(blocks_desc(), baddrs).cache_id,
               cm.allocate_blocks_cache(blocks_desc()).cache_id]
        assert ids == [1, 2, 3, 4]
        cm.unregister_cache(1)
        assert cm.register_cache(desc, addrs).cache_id == 5  # ids are never reused
        dd.finalize()
        again = make_datadist(cluster_id=2).cache_manager
        assert again.register_cache(desc, addrs).cache_id == 1

    def test_unregister_unknown_succeeds(self, cm):
        assert cm.unregister_cache(42) is None
        assert cm.unregister_cache(-1) is None

    def test_unregistered_cache_no_longer_exists(self, cm, registered):
        cache, _ = registered
        cm.unregister_cache(cache.cache_id)
        cm.unregister_cache(cache.cache_id)
        with code(S.LLM_KV_CACHE_NOT_EXIST):
            cm.pull_cache(CacheKeyByIdAndIndex(PEER, 1), cache)

    def test_cache_str(self, cm, registered):
        assert str(registered[0]) == \
            "Cache(cache_id = 1, device_tensor_addrs = 4, is_blocks_cache = False)"


# ---------------------------------------------------------------------------------- pulls


LAYER_ERRORS = [
    # (kwargs, expected): the layer-range rules of spec §8.6 / §9
    ({"src_layer_range": (0, 1)}, pytest.raises(TypeError)),
    ({"dst_layer_range": [0, 1]}, pytest.raises(TypeError)),
    ({"src_layer_range": range(0, 2, 2)}, code(S.LLM_PARAM_INVALID)),  # step != 1
    ({"dst_layer_range": range(1, 0, -1)}, code(S.LLM_PARAM_INVALID)),
    ({"src_layer_range": range(1, 1)}, code(S.LLM_PARAM_INVALID)),  # start >= stop
    ({"dst_layer_range": range(2, 1)}, code(S.LLM_PARAM_INVALID)),
    ({"src_layer_range": range(-1, 1)}, code(S.LLM_PARAM_INVALID)),  # start < 0
    ({"src_layer_range": range(0, 1), "dst_layer_range": range(0, 2)},
     code(S.LLM_PARAM_INVALID)),  # unequal lengths
    ({"src_layer_range": range(0, 1)}, code(S.LLM_PARAM_INVALID)),  # != all dst layers
    ({"dst_layer_range": range(1, 3)}, code(S.LLM_PARAM_INVALID)),  # past the last layer
    ({"src_layer_range": range(0, 1), "tensor_num_per_layer": 3},
     code(S.LLM_PARAM_INVALID)),  # 4 tensors are not layers of 3
    ({"tensor_num_per_layer": 0}, code(S.LLM_PARAM_INVALID)),
    ({"tensor_num_per_layer": -1}, pytest.raises(ValueError)),
    ({"tensor_num_per_layer": 2**32}, pytest.raises(ValueError)),
    ({"tensor_num_per_layer": "2"}, pytest.raises(TypeError)),
    # other keywords are ignored, as hixl v2/cache_manager.py (kwargs.get of the three):
    # the pull goes as far as the missing link
    ({"src_cache_offset": 0}, code(S.LLM_NOT_YET_LINK)),  # a v1-only kwarg
    ({"layer_range": range(0, 1)}, code(S.LLM_NOT_YET_LINK)),
]


class TestPullCache:
    @pytest.mark.parametrize("key", [BlocksCacheKey(PEER), None, (PEER, 1)])
    def test_cache_key_type(self, cm, registered, key):
        with pytest.raises(TypeError):
            cm.pull_cache(key, registered[0])

    def test_cache_type(self, cm):
        with pytest.raises(TypeError):
            cm.pull_cache(CacheKey(PEER, 1), 1)

    @pytest.mark.parametrize(("kwargs", "expect"), [
        ({"batch_index": -1}, pytest.raises(ValueError)),
        ({"batch_index": 2**32}, pytest.raises(ValueError)),
        ({"batch_index": "0"}, pytest.raises(TypeError)),
        ({"size": "1"}, pytest.raises(TypeError)),
        ({"size": 2**63}, pytest.raises(ValueError)),
        ({"size": 0}, code(S.LLM_PARAM_INVALID)),
        ({"size": -2}, code(S.LLM_PARAM_INVALID)),
        ({"batch_index": 2}, code(S.LLM_PARAM_INVALID)),  # the cache has batch 2
        ({"size": 129}, code(S.LLM_PARAM_INVALID)),  # one slot is 128 bytes
    ])
    def test_arguments(self, cm, registered, kwargs, expect):
        with expect:
            cm.pull_cache(CacheKey(PEER, 1), registered[0], **kwargs)

    @pytest.mark.parametrize(("kwargs", "expect"), LAYER_ERRORS)
    def test_layer_kwargs(self, cm, registered, kwargs, expect):
        with expect:
            cm.pull_cache(CacheKey(PEER, 1), registered[0], **kwargs)

    def test_blocks_cache_destination_is_param_invalid(self, cm, blocks):
        with code(S.LLM_PARAM_INVALID):
            cm.pull_cache(CacheKey(PEER, 1), blocks[0])

    @pytest.mark.parametrize("key", [CacheKey(PEER, U64), CacheKey(PEER, 1, prefix_id=2)])
    def test_exactly_one_of_req_id_and_prefix_id(self, cm, registered, key):
        with code(S.LLM_PARAM_INVALID):
            cm.pull_cache(key, registered[0])

    def test_unknown_local_cache_comes_after_the_argument_checks(self, cm):
        # the Python layer's checks come first (hixl v2/cache_manager.py pull_cache /
        # pull_blocks), the lookup of the local cache (native there) after them: a
        # create_cpu_cache handle is a blocks cache, which pull_cache refuses as such
        ghost = Cache.create_cpu_cache(contiguous_desc(), [4096, 8192, 12288, 16384])
        with code(S.LLM_PARAM_INVALID):
            cm.pull_cache(CacheKey(PEER, 1), ghost)
        with code(S.LLM_PARAM_INVALID):
            cm.pull_blocks(BlocksCacheKey(PEER, 0), ghost, [0], [])
        with code(S.LLM_KV_CACHE_NOT_EXIST):
            cm.pull_blocks(BlocksCacheKey(PEER, 0), ghost, [0], [0])

    def test_own_cluster_is_param_invalid(self, cm, registered):
        with code(S.LLM_PARAM_INVALID):
            cm.pull_cache(CacheKey(ME, 1), registered[0])
        with code(S.LLM_PARAM_INVALID):
            cm.pull_cache(CacheKeyByIdAndIndex(ME, 1), registered[0])

    def test_without_link_is_not_yet_link(self, cm, registered):
        with code(S.LLM_NOT_YET_LINK):
            cm.pull_cache(CacheKey(PEER, 1), registered[0])
        with code(S.LLM_NOT_YET_LINK):
            cm.pull_cache(CacheKeyByIdAndIndex(PEER, 1, 1), registered[0], 1, 64,
                          src_layer_range=range(0, 2), dst_layer_range=range(0, 2))

    def test_parameters_are_checked_before_the_link(self, cm, registered):
        with code(S.LLM_PARAM_INVALID):
            cm.pull_cache(CacheKey(PEER, 1), registered[0], size=0)

    def test_remote_cache_accessible_takes_only_id_keys(self, make_datadist):
        cm = make_datadist(RA_OPTS).cache_manager
        desc = contiguous_desc()
        arr, addrs = host_memory(desc)
        cache = cm.register_cache(desc, addrs)
        with pytest.raises(TypeError):  # the key type is checked against the mode
            cm.pull_cache(CacheKey(PEER, 1), cache)
        with code(S.LLM_NOT_YET_LINK):
            cm.pull_cache(CacheKeyByIdAndIndex(PEER, 1), cache)


class TestPullBlocks:
    @pytest.mark.parametrize("key", [None, 5, (PEER, 0)])
    def test_key_type(self, cm, blocks, key):
        with pytest.raises(TypeError):
            cm.pull_blocks(key, blocks[0], [0], [0])

    def test_dst_cache_type(self, cm):
        with pytest.raises(TypeError):
            cm.pull_blocks(BlocksCacheKey(PEER), "cache", [0], [0])

    @pytest.mark.parametrize(("src", "dst", "error"), [
        ("0", [0], TypeError), ([0], 0, TypeError), (None, [0], TypeError),
        ([0.0], [0], TypeError), ([0], ["1"], TypeError), ([[0]], [0], TypeError),
        ([-1], [0], ValueError), ([0], [2**64], ValueError),
    ])
    def test_block_list_types(self, cm, blocks, src, dst, error):
        with pytest.raises(error):
            cm.pull_blocks(BlocksCacheKey(PEER), blocks[0], src, dst)

    def test_non_blocks_destination_is_param_invalid(self, cm, registered):
        with code(S.LLM_PARAM_INVALID):
            cm.pull_blocks(BlocksCacheKey(PEER), registered[0], [0], [0])

    def test_empty_dst_blocks_is_param_invalid(self, cm, blocks):
        with code(S.LLM_PARAM_INVALID):
            cm.pull_blocks(BlocksCacheKey(PEER), blocks[0], [0], [])
        with code(S.LLM_PARAM_INVALID):
            cm.pull_blocks(CacheKey(PEER, 1), blocks[0])

    def test_blocks_key_needs_src_blocks(self, cm, blocks):
        with code(S.LLM_PARAM_INVALID):
            cm.pull_blocks(BlocksCacheKey(PEER), blocks[0], [], [0])

    @pytest.mark.parametrize("key", [CacheKey(PEER, 1), CacheKeyByIdAndIndex(PEER, 1)])
    def test_src_blocks_with_a_contiguous_key_is_param_invalid(self, cm, blocks, key):
        with code(S.LLM_PARAM_INVALID):
            cm.pull_blocks(key, blocks[0], [0], [0])

    def test_contiguous_key_checks_req_and_prefix(self, cm, blocks):
        with code(S.LLM_PARAM_INVALID):
            cm.pull_blocks(CacheKey(PEER, U64), blocks[0], (), [0])

    def test_unequal_block_lists_are_param_invalid(self, cm, blocks):
        with code(S.LLM_PARAM_INVALID):
            cm.pull_blocks(BlocksCacheKey(PEER), blocks[0], [0, 1], [0])

    def test_dst_block_out_of_range_is_param_invalid(self, cm, blocks):
        with code(S.LLM_PARAM_INVALID):
            cm.pull_blocks(BlocksCacheKey(PEER), blocks[0], [0], [8])
        with code(S.LLM_PARAM_INVALID):
            cm.pull_blocks(CacheKey(PEER, 1), blocks[0], [], [3, 8])

    @pytest.mark.parametrize(("kwargs", "expect"), LAYER_ERRORS)
    def test_layer_kwargs(self, cm, blocks, kwargs, expect):
        with expect:
            cm.pull_blocks(BlocksCacheKey(PEER), blocks[0], [0], [0], **kwargs)

    def test_unknown_local_cache(self, cm):
        desc = blocks_desc()
        arr, addrs = host_memory(desc)
        ghost = Cache.create_cpu_cache(desc, addrs)
        with code(S.LLM_KV_CACHE_NOT_EXIST):
            cm.pull_blocks(BlocksCacheKey(PEER), ghost, [0], [0])

    def test_own_cluster_is_param_invalid(self, cm, blocks):
        with code(S.LLM_PARAM_INVALID):
            cm.pull_blocks(BlocksCacheKey(ME), blocks[0], [0], [0])

    def test_without_link_is_not_yet_link(self, cm, blocks):
        with code(S.LLM_NOT_YET_LINK):
            cm.pull_blocks(BlocksCacheKey(PEER, 3), blocks[0], (0, 1), (5, 6),
                           src_layer_range=range(1, 2), dst_layer_range=range(0, 1))
        with code(S.LLM_NOT_YET_LINK):  # contiguous -> blocks
            cm.pull_blocks(CacheKeyByIdAndIndex(PEER, 1), blocks[0], dst_blocks=[2, 3])


class TestPush:
    @pytest.fixture
    def ra(self, make_datadist):
        cm = make_datadist(RA_OPTS).cache_manager
        desc, bdesc = contiguous_desc(), blocks_desc()
        arr, addrs = host_memory(desc)
        barr, baddrs = host_memory(bdesc)
        return cm, cm.register_cache(desc, addrs), cm.register_blocks_cache(bdesc, baddrs), \
            (arr, barr)

    def test_push_cache_arguments(self, ra):
        cm, cache, paged, _ = ra
        key = CacheKeyByIdAndIndex(PEER, 1)
        with pytest.raises(TypeError):
            cm.push_cache(CacheKey(PEER, 1), cache)
        with pytest.raises(TypeError):
            cm.push_cache(key, None)
        with pytest.raises(ValueError):
            cm.push_cache(key, cache, src_batch_index=-1)
        with code(S.LLM_PARAM_INVALID):
            cm.push_cache(key, cache, size=64)  # only -1 is supported
        with code(S.LLM_PARAM_INVALID):
            cm.push_cache(key, paged)
        with code(S.LLM_PARAM_INVALID):
            cm.push_cache(key, cache, src_layer_range=range(0, 1), dst_layer_range=range(0, 2))
        with code(S.LLM_PARAM_INVALID):
            cm.push_cache(key, cache, tensor_num_per_layer=0)
        with code(S.LLM_NOT_YET_LINK):  # no own-cluster rule for pushes in the original
            cm.push_cache(CacheKeyByIdAndIndex(ME, 1), cache)
        with code(S.LLM_NOT_YET_LINK):
            cm.push_cache(key, cache)

    def test_push_blocks_arguments(self, ra):
        cm, cache, paged, _ = ra
        key = BlocksCacheKey(PEER)
        with pytest.raises(TypeError):
            cm.push_blocks(CacheKeyByIdAndIndex(PEER, 1), paged, [0], [0])
        with pytest.raises(TypeError):
            cm.push_blocks(key, paged, "0", [0])
        with code(S.LLM_PARAM_INVALID):
            cm.push_blocks(key, cache, [0], [0])  # the source must be a blocks cache
        with code(S.LLM_PARAM_INVALID):
            cm.push_blocks(key, paged, [0], [])
        with code(S.LLM_PARAM_INVALID):
            cm.push_blocks(key, paged, [0], [0], src_layer_range=range(0, 2, 2))
        with code(S.LLM_NOT_YET_LINK):  # no own-cluster rule for pushes in the original
            cm.push_blocks(BlocksCacheKey(ME), paged, [0], [0])
        with code(S.LLM_NOT_YET_LINK):
            cm.push_blocks(key, paged, [0], [0])

    @pytest.mark.parametrize("method", ["push_cache", "push_blocks"])
    def test_push_layers_as_the_original(self, make_datadist, method):
        """hixl v2/cache_manager.py: both ranges default to every *local* layer and must be
        as long as each other; one native layer-wise transfer per layer, which refuses a
        source whose tensor count is not a multiple of tensor_num_per_layer
        (LayerWiseTransferJob::Prepare)."""
        cm = make_datadist(RA_OPTS).cache_manager
        blocks = method == "push_blocks"

        def source(num_tensors):
            desc = CacheDesc(num_tensors, [4, 64], F16)
            _, addrs = host_memory(desc)
            if blocks:
                return cm.register_blocks_cache(desc, addrs)
            return cm.register_cache(desc, addrs)

        def push(cache, **kw):
            if blocks:
                cm.push_blocks(BlocksCacheKey(PEER), cache, [0], [0], **kw)
            else:
                cm.push_cache(CacheKeyByIdAndIndex(PEER, 1), cache, **kw)

        four, three, one = source(4), source(3), source(1)
        with code(S.LLM_PARAM_INVALID):  # dst defaults to both local layers: 1 != 2
            push(four, src_layer_range=range(0, 1))
        with code(S.LLM_PARAM_INVALID):
            push(four, dst_layer_range=range(1, 2))
        with code(S.LLM_PARAM_INVALID):  # 3 tensors are not layers of 2
            push(three)
        with code(S.LLM_PARAM_INVALID):  # layer 2 of a 2-layer source
            push(four, src_layer_range=range(1, 3), dst_layer_range=range(0, 2))
        with code(S.LLM_NOT_YET_LINK):  # no whole layer: the original moves nothing, we
            push(one)  # push the one tensor (both report success), so the link is needed
        with code(S.LLM_NOT_YET_LINK):  # the same argument checks passed: now the link
            push(four, src_layer_range=range(1, 2), dst_layer_range=range(0, 1))
        with code(S.LLM_NOT_YET_LINK):
            push(three, tensor_num_per_layer=1)

    def test_unknown_local_source(self, ra):
        cm, _, _, _ = ra
        ghost = Cache(77, contiguous_desc(), [4096] * 4, None, True, False)
        with code(S.LLM_KV_CACHE_NOT_EXIST):
            cm.push_cache(CacheKeyByIdAndIndex(PEER, 1), ghost)


class TestCheckCacheKey:
    def test_valid(self):
        from datadist.api.cache_manager import CacheManager

        CacheManager.check_cache_key(CacheKey(PEER, 1))
        CacheManager.check_cache_key(CacheKey(PEER, U64, prefix_id=4))

    @pytest.mark.parametrize("key", [CacheKey(PEER, U64), CacheKey(PEER, 1, 0, 2)])
    def test_invalid(self, key):
        from datadist.api.cache_manager import CacheManager

        with code(S.LLM_PARAM_INVALID):
            CacheManager.check_cache_key(key)

    def test_type(self):
        # hixl v2/cache_manager.py CacheManager.check_cache_key reads req_id without a type
        # check: another key kind has no such attribute.
        from datadist.api.cache_manager import CacheManager

        with pytest.raises(AttributeError):
            CacheManager.check_cache_key(BlocksCacheKey(PEER))


# ---------------------------------------------------------------------------------- with a peer


def _fill(addr: int, nbytes: int, value: int) -> None:
    ctypes.memset(addr, value, nbytes)


@pytest.mark.timeout(30)
class TestRemoteErrors:
    """Errors the owner of the remote cache reports, relayed with their status code."""

    def test_unknown_remote_key_or_cache(self, cm, registered, blocks, linked):
        with code(S.LLM_KV_CACHE_NOT_EXIST):
            cm.pull_cache(CacheKey(PEER, 12345), registered[0])
        with code(S.LLM_KV_CACHE_NOT_EXIST):
            cm.pull_cache(CacheKeyByIdAndIndex(PEER, 999), registered[0])
        with code(S.LLM_KV_CACHE_NOT_EXIST):
            cm.pull_blocks(BlocksCacheKey(PEER, 3), blocks[0], [0], [0])

    def test_remote_bounds_are_param_invalid(self, cm, registered, blocks, linked):
        geo = Geometry(4, 256, 2, False)  # the same shape as ``registered``
        entry = linked.allocate(geo, placement=HOST)
        with code(S.LLM_PARAM_INVALID):  # remote batch index out of range
            cm.pull_cache(CacheKeyByIdAndIndex(PEER, entry.cache_id, 2), registered[0])
        other = Geometry(4, 8 * 64, 8, True)  # 64-byte blocks; ours are 32
        linked.allocate(other, placement=HOST, blocks_model_id=0)
        with code(S.LLM_PARAM_INVALID):
            cm.pull_blocks(BlocksCacheKey(PEER, 0), blocks[0], [0], [0])

    def test_req_id_key_is_consumed_by_a_pull(self, cm, registered, linked):
        cache, arr = registered
        geo = Geometry(4, 256, 2, False)
        entry = linked.allocate(geo, placement=HOST, keys=[key_id(7, U64, 0)])
        for i, addr in enumerate(entry.addrs.tolist()):
            _fill(addr, 128, 0x10 + i)  # slot 0 of tensor i
        cm.pull_cache(CacheKey(PEER, 7), cache, batch_index=1)
        got = arr.view(np.uint8).reshape(4, 2, 128)
        assert [set(got[i, 1].tolist()) for i in range(4)] == [{0x10 + i} for i in range(4)]
        assert not got[:, 0].any()  # slot 0 untouched
        with code(S.LLM_KV_CACHE_NOT_EXIST):
            cm.pull_cache(CacheKey(PEER, 7), cache, batch_index=1)
        cm.remove_cache_key(CacheKey(PEER, 7))  # a no-op once consumed


# ================================================================================ value types


class TestCacheDesc:
    def test_defaults_and_properties(self):
        d = CacheDesc(4, (3, 5, 7), DataType.DT_FLOAT)
        assert d.num_tensors == 4
        assert d.shape == (3, 5, 7)  # hixl v2/llm_types.py CacheDesc keeps the caller's shape
        assert d.data_type is DataType.DT_FLOAT
        assert d.placement is Placement.DEVICE
        assert d.batch_dim == 0 and d.batch_size == 3
        assert d.seq_len_dim_index == -1
        assert d.kv_tensor_format is None
        assert d.size == 3 * 5 * 7 * 4

    def test_batch_dim_index_picks_batch_size(self):
        assert CacheDesc(1, [3, 5], F16, HOST, batch_dim_index=1).batch_size == 5

    def test_update_dim(self):
        d = CacheDesc(1, [3, 5], F16)
        d.update_dim(1, 9)
        assert d.shape == [3, 9] and d.size == 3 * 9 * 2
        with code(S.LLM_PARAM_INVALID):
            d.update_dim(2, 1)
        with pytest.raises(TypeError):
            d.update_dim(0, "1")

    @pytest.mark.parametrize(("args", "kwargs", "error"), [
        (("4", [2], F16), {}, TypeError),
        ((4.0, [2], F16), {}, TypeError),
        ((-1, [2], F16), {}, ValueError),
        ((2**32, [2], F16), {}, ValueError),
        ((4, "2", F16), {}, TypeError),
        ((4, 2, F16), {}, TypeError),
        ((4, [2.0], F16), {}, TypeError),
        ((4, [2**63], F16), {}, ValueError),
        ((4, [2], 1), {}, TypeError),
        ((4, [2], "DT_FLOAT16"), {}, TypeError),
        ((4, [2], F16, 1), {}, TypeError),
        ((4, [2], F16), {"batch_dim_index": "0"}, TypeError),
        ((4, [2], F16), {"kv_tensor_format": 1}, TypeError),
    ])
    def test_type_and_range_errors(self, args, kwargs, error):
        with pytest.raises(error):
            CacheDesc(*args, **kwargs)

    @pytest.mark.parametrize("kwargs", [
        {"batch_dim_index": 2}, {"batch_dim_index": -1}, {"seq_len_dim_index": 2},
        {"seq_len_dim_index": -2},
    ])
    def test_dim_indexes_out_of_range(self, kwargs):
        with code(S.LLM_PARAM_INVALID):
            CacheDesc(4, [2, 3], F16, **kwargs)

    def test_string_has_no_size(self):
        with code(S.LLM_PARAM_INVALID):
            CacheDesc(1, [2], DataType.DT_STRING).size  # noqa: B018


class TestKeys:
    def test_cache_key_positional_and_defaults(self):
        k = CacheKey(3, 4)
        assert (k.cluster_id, k.prompt_cluster_id, k.req_id, k.model_id, k.prefix_id) == \
            (3, 3, 4, 0, U64)
        k = CacheKey(3, 4, 5, 6)
        assert (k.cluster_id, k.req_id, k.model_id, k.prefix_id) == (3, 4, 5, 6)

    def test_cache_key_keywords(self):
        assert CacheKey(prompt_cluster_id=3, req_id=4).cluster_id == 3
        assert CacheKey(cluster_id=3, req_id=4, model_id=2).model_id == 2
        assert CacheKey(3, req_id=4, prefix_id=1).prefix_id == 1

    @pytest.mark.parametrize(("args", "kwargs"), [
        ((1, 2, 3, 4, 5), {}),  # at most 4
        ((1, 2), {"foo": 1}),  # unknown keyword
        ((1,), {}),  # req_id missing
        ((), {"req_id": 1}),  # cluster_id missing
        ((1, 2, 3), {"cluster_id": 1, "req_id": 2}),  # 5 in all
    ])
    def test_cache_key_bad_parameters(self, args, kwargs):
        with code(S.LLM_PARAM_INVALID):
            CacheKey(*args, **kwargs)

    def test_cache_key_name_given_twice(self):
        # hixl v2/llm_types.py CacheKey.__init__ / BlocksCacheKey.__init__: a positional
        # argument overwrites the keyword of the same name; cluster_id wins over
        # prompt_cluster_id. Neither is an error.
        assert CacheKey(1, 2, cluster_id=9).cluster_id == 1
        assert CacheKey(cluster_id=1, prompt_cluster_id=5, req_id=2).cluster_id == 1
        assert BlocksCacheKey(3, model_id=4).model_id == 4
        assert BlocksCacheKey(3, cluster_id=8).cluster_id == 3
        assert BlocksCacheKey(prompt_cluster_id=6, cluster_id=7).cluster_id == 7
        with code(S.LLM_PARAM_INVALID):
            BlocksCacheKey(1, 2, model_id=3)

    @pytest.mark.parametrize(("args", "error"), [
        ((-1, 1), ValueError), ((1, 2**64), ValueError), ((1, 1, -1), ValueError),
        ((1, 1, 0, 2**64), ValueError), (("1", 1), TypeError), ((1, 1.0), TypeError),
    ])
    def test_cache_key_ranges(self, args, error):
        with pytest.raises(error):
            CacheKey(*args)

    def test_cache_key_by_id(self):
        k = CacheKeyByIdAndIndex(3, 4)
        assert (k.cluster_id, k.cache_id, k.batch_index) == (3, 4, 0)
        assert CacheKeyByIdAndIndex(3, -1, 2**32 - 1).batch_index == 2**32 - 1

    @pytest.mark.parametrize(("args", "error"), [
        ((-1, 1), ValueError), ((1, 2**63), ValueError), ((1, 1, -1), ValueError),
        ((1, 1, 2**32), ValueError), (("1", 1), TypeError), ((1, None), TypeError),
        ((1, 1, 0.0), TypeError),
    ])
    def test_cache_key_by_id_errors(self, args, error):
        with pytest.raises(error):
            CacheKeyByIdAndIndex(*args)

    def test_blocks_cache_key(self):
        k = BlocksCacheKey(3)
        assert (k.cluster_id, k.prompt_cluster_id, k.model_id) == (3, 3, 0)
        assert BlocksCacheKey(prompt_cluster_id=3, model_id=2).model_id == 2
        assert BlocksCacheKey(cluster_id=3).cluster_id == 3
        # ints of any range: llm_datadist checks the type only
        assert BlocksCacheKey(-1, 2**70).model_id == 2**70

    @pytest.mark.parametrize(("args", "kwargs", "expect"), [
        ((1, 2, 3), {}, code(S.LLM_PARAM_INVALID)),
        ((1,), {"foo": 2}, code(S.LLM_PARAM_INVALID)),
        ((), {"model_id": 2}, code(S.LLM_PARAM_INVALID)),
        (("1",), {}, pytest.raises(TypeError)),
        ((1, 2.0), {}, pytest.raises(TypeError)),
    ])
    def test_blocks_cache_key_errors(self, args, kwargs, expect):
        with expect:
            BlocksCacheKey(*args, **kwargs)


class TestCpuCache:
    def test_create_cpu_cache(self):
        desc = contiguous_desc()
        arr, addrs = host_memory(desc)
        c = Cache.create_cpu_cache(desc, addrs)
        assert c.cache_id == -1 and c.is_blocks_cache and c.tensor_addrs == addrs
        assert c.cache_desc is desc

    def test_errors(self):
        desc = contiguous_desc()
        with pytest.raises(TypeError):
            Cache.create_cpu_cache("desc", [1, 2, 3, 4])
        with pytest.raises(TypeError):
            Cache.create_cpu_cache(desc, 4096)
        with pytest.raises(TypeError):
            Cache.create_cpu_cache(desc, [1, 2, 3, "4"])
        with pytest.raises(ValueError):
            Cache.create_cpu_cache(desc, [1, 2, 3, -4])
        with code(S.LLM_PARAM_INVALID):
            Cache.create_cpu_cache(contiguous_desc(placement=DEVICE), [1, 2, 3, 4])
        with code(S.LLM_PARAM_INVALID):
            Cache.create_cpu_cache(desc, [1, 2, 3])


class TestOtherValueTypes:
    def test_mem_info(self):
        m = MemInfo(Memtype.MEM_TYPE_DEVICE, 4096, 8192)
        assert (m.mem_type, m.addr, m.size) == (Memtype.MEM_TYPE_DEVICE, 4096, 8192)
        with pytest.raises(TypeError):
            MemInfo(0, 4096, 8192)
        with pytest.raises(TypeError):
            MemInfo(Memtype.MEM_TYPE_HOST, 1.5, 1)
        # hixl v2/llm_types.py MemInfo.__init__ checks types only; values are checked by
        # remap_registered_memory.
        assert MemInfo(Memtype.MEM_TYPE_HOST, -1, 1).addr == -1

    def test_transfer_with_cache_key_config(self):
        cfg = TransferWithCacheKeyConfig(BlocksCacheKey(PEER), range(0, 2), range(1, 3))
        assert cfg.dst_cluster_id == PEER and cfg.src_batch_index == 0
        with pytest.raises(TypeError):
            TransferWithCacheKeyConfig(CacheKey(PEER, 1))
        with pytest.raises(TypeError):
            TransferWithCacheKeyConfig(BlocksCacheKey(PEER), (0, 2))
        with code(S.LLM_PARAM_INVALID):
            TransferWithCacheKeyConfig(BlocksCacheKey(PEER), range(0, 4, 2))
        with pytest.raises(TypeError):  # both ranges are required (hixl v2/llm_types.py)
            TransferWithCacheKeyConfig(BlocksCacheKey(PEER), None, range(2, 3))
        with code(S.LLM_PARAM_INVALID):
            TransferWithCacheKeyConfig(BlocksCacheKey(PEER), range(0, 1), range(2, 2))

    def test_transfer_config(self):
        cfg = TransferConfig(PEER, [4096, 8192], range(0, 1))
        assert cfg.dst_addrs == [4096, 8192] and cfg.dst_layer_range is None
        with pytest.raises(ValueError):
            TransferConfig(-1, [4096])
        with pytest.raises(TypeError):
            TransferConfig(PEER, 4096)
        with code(S.LLM_PARAM_INVALID):
            TransferConfig(PEER, [4096], range(1, 0))
        with pytest.raises(ValueError):
            cfg.src_batch_index = -1
