"""Is memory the user hands us really there? Checks of our own address space.

Who calls: ``register_cache`` / ``register_blocks_cache`` (once per registration, through
:func:`check_ranges`), and an owner before it serves a peer from memory it did not allocate
(:func:`first_unreadable`, a cheap probe per request). Neither blocks beyond one read of
``/proc/self/maps`` or one system call per ``IOV_MAX`` probes; neither touches a page's
contents (the probe reads one byte).

Why: a cache registered over memory that is smaller than its description, or not mapped at
all, is only found out by the first transfer, as a SIGSEGV in whichever process copies into or
out of it (a same-host reader's memcpy, our own local copy), or as a socket error the owner
cannot explain. Refusing it at registration names the tensor and the range instead.

How: ``/proc/self/maps`` lists every mapping with its permissions. Mappings with the access a
cache needs (read and write) are merged where adjacent, and each tensor's range must lie inside
one merged run: numpy over the mapping list, no loop per page or per tensor in Python. A
mapping that exists but reaches past the end of its file would still fault; that is out of
reach of this check.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
from collections.abc import Callable

import numpy as np

from datadist.core.errors import InvalidArgument

log = logging.getLogger(__name__)

U64 = np.dtype("<u8")
_MAPS_LINE = re.compile(rb"^([0-9a-f]+)-([0-9a-f]+) ([r-])([w-])", re.M)
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024

_libc = ctypes.CDLL(None, use_errno=True)
_vm_readv = _libc.process_vm_readv
_vm_readv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p,
                      ctypes.c_ulong, ctypes.c_ulong]
_vm_readv.restype = ctypes.c_ssize_t


def _runs(write: bool) -> tuple[np.ndarray, np.ndarray] | None:
    """Start and end of each run of adjacent mappings readable (and writable with ``write``);
    None where ``/proc/self/maps`` cannot be read."""
    try:
        with open("/proc/self/maps", "rb") as f:
            text = f.read()
    except OSError as e:
        log.debug("no /proc/self/maps (%s): mapped-range checks skipped", e)
        return None
    rows = [(int(a, 16), int(b, 16)) for a, b, r, w in _MAPS_LINE.findall(text)
            if r == b"r" and (w == b"w" or not write)]
    if not rows:
        return np.zeros(0, U64), np.zeros(0, U64)
    spans = np.array(rows, dtype=U64)
    spans = spans[np.argsort(spans[:, 0], kind="stable")]
    starts, ends = spans[:, 0], spans[:, 1]
    first = np.concatenate(([True], starts[1:] != ends[:-1]))
    idx = np.flatnonzero(first)
    last = np.concatenate((idx[1:] - 1, [len(starts) - 1]))
    return starts[idx], ends[last]


def unmapped(bases: np.ndarray, lengths: np.ndarray, *, write: bool = True) -> np.ndarray:
    """For each range ``[bases[i], bases[i] + lengths[i])``: the first byte of it that is not
    mapped with read (and write) access, or 0 where the whole range is. All zeros where the
    mappings cannot be listed."""
    b = np.asarray(bases, dtype=U64)
    n = np.asarray(lengths, dtype=U64)
    runs = _runs(write)
    if runs is None or not len(b):
        return np.zeros(len(b), U64)
    starts, ends = runs
    if not len(starts):
        copy: np.ndarray = b.copy()
        return copy
    k = np.searchsorted(starts, b, side="right").astype(np.int64) - 1
    inside = k >= 0
    run_end = np.where(inside, ends[np.maximum(k, 0)], np.uint64(0))
    base_ok = inside & (b < run_end)
    end = b + n  # callers keep b + n below 2**64 (registration checks non-zero u64 addresses)
    ok = base_ok & (end <= run_end)
    return np.where(ok, np.uint64(0), np.where(base_ok, run_end, b))


_SCRATCH = np.empty(_IOV_MAX, np.uint8)  # where probed bytes go (never read)
_SCRATCH_ADDR = _SCRATCH.ctypes.data


# A request's probes are usually a few addresses (first and last byte of the tensors it
# touches): those go through ctypes arrays, ~2 us, where numpy's set-up alone costs ~5 us.
_FEW = 16
_FEW_LOCAL = [(ctypes.c_uint64 * 2)(_SCRATCH_ADDR, k) for k in range(_FEW + 1)]  # read-only
_FEW_LOCAL_ADDR = [ctypes.addressof(iov) for iov in _FEW_LOCAL]
_ONES = [[1] * k for k in range(_FEW + 1)]


def first_unreadable(addrs: np.ndarray | list[int]) -> int | None:
    """Index of the first address in ``addrs`` whose byte we cannot read, or None when all
    are readable (or the kernel will not tell: cross-memory attach refused on ourselves).
    One ``process_vm_readv`` on our own pid per ``IOV_MAX`` addresses, one byte each.
    ``addrs``: non-negative integers below 2**64 (a list of Python ints or a uint64 array)."""
    if isinstance(addrs, list) and len(addrs) <= _FEW:
        return _first_unreadable_few(addrs)
    a = np.asarray(addrs, dtype=U64)
    if not len(a):
        return None
    # the probed bytes land in one scratch buffer shared by every caller: nobody reads it
    local = np.array([[_SCRATCH_ADDR, min(len(a), _IOV_MAX)]], dtype=U64)
    pid = os.getpid()
    for start in range(0, len(a), _IOV_MAX):
        chunk = a[start:start + _IOV_MAX]
        remote = np.empty((len(chunk), 2), dtype=U64)
        remote[:, 0] = chunk
        remote[:, 1] = 1
        local[0, 1] = len(chunk)
        got = _vm_readv(pid, local.ctypes.data, 1, remote.ctypes.data, len(chunk), 0)
        if got == len(chunk):
            continue
        if got < 0:
            err = ctypes.get_errno()
            if err != 14:  # not EFAULT: EPERM, ENOSYS (seccomp, no CMA): cannot tell
                return None
            got = 0
        return start + int(got)
    return None


def _first_unreadable_few(addrs: list[int]) -> int | None:
    n = len(addrs)
    if not n:
        return None
    remote = (ctypes.c_uint64 * (2 * n))()
    # (typeshed types a slice of a c_uint64 array as list[c_uint64 | int]: ints are fine)
    remote[0::2] = addrs  # type: ignore[assignment]
    remote[1::2] = _ONES[n]  # type: ignore[assignment]
    got = _vm_readv(os.getpid(), _FEW_LOCAL_ADDR[n], 1, ctypes.addressof(remote), n, 0)
    if got == n:
        return None
    if got < 0:
        if ctypes.get_errno() != 14:  # not EFAULT: EPERM, ENOSYS (seccomp, no CMA)
            return None
        return 0
    return int(got)


def check_ranges(names: list[str], bases: np.ndarray, lengths: np.ndarray,
                 what: str, gpu: Callable[[int], int | None] | None = None) -> None:
    """Raise InvalidArgument naming the first range not wholly mapped readable and writable.
    ``names[i]`` says which tensor range i is (for the message). ``gpu``: for a DEVICE-placed
    cache, the CUDA device an address lies on, or None (core/native.py ``cuda_device``); a
    range not mapped for the CPU whose first and last bytes are on one device is GPU memory
    (never in /proc/self/maps with access) and passes."""
    bad = unmapped(bases, lengths)
    hit = np.flatnonzero(bad)
    if gpu is not None:
        hit = np.array([i for i in hit if not _on_one_gpu(gpu, int(bases[i]), int(lengths[i]))],
                       dtype=np.int64)
    if not len(hit):
        return
    i = int(hit[0])
    base, n, at = int(bases[i]), int(lengths[i]), int(bad[i])
    raise InvalidArgument(
        f"{what}: {names[i]} [{base:#x}, {base + n:#x}) ({n} bytes) is not wholly mapped "
        f"readable and writable in this process: no access from {at:#x} "
        f"({at - base} bytes in)"
    )


def _on_one_gpu(gpu: Callable[[int], int | None], base: int, n: int) -> bool:
    first = gpu(base)
    return first is not None and gpu(base + n - 1) == first


__all__ = ["check_ranges", "first_unreadable", "unmapped"]
