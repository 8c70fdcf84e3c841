"""Rows of the C++ API (cpp/, docs/cpp.md): its PullKvBlocks against the same limits as the
Python rows, measured by the C++ driver ``dd_bench`` between two processes of its own.

Who calls: :mod:`.runner` for the ``cpp`` row group. The driver is the one the C++ build
makes (``build/cpp/dd_bench``, or ``$DATADIST_CPP_BUILD_DIR/dd_bench``); nothing is built
here. Without it the group is one row saying why it was skipped.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np

from datadist.bench.harness import BenchError, Progress, Row, Sizes, throughput_row

ROOT = Path(__file__).resolve().parents[3]
ROWS = 4  # rows of a run (two paths x small latency, throughput)


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
    exe, why = driver()
    if exe is None:
        progress.step(n=ROWS * repeat)
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
    progress.step(n=ROWS * repeat)
    return rows
