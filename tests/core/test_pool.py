"""Unit and property tests of memory.pool: the memfd-backed first-fit host pool."""

from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from datadist.core.errors import Code, InvalidArgument, OutOfMemory
from datadist.memory.pool import OS_PAGE, HostPool, PoolConfig, map_shared, unmap

PAGE = 4096


@pytest.fixture
def pool():  # type: ignore[no-untyped-def]
    p = HostPool(16 * PAGE, page_shift=12)
    yield p
    p.close()


def view(addr: int, nbytes: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr))


# ------------------------------------------------------------------------------ basics


def test_size_rounds_up_to_the_page() -> None:
    p = HostPool(PAGE + 1, page_shift=12)
    try:
        assert p.size == 2 * PAGE
    finally:
        p.close()


def test_page_is_at_least_the_os_page() -> None:
    p = HostPool(1, page_shift=10)
    try:
        assert p.page == OS_PAGE
        assert p.size == OS_PAGE
    finally:
        p.close()


@pytest.mark.parametrize("shift", [12, 16])
def test_allocations_are_page_aligned(shift: int) -> None:
    page = max(1 << shift, OS_PAGE)
    p = HostPool(8 * page, page_shift=shift)
    try:
        addrs = [p.allocate(n) for n in (1, page - 1, page, page + 1, 3)]
        for a in addrs:
            assert a % OS_PAGE == 0
            assert (a - p.base) % page == 0
            assert p.contains(a, 1)
        # rounded up to whole pages: 1 + 1 + 1 + 2 + 1 pages
        assert [a - p.base for a in addrs] == [0, page, 2 * page, 3 * page, 5 * page]
        assert p.used == 6 * page
    finally:
        p.close()


def test_memory_is_usable_and_shared_through_the_memfd(pool: HostPool) -> None:
    a = pool.allocate(PAGE)
    mem = view(a, PAGE)
    mem[:] = np.arange(PAGE, dtype=np.uint64).astype(np.uint8)
    # Another mapping of the same fd sees the same bytes: this is what a peer on the same
    # host maps through /proc/<pid>/fd/<fd>.
    other = map_shared(pool.fd, pool.size, writable=False)
    try:
        assert view(other + (a - pool.base), PAGE).tolist() == mem.tolist()
    finally:
        unmap(other, pool.size)


def test_first_fit_reuses_the_lowest_hole(pool: HostPool) -> None:
    a = pool.allocate(PAGE)
    b = pool.allocate(2 * PAGE)
    c = pool.allocate(PAGE)
    pool.free(b)
    # one page fits the hole at b: first fit takes it rather than the space after c
    assert pool.allocate(PAGE) == b
    # three pages do not fit the one page left in the hole: they go after c
    assert pool.allocate(3 * PAGE) == c + PAGE
    assert pool.allocate(PAGE) == b + PAGE
    assert a == pool.base


def test_free_coalesces_with_both_neighbours(pool: HostPool) -> None:
    addrs = [pool.allocate(PAGE) for _ in range(16)]
    with pytest.raises(OutOfMemory):
        pool.allocate(1)
    for i in (3, 5, 4):  # 4 frees the page between two free neighbours
        pool.free(addrs[i])
    assert pool.allocate(3 * PAGE) == addrs[3]  # pages 3..5 merged into one range
    for i in (0, 1, 2, 3, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15):  # 3: the 3-page allocation
        pool.free(addrs[i])
    assert pool.used == 0
    assert pool.allocate(16 * PAGE) == pool.base  # one range again


def test_exhaustion_raises_out_of_memory(pool: HostPool) -> None:
    pool.allocate(10 * PAGE)
    with pytest.raises(OutOfMemory, match="exhausted") as info:
        pool.allocate(7 * PAGE)
    assert info.value.code == Code.OUT_OF_MEMORY
    assert isinstance(info.value, MemoryError)
    assert pool.used == 10 * PAGE  # a failed allocation takes nothing
    pool.allocate(6 * PAGE)


def test_fragmentation_can_exhaust_a_pool_with_enough_free_bytes(pool: HostPool) -> None:
    addrs = [pool.allocate(PAGE) for _ in range(16)]
    for a in addrs[::2]:
        pool.free(a)
    assert pool.size - pool.used == 8 * PAGE
    with pytest.raises(OutOfMemory):
        pool.allocate(2 * PAGE)


@pytest.mark.parametrize("nbytes", [0, -1])
def test_allocate_nothing_is_invalid(pool: HostPool, nbytes: int) -> None:
    with pytest.raises(InvalidArgument):
        pool.allocate(nbytes)


def test_double_free_is_invalid(pool: HostPool) -> None:
    a = pool.allocate(PAGE)
    pool.free(a)
    with pytest.raises(InvalidArgument, match="not an allocation") as info:
        pool.free(a)
    assert info.value.code == Code.PARAM_INVALID
    assert pool.used == 0
    assert pool.allocate(16 * PAGE) == pool.base  # the double free did not corrupt the lists


def test_free_of_a_foreign_or_interior_address_is_invalid(pool: HostPool) -> None:
    a = pool.allocate(2 * PAGE)
    for bad in (a + PAGE, a + 1, pool.base + pool.size, 0):
        with pytest.raises(InvalidArgument):
            pool.free(bad)
    assert pool.used == 2 * PAGE


def test_contains(pool: HostPool) -> None:
    assert pool.contains(pool.base, pool.size)
    assert not pool.contains(pool.base, pool.size + 1)
    assert not pool.contains(pool.base - 1, 1)


def test_close_is_idempotent_and_closes_the_fd() -> None:
    p = HostPool(PAGE, page_shift=12)
    fd = p.fd
    p.close()
    p.close()
    with pytest.raises(OSError):
        os.fstat(fd)


# ------------------------------------------------------------------------------ model check


class PoolModel(RuleBasedStateMachine):
    """Random allocate/free sequences against a page bitmap with lowest-address first fit.

    The bitmap never fragments by bookkeeping, so agreeing with it shows that every free
    coalesces fully: two adjacent free ranges left unmerged would refuse an allocation that
    the bitmap grants.
    """

    PAGES = 24

    def __init__(self) -> None:
        super().__init__()
        self.pool = HostPool(self.PAGES * PAGE, page_shift=12)
        self.free_pages = [True] * self.PAGES
        self.live: dict[int, int] = {}  # addr -> pages

    def teardown(self) -> None:
        self.pool.close()

    def _model_fit(self, need: int) -> int | None:
        run = 0
        for i, free in enumerate(self.free_pages):
            run = run + 1 if free else 0
            if run == need:
                return i - need + 1
        return None

    @rule(nbytes=st.integers(1, 8 * PAGE))
    def allocate(self, nbytes: int) -> None:
        need = -(-nbytes // PAGE)
        want = self._model_fit(need)
        if want is None:
            with pytest.raises(OutOfMemory):
                self.pool.allocate(nbytes)
            return
        addr = self.pool.allocate(nbytes)
        assert addr == self.pool.base + want * PAGE
        self.free_pages[want : want + need] = [False] * need
        self.live[addr] = need

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data) -> None:  # type: ignore[no-untyped-def]
        addr = data.draw(st.sampled_from(sorted(self.live)))
        need = self.live.pop(addr)
        self.pool.free(addr)
        start = (addr - self.pool.base) // PAGE
        self.free_pages[start : start + need] = [True] * need

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def double_free(self, data) -> None:  # type: ignore[no-untyped-def]
        addr = data.draw(st.sampled_from(sorted(self.live)))
        need = self.live.pop(addr)
        self.pool.free(addr)
        start = (addr - self.pool.base) // PAGE
        self.free_pages[start : start + need] = [True] * need
        with pytest.raises(InvalidArgument):
            self.pool.free(addr)

    @invariant()
    def used_matches(self) -> None:
        assert self.pool.used == PAGE * sum(self.live.values())


PoolModel.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestPoolModel = PoolModel.TestCase


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
