"""Mooncake's transfer engine beside datadist's TCP path, on the same workloads in the same
run (``datadist bench --peers``, where the ``mooncake`` module is importable: the
``mooncake-transfer-engine-non-cuda`` wheel, or the CUDA one on a machine with a driver).

Both read the owner process's memory over loopback TCP: the owner registers its source
tensors, blocks cache and small cache with a Mooncake engine of its own (:func:`serve`,
metadata by P2P handshake, no etcd), and the puller reads them through another
(:class:`MooncakeReader`) into the same buffers datadist pulls into. Rows are reported side
by side (figure: datadist's TCP path; limit: Mooncake), no goal: Mooncake is a peer, not a
limit. The small-pull row runs with both processes on one CPU, as the other latency rows.

Mooncake is driven as a tuned deployment would drive it (issue 27): large reads posted
asynchronously and looked at every 200 us (no core spinning), blocks posted in big batches
back to back with its TCP queue limits raised (TUNED), both sides given the same warm-up into
the same zeroed buffers and checked (:func:`.harness.warm_both`). ``MC_TCP_PROTO=1`` (its
legacy framing) is a variant the user sets; ``DATADIST_BENCH_MOONCAKE_WAIT=sync`` restores
the synchronous calls of the earlier rounds. Each row's note says which was used.

Who calls: the bench runner, in the owner child (:func:`serve`) and in the puller
(:func:`mooncake_rows`). Blocks while it runs.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from datadist.bench.harness import (
    SMALL_BLOCK,
    BenchError,
    Row,
    check_blocks,
    interleave,
    mib,
    one_cpu,
    pattern_seed,
    throughput_row,
    warm_both,
)
from datadist.bench.peers import importable
from datadist.bench.puller import Context, Puller, alternate_runs, check_contig

PROTOCOL = "tcp"  # what both datadist and Mooncake can use between any two hosts
# Spans per batch: Mooncake's TCP transport queues at most 1024 transfers per peer by default
# and fails a batch that overflows; TUNED raises that limit, so the blocks are posted in a few
# big batches, all at once (pipelined), as a tuned deployment would.
MAX_BATCH = int(os.environ.get("DATADIST_BENCH_MOONCAKE_BATCH", "2048"))
# Mooncake's TCP queue limits, raised in both processes (unless the user set them): set before
# the first engine of a process is initialized (:func:`_engine`).
TUNED = {"MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "16384",
         "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "16384"}
POLL = 200e-6  # seconds between two looks at a posted read (the async wait)
# "async" (default): reads posted asynchronously, waited for by polling every POLL seconds
# (single-span batches) or by one wait for all posted batches; "sync": Mooncake's
# synchronous calls, which spin a core while they wait (the bench's first rounds).
WAIT = os.environ.get("DATADIST_BENCH_MOONCAKE_WAIT", "async")


def available() -> str | None:
    """The importable Mooncake module's name, or None."""
    return importable(("mooncake",))


def variant() -> str:
    """How Mooncake is driven in this run, for the rows' notes and docs/performance.md:
    the wait, the batch size, the queue limits and the TCP framing (``MC_TCP_PROTO=1``, the
    legacy unacknowledged framing, is a documented variant the user sets)."""
    proto = "legacy framing (MC_TCP_PROTO=1)" if os.environ.get("MC_TCP_PROTO") == "1" else \
        "default (acknowledged) framing"
    queued = os.environ.get("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER",
                            TUNED["MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"])
    return (f"Mooncake {WAIT} wait (poll {POLL * 1e6:.0f} us), batches of {MAX_BATCH}, "
            f"queue {queued}/peer, {proto}")


def _engine() -> Any:
    for k, v in TUNED.items():
        os.environ.setdefault(k, v)
    # its INFO lines ("Batch Transfer completed!" per batch) would flood stderr; Mooncake
    # reads its log level from the environment (measured: GLOG_minloglevel has no effect)
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    from mooncake.engine import TransferEngine  # type: ignore[import-not-found,import-untyped,unused-ignore]

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
        """Read every span; returns when all arrived (see WAIT)."""
        if WAIT == "sync":
            self._read_sync(dst, src, lengths)
        elif len(dst) <= 16:
            self._read_polled(dst, src, lengths)
        else:
            self._read_pipelined(dst, src, lengths)

    def read_small(self, dst: int, src: int, n: int) -> None:
        """One small span, for latency: Mooncake's synchronous read, whose spinning wait is
        what a latency-minded user wants here (a 200 us poll would dominate a 16 KiB read)."""
        rc = self.engine.transfer_sync_read(self.target, dst, src, n)
        if rc != 0:
            raise BenchError(f"a Mooncake read failed ({rc})")

    def _read_polled(self, dst: list[int], src: list[int], lengths: list[int]) -> None:
        """A few large spans: each its own single-span batch, posted at once, then looked at
        every POLL seconds (``transfer_check_status`` checks a batch's first span and frees
        the batch when it completed, so each batch holds one span and is looked at until then).
        The thread sleeps between looks instead of spinning a core."""
        e = self.engine
        pending = []
        for d, s_, n in zip(dst, src, lengths, strict=True):
            bid = e.batch_transfer_async_read(self.target, [d], [s_], [n])
            if not bid:
                raise BenchError("Mooncake refused to post a read")
            pending.append(bid)
        while pending:
            time.sleep(POLL)
            left = []
            for bid in pending:
                rc = e.transfer_check_status(bid)
                if rc < 0:
                    raise BenchError(f"a Mooncake read failed ({rc})")
                if rc == 0:
                    left.append(bid)
            pending = left

    def _read_pipelined(self, dst: list[int], src: list[int], lengths: list[int]) -> None:
        """Many spans: batches of MAX_BATCH posted back to back (the queue limits raised),
        then one wait for all of them (``get_batch_transfer_status``: Mooncake's Python API
        has no sleeping wait for a batch of several spans, so this wait spins, once)."""
        e = self.engine
        ids = []
        for i in range(0, len(dst), MAX_BATCH):
            j = i + MAX_BATCH
            bid = e.batch_transfer_async_read(self.target, dst[i:j], src[i:j], lengths[i:j])
            if not bid:
                raise BenchError("Mooncake refused to post a batch read")
            ids.append(bid)
        rc = e.get_batch_transfer_status(ids)
        if rc != 0:
            raise BenchError(f"a Mooncake batch read failed ({rc})")

    def _read_sync(self, dst: list[int], src: list[int], lengths: list[int]) -> None:
        if len(dst) == 1:
            self.read_small(dst[0], src[0], lengths[0])
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
    p = ctx.puller("tcp")
    rows: list[Row] = []
    how = variant()
    try:
        reader = MooncakeReader(info["mooncake_port"],
                                [*bufs["contig"], bufs["blocks"], bufs["small"]])
        contig = bufs["contig"]
        c_dst = [a.ctypes.data for a in contig]
        c_src = list(info["contig_addrs"])
        c_len = [s.tensor_bytes] * len(contig)

        def read_contig() -> None:
            reader.read(c_dst, c_src, c_len)

        # rules 1 and 2 for both sides: the same warm-up, into the same zeroed buffers, checked
        def zero_contig() -> None:
            for a in contig:
                a.fill(0)

        warm_both([("TCP pull", p.pull_contig), ("Mooncake read", read_contig)], zero_contig,
                  lambda what: check_contig(contig, 1, what))
        ctx.progress.set_label("Mooncake: 256 MiB")
        f, lim = interleave(p.pull_contig, read_contig, ctx.repeat, ctx.progress)
        rows.append(_beside(throughput_row(
            "mooncake_pull", f"TCP pull beside Mooncake TCP, {mib(s.contig_bytes)}",
            s.contig_bytes, p.mechanism(), f, "Mooncake TransferEngine read, tcp", lim, 0),
            how))

        bb = s.block_bytes
        blocks = bufs["blocks"]
        b_dst = (blocks.ctypes.data + ctx.dst_ids.astype(np.uint64) * np.uint64(bb)).tolist()
        b_src = (info["blocks_addr"] + ctx.src_ids.astype(np.uint64) * np.uint64(bb)).tolist()
        b_len = [bb] * len(b_dst)
        src, dst = ctx.src_list, ctx.dst_list

        def pull_blocks() -> None:
            p.pull_blocks(src, dst)

        def read_blocks() -> None:
            reader.read(b_dst, b_src, b_len)

        warm_both([("TCP pull_blocks", pull_blocks), ("Mooncake block reads", read_blocks)],
                  lambda: blocks.fill(0),
                  lambda what: check_blocks(blocks.reshape(s.cache_blocks, -1), ctx.src_ids,
                                            ctx.dst_ids, bb, pattern_seed(2, 0), what))
        ctx.progress.set_label("Mooncake: blocks")
        f, lim = interleave(pull_blocks, read_blocks, ctx.repeat, ctx.progress)
        rows.append(_beside(throughput_row(
            "mooncake_pull_blocks", f"TCP pull_blocks beside Mooncake TCP, {s.blocks} x "
            f"{bb >> 10} KiB", s.blocks * bb, p.mechanism(), f,
            "Mooncake batch read, same blocks", lim, 0), how))
        rows.append(_beside(_small_row(ctx, p, reader), how))
    finally:
        p.close()
    return rows


def _beside(row: Row, how: str) -> Row:
    row.goal, row.met, row.note = "reported", True, how
    return row


def _small_row(ctx: Context, p: Puller, reader: MooncakeReader) -> Row:
    """p50 of one 16 KiB block: datadist's TCP pull against Mooncake's read of the same block,
    in alternating runs, both processes on one CPU."""
    small = ctx.bufs["small"]
    d, s_ = small.ctypes.data + 9 * SMALL_BLOCK, ctx.info["small_addr"] + 5 * SMALL_BLOCK
    ctx.progress.set_label("Mooncake: small pull")
    with one_cpu(os.getpid(), ctx.info["pid"]):
        pulls, reads = alternate_runs(ctx, lambda _: p.pull_small(5, 9),
                                      lambda: reader.read_small(d, s_, SMALL_BLOCK))
    return Row("mooncake_small", "small pull, one 16 KiB block, TCP, beside Mooncake", "us",
               float(np.median(pulls)), "Mooncake read of the same block, p50",
               float(np.median(reads)), "reported", True, p.mechanism(),
               figure_samples=pulls, limit_samples=reads)
