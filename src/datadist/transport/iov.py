"""iovec arrays, and the copies this process makes itself: local memmoves and
cross-memory attach (``process_vm_readv`` / ``writev``).

Who calls: the facade's planning (``core/layout.py``: an iovec array is
an ``(n, 2)`` uint64 numpy array, as ``struct iovec`` on 64-bit Linux), local copies
(``core/local.py``: copy_cache, swap_blocks), ``datadist info`` (:func:`vm_copy`) and the
bench's limits. Peers' transfers are the core's (cpp/src). Nothing here loops in Python per
span; copies run in batches of ``IOV_MAX`` and block until done.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
from collections import deque
from collections.abc import Callable
from typing import NoReturn

import numpy as np

from datadist.core.errors import BrokenLink, DatadistError

log = logging.getLogger(__name__)

IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
U64 = np.dtype("<u8")

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
_libc.memmove.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
_libc.memmove.restype = ctypes.c_void_p


MSG_WAITALL = 0x100  # <sys/socket.h>, Linux


class CmaRefused(DatadistError):
    """The kernel refused cross-memory attach (EPERM, EACCES, ENOSYS): use another path."""


def span_iov(
    tensor_bases: np.ndarray, offsets: np.ndarray, lengths: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Broadcast per-tensor bases with per-span offsets: tensor-major (base, length) arrays,
    the spans of a plan in every tensor (see core/layout.py)."""
    bases = (tensor_bases.astype(U64)[:, None] + offsets[None, :]).reshape(-1)
    lens = np.broadcast_to(lengths, (len(tensor_bases), len(lengths))).reshape(-1)
    return bases, lens


def iovecs(tensor_bases: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``make_iov(*span_iov(...))`` in one step: the ``(n, 2)`` uint64 iovec array of every
    span in every tensor, tensor-major, zero-length spans dropped. Filled in place by
    broadcasting: on the few-span requests of every small pull this is a third of the cost."""
    t, s = len(tensor_bases), len(offsets)
    iov = np.empty((t, s, 2), dtype=U64)
    np.add(np.asarray(tensor_bases, dtype=U64)[:, None], offsets[None, :], out=iov[:, :, 0])
    iov[:, :, 1] = lengths
    out = iov.reshape(t * s, 2)
    if s and (0 in lengths.tolist() if s <= 16 else not lengths.all()):
        out = out[out[:, 1] != 0]
    return out


def make_iov(bases: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """An ``(n, 2)`` uint64 iovec array, zero-length spans dropped."""
    iov = np.empty((len(bases), 2), dtype=U64)
    iov[:, 0] = bases
    iov[:, 1] = lengths
    if len(iov) and not iov[:, 1].all():
        iov = iov[iov[:, 1] != 0]
    return iov


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


def memmove(dst: int, src: int, nbytes: int) -> None:
    _libc.memmove(dst, src, nbytes)


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
