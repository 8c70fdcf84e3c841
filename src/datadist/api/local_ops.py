"""Argument handling for the local copy methods, shared by ``CacheManager`` (cache-manager
mode) and ``KvCacheManager`` (legacy mode): ``copy_cache``, ``copy_blocks``, ``swap_blocks``.

Who calls: those two facades, after their own type checks of the cache objects. Everything
here blocks until the copy is done. This module keeps the original's argument rules and
words that come before planning, and names each cache to the core (a filed cache's id or, for
a ``create_cpu_cache``, a description of the caller's memory); the copy is one core call
(``NativeEngine.copy_slot`` / ``copy_blocks``: the session's CopySlot / CopyBlocks, the ones
CANN's CopyKvCache and CopyKvBlocks use), which holds both caches, plans the copy with the
Python API's rules and texts (cpp/src/plan.h PlanSlotCopy / PlanBlockCopy), checks every span
against both before a byte moves, and copies. Errors are mapped to LLMException.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from datadist.api.checks import check_isinstance, int_list
from datadist.api.enums import Placement
from datadist.api.geometry import describe, geometry_of
from datadist.api.status import llm_errors, raise_if_false
from datadist.api.types import CacheDesc
from datadist.core import layout
from datadist.core.errors import InvalidArgument
from datadist.core.native import NativeEngine
from datadist.memory import mapped

if TYPE_CHECKING:
    from datadist._core import UserCache

UNREGISTERED_ID = -1  # Cache.create_cpu_cache / KvCache.create_cpu_cache


@dataclass(frozen=True)
class CacheRef:
    """What the facades know about a cache object (``Cache`` or ``KvCache``)."""

    cache_id: int
    desc: CacheDesc
    is_blocks: bool
    addrs: list[int]


def _check_cpu_cache(geo: layout.Geometry, addrs: np.ndarray) -> None:
    """A ``create_cpu_cache`` is the caller's memory, never registered: before copying into
    or out of it, probe the first and last byte of each tensor (one system call), so that
    memory shorter than the description or freed is PARAM_INVALID, not a SIGSEGV."""
    raise_if_false(int(addrs.max()) <= 2**64 - 1 - geo.tensor_bytes,
                   "a cpu cache tensor passes the end of the address space")
    probes = np.concatenate((addrs, addrs + np.uint64(geo.tensor_bytes - 1)))
    bad = mapped.first_unreadable(probes)
    if bad is not None:
        t = bad % len(addrs)
        raise_if_false(False, f"cpu cache tensor {t} [{int(addrs[t]):#x}, "
                              f"{int(addrs[t]) + geo.tensor_bytes:#x}) is not wholly mapped "
                              f"in this process (no access at {int(probes[bad]):#x})")


def side(engine: NativeEngine, ref: CacheRef) -> int | UserCache:
    """The core's name for the cache: a filed cache's id (the core holds it for the copy;
    LLM_KV_CACHE_NOT_EXIST for one deallocated or unregistered), or, for an unregistered one
    (``create_cpu_cache``), a description of the caller's memory, probed first
    (:func:`_check_cpu_cache`)."""
    if ref.cache_id == UNREGISTERED_ID:
        raise_if_false(len(ref.addrs) == ref.desc.num_tensors and all(ref.addrs),
                       f"the cpu cache has {len(ref.addrs)} addresses for "
                       f"{ref.desc.num_tensors} tensors")
        geo = geometry_of(ref.desc, blocks=ref.is_blocks)
        addrs = np.asarray(ref.addrs, dtype=np.uint64)
        _check_cpu_cache(geo, addrs)
        with llm_errors():
            return engine.user_cache(geo, addrs)
    return ref.cache_id


def copy_cache(engine: NativeEngine, dst: CacheRef, src: CacheRef, dst_batch_index: int,
               src_batch_index: int, offset: int, size: int) -> None:
    """Copy one batch slot of every tensor (``size`` bytes from ``offset``). Types checked."""
    check_copy_cache(dst, src, size)
    s, d = side(engine, src), side(engine, dst)
    with llm_errors("copy_cache"):
        try:
            engine.copy_slot(s, d, src_unit=src_batch_index, dst_unit=dst_batch_index,
                             offset=offset, size=size)
        except InvalidArgument as e:  # sizes or counts that do not fit: both sides shown
            raise InvalidArgument(f"{e} (src: {describe(src.desc, blocks=False)}; dst: "
                                  f"{describe(dst.desc, blocks=False)})") from None


def check_copy_cache(dst: CacheRef, src: CacheRef, size: int) -> None:
    """The original's checks after the types (v2/cache_manager.py copy_cache): neither cache
    a blocks cache, then the size; its texts."""
    raise_if_false(not src.is_blocks, "param check failed, src cache can not be blocks cache.")
    raise_if_false(not dst.is_blocks, "param check failed, dst cache can not be blocks cache.")
    raise_if_false(size == -1 or size > 0,
                   f"[copy_cache] param check failed, size ({size}) is invalid, should be = -1 "
                   "or > 0")


def parse_copy_block_info(info: Any) -> tuple[np.ndarray, np.ndarray]:
    """``{src_block: [dst_block, ...]}`` -> flat (src, dst) uint64 arrays, one pair per copy."""
    check_isinstance("copy_block_info", info, dict, allow_none=False)
    values = list(info.values())
    for v in values:
        check_isinstance("copy_block_info value", v, list, allow_none=False)
    src = int_list("copy_block_info keys", list(info.keys()), "uint64")
    dst = int_list("copy_block_info values", list(itertools.chain.from_iterable(values)),
                   "uint64")
    counts = np.fromiter((len(v) for v in values), dtype=np.int64, count=len(values))
    return np.repeat(src, counts).astype(np.uint64), dst.astype(np.uint64)


def copy_blocks(engine: NativeEngine, cache: CacheRef, copy_block_info: Any) -> None:
    """Copy blocks within one blocks cache: each source block to each of its destinations.

    An empty mapping copies nothing. A block may not be both a source and a destination,
    nor a destination twice (PARAM_INVALID).
    """
    src, dst = parse_copy_block_info(copy_block_info)
    raise_if_false(cache.is_blocks, "param check failed, cache should be blocks cache.")
    if dst.size == 0:
        return
    c = side(engine, cache)
    with llm_errors("copy_blocks"):
        engine.copy_blocks(c, c, src, dst)  # one cache: a block both read and written is refused


def swap_blocks(engine: NativeEngine, src: CacheRef, dst: CacheRef, src_to_dst: Any) -> None:
    """Copy blocks between a HOST and a DEVICE cache (either way): ``{src: dst}``.

    The original's checks, texts and order (v2/cache_manager.py _verify_caches, then
    swap_blocks): both blocks caches, the mapping, equal block bytes and tensor counts, every
    index inside its cache, then one HOST and one DEVICE side.
    """
    raise_if_false(src.is_blocks, "param check failed, src cache should be blocks cache.")
    raise_if_false(dst.is_blocks, "param check failed, dst cache should be blocks cache.")
    check_isinstance("src_to_dst", src_to_dst, dict, allow_none=False)
    s_blocks = int_list("src_to_dst keys", list(src_to_dst.keys()), "int64")
    d_blocks = int_list("src_to_dst values", list(src_to_dst.values()), "int64")
    sg, dg = geometry_of(src.desc, blocks=True), geometry_of(dst.desc, blocks=True)
    if sg.unit_bytes != dg.unit_bytes or sg.num_tensors != dg.num_tensors:
        # the original's text first, then both caches as the caller described them
        what = (f"src block size:{sg.unit_bytes} and dst block size:{dg.unit_bytes} must be "
                "equal" if sg.unit_bytes != dg.unit_bytes else
                f"src num_tensors:{sg.num_tensors} and dst num_tensors:{dg.num_tensors} must "
                "be equal")
        raise_if_false(False, f"{what} (src: {describe(src.desc, blocks=True)}; dst: "
                              f"{describe(dst.desc, blocks=True)})")
    bad = np.flatnonzero((s_blocks < 0) | (s_blocks >= sg.units) | (d_blocks < 0)
                         | (d_blocks >= dg.units))
    if bad.size:  # the first pair out of range, its source index first
        s_i, d_i = int(s_blocks[bad[0]]), int(d_blocks[bad[0]])
        raise_if_false(0 <= s_i < sg.units, f"src_block_index:{s_i} must be in [0, {sg.units})")
        raise_if_false(0 <= d_i < dg.units, f"dst_block_index:{d_i} must be in [0, {dg.units})")
    sp, dp = src.desc.placement, dst.desc.placement
    raise_if_false({sp, dp} == {Placement.HOST, Placement.DEVICE},
                   f"swap src placement:{sp} to dst placement:{dp} is not support")
    if d_blocks.size == 0:
        return
    s, d = side(engine, src), side(engine, dst)
    with llm_errors("swap_blocks"):
        engine.copy_blocks(s, d, s_blocks.astype(np.uint64), d_blocks.astype(np.uint64))


__all__ = ["CacheRef", "copy_blocks", "copy_cache", "side", "swap_blocks"]
