"""A careless caller gets a clear error, never corruption or a crash (issue 9, items 10-17).

Each test names its item. The engines run in this process (two core ``Engine`` s linked both
ways, each with the facade it needs), or as the real ``LLMDataDist`` where a session matters.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import pytest

import datadist as llm
from datadist.api.cache_manager import CacheManager
from datadist.core.engine import Engine, EngineConfig

pytestmark = pytest.mark.timeout(60)

S = llm.LLMStatusCode
PROMPT_ID, DECODER_ID = 1, 2


@contextlib.contextmanager
def code(status: llm.LLMStatusCode, match: str | None = None) -> Iterator[None]:
    with pytest.raises(llm.LLMException, match=match) as info:
        yield
    assert info.value.status_code == status, info.value


class Sync(llm.LayerSynchronizer):
    def synchronize_layer(self, layer_index, timeout_in_millis):
        return True


@pytest.fixture
def ra_pair() -> Iterator[tuple[CacheManager, CacheManager]]:
    """A PROMPT and a DECODER cache manager, remote-cache-accessible, linked both ways."""
    engines = [Engine(EngineConfig(cluster_id=c, role=r, listen=("127.0.0.1", 0),
                                   sync_timeout=5.0)) for c, r in ((PROMPT_ID, 1), (DECODER_ID, 2))]
    p, d = engines
    try:
        d.link(PROMPT_ID, *p.listen_address, 5.0)
        p.link(DECODER_ID, *d.listen_address, 5.0)
        yield (CacheManager(p, remote_cache_accessible=True),
               CacheManager(d, remote_cache_accessible=True))
    finally:
        for e in engines:
            e.close()


@pytest.fixture
def make_datadist() -> Iterator:
    made: list[llm.LLMDataDist] = []

    def make(options: dict[str, str], role=llm.LLMRole.DECODER, cluster_id=DECODER_ID):
        dd = llm.LLMDataDist(role, cluster_id)
        dd.init(options)
        made.append(dd)
        return dd

    yield make
    for dd in made:
        dd.finalize()


# ---------------------------------------------------------------------------------- item 10


class TestBlockOffsetsNeverWrap:
    """Item 10: a block index whose byte offset passes 2**64 is PARAM_INVALID, wherever
    block indexes become offsets, and nothing is written."""

    BLOCK = 256  # 2**56 * 256 == 2**64: block 2**56 + 1 would wrap to block 1

    def _blocks(self, cm: CacheManager, model_id: int | None, seed: int | None):
        desc = llm.CacheDesc(2, [4, self.BLOCK], llm.DataType.DT_UINT8, llm.Placement.DEVICE)
        arr = np.zeros((2, 4 * self.BLOCK), np.uint8)
        if seed is not None:
            arr[...] = np.random.default_rng(seed).integers(1, 256, arr.shape, dtype=np.uint8)
        key = None if model_id is None else llm.BlocksCacheKey(cm._engine.config.cluster_id,
                                                                model_id)
        cache = cm.register_blocks_cache(desc, [int(a.ctypes.data) for a in arr], key)
        return cache, arr

    def test_transfer_cache_async_dst_block_that_wraps(self, ra_pair):
        p, d = ra_pair
        src, _ = self._blocks(p, None, seed=1)
        _, dst = self._blocks(d, 7, seed=None)
        cfg = llm.TransferWithCacheKeyConfig(llm.BlocksCacheKey(DECODER_ID, 7), range(0, 1),
                                             range(0, 1))
        with code(S.LLM_PARAM_INVALID, "overflows 64 bits"):
            task = p.transfer_cache_async(src, Sync(), [cfg], src_block_indices=[0],
                                          dst_block_indices=[2**56 + 1])
            task.synchronize(5000)  # the old code got here: SUCCESS, block 1 written
        assert not dst.any()

    def test_slot_into_blocks_with_a_wrapping_block_size(self, ra_pair):
        p, d = ra_pair
        desc = llm.CacheDesc(2, [1, 4 * self.BLOCK], llm.DataType.DT_UINT8,
                             llm.Placement.DEVICE)
        arr = np.ones((2, 4 * self.BLOCK), np.uint8)
        src = p.register_cache(desc, [int(a.ctypes.data) for a in arr])
        _, dst = self._blocks(d, 7, seed=None)
        cfg = llm.TransferWithCacheKeyConfig(llm.BlocksCacheKey(DECODER_ID, 7), range(0, 1),
                                             range(0, 1))
        # three chunks of 2**63 bytes: chunk 2 starts at 2**64, which wrapped to 0 < stride
        with code(S.LLM_PARAM_INVALID):
            p.transfer_cache_async(src, Sync(), [cfg], dst_block_indices=[0, 1, 2],
                                   dst_block_memory_size=2**63)
        assert not dst.any()

    def test_raw_address_plus_offset_that_wraps(self, make_datadist):
        dd = make_datadist({"llm.listenIpInfo": "127.0.0.1:0"}, llm.LLMRole.PROMPT, PROMPT_ID)
        kv = dd.kv_cache_manager
        desc = llm.CacheDesc(2, [2, 64], llm.DataType.DT_UINT8, llm.Placement.DEVICE)
        src = kv.allocate_cache(desc)
        top = 2**64 - 32  # + the slot's 64 bytes passes 2**64
        cfg = llm.TransferConfig(DECODER_ID, [top, top], range(0, 1), 1)
        with code(S.LLM_PARAM_INVALID, "overflows 64 bits"):
            kv.transfer_cache_async(src, Sync(), [cfg])

    def test_local_copies_and_pulls_still_refuse_huge_blocks(self, ra_pair):
        p, _ = ra_pair
        cache, _ = self._blocks(p, None, seed=3)
        with code(S.LLM_PARAM_INVALID):
            p.copy_blocks(cache, {2**56 + 1: [1]})
        with code(S.LLM_PARAM_INVALID):
            p.pull_blocks(llm.BlocksCacheKey(DECODER_ID, 7), cache, [2**56 + 1], [1])
        with code(S.LLM_PARAM_INVALID):
            p.push_blocks(llm.BlocksCacheKey(DECODER_ID, 7), cache, [0], [2**56 + 1])


# ---------------------------------------------------------------------------------- item 14


POOL = {"llm.EnableCacheManager": "1", "llm.MemPoolConfig": '{"memory_size": 1048576}'}


class TestStaleHandles:
    """Item 14: a handle from before finalize() + init() names a cache of a finished
    session; it never reaches the new session's cache with the same id."""

    def test_stale_cache_handle_cannot_free_the_new_sessions_cache(self):
        desc = llm.CacheDesc(2, [2, 64], llm.DataType.DT_UINT8, llm.Placement.DEVICE)
        dd = llm.LLMDataDist(llm.LLMRole.DECODER, DECODER_ID)
        try:
            dd.init(dict(POOL))
            old = dd.cache_manager.allocate_cache(desc)
            dd.finalize()
            dd.init(dict(POOL))
            cm = dd.cache_manager
            new = cm.allocate_cache(desc)
            assert new.cache_id == old.cache_id  # ids restart per session
            for call in (lambda: cm.deallocate_cache(old),
                         lambda: cm.copy_cache(new, old),
                         lambda: cm.pull_cache(llm.CacheKey(PROMPT_ID, 1), old)):
                with code(S.LLM_KV_CACHE_NOT_EXIST, "another LLMDataDist session"):
                    call()
            # the new session's cache is intact and usable
            assert dd.engine.registry.get(new.cache_id).addrs.tolist() == new.tensor_addrs
            cm.copy_cache(new, new, 1, 0)
            cm.deallocate_cache(new)
        finally:
            dd.finalize()

    def test_stale_kv_cache_handle_in_legacy_mode(self):
        desc = llm.CacheDesc(2, [2, 64], llm.DataType.DT_UINT8, llm.Placement.DEVICE)
        dd = llm.LLMDataDist(llm.LLMRole.DECODER, DECODER_ID)
        try:
            dd.init({})
            old = dd.kv_cache_manager.allocate_cache(desc)
            dd.finalize()
            dd.init({})
            kv = dd.kv_cache_manager
            new = kv.allocate_cache(desc)
            assert new.cache_id == old.cache_id
            with code(S.LLM_KV_CACHE_NOT_EXIST, "another LLMDataDist session"):
                kv.deallocate_cache(old)
            with code(S.LLM_KV_CACHE_NOT_EXIST):
                kv.get_cache_tensors(old)
            dd.engine.registry.get(new.cache_id)  # still there
        finally:
            dd.finalize()


# ---------------------------------------------------------------------------------- item 15


class TestViewsFromWhatWasRegistered:
    """Item 15: get_cache_tensors sizes its views from the cache as allocated, not from the
    caller's CacheDesc, which update_dim may have changed since."""

    def test_update_dim_after_allocation_does_not_grow_the_view(self, make_datadist):
        dd = make_datadist({})
        kv = dd.kv_cache_manager
        desc = llm.CacheDesc(2, [1, 1024], llm.DataType.DT_UINT8, llm.Placement.DEVICE)
        cache = kv.allocate_cache(desc)
        desc.update_dim(1, 1 << 20)
        (tensor,) = kv.get_cache_tensors(cache, 1)
        view = tensor.numpy()
        assert view.nbytes == 1024 and view.shape == (1, 1024)
        assert view.ctypes.data == cache.per_device_tensor_addrs[0][1]

    def test_update_dim_does_not_change_what_a_pull_plans(self, make_datadist):
        dd = make_datadist({})
        kv = dd.kv_cache_manager
        desc = llm.CacheDesc(2, [1, 1024], llm.DataType.DT_UINT8, llm.Placement.DEVICE)
        cache = kv.allocate_cache(desc)
        desc.update_dim(0, 4)
        # batch_index 3 exists only in the changed description: out of range, not linked
        with code(S.LLM_PARAM_INVALID, "batch_index 3"):
            kv.pull_cache(llm.CacheKey(PROMPT_ID, 1), cache, 3)


# ---------------------------------------------------------------------------------- item 16


class TestOptionsAreCheckedAtInit:
    """Item 16: a bad option is refused by init with the documented kind and the offending
    value in the message, never a raw OSError / FileNotFoundError / OverflowError later."""

    def _init_error(self, options: dict[str, str]) -> llm.LLMException:
        dd = llm.LLMDataDist(llm.LLMRole.DECODER, DECODER_ID)
        try:
            with pytest.raises(llm.LLMException) as info:
                dd.init(options)
            assert llm.LLMDataDist.llm_engine_instance is None  # nothing was left started
            return info.value
        finally:
            dd.finalize()

    def test_sync_kv_wait_time_that_overflows(self):
        e = self._init_error({"llm.SyncKvCacheWaitTime": "9" * 30})
        assert e.status_code == S.LLM_PARAM_INVALID and "9" * 30 in str(e)
        e = self._init_error({"llm.SyncKvCacheWaitTime": "\u00b2"})  # isdigit() but not int
        assert e.status_code == S.LLM_PARAM_INVALID

    def test_link_total_time_that_overflows(self):
        e = self._init_error({"llm.EnableCacheManager": "1", "llm.LinkTotalTime": "9" * 30})
        assert e.status_code == S.LLM_PARAM_INVALID and "llm.LinkTotalTime" in str(e)

    def test_pool_larger_than_the_address_space(self):
        size = 2**60
        e = self._init_error({"llm.EnableCacheManager": "1",
                              "llm.MemPoolConfig": f'{{"memory_size": {size}, "page_shift": 30}}'})
        assert e.status_code == S.LLM_OUT_OF_MEMORY and str(size) in str(e)

    @pytest.mark.parametrize("options", [{"ge.flowGraphMemMaxSize": "9" * 30},
                                         {"llm.BufPoolCfg": '{"buf_cfg": [{"total_size": %d}]}'
                                                            % 10**30}])
    def test_legacy_pool_sizes(self, options):
        e = self._init_error(options)
        assert e.status_code == S.LLM_PARAM_INVALID
        assert "9" * 30 in str(e) or "1" + "0" * 30 in str(e)

    def test_missing_tls_file_is_named(self, tmp_path):
        missing = str(tmp_path / "no-such-cert.pem")
        e = self._init_error({"datadist.TlsCert": missing, "datadist.TlsKey": missing,
                              "datadist.TlsCa": missing})
        assert e.status_code == S.LLM_PARAM_INVALID and missing in str(e)

    def test_tls_file_that_is_not_pem_is_named(self, tmp_path):
        junk = tmp_path / "junk.pem"
        junk.write_text("not a certificate\n")
        e = self._init_error({"datadist.TlsCert": str(junk), "datadist.TlsKey": str(junk),
                              "datadist.TlsCa": str(junk)})
        assert e.status_code == S.LLM_PARAM_INVALID and str(junk) in str(e)

    def test_config_setters(self):
        c = llm.LLMConfig()
        with code(S.LLM_PARAM_INVALID):
            c.sync_kv_timeout = "\u00b2"
        with code(S.LLM_PARAM_INVALID):
            c.cluster_info = '{"listen_ip_info": 5}'
