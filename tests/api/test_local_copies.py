"""Local copies: ``copy_cache``, ``copy_blocks``, ``swap_blocks`` (with ``create_cpu_cache``),
``remap_registered_memory``; the planners of ``core/local.py`` and the core's copy
(``NativeEngine.copy_local``, the session's CopyCaches) they call.

Every copy is checked byte for byte against the same copy done with numpy slicing, including
the bytes that must stay untouched.
"""

from __future__ import annotations

import numpy as np
import pytest

import datadist as llm
from datadist.api.cache_manager import CacheManager
from datadist.core import local
from datadist.core.errors import CacheNotFound, InvalidArgument
from datadist.core.layout import Geometry, Plan

from ._support import PROMPT_ID, code, units

S = llm.LLMStatusCode
HOST, DEVICE = llm.Placement.HOST, llm.Placement.DEVICE


@pytest.fixture
def side(make_side):
    return make_side(PROMPT_ID, listen=False)


# ================================================================================ core planners


class TestPlanners:
    def test_slot_copy_spans(self):
        src, dst = Geometry(3, 4 * 64, 4), Geometry(3, 2 * 64, 2)
        plan = local.plan_slot_copy(src, dst, 3, 1, offset=8, size=16)
        assert plan.remote_offsets.tolist() == [3 * 64 + 8]
        assert plan.local_offsets.tolist() == [64 + 8]
        assert plan.lengths.tolist() == [16]
        assert plan.local_tensors.tolist() == plan.remote_tensors.tolist() == [0, 1, 2]

    def test_slot_copy_default_size_is_rest_of_source_slot(self):
        plan = local.plan_slot_copy(Geometry(1, 64, 1), Geometry(1, 128, 1), 0, 0, offset=10)
        assert plan.lengths.tolist() == [54]

    @pytest.mark.parametrize("args", [
        dict(src_unit=4, dst_unit=0), dict(src_unit=0, dst_unit=2),
        dict(src_unit=0, dst_unit=0, offset=64), dict(src_unit=0, dst_unit=0, size=65),
        dict(src_unit=0, dst_unit=0, offset=60, size=5),
    ])
    def test_slot_copy_bounds(self, args):
        with pytest.raises(InvalidArgument):
            local.plan_slot_copy(Geometry(2, 4 * 64, 4), Geometry(2, 2 * 64, 2), **args)

    def test_slot_copy_needs_equal_tensor_counts(self):
        with pytest.raises(InvalidArgument, match="tensors"):
            local.plan_slot_copy(Geometry(2, 64, 1), Geometry(3, 64, 1), 0, 0)

    def test_block_copy_coalesces_runs_adjacent_on_both_sides(self):
        g = Geometry(2, 16 * 32, 16, True)
        plan = local.plan_block_copy(g, g, np.array([0, 1, 2, 9]), np.array([5, 6, 7, 3]))
        assert plan.remote_offsets.tolist() == [0, 9 * 32]
        assert plan.local_offsets.tolist() == [5 * 32, 3 * 32]
        assert plan.lengths.tolist() == [3 * 32, 32]

    @pytest.mark.parametrize("src,dst,same,match", [
        ([16], [0], False, "src block"),
        ([0], [16], False, "dst block"),
        ([0, 1], [2, 2], False, "more than once"),
        ([0, 1], [1, 2], True, "both a source and a destination"),
    ])
    def test_block_copy_errors(self, src, dst, same, match):
        g = Geometry(1, 16 * 32, 16, True)
        with pytest.raises(InvalidArgument, match=match):
            local.plan_block_copy(g, g, np.array(src), np.array(dst), same_cache=same)

    def test_block_copy_needs_equal_block_bytes(self):
        with pytest.raises(InvalidArgument, match="block size"):
            local.plan_block_copy(Geometry(1, 64, 2, True), Geometry(1, 64, 4, True),
                                  np.array([0]), np.array([0]))



# ================================================================================ the core's copy


def _plan(src_tensors, dst_tensors, src_offsets, dst_offsets, lengths):
    return Plan(np.array(src_tensors, np.uint32), np.array(dst_tensors, np.uint32),
                np.array(src_offsets, np.uint64), np.array(dst_offsets, np.uint64),
                np.array(lengths, np.uint64))


class TestCoreCopy:
    """``NativeEngine.copy_local``: one core call holds both caches, checks every span against
    both and copies; the facade's planning is not what keeps memory safe."""

    def test_a_span_outside_either_cache_is_refused_and_nothing_is_written(self, side):
        src, a = side.register(2, [8, 16], blocks=True, seed=11)
        dst, b = side.register(2, [4, 16], blocks=True)
        eng = side.engine
        for plan in [
            _plan([1], [1], [0, 16], [0, 56], [16, 16]),  # the second span passes dst's 64 bytes
            _plan([1], [1], [120], [0], [16]),  # passes the source's 128 bytes
            _plan([1], [2], [0], [0], [16]),  # dst has 2 tensors
            _plan([0], [0], [0], [0], [0]),  # an empty span
            _plan([0], [0], [2**64 - 8], [0], [16]),  # wraps
        ]:
            with pytest.raises(InvalidArgument, match="local copy"):
                eng.copy_local(src.cache_id, dst.cache_id, plan)
        assert not b.any()
        assert eng.leases(src.cache_id) == eng.leases(dst.cache_id) == 0

    def test_copies_what_the_plan_names_and_counts_it(self, side):
        src, a = side.register(2, [8, 16], blocks=True, seed=12)
        dst, b = side.register(2, [4, 16], blocks=True)
        plan = _plan([1, 0], [0, 1], [16, 96], [0, 32], [32, 16])
        assert side.engine.copy_local(src.cache_id, dst.cache_id, plan) == 2 * 48
        want = np.zeros_like(b)
        want[0, 0:32], want[0, 32:48] = a[1, 16:48], a[1, 96:112]
        want[1, 0:32], want[1, 32:48] = a[0, 16:48], a[0, 96:112]
        np.testing.assert_array_equal(b, want)

    def test_a_cache_not_filed_is_cache_not_found(self, side):
        src, _ = side.register(1, [4, 16], blocks=True)
        gone, _ = side.register(1, [4, 16], blocks=True)
        side.cm.unregister_cache(gone.cache_id)
        for s_id, d_id in [(src.cache_id, gone.cache_id), (gone.cache_id, src.cache_id),
                           (src.cache_id, -1)]:
            with pytest.raises(CacheNotFound):
                side.engine.copy_local(s_id, d_id, _plan([0], [0], [0], [0], [16]))

    def test_unfiled_memory_is_checked_against_its_description(self, side):
        src, a = side.register(1, [4, 16], blocks=True, seed=13)
        mine = np.zeros(64, np.uint8)
        user = side.engine.user_cache(Geometry(1, 64, 4, True), np.array([mine.ctypes.data]))
        with pytest.raises(InvalidArgument, match="outside the destination"):
            side.engine.copy_local(src.cache_id, user, _plan([0], [0], [0], [48], [32]))
        assert not mine.any()
        side.engine.copy_local(src.cache_id, user, _plan([0], [0], [16], [48], [16]))
        np.testing.assert_array_equal(mine[48:], a[0, 16:32])
        with pytest.raises(InvalidArgument):
            side.engine.user_cache(Geometry(1, 64, 4, True), np.array([0]))

    def test_a_run_shifted_within_one_cache_copies_block_by_block(self, side):
        c, a = side.register(1, [8, 16], blocks=True)
        units(a, 8)[0] = np.arange(1, 9, dtype=np.uint8)[:, None]
        # blocks 0..2 -> 1..3 as one span that overlaps itself: as three block copies in
        # order, every one of blocks 1..3 ends up block 0's
        side.engine.copy_local(c.cache_id, c.cache_id, _plan([0], [0], [0], [16], [48]))
        assert units(a, 8)[0, :, 0].tolist() == [1, 1, 1, 1, 5, 6, 7, 8]

    def test_many_blocks_land_as_numpy_says(self, side):
        n_blocks, bb = 512, 64
        dev, d = side.register(2, [n_blocks, bb], blocks=True, seed=14)
        host, h = side.register(2, [n_blocks, bb], blocks=True, placement=HOST)
        rng = np.random.default_rng(1)
        s_blocks = rng.permutation(n_blocks)[:300]
        d_blocks = rng.permutation(n_blocks)[:300]
        side.cm.swap_blocks(dev, host, dict(zip(s_blocks.tolist(), d_blocks.tolist(),
                                                strict=True)))
        want = np.zeros_like(h)
        units(want, n_blocks)[:, d_blocks] = units(d, n_blocks)[:, s_blocks]
        np.testing.assert_array_equal(h, want)


class TestPoolAndUserCaches:
    """Copies between caches carved from a pool and the caller's memory, both ways."""

    @pytest.fixture
    def pooled(self, make_side):
        side = make_side(PROMPT_ID, listen=False, pool=1 << 20)
        side.cm = CacheManager(side.engine, mem_pool=True)
        return side

    def test_swap_between_a_pool_cache_and_a_cpu_cache(self, pooled):
        desc = llm.CacheDesc(2, [8, 32], llm.DataType.DT_UINT8, DEVICE)
        dev = pooled.cm.allocate_blocks_cache(desc)
        entry = pooled.engine.cache(dev.cache_id)
        assert entry.owned
        pool_mem = [np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * 256).from_address(
            int(entry.addrs[i]))) for i in range(2)]
        for i in range(2):
            pool_mem[i][:] = np.arange(256, dtype=np.uint8) + i
        host, h = cpu_cache(2, [8, 32])
        pooled.cm.swap_blocks(dev, host, {1: 0, 2: 1, 7: 5})
        want = np.zeros_like(h)
        for i in range(2):
            units(want, 8)[i, [0, 1, 5]] = pool_mem[i].reshape(8, 32)[[1, 2, 7]]
        np.testing.assert_array_equal(h, want)
        h[...] = 200
        pooled.cm.swap_blocks(host, dev, {0: 3})
        for i in range(2):
            assert (pool_mem[i].reshape(8, 32)[3] == 200).all()
            assert pool_mem[i][0] == i  # block 0 untouched

    def test_copy_cache_between_a_pool_cache_and_a_registered_one(self, pooled):
        desc = llm.CacheDesc(1, [2, 64], llm.DataType.DT_UINT8, DEVICE)
        pool_cache = pooled.cm.allocate_cache(desc)
        user, u = pooled.register(1, [2, 64], seed=15)
        pooled.cm.copy_cache(pool_cache, user, dst_batch_index=1, src_batch_index=0)
        back, b = pooled.register(1, [2, 64])
        pooled.cm.copy_cache(back, pool_cache, dst_batch_index=0, src_batch_index=1)
        np.testing.assert_array_equal(units(b, 2)[0, 0], units(u, 2)[0, 0])
        assert not units(b, 2)[0, 1].any()


# ================================================================================ copy_cache


class TestCopyCache:
    def test_copies_one_slot_range_of_every_tensor(self, side):
        src, a = side.register(3, [4, 64], seed=1)
        dst, b = side.register(3, [2, 64])
        side.cm.copy_cache(dst, src, dst_batch_index=1, src_batch_index=3, offset=8, size=16)
        want = np.zeros_like(b)
        units(want, 2)[:, 1, 8:24] = units(a, 4)[:, 3, 8:24]
        np.testing.assert_array_equal(b, want)

    def test_default_size_is_the_rest_of_the_source_slot(self, side):
        src, a = side.register(2, [2, 32], seed=2)
        dst, b = side.register(2, [2, 32])
        side.cm.copy_cache(dst, src, 0, 1, offset=4)
        want = np.zeros_like(b)
        units(want, 2)[:, 0, 4:] = units(a, 2)[:, 1, 4:]
        np.testing.assert_array_equal(b, want)

    def test_a_slot_onto_another_slot_of_the_same_cache(self, side):
        c, a = side.register(2, [3, 16], seed=3)
        before = a.copy()
        side.cm.copy_cache(c, c, dst_batch_index=2, src_batch_index=0)
        units(before, 3)[:, 2] = units(before, 3)[:, 0]
        np.testing.assert_array_equal(a, before)

    def test_types(self, side):
        c, _ = side.register(1, [2, 8])
        cm = side.cm
        with pytest.raises(TypeError):
            cm.copy_cache("dst", c)
        with pytest.raises(TypeError):
            cm.copy_cache(c, None)
        with pytest.raises(TypeError):
            cm.copy_cache(c, c, dst_batch_index="0")
        with pytest.raises(TypeError):
            cm.copy_cache(c, c, offset=1.0)
        with pytest.raises(ValueError):
            cm.copy_cache(c, c, src_batch_index=-1)
        with pytest.raises(ValueError):
            cm.copy_cache(c, c, offset=-1)
        with pytest.raises(ValueError):
            cm.copy_cache(c, c, req_id=-1)
        with pytest.raises(TypeError):
            cm.copy_cache(c, c, req_id="r")

    def test_param_invalid(self, side):
        c, _ = side.register(2, [2, 8])
        three, _ = side.register(3, [2, 8])
        blocks, _ = side.register(2, [2, 8], blocks=True)
        cm = side.cm
        for call in [
            lambda: cm.copy_cache(c, blocks),
            lambda: cm.copy_cache(blocks, c),
            lambda: cm.copy_cache(c, c, size=0),
            lambda: cm.copy_cache(c, c, size=-2),
            lambda: cm.copy_cache(c, c, dst_batch_index=2),
            lambda: cm.copy_cache(c, c, src_batch_index=2),
            lambda: cm.copy_cache(c, c, offset=8),
            lambda: cm.copy_cache(c, c, offset=4, size=5),
            lambda: cm.copy_cache(three, c),
        ]:
            with code(S.LLM_PARAM_INVALID):
                call()

    def test_unregistered_cache_does_not_exist(self, side):
        c, _ = side.register(1, [2, 8])
        gone, _ = side.register(1, [2, 8])
        side.cm.unregister_cache(gone.cache_id)
        with code(S.LLM_KV_CACHE_NOT_EXIST):
            side.cm.copy_cache(c, gone)
        with code(S.LLM_KV_CACHE_NOT_EXIST):
            side.cm.copy_cache(gone, c)


# ================================================================================ copy_blocks


class TestCopyBlocks:
    def test_each_source_block_to_each_destination(self, side):
        c, a = side.register(2, [16, 24], blocks=True, seed=4)
        want = units(a.copy(), 16)
        side.cm.copy_blocks(c, {0: [5, 6], 1: [7], 9: [15, 3]})
        for s, ds in {0: [5, 6], 1: [7], 9: [15, 3]}.items():
            want[:, ds] = want[:, [s]]
        np.testing.assert_array_equal(units(a, 16), want)

    def test_empty_mapping_copies_nothing(self, side):
        c, a = side.register(1, [4, 8], blocks=True, seed=5)
        before = a.copy()
        side.cm.copy_blocks(c, {})
        side.cm.copy_blocks(c, {1: []})
        np.testing.assert_array_equal(a, before)

    def test_types(self, side):
        c, _ = side.register(1, [4, 8], blocks=True)
        for bad in [[(0, [1])], {0: (1,)}, {"0": [1]}, {0: ["1"]}, {0: [1.0]}]:
            with pytest.raises(TypeError):
                side.cm.copy_blocks(c, bad)
        with pytest.raises(TypeError):
            side.cm.copy_blocks("cache", {0: [1]})
        with pytest.raises(ValueError):
            side.cm.copy_blocks(c, {0: [-1]})

    def test_param_invalid(self, side):
        c, _ = side.register(1, [4, 8], blocks=True)
        contiguous, _ = side.register(1, [4, 8])
        for cache, info in [(contiguous, {0: [1]}), (c, {4: [1]}), (c, {0: [4]}),
                            (c, {0: [2], 1: [2]}), (c, {0: [1], 1: [2]}), (c, {2: [2]})]:
            with code(S.LLM_PARAM_INVALID):
                side.cm.copy_blocks(cache, info)


# ================================================================================ swap_blocks


def cpu_cache(num_tensors, shape, dtype=llm.DataType.DT_UINT8):
    desc = llm.CacheDesc(num_tensors, shape, dtype, HOST)
    arr = np.zeros((num_tensors, desc.size), dtype=np.uint8)
    addrs = [int(arr[i].ctypes.data) for i in range(num_tensors)]
    return llm.Cache.create_cpu_cache(desc, addrs), arr


class TestSwapBlocks:
    def test_swap_out_and_back_in(self, side):
        dev, d = side.register(2, [8, 32], blocks=True, seed=6)
        host, h = cpu_cache(2, [8, 32])
        assert host.cache_id == -1 and host.is_blocks_cache
        side.cm.swap_blocks(dev, host, {1: 0, 2: 1, 3: 2, 7: 5})
        want = np.zeros_like(h)
        units(want, 8)[:, [0, 1, 2, 5]] = units(d, 8)[:, [1, 2, 3, 7]]
        np.testing.assert_array_equal(h, want)
        original = d.copy()
        d[...] = 0
        side.cm.swap_blocks(host, dev, {0: 1, 1: 2, 2: 3, 5: 7})
        back = np.zeros_like(d)
        units(back, 8)[:, [1, 2, 3, 7]] = units(original, 8)[:, [1, 2, 3, 7]]
        np.testing.assert_array_equal(d, back)

    def test_registered_host_cache(self, side):
        dev, d = side.register(1, [4, 16], blocks=True, seed=7)
        host, h = side.register(1, [4, 16], blocks=True, placement=HOST)
        side.cm.swap_blocks(dev, host, {3: 0})
        np.testing.assert_array_equal(units(h, 4)[:, 0], units(d, 4)[:, 3])

    def test_types(self, side):
        dev, _ = side.register(1, [4, 16], blocks=True)
        host, _ = cpu_cache(1, [4, 16])
        with pytest.raises(TypeError):
            side.cm.swap_blocks("src", host, {0: 0})
        with pytest.raises(TypeError):
            side.cm.swap_blocks(dev, host, [(0, 0)])
        with pytest.raises(TypeError):
            side.cm.swap_blocks(dev, host, {0: "0"})
        # a negative index is out of the cache's range, not of uint64's: LLM_PARAM_INVALID,
        # as hixl v2/cache_manager.py _verify_caches ("src_block_index:-1 must be in [0, 4)")
        with pytest.raises(llm.LLMException, match=r"^src_block_index:-1 must be in \[0, 4\)"):
            side.cm.swap_blocks(dev, host, {-1: 0})

    def test_param_invalid(self, side):
        dev, _ = side.register(2, [4, 16], blocks=True)
        dev2, _ = side.register(2, [4, 16], blocks=True)
        contiguous, _ = side.register(2, [4, 16])
        host, _ = cpu_cache(2, [4, 16])
        host_big_blocks, _ = cpu_cache(2, [4, 32])
        host_one_tensor, _ = cpu_cache(1, [4, 16])
        for src, dst, mapping in [
            (dev, dev2, {0: 0}),  # DEVICE -> DEVICE
            (host, host, {0: 1}),  # HOST -> HOST
            (contiguous, host, {0: 0}),
            (dev, host_big_blocks, {0: 0}),
            (dev, host_one_tensor, {0: 0}),
            (dev, host, {4: 0}),
            (dev, host, {0: 4}),
        ]:
            with code(S.LLM_PARAM_INVALID):
                side.cm.swap_blocks(src, dst, mapping)

    def test_create_cpu_cache_errors(self):
        arr = np.zeros(64, np.uint8)
        with code(S.LLM_PARAM_INVALID):
            llm.Cache.create_cpu_cache(llm.CacheDesc(1, [4, 16], llm.DataType.DT_UINT8, DEVICE),
                                       [int(arr.ctypes.data)])
        with code(S.LLM_PARAM_INVALID):
            llm.Cache.create_cpu_cache(llm.CacheDesc(2, [4, 16], llm.DataType.DT_UINT8, HOST),
                                       [int(arr.ctypes.data)])
        with pytest.raises(TypeError):
            llm.Cache.create_cpu_cache(llm.CacheDesc(1, [4, 16], llm.DataType.DT_UINT8, HOST),
                                       int(arr.ctypes.data))


# ================================================================================ remap


class TestRemap:
    def test_device_memory_is_accepted(self, side):
        _, a = side.register(1, [4, 16])
        info = llm.MemInfo(llm.Memtype.MEM_TYPE_DEVICE, int(a.ctypes.data), a.nbytes)
        assert side.cm.remap_registered_memory(info) is None
        assert side.cm.remap_registered_memory([info, info]) is None

    @pytest.mark.parametrize("infos", [
        llm.MemInfo(llm.Memtype.MEM_TYPE_HOST, 4096, 64),
        llm.MemInfo(llm.Memtype.MEM_TYPE_DEVICE, 0, 64),
        llm.MemInfo(llm.Memtype.MEM_TYPE_DEVICE, 4096, 0),
        [llm.MemInfo(llm.Memtype.MEM_TYPE_DEVICE, 4096, 64), "x"],
        (llm.MemInfo(llm.Memtype.MEM_TYPE_DEVICE, 4096, 64),),
        None,
    ])
    def test_param_invalid(self, side, infos):
        with code(S.LLM_PARAM_INVALID):
            side.cm.remap_registered_memory(infos)

    def test_mem_info_types(self):
        with pytest.raises(TypeError):
            llm.MemInfo("device", 4096, 64)
        # hixl v2/llm_types.py MemInfo.__init__ checks types only: a negative address is
        # refused where it is used.
        assert llm.MemInfo(llm.Memtype.MEM_TYPE_DEVICE, -1, 64).addr == -1
