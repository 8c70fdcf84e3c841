"""Rows of the NIXL data path (transport "nixl") against NIXL driven directly, and beside
datadist's own best path on this host. Run only where NIXL is importable.

The limit is the same READ through a second NIXL agent in this process: descriptor lists
prepared once (``prep_xfer_dlist``), one transfer handle made once (``make_prepped_xfer``)
and reposted for every repetition, polled to completion, no progress thread. It reads the same
owner memory from the owner's own agent (created by datadist when the puller linked). The
owner drives its agent only while a NIXL lease is open (transport/nixl.py), so the limit
holds one open for its whole run on a side connection: both sides get the same owner.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from datadist.bench.harness import (
    BLOCKS_MODEL,
    OWNER_ID,
    SMALL_BLOCK,
    SMALL_MODEL,
    U64,
    BenchError,
    Row,
    interleave,
    mib,
    throughput_row,
)
from datadist.bench.limits import iov
from datadist.bench.puller import Context, Puller, alternate_runs, warm_and_check

SIDE_ID = 3  # the limit's side connection says Hello as this cluster


class RawNixl:
    """NIXL without datadist: an agent of its own, the owner's metadata, prepared handles."""

    def __init__(self, port: int, bufs: dict[str, Any]) -> None:
        from datadist.core.links import HostIdentity, greet
        from datadist.transport import nixl
        from datadist.wire import protocol as p

        mod = nixl.load()
        self.agent = mod.nixl_agent(
            f"bench-raw-{os.getpid()}",
            mod.nixl_agent_config(enable_prog_thread=False, backends=[nixl.BACKEND]))
        ident = HostIdentity.current()
        deadline = time.monotonic() + 10

        def hello() -> Any:
            return p.Hello(SIDE_ID, 2, ident.pid, ident.pid_ns, ident.boot_id)

        self.chan, _ = greet("127.0.0.1", port, OWNER_ID, hello, None, deadline)
        md = self.chan.call(p.NixlMdRequest(), deadline)
        if not isinstance(md, p.NixlMd):
            raise BenchError(f"the owner sent no NIXL metadata: {md!r}")
        self.remote = self.agent.add_remote_agent(md.metadata)
        self._lease = self._open_lease()
        self._keep: list[Any] = []
        arrays = [*bufs["contig"], bufs["blocks"], bufs["small"]]
        regs = np.array([[a.ctypes.data, a.nbytes, 0] for a in arrays], dtype=U64)
        self._reg = self.agent.register_memory(regs, "DRAM")

    def _open_lease(self) -> int:
        """An open lease (one byte of the small cache) keeps the owner's agent progressing
        for the limit as for the figure (transport/nixl.py, the pump)."""
        from datadist.wire import protocol as p

        grant = self.chan.call(p.NixlRead(
            p.KeyRef(p.KeyKind.BLOCKS_KEY, 0, SMALL_MODEL, 0), 0, p.ReadFlags.NONE,
            np.zeros(1, np.uint32), np.zeros(1, U64), np.ones(1, U64)), time.monotonic() + 10)
        if not isinstance(grant, p.NixlGrant):
            raise BenchError(f"the owner granted nothing: {grant!r}")
        return int(grant.lease_id)

    def settle(self) -> None:
        """After the first READ: release the lease as completed and hold a new one, as a
        datadist reader's connection does after its first pull (the owner's pump then beats
        slowly; it beat fast while the endpoint was being wired up)."""
        from datadist.wire import protocol as p

        self.chan.send(p.Release(self._lease, True), time.monotonic() + 2)
        self._lease = self._open_lease()

    def prepare(self, local: np.ndarray, remote: np.ndarray) -> Callable[[], None]:
        """One prepared READ of ``remote`` spans into ``local`` spans ((n, 2) uint64 iovs);
        the returned call posts it and polls it to completion."""
        a = self.agent
        ld = np.zeros((len(local), 3), dtype=U64)
        ld[:, :2] = local
        rd = np.zeros((len(remote), 3), dtype=U64)
        rd[:, :2] = remote
        lh = a.prep_xfer_dlist("NIXL_INIT_AGENT", ld, "DRAM")
        rh = a.prep_xfer_dlist(self.remote, rd, "DRAM")
        idx = np.arange(len(local), dtype=np.int32)
        handle = a.make_prepped_xfer("READ", lh, idx, rh, idx)
        self._keep += [lh, rh, handle]

        def run() -> None:
            state = a.transfer(handle)
            while state == "PROC":
                state = a.check_xfer_state(handle)
            if state != "DONE":
                raise BenchError("NIXL READ failed (the limit)")

        return run

    def close(self) -> None:
        from datadist.wire import protocol as p

        for h in reversed(self._keep):
            h.release()
        self.agent.deregister_memory(self._reg)
        try:
            self.chan.send(p.Release(self._lease, True), time.monotonic() + 2)
        finally:
            self.chan.close()
        self.agent.remove_remote_agent(self.remote)


def _latency(ctx: Context, p: Puller, raw: Callable[[], None], title: str) -> Row:
    """p50 of one 16 KiB block pulls against the same 16 KiB READ on a reused handle."""
    ctx.progress.set_label(title)
    pulls, lims = alternate_runs(ctx, lambda _: p.pull_small(5, 9), raw)
    row = Row("nixl_small", title, "us", float(np.median(pulls)),
              "NIXL READ of 16 KiB, reused handle, p50", float(np.median(lims)), "<= 2.00x",
              path=p.mechanism(), figure_samples=pulls, limit_samples=lims)
    row.met = row.ratio is not None and row.ratio <= 2.0
    return row


def nixl_rows(ctx: Context) -> list[Row]:
    s, info = ctx.sizes, ctx.info
    rows: list[Row] = []
    p = Puller(info, s, ctx.bufs, "nixl")
    raw = None
    try:
        if p.path != "nixl":
            raise BenchError(f"transport nixl was forced but the link uses {p.path}")
        warm_and_check(ctx, p, "nixl")
        raw = RawNixl(info["port"], ctx.bufs)
        lengths = [s.tensor_bytes] * s.contig_tensors
        raw_c = raw.prepare(iov([a.ctypes.data for a in ctx.bufs["contig"]], lengths),
                            iov(info["contig_addrs"], lengths))
        raw_c()
        raw.settle()
        ctx.progress.set_label("NIXL pull")
        f_nixl, lim = interleave(p.pull_contig, raw_c, ctx.repeat, ctx.progress)
        rows.append(throughput_row(
            "nixl_pull", f"NIXL path pull, {mib(s.contig_bytes)}", s.contig_bytes,
            p.mechanism(), f_nixl, "NIXL READ, prepared handle", lim, 0.95))

        bb = np.uint64(s.block_bytes)
        n = np.full(s.blocks, bb, dtype=U64)
        raw_b = raw.prepare(
            iov(ctx.bufs["blocks"].ctypes.data + ctx.dst_ids.astype(U64) * bb, n),
            iov(info["blocks_addr"] + ctx.src_ids.astype(U64) * bb, n))
        raw_b()
        src, dst = ctx.src_list, ctx.dst_list
        ctx.progress.set_label("NIXL pull_blocks")
        f, lim = interleave(lambda: p.pull_blocks(src, dst), raw_b, ctx.repeat, ctx.progress)
        rows.append(throughput_row(
            "nixl_pull_blocks", f"NIXL path pull_blocks, {s.blocks} x {s.block_bytes >> 10} KiB",
            s.blocks * s.block_bytes, p.mechanism(), f, "NIXL READ, prepared handle, same "
            "descriptors", lim, 0.95))

        small = ctx.bufs["small"].ctypes.data
        raw_s = raw.prepare(iov([small + 9 * SMALL_BLOCK], [SMALL_BLOCK]),
                            iov([info["small_addr"] + 5 * SMALL_BLOCK], [SMALL_BLOCK]))
        rows.append(_latency(ctx, p, raw_s,
                             f"small pull, one {SMALL_BLOCK >> 10} KiB block, NIXL path"))
    finally:
        if raw is not None:
            raw.close()
        p.close()
    rows.append(_beside_best(ctx, f_nixl))
    return rows


def _beside_best(ctx: Context, nixl_s: list[float]) -> Row:
    """The NIXL path beside datadist's own best path here (auto: shared memory or
    cross-memory attach on one host), reported side by side, no goal."""
    s = ctx.sizes
    p = Puller(ctx.info, s, ctx.bufs, "auto")
    try:
        p.pull_contig()
        ctx.progress.set_label("best own path pull")
        best, _ = interleave(p.pull_contig, lambda: None, ctx.repeat, ctx.progress)
        path = p.mechanism()
    finally:
        p.close()
    row = throughput_row("nixl_vs_best", f"NIXL path pull beside datadist's {path}, "
                         f"{mib(s.contig_bytes)}", s.contig_bytes, "nixl", nixl_s,
                         f"datadist {path} pull", best, 0.0)
    row.goal, row.met = "reported", True
    return row


__all__ = ["BLOCKS_MODEL", "RawNixl", "nixl_rows"]
