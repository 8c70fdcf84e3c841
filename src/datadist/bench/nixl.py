"""Rows of the NIXL data path (transport "nixl") against NIXL driven directly, and beside
datadist's own best path on this host. Run only where NIXL is importable.

The limit is the same READ through a second NIXL agent in this process: descriptor lists
prepared once (``prep_xfer_dlist``), one transfer handle made once (``make_prepped_xfer``)
and reposted for every repetition, polled to completion, with NIXL's progress thread off (the
goal rows) and again on (the ``_prog`` rows, reported). It reads the same
owner memory from the owner's own agent (created by the core when the puller linked). The
owner drives its agent only while a NIXL lease is open (the core's NIXL owner), so the limit
holds one open for its whole run on a side connection spoken by hand on the wire
(:class:`SideChannel`): both sides get the same owner.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import socket
import sys
import tempfile
from collections.abc import Callable, Iterator
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
    check_blocks,
    interleave,
    mib,
    pattern_seed,
    throughput_row,
    timed,
    warm_both,
)
from datadist.bench.limits import iov
from datadist.bench.puller import Context, Puller, alternate_runs, check_contig, warm_and_check

SIDE_ID = 3  # the limit's side connection says Hello as this cluster


@contextlib.contextmanager
def ucx_protocols(out: list[str]) -> Iterator[None]:
    """Appends to ``out`` the UCX transports (``tcp/lo``, ``cma/memory``, ...) that UCX chose
    for remote-memory reads while the block ran: UCX prints its protocol choices when
    ``UCX_PROTO_INFO=y`` was set as its context was made (here: the limit's agent), and this
    catches the process's stdout and stderr (file descriptors 1 and 2) meanwhile. Other
    output written then is dropped. Where UCX prints nothing, ``out`` stays empty."""
    saved_env = os.environ.get("UCX_PROTO_INFO")
    os.environ["UCX_PROTO_INFO"] = "y"
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with tempfile.TemporaryFile() as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            if saved_env is None:
                os.environ.pop("UCX_PROTO_INFO", None)
            else:
                os.environ["UCX_PROTO_INFO"] = saved_env
            f.seek(0)
            out.extend(read_transports(f.read().decode(errors="replace")))


def read_transports(text: str) -> list[str]:
    """The transports of the remote-memory-read tables in UCX's protocol printout, in order
    of first appearance (``| 0..inf | zero-copy | cma/memory |`` rows under a title that says
    "remote memory read")."""
    found: dict[str, None] = {}
    in_read = False
    for line in text.splitlines():
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if len(cells) == 1:  # a table's title lines
            if "remote memory read" in cells[0]:
                in_read = True
            elif "memory" in cells[0] or "message" in cells[0]:
                in_read = "remote memory read" in cells[0]
        elif in_read and len(cells) == 3 and cells[0] != "Range":
            for t in cells[2].replace(",", " ").split():
                if "/" in t and not t.startswith("<"):
                    found.setdefault(t.split("(")[0].rstrip(":"))
    return list(found)


BACKEND = "UCX"  # NIXL's backend the limit's agent uses (the core's NIXL path uses UCX too)
SIDE_TIMEOUT = 10.0  # s any wait of the side connection may take


def load_nixl() -> Any:
    """The NIXL module, found as datadist finds it (core/nixl_wheel.py: the wheels' names;
    UCX's ib module left out where the host has no RDMA device). Raises BenchError without
    NIXL. Called once per :class:`RawNixl`, before its agent is made."""
    from datadist.core import nixl_wheel as nixl

    for name in nixl.MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        nixl._skip_unusable_ib()
        if not os.environ.get("NIXL_LOG_LEVEL"):  # NIXL logs every agent made on stdout
            logging.getLogger("nixl").setLevel(logging.WARNING)
        return mod
    raise BenchError("the nixl rows need NIXL: pip install 'datadist[nixl]'")


class SideChannel:
    """The limit's side connection to the owner, spoken by hand on the wire
    (``datadist.wire.protocol``): connect, say ``hello``, check the Welcome is the owner's,
    then requests answered in order. Frames the owner sends unasked (request id 0) are
    skipped. Every wait is bounded by SIDE_TIMEOUT; a closed or silent owner is a
    BenchError. Who calls: :class:`RawNixl`, from the puller's thread."""

    def __init__(self, port: int, hello: Any) -> None:
        from datadist.wire import protocol as p

        self._p = p
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=SIDE_TIMEOUT)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._dec = p.FrameDecoder()
        self._got: list[tuple[int, Any]] = []
        self._rid = 0
        try:
            welcome = self.call(hello)
            if not isinstance(welcome, p.Welcome) or welcome.cluster_id != OWNER_ID:
                raise BenchError(f"the owner did not welcome the side connection: {welcome!r}")
        except BaseException:
            self.sock.close()
            raise

    def send(self, msg: Any) -> int:
        """Sends ``msg`` under a new request id, which it returns."""
        self._rid += 1
        self.sock.sendall(self._p.encode(msg, self._rid))
        return self._rid

    def call(self, msg: Any) -> Any:
        """Sends ``msg`` and returns the owner's answer to it."""
        rid = self.send(msg)
        while True:
            while not self._got:
                try:
                    chunk = self.sock.recv(1 << 16)
                except OSError as e:
                    raise BenchError(f"the owner's side connection failed: {e}") from e
                if not chunk:
                    raise BenchError("the owner closed the side connection")
                self._got.extend(self._dec.feed(chunk))
            got_rid, answer = self._got.pop(0)
            if got_rid == rid:
                return answer

    def close(self) -> None:
        self.sock.close()


class RawNixl:
    """NIXL without datadist: an agent of its own, the owner's metadata, prepared handles.
    ``prog_thread``: NIXL's own progress thread on (it then completes transfers in the
    background) or off (this thread polls them to completion, as datadist does)."""

    def __init__(self, port: int, bufs: dict[str, Any], prog_thread: bool = False) -> None:
        from datadist.core.config import HostIdentity
        from datadist.wire import protocol as p

        mod = load_nixl()
        self.prog_thread = prog_thread
        self.agent = mod.nixl_agent(
            f"bench-raw-{os.getpid()}-{int(prog_thread)}",
            mod.nixl_agent_config(enable_prog_thread=prog_thread, backends=[BACKEND]))
        ident = HostIdentity.current()
        self.chan = SideChannel(port, p.Hello(SIDE_ID, 2, ident.pid, ident.pid_ns,
                                              ident.boot_id))
        md = self.chan.call(p.NixlMdRequest())
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
        for the limit as for the figure (the core's NIXL owner and its pump)."""
        from datadist.wire import protocol as p

        grant = self.chan.call(p.NixlRead(
            p.KeyRef(p.KeyKind.BLOCKS_KEY, 0, SMALL_MODEL, 0), 0, p.ReadFlags.NONE,
            np.zeros(1, np.uint32), np.zeros(1, U64), np.ones(1, U64)))
        if not isinstance(grant, p.NixlGrant):
            raise BenchError(f"the owner granted nothing: {grant!r}")
        return int(grant.lease_id)

    def settle(self) -> None:
        """After the first READ: release the lease as completed and hold a new one, as a
        datadist reader's connection does after its first pull (the owner's pump then beats
        slowly; it beat fast while the endpoint was being wired up)."""
        from datadist.wire import protocol as p

        self.chan.send(p.Release(self._lease, True))
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
            self.chan.send(p.Release(self._lease, True))
        finally:
            self.chan.close()
        self.agent.remove_remote_agent(self.remote)


def _latency(ctx: Context, p: Puller, raw: Callable[[], None], title: str, key: str,
             limit_title: str) -> Row:
    """p50 of one 16 KiB block pulls against the same 16 KiB READ on a reused handle."""
    ctx.progress.set_label(title)
    pulls, lims = alternate_runs(ctx, lambda _: p.pull_small(5, 9), raw)
    row = Row(key, title, "us", float(np.median(pulls)), limit_title, float(np.median(lims)),
              "<= 2.00x", path=p.mechanism(), figure_samples=pulls, limit_samples=lims)
    row.met = row.ratio is not None and row.ratio <= 2.0
    return row


def nixl_rows(ctx: Context) -> list[Row]:
    """The NIXL path against NIXL driven directly with its progress thread off (goals), and
    again against NIXL with its progress thread on (reported), so that neither of NIXL's
    settings is left out; every row's note names the UCX transports NIXL's reads used."""
    s, info, bufs = ctx.sizes, ctx.info, ctx.bufs
    rows: list[Row] = []
    p = ctx.puller("nixl")
    raws: list[RawNixl] = []
    try:
        if p.path != "nixl":
            raise BenchError(f"transport nixl was forced but the link uses {p.path}")
        warm_and_check(ctx, p, "nixl")
        lengths = [s.tensor_bytes] * s.contig_tensors
        bb = np.uint64(s.block_bytes)
        n = np.full(s.blocks, bb, dtype=U64)
        small = bufs["small"].ctypes.data
        transports: list[str] = []
        prepared = []
        for prog in (False, True):
            with contextlib.ExitStack() as stack:
                if not prog:  # UCX's choices, printed as the first agent wires up (see above)
                    stack.enter_context(ucx_protocols(transports))
                raw = RawNixl(info["port"], bufs, prog_thread=prog)
                raws.append(raw)
                fns = (raw.prepare(iov([a.ctypes.data for a in bufs["contig"]], lengths),
                                   iov(info["contig_addrs"], lengths)),
                       raw.prepare(iov(bufs["blocks"].ctypes.data + ctx.dst_ids.astype(U64) * bb,
                                       n),
                                   iov(info["blocks_addr"] + ctx.src_ids.astype(U64) * bb, n)),
                       raw.prepare(iov([small + 9 * SMALL_BLOCK], [SMALL_BLOCK]),
                                   iov([info["small_addr"] + 5 * SMALL_BLOCK], [SMALL_BLOCK])))
                for fn in fns:
                    fn()
            raw.settle()
            prepared.append(fns)
        note = ("UCX transports of NIXL's reads: " + (", ".join(transports) or
                                                       "not reported by this UCX"))
        off, on = prepared
        src, dst = ctx.src_list, ctx.dst_list

        def pull_blocks() -> None:
            p.pull_blocks(src, dst)

        _warm_sides(ctx, p.pull_contig, pull_blocks, off, on)
        f_best: list[float] = []
        for fns, tag, how in ((off, "", "progress thread off"),
                              (on, "_prog", "progress thread on")):
            goal = 0.95 if not tag else 0.0
            ctx.progress.set_label(f"NIXL pull ({how})")
            f_nixl, lim = interleave(p.pull_contig, fns[0], ctx.repeat, ctx.progress)
            rows.append(throughput_row(
                f"nixl_pull{tag}", f"NIXL path pull, {mib(s.contig_bytes)}"
                f"{', vs NIXL ' + how if tag else ''}", s.contig_bytes, p.mechanism(), f_nixl,
                f"NIXL READ, prepared handle, {how}", lim, goal))
            if not tag:
                f_best = f_nixl
            ctx.progress.set_label(f"NIXL pull_blocks ({how})")
            f, lim = interleave(pull_blocks, fns[1], ctx.repeat, ctx.progress)
            rows.append(throughput_row(
                f"nixl_pull_blocks{tag}", f"NIXL path pull_blocks, {s.blocks} x "
                f"{s.block_bytes >> 10} KiB{', vs NIXL ' + how if tag else ''}",
                s.blocks * s.block_bytes, p.mechanism(), f,
                f"NIXL READ, prepared handle, same descriptors, {how}", lim, goal))
            rows.append(_latency(ctx, p, fns[2], f"small pull, one {SMALL_BLOCK >> 10} KiB "
                                 f"block, NIXL path{', vs NIXL ' + how if tag else ''}",
                                 f"nixl_small{tag}",
                                 f"NIXL READ of 16 KiB, reused handle, {how}, p50"))
        for r in rows:
            r.note = note
            if r.key.endswith("_prog"):
                r.goal, r.met = "reported", True
    finally:
        for raw in raws:
            raw.close()
        p.close()
    rows.append(_beside_best(ctx, f_best))
    return rows


def _warm_sides(ctx: Context, pull: Callable[[], None], pull_blocks: Callable[[], None],
                off: tuple[Callable[[], None], ...], on: tuple[Callable[[], None], ...]) -> None:
    """Rules 1 and 2 for the NIXL path and both NIXL settings: the same warm-up into the same
    zeroed buffers, the bytes checked (harness.warm_both)."""
    s, contig, blocks = ctx.sizes, ctx.bufs["contig"], ctx.bufs["blocks"]

    def zero_contig() -> None:
        for a in contig:
            a.fill(0)

    warm_both([("NIXL path pull", pull), ("NIXL READ, progress thread off", off[0]),
               ("NIXL READ, progress thread on", on[0])], zero_contig,
              lambda what: check_contig(contig, 1, what))
    warm_both([("NIXL path pull_blocks", pull_blocks),
               ("NIXL READ of the blocks, progress thread off", off[1]),
               ("NIXL READ of the blocks, progress thread on", on[1])], lambda: blocks.fill(0),
              lambda what: check_blocks(blocks.reshape(s.cache_blocks, -1), ctx.src_ids,
                                        ctx.dst_ids, s.block_bytes, pattern_seed(2, 0), what))


def _beside_best(ctx: Context, nixl_s: list[float]) -> Row:
    """The NIXL path beside datadist's own best path here (auto: shared memory or
    cross-memory attach on one host), reported side by side, no goal."""
    s = ctx.sizes
    p = ctx.puller("auto")
    contig = ctx.bufs["contig"]

    def zero_contig() -> None:
        for a in contig:
            a.fill(0)

    try:
        warm_both([("datadist's own path pull", p.pull_contig)], zero_contig,
                  lambda what: check_contig(contig, 1, what))
        ctx.progress.set_label("best own path pull")
        best = []
        for _ in range(ctx.repeat):
            best.append(timed(p.pull_contig))
            ctx.progress.step()
        path = p.mechanism()
    finally:
        p.close()
    row = throughput_row("nixl_vs_best", f"NIXL path pull beside datadist's {path}, "
                         f"{mib(s.contig_bytes)}", s.contig_bytes, "nixl", nixl_s,
                         f"datadist {path} pull", best, 0.0)
    row.goal, row.met = "reported", True
    return row


__all__ = ["BLOCKS_MODEL", "RawNixl", "SideChannel", "nixl_rows"]
