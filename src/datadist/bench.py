"""The datadist benchmark: every figure beside the limit it is held against (DESIGN.md §6).

Who calls: ``datadist bench`` (cli.py), ``python -m datadist.bench`` and
``benchmarks/run.py``, all through :func:`main`. Blocks for the whole run: a few seconds with
``--quick``, under a minute at full size. Prints a progress bar on stderr, the table on stdout,
and writes JSON with ``--json PATH``.

Theory of operation
-------------------
Machines are shared and noisy; absolute numbers drift by tens of percent from run to run. So
every figure is a ratio to a *limit* measured in the same run, on the same buffers, between the
same two processes. The owner (the prompt side) is a child process started with
multiprocessing's ``spawn``; the puller (the decoder side) is this process. Both sides use only
the public API (``import datadist as llm_datadist``); the limits use ctypes and plain sockets.

Rules this module keeps:

1. Figure and limit repetitions are interleaved, so that drift hits both; each number is the
   median of its repetitions (``--repeat``), after one untimed warm-up.
2. After the warm-up the destination bytes are checked against the pattern the owner wrote:
   a fast pull of wrong bytes must fail the run, not win it.
3. Client buffers are page-aligned on both sides by default. numpy's own large arrays start 16
   bytes past a page, and a copy whose ends differ by 8..256 bytes modulo 4096 runs about 4x
   slower ("4K aliasing"); aligning both ends, as DESIGN.md §6 measures its limits, keeps the
   comparison fair. ``--align numpy`` keeps numpy's placement; the output says which was used.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib.util
import json
import mmap
import multiprocessing as mp
import os
import platform
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

MiB = 1 << 20
OWNER_ID, PULLER_ID = 1, 2
BLOCKS_MODEL, SMALL_MODEL = 0, 1
SMALL_BLOCK = 16 << 10
SMALL_CACHE_BLOCKS = 64
CHUNK = 4 * MiB  # the plain-socket limit's chunk size (DESIGN.md §6)
PAGE = mmap.PAGESIZE
U64 = np.dtype("<u8")
PLAN_GOAL_MS = 5.0


# --------------------------------------------------------------------------------------------
# configuration


@dataclass(frozen=True)
class Sizes:
    """What the run moves. ``blocks * block_bytes`` equals ``contig_bytes`` in both presets,
    so the blocks rows and the contiguous rows share one plain-socket limit."""

    contig_bytes: int
    contig_tensors: int
    block_bytes: int
    blocks: int  # blocks pulled, picked at random from caches of cache_blocks
    small_iters: int
    plan_blocks: int

    @classmethod
    def preset(cls, quick: bool, size_mib: int | None = None) -> Sizes:
        mib = size_mib if size_mib is not None else (8 if quick else 256)
        contig = mib * MiB
        block = 32 << 10
        return cls(
            contig_bytes=contig,
            contig_tensors=4,
            block_bytes=block,
            blocks=max(1, contig // block),
            small_iters=40 if quick else 400,
            plan_blocks=100_000,
        )

    @property
    def at_goal_size(self) -> bool:
        """DESIGN.md §6 states its goals for 256 MiB and 8192 x 32 KiB; smaller runs carry
        fixed costs that the goals do not allow for."""
        return self.contig_bytes >= 256 * MiB and self.blocks >= 8192

    @property
    def tensor_bytes(self) -> int:
        return self.contig_bytes // self.contig_tensors

    @property
    def cache_blocks(self) -> int:
        # a quarter more than are pulled: the picks are a random subset in random order
        return self.blocks + max(1, self.blocks // 4)

    @property
    def pool_bytes(self) -> int:
        # the pool rounds every tensor up to its 64 KiB page
        return self.contig_bytes + (self.contig_tensors + 2) * (1 << 16)


# --------------------------------------------------------------------------------------------
# memory helpers (both processes)


def aligned_array(nbytes: int, align: str) -> np.ndarray:
    """A uint8 numpy array of ``nbytes``: page-aligned (``align="page"``), or where numpy puts
    it (``"numpy"``, 16 bytes past a page for large arrays)."""
    if align == "numpy":
        return np.empty(nbytes, dtype=np.uint8)
    raw = np.empty(nbytes + PAGE, dtype=np.uint8)
    off = (-raw.ctypes.data) % PAGE
    return raw[off : off + nbytes]


def array_at(addr: int, nbytes: int) -> np.ndarray:
    """A uint8 view of memory we own at ``addr`` (pool-allocated caches)."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr))


def fill_pattern(buf: np.ndarray, seed: int) -> None:
    """Word ``i`` of ``buf`` becomes ``i + seed``: every 8 bytes unique per (buffer, place)."""
    words = buf.view(U64)
    words[:] = np.arange(len(words), dtype=U64)
    words += np.uint64(seed)


def _seed(tag: int, tensor: int) -> int:
    return (tag << 48) | (tensor << 40)


def _check_pattern(buf: np.ndarray, seed: int, what: str) -> None:
    words = buf.view(U64)
    step = 8 * MiB
    for start in range(0, len(words), step):
        part = words[start : start + step]
        want = np.arange(start, start + len(part), dtype=U64) + np.uint64(seed)
        if not np.array_equal(part, want):
            raise BenchError(f"{what}: the bytes that arrived are not the owner's")


def _check_blocks(dst: np.ndarray, src_ids: np.ndarray, dst_ids: np.ndarray, block: int,
                  seed: int, what: str) -> None:
    """``dst`` (cache_blocks, block) uint8: block ``dst_ids[i]`` must hold source block
    ``src_ids[i]`` of a cache filled with :func:`fill_pattern`."""
    w = block // 8
    words = dst.view(U64).reshape(len(dst), w)
    col = np.arange(w, dtype=U64)
    for start in range(0, len(src_ids), 1024):
        s = src_ids[start : start + 1024].astype(U64)
        d = dst_ids[start : start + 1024]
        want = s[:, None] * np.uint64(w) + col[None, :] + np.uint64(seed)
        if not np.array_equal(words[d], want):
            raise BenchError(f"{what}: a block that arrived is not the owner's")


class BenchError(RuntimeError):
    """The run could not produce a figure (a peer died, bytes were wrong, a link failed)."""


# --------------------------------------------------------------------------------------------
# the owner: a child process


class _PlainServer:
    """The plain-socket side of the limits, in the owner process.

    A connection's first byte picks its mode: ``E`` echoes 16-byte messages (the round-trip
    limit), ``S`` answers each 8-byte count with that many bytes of the source tensors, sent
    with ``sendall`` in 4 MiB chunks (the TCP throughput limit).
    """

    def __init__(self, tensors: list[np.ndarray]) -> None:
        self.tensors = tensors
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            mode = _recv_exact(conn, 1)
            if mode == b"E":
                buf = bytearray(16)
                while _recv_into_exact(conn, buf):
                    conn.sendall(buf)
            elif mode == b"S":
                while True:
                    head = _recv_exact(conn, 8)
                    if not head:
                        return
                    self._stream(conn, struct.unpack("<Q", head)[0])
        except OSError:
            pass
        finally:
            conn.close()

    def _stream(self, conn: socket.socket, n: int) -> None:
        views = [memoryview(t) for t in self.tensors]
        i = 0
        while n:
            v = views[i % len(views)]
            for off in range(0, min(n, len(v)), CHUNK):
                m = min(CHUNK, n, len(v) - off)
                conn.sendall(v[off : off + m])
                n -= m
            i += 1


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    """``n`` bytes, or b"" if the peer closed before the first byte."""
    buf = bytearray(n)
    return bytes(buf) if _recv_into_exact(conn, buf) else b""


def _recv_into_exact(conn: socket.socket, buf: bytearray | memoryview) -> bool:
    view = memoryview(buf)
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if not n:
            if got:
                raise OSError("peer closed mid-message")
            return False
        got += n
    return True


def _owner_main(conn: Any, sizes_dict: dict[str, int], align: str) -> None:
    """The child: serve the caches through datadist and the plain sockets until told to quit.

    Speaks to the parent over ``conn``: one dict with what it set up (or ``{"error": ...}``),
    then waits for ``"quit"``.
    """
    import datadist as llm_datadist

    try:
        sizes = Sizes(**sizes_dict)
        dd = llm_datadist.LLMDataDist(llm_datadist.LLMRole.PROMPT, OWNER_ID)
        cfg = llm_datadist.LLMConfig()
        cfg.listen_ip_info = "127.0.0.1:0"
        cfg.local_comm_res = ""
        cfg.host_mem_pool_cfg = json.dumps({"memory_size": sizes.pool_bytes})
        dd.init(cfg.generate_options())
        cm = dd.cache_manager
        host = llm_datadist.Placement.HOST
        u8 = llm_datadist.DataType.DT_UINT8

        tensors = [aligned_array(sizes.tensor_bytes, align) for _ in range(sizes.contig_tensors)]
        for t, arr in enumerate(tensors):
            fill_pattern(arr, _seed(1, t))
        contig_desc = llm_datadist.CacheDesc(sizes.contig_tensors, [1, sizes.tensor_bytes], u8,
                                             host)
        contig = cm.register_cache(contig_desc, [a.ctypes.data for a in tensors])

        blocks = aligned_array(sizes.cache_blocks * sizes.block_bytes, align)
        fill_pattern(blocks, _seed(2, 0))
        blocks_desc = llm_datadist.CacheDesc(1, [sizes.cache_blocks, sizes.block_bytes], u8, host)
        cm.register_blocks_cache(blocks_desc, [blocks.ctypes.data],
                                 llm_datadist.BlocksCacheKey(OWNER_ID, BLOCKS_MODEL))

        small = aligned_array(SMALL_CACHE_BLOCKS * SMALL_BLOCK, align)
        fill_pattern(small, _seed(3, 0))
        small_desc = llm_datadist.CacheDesc(1, [SMALL_CACHE_BLOCKS, SMALL_BLOCK], u8, host)
        cm.register_blocks_cache(small_desc, [small.ctypes.data],
                                 llm_datadist.BlocksCacheKey(OWNER_ID, SMALL_MODEL))

        pooled = cm.allocate_cache(contig_desc)
        for t, addr in enumerate(pooled.tensor_addrs):
            fill_pattern(array_at(addr, sizes.tensor_bytes), _seed(4, t))

        server = _PlainServer(tensors)
        listen = dd.listen_address
        assert listen is not None
        conn.send({
            "pid": os.getpid(),
            "port": listen[1],
            "plain_port": server.port,
            "contig_id": contig.cache_id,
            "contig_addrs": [a.ctypes.data for a in tensors],
            "blocks_addr": blocks.ctypes.data,
            "pool_id": pooled.cache_id,
            "pool_addrs": list(pooled.tensor_addrs),
        })
    except BaseException as e:  # the parent reports it; a traceback in a child is lost
        import traceback

        conn.send({"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"})
        return
    try:
        while conn.recv() != "quit":
            pass
    except EOFError:
        pass
    finally:
        dd.finalize()


# --------------------------------------------------------------------------------------------
# limits measured in the puller


class RawCma:
    """process_vm_readv straight through ctypes: the same-host limit. Batches are prepared
    before timing, so a timed call is the system calls and nothing else."""

    def __init__(self, pid: int) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self._fn = libc.process_vm_readv
        self._fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p,
                             ctypes.c_ulong, ctypes.c_ulong]
        self._fn.restype = ctypes.c_ssize_t
        self.pid = pid
        self.iov_max = os.sysconf("SC_IOV_MAX")

    def prepare(self, local: np.ndarray, remote: np.ndarray) -> Callable[[], None]:
        """``local``/``remote``: (n, 2) uint64 iovec arrays of equal span lengths."""
        batches = []
        for s in range(0, len(local), self.iov_max):
            lb = np.ascontiguousarray(local[s : s + self.iov_max], dtype=U64)
            rb = np.ascontiguousarray(remote[s : s + self.iov_max], dtype=U64)
            batches.append((lb, rb, lb.ctypes.data, rb.ctypes.data, len(lb),
                            int(lb[:, 1].sum())))
        fn, pid = self._fn, self.pid

        def run() -> None:
            for _lb, _rb, lp, rp, n, want in batches:
                got = fn(pid, lp, n, rp, n, 0)
                if got != want:
                    err = ctypes.get_errno()
                    raise BenchError(f"process_vm_readv moved {got} of {want} bytes: "
                                     f"{os.strerror(err) if got < 0 else 'short'}")

        return run


def _iov(bases: list[int] | np.ndarray, lengths: list[int] | np.ndarray) -> np.ndarray:
    out = np.empty((len(bases), 2), dtype=U64)
    out[:, 0] = bases
    out[:, 1] = lengths
    return out


class MemcpyLimit:
    """memcpy (ctypes.memmove) between two mmap'd, page-aligned, warm buffers."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._maps = [mmap.mmap(-1, nbytes) for _ in range(2)]
        self._views = [np.frombuffer(m, dtype=np.uint8) for m in self._maps]
        for v in self._views:
            v.fill(1)  # commit the pages: the limit is the warm copy
        self.src, self.dst = (v.ctypes.data for v in self._views)

    def __call__(self) -> None:
        ctypes.memmove(self.dst, self.src, self.nbytes)

    def close(self) -> None:
        self._views.clear()  # drop the buffer exports before unmapping
        for m in self._maps:
            m.close()


class PlainClient:
    """The puller's ends of the plain-socket limits: a stream and an echo connection."""

    def __init__(self, port: int) -> None:
        self.stream = socket.create_connection(("127.0.0.1", port), timeout=60)
        self.echo = socket.create_connection(("127.0.0.1", port), timeout=60)
        for s in (self.stream, self.echo):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.settimeout(None)  # plain blocking calls: a timeout would add a poll per call
        self.stream.sendall(b"S")
        self.echo.sendall(b"E")
        self._ping = bytearray(b"datadist-bench16")
        self._pong = bytearray(16)

    def receive(self, dst: list[np.ndarray], nbytes: int) -> None:
        """Ask for ``nbytes`` and ``recv_into`` them, 4 MiB at a time, across ``dst``."""
        self.stream.sendall(struct.pack("<Q", nbytes))
        views = [memoryview(d) for d in dst]
        i = 0
        while nbytes:
            v = views[i % len(views)]
            end = min(nbytes, len(v))
            got = 0
            while got < end:
                n = self.stream.recv_into(v[got : min(end, got + CHUNK)])
                if not n:
                    raise BenchError("the owner closed the plain stream")
                got += n
            nbytes -= end
            i += 1

    def round_trip(self) -> None:
        self.echo.sendall(self._ping)
        if not _recv_into_exact(self.echo, self._pong):
            raise BenchError("the owner closed the echo connection")

    def close(self) -> None:
        self.stream.close()
        self.echo.close()


# --------------------------------------------------------------------------------------------
# results


@dataclass
class Row:
    """One line of the table: a figure, its limit, and the goal for their ratio."""

    key: str
    title: str
    unit: str  # "GB/s", "us" or "ms"
    figure: float
    limit_title: str = ""
    limit: float | None = None
    goal: str = ""
    met: bool | None = None
    path: str = ""
    figure_samples: list[float] = field(default_factory=list)
    limit_samples: list[float] = field(default_factory=list)
    note: str = ""

    @property
    def ratio(self) -> float | None:
        if self.limit is None or not self.limit:
            return None
        return self.figure / self.limit

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["ratio"] = self.ratio
        return d


def _throughput_row(key: str, title: str, nbytes: int, path: str, fig_s: list[float],
                    limit_title: str, lim_s: list[float], goal: float) -> Row:
    gbs = [nbytes / t / 1e9 for t in fig_s]
    lim = [nbytes / t / 1e9 for t in lim_s]
    row = Row(key, title, "GB/s", float(np.median(gbs)), limit_title, float(np.median(lim)),
              f">= {goal:.2f}x", path=path, figure_samples=gbs, limit_samples=lim)
    row.met = row.ratio is not None and row.ratio >= goal
    return row


class Progress:
    """A one-line progress bar on stderr (redrawn in place on a terminal)."""

    def __init__(self, total: int, stream: Any = None, width: int = 28,
                 enabled: bool = True) -> None:
        self.total = max(1, total)
        self.enabled = enabled
        self.done = 0
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._last = -1
        self.label = ""

    def step(self, label: str | None = None, n: int = 1) -> None:
        self.done = min(self.total, self.done + n)
        if label is not None:
            self.label = label
        self._draw()

    def set_label(self, label: str) -> None:
        self.label = label
        self._draw()

    def _draw(self) -> None:
        if not self.enabled:
            return
        filled = self.width * self.done // self.total
        pct = 100 * self.done // self.total
        if not self.tty and pct // 10 == self._last // 10 and self.done < self.total:
            return  # a log file gets a line per 10 %, not a line per step
        self._last = pct
        bar = "#" * filled + "." * (self.width - filled)
        text = f"[{bar}] {pct:3d}% {self.label}"
        self.stream.write(f"\r{text:<78}" if self.tty else text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty and self.enabled:
            self.stream.write("\n")
            self.stream.flush()


# --------------------------------------------------------------------------------------------
# the puller


def _timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _interleave(a: Callable[[], None], b: Callable[[], None], repeat: int,
                progress: Progress) -> tuple[list[float], list[float]]:
    """Time ``a`` and ``b`` alternately ``repeat`` times each (rule 1)."""
    ta, tb = [], []
    for _ in range(repeat):
        ta.append(_timed(a))
        tb.append(_timed(b))
        progress.step()
    return ta, tb


class Puller:
    """The decoder side: one LLMDataDist, its caches, and a link to the owner.

    Buffers are allocated once by the caller and registered again for each transport, since
    one process holds one initialized LLMDataDist at a time.
    """

    def __init__(self, info: dict[str, Any], sizes: Sizes, bufs: dict[str, Any],
                 transport: str) -> None:
        import datadist as llm_datadist

        self.ll = llm_datadist
        self.info = info
        self.sizes = sizes
        cfg = llm_datadist.LLMConfig()
        cfg.local_comm_res = ""
        cfg.host_mem_pool_cfg = json.dumps({"memory_size": sizes.pool_bytes})
        cfg.sync_kv_timeout = 60000
        cfg.transport = transport
        self.dd = llm_datadist.LLMDataDist(llm_datadist.LLMRole.DECODER, PULLER_ID)
        self.dd.init(cfg.generate_options())
        try:
            self._setup(bufs)
        except BaseException:
            self.dd.finalize()
            raise

    def _setup(self, bufs: dict[str, Any]) -> None:
        ll, s, cm = self.ll, self.sizes, self.dd.cache_manager
        host, u8 = ll.Placement.HOST, ll.DataType.DT_UINT8
        contig_desc = ll.CacheDesc(s.contig_tensors, [1, s.tensor_bytes], u8, host)
        self.contig = cm.register_cache(contig_desc, [a.ctypes.data for a in bufs["contig"]])
        self.blocks = cm.register_blocks_cache(
            ll.CacheDesc(1, [s.cache_blocks, s.block_bytes], u8, host),
            [bufs["blocks"].ctypes.data], ll.BlocksCacheKey(PULLER_ID, BLOCKS_MODEL))
        self.small = cm.register_blocks_cache(
            ll.CacheDesc(1, [SMALL_CACHE_BLOCKS, SMALL_BLOCK], u8, host),
            [bufs["small"].ctypes.data], ll.BlocksCacheKey(PULLER_ID, SMALL_MODEL))
        self.pooled = cm.allocate_cache(contig_desc)
        cluster = ll.LLMClusterInfo()
        cluster.remote_cluster_id = OWNER_ID
        cluster.append_local_ip_info("127.0.0.1", 0)
        cluster.append_remote_ip_info("127.0.0.1", self.info["port"])
        code, _ = self.dd.link_clusters([cluster], 10000)
        if code != ll.LLMStatusCode.LLM_SUCCESS:
            raise BenchError(f"link to the owner failed: {code}")
        self.path = self.dd.engine.get_link(OWNER_ID).path_name

    def mechanism(self) -> str:
        """The link's path, and on the same host what moved the last request (shm or cma)."""
        path = self.dd.engine.get_link(OWNER_ID).path
        last = getattr(path, "last", "")
        name = path.caps.name
        return f"{name}/{last}" if last and last != name else name

    def pull_contig(self) -> None:
        key = self.ll.CacheKeyByIdAndIndex(OWNER_ID, self.info["contig_id"], 0)
        self.dd.cache_manager.pull_cache(key, self.contig, 0)

    def pull_pool(self) -> None:
        key = self.ll.CacheKeyByIdAndIndex(OWNER_ID, self.info["pool_id"], 0)
        self.dd.cache_manager.pull_cache(key, self.pooled, 0)

    def pull_blocks(self, src: list[int], dst: list[int]) -> None:
        key = self.ll.BlocksCacheKey(OWNER_ID, BLOCKS_MODEL)
        self.dd.cache_manager.pull_blocks(key, self.blocks, src, dst)

    def pull_small(self, src: int, dst: int) -> None:
        key = self.ll.BlocksCacheKey(OWNER_ID, SMALL_MODEL)
        self.dd.cache_manager.pull_blocks(key, self.small, [src], [dst])

    def close(self) -> None:
        self.dd.finalize()


@dataclass
class Context:
    """Everything one run shares: sizes, the owner's answer, the puller's buffers."""

    sizes: Sizes
    repeat: int
    info: dict[str, Any]
    bufs: dict[str, Any]
    src_ids: np.ndarray
    dst_ids: np.ndarray
    progress: Progress
    plain: PlainClient

    @property
    def src_list(self) -> list[int]:
        return self.src_ids.tolist()

    @property
    def dst_list(self) -> list[int]:
        return self.dst_ids.tolist()


def _check_contig(tensors: list[np.ndarray], tag: int, what: str) -> None:
    for t, arr in enumerate(tensors):
        _check_pattern(arr, _seed(tag, t), what)


def _pool_views(p: Puller) -> list[np.ndarray]:
    return [array_at(a, p.sizes.tensor_bytes) for a in p.pooled.tensor_addrs]


def _warm_and_check(ctx: Context, p: Puller, label: str) -> None:
    """Rule 2: one untimed pull of each kind into zeroed memory, then check the bytes."""
    ctx.progress.set_label(f"{label}: warm-up and check")
    for arr in ctx.bufs["contig"]:
        arr.fill(0)
    p.pull_contig()
    _check_contig(ctx.bufs["contig"], 1, f"{label} pull")
    ctx.bufs["blocks"].fill(0)
    p.pull_blocks(ctx.src_list, ctx.dst_list)
    _check_blocks(ctx.bufs["blocks"].reshape(ctx.sizes.cache_blocks, -1), ctx.src_ids,
                  ctx.dst_ids, ctx.sizes.block_bytes, _seed(2, 0), f"{label} pull_blocks")
    for v in _pool_views(p):
        v.fill(0)
    p.pull_pool()
    _check_contig(_pool_views(p), 4, f"{label} pull of a pool-allocated cache")
    ctx.bufs["small"].fill(0)
    p.pull_small(5, 9)
    small = ctx.bufs["small"].reshape(SMALL_CACHE_BLOCKS, -1)
    _check_blocks(small, np.array([5]), np.array([9]), SMALL_BLOCK, _seed(3, 0),
                  f"{label} small pull")


def _latency_row(ctx: Context, p: Puller, key: str, title: str) -> Row:
    """p50 of one 16 KiB block pulls, and of 16-byte plain round trips, in alternating runs.

    Runs, not single alternating calls: a same-host pull ends with a one-way Release that the
    owner handles after the pull returned, and a round trip measured right then would wait for
    the owner's GIL and flatter the ratio.
    """
    ctx.progress.set_label(title)
    pulls, rtts = [], []
    per_step = max(1, ctx.sizes.small_iters // ctx.repeat)
    for i in range(10):  # warm both ends' code paths
        p.pull_small(i % SMALL_CACHE_BLOCKS, (i * 7) % SMALL_CACHE_BLOCKS)
        ctx.plain.round_trip()
    for _ in range(ctx.repeat):
        for i in range(per_step):
            t0 = time.perf_counter()
            p.pull_small(i % SMALL_CACHE_BLOCKS, (i * 7) % SMALL_CACHE_BLOCKS)
            pulls.append((time.perf_counter() - t0) * 1e6)
        time.sleep(0.001)  # the owner finishes the last Release
        for _ in range(per_step):
            t0 = time.perf_counter()
            ctx.plain.round_trip()
            rtts.append((time.perf_counter() - t0) * 1e6)
        ctx.progress.step()
    row = Row(key, title, "us", float(np.median(pulls)),
              "16-byte request/reply on a plain socket, p50", float(np.median(rtts)),
              "<= 2.00x", path=p.mechanism(), figure_samples=pulls, limit_samples=rtts)
    row.met = row.ratio is not None and row.ratio <= 2.0
    return row


def same_host_rows(ctx: Context) -> list[Row]:
    s, info = ctx.sizes, ctx.info
    p = Puller(info, s, ctx.bufs, "auto")
    rows: list[Row] = []
    try:
        _warm_and_check(ctx, p, "same-host")
        cma = RawCma(info["pid"])
        lengths = [s.tensor_bytes] * s.contig_tensors
        local = _iov([a.ctypes.data for a in ctx.bufs["contig"]], lengths)
        remote = _iov(info["contig_addrs"], lengths)
        raw = cma.prepare(local, remote)
        raw()  # warm
        ctx.progress.set_label("same-host pull, client memory")
        f, lim = _interleave(p.pull_contig, raw, ctx.repeat, ctx.progress)
        rows.append(_throughput_row(
            "same_host_pull", f"same-host pull, {_mib(s.contig_bytes)}, client memory",
            s.contig_bytes, p.mechanism(), f, "raw process_vm_readv, same bytes", lim, 0.9))

        bb = np.uint64(s.block_bytes)
        local_b = _iov(ctx.bufs["blocks"].ctypes.data + ctx.dst_ids.astype(U64) * bb,
                       np.full(s.blocks, bb, dtype=U64))
        remote_b = _iov(info["blocks_addr"] + ctx.src_ids.astype(U64) * bb,
                        np.full(s.blocks, bb, dtype=U64))
        raw_b = cma.prepare(local_b, remote_b)
        raw_b()
        src, dst = ctx.src_list, ctx.dst_list
        ctx.progress.set_label("same-host pull_blocks, client memory")
        f, lim = _interleave(lambda: p.pull_blocks(src, dst), raw_b, ctx.repeat, ctx.progress)
        rows.append(_throughput_row(
            "same_host_pull_blocks",
            f"same-host pull_blocks, {s.blocks} x {s.block_bytes >> 10} KiB, client memory",
            s.blocks * s.block_bytes, p.mechanism(), f, "raw process_vm_readv, same iovecs", lim,
            0.9))

        memcpy = MemcpyLimit(s.contig_bytes)
        try:
            memcpy()
            ctx.progress.set_label("same-host pull, pool-allocated")
            f, lim = _interleave(p.pull_pool, memcpy, ctx.repeat, ctx.progress)
        finally:
            memcpy.close()
        rows.append(_throughput_row(
            "same_host_pull_pool", f"same-host pull, {_mib(s.contig_bytes)}, both caches "
            "allocated by datadist", s.contig_bytes, p.mechanism(), f,
            "memcpy, page-aligned, warm", lim, 0.85))

        rows.append(_latency_row(ctx, p, "same_host_small",
                                 f"small pull, one {SMALL_BLOCK >> 10} KiB block, same host"))
    finally:
        p.close()
    return rows


def tcp_rows(ctx: Context) -> list[Row]:
    s, info = ctx.sizes, ctx.info
    p = Puller(info, s, ctx.bufs, "tcp")
    rows: list[Row] = []
    try:
        if p.path != "tcp":
            raise BenchError(f"transport tcp was forced but the link uses {p.path}")
        _warm_and_check(ctx, p, "tcp")
        contig = ctx.bufs["contig"]

        def plain(n: int) -> Callable[[], None]:
            return lambda: ctx.plain.receive(contig, n)

        plain(s.contig_bytes)()  # warm
        ctx.progress.set_label("TCP pull")
        f, lim = _interleave(p.pull_contig, plain(s.contig_bytes), ctx.repeat, ctx.progress)
        rows.append(_throughput_row(
            "tcp_pull", f"TCP pull, {_mib(s.contig_bytes)}", s.contig_bytes, p.mechanism(), f,
            "plain socket sendall/recv_into, 4 MiB chunks", lim, 0.9))

        nbytes = s.blocks * s.block_bytes
        src, dst = ctx.src_list, ctx.dst_list
        ctx.progress.set_label("TCP pull_blocks")
        f, lim = _interleave(lambda: p.pull_blocks(src, dst), plain(nbytes), ctx.repeat,
                             ctx.progress)
        rows.append(_throughput_row(
            "tcp_pull_blocks", f"TCP pull_blocks, {s.blocks} x {s.block_bytes >> 10} KiB",
            nbytes, p.mechanism(), f, "plain socket sendall/recv_into, same bytes", lim, 0.8))

        rows.append(_latency_row(ctx, p, "tcp_small",
                                 f"small pull, one {SMALL_BLOCK >> 10} KiB block, TCP"))
    finally:
        p.close()
    return rows


def plan_rows(sizes: Sizes, repeat: int, progress: Progress) -> list[Row]:
    """Planning cost: ``layout.plan_blocks`` from numpy arrays, and from Python lists through
    the api's ``int_list`` conversion (what ``pull_blocks`` does with a client's lists)."""
    from datadist.api.checks import int_list
    from datadist.core import layout

    n = sizes.plan_blocks
    rng = np.random.default_rng(7)
    units = 2 * n
    geo = layout.Geometry(2, units * sizes.block_bytes, units, True)
    src = rng.permutation(units)[:n].astype(np.int64)
    dst = rng.permutation(units)[:n].astype(np.int64)
    src_l, dst_l = src.tolist(), dst.tolist()

    def from_numpy() -> None:
        tensors = layout.layer_tensor_indices(geo.num_tensors, None, None, 2)
        layout.plan_blocks(geo, src, dst, tensors)

    def from_lists() -> None:
        s = int_list("src_blocks", src_l, "uint64", types=(list, tuple, np.ndarray))
        d = int_list("dst_blocks", dst_l, "uint64", types=(list, tuple, np.ndarray))
        tensors = layout.layer_tensor_indices(geo.num_tensors, None, None, 2)
        layout.plan_blocks(geo, s, d, tensors)

    rows = []
    for key, title, fn in (
        ("plan_numpy", f"plan {n // 1000}k blocks, numpy arrays", from_numpy),
        ("plan_lists", f"plan {n // 1000}k blocks, Python lists (int_list)", from_lists),
    ):
        progress.set_label(title)
        fn()
        samples = []
        for _ in range(repeat):
            samples.append(_timed(fn) * 1e3)
            progress.step()
        fig = float(np.median(samples))
        rows.append(Row(key, title, "ms", fig, goal=f"< {PLAN_GOAL_MS:g} ms",
                        met=fig < PLAN_GOAL_MS, figure_samples=samples))
    return rows


def peer_lines() -> list[str]:
    """NIXL and Mooncake are only mentioned when already importable; never installed here."""
    lines = []
    for mod, name in (("nixl", "NIXL"), ("mooncake", "Mooncake")):
        if importlib.util.find_spec(mod) is None:
            lines.append(f"{name}: skipped, python module {mod!r} is not importable")
        else:
            lines.append(f"{name}: importable, but this benchmark does not drive it; "
                         "DESIGN.md §6 lists figures measured by hand")
    return lines


# --------------------------------------------------------------------------------------------
# driving a run


def _mib(n: int) -> str:
    return f"{n / MiB:g} MiB"


def _alignment_text(bufs: dict[str, Any], info: dict[str, Any], align: str) -> str:
    mine = sorted({a.ctypes.data % PAGE for a in bufs["contig"]} | {bufs["blocks"].ctypes.data
                                                                     % PAGE})
    theirs = sorted({a % PAGE for a in info["contig_addrs"]} | {info["blocks_addr"] % PAGE})
    how = "page-aligned" if align == "page" else "numpy's own placement"
    return (f"client buffers: {how} (address mod 4096: puller {mine}, owner {theirs}); "
            "pool caches are page-aligned by datadist")


def _start_owner(sizes: Sizes, align: str) -> tuple[Any, Any, dict[str, Any]]:
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_owner_main, args=(there, asdict(sizes), align),
                       name="datadist-bench-owner", daemon=True)
    proc.start()
    there.close()
    deadline = time.monotonic() + 120
    while not here.poll(0.2):
        if not proc.is_alive() or time.monotonic() > deadline:
            proc.kill()
            raise BenchError(f"the owner process did not start (exit code {proc.exitcode})")
    try:
        info = here.recv()
    except EOFError:
        proc.join(5)
        raise BenchError(f"the owner process died (exit code {proc.exitcode})") from None
    if "error" in info:
        proc.join(5)
        raise BenchError(f"the owner process failed:\n{info['error']}")
    return proc, here, info


def _stop_owner(proc: Any, conn: Any) -> None:
    with contextlib.suppress(OSError):  # the owner may be gone already
        conn.send("quit")
    proc.join(10)
    if proc.is_alive():
        proc.kill()
        proc.join(5)
    conn.close()


GROUPS = {"same-host": 4, "tcp": 3, "plan": 2}  # row groups and their number of rows


def timed_steps(repeat: int, groups: tuple[str, ...] = tuple(GROUPS)) -> int:
    """Progress steps of a run: every row of every group takes ``repeat`` steps."""
    return repeat * sum(GROUPS[g] for g in groups)


def run(sizes: Sizes, repeat: int, align: str = "page", peers: bool = False,
        progress: Progress | None = None,
        groups: tuple[str, ...] = tuple(GROUPS)) -> dict[str, Any]:
    """One run of the row ``groups``; returns the JSON-ready result. Raises BenchError if a
    row cannot run."""
    progress = progress or Progress(timed_steps(repeat, groups))
    progress.set_label("starting the owner process")
    t_start = time.monotonic()
    proc, conn, info = _start_owner(sizes, align)
    plain = None
    try:
        bufs = {
            "contig": [aligned_array(sizes.tensor_bytes, align)
                       for _ in range(sizes.contig_tensors)],
            "blocks": aligned_array(sizes.cache_blocks * sizes.block_bytes, align),
            "small": aligned_array(SMALL_CACHE_BLOCKS * SMALL_BLOCK, align),
        }
        rng = np.random.default_rng(2024)
        src_ids = rng.permutation(sizes.cache_blocks)[: sizes.blocks]
        dst_ids = rng.permutation(sizes.cache_blocks)[: sizes.blocks]
        plain = PlainClient(info["plain_port"])
        ctx = Context(sizes, repeat, info, bufs, src_ids, dst_ids, progress, plain)
        rows = same_host_rows(ctx) if "same-host" in groups else []
        rows += tcp_rows(ctx) if "tcp" in groups else []
        alignment = _alignment_text(bufs, info, align)
    finally:
        if plain is not None:
            plain.close()
        _stop_owner(proc, conn)
    rows += plan_rows(sizes, repeat, progress) if "plan" in groups else []
    progress.close()
    return {
        "datadist_version": _version(),
        "sizes": asdict(sizes),
        "repeat": repeat,
        "alignment": alignment,
        "host": {"cpus": os.cpu_count(), "kernel": platform.release(),
                 "python": platform.python_version(), "numpy": np.__version__},
        "seconds": round(time.monotonic() - t_start, 2),
        "at_goal_size": sizes.at_goal_size,
        "rows": [r.to_json() for r in rows],
        "peers": peer_lines() if peers else [],
    }


def _version() -> str:
    from datadist import __version__

    return __version__


def format_table(result: dict[str, Any]) -> str:
    """The human-readable table of a result from :func:`run`."""
    head = ("what", "path", "figure", "limit", "ratio", "goal", "")
    lines = []
    for r in result["rows"]:
        unit = r["unit"]
        fig = f"{r['figure']:.2f} {unit}" if unit != "us" else f"{r['figure']:.0f} us p50"
        if r["limit"] is None:
            lim, ratio = "-", "-"
        else:
            lim = (f"{r['limit']:.2f} {unit}" if unit != "us" else f"{r['limit']:.0f} us")
            lim = f"{lim} ({r['limit_title']})"
            ratio = f"{r['ratio']:.2f}x"
        ok = "ok" if r["met"] else "MISSED"
        if not result["at_goal_size"] and r["unit"] == "GB/s":
            ok = f"({ok.lower()})"  # goals are for full size: see the note below
        lines.append((r["title"], r["path"] or "-", fig, lim, ratio, r["goal"], ok))
    widths = [max(len(str(x[i])) for x in [head, *lines]) for i in range(len(head))]
    out = [f"datadist bench: median of {result['repeat']}, {result['seconds']} s; "
           f"{result['alignment']}"]
    for i, line in enumerate([head, *lines]):
        out.append("  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)).rstrip())
        if i == 0:
            out.append("  ".join("-" * w for w in widths))
    if not result["at_goal_size"]:
        out.append("note: transfers smaller than 256 MiB / 8192 blocks: fixed costs weigh more "
                   "than the goals allow for; run without --quick/--size to judge them")
    out.extend(result["peers"])
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """``datadist bench``: run, print the table, optionally write JSON. Returns the exit code:
    0 when every row ran (goals missed or not), 1 when the run failed."""
    ap = argparse.ArgumentParser(prog="datadist bench", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="8 MiB transfers and fewer small pulls (a smoke run, seconds)")
    ap.add_argument("--size", type=int, metavar="MiB",
                    help="bytes per transfer in MiB (default 256, or 8 with --quick)")
    ap.add_argument("--repeat", type=int, default=None, metavar="N",
                    help="repetitions per figure, the median is reported (default 7, quick 3)")
    ap.add_argument("--json", metavar="PATH", help="also write the result as JSON to PATH")
    ap.add_argument("--align", choices=("page", "numpy"), default="page",
                    help="placement of client buffers (default page; see DESIGN.md §6)")
    ap.add_argument("--peers", action="store_true",
                    help="also report NIXL / Mooncake, if they are already importable")
    ap.add_argument("--only", metavar="GROUPS", default=",".join(GROUPS),
                    help=f"comma-separated row groups to run, of {','.join(GROUPS)} (default all)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    args = ap.parse_args(argv)
    repeat = args.repeat if args.repeat is not None else (3 if args.quick else 7)
    if repeat < 1:
        ap.error("--repeat must be >= 1")
    if args.size is not None and args.size < 1:
        ap.error("--size must be >= 1")
    groups = tuple(g for g in args.only.split(",") if g)
    unknown = [g for g in groups if g not in GROUPS]
    if unknown or not groups:
        ap.error(f"--only takes groups of {','.join(GROUPS)}, got {args.only!r}")
    sizes = Sizes.preset(args.quick, args.size)
    progress = Progress(timed_steps(repeat, groups), enabled=not args.no_progress)
    try:
        result = run(sizes, repeat, args.align, args.peers, progress, groups)
    except BenchError as e:
        progress.close()
        print(f"datadist bench failed: {e}", file=sys.stderr)
        return 1
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
