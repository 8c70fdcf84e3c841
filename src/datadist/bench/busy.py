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

The processes are not pinned to a CPU here (unlike the other latency rows): the busy thread
holds a core, as in a server. Every row is reported, with no goal. A pull posted by the busy
thread itself and polled between its rounds is not measured: asynchronous pulls do not
exist yet (each row's note says so).

Who calls: the bench runner (``--only busy``). Blocks while it runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from datadist.bench.harness import (
    SMALL_BLOCK,
    SMALL_CACHE_BLOCKS,
    BenchError,
    PythonWork,
    Row,
    check_blocks,
    pattern_seed,
)
from datadist.bench.puller import Context, Puller

SIDES = ("owner", "puller")
PATHS = (("auto", "same host"), ("tcp", "TCP"))
ROWS = len(SIDES) * len(PATHS) * 3
MIN_RUN = 0.1  # seconds a run of pulls lasts at least
NOTE = ("not pinned to a CPU; a pull posted and polled by the busy thread itself is not "
        "measured: asynchronous pulls do not exist yet")


def busy_rows(ctx: Context) -> list[Row]:
    rows: list[Row] = []
    for transport, where in PATHS:
        p = Puller(ctx.info, ctx.sizes, ctx.bufs, transport)
        try:
            _check_small(ctx, p, where)
            for side in SIDES:
                rows += _side_rows(ctx, p, side, where, transport)
        finally:
            p.close()
    return rows


def _check_small(ctx: Context, p: Puller, where: str) -> None:
    """Rule 2: one small pull into zeroed memory, checked, before anything is timed."""
    small = ctx.bufs["small"]
    small.fill(0)
    p.pull_small(5, 9)
    check_blocks(small.reshape(SMALL_CACHE_BLOCKS, -1), np.array([5]), np.array([9]),
                 SMALL_BLOCK, pattern_seed(3, 0), f"{where} small pull (busy rows)")


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

    ctx.progress.set_label(f"busy {side}, {where}")
    m = pulls([])  # warm: one untimed run
    for _ in range(ctx.repeat):
        pulls(idle, m)
        ctx.progress.step()
        stop = start()
        pulls(busy, m)
        rounds, secs = stop()
        with_pulls.append(rounds / secs)
        ctx.progress.step()
        stop = start()
        time.sleep(secs)
        rounds, secs = stop()
        alone.append(rounds / secs)
        ctx.progress.step()

    key = f"busy_{side}_{'same_host' if transport == 'auto' else 'tcp'}"
    title = f"small pull, 16 KiB, {where}, Python work in the {side}"
    rows = []
    for q, name in ((50, "p50"), (99, "p99")):
        rows.append(Row(f"{key}_{name}", f"{title}, {name}", "us",
                        float(np.percentile(busy, q)), f"the same pulls, nothing beside, {name}",
                        float(np.percentile(idle, q)), "reported", True, p.mechanism(),
                        figure_samples=busy, limit_samples=idle, note=NOTE))
    rows.append(Row(f"{key}_work", f"Python work kept in the {side} while it pulls, {where}",
                    "kround/s", float(np.median(with_pulls)) / 1e3,
                    "the same work alone, kround/s", float(np.median(alone)) / 1e3,
                    "reported", True, p.mechanism(),
                    figure_samples=[x / 1e3 for x in with_pulls],
                    limit_samples=[x / 1e3 for x in alone], note=NOTE))
    return rows
