"""Host memory pools: page-aligned, shareable memory that datadist allocates caches from.

Who calls: the native engine (``core/native.py``), for ``allocate_cache`` /
``allocate_blocks_cache`` (``mem_pool_cfg`` and ``host_mem_pool_cfg``), and users who want
their own KV caches in fast memory (:func:`datadist.memory.alloc_shared_array`).

The pool is one ``memfd`` mapped once. Its pages are committed on first touch, so a large pool
costs nothing until used. Because it is a memfd, a peer on the same host can map the same pages
(``/proc/<pid>/fd/<fd>``) and copy out of them with memcpy: the fastest same-host path. Huge
pages back it where the kernel offers them (:func:`shareable_map`, :mod:`.hugepages`).

Allocation is first fit over a sorted free list, every allocation rounded up to the pool's page
(``1 << page_shift``, at least the OS page) so that caches start page-aligned. Thread-safe.
"""

from __future__ import annotations

import bisect
import ctypes
import fcntl
import logging
import mmap
import os
import threading
from dataclasses import dataclass

from datadist.core.errors import InvalidArgument, OutOfMemory
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


class HostPool:
    """A memfd-backed arena with a first-fit allocator. ``close()`` unmaps it."""

    def __init__(self, size: int, page_shift: int = 16, name: str = "datadist-pool") -> None:
        self.page = max(1 << page_shift, OS_PAGE)
        self.size = -(-size // self.page) * self.page  # what the allocator hands out
        try:
            mapped = shareable_map(name, self.size)
        except (OSError, OverflowError) as e:  # ENOMEM, EFBIG, a size past the address space
            raise OutOfMemory(f"cannot map a memory pool of {size} bytes: "
                              f"{getattr(e, 'strerror', None) or e}") from e
        self.fd, self.base = mapped.fd, mapped.addr
        self.map_size = mapped.size  # >= size: whole huge pages (hugepages.round_size)
        self.backing = mapped.backing
        self._closed = False
        self._lock = threading.Lock()
        self._free_starts: list[int] = [0]
        self._free_sizes: dict[int, int] = {0: self.size}
        self._used: dict[int, int] = {}

    def __repr__(self) -> str:
        return (f"<HostPool {self.size} bytes, {self.used} used, base={self.base:#x}, "
                f"{self.backing} pages>")

    @property
    def used(self) -> int:
        with self._lock:
            return sum(self._used.values())

    def allocate(self, nbytes: int) -> int:
        """Reserve ``nbytes`` (rounded up to the page); returns the absolute address."""
        if nbytes <= 0:
            raise InvalidArgument(f"cannot allocate {nbytes} bytes")
        need = -(-nbytes // self.page) * self.page
        with self._lock:
            for i, start in enumerate(self._free_starts):
                have = self._free_sizes[start]
                if have >= need:
                    del self._free_starts[i]
                    del self._free_sizes[start]
                    if have > need:
                        bisect.insort(self._free_starts, start + need)
                        self._free_sizes[start + need] = have - need
                    self._used[start] = need
                    return self.base + start
        raise OutOfMemory(
            f"memory pool exhausted: {nbytes} bytes requested, pool of {self.size} bytes"
        )

    def free(self, addr: int) -> None:
        """Return an allocation. Unknown addresses raise InvalidArgument."""
        start = addr - self.base
        with self._lock:
            size = self._used.pop(start, None)
            if size is None:
                raise InvalidArgument(f"{addr:#x} is not an allocation of this pool")
            i = bisect.bisect(self._free_starts, start)
            # merge with the next free range
            if i < len(self._free_starts) and self._free_starts[i] == start + size:
                nxt = self._free_starts.pop(i)
                size += self._free_sizes.pop(nxt)
            # merge with the previous free range
            if i > 0:
                prev = self._free_starts[i - 1]
                if prev + self._free_sizes[prev] == start:
                    self._free_sizes[prev] += size
                    return
            self._free_starts.insert(i, start)
            self._free_sizes[start] = size

    def contains(self, addr: int, nbytes: int) -> bool:
        return self.base <= addr and addr + nbytes <= self.base + self.size

    def close(self) -> None:
        """Unmap and close. Idempotent. Callers make sure nothing uses the memory any more."""
        if not self._closed:
            self._closed = True
            unmap(self.base, self.map_size)
            os.close(self.fd)
