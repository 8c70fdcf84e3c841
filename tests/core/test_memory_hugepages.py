"""Huge pages for the memory datadist allocates, their fallbacks, and the shm/cma choice.

The machine running these may offer huge pages for shmem or not (shmem_enabled is often
``never`` and hugetlb pools empty): each test either checks what the kernel really did, or
makes the kernel's answer up through the module's probes, never both.
"""

from __future__ import annotations

import ctypes
import fcntl
import os

import numpy as np
import pytest

from datadist.core.errors import OutOfMemory
from datadist.memory import hugepages, pool, shared
from datadist.testing.engine import host_pool_fd

HUGE = hugepages.pmd_size()


def _vm_flags(addr: int) -> list[str]:
    """The VmFlags of our mapping that starts at ``addr`` (from /proc/self/smaps)."""
    found = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(" ", 1)[0]
            if "-" in head and not head.endswith(":"):
                found = int(head.split("-")[0], 16) == addr
            elif found and line.startswith("VmFlags:"):
                return line.split()[1:]
    raise AssertionError(f"no mapping at {addr:#x}")


def _view(addr: int, n: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(addr))


@pytest.mark.parametrize(("text", "mode", "possible"), [
    ("always within_size advise [never] deny force\n", "never", False),
    ("always within_size [advise] never deny force\n", "advise", True),
    ("[always] within_size advise never\n", "always", True),
    ("always within_size advise never [deny] force\n", "deny", False),
    ("", "", False),  # no shmem THP in this kernel
])
def test_shmem_thp_mode_is_read_from_sysfs(monkeypatch: pytest.MonkeyPatch, text: str,
                                           mode: str, possible: bool) -> None:
    real = hugepages._read
    monkeypatch.setattr(hugepages, "_read",
                        lambda path: text if path.endswith("shmem_enabled") else real(path))
    assert hugepages.shmem_thp_mode() == mode
    assert hugepages.shmem_thp_possible() is possible


def test_hugetlb_fits_only_whole_free_huge_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    meminfo = "MemTotal: 1 kB\nHugePages_Free:        3\nHugepagesize:       2048 kB\n"
    monkeypatch.setattr(hugepages, "_read", lambda path: meminfo)
    mib2 = 2 << 20
    assert hugepages.hugetlb_free_bytes() == (3 * mib2, mib2)
    assert hugepages.hugetlb_fits(2 * mib2) and hugepages.hugetlb_fits(3 * mib2)
    assert not hugepages.hugetlb_fits(4 * mib2)  # more than are free
    assert not hugepages.hugetlb_fits(mib2 + 4096)  # not whole huge pages
    monkeypatch.setattr(hugepages, "_read", lambda path: "")
    assert hugepages.hugetlb_free_bytes() == (0, 0) and not hugepages.hugetlb_fits(mib2)


def test_round_size_whole_huge_pages_from_one_up() -> None:
    assert hugepages.round_size(1, 4096) == 4096
    assert hugepages.round_size(HUGE - 1, 4096) == HUGE
    assert hugepages.round_size(HUGE, 4096) == HUGE
    assert hugepages.round_size(HUGE + 1, 4096) == 2 * HUGE


def test_shareable_map_is_sealed_usable_and_says_what_backs_it() -> None:
    m = pool.shareable_map("test", 3 * HUGE + 5)
    try:
        assert m.size == 4 * HUGE and m.backing in (hugepages.HUGETLB, hugepages.THP,
                                                    hugepages.SMALL)
        assert pool.shrink_sealed(m.fd) and os.fstat(m.fd).st_size == m.size
        view = _view(m.addr, m.size)
        view[::4096] = 7
        assert int(view[::4096].sum()) == 7 * (m.size // 4096)
        if m.backing == hugepages.THP:
            assert "hg" in _vm_flags(m.addr)  # MADV_HUGEPAGE is on the mapping
        if not hugepages.shmem_thp_possible():  # e.g. shmem_enabled=never: nothing asked
            assert m.backing != hugepages.THP
    finally:
        pool.unmap(m.addr, m.size)
        os.close(m.fd)


def test_hugetlb_refused_falls_back_to_a_plain_memfd(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe says hugetlb pages are free, but the kernel refuses (raced for them, or
    none after all): the map comes from ordinary shmem, whole and sealed; no fd leaks."""
    monkeypatch.setattr(hugepages, "hugetlb_fits", lambda size: True)
    real = pool.memfd_map
    asked: list[bool] = []

    def memfd_map(name: str, size: int, *, hugetlb: bool = False) -> tuple[int, int]:
        asked.append(hugetlb)
        if hugetlb:
            raise OSError(12, "Cannot allocate memory")
        return real(name, size)

    monkeypatch.setattr(pool, "memfd_map", memfd_map)
    m = pool.shareable_map("test", 2 * HUGE)
    try:
        assert asked == [True, False] and m.backing != hugepages.HUGETLB
        assert fcntl.fcntl(m.fd, fcntl.F_GET_SEALS) & pool.POOL_SEALS == pool.POOL_SEALS
        _view(m.addr, m.size)[-1] = 1
    finally:
        pool.unmap(m.addr, m.size)
        os.close(m.fd)


def test_a_real_hugetlb_attempt_without_free_pages_falls_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where no hugetlb pages are reserved, a real MFD_HUGETLB memfd cannot be mapped: the
    attempt (forced past the probe) must end in the ordinary memfd, not in an error."""
    if hugepages.hugetlb_free_bytes()[0] >= 2 * HUGE:
        pytest.skip("this host has free hugetlb pages: the fallback is not reachable")
    monkeypatch.setattr(hugepages, "hugetlb_fits", lambda size: True)
    m = pool.shareable_map("test", 2 * HUGE)
    try:
        assert m.backing != hugepages.HUGETLB
    finally:
        pool.unmap(m.addr, m.size)
        os.close(m.fd)


def test_pool_maps_whole_huge_pages_but_allocates_what_was_asked() -> None:
    """The core's pool (cpp/src/pool.h, shm::Region): its memfd is whole huge pages, and it
    hands out exactly the size asked for (rounded to its pages), not a byte more."""
    from datadist.core.config import HOST, EngineConfig
    from datadist.core.layout import Geometry
    from datadist.core.native import NativeEngine

    eng = NativeEngine(EngineConfig(cluster_id=63, role=0,
                                    host_pool=pool.PoolConfig(HUGE + (1 << 16), 16)))
    try:
        fd = host_pool_fd()
        assert os.fstat(fd).st_size == 2 * HUGE
        entry = eng.allocate(Geometry(1, HUGE + (1 << 16), 1), placement=HOST)  # all of it
        with pytest.raises(OutOfMemory):
            eng.allocate(Geometry(1, 1, 1), placement=HOST)
        _view(int(entry.addrs[0]), HUGE + (1 << 16))[[0, -1]] = 1
    finally:
        eng.close()


def test_shared_empty_is_huge_page_sized_and_found_by_lookup() -> None:
    arr = shared.shared_empty((HUGE + 10,), np.uint8)
    arr[-1] = 9
    found = shared.lookup(np.array([arr.ctypes.data], np.uint64), arr.nbytes)
    assert found is not None
    fds, _, offs = found
    assert int(offs[0]) == 0 and os.fstat(int(fds[0])).st_size == 2 * HUGE
