"""Rows of memory datadist allocates (pools) as a same-host source, against the same pull
from memory the user allocated with numpy.

The owner allocates a blocks cache the size of its numpy one from its host pool
(:func:`allocate_pool_blocks`, filled with the same pattern); the puller pulls the same random
blocks from each, into the same numpy destination, alternately. numpy's large arrays get
transparent huge pages where the kernel offers them; the row shows whether pool memory (a
memfd: shared memory or cross-memory attach, see ``cpp/src/shm.h``) copies as well.
"""

from __future__ import annotations

from typing import Any

from datadist.bench.harness import (
    BLOCKS_MODEL,
    OWNER_ID,
    Row,
    Sizes,
    array_at,
    check_blocks,
    fill_pattern,
    interleave,
    pattern_seed,
    throughput_row,
)
from datadist.bench.puller import Context

POOL_BLOCKS_MODEL = 3  # the owner's pool-allocated blocks cache
POOL_TAG = 5  # its pattern's tag (harness.pattern_seed)


def pool_blocks_bytes(sizes: Sizes) -> int:
    """What the owner's pool needs on top of ``Sizes.pool_bytes`` for the blocks cache."""
    return sizes.cache_blocks * sizes.block_bytes + (1 << 16)


def allocate_pool_blocks(ll: Any, cm: Any, sizes: Sizes) -> None:
    """Owner side: a blocks cache like the numpy one, allocated from the host pool."""
    desc = ll.CacheDesc(1, [sizes.cache_blocks, sizes.block_bytes], ll.DataType.DT_UINT8,
                        ll.Placement.HOST)
    cache = cm.allocate_blocks_cache(desc, ll.BlocksCacheKey(OWNER_ID, POOL_BLOCKS_MODEL))
    fill_pattern(array_at(cache.tensor_addrs[0], sizes.cache_blocks * sizes.block_bytes),
                 pattern_seed(POOL_TAG, 0))


def pool_rows(ctx: Context) -> list[Row]:
    s, buf = ctx.sizes, ctx.bufs["blocks"]
    p = ctx.puller("auto")
    try:
        cm, ll = p.dd.cache_manager, p.ll
        src, dst = ctx.src_list, ctx.dst_list
        pooled = ll.BlocksCacheKey(OWNER_ID, POOL_BLOCKS_MODEL)
        numpy_key = ll.BlocksCacheKey(OWNER_ID, BLOCKS_MODEL)

        def from_pool() -> None:
            cm.pull_blocks(pooled, p.blocks, src, dst)

        def from_numpy() -> None:
            cm.pull_blocks(numpy_key, p.blocks, src, dst)

        what = f"{s.blocks} x {s.block_bytes >> 10} KiB"
        for fn, tag, label in ((from_numpy, 2, "numpy"), (from_pool, POOL_TAG, "pool")):
            buf.fill(0)
            fn()  # warm, and rule 2: the owner's bytes arrived where asked
            check_blocks(buf.reshape(s.cache_blocks, -1), ctx.src_ids, ctx.dst_ids,
                         s.block_bytes, pattern_seed(tag, 0), f"pull_blocks from {label} memory")
        path = p.mechanism()  # what moved the pool pull (shm or cma)
        ctx.progress.set_label("same-host pull_blocks from pool memory")
        f, lim = interleave(from_pool, from_numpy, ctx.repeat, ctx.progress)
        return [throughput_row(
            "same_host_pull_blocks_pool",
            f"same-host pull_blocks, {what}, from datadist-allocated memory",
            s.blocks * s.block_bytes, path, f,
            "the same pull from numpy (client) memory", lim, 0.95)]
    finally:
        p.close()
