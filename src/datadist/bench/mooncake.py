"""Mooncake's transfer engine beside datadist's TCP path, on the same workloads in the same
run (``datadist bench --peers``, where the ``mooncake`` module is importable: the
``mooncake-transfer-engine-non-cuda`` wheel, or the CUDA one on a machine with a driver).

Both read the owner process's memory over loopback TCP: the owner registers its source
tensors, blocks cache and small cache with a Mooncake engine of its own (:func:`serve`,
metadata by P2P handshake, no etcd), and the puller reads them through another
(:class:`MooncakeReader`) into the same buffers datadist pulls into. Rows are reported side
by side (figure: datadist's TCP path; limit: Mooncake), no goal: Mooncake is a peer, not a
limit. The small-pull row runs with both processes on one CPU, as the other latency rows.

Who calls: the bench runner, in the owner child (:func:`serve`) and in the puller
(:func:`mooncake_rows`). Blocks while it runs.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from datadist.bench.harness import (
    SMALL_BLOCK,
    BenchError,
    Row,
    check_blocks,
    check_pattern,
    interleave,
    mib,
    one_cpu,
    pattern_seed,
    throughput_row,
)
from datadist.bench.peers import importable
from datadist.bench.puller import Context, Puller, alternate_runs

PROTOCOL = "tcp"  # what both datadist and Mooncake can use between any two hosts
MAX_BATCH = int(os.environ.get("DATADIST_BENCH_MOONCAKE_BATCH", "256"))  # spans per batch


def available() -> str | None:
    """The importable Mooncake module's name, or None."""
    return importable(("mooncake",))


def _engine() -> Any:
    from mooncake.engine import TransferEngine  # type: ignore[import-not-found]

    engine = TransferEngine()
    rc = engine.initialize("127.0.0.1", "P2PHANDSHAKE", PROTOCOL, "")
    if rc != 0:
        raise BenchError(f"Mooncake's TransferEngine.initialize failed ({rc})")
    return engine


def serve(arrays: list[np.ndarray]) -> tuple[Any, int]:
    """Owner side: an engine with ``arrays`` registered; returns it (keep it alive) and its
    RPC port, where readers address it."""
    engine = _engine()
    for a in arrays:
        if engine.register_memory(a.ctypes.data, a.nbytes) != 0:
            raise BenchError("Mooncake could not register the owner's memory")
    return engine, int(engine.get_rpc_port())


class MooncakeReader:
    """The puller's engine: its buffers registered, reads from the owner's engine."""

    def __init__(self, port: int, arrays: list[np.ndarray]) -> None:
        self.engine = _engine()
        self.target = f"127.0.0.1:{port}"
        for a in arrays:
            if self.engine.register_memory(a.ctypes.data, a.nbytes) != 0:
                raise BenchError("Mooncake could not register the puller's memory")

    def read(self, dst: list[int], src: list[int], lengths: list[int]) -> None:
        """Read every span, synchronously: one call, or batches of MAX_BATCH spans (a bigger
        batch overflows the TCP transport's queue, and the read fails)."""
        if len(dst) == 1:
            rc = self.engine.transfer_sync_read(self.target, dst[0], src[0], lengths[0])
            if rc != 0:
                raise BenchError(f"a Mooncake read failed ({rc})")
            return
        for i in range(0, len(dst), MAX_BATCH):
            j = i + MAX_BATCH
            rc = self.engine.batch_transfer_sync_read(self.target, dst[i:j], src[i:j],
                                                      lengths[i:j])
            if rc != 0:
                raise BenchError(f"a Mooncake batch read failed ({rc})")


def mooncake_rows(ctx: Context) -> list[Row]:
    s, info, bufs = ctx.sizes, ctx.info, ctx.bufs
    if "mooncake_port" not in info:
        raise BenchError(f"the owner could not serve Mooncake: {info.get('mooncake_error')}")
    p = Puller(info, s, bufs, "tcp")
    rows: list[Row] = []
    try:
        reader = MooncakeReader(info["mooncake_port"],
                                [*bufs["contig"], bufs["blocks"], bufs["small"]])
        contig = bufs["contig"]
        c_dst = [a.ctypes.data for a in contig]
        c_src = list(info["contig_addrs"])
        c_len = [s.tensor_bytes] * len(contig)
        for a in contig:
            a.fill(0)
        reader.read(c_dst, c_src, c_len)  # warm, and rule 2: the owner's bytes arrived
        for t, a in enumerate(contig):
            check_pattern(a, pattern_seed(1, t), "Mooncake read")
        ctx.progress.set_label("Mooncake: 256 MiB")
        f, lim = interleave(p.pull_contig, lambda: reader.read(c_dst, c_src, c_len),
                            ctx.repeat, ctx.progress)
        rows.append(_beside(throughput_row(
            "mooncake_pull", f"TCP pull beside Mooncake TCP, {mib(s.contig_bytes)}",
            s.contig_bytes, p.mechanism(), f, "Mooncake TransferEngine read, tcp", lim, 0)))

        bb = s.block_bytes
        blocks = bufs["blocks"]
        b_dst = (blocks.ctypes.data + ctx.dst_ids.astype(np.uint64) * np.uint64(bb)).tolist()
        b_src = (info["blocks_addr"] + ctx.src_ids.astype(np.uint64) * np.uint64(bb)).tolist()
        b_len = [bb] * len(b_dst)
        blocks.fill(0)
        reader.read(b_dst, b_src, b_len)
        check_blocks(blocks.reshape(s.cache_blocks, -1), ctx.src_ids, ctx.dst_ids, bb,
                     pattern_seed(2, 0), "Mooncake block reads")
        src, dst = ctx.src_list, ctx.dst_list
        ctx.progress.set_label("Mooncake: blocks")
        f, lim = interleave(lambda: p.pull_blocks(src, dst),
                            lambda: reader.read(b_dst, b_src, b_len), ctx.repeat, ctx.progress)
        rows.append(_beside(throughput_row(
            "mooncake_pull_blocks", f"TCP pull_blocks beside Mooncake TCP, {s.blocks} x "
            f"{bb >> 10} KiB", s.blocks * bb, p.mechanism(), f,
            "Mooncake batch read, same blocks", lim, 0)))
        rows.append(_small_row(ctx, p, reader))
    finally:
        p.close()
    return rows


def _beside(row: Row) -> Row:
    row.goal, row.met = "reported", True
    return row


def _small_row(ctx: Context, p: Puller, reader: MooncakeReader) -> Row:
    """p50 of one 16 KiB block: datadist's TCP pull against Mooncake's read of the same block,
    in alternating runs, both processes on one CPU."""
    small = ctx.bufs["small"]
    d, s_ = small.ctypes.data + 9 * SMALL_BLOCK, ctx.info["small_addr"] + 5 * SMALL_BLOCK
    ctx.progress.set_label("Mooncake: small pull")
    with one_cpu(os.getpid(), ctx.info["pid"]):
        pulls, reads = alternate_runs(ctx, lambda _: p.pull_small(5, 9),
                                      lambda: reader.read([d], [s_], [SMALL_BLOCK]))
    return Row("mooncake_small", "small pull, one 16 KiB block, TCP, beside Mooncake", "us",
               float(np.median(pulls)), "Mooncake read of the same block, p50",
               float(np.median(reads)), "reported", True, p.mechanism(),
               figure_samples=pulls, limit_samples=reads)
