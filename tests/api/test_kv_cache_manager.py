"""Legacy mode: ``KvCacheManager`` (role gating, pool caches, pulls with offsets, copies,
``get_cache_tensors``, ``transfer_cache_async``) and the LLMDataDist parts only it uses.

A PROMPT and a DECODER engine live in this process, each with a device pool and its own
``KvCacheManager`` (the role is the engine's, as ``switch_role`` sets it).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import datadist as llm
from datadist.api.v1 import DEFAULT_POOL_BYTES, KvCacheManager, v1_pool_config

from ._support import DECODER_ID, PROMPT_ID, code, units

pytestmark = pytest.mark.timeout(30)

S = llm.LLMStatusCode
U64 = 2**64 - 1
F16 = llm.DataType.DT_FLOAT16
DEVICE, HOST = llm.Placement.DEVICE, llm.Placement.HOST
PROMPT, DECODER, MIX = llm.LLMRole.PROMPT, llm.LLMRole.DECODER, llm.LLMRole.MIX


class V1:
    def __init__(self, side, role):
        self.side = side
        side.engine.role = int(role)
        self.kv = KvCacheManager(side.engine, role)

    def fill(self, cache, seed):
        """Write seeded bytes through get_cache_tensors; returns them (num_tensors, bytes)."""
        n = cache.cache_desc.num_tensors
        data = np.random.default_rng(seed).integers(0, 256, (n, cache.cache_desc.size),
                                                    dtype=np.uint8)
        for i in range(n):
            (t,) = self.kv.get_cache_tensors(cache, i)
            t.numpy().view(np.uint8).reshape(-1)[:] = data[i]
        return data

    def read(self, cache):
        return np.stack([self.kv.get_cache_tensors(cache, i)[0].numpy().view(np.uint8).reshape(-1)
                         for i in range(cache.cache_desc.num_tensors)])


@pytest.fixture
def v1(make_side):
    p = make_side(PROMPT_ID, pool=1 << 20)
    d = make_side(DECODER_ID, pool=1 << 20, listen=False)
    d.engine.link(PROMPT_ID, *p.engine.listen_address, 5.0)
    return V1(p, PROMPT), V1(d, DECODER)


def desc(shape=(4, 8, 4), n=4, placement=DEVICE):
    return llm.CacheDesc(n, list(shape), F16, placement)


# ================================================================================ the flow


class TestPullCache:
    def test_keys_slots_and_consumption(self, v1):
        p, d = v1
        keys = [llm.CacheKey(PROMPT_ID, 11), llm.CacheKey(PROMPT_ID, U64),
                llm.CacheKey(PROMPT_ID, 13)]
        pc = p.kv.allocate_cache(desc(), keys)
        assert pc.cache_id == 1 and len(pc.per_device_tensor_addrs) == 1
        assert len(pc.per_device_tensor_addrs[0]) == 4
        data = p.fill(pc, 1)
        dc = d.kv.allocate_cache(desc())
        d.kv.pull_cache(llm.CacheKey(PROMPT_ID, 13), dc, batch_index=1)
        want = np.zeros_like(data)
        units(want, 4)[:, 1] = units(data, 4)[:, 2]
        np.testing.assert_array_equal(d.read(dc), want)
        with code(S.LLM_KV_CACHE_NOT_EXIST):  # a req_id key of a pool cache is consumed
            d.kv.pull_cache(llm.CacheKey(PROMPT_ID, 13), dc)
        p.kv.remove_cache_key(llm.CacheKey(PROMPT_ID, 13))  # no-op now
        p.kv.remove_cache_key(llm.CacheKey(PROMPT_ID, 11))
        with code(S.LLM_KV_CACHE_NOT_EXIST):
            d.kv.pull_cache(llm.CacheKey(PROMPT_ID, 11), dc)

    def test_by_id_with_size_offsets_and_layers(self, v1):
        """The legacy flow: hard-coded remote cache id, size and offsets (slot-relative)."""
        p, d = v1
        pc = p.kv.allocate_cache(desc((2, 64), n=4))  # stride 128 bytes
        data = p.fill(pc, 2)
        dc = d.kv.allocate_cache(desc((2, 64), n=4))
        d.kv.pull_cache(llm.CacheKeyByIdAndIndex(PROMPT_ID, pc.cache_id, 1), dc, 0, 40,
                        src_cache_offset=16, dst_cache_offset=72,
                        src_layer_range=range(1, 2), dst_layer_range=range(0, 1))
        want = np.zeros_like(data)
        units(want, 2)[0:2, 0, 72:112] = units(data, 2)[2:4, 1, 16:56]
        np.testing.assert_array_equal(d.read(dc), want)

    def test_default_offsets_pull_the_whole_slot(self, v1):
        p, d = v1
        pc = p.kv.allocate_cache(desc())
        data = p.fill(pc, 3)
        dc = d.kv.allocate_cache(desc())
        d.kv.pull_cache(llm.CacheKeyByIdAndIndex(PROMPT_ID, pc.cache_id, 3), dc, 3)
        np.testing.assert_array_equal(units(d.read(dc), 4)[:, 3], units(data, 4)[:, 3])

    def test_argument_errors(self, v1):
        p, d = v1
        dc = d.kv.allocate_cache(desc())
        key = llm.CacheKeyByIdAndIndex(PROMPT_ID, 1)
        with pytest.raises(TypeError):
            d.kv.pull_cache(llm.BlocksCacheKey(PROMPT_ID), dc)
        with pytest.raises(TypeError):
            d.kv.pull_cache(key, "cache")
        with pytest.raises(TypeError):
            d.kv.pull_cache(key, dc, src_cache_offset="0")
        with pytest.raises(ValueError):
            d.kv.pull_cache(key, dc, src_cache_offset=-1)
        with pytest.raises(ValueError):
            d.kv.pull_cache(key, dc, dst_cache_offset=-5)
        with pytest.raises(ValueError):
            d.kv.pull_cache(key, dc, batch_index=-1)
        blocks = d.kv.allocate_blocks_cache(desc())
        for call in [
            lambda: d.kv.pull_cache(key, dc, size=0),
            lambda: d.kv.pull_cache(key, dc, bogus=1),
            lambda: d.kv.pull_cache(key, dc, tensor_num_per_layer=0),
            lambda: d.kv.pull_cache(key, dc, src_layer_range=range(0, 4, 2)),
            lambda: d.kv.pull_cache(key, dc, dst_cache_offset=64),  # past the 64-byte slot
            lambda: d.kv.pull_cache(key, dc, size=60, dst_cache_offset=8),
            lambda: d.kv.pull_cache(key, dc, batch_index=4),
            lambda: d.kv.pull_cache(llm.CacheKey(PROMPT_ID, U64), dc),  # padding key
            lambda: d.kv.pull_cache(key, blocks),
        ]:
            with code(S.LLM_PARAM_INVALID):
                call()
        with code(S.LLM_NOT_YET_LINK):
            d.kv.pull_cache(llm.CacheKeyByIdAndIndex(99, 1), dc)


class TestPullBlocks:
    def test_blocks(self, v1):
        p, d = v1
        pc = p.kv.allocate_blocks_cache(desc((8, 16)), llm.BlocksCacheKey(PROMPT_ID, 3))
        data = p.fill(pc, 4)
        dc = d.kv.allocate_blocks_cache(desc((8, 16)))
        d.kv.pull_blocks(llm.BlocksCacheKey(PROMPT_ID, 3), dc, [0, 1, 5], [7, 2, 3])
        want = np.zeros_like(data)
        units(want, 8)[:, [7, 2, 3]] = units(data, 8)[:, [0, 1, 5]]
        np.testing.assert_array_equal(d.read(dc), want)

    def test_argument_errors(self, v1):
        _, d = v1
        dc = d.kv.allocate_blocks_cache(desc((8, 16)))
        contiguous = d.kv.allocate_cache(desc((8, 16)))
        key = llm.BlocksCacheKey(PROMPT_ID, 3)
        for call in [
            lambda: d.kv.pull_blocks(key, dc, (0,), [1]),  # lists only
            lambda: d.kv.pull_blocks(key, dc, [0], (1,)),
            lambda: d.kv.pull_blocks(llm.CacheKey(PROMPT_ID, 1), dc, [0], [1]),
            lambda: d.kv.pull_blocks(key, None, [0], [1]),
            lambda: d.kv.pull_blocks(key, dc, ["0"], [1]),
        ]:
            with pytest.raises(TypeError):
                call()
        with pytest.raises(ValueError):
            d.kv.pull_blocks(key, dc, [-1], [1])
        for call in [
            lambda: d.kv.pull_blocks(key, dc, [], []),
            lambda: d.kv.pull_blocks(key, dc, [0, 1], [1]),
            lambda: d.kv.pull_blocks(key, dc, [0], [1], src_cache_offset=0),
            lambda: d.kv.pull_blocks(key, dc, [0], [8]),
            lambda: d.kv.pull_blocks(key, contiguous, [0], [1]),
        ]:
            with code(S.LLM_PARAM_INVALID):
                call()


class TestIssuedPulls:
    """pull_cache_async / pull_blocks_async (datadist extension): the blocking calls' bytes,
    their argument errors at the call, the transfer's failures from wait()."""

    def test_same_bytes_as_the_blocking_calls(self, v1):
        p, d = v1
        pc = p.kv.allocate_cache(desc((2, 64), n=4))
        p.fill(pc, 5)
        a, b = d.kv.allocate_cache(desc((2, 64), n=4)), d.kv.allocate_cache(desc((2, 64), n=4))
        key = llm.CacheKeyByIdAndIndex(PROMPT_ID, pc.cache_id, 1)
        kwargs = {"src_cache_offset": 16, "dst_cache_offset": 72}
        d.kv.pull_cache(key, a, 0, 40, **kwargs)
        handle = d.kv.pull_cache_async(key, b, 0, 40, **kwargs)
        handle.wait(10)
        assert handle.status == S.LLM_SUCCESS
        np.testing.assert_array_equal(d.read(b), d.read(a))
        pb = p.kv.allocate_blocks_cache(desc((8, 16)), llm.BlocksCacheKey(PROMPT_ID, 4))
        p.fill(pb, 6)
        x, y = d.kv.allocate_blocks_cache(desc((8, 16))), d.kv.allocate_blocks_cache(desc((8, 16)))
        d.kv.pull_blocks(llm.BlocksCacheKey(PROMPT_ID, 4), x, [0, 1, 5], [7, 2, 3])
        d.kv.pull_blocks_async(llm.BlocksCacheKey(PROMPT_ID, 4), y, [0, 1, 5], [7, 2, 3]).wait()
        np.testing.assert_array_equal(d.read(y), d.read(x))
        assert d.read(y).any()

    def test_errors(self, v1):
        p, d = v1
        pc = p.kv.allocate_cache(desc())
        dc = d.kv.allocate_cache(desc())
        with code(S.LLM_PARAM_INVALID):  # only a decoder pulls: refused at the call
            p.kv.pull_cache_async(llm.CacheKeyByIdAndIndex(DECODER_ID, 1), pc)
        with pytest.raises(ValueError):
            d.kv.pull_cache_async(llm.CacheKeyByIdAndIndex(PROMPT_ID, 1), dc, src_cache_offset=-1)
        with code(S.LLM_PARAM_INVALID):
            d.kv.pull_blocks_async(llm.BlocksCacheKey(PROMPT_ID, 3), dc, [0], [1])
        handle = d.kv.pull_cache_async(llm.CacheKeyByIdAndIndex(99, 1), dc)  # not linked
        with code(S.LLM_NOT_YET_LINK):
            handle.wait(10)
        assert handle.status == S.LLM_NOT_YET_LINK


# ================================================================================ roles


class TestRoles:
    def test_only_a_decoder_pulls(self, v1):
        p, d = v1
        pc = p.kv.allocate_cache(desc())
        pb = p.kv.allocate_blocks_cache(desc())
        for kv in (p.kv, KvCacheManager(p.side.engine, MIX)):
            with code(S.LLM_PARAM_INVALID):
                kv.pull_cache(llm.CacheKeyByIdAndIndex(DECODER_ID, 1), pc)
            with code(S.LLM_PARAM_INVALID):
                kv.pull_blocks(llm.BlocksCacheKey(DECODER_ID), pb, [0], [0])

    def test_only_a_prompt_binds_and_removes_keys(self, v1):
        _, d = v1
        with code(S.LLM_PARAM_INVALID):
            d.kv.allocate_cache(desc(), [llm.CacheKey(DECODER_ID, 1)])
        with code(S.LLM_PARAM_INVALID):
            d.kv.allocate_blocks_cache(desc(), llm.BlocksCacheKey(DECODER_ID, 0))
        with code(S.LLM_PARAM_INVALID):
            d.kv.remove_cache_key(llm.CacheKey(DECODER_ID, 1))
        d.kv.allocate_cache(desc(), [])  # no keys: fine

    def test_only_a_prompt_transfers(self, v1):
        _, d = v1
        dc = d.kv.allocate_cache(desc())
        with code(S.LLM_PARAM_INVALID):
            d.kv.transfer_cache_async(dc, _Sync(), [llm.TransferConfig(PROMPT_ID, [1] * 4)])

    def test_the_role_follows_switch_role(self, make_datadist):
        dd = make_datadist({"llm.listenIpInfo": "127.0.0.1:0", "llm.EnableSwitchRole": "1",
                            "ge.flowGraphMemMaxSize": str(1 << 20)})
        kv = dd.kv_cache_manager
        cache = kv.allocate_cache(desc())
        key = llm.CacheKeyByIdAndIndex(DECODER_ID, 1)
        with code(S.LLM_PARAM_INVALID):
            kv.pull_cache(key, cache)
        dd.switch_role(DECODER)
        with code(S.LLM_NOT_YET_LINK):  # past the role check now
            kv.pull_cache(key, cache)


# ================================================================================ caches


class TestCaches:
    def test_device_only(self, v1):
        p, _ = v1
        cpu = llm.KvCache.create_cpu_cache(desc(placement=HOST), [4096] * 4)
        with code(S.LLM_PARAM_INVALID):
            p.kv.allocate_cache(desc(placement=HOST))
        with code(S.LLM_PARAM_INVALID):
            p.kv.allocate_blocks_cache(desc(placement=HOST))
        with code(S.LLM_PARAM_INVALID):
            p.kv.deallocate_cache(cpu)
        with code(S.LLM_PARAM_INVALID):
            p.kv.allocate_cache(llm.CacheDesc(0, [4, 8], F16))
        with pytest.raises(TypeError):
            p.kv.allocate_cache(desc(), [1])
        with pytest.raises(TypeError):
            p.kv.allocate_cache("desc")

    def test_cache_ids_count_from_one_per_process(self, make_side):
        side = make_side(7, pool=1 << 20, listen=False)
        kv = V1(side, PROMPT).kv
        ids = [kv.allocate_cache(desc()).cache_id, kv.allocate_blocks_cache(desc()).cache_id,
               kv.allocate_cache(desc()).cache_id]
        assert ids == [1, 2, 3]

    def test_deallocate(self, v1):
        p, _ = v1
        cache = p.kv.allocate_cache(desc())
        blocks = p.kv.allocate_blocks_cache(desc(), llm.BlocksCacheKey(PROMPT_ID, 1))
        p.kv.deallocate_cache(cache)
        p.kv.deallocate_cache(blocks)
        assert cache.per_device_tensor_addrs == []
        p.kv.deallocate_cache(cache)  # again: a no-op
        with code(S.LLM_KV_CACHE_NOT_EXIST):
            p.kv.get_cache_tensors(blocks)
        with pytest.raises(TypeError):
            p.kv.deallocate_cache("cache")

    def test_get_cache_tensors(self, v1):
        p, _ = v1
        cache = p.kv.allocate_cache(desc((2, 3), n=2))
        (t,) = p.kv.get_cache_tensors(cache, 1)
        arr = t.numpy()
        assert arr.shape == (2, 3) and arr.dtype == np.float16
        assert str(t).endswith("tensor_desc=TensorDesc(dtype=DataType.DT_FLOAT16, shape=[2, 3]))")
        arr[...] = 1.5
        assert int(arr.ctypes.data) == cache.per_device_tensor_addrs[0][1]
        assert (p.kv.get_cache_tensors(cache, 1)[0].numpy() == 1.5).all()
        assert t.numpy(copy=True) is not arr
        for bad in (2, -1):
            with code(S.LLM_PARAM_INVALID):
                p.kv.get_cache_tensors(cache, bad)
        with pytest.raises(ValueError):
            p.kv.get_cache_tensors(cache, 2**31)
        with pytest.raises(TypeError):
            p.kv.get_cache_tensors(cache, "0")
        with pytest.raises(TypeError):
            p.kv.get_cache_tensors(None)

    def test_copies_and_swaps(self, v1):
        p, _ = v1
        a = p.kv.allocate_cache(desc())
        data = p.fill(a, 5)
        b = p.kv.allocate_cache(desc())
        p.kv.copy_cache(b, a, 2, 1, offset=4, size=8, req_id=9)
        want = np.zeros_like(data)
        units(want, 4)[:, 2, 4:12] = units(data, 4)[:, 1, 4:12]
        np.testing.assert_array_equal(p.read(b), want)
        blocks = p.kv.allocate_blocks_cache(desc())
        bdata = p.fill(blocks, 6)
        p.kv.copy_blocks(blocks, {0: [2, 3]})
        units(bdata, 4)[:, [2, 3]] = units(bdata, 4)[:, [0]]
        np.testing.assert_array_equal(p.read(blocks), bdata)
        host = np.zeros_like(bdata)
        cpu = llm.KvCache.create_cpu_cache(desc(placement=HOST),
                                           [[int(host[i].ctypes.data) for i in range(4)]])
        p.kv.swap_blocks(blocks, cpu, {1: 0, 3: 3})
        np.testing.assert_array_equal(units(host, 4)[:, [0, 3]], units(bdata, 4)[:, [1, 3]])
        with code(S.LLM_PARAM_INVALID):
            p.kv.copy_cache(b, cpu)
        with code(S.LLM_PARAM_INVALID):
            p.kv.copy_blocks(cpu, {0: [1]})
        with code(S.LLM_PARAM_INVALID):
            p.kv.swap_blocks(blocks, blocks, {0: 1})
        with pytest.raises(TypeError):
            p.kv.copy_cache(b, a, req_id="9")
        with pytest.raises(TypeError):
            p.kv.swap_blocks(blocks, "cpu", {0: 1})
        with pytest.raises(TypeError):
            p.kv.copy_blocks(blocks, [0, 1])


class _Sync(llm.LayerSynchronizer):
    def __init__(self, fail=False):
        self.fail = fail

    def synchronize_layer(self, layer_index, timeout_in_millis):
        if self.fail:
            raise RuntimeError("compute failed")
        return True


class TestTransferAsync:
    def test_prompt_sends_to_raw_addresses(self, v1):
        p, d = v1
        d.side.engine.start_listening("127.0.0.1", 0)
        p.side.engine.link(DECODER_ID, *d.side.engine.listen_address, 5.0)
        src = p.kv.allocate_cache(desc())
        data = p.fill(src, 7)
        dst = d.kv.allocate_cache(desc())
        addrs = [a + 2 * 64 for a in dst.per_device_tensor_addrs[0]]  # into slot 2 (64 B)
        task = p.kv.transfer_cache_async(src, _Sync(), [llm.TransferConfig(DECODER_ID, addrs,
                                                                          None, 1)])
        assert task.synchronize(5000) == S.LLM_SUCCESS
        want = np.zeros_like(data)
        units(want, 4)[:, 2] = units(data, 4)[:, 1]
        np.testing.assert_array_equal(d.read(dst), want)
        failing = p.kv.transfer_cache_async(src, _Sync(fail=True),
                                            [llm.TransferConfig(DECODER_ID, addrs)])
        assert failing.synchronize(5000) == S.LLM_WAIT_PROCESS_TIMEOUT  # v1's default error

    def test_only_transfer_configs(self, v1):
        p, _ = v1
        src = p.kv.allocate_cache(desc())
        key_cfg = llm.TransferWithCacheKeyConfig(llm.CacheKeyByIdAndIndex(DECODER_ID, 1),
                                                 range(1), range(1))
        with pytest.raises(TypeError):
            p.kv.transfer_cache_async(src, _Sync(), [key_cfg])
        with pytest.raises(TypeError):
            p.kv.transfer_cache_async("src", _Sync(), [])


# ================================================================================ LLMDataDist


class TestLegacyDataDist:
    def test_pool_size(self):
        assert v1_pool_config({"ge.flowGraphMemMaxSize": "4096"}).memory_size == 4096
        buf = json.dumps({"buf_cfg": [{"total_size": 2 << 20, "blk_size": 256,
                                       "max_buf_size": 8192},
                                      {"total_size": 4 << 20, "blk_size": 4096,
                                       "max_buf_size": 65536}]})
        assert v1_pool_config({"llm.BufPoolCfg": buf}).memory_size == 6 << 20
        assert v1_pool_config({}).memory_size == DEFAULT_POOL_BYTES
        for bad in ({"llm.BufPoolCfg": "{}"}, {"llm.BufPoolCfg": "[1]"},
                    {"llm.BufPoolCfg": json.dumps({"buf_cfg": []})}):
            with code(S.LLM_PARAM_INVALID):
                v1_pool_config(bad)

    def test_pool_exhaustion(self, make_datadist):
        dd = make_datadist({"ge.flowGraphMemMaxSize": str(1 << 16)}, DECODER, DECODER_ID)
        kv = dd.kv_cache_manager
        kv.allocate_cache(llm.CacheDesc(1, [1 << 15], llm.DataType.DT_UINT8))
        with code(S.LLM_DEVICE_OUT_OF_MEMORY):
            kv.allocate_cache(llm.CacheDesc(2, [1 << 15], llm.DataType.DT_UINT8))

    def test_bad_buf_pool_cfg_at_init(self):
        dd = llm.LLMDataDist(DECODER, DECODER_ID)
        with code(S.LLM_PARAM_INVALID):
            dd.init({"llm.BufPoolCfg": "not json"})
        assert llm.LLMDataDist.llm_engine_instance is None

    def test_check_link_status(self, make_datadist, make_side):
        prompt = make_side(PROMPT_ID)
        dd = make_datadist({}, DECODER, DECODER_ID)
        with code(S.LLM_NOT_YET_LINK):
            dd.check_link_status(PROMPT_ID)
        info = llm.LLMClusterInfo()
        info.remote_cluster_id = PROMPT_ID
        info.append_local_ip_info("127.0.0.1", 0)
        info.append_remote_ip_info(*prompt.engine.listen_address)
        assert dd.link_clusters([info], 3000)[0] == S.LLM_SUCCESS
        assert dd.check_link_status(PROMPT_ID) is None
        prompt.engine.close()
        with pytest.raises(llm.LLMException):
            dd.check_link_status(PROMPT_ID)


class TestAfterFinalize:
    def test_managers_are_not_initialized(self, make_datadist):
        dd = make_datadist({"llm.EnableCacheManager": "1"})
        cm = dd.cache_manager
        dd.finalize()
        for call in [lambda: cm.copy_cache(None, None), lambda: cm.copy_blocks(None, {}),
                     lambda: cm.swap_blocks(None, None, {}),
                     lambda: cm.remap_registered_memory([]),
                     lambda: cm.transfer_cache_async(None, None, [])]:
            with pytest.raises(RuntimeError, match="not initialized"):
                call()
        dd = make_datadist({}, DECODER, DECODER_ID)
        kv = dd.kv_cache_manager
        dd.finalize()
        assert not kv.is_initialized()
        for call in [lambda: kv.allocate_cache(desc()), lambda: kv.pull_cache(None, None),
                     lambda: kv.get_cache_tensors(None), lambda: kv.copy_blocks(None, {})]:
            with pytest.raises(RuntimeError, match="not initialized"):
                call()

    def test_key_types(self, v1):
        p, _ = v1
        with pytest.raises(TypeError):
            p.kv.remove_cache_key(llm.BlocksCacheKey(PROMPT_ID))
        with pytest.raises(TypeError):
            p.kv.allocate_blocks_cache(desc(), llm.CacheKey(PROMPT_ID, 1))
