"""Huge pages for the shareable memory datadist allocates, where the kernel offers them.

Who calls: :func:`datadist.memory.pool.memfd_map` (pools and ``shared_empty``), once per
mapping, and :func:`~datadist.memory.pool.map_shared` (a same-host reader's view of a peer's
memfd). Nothing blocks; every probe reads a small file under /proc or /sys once.

Why: a same-host copy out of memory on 4 KiB pages costs the kernel a page walk (and, for
``process_vm_readv``, a page pin) every 4 KiB; numpy's own large arrays get transparent huge
pages and copy out up to 2x faster. A memfd can be backed by huge pages two ways:

* hugetlbfs (``MFD_HUGETLB``): pages an administrator reserved (``vm.nr_hugepages``). Used only
  when enough of them are free for the whole mapping, since they are committed at ``mmap``,
  not on first touch; any failure falls back to the next way;
* shmem transparent huge pages: ``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` set to
  ``always``, ``within_size`` or ``advise`` (the last one needs ``MADV_HUGEPAGE`` on the
  mapping, which :func:`advise` gives). ``never``/``deny`` (a common default): 4 KiB pages.

What a mapping got is reported (:data:`HUGETLB`, :data:`THP`, :data:`SMALL`) so that
``datadist info`` and the logs can say why a same-host copy runs at the speed it does.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import re

log = logging.getLogger(__name__)

HUGETLB, THP, SMALL = "hugetlb", "thp", "4k"
SYSFS = "/sys/kernel/mm/transparent_hugepage"
MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def pmd_size() -> int:
    """The transparent huge page size (2 MiB on x86-64), from sysfs; 2 MiB if not told."""
    text = _read(f"{SYSFS}/hpage_pmd_size").strip()
    return int(text) if text.isdigit() else 2 << 20


def shmem_thp_mode() -> str:
    """The selected mode of ``shmem_enabled`` ("always", "within_size", "advise", "never",
    "deny", "force"), or "" where the kernel has no shmem THP."""
    m = re.search(r"\[(\w+)\]", _read(f"{SYSFS}/shmem_enabled"))
    return m.group(1) if m else ""


def shmem_thp_possible() -> bool:
    """Whether a shmem mapping that asks for huge pages (``advise``) can get them."""
    return shmem_thp_mode() in ("always", "within_size", "advise", "force")


def hugetlb_free_bytes() -> tuple[int, int]:
    """(bytes of free reserved huge pages, their page size) of the default hugetlb size."""
    text = _read("/proc/meminfo")
    free = re.search(r"^HugePages_Free:\s+(\d+)", text, re.M)
    size = re.search(r"^Hugepagesize:\s+(\d+) kB", text, re.M)
    if not free or not size:
        return 0, 0
    page = int(size.group(1)) << 10
    return int(free.group(1)) * page, page


def hugetlb_fits(size: int) -> bool:
    """Whether a hugetlb memfd of ``size`` bytes could be mapped now: ``size`` a multiple of
    the huge page, and that many huge pages free."""
    free, page = hugetlb_free_bytes()
    return bool(page) and size >= page and size % page == 0 and free >= size


def advise(addr: int, size: int) -> bool:
    """Ask for transparent huge pages on ``[addr, addr + size)``; True if the kernel took the
    advice (it may still use small pages: shmem_enabled decides). Never raises."""
    if size < pmd_size():
        return False
    return bool(_libc.madvise(addr, size, MADV_HUGEPAGE) == 0)


def round_size(nbytes: int, page: int) -> int:
    """A mapping's size for ``nbytes``: whole huge pages from one huge page up (so that a
    hugetlb memfd is possible and the tail can be a huge page too), else whole ``page``s."""
    huge = pmd_size()
    unit = huge if nbytes >= huge else page
    return max(page, -(-nbytes // unit) * unit)


__all__ = ["HUGETLB", "SMALL", "THP", "advise", "hugetlb_fits", "hugetlb_free_bytes",
           "pmd_size", "round_size", "shmem_thp_mode", "shmem_thp_possible"]
