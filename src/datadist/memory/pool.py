"""Shareable memory and the pool settings: page-aligned memfd mappings, and ``PoolConfig``.

Who calls: ``datadist.memory.shared`` (``shared_empty``: users who want their own KV caches in
fast memory), ``datadist info`` and benchmarks (``shareable_map``, ``map_shared``), and the
configuration (``PoolConfig``: ``mem_pool_cfg`` / ``host_mem_pool_cfg``). The pools themselves
are the core's (cpp/src/pool.h): one sealed memfd each, carved first fit in pages, their pages
given back by the core's registry once nothing holds a cache.

A memfd's pages are committed on first touch, so a large mapping costs nothing until used.
Because it is a memfd, a peer on the same host can map the same pages
(``/proc/<pid>/fd/<fd>``) and copy out of them with memcpy: the fastest same-host path. Huge
pages back it where the kernel offers them (:func:`shareable_map`, :mod:`.hugepages`).
Nothing here blocks; thread-safe.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import mmap
import os
from dataclasses import dataclass

from datadist.core.errors import InvalidArgument
from datadist.memory import hugepages

log = logging.getLogger(__name__)

OS_PAGE = mmap.PAGESIZE

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.argtypes = [
    ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long
]
_libc.mmap.restype = ctypes.c_void_p
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.munmap.restype = ctypes.c_int
_MAP_FAILED = ctypes.c_void_p(-1).value


def map_shared(fd: int, size: int, *, writable: bool = True) -> int:
    """mmap ``size`` bytes of ``fd`` shared; returns the address. Raw, so no Python buffer
    export pins the mapping: ``unmap`` is always allowed, and views must not outlive it."""
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    addr = _libc.mmap(None, size, prot, mmap.MAP_SHARED, fd, 0)
    if addr in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        raise OSError(err, f"mmap failed: {os.strerror(err)}")
    if hugepages.shmem_thp_possible():  # a reader's view maps the owner's huge pages whole
        hugepages.advise(int(addr), size)
    return int(addr)


# A shared pool's size is fixed for good: a same-host reader maps it, and a file shrunk under
# its mapping would make its next copy fault (SIGBUS). Readers check SHRINK (shrink_sealed).
POOL_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def memfd_map(name: str, size: int, *, hugetlb: bool = False) -> tuple[int, int]:
    """A new memfd of ``size`` bytes, sealed at that size (POOL_SEALS), mapped shared:
    (fd, address). ``hugetlb``: on hugetlbfs pages (``size`` a multiple of them); OSError
    where there are not enough free."""
    flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | (os.MFD_HUGETLB if hugetlb else 0)
    fd = os.memfd_create(name, flags)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, POOL_SEALS)
        return fd, map_shared(fd, size)
    except OSError:
        os.close(fd)
        raise


@dataclass(frozen=True, slots=True)
class SharedMap:
    """A sealed memfd mapped shared: its fd, address, size, and what backs it
    (``hugepages.HUGETLB``, ``THP`` or ``SMALL``)."""

    fd: int
    addr: int
    size: int
    backing: str


def shareable_map(name: str, nbytes: int) -> SharedMap:
    """A sealed memfd of at least ``nbytes``, mapped shared, on huge pages where the kernel
    offers them: hugetlbfs pages when enough are free (committed now), else shmem transparent
    huge pages (asked for with MADV_HUGEPAGE where shmem_enabled allows them), else 4 KiB
    pages. The size is rounded up to whole huge pages from one huge page up
    (:func:`hugepages.round_size`); untouched pages of a non-hugetlb map cost nothing."""
    size = hugepages.round_size(nbytes, OS_PAGE)
    if hugepages.hugetlb_fits(size):
        try:
            fd, addr = memfd_map(name, size, hugetlb=True)
            return SharedMap(fd, addr, size, hugepages.HUGETLB)
        except OSError as e:  # raced for the pages, or hugetlb memfds unsupported here
            log.info("no hugetlb memfd of %d bytes (%s): transparent or small pages", size, e)
    fd, addr = memfd_map(name, size)
    thp = hugepages.shmem_thp_possible() and hugepages.advise(addr, size)
    return SharedMap(fd, addr, size, hugepages.THP if thp else hugepages.SMALL)


def shrink_sealed(fd: int) -> bool:
    """Whether the file ``fd`` can never shrink (a memfd with F_SEAL_SHRINK). Files that
    cannot carry seals (not a memfd) are not."""
    try:
        return bool(fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK)
    except OSError:
        return False


def unmap(addr: int, size: int) -> None:
    _libc.munmap(addr, size)


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """A memory pool's size in bytes and page size (``1 << page_shift``, 64 KiB by default),
    from ``mem_pool_cfg``/``host_mem_pool_cfg``."""

    memory_size: int
    page_shift: int = 16

    @classmethod
    def parse(cls, text: str) -> PoolConfig:
        """Parse the JSON of ``mem_pool_cfg`` / ``host_mem_pool_cfg``."""
        import json

        try:
            cfg = json.loads(text)
        except ValueError as e:
            raise InvalidArgument(f"memory pool config is not JSON: {e}") from None
        if not isinstance(cfg, dict) or "memory_size" not in cfg:
            raise InvalidArgument('memory pool config needs {"memory_size": N}')
        size = cfg["memory_size"]
        shift = cfg.get("page_shift", 16)
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise InvalidArgument(f"memory_size must be an int > 0, got {size!r}")
        if not isinstance(shift, int) or isinstance(shift, bool) or not 10 <= shift < 31:
            raise InvalidArgument(f"page_shift must be an int in [10, 31), got {shift!r}")
        if (size >> shift) >= 0xFFFFFFFF:
            raise InvalidArgument("memory_size >> page_shift must be below 2**32 - 1")
        return cls(size, shift)
