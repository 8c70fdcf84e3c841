"""Local copies: between or within caches of this process.

Who calls: the facade's ``copy_cache``, ``copy_blocks`` and ``swap_blocks`` (cache-manager and
legacy mode alike), with caches already resolved to a :class:`Geometry` and tensor addresses.
Blocks until the bytes are copied; thread-safe (no state).

Theory of operation
-------------------
A local copy is planned exactly like a transfer: :mod:`datadist.core.layout` turns the request
into a :class:`Plan` (tensor pairs x byte spans, coalesced where a run of blocks is adjacent on
both sides), with the *source* in the plan's ``remote_*`` fields and the destination in its
``local_*`` fields. Source offsets here are absolute within the source tensor (the source unit
base is folded in by the planners below), so both sides become absolute iovecs with one
broadcast add each.

Rules this module keeps:

1. No Python loop per block. Spans are numpy arrays from the start; the executor issues either
   one ``memmove`` per *coalesced* span (few or large spans: memmove beats the kernel for
   bulk bytes) or one ``process_vm_readv`` on our own pid per ``IOV_MAX`` spans (many small
   spans: one system call instead of thousands of ctypes calls).
2. Every index and size is checked here, against both caches, before any byte moves; errors
   are :class:`InvalidArgument` naming the culprit.
3. A copy never reads and writes the same bytes in one call, except a span copied onto itself:
   ``plan_block_copy`` refuses a block that is both a source and a destination, and duplicate
   destinations (which source would win is not defined).

On a host without CUDA, DEVICE placement is host memory too, so "host <-> device" swaps are
host copies; placement rules are the facade's to check.
"""

from __future__ import annotations

import os

import numpy as np

from datadist.core.dtypes import in_elements
from datadist.core.errors import InvalidArgument
from datadist.core.layout import U32, U64, Geometry, Plan, plan_blocks, plan_slot
from datadist.transport.iov import CmaRefused, iovecs, local_copy, vm_copy

# memmove per span while there are at most this many spans, or while spans are this large on
# average; beyond, batched process_vm_readv on our own pid (one syscall per IOV_MAX spans).
MEMMOVE_MAX_SPANS = 64
MEMMOVE_MIN_AVG_SPAN = 1 << 20


def _all_tensors(src: Geometry, dst: Geometry) -> tuple[np.ndarray, np.ndarray]:
    if src.num_tensors != dst.num_tensors:
        raise InvalidArgument(
            f"src has {src.num_tensors} tensors but dst has {dst.num_tensors}"
        )
    idx = np.arange(dst.num_tensors, dtype=U32)
    return idx, idx


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
    # here (slot base + offset), which is what execute() expects.
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


def _copy_iov(dst: np.ndarray, src: np.ndarray) -> None:
    n = len(dst)
    if n == 0:
        return
    if n <= MEMMOVE_MAX_SPANS or int(dst[:, 1].sum()) // n >= MEMMOVE_MIN_AVG_SPAN:
        local_copy(dst, src)
        return
    try:
        vm_copy(os.getpid(), dst, src)
    except CmaRefused:
        # The kernel forbids cross-memory attach even on ourselves (seccomp, Yama): fall
        # back to one memmove per coalesced span.
        local_copy(dst, src)


def execute(plan: Plan, src_addrs: np.ndarray, dst_addrs: np.ndarray) -> int:
    """Copy what ``plan`` names from the source tensors to the destination tensors.

    ``src_addrs`` / ``dst_addrs``: base address of each tensor (uint64). Returns the bytes
    copied. The caller keeps both caches alive (leases) for the duration.
    """
    src = iovecs(np.asarray(src_addrs, dtype=U64)[plan.remote_tensors],
                 plan.remote_offsets, plan.lengths)
    dst = plan.local_iovecs(np.asarray(dst_addrs, dtype=U64))
    _copy_iov(dst, src)
    return plan.nbytes


__all__ = ["execute", "plan_block_copy", "plan_slot_copy"]
