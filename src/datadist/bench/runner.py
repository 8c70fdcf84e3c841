"""Driving a run: which row groups, the owner's lifetime, the table and the JSON.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from dataclasses import asdict
from typing import Any

import numpy as np

from datadist.bench.busy import ROWS as BUSY_ROWS
from datadist.bench.busy import busy_rows
from datadist.bench.calls import calls_rows
from datadist.bench.cpp import ROWS as CPP_ROWS
from datadist.bench.cpp import cpp_rows, face_rows
from datadist.bench.cpp import driver as cpp_driver
from datadist.bench.harness import (
    LAYER_BLOCK,
    LAYER_BLOCKS,
    LAYERS,
    PAGE,
    SMALL_BLOCK,
    SMALL_CACHE_BLOCKS,
    BenchError,
    Progress,
    Sizes,
    aligned_array,
)
from datadist.bench.limits import PlainClient
from datadist.bench.mooncake import available as mooncake_available
from datadist.bench.owner import start_owner, stop_owner
from datadist.bench.peers import peer_lines
from datadist.bench.plan import plan_rows
from datadist.bench.plot import PLOT_MISSING, plot_available
from datadist.bench.pools import pool_rows
from datadist.bench.puller import (
    Context,
)
from datadist.bench.same_host import same_host_rows
from datadist.bench.stall import ROWS as STALL_ROWS
from datadist.bench.stall import stall_rows
from datadist.bench.table import format_table
from datadist.bench.tcp import tcp_rows
from datadist.core.nixl_wheel import available as nixl_available


def alignment_text(bufs: dict[str, Any], info: dict[str, Any], align: str) -> str:
    mine = sorted({a.ctypes.data % PAGE for a in bufs["contig"]} | {bufs["blocks"].ctypes.data
                                                                     % PAGE})
    theirs = sorted({a % PAGE for a in info["contig_addrs"]} | {info["blocks_addr"] % PAGE})
    how = "page-aligned" if align == "page" else "numpy's own placement"
    return (f"client buffers: {how} (address mod 4096: puller {mine}, owner {theirs}); "
            "pool caches are page-aligned by datadist")


GROUPS = {"same-host": 4, "pools": 1, "tcp": 5, "calls": 14, "busy": BUSY_ROWS,
          "plan": 2, "stall": STALL_ROWS}  # groups: rows
if nixl_available() is not None:  # the optional NIXL path's rows, where NIXL is installed
    GROUPS["nixl"] = 7
if mooncake_available() is not None:  # a peer, beside the TCP path: with --peers or --only
    GROUPS["mooncake"] = 3
GROUPS["cpp"] = CPP_ROWS  # the C++ API (cpp/), run by its own driver; skipped if not built
# A plain run: every group but cpp (it needs the C++ build; ask for it with --only) and the
# peers' (--peers adds them).
DEFAULT_GROUPS = tuple(g for g in GROUPS if g not in ("cpp", "mooncake"))
PEER_GROUPS = tuple(g for g in GROUPS if g == "mooncake")
# --engine: only the C++ core now (there is one engine); kept so that older commands run
ENGINES = ("native",)
# the groups that pull from an owner process
_OWNED = ("same-host", "pools", "tcp", "calls", "busy", "nixl", "mooncake")


def timed_steps(repeat: int, groups: tuple[str, ...] = DEFAULT_GROUPS) -> int:
    """Progress steps of a run: every row of every group takes ``repeat`` steps."""
    return repeat * sum(GROUPS[g] for g in groups)


def run(sizes: Sizes, repeat: int, align: str = "page", peers: bool = False,
        progress: Progress | None = None,
        groups: tuple[str, ...] = DEFAULT_GROUPS) -> dict[str, Any]:
    """One run of the row ``groups``; returns the JSON-ready result. Raises BenchError if a
    row cannot run. Both processes run on the C++ core (the one engine)."""
    progress = progress or Progress(timed_steps(repeat, groups))
    t_start = time.monotonic()
    rows: list[Any] = []
    alignment = "no Python pulls in this run"
    # the cpp group's face rows (bench/cpp.py) pull from this owner too, where the driver is built
    owned = tuple(g for g in groups
                  if g in _OWNED or (g == "cpp" and cpp_driver()[0] is not None))
    if owned:
        rows, alignment = _owned_rows(sizes, repeat, align, progress, owned)
    rows += cpp_rows(sizes, repeat, progress) if "cpp" in groups else []
    rows += plan_rows(sizes, repeat, progress) if "plan" in groups else []
    # stalled clients (issue 35): owners of their own, one per I/O thread count
    rows += stall_rows(sizes, repeat, progress) if "stall" in groups else []
    progress.close()
    return {
        "datadist_version": datadist_version(),
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


def _owned_rows(sizes: Sizes, repeat: int, align: str, progress: Progress,
                groups: tuple[str, ...]) -> tuple[list[Any], str]:
    """The rows that pull from an owner process and the alignment line. The nixl rows get an
    owner of their own: it serves NIXL with the whole-process allowance, which the other rows'
    owner must not have."""
    bufs = {
        "contig": [aligned_array(sizes.tensor_bytes, align) for _ in range(sizes.contig_tensors)],
        "blocks": aligned_array(sizes.cache_blocks * sizes.block_bytes, align),
        "small": aligned_array(SMALL_CACHE_BLOCKS * SMALL_BLOCK, align),
        "layers": aligned_array(2 * LAYERS * LAYER_BLOCKS * LAYER_BLOCK, align),
    }
    rng = np.random.default_rng(2024)
    src_ids = rng.permutation(sizes.cache_blocks)[: sizes.blocks]
    dst_ids = rng.permutation(sizes.cache_blocks)[: sizes.blocks]
    rows: list[Any] = []
    alignment = ""
    owners = [([g for g in (*_OWNED, "cpp") if g in groups and g != "nixl"], False),
              (["nixl"] if "nixl" in groups else [], True)]
    for owned, nixl in owners:
        if not owned:
            continue
        progress.set_label("starting the owner process")
        proc, conn, info = start_owner(sizes, align, mooncake="mooncake" in owned, nixl=nixl)
        plain = None
        try:
            plain = PlainClient(info["plain_port"])
            ctx = Context(sizes, repeat, info, bufs, src_ids, dst_ids, progress, plain, conn)
            for group in owned:
                rows += _group_rows(group, ctx)
            alignment = alignment or alignment_text(bufs, info, align)
        finally:
            if plain is not None:
                plain.close()
            stop_owner(proc, conn)
    return rows, alignment


def _group_rows(group: str, ctx: Context) -> list[Any]:
    """One group's rows, pulled from ``ctx``'s owner (the groups of ``_OWNED``, and the cpp
    group's face rows)."""
    if group == "nixl":
        from datadist.bench.nixl import nixl_rows

        return nixl_rows(ctx)
    if group == "mooncake":
        from datadist.bench.mooncake import mooncake_rows

        return mooncake_rows(ctx)
    make = {"same-host": same_host_rows, "pools": pool_rows, "tcp": tcp_rows,
            "calls": calls_rows, "busy": busy_rows, "cpp": face_rows}[group]
    return make(ctx)


def datadist_version() -> str:
    from datadist import __version__

    return __version__


def main(argv: list[str] | None = None) -> int:
    """``datadist bench``: run, print the table, optionally write JSON. Returns the exit code:
    0 when every row ran (goals missed or not), 1 when the run failed."""
    from datadist.argparsing import OneLineParser  # errors on one line, as every datadist command

    ap = OneLineParser(
        prog="datadist bench",
        description="Measure how fast datadist moves KV caches on this machine: every data "
        "path (same host, pools, TCP, small pulls, busy owners, block planning; NIXL where "
        "installed) beside its limit, measured in the same run (raw process_vm_readv, "
        "memcpy, a plain socket, a bare round trip). Prints one table: each row's figure, "
        "its limit, the speed against the limit (higher is better) and whether it meets its "
        "goal. --quick is a smoke run of a few seconds.",
        epilog="Rows, limits and goals: docs/performance.md. Exit code 0 when every row ran "
        "(goals met or not), 1 when the run failed.")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run in seconds: 8 MiB transfers, fewer small pulls; judges "
                    "no goal")
    ap.add_argument("--size", type=int, metavar="MiB",
                    help="bytes per transfer, in MiB (default 256; 8 with --quick); below 256 "
                    "no goal is judged")
    ap.add_argument("--repeat", type=int, default=None, metavar="N",
                    help="measure each figure N times and report the median (default 7; 3 "
                    "with --quick)")
    ap.add_argument("--json", metavar="PATH",
                    help="also save the result to PATH, for --input or your own tools")
    ap.add_argument("--align", choices=("page", "numpy"), default="page",
                    help="where the client buffers start: page (default), or where numpy "
                    "puts them, to see what misalignment costs (docs/performance.md)")
    ap.add_argument("--peers", action="store_true",
                    help="also measure Mooncake beside datadist's TCP path, and name the NIXL "
                    "and Mooncake versions found, where they are installed")
    ap.add_argument("--only", metavar="GROUPS", default=",".join(DEFAULT_GROUPS),
                    help=f"run these row groups only, comma-separated, of {','.join(GROUPS)} "
                    "(default: all but cpp, the C++ API's rows, which need the C++ build "
                    "build/cpp/dd_bench)")
    ap.add_argument("--engine", choices=ENGINES, default=None,
                    help="accepted for older command lines; there is one engine (the C++ "
                    "core), so it changes nothing")
    ap.add_argument("--no-progress", action="store_true",
                    help="no progress bar on stderr (for logs)")
    ap.add_argument("--plot", metavar="PATH",
                    help="also draw the rows' speeds against their limits as a bar chart to "
                    "PATH (.png or .svg); needs matplotlib: pip install 'datadist[plot]', "
                    "checked before anything is measured")
    ap.add_argument("--input", metavar="JSON",
                    help="measure nothing: print the table (and --plot the chart) of a result "
                    "saved with --json")
    args = ap.parse_args(argv)
    if args.plot and not args.plot.lower().endswith((".png", ".svg")):
        ap.error("--plot writes a .png or .svg file")
    if args.plot and not plot_available():
        # before any measurement: a run of minutes must not end in "install matplotlib"
        print(f"datadist bench --plot: {PLOT_MISSING}", file=sys.stderr)
        return 1
    if args.input:
        return _replay(args.input, args.plot)
    repeat = args.repeat if args.repeat is not None else (3 if args.quick else 7)
    if repeat < 1:
        ap.error("--repeat must be >= 1")
    if args.size is not None and args.size < 1:
        ap.error("--size must be >= 1")
    groups = tuple(g for g in args.only.split(",") if g)
    if args.peers:
        groups += tuple(g for g in PEER_GROUPS if g not in groups)
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
    return _draw(result, args.plot) if args.plot else 0


def _draw(result: dict[str, Any], path: str) -> int:
    """--plot: the chart (bench/plot.py; matplotlib imported only now)."""
    from datadist.bench.plot import plot

    try:
        plot(result, path)
    except BenchError as e:
        print(f"datadist bench --plot: {e}", file=sys.stderr)
        return 1
    print(f"chart: {path}")
    return 0


def _replay(path: str, plot_path: str | None) -> int:
    """--input: the table (and chart) of a saved result, nothing run."""
    try:
        with open(path) as f:
            result = json.load(f)
        table = format_table(result)
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"datadist bench --input: cannot read a result from {path}: {e}", file=sys.stderr)
        return 1
    print(table)
    return _draw(result, plot_path) if plot_path else 0
