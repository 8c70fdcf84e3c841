"""Rows of the C++ API (cpp/, docs/cpp.md): its PullKvBlocks against the same limits as the
Python rows, measured by the C++ driver ``dd_bench`` between two processes of its own; and
the two faces' small pulls against each other (:func:`face_rows`), from the Python rows' own
owner, measured alike.

Who calls: :mod:`.runner` for the ``cpp`` row group. The driver is the one the C++ build
makes (``build/cpp/dd_bench``, or ``$DATADIST_CPP_BUILD_DIR/dd_bench``); nothing is built
here. Without it the group is one row saying why it was skipped.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from datadist.bench.harness import (
    SMALL_BLOCK,
    SMALL_CACHE_BLOCKS,
    BenchError,
    Progress,
    Row,
    Sizes,
    at_most,
    check_blocks,
    one_cpu,
    pattern_seed,
    throughput_row,
)
from datadist.bench.puller import Context, alternate, small_walk

ROOT = Path(__file__).resolve().parents[3]
DRIVER_ROWS = 5  # the driver's rows (two paths x small latency, throughput; TCP's reply row)
FACE_ROWS = 2  # the faces' small pulls against each other, same host and TCP
ROWS = DRIVER_ROWS + FACE_ROWS
# The issue "Per call and per layer at the limit": "a 16 KiB pull from Python: p50 <= 1.2x the
# C++ API's p50 for the same pull, on one host and over TCP"
FACE_GOAL = 1.2
FACE_TIMEOUT = 60.0  # seconds the driver may take to link, or to answer one run of pulls


def driver() -> tuple[Path | None, str]:
    """The dd_bench binary, or None and why it is not there."""
    build = Path(os.environ.get("DATADIST_CPP_BUILD_DIR", ROOT / "build" / "cpp"))
    exe = build / "dd_bench"
    if exe.is_file() and os.access(exe, os.X_OK):
        return exe, ""
    missing = [t for t in ("cmake", "g++") if shutil.which(t) is None]
    if missing:
        return None, f"the C++ rows need {' and '.join(missing)} (not found on PATH)"
    return None, (f"{exe} is not built: cmake -S cpp -B {build} && cmake --build {build} -j2 "
                  "--target dd_bench")


def skipped(why: str) -> Row:
    row = Row("cpp_skipped", "C++ API rows", "", 0.0, note=why)
    return row


def cpp_rows(sizes: Sizes, repeat: int, progress: Progress) -> list[Row]:
    """The driver's own rows (its owner forked by itself), or the skipped row. Blocks for the
    driver's run (at most 600 s)."""
    exe, why = driver()
    if exe is None:
        progress.step(n=ROWS * repeat)  # the face rows too: they are skipped with the group
        return [skipped(why)]
    progress.set_label("C++ API (dd_bench)")
    mib = max(1, sizes.blocks * sizes.block_bytes >> 20)
    cmd = [str(exe), "--json", "--mib", str(mib), "--repeat", str(repeat),
           "--small-iters", str(max(repeat, sizes.small_iters * 5))]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired as e:
        raise BenchError(f"{exe} did not finish within 600 s") from e
    if done.returncode:
        raise BenchError(f"{exe} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    rows: list[Row] = []
    for r in json.loads(done.stdout)["rows"]:
        goal = float(r["goal"].split()[1].rstrip("x"))
        if r["unit"] == "GB/s":
            rows.append(throughput_row(r["key"], r["title"], int(r["nbytes"]), r["path"],
                                       r["figure_samples"], r["limit_title"],
                                       r["limit_samples"], goal))
            continue
        row = Row(r["key"], r["title"], "us", float(np.median(r["figure_samples"])),
                  r["limit_title"], float(np.median(r["limit_samples"])), r["goal"],
                  path=r["path"], figure_samples=r["figure_samples"],
                  limit_samples=r["limit_samples"])
        row.met = row.ratio is not None and row.ratio <= goal
        rows.append(row)
    progress.step(n=DRIVER_ROWS * repeat)
    return rows


def face_rows(ctx: Context) -> list[Row]:
    """The Python face's 16 KiB pull against the C++ face's, on one host and over TCP: p50 of
    each, from the same owner (``ctx``'s, a Python process), the same cache, the same block
    pairs (:func:`.puller.small_walk`), every thread of the three processes on one CPU (as the
    latency rows, :func:`.harness.one_cpu`), in alternating runs of pulls (the C++ ones timed
    by ``dd_bench --attach``, each pull as the Python ones are: a clock read either side).
    Nothing here when the driver is not built (:func:`cpp_rows` says why).

    Who calls: :mod:`.runner`, for the ``cpp`` group, with the owner of the Python rows.
    Blocks for ``repeat`` runs of each face; every wait on the driver has a deadline
    (FACE_TIMEOUT)."""
    exe, _ = driver()
    if exe is None:
        return []
    rows = []
    for key, where, transport in (("same_host_small_vs_cpp", "same host", "auto"),
                                  ("tcp_small_vs_cpp", "TCP", "tcp")):
        p = ctx.puller(transport)
        try:
            ctx.bufs["small"].fill(0)
            p.pull_small(5, 9)  # rule 2: the owner's block arrived where asked
            check_blocks(ctx.bufs["small"].reshape(SMALL_CACHE_BLOCKS, -1), np.array([5]),
                         np.array([9]), SMALL_BLOCK, pattern_seed(3, 0), f"{where} small pull")
            title = f"small pull, one {SMALL_BLOCK >> 10} KiB block, {where}, Python face"
            ctx.progress.set_label(title)
            with (Attached(exe, ctx.info, transport == "tcp") as cpp,
                  one_cpu(os.getpid(), ctx.info["pid"], cpp.pid)):
                # a pause of 1 ms either side of a C++ run: a same-host pull's one-way
                # Release, as :func:`.puller.latency_row`
                pulls, theirs = alternate(ctx, small_walk(p), cpp.pulls, pause_before=0.001,
                                          pause_after=0.001)
            row = Row(key, title, "us", float(np.median(pulls)),
                      "the C++ API's PullKvBlocks of the same blocks from the same owner, same "
                      "CPU, p50", float(np.median(theirs)), path=p.mechanism(),
                      figure_samples=pulls, limit_samples=theirs)
            rows.append(at_most(row, FACE_GOAL))
        finally:
            p.close()
    return rows


class Attached:
    """``dd_bench --attach``: the C++ face linked to ``info``'s owner (its small cache), as a
    context manager. Enter blocks until the driver linked, checked a pull's bytes and warmed
    (at most FACE_TIMEOUT); exit asks it to quit and waits (at most 10 s, then kills it)."""

    def __init__(self, exe: Path, info: Mapping[str, Any], tcp: bool) -> None:
        self._cmd = [str(exe), "--attach", str(info["port"]), "--cache-id", str(info["small_id"]),
                     "--seed", str(pattern_seed(3, 0))] + (["--tcp"] if tcp else [])
        self._proc: subprocess.Popen[str] | None = None

    @property
    def pid(self) -> int:
        assert self._proc is not None
        return self._proc.pid

    def __enter__(self) -> Attached:
        self._proc = subprocess.Popen(self._cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, bufsize=1)
        if self._line() != "ready":
            raise BenchError(f"dd_bench --attach did not start: {self._why()}")
        return self

    def pulls(self, k: int) -> list[float]:
        """``k`` pulls of the C++ face, their times in us. Blocks for them (FACE_TIMEOUT)."""
        assert self._proc is not None and self._proc.stdin is not None
        try:
            self._proc.stdin.write(f"pull {k}\n")
            self._proc.stdin.flush()
        except OSError as e:  # it ended: a broken pipe
            raise BenchError(f"dd_bench --attach ended: {self._why()}") from e
        got = [float(x) for x in self._line().split()]
        if len(got) != k:
            raise BenchError(f"dd_bench --attach answered {len(got)} times of {k}: {self._why()}")
        return got

    def _line(self) -> str:
        """One line of the driver's, waited for at most FACE_TIMEOUT ("" if it ended)."""
        assert self._proc is not None and self._proc.stdout is not None
        out = self._proc.stdout
        ready, _, _ = select.select([out], [], [], FACE_TIMEOUT)
        if not ready:
            raise BenchError(f"dd_bench --attach gave no answer within {FACE_TIMEOUT:.0f} s")
        return out.readline().strip()

    def _why(self) -> str:
        assert self._proc is not None
        try:
            self._proc.wait(5)  # it said something else, or closed its output: ending
        except subprocess.TimeoutExpired:
            return "it is still running"
        err = self._proc.stderr.read() if self._proc.stderr is not None else ""
        return f"exit code {self._proc.returncode}: {err.strip()[-2000:]}"

    def __exit__(self, *exc: object) -> None:
        proc = self._proc
        if proc is None:
            return
        try:
            if proc.stdin is not None:
                proc.stdin.write("quit\n")
                proc.stdin.close()
        except OSError:
            pass  # it ended already
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        for f in (proc.stdout, proc.stderr):
            if f is not None:
                f.close()
