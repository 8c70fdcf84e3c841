"""Copies this process makes itself, outside the engine: cross-memory copies with another
process (:func:`vm_copy`: ``datadist info`` asks whether this process may read itself) and
memmove between iovec arrays (:func:`local_copy`, for benchmarks/shm_vs_cma.py). Both block
until done; thread-safe (no state).

The API's local copies (``copy_cache``, ``copy_blocks``, ``swap_blocks``) are not here: the
core plans, holds, checks and copies them in one call (``NativeEngine.copy_slot`` /
``copy_blocks``: cpp/src/session.h ``Session::CopySlot`` / ``CopyBlocks``, planned by
cpp/src/plan.h ``PlanSlotCopy`` / ``PlanBlockCopy``, the C++ API's CopyKvCache and
CopyKvBlocks too); ``api/local_ops.py`` translates the facades' arguments.
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections import deque
from collections.abc import Callable
from typing import NoReturn

import numpy as np

from datadist.core.errors import BrokenLink, DatadistError

# ---- Copies this process makes itself with memmove or cross-memory attach
# (process_vm_readv / writev), outside the engine: ``datadist info`` (:func:`vm_copy`: can this
# process read itself?), benchmarks and tests. Copies run in batches of ``IOV_MAX`` spans and
# block until done.

IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024

_libc = ctypes.CDLL(None, use_errno=True)
# libc entry points as this module calls them (ctypes returns what ``restype`` says: an int).
VmCall = Callable[[int, int, int, int, int, int], int]  # process_vm_readv/writev
_c_ssize = ctypes.c_ssize_t
for _name in ("process_vm_readv", "process_vm_writev"):
    _fn = getattr(_libc, _name)
    _fn.argtypes = [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_ulong,
        ctypes.c_void_p,
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    _fn.restype = _c_ssize


class CmaRefused(DatadistError):
    """The kernel refused cross-memory attach (EPERM, EACCES, ENOSYS): use another path."""


def _advance(iov: np.ndarray, done: int) -> np.ndarray:
    """Drop ``done`` bytes from the front of ``iov``; returns the rest (a view, edited)."""
    if done == 0:
        return iov
    batch = iov[:IOV_MAX]
    ends = np.cumsum(batch[:, 1])
    k = int(np.searchsorted(ends, done, side="right"))
    rest = iov[k:]
    if k < len(batch) and k < len(iov):
        consumed = done - (int(ends[k - 1]) if k else 0)
        if consumed:
            rest = rest.copy() if not rest.flags.writeable else rest
            rest[0, 0] += consumed
            rest[0, 1] -= consumed
    return rest


def _vm_call(call: VmCall, pid: int, local: np.ndarray, remote: np.ndarray) -> int:
    """One batch pair; returns bytes moved or raises with errno."""
    n = call(pid, local.ctypes.data, len(local), remote.ctypes.data, len(remote), 0)
    if n < 0:
        _vm_failed(pid)
    return n


def _vm_failed(pid: int) -> NoReturn:
    """Raise what a failed process_vm_* call means (errno read here)."""
    err = ctypes.get_errno()
    if err == errno.ESRCH:
        # The owner process is gone: the link is broken, not the path (a restarted owner
        # reconnects and may use cross-memory attach again).
        raise BrokenLink(f"the owner process {pid} is gone")
    if err in (errno.EPERM, errno.ENOSYS, errno.EACCES):
        raise CmaRefused(f"process_vm_* refused: {os.strerror(err)}")
    raise BrokenLink(f"cross-memory copy failed: {os.strerror(err)}")


def _vm_rest(call: VmCall, pid: int, local: np.ndarray, remote: np.ndarray, got: int,
             want: int) -> None:
    """A partial copy: retry the rest once (the kernel may stop at a page boundary under
    memory pressure); a second short copy is a fault."""
    lb2, rb2 = _advance(local.copy(), got), _advance(remote.copy(), got)
    got2 = _vm_call(call, pid, lb2, rb2)
    if got2 != want - got:
        raise BrokenLink(f"cross-memory copy moved {got + got2} of {want} bytes")


def vm_copy(pid: int, local: np.ndarray, remote: np.ndarray, *, write: bool = False,
            nbytes: int | None = None) -> None:
    """Copy between our memory and process ``pid``'s, span by span (pairs of equal length).

    ``local`` and ``remote`` are iovec arrays of the same span lengths; ``nbytes``, if the
    caller knows it, their total (saves a sum on small copies). A short copy (the remote
    mapping went away) raises BrokenLink.
    """
    call = _libc.process_vm_writev if write else _libc.process_vm_readv
    total = len(local)
    for start in range(0, total, IOV_MAX):
        if total <= IOV_MAX and local.flags.c_contiguous and remote.flags.c_contiguous:
            lb, rb = local, remote  # one batch as it is (no copies: the usual small read)
            want = nbytes if nbytes is not None else int(lb[:, 1].sum())
        else:
            lb = np.ascontiguousarray(local[start : start + IOV_MAX])
            rb = np.ascontiguousarray(remote[start : start + IOV_MAX])
            want = int(lb[:, 1].sum())
        got = _vm_call(call, pid, lb, rb)
        if got != want:
            _vm_rest(call, pid, lb, rb, got, want)


def local_copy(dst: np.ndarray, src: np.ndarray) -> None:
    """Copy within this process between iovec arrays of equal span lengths.

    Used for same-process and mapped-shared-memory copies. One ``memmove`` per span: callers
    coalesce first, so a span is a run of blocks, not a block. The calls are driven by
    ``map`` over three lists (about 0.33 us a span, against 0.53 for a Python loop).
    """
    if len(dst) != len(src):
        raise ValueError(f"local_copy: {len(dst)} destination spans, {len(src)} source spans")
    if not len(dst):
        return
    deque(map(ctypes.memmove, dst[:, 0].tolist(), src[:, 0].tolist(), dst[:, 1].tolist()),
          maxlen=0)


__all__ = ["IOV_MAX", "CmaRefused", "local_copy", "vm_copy"]
