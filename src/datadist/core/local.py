"""Local copies: between or within caches of this process, planned here, copied by the core.

Who calls: the facade's ``copy_cache``, ``copy_blocks`` and ``swap_blocks`` (cache-manager and
legacy mode alike, through ``api/local_ops.py``), with caches already resolved to a
:class:`Geometry`. Never blocks; thread-safe (no state).

Theory of operation
-------------------
A local copy is planned exactly like a transfer: :mod:`datadist.core.layout` turns the request
into a :class:`Plan` (tensor pairs x byte spans, coalesced where a run of blocks is adjacent on
both sides), with the *source* in the plan's ``remote_*`` fields and the destination in its
``local_*`` fields. Source offsets here are absolute within the source tensor (the source unit
base is folded in by the planners below). The copy is the core's (``NativeEngine.copy_local``,
cpp/src/session.h ``Session::CopyCaches``, the one the C++ API's CopyKvCache / CopyKvBlocks
use): it holds both caches, checks every span against both, and copies one memmove a span.

Rules this module keeps:

1. No Python loop per block: spans are numpy arrays from the start.
2. Every index and size is checked here, against both caches, before the core is called;
   errors are :class:`InvalidArgument` naming the culprit (the core checks the spans again:
   what reaches memory never depends on these checks alone).
3. A copy never reads and writes the same bytes in one call, except a span copied onto itself:
   ``plan_block_copy`` refuses a block that is both a source and a destination, and duplicate
   destinations (which source would win is not defined).

Also here: :func:`vm_copy` (cross-memory copies with another process; ``datadist info`` asks
whether this process may read itself) and :func:`local_copy` (memmove between iovec arrays, for
benchmarks/shm_vs_cma.py).

On a host without CUDA, DEVICE placement is host memory too, so "host <-> device" swaps are
host copies; placement rules are the facade's to check.
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections import deque
from collections.abc import Callable
from typing import NoReturn

import numpy as np

from datadist.core.dtypes import in_elements
from datadist.core.errors import BrokenLink, DatadistError, InvalidArgument
from datadist.core.layout import U64, Geometry, Plan, every_tensor, plan_blocks, plan_slot

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


def _all_tensors(src: Geometry, dst: Geometry) -> tuple[np.ndarray, np.ndarray]:
    if src.num_tensors != dst.num_tensors:
        raise InvalidArgument(
            f"src has {src.num_tensors} tensors but dst has {dst.num_tensors}"
        )
    return every_tensor(dst.num_tensors)


def plan_slot_copy(
    src: Geometry, dst: Geometry, src_unit: int, dst_unit: int, offset: int = 0, size: int = -1
) -> Plan:
    """Slot ``src_unit`` of every source tensor into slot ``dst_unit`` of the same-index
    destination tensor, ``size`` bytes from ``offset`` within the slot on both sides.

    ``size == -1`` means the rest of the source slot after ``offset``; it must fit the
    destination slot too.
    """
    tensors = _all_tensors(src, dst)
    if not 0 <= src_unit < src.units:
        raise InvalidArgument(f"src_batch_index {src_unit} out of range [0, {src.units})")
    if not 0 <= dst_unit < dst.units:
        raise InvalidArgument(f"dst_batch_index {dst_unit} out of range [0, {dst.units})")
    for name, g in (("src", src), ("dst", dst)):
        if not 0 <= offset < g.unit_bytes:
            raise InvalidArgument(
                f"offset {offset} out of range of the {name} batch stride {g.unit_bytes}"
            )
    if size == -1:
        size = src.unit_bytes - offset
    for name, g in (("src", src), ("dst", dst)):
        if size <= 0 or size > g.unit_bytes - offset:
            raise InvalidArgument(
                f"size {size} does not fit the {name} batch stride {g.unit_bytes} after "
                f"offset {offset}"
            )
    # plan_slot checks the destination side; the source offset it carries is made absolute
    # here (slot base + offset), which is what the core's copy expects.
    return plan_slot(dst, dst_unit, tensors, size,
                     src_offset=src_unit * src.unit_bytes + offset, dst_offset=offset)


def plan_block_copy(
    src: Geometry,
    dst: Geometry,
    src_blocks: np.ndarray,
    dst_blocks: np.ndarray,
    *,
    same_cache: bool = False,
) -> Plan:
    """Block ``src_blocks[i]`` of every source tensor into block ``dst_blocks[i]`` of the
    same-index destination tensor. Both caches need the same block bytes and tensor count.

    ``same_cache``: source and destination are one cache (``copy_blocks``), so a block may
    not be both read and written.
    """
    tensors = _all_tensors(src, dst)
    if src.unit_bytes != dst.unit_bytes:
        raise InvalidArgument(
            f"block sizes differ: the source's blocks hold "
            f"{in_elements(src.unit_bytes, src.layout)}, the destination's "
            f"{in_elements(dst.unit_bytes, dst.layout)}"
        )
    s = np.asarray(src_blocks, dtype=U64)
    d = np.asarray(dst_blocks, dtype=U64)
    if s.size == 0:
        raise InvalidArgument("no blocks to copy")
    if int(s.max()) >= src.units:
        raise InvalidArgument(
            f"src block {int(s.max())} out of range: the cache has {src.units} blocks"
        )
    if np.unique(d).size != d.size:
        raise InvalidArgument("a destination block is listed more than once")
    if same_cache and np.intersect1d(s, d).size:
        raise InvalidArgument(
            f"block {int(np.intersect1d(s, d)[0])} is both a source and a destination"
        )
    # plan_blocks checks the destination indices and coalesces runs adjacent on both sides.
    return plan_blocks(dst, s, d, tensors)


__all__ = ["IOV_MAX", "CmaRefused", "local_copy", "plan_block_copy", "plan_slot_copy", "vm_copy"]
