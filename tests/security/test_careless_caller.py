"""A careless caller gets a clear error, never corruption or a crash (issue 9, items 10-17).

Each test names its item. The engines run in this process (two of the C++ core's
``NativeEngine`` s linked both ways, each with the facade it needs), or as the real
``LLMDataDist`` where a session matters.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import pytest

import datadist as llm
from datadist.api.cache_manager import CacheManager
from datadist.core.config import EngineConfig
from datadist.core.native import NativeEngine

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
    engines = [NativeEngine(EngineConfig(cluster_id=c, role=r, listen=("127.0.0.1", 0),
                                         sync_timeout=5.0))
               for c, r in ((PROMPT_ID, 1), (DECODER_ID, 2))]
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
            assert dd.engine.cache(new.cache_id).addrs.tolist() == new.tensor_addrs
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
            dd.engine.cache(new.cache_id)  # still there
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
                                         {"llm.BufPoolCfg": '{"buf_cfg": [{"total_size": '
                                                            + str(10**30) + "}]}"}])
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

    def test_listen_port_that_isdigit_but_is_not_an_int(self):
        e = self._init_error({"llm.EnableCacheManager": "1",
                              "llm.listenIpInfo": "127.0.0.1:\u00b2"})
        assert e.status_code == S.LLM_PARAM_INVALID and "127.0.0.1:\u00b2" in str(e)

    def test_config_setters(self):
        c = llm.LLMConfig()
        with code(S.LLM_PARAM_INVALID):
            c.sync_kv_timeout = "\u00b2"
        with code(S.LLM_PARAM_INVALID):
            c.cluster_info = '{"listen_ip_info": 5}'


# ---------------------------------------------------------------------------------- item 17


PAGE = 4096


class _Mapping:
    """Raw anonymous memory that the test can shrink or protect: what a careless caller's
    allocator might hand over."""

    def __init__(self, pages: int, prot: int | None = None) -> None:
        import ctypes
        import mmap

        self.libc = ctypes.CDLL(None, use_errno=True)
        self.libc.mmap.restype = ctypes.c_void_p
        self.libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                   ctypes.c_int, ctypes.c_int, ctypes.c_long]
        self.libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        prot = mmap.PROT_READ | mmap.PROT_WRITE if prot is None else prot
        self.addr = self.libc.mmap(None, pages * PAGE, prot,
                                   mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        assert self.addr not in (None, ctypes.c_void_p(-1).value)
        self.pages = pages
        self.mapped = [True] * pages

    def unmap(self, first: int, count: int = 1) -> None:
        assert self.libc.munmap(self.addr + first * PAGE, count * PAGE) == 0
        for i in range(first, first + count):
            self.mapped[i] = False

    def protect(self, first: int, count: int, prot: int) -> None:
        assert self.libc.mprotect(self.addr + first * PAGE, count * PAGE, prot) == 0

    def close(self) -> None:
        for i, m in enumerate(self.mapped):
            if m:
                self.libc.munmap(self.addr + i * PAGE, PAGE)


@pytest.fixture
def mapping():
    made: list[_Mapping] = []

    def make(pages: int, prot: int | None = None) -> _Mapping:
        m = _Mapping(pages, prot)
        made.append(m)
        return m

    yield make
    for m in made:
        m.close()


@pytest.fixture
def cm() -> Iterator[CacheManager]:
    engine = NativeEngine(EngineConfig(cluster_id=DECODER_ID, role=2))
    try:
        yield CacheManager(engine)
    finally:
        engine.close()


def _desc(num_tensors: int, nbytes: int) -> llm.CacheDesc:
    return llm.CacheDesc(num_tensors, [1, nbytes], llm.DataType.DT_UINT8, llm.Placement.HOST)


class TestRegistrationChecksTheMemory:
    """Item 17: register_cache / register_blocks_cache refuse memory that cannot hold the
    described cache, naming the tensor and the range, instead of crashing a later pull."""

    def test_memory_shorter_than_the_description(self, cm, mapping):
        m = mapping(2)
        m.unmap(1)  # one page left, two described
        with code(S.LLM_PARAM_INVALID, r"tensor 0 \[0x[0-9a-f]+, 0x[0-9a-f]+\) \(8192 bytes\)"):
            cm.register_cache(_desc(1, 2 * PAGE), [m.addr])
        with code(S.LLM_PARAM_INVALID, "tensor 0"):
            cm.register_blocks_cache(_desc(1, 2 * PAGE), [m.addr])
        cm.register_cache(_desc(1, PAGE), [m.addr])  # what is there may be registered

    def test_unmapped_address_names_the_tensor(self, cm, mapping):
        good, gone = mapping(1), mapping(1)
        gone.unmap(0)
        with code(S.LLM_PARAM_INVALID, "tensor 1"):
            cm.register_cache(_desc(2, PAGE), [good.addr, gone.addr])
        with code(S.LLM_PARAM_INVALID, "tensor 0"):
            cm.register_cache(_desc(1, 64), [PAGE])  # page 1: never mapped

    def test_read_only_memory_is_refused(self, cm, mapping):
        import mmap

        m = mapping(2)
        m.protect(1, 1, mmap.PROT_READ)
        with code(S.LLM_PARAM_INVALID, f"{PAGE} bytes in"):
            cm.register_cache(_desc(1, 2 * PAGE), [m.addr])

    def test_numpy_array_smaller_than_the_description(self, cm):
        small = np.zeros(100, np.uint8)
        with code(S.LLM_PARAM_INVALID, r"addrs\[0\] holds 100 bytes"):
            cm.register_cache(_desc(1, 128), [small])
        with pytest.raises(TypeError):
            cm.register_cache(_desc(1, 128), ["0x1000"])
        with code(S.LLM_PARAM_INVALID, "C-contiguous"):
            cm.register_cache(_desc(1, 64), [np.zeros((64, 2), np.uint8)[:, 0]])


class TestArraysAndTensorsAsAddresses:
    """Item 17, extension: numpy arrays and CPU torch tensors where an address is expected,
    kept alive while registered."""

    def test_numpy_and_torch_sources_are_kept_alive_and_served(self, ra_pair):
        import gc
        import weakref

        torch = pytest.importorskip("torch")
        p, d = ra_pair
        desc = llm.CacheDesc(2, [2, 256], llm.DataType.DT_UINT8, llm.Placement.DEVICE)
        a = np.arange(512, dtype=np.uint16).astype(np.uint8)
        t = torch.arange(512, dtype=torch.uint8).flip(0)
        want = [a.copy(), t.numpy().copy()]
        src = p.register_cache(desc, [a, t])
        assert src.tensor_addrs == [a.ctypes.data, t.data_ptr()]
        alive = [weakref.ref(t)]
        del a, t
        gc.collect()
        assert alive[0]() is not None  # held by the registration
        dst = [np.zeros(512, np.uint8) for _ in range(2)]
        local = d.register_cache(desc, dst)
        d.pull_cache(llm.CacheKeyByIdAndIndex(PROMPT_ID, src.cache_id, 1), local, 0)
        for got, w in zip(dst, want, strict=True):
            assert np.array_equal(got[:256], w[256:])
        p.unregister_cache(src.cache_id)
        gc.collect()
        assert alive[0]() is None  # released with the registration

    def test_tensor_smaller_than_the_description(self, cm):
        torch = pytest.importorskip("torch")
        with code(S.LLM_PARAM_INVALID, r"addrs\[1\] holds 32 bytes"):
            cm.register_cache(_desc(2, 64), [torch.zeros(16), torch.zeros(8)])
        with code(S.LLM_PARAM_INVALID, "not contiguous"):
            cm.register_cache(_desc(1, 64), [torch.zeros(4, 8).t()])


class TestOwnerThatCannotReadItsMemory:
    """Item 17: memory unmapped after registration: the owner probes the tensors a request
    touches before it streams them, says so on stderr, and answers with an error frame
    (LLM_DEVICE_MEM_ERROR); the connection stays usable and nobody crashes."""

    def test_tcp_read_of_unmapped_registered_memory(self, mapping, capfd):
        owner = NativeEngine(EngineConfig(cluster_id=PROMPT_ID, role=1,
                                          listen=("127.0.0.1", 0)))
        reader = NativeEngine(EngineConfig(cluster_id=DECODER_ID, role=2, transport="tcp",
                                           sync_timeout=5.0))
        try:
            reader.link(PROMPT_ID, *owner.listen_address, 5.0)
            link = reader.get_link(PROMPT_ID)
            ocm, rcm = CacheManager(owner), CacheManager(reader)
            m = mapping(4)
            src = ocm.register_cache(_desc(1, 4 * PAGE), [m.addr])
            good = np.arange(4 * PAGE, dtype=np.uint32).astype(np.uint8)
            kept = ocm.register_cache(_desc(1, 4 * PAGE), [good])
            m.unmap(0, 4)  # the caller frees it behind our back
            dst_arr = np.zeros(4 * PAGE, np.uint8)
            dst = rcm.register_cache(_desc(1, 4 * PAGE), [dst_arr])
            hellos = owner.hello_count(DECODER_ID)
            with pytest.raises(llm.LLMException) as e:
                rcm.pull_cache(llm.CacheKeyByIdAndIndex(PROMPT_ID, src.cache_id), dst)
            assert e.value.status_code == llm.LLMStatusCode.LLM_DEVICE_MEM_ERROR
            assert "not mapped" in str(e.value)
            assert "is not mapped any more" in capfd.readouterr().err  # the owner's own error
            # an error frame, not a cut connection: the same channel serves the next pull
            rcm.pull_cache(llm.CacheKeyByIdAndIndex(PROMPT_ID, kept.cache_id), dst)
            assert reader.get_link(PROMPT_ID) == link  # the same core link (its serial)
            assert owner.hello_count(DECODER_ID) == hellos  # no new control channel
            reader.check_link(PROMPT_ID, 5.0)  # and it is open
            assert np.array_equal(dst_arr, good)
            # a push into the freed memory is refused the same way
            from datadist.core.errors import DatadistError
            from datadist.core.layout import every_tensor, plan_slot
            from datadist.wire import protocol as p

            entry = reader.cache(dst.cache_id)
            plan = plan_slot(entry.geometry, 0, every_tensor(1))
            with pytest.raises(DatadistError) as err:
                reader.push(PROMPT_ID, p.KeyRef(p.KeyKind.CACHE_ID, src.cache_id, 0), 0, plan,
                            dst.cache_id, 5.0)
            assert err.value.code == llm.LLMStatusCode.LLM_DEVICE_MEM_ERROR
        finally:
            reader.close()
            owner.close()


_SWAP_INTO_FREED = """
import ctypes, mmap
import numpy as np
import datadist as llm
from datadist.api.cache_manager import CacheManager
from datadist.core.config import EngineConfig
from datadist.core.native import NativeEngine
from datadist.memory.pool import PoolConfig

libc = ctypes.CDLL(None)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
engine = NativeEngine(EngineConfig(cluster_id=2, role=2, device_pool=PoolConfig(1 << 20, 12)))
cm = CacheManager(engine, mem_pool=True)
desc = llm.CacheDesc(1, [4, 4096], llm.DataType.DT_UINT8, llm.Placement.DEVICE)
dev = cm.allocate_blocks_cache(desc)
addr = libc.mmap(None, 4 * 4096, mmap.PROT_READ | mmap.PROT_WRITE,
                 mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
libc.munmap(addr + 4096, 3 * 4096)  # the caller's buffer: one page of the four described
host = llm.Cache.create_cpu_cache(
    llm.CacheDesc(1, [4, 4096], llm.DataType.DT_UINT8, llm.Placement.HOST), [addr])
try:
    cm.swap_blocks(dev, host, {0: 3})
    print("SWAPPED")
except llm.LLMException as e:
    print("REFUSED", e.status_code, e)
engine.close()
"""


class TestCpuCacheMemory:
    """Item 17, the same hole in local copies: swap_blocks into a create_cpu_cache whose
    memory is shorter than its description is PARAM_INVALID, not a SIGSEGV."""

    def test_swap_into_short_cpu_cache(self):
        import subprocess
        import sys
        from pathlib import Path

        src = str(Path(llm.__file__).resolve().parents[1])
        proc = subprocess.run([sys.executable, "-c", _SWAP_INTO_FREED], capture_output=True,
                              text=True, timeout=60, env={"PYTHONPATH": src, "PATH": ""})
        assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
        assert "REFUSED LLMStatusCode.LLM_PARAM_INVALID" in proc.stdout, proc.stdout
        assert "cpu cache tensor 0" in proc.stdout


class TestV1TensorFromAddress:
    """The v1 ``Tensor(address, desc)``: a view of memory that is not there is PARAM_INVALID,
    not a SIGSEGV at the first access; read-only memory gives a read-only array."""

    def test_unmapped_and_short_memory(self, mapping):
        from datadist.api.v1 import Tensor, TensorDesc

        m = mapping(2)
        m.unmap(1)
        u8 = llm.DataType.DT_UINT8
        assert Tensor(m.addr, TensorDesc(u8, [PAGE])).numpy().nbytes == PAGE
        with code(S.LLM_PARAM_INVALID, "not wholly mapped"):
            Tensor(m.addr, TensorDesc(u8, [2 * PAGE]))
        with code(S.LLM_PARAM_INVALID):
            Tensor(0, TensorDesc(u8, [4]))
        with code(S.LLM_PARAM_INVALID):
            Tensor(m.addr, TensorDesc(u8, [2**62, 8]))

    def test_read_only_memory_gives_a_read_only_view(self, mapping):
        import mmap

        from datadist.api.v1 import Tensor, TensorDesc

        m = mapping(1, mmap.PROT_READ)
        view = Tensor(m.addr, TensorDesc(llm.DataType.DT_UINT8, [PAGE])).numpy()
        assert not view.flags.writeable
        with pytest.raises(ValueError):
            view[0] = 1


def test_rank_table_digit_strings_are_ascii():
    """Item 16's class of bug in the rank table: '²' passes str.isdigit() but not int()."""
    from datadist.api import rank_table

    table = ('{"version": "1.0", "server_list": [{"device": [{"rank_id": "\\u00b2", '
             '"device_ip": "127.0.0.1"}]}]}')
    with code(S.LLM_PARAM_INVALID, "rank_id"):
        rank_table.parse(table)
