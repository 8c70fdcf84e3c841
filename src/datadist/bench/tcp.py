"""Rows of the TCP path against a plain socket between the same two processes.

Small blocks (TINY_BLOCK) are held against a plain-socket scatter of the same blocks
(``sendmsg`` / ``recvmsg_into``, :class:`.limits.ScatterClient`): both sides then pay per
block, and the row shows what datadist adds to that. The owner's blocks cache is registered a
second time as TINY_BLOCK blocks (:func:`register_tiny_blocks`); the puller's too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from datadist.bench.harness import (
    OWNER_ID,
    PULLER_ID,
    SMALL_BLOCK,
    BenchError,
    Row,
    check_blocks,
    interleave,
    mib,
    pattern_seed,
    throughput_row,
)
from datadist.bench.limits import ScatterClient
from datadist.bench.puller import (
    REPLY_TITLE,
    Context,
    Puller,
    latency_row,
    reply_trip,
    warm_and_check,
)

SMALL_GOAL = 2.0  # a repeated 16 KiB TCP pull: p50 at most 2x the plain round trip
# ... and at most 1.5x a plain round trip that carries the same 16 KiB back (the issue "Per
# call and per layer at the limit": "over TCP <= 1.5x the plain 16 B -> 16 KiB round trip")
REPLY_GOAL = 1.5


def tcp_rows(ctx: Context) -> list[Row]:
    s = ctx.sizes
    p = ctx.puller("tcp")
    rows: list[Row] = []
    try:
        if p.path != "tcp":
            raise BenchError(f"transport tcp was forced but the link uses {p.path}")
        warm_and_check(ctx, p, "tcp")
        contig = ctx.bufs["contig"]

        def plain(n: int) -> Callable[[], None]:
            return lambda: ctx.plain.receive(contig, n)

        plain(s.contig_bytes)()  # warm
        ctx.progress.set_label("TCP pull")
        f, lim = interleave(p.pull_contig, plain(s.contig_bytes), ctx.repeat, ctx.progress)
        rows.append(throughput_row(
            "tcp_pull", f"TCP pull, {mib(s.contig_bytes)}", s.contig_bytes, p.mechanism(), f,
            "plain socket sendall/recv_into, 4 MiB chunks", lim, 0.9))

        nbytes = s.blocks * s.block_bytes
        src, dst = ctx.src_list, ctx.dst_list
        ctx.progress.set_label("TCP pull_blocks")
        f, lim = interleave(lambda: p.pull_blocks(src, dst), plain(nbytes), ctx.repeat,
                             ctx.progress)
        rows.append(throughput_row(
            "tcp_pull_blocks", f"TCP pull_blocks, {s.blocks} x {s.block_bytes >> 10} KiB",
            nbytes, p.mechanism(), f, "plain socket sendall/recv_into, same bytes", lim, 0.8))

        rows.append(tiny_blocks_row(ctx, p))
        rows.append(latency_row(ctx, p, "tcp_small",
                                 f"small pull, one {SMALL_BLOCK >> 10} KiB block, TCP",
                                 goal=SMALL_GOAL))
        rows.append(latency_row(ctx, p, "tcp_small_vs_reply",
                                 f"small pull, one {SMALL_BLOCK >> 10} KiB block, TCP, against "
                                 "a plain reply of as many bytes", goal=REPLY_GOAL,
                                 limit=reply_trip(ctx), limit_title=REPLY_TITLE))
    finally:
        p.close()
    return rows


TINY_BLOCK = 4 << 10
TINY_MODEL = 2  # the blocks caches registered again as TINY_BLOCK blocks


def register_tiny_blocks(ll: Any, cm: Any, blocks: np.ndarray, cluster: int = OWNER_ID) -> Any:
    """Register ``blocks`` (a flat uint8 cache) again, as TINY_BLOCK blocks."""
    desc = ll.CacheDesc(1, [blocks.nbytes // TINY_BLOCK, TINY_BLOCK], ll.DataType.DT_UINT8,
                        ll.Placement.HOST)
    return cm.register_blocks_cache(desc, [blocks.ctypes.data],
                                    ll.BlocksCacheKey(cluster, TINY_MODEL))


def tiny_blocks_row(ctx: Context, p: Puller) -> Row:
    """TCP pull_blocks of TINY_BLOCK blocks (as many bytes as the other rows, random picks)
    against the plain scatter of the same blocks between the same buffers."""
    s, buf = ctx.sizes, ctx.bufs["blocks"]
    count = s.contig_bytes // TINY_BLOCK
    cache_blocks = buf.nbytes // TINY_BLOCK
    rng = np.random.default_rng(4096)
    src_ids = rng.permutation(cache_blocks)[:count]
    dst_ids = rng.permutation(cache_blocks)[:count]
    cache = register_tiny_blocks(p.ll, p.dd.cache_manager, buf, PULLER_ID)
    key = p.ll.BlocksCacheKey(OWNER_ID, TINY_MODEL)
    src, dst = src_ids.tolist(), dst_ids.tolist()
    what = f"{count} x {TINY_BLOCK >> 10} KiB"

    def pull() -> None:
        p.dd.cache_manager.pull_blocks(key, cache, src, dst)

    scatter = ScatterClient(ctx.info["plain_port"], buf, TINY_BLOCK, src_ids, dst_ids)
    try:
        for fn, label in ((scatter, "plain scatter"), (pull, "TCP pull_blocks")):
            buf.fill(0)
            fn()  # warm, and rule 2: the owner's blocks arrived where asked
            check_blocks(buf.reshape(cache_blocks, TINY_BLOCK), src_ids, dst_ids, TINY_BLOCK,
                         pattern_seed(2, 0), f"{label}, {what}")
        ctx.progress.set_label(f"TCP pull_blocks, {what}")
        f, lim = interleave(pull, scatter, ctx.repeat, ctx.progress)
    finally:
        scatter.close()
        p.dd.cache_manager.unregister_cache(cache.cache_id)
    return throughput_row(
        "tcp_pull_blocks_4k", f"TCP pull_blocks, {what}", count * TINY_BLOCK, p.mechanism(), f,
        "plain socket sendmsg/recvmsg_into scatter, same blocks", lim, 0.9)
