"""The benchmark's shared harness: what a run moves (:class:`Sizes`), the byte patterns
that prove a transfer moved the owner's bytes, rows and their ratios, the progress bar, and
the alternation of figure and limit repetitions (rule 1 of :mod:`datadist.bench`).

Used by every other module of the package; imports nothing of datadist's.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

MiB = 1 << 20
OWNER_ID, PULLER_ID = 1, 2
# BlocksCacheKey model ids of the run's caches (bench/tcp.py uses 2, bench/pools.py 3)
BLOCKS_MODEL, SMALL_MODEL, LAYERS_MODEL = 0, 1, 4
# The layer-wise rows: a paged cache of LAYERS layers (K and V tensors each) of LAYER_BLOCKS
# blocks of 32 KiB: one layer's pull moves 1 MiB, one pull of every layer 32 MiB.
LAYERS, LAYER_BLOCKS, LAYER_BLOCK = 32, 16, 32 << 10
SMALL_BLOCK = 16 << 10
SMALL_CACHE_BLOCKS = 64
CHUNK = 4 * MiB  # the plain-socket limit's chunk size (docs/performance.md)
PAGE = mmap.PAGESIZE
U64 = np.dtype("<u8")
PLAN_GOAL_MS = 5.0


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
        """docs/performance.md states its goals for 256 MiB and 8192 x 32 KiB; smaller runs carry
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


def pattern_seed(tag: int, tensor: int) -> int:
    return (tag << 48) | (tensor << 40)


def check_pattern(buf: np.ndarray, seed: int, what: str) -> None:
    words = buf.view(U64)
    step = 8 * MiB
    for start in range(0, len(words), step):
        part = words[start : start + step]
        want = np.arange(start, start + len(part), dtype=U64) + np.uint64(seed)
        if not np.array_equal(part, want):
            raise BenchError(f"{what}: the bytes that arrived are not the owner's")


def check_blocks(dst: np.ndarray, src_ids: np.ndarray, dst_ids: np.ndarray, block: int,
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


def at_most(row: Row, times: float | None) -> Row:
    """Judge a time row (a latency: lower is better) against its goal: met when its ratio to
    its limit is at most ``times``; ``None``: no goal, the row is "reported" (met). Returns
    ``row``. Who calls: the row modules, once a row has its figure and limit."""
    if times is None:
        row.goal, row.met = "reported", True
    else:
        row.goal = f"<= {times:.2f}x"
        row.met = row.ratio is not None and row.ratio <= times
    return row


def throughput_row(key: str, title: str, nbytes: int, path: str, fig_s: list[float],
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


def timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def interleave(a: Callable[[], None], b: Callable[[], None], repeat: int,
                progress: Progress) -> tuple[list[float], list[float]]:
    """Time ``a`` and ``b`` alternately ``repeat`` times each (rule 1)."""
    ta, tb = [], []
    for _ in range(repeat):
        ta.append(timed(a))
        tb.append(timed(b))
        progress.step()
    return ta, tb


def warm_both(sides: list[tuple[str, Callable[[], None]]], reset: Callable[[], None],
              check: Callable[[str], None]) -> None:
    """Rules 1 and 2 for a figure and its limit (or a peer): every side, in turn, gets the same
    untimed warm-up into the same zeroed buffers (``reset``), and what it moved is checked
    (``check(label)`` raises BenchError on a wrong byte) before anything is timed. A side that
    moved wrong bytes fails the run instead of winning it; a side that was never warmed cannot
    pay its first-use costs (connection set-up, registrations, page faults) inside the timing.

    Who calls: the row modules, before :func:`interleave`. Blocks for one transfer per side."""
    for label, run in sides:
        reset()
        run()
        check(label)


class PythonWork:
    """A thread of pure-Python work (an integer hash loop, no C calls that release the GIL),
    as a serving engine's scheduler or tokenizer would run beside datadist: the busy rows
    (bench/busy.py) count how much of it a pulling datadist leaves, and how much it slows
    the pulls. :meth:`start` returns at once; :meth:`stop` blocks until the thread ended and
    returns (rounds done, seconds). Used in the puller and in the owner process."""

    ROUND = 1000  # loop steps per counted round

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._rounds = 0
        self._t0 = 0.0
        self._thread = threading.Thread(target=self._run, name="bench-python-work",
                                        daemon=True)

    def start(self) -> PythonWork:
        self._t0 = time.perf_counter()
        self._thread.start()
        return self

    def _run(self) -> None:
        n, acc, stop = 0, 0, self._stop
        while not stop.is_set():
            for i in range(self.ROUND):
                acc = (acc * 31 + i) & 0xFFFFFFFF
            n += 1
        self._rounds = n

    def stop(self) -> tuple[int, float]:
        self._stop.set()
        self._thread.join()
        return self._rounds, time.perf_counter() - self._t0


def recv_exact(conn: socket.socket, n: int) -> bytes:
    """``n`` bytes, or b"" if the peer closed before the first byte."""
    buf = bytearray(n)
    return bytes(buf) if recv_into_exact(conn, buf) else b""


def recv_into_exact(conn: socket.socket, buf: bytearray | memoryview) -> bool:
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


def mib(n: int) -> str:
    return f"{n / MiB:g} MiB"


@contextlib.contextmanager
def one_cpu(*pids: int) -> Iterator[None]:
    """Every thread of ``pids`` on one CPU for the duration (their affinity restored after).

    For the latency rows: two processes on two CPUs pay a cross-CPU wake-up per message, which
    from an idle CPU costs 60-80 us on the development machine and made the round-trip limit
    bimodal (7 us or 60-80 us, by where the scheduler put the owner); on one CPU a round trip
    is two context switches, the tightest limit. Where affinity cannot be set, nothing is."""
    cpu = min(os.sched_getaffinity(0))
    saved: list[tuple[int, set[int]]] = []
    try:
        for pid in pids:
            try:
                tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
            except OSError:
                continue
            for tid in tids:
                try:
                    saved.append((tid, os.sched_getaffinity(tid)))
                    os.sched_setaffinity(tid, {cpu})
                except OSError:
                    pass  # a thread that ended, or one we may not move
        yield
    finally:
        for tid, cpus in saved:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, cpus)
