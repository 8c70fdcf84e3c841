"""Rows of the same-host paths (cross-memory attach, shared memory) against raw
``process_vm_readv`` and ``memcpy``.
"""

from __future__ import annotations

import numpy as np

from datadist.bench.harness import (
    SMALL_BLOCK,
    U64,
    Row,
    interleave,
    mib,
    throughput_row,
)
from datadist.bench.limits import MemcpyLimit, RawCma, iov
from datadist.bench.puller import (
    Context,
    latency_row,
    warm_and_check,
)

# A repeated 16 KiB same-host pull: p50 at most 1.5x the plain round trip (issue "One engine,
# native"; it was 2x while the engine was Python's). The TCP one keeps 2x (bench/tcp.py).
SMALL_GOAL = 1.5


def same_host_rows(ctx: Context) -> list[Row]:
    s, info = ctx.sizes, ctx.info
    p = ctx.puller("auto")
    rows: list[Row] = []
    try:
        warm_and_check(ctx, p, "same-host")
        cma = RawCma(info["pid"])
        lengths = [s.tensor_bytes] * s.contig_tensors
        local = iov([a.ctypes.data for a in ctx.bufs["contig"]], lengths)
        remote = iov(info["contig_addrs"], lengths)
        raw = cma.prepare(local, remote)
        raw()  # warm
        ctx.progress.set_label("same-host pull, client memory")
        f, lim = interleave(p.pull_contig, raw, ctx.repeat, ctx.progress)
        rows.append(throughput_row(
            "same_host_pull", f"same-host pull, {mib(s.contig_bytes)}, client memory",
            s.contig_bytes, p.mechanism(), f, "raw process_vm_readv, same bytes", lim, 0.9))

        bb = np.uint64(s.block_bytes)
        local_b = iov(ctx.bufs["blocks"].ctypes.data + ctx.dst_ids.astype(U64) * bb,
                       np.full(s.blocks, bb, dtype=U64))
        remote_b = iov(info["blocks_addr"] + ctx.src_ids.astype(U64) * bb,
                        np.full(s.blocks, bb, dtype=U64))
        raw_b = cma.prepare(local_b, remote_b)
        raw_b()
        src, dst = ctx.src_list, ctx.dst_list
        ctx.progress.set_label("same-host pull_blocks, client memory")
        f, lim = interleave(lambda: p.pull_blocks(src, dst), raw_b, ctx.repeat, ctx.progress)
        rows.append(throughput_row(
            "same_host_pull_blocks",
            f"same-host pull_blocks, {s.blocks} x {s.block_bytes >> 10} KiB, client memory",
            s.blocks * s.block_bytes, p.mechanism(), f, "raw process_vm_readv, same iovecs", lim,
            0.9))

        memcpy = MemcpyLimit(s.contig_bytes)
        try:
            memcpy()
            ctx.progress.set_label("same-host pull, pool-allocated")
            f, lim = interleave(p.pull_pool, memcpy, ctx.repeat, ctx.progress)
        finally:
            memcpy.close()
        rows.append(throughput_row(
            "same_host_pull_pool", f"same-host pull, {mib(s.contig_bytes)}, both caches "
            "allocated by datadist", s.contig_bytes, p.mechanism(), f,
            "memcpy, page-aligned, warm", lim, 0.85))

        rows.append(latency_row(ctx, p, "same_host_small",
                                 f"small pull, one {SMALL_BLOCK >> 10} KiB block, same host",
                                 goal=SMALL_GOAL))
    finally:
        p.close()
    return rows
