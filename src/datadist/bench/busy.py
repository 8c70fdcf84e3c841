"""Rows of the busy interpreter: datadist beside a thread of pure-Python work (issue 27).

Serving engines run Python beside their transfers (a scheduler, a tokenizer, sampling), and
a Python datadist shares the interpreter's lock with it. For each side (the owner, then
separately the puller) and each path (same host, TCP), runs of 16 KiB small pulls are made
three ways, alternating, ``--repeat`` times:

- idle: nothing else runs (the limit of the latency rows);
- busy: a thread of :class:`.harness.PythonWork` runs in that side's process meanwhile (the
  figure: pull p50 and p99 against the idle run's);
- alone: the same thread, as long as the busy run took, with no pulls (the limit of the work
  row: rounds/s with pulls against rounds/s alone, i.e. the Python work datadist costs).

On the puller's side two more runs follow, as a serving engine's step loop would drive its
transfers (issue "One engine, native"): the busy thread itself issues each pull
(``pull_blocks_async``) and checks ``done()`` between its rounds of Python work (a round of
:data:`POLL_STEPS` loop steps, a few us, so the figure is the pull's own time and not the
poll's interval), issuing the next once it is done: the "async" rows, pull p50 and p99
against the idle blocking pull's, and the loop's work against the same loop with its polls
replaced by a clock check ("async alone").

Each timed run (idle, busy, the busy thread's own pulls) starts after :data:`SETTLE_S` of the
same pulls untimed: the scheduler takes a few tens of milliseconds to place the threads again
after what ran before changed (a thread started, or one that slept now spins), and in that
while pulls paid a wake-up on a CPU another thread held (a 4 ms tick each). Before, every run
of every build (docs/performance.md, "Round 12") began with 10-14 such pulls of the busy
thread's own, 96% of its pulls over 1 ms: about 36 a run of 3, so that its p99 was milliseconds
whenever the run made fewer than ~3600 pulls, and microseconds otherwise.

The processes are not pinned to a CPU here (unlike the other latency rows): the busy thread
holds a core, as in a server. The issue's goals are judged (:data:`GOALS`): Python work in
the owner, TCP: p50 <= 1.3x idle, p99 <= 3x; the busy thread's own pulls: p50 <= 1.3x the
idle blocking pull's, on both paths. Every other row is reported, with no goal.

Who calls: the bench runner (``--only busy``). Blocks while it runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from datadist.bench.harness import (
    SMALL_BLOCK,
    SMALL_CACHE_BLOCKS,
    BenchError,
    PythonWork,
    Row,
    at_most,
    check_blocks,
    pattern_seed,
)
from datadist.bench.puller import Context, Puller

SIDES = ("owner", "puller")
PATHS = (("auto", "same host"), ("tcp", "TCP"))
# p50, p99 and work rows per side and path, and the same three for the busy thread's own
# asynchronous pulls per path; a run makes as many progress steps (runner.GROUPS)
ROWS = len(SIDES) * len(PATHS) * 3 + len(PATHS) * 3
MIN_RUN = 0.1  # seconds a run of pulls lasts at least
SETTLE_S = 0.1  # seconds of untimed pulls before each timed run (the scheduler's settling)
ASYNC_MAX = 1.0  # seconds a run of the busy thread's own pulls lasts at most (a slow engine)
POLL_STEPS = 20  # loop steps of Python work between two done() checks of the async rows
NOTE = "not pinned to a CPU"
ASYNC_NOTE = (f"issued by the busy thread (pull_blocks_async), done() checked every "
              f"{POLL_STEPS} steps of its Python work; not pinned to a CPU")
# The issue's goals ("One engine, native"), the most a row's figure may be in its limits
# (idle pulls); every other busy row is reported.
GOALS = {"busy_owner_tcp_p50": 1.3, "busy_owner_tcp_p99": 3.0,
         "busy_async_same_host_p50": 1.3, "busy_async_tcp_p50": 1.3}


def busy_rows(ctx: Context) -> list[Row]:
    rows: list[Row] = []
    for transport, where in PATHS:
        p = ctx.puller(transport)
        try:
            _check_small(ctx, p, where)
            _check_small(ctx, p, where, asynchronous=True)
            for side in SIDES:
                rows += _side_rows(ctx, p, side, where, transport)
        finally:
            p.close()
    return rows


def _check_small(ctx: Context, p: Puller, where: str, asynchronous: bool = False) -> None:
    """Rule 2: one small pull (``asynchronous``: issued, then waited for) into zeroed memory,
    checked, before anything is timed."""
    small = ctx.bufs["small"]
    small.fill(0)
    if asynchronous:
        p.pull_small_async(5, 9).wait(60)
    else:
        p.pull_small(5, 9)
    how = "pull_blocks_async" if asynchronous else "small pull"
    check_blocks(small.reshape(SMALL_CACHE_BLOCKS, -1), np.array([5]), np.array([9]),
                 SMALL_BLOCK, pattern_seed(3, 0), f"{where} {how} (busy rows)")


def polled_pulls(issue: Callable[[int], Any], count: int, first: int = 0,
                 max_s: float = ASYNC_MAX) -> tuple[list[float], int, float]:
    """The busy thread's own pulls: ``issue(i)`` (returning a TransferHandle) for ``count``
    pulls (i from ``first``) or until ``max_s`` seconds passed (at least one pull), each
    polled with ``done()`` between rounds of :data:`POLL_STEPS` steps of Python work in this
    thread, the next issued once it is done. Returns (latencies in us, from the issuing call
    until done() said so; loop steps done; seconds). Raises BenchError if a pull failed.
    Who calls: :func:`_side_rows`, in the puller's main thread (which is the busy one)."""
    lat: list[float] = []
    steps, acc = 0, 0
    t_start = time.perf_counter()
    end = t_start + max_s
    for i in range(first, first + count):
        t0 = time.perf_counter()
        handle = issue(i)
        while True:
            for j in range(POLL_STEPS):
                acc = (acc * 31 + j) & 0xFFFFFFFF
            steps += POLL_STEPS
            if handle.done():
                break
        lat.append((time.perf_counter() - t0) * 1e6)
        if handle.exception() is not None:
            raise BenchError(f"a pull_blocks_async failed: {handle.exception()}")
        if time.perf_counter() > end:
            break
    return lat, steps, time.perf_counter() - t_start


def polled_work_alone(seconds: float) -> int:
    """The loop of :func:`polled_pulls` with no pulls, for ``seconds``: its ``done()`` check
    becomes a clock check. Returns the loop steps done (the async work row's limit)."""
    steps, acc = 0, 0
    end = time.perf_counter() + seconds
    while True:
        for j in range(POLL_STEPS):
            acc = (acc * 31 + j) & 0xFFFFFFFF
        steps += POLL_STEPS
        if time.perf_counter() >= end:
            return steps


def _side_rows(ctx: Context, p: Puller, side: str, where: str, transport: str) -> list[Row]:
    conn = ctx.owner  # the pipe to the owner process (owner.py's command loop)
    if side == "owner" and conn is None:
        raise BenchError("the busy rows need the pipe to the owner process")

    def start() -> Callable[[], tuple[int, float]]:
        if side == "puller":
            return PythonWork().start().stop
        conn.send("busy-start")

        def stop() -> tuple[int, float]:
            conn.send("busy-stop")
            rounds, secs = conn.recv()
            return int(rounds), float(secs)
        return stop

    n = max(5, ctx.sizes.small_iters // ctx.repeat)
    idle: list[float] = []
    busy: list[float] = []
    with_pulls: list[float] = []
    alone: list[float] = []
    k = 0

    def pulls(out: list[float], count: int = 0) -> int:
        """``count`` pulls; with 0, at least ``n`` for at least MIN_RUN seconds (the warm-up,
        which sets the count of the timed runs: long enough for the work to be counted)."""
        nonlocal k
        end = time.perf_counter() + MIN_RUN
        done = 0
        while (done < count) if count else (done < n or time.perf_counter() < end):
            t0 = time.perf_counter()
            p.pull_small(k % SMALL_CACHE_BLOCKS, (k * 7) % SMALL_CACHE_BLOCKS)
            out.append((time.perf_counter() - t0) * 1e6)
            k += 1
            done += 1
        return done

    polled: list[float] = []  # the busy thread's own pulls (the puller's side only)
    polled_work: list[float] = []
    polled_alone: list[float] = []

    def issue(i: int) -> Any:
        return p.pull_small_async(i % SMALL_CACHE_BLOCKS, (i * 7) % SMALL_CACHE_BLOCKS)

    def settle() -> None:
        """Untimed pulls for SETTLE_S, before a timed run (the module's docstring)."""
        nonlocal k
        end = time.perf_counter() + SETTLE_S
        while time.perf_counter() < end:
            p.pull_small(k % SMALL_CACHE_BLOCKS, (k * 7) % SMALL_CACHE_BLOCKS)
            k += 1

    ctx.progress.set_label(f"busy {side}, {where}")
    m = pulls([])  # warm: one untimed run
    if side == "puller":
        polled_pulls(issue, m, k)  # warm the asynchronous path too
    for _ in range(ctx.repeat):
        settle()
        pulls(idle, m)
        ctx.progress.step()
        stop = start()
        settle()
        pulls(busy, m)
        rounds, secs = stop()
        with_pulls.append(rounds / secs)
        ctx.progress.step()
        stop = start()
        time.sleep(secs)
        rounds, secs = stop()
        alone.append(rounds / secs)
        ctx.progress.step()
        if side == "puller":
            k += len(polled_pulls(issue, m, k, SETTLE_S)[0])  # settle, untimed
            lat, steps, secs = polled_pulls(issue, m, k)
            k += len(lat)
            polled += lat
            polled_work.append(steps / PythonWork.ROUND / secs)
            ctx.progress.step(n=2)
            polled_alone.append(polled_work_alone(secs) / PythonWork.ROUND / secs)
            ctx.progress.step()

    path = "same_host" if transport == "auto" else "tcp"
    rows = latency_rows(f"busy_{side}_{path}", f"small pull, 16 KiB, {where}, Python work in "
                        f"the {side}", busy, idle, "the same pulls, nothing beside", p.mechanism(),
                        NOTE)
    rows.append(Row(f"busy_{side}_{path}_work",
                    f"Python work kept in the {side} while it pulls, {where}",
                    "kround/s", float(np.median(with_pulls)) / 1e3,
                    "the same work alone, kround/s", float(np.median(alone)) / 1e3,
                    "reported", True, p.mechanism(),
                    figure_samples=[x / 1e3 for x in with_pulls],
                    limit_samples=[x / 1e3 for x in alone], note=NOTE))
    if side == "puller":
        rows += latency_rows(f"busy_async_{path}", f"small pull, 16 KiB, {where}, issued and "
                             "polled by the busy thread", polled, idle,
                             "blocking pulls, nothing beside", p.mechanism(), ASYNC_NOTE)
        rows.append(Row(f"busy_async_{path}_work",
                        f"Python work kept by the thread polling its pulls, {where}",
                        "kround/s", float(np.median(polled_work)) / 1e3,
                        "the same loop without pulls, kround/s",
                        float(np.median(polled_alone)) / 1e3, "reported", True, p.mechanism(),
                        figure_samples=[x / 1e3 for x in polled_work],
                        limit_samples=[x / 1e3 for x in polled_alone], note=ASYNC_NOTE))
    return rows


def latency_rows(key: str, title: str, figure: list[float], limit: list[float],
                 limit_title: str, path: str, note: str) -> list[Row]:
    """The p50 and p99 rows (``key``_p50, ``key``_p99) of latency samples in us against the
    limit's samples, judged by :data:`GOALS` (reported where it has none)."""
    rows = []
    for q, name in ((50, "p50"), (99, "p99")):
        row = Row(f"{key}_{name}", f"{title}, {name}", "us", float(np.percentile(figure, q)),
                  f"{limit_title}, {name}", float(np.percentile(limit, q)), path=path,
                  figure_samples=figure, limit_samples=limit, note=note)
        rows.append(at_most(row, GOALS.get(row.key)))
    return rows
