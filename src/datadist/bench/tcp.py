"""Rows of the TCP path against a plain socket between the same two processes.
"""

from __future__ import annotations

from collections.abc import Callable

from datadist.bench.harness import (
    SMALL_BLOCK,
    BenchError,
    Row,
    interleave,
    mib,
    throughput_row,
)
from datadist.bench.puller import (
    Context,
    Puller,
    latency_row,
    warm_and_check,
)


def tcp_rows(ctx: Context) -> list[Row]:
    s, info = ctx.sizes, ctx.info
    p = Puller(info, s, ctx.bufs, "tcp")
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

        rows.append(latency_row(ctx, p, "tcp_small",
                                 f"small pull, one {SMALL_BLOCK >> 10} KiB block, TCP"))
    finally:
        p.close()
    return rows
