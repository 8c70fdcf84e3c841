"""Local copies: ``copy_cache``, ``copy_blocks``, ``swap_blocks`` (with ``create_cpu_cache``),
``remap_registered_memory``; the core's planned copies they call (``NativeEngine.copy_slot`` /
``copy_blocks``: the session's CopySlot / CopyBlocks, planned by cpp/src/plan.cc).

Every copy is checked byte for byte against the same copy done with numpy slicing, including
the bytes that must stay untouched.
"""

from __future__ import annotations

import sys
import time

import numpy as np
import pytest

import datadist as llm
from datadist.api.cache_manager import CacheManager
from datadist.core.errors import CacheNotFound, InvalidArgument
from datadist.core.layout import Geometry
from datadist.core.native import NativeEngine
from datadist.testing.doubles import BusyCounter

from ._support import PROMPT_ID, code, units

S = llm.LLMStatusCode
HOST, DEVICE = llm.Placement.HOST, llm.Placement.DEVICE


@pytest.fixture
def side(make_side):
    return make_side(PROMPT_ID, listen=False)


# ================================================================================ the core's copies


class TestCorePlanner:
    """``NativeEngine.copy_slot`` / ``copy_blocks``: one core call plans the copy with the
    Python API's rules and texts (cpp/src/plan.cc PlanSlotCopy / PlanBlockCopy, the C++ API's
    CopyKvCache / CopyKvBlocks plan with them too), holds both caches, checks every span against
    both and copies. A refusal writes nothing and leaves no hold."""

    def test_slot_copy_lands_where_the_plan_says_and_counts_it(self, side):
        src, a = side.register(3, [4, 64], seed=21)
        dst, b = side.register(3, [2, 64])
        n = side.engine.copy_slot(src.cache_id, dst.cache_id, src_unit=3, dst_unit=1, offset=8,
                                  size=16)
        assert n == 3 * 16
        want = np.zeros_like(b)
        units(want, 2)[:, 1, 8:24] = units(a, 4)[:, 3, 8:24]
        np.testing.assert_array_equal(b, want)

    def test_slot_copy_default_size_is_rest_of_source_slot(self, side):
        src, a = side.register(1, [1, 64], seed=22)
        dst, b = side.register(1, [1, 128])
        assert side.engine.copy_slot(src.cache_id, dst.cache_id, src_unit=0, dst_unit=0,
                                     offset=10) == 54
        np.testing.assert_array_equal(b[0, 10:64], a[0, 10:64])
        assert not b[0, :10].any() and not b[0, 64:].any()

    @pytest.mark.parametrize("args,text", [
        (dict(src_unit=4, dst_unit=0), "src_batch_index 4 out of range [0, 4)"),
        (dict(src_unit=0, dst_unit=2), "dst_batch_index 2 out of range [0, 2)"),
        (dict(src_unit=0, dst_unit=0, offset=64),
         "offset 64 out of range of the src batch stride 64"),
        (dict(src_unit=0, dst_unit=0, size=65),
         "size 65 does not fit the src batch stride 64 after offset 0"),
        (dict(src_unit=0, dst_unit=0, offset=60, size=5),
         "size 5 does not fit the src batch stride 64 after offset 60"),
    ])
    def test_slot_copy_refusals_are_the_python_api_texts(self, side, args, text):
        src, _ = side.register(2, [4, 64], seed=23)
        dst, b = side.register(2, [2, 64])
        with pytest.raises(InvalidArgument) as e:
            side.engine.copy_slot(src.cache_id, dst.cache_id, **args)
        assert str(e.value) == text
        assert not b.any()
        assert side.engine.leases(src.cache_id) == side.engine.leases(dst.cache_id) == 0

    def test_slot_copy_needs_equal_tensor_counts(self, side):
        two, _ = side.register(2, [1, 64])
        three, _ = side.register(3, [1, 64])
        with pytest.raises(InvalidArgument, match="^src has 2 tensors but dst has 3 tensors$"):
            side.engine.copy_slot(two.cache_id, three.cache_id, src_unit=0, dst_unit=0)

    def test_block_copy_coalesced_runs_land_as_numpy_says(self, side):
        src, a = side.register(2, [16, 32], blocks=True, seed=24)
        dst, b = side.register(2, [16, 32], blocks=True)
        s, d = np.array([0, 1, 2, 9], np.uint64), np.array([5, 6, 7, 3], np.uint64)
        assert side.engine.copy_blocks(src.cache_id, dst.cache_id, s, d) == 2 * 4 * 32
        want = np.zeros_like(b)
        units(want, 16)[:, d.astype(int)] = units(a, 16)[:, s.astype(int)]
        np.testing.assert_array_equal(b, want)

    @pytest.mark.parametrize("src,dst,same,text", [
        ([16], [0], False, "src block 16 out of range: the cache has 16 blocks"),
        ([0], [16], False, "dst block 16 out of range: the cache has 16 blocks"),
        ([0, 1], [2, 2], False, "a destination block is listed more than once"),
        ([0, 1], [3, 1], True, "block 1 is both a source and a destination"),
        ([], [], False, "no blocks to copy"),
        ([0, 1], [2], False, "src_blocks has 2 entries but dst_blocks has 1"),
    ])
    def test_block_copy_refusals_are_the_python_api_texts(self, side, src, dst, same, text):
        a_cache, a = side.register(1, [16, 32], blocks=True, seed=25)
        b_cache, _ = side.register(1, [16, 32], blocks=True)
        before = a.copy()
        other = a_cache if same else b_cache
        with pytest.raises(InvalidArgument) as e:
            side.engine.copy_blocks(a_cache.cache_id, other.cache_id, np.array(src, np.uint64),
                                    np.array(dst, np.uint64))
        assert str(e.value) == text
        np.testing.assert_array_equal(a, before)

    def test_block_copy_needs_equal_block_sizes_in_the_callers_units(self, side):
        small, _ = side.register(1, [2, 32], blocks=True, dtype=llm.DataType.DT_FLOAT16)
        big, _ = side.register(1, [2, 64], blocks=True, dtype=llm.DataType.DT_FLOAT16)
        with pytest.raises(InvalidArgument) as e:
            side.engine.copy_blocks(small.cache_id, big.cache_id, np.array([0], np.uint64),
                                    np.array([0], np.uint64))
        assert str(e.value) == ("block sizes differ: the source's blocks hold 32 DT_FLOAT16 "
                                "elements (64 bytes), the destination's 64 DT_FLOAT16 elements "
                                "(128 bytes)")

    def test_a_cache_not_filed_is_cache_not_found(self, side):
        src, _ = side.register(1, [4, 16], blocks=True)
        gone, _ = side.register(1, [4, 16], blocks=True)
        side.cm.unregister_cache(gone.cache_id)
        one = np.array([0], np.uint64)
        for s_id, d_id in [(src.cache_id, gone.cache_id), (gone.cache_id, src.cache_id),
                           (src.cache_id, -1)]:
            with pytest.raises(CacheNotFound):
                side.engine.copy_blocks(s_id, d_id, one, one)
            with pytest.raises(CacheNotFound):
                side.engine.copy_slot(s_id, d_id, src_unit=0, dst_unit=0)

    def test_unfiled_memory_is_planned_against_its_description(self, side):
        src, a = side.register(1, [4, 16], blocks=True, seed=13)
        mine = np.zeros(64, np.uint8)
        user = side.engine.user_cache(Geometry(1, 64, 4, True), np.array([mine.ctypes.data]))
        with pytest.raises(InvalidArgument, match="^dst block 4 out of range"):
            side.engine.copy_blocks(src.cache_id, user, np.array([0], np.uint64),
                                    np.array([4], np.uint64))
        assert not mine.any()
        side.engine.copy_blocks(src.cache_id, user, np.array([1], np.uint64),
                                np.array([3], np.uint64))
        np.testing.assert_array_equal(mine[48:], a[0, 16:32])
        # the same unfiled memory on both sides is one cache
        with pytest.raises(InvalidArgument, match="both a source and a destination"):
            side.engine.copy_blocks(user, user, np.array([3], np.uint64), np.array([3], np.uint64))
        with pytest.raises(InvalidArgument):
            side.engine.user_cache(Geometry(1, 64, 4, True), np.array([0]))

    def test_the_facades_copy_through_the_core_planner(self, side, monkeypatch):
        """copy_cache, copy_blocks and swap_blocks make one core planning call each, with the
        caller's indices as they are (nothing planned in Python)."""
        calls = []
        for name in ("copy_slot", "copy_blocks"):
            real = getattr(NativeEngine, name)

            def spy(self, *args, _real=real, _name=name, **kwargs):
                calls.append((_name, args, kwargs))
                return _real(self, *args, **kwargs)

            monkeypatch.setattr(NativeEngine, name, spy)
        c, _ = side.register(1, [4, 16], seed=26)
        d, _ = side.register(1, [4, 16])
        blocks, _ = side.register(1, [8, 16], blocks=True, seed=27)
        host, _ = side.register(1, [8, 16], blocks=True, placement=HOST)
        side.cm.copy_cache(d, c, dst_batch_index=1, src_batch_index=2, offset=4, size=8)
        side.cm.copy_blocks(blocks, {0: [5, 6], 1: [7]})
        side.cm.swap_blocks(blocks, host, {2: 3, 3: 4})
        assert [n for n, _, _ in calls] == ["copy_slot", "copy_blocks", "copy_blocks"]
        assert calls[0][1] == (c.cache_id, d.cache_id)
        assert calls[0][2] == dict(src_unit=2, dst_unit=1, offset=4, size=8)
        assert [a.tolist() for a in calls[1][1][2:]] == [[0, 0, 1], [5, 6, 7]]
        assert calls[1][1][:2] == (blocks.cache_id, blocks.cache_id)
        assert [a.tolist() for a in calls[2][1][2:]] == [[2, 3], [3, 4]]

    def test_a_small_copy_keeps_the_gil_and_a_large_one_lets_it_go(self, side):
        """Up to 1 MiB (cpp/python/gil.h's kHoldBytes) a copy keeps the interpreter's lock: a
        busy Python thread does not run across 50 of them, with a switch interval too long for
        the interpreter to take the lock from us. A 16 MiB copy lets it go once planned (the
        busy thread runs during such copies) and lands whole."""
        small_src, _ = side.register(2, [4, 256], seed=28)
        small_dst, _ = side.register(2, [4, 256])
        big_src, a = side.register(4, [2, 4 << 20], seed=29)
        big_dst, b = side.register(4, [2, 4 << 20])
        eng = side.engine
        old = sys.getswitchinterval()
        try:
            sys.setswitchinterval(1.0)
            with BusyCounter() as busy:
                time.sleep(0.01)  # the busy thread runs; we get the lock back by the interval
                assert busy.steps > 0
                before = busy.steps
                for _ in range(50):
                    eng.copy_slot(small_src.cache_id, small_dst.cache_id, src_unit=1, dst_unit=2)
                assert busy.steps == before
            # 0.1 s: longer than the copies take on a quiet machine, so the busy thread runs
            # only if they let the lock go (the system must schedule it during one of them;
            # we then wait up to the interval to get the lock back)
            sys.setswitchinterval(0.1)
            with BusyCounter() as busy:
                time.sleep(0.01)
                before = busy.steps
                for _ in range(10):
                    assert eng.copy_slot(big_src.cache_id, big_dst.cache_id, src_unit=0,
                                         dst_unit=1) == 4 * (4 << 20)
                assert busy.steps > before
        finally:
            sys.setswitchinterval(old)
        np.testing.assert_array_equal(units(b, 2)[:, 1], units(a, 2)[:, 0])

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
