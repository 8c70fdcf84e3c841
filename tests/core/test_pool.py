"""The core's pools (cpp/src/pool.h) as the engine uses them, and memory.pool's PoolConfig.

The allocator itself (first fit in pages, coalescing, exhaustion, a random model check against
a page bitmap) is tested in cpp/tests/pool_test.cc; here: what the Python face sees of it.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator

import numpy as np
import pytest

from datadist.core.config import DEVICE, HOST, EngineConfig
from datadist.core.errors import DeviceOutOfMemory, InvalidArgument, OutOfMemory
from datadist.core.keys import KeyId
from datadist.core.layout import Geometry
from datadist.core.native import NativeEngine
from datadist.memory.pool import PoolConfig, map_shared, unmap

PAGE = 4096


def view(addr: int, nbytes: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr))


def pool_fd(name: str) -> int:
    """Our descriptor of the memfd the core made for a pool (``datadist-host-pool``)."""
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith(f"/memfd:{name} "):
                return int(fd)
        except OSError:
            continue
    raise AssertionError(f"no memfd {name}")


@pytest.fixture
def engine() -> Iterator[NativeEngine]:
    eng = NativeEngine(EngineConfig(cluster_id=61, role=0, host_pool=PoolConfig(16 * PAGE, 12),
                                    device_pool=PoolConfig(4 * PAGE, 12)))
    yield eng
    eng.close()


GEO = Geometry(2, 2 * PAGE + 8, 2)  # 2 tensors of 2 slots, each tensor 3 pages once rounded


def test_pool_caches_are_page_aligned_and_shared_through_the_memfd(engine: NativeEngine) -> None:
    a = engine.allocate(GEO, placement=HOST)
    b = engine.allocate(GEO, placement=HOST)
    assert a.owned and engine.pool_used(HOST) == 4 * 3 * PAGE
    base = int(a.addrs[0])
    assert base % PAGE == 0
    assert [int(x) - base for x in (*a.addrs, *b.addrs)] == [0, 3 * PAGE, 6 * PAGE, 9 * PAGE]
    mem = view(int(b.addrs[1]), PAGE)
    mem[:] = np.arange(PAGE, dtype=np.uint64).astype(np.uint8)
    # another mapping of the memfd sees the same bytes: what a same-host reader maps
    fd = pool_fd("datadist-host-pool")
    other = map_shared(fd, 16 * PAGE, writable=False)
    try:
        assert view(other + 9 * PAGE, PAGE).tolist() == mem.tolist()
    finally:
        unmap(other, 16 * PAGE)
    with pytest.raises(PermissionError):  # sealed: a reader's mapping can never fault
        os.ftruncate(fd, PAGE)


def test_the_core_gives_the_pages_back_once_nothing_holds_the_cache(engine: NativeEngine) -> None:
    key = KeyId(5, 0, False)
    kept = engine.allocate(GEO, placement=HOST, keys=[key])
    gone = engine.allocate(GEO, placement=HOST)
    engine.deallocate(gone.cache_id)
    assert engine.pool_used(HOST) == 2 * 3 * PAGE  # at once: nobody polls for it
    engine.deallocate(kept.cache_id)
    assert engine.pool_used(HOST) == 2 * 3 * PAGE  # its key still serves it
    engine.remove_key(key)
    assert engine.pool_used(HOST) == 0
    again = engine.allocate(GEO, placement=HOST)  # the lowest pages again
    assert int(again.addrs[0]) == int(kept.addrs[0])


def test_a_full_pool_is_out_of_memory_and_allocates_nothing(engine: NativeEngine) -> None:
    with pytest.raises(DeviceOutOfMemory):
        engine.allocate(Geometry(1, 5 * PAGE, 1), placement=DEVICE)
    assert engine.pool_used(DEVICE) == 0
    engine.allocate(Geometry(1, 4 * PAGE, 1), placement=DEVICE)
    with pytest.raises(DeviceOutOfMemory):
        engine.allocate(Geometry(1, 1, 1), placement=DEVICE)
    with pytest.raises(OutOfMemory):
        engine.allocate(Geometry(1, 17 * PAGE, 1), placement=HOST)
    with pytest.raises(InvalidArgument):  # a bad key (given twice), before any memory
        engine.allocate(Geometry(1, PAGE, 1), placement=HOST,
                        keys=[KeyId(1, 0, False), KeyId(1, 0, False)])
    assert engine.pool_used(HOST) == 0


def test_no_pool_is_invalid_and_close_drops_the_pools() -> None:
    eng = NativeEngine(EngineConfig(cluster_id=62, role=0, host_pool=PoolConfig(4 * PAGE, 12)))
    try:
        with pytest.raises(InvalidArgument, match="no memory pool for DEVICE placement"):
            eng.allocate(Geometry(1, PAGE, 1), placement=DEVICE)
        eng.allocate(Geometry(1, PAGE, 1), placement=HOST)
    finally:
        eng.close()
    assert eng.pool_used(HOST) is None
    with pytest.raises(AssertionError, match="no memfd"):
        pool_fd("datadist-host-pool")  # unmapped and closed: nothing held a cache


# ------------------------------------------------------------------------------ PoolConfig


def test_pool_config_parse() -> None:
    assert PoolConfig.parse('{"memory_size": 1024}') == PoolConfig(1024, 16)
    assert PoolConfig.parse('{"memory_size": 4096, "page_shift": 12}') == PoolConfig(4096, 12)


@pytest.mark.parametrize(
    "text",
    ["not json", "[]", "{}", '{"memory_size": 0}', '{"memory_size": -5}',
     '{"memory_size": true}', '{"memory_size": 1.5}', '{"memory_size": "1024"}',
     '{"memory_size": 1024, "page_shift": 9}', '{"memory_size": 1024, "page_shift": 31}',
     '{"memory_size": 1024, "page_shift": false}',
     '{"memory_size": 1099511627776000, "page_shift": 10}'],
)
def test_pool_config_parse_refuses(text: str) -> None:
    with pytest.raises(InvalidArgument):
        PoolConfig.parse(text)


def test_shared_allocators_are_exported_where_the_readme_names_them():
    from datadist.memory import shared_empty, shared_tensor
    from datadist.memory.shared import shared_empty as inner

    assert shared_empty is inner and callable(shared_tensor)
    a = shared_empty((3, 5), np.float32)
    assert a.shape == (3, 5) and a.dtype == np.float32 and a.ctypes.data % 4096 == 0
