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
from datadist.bench.cpp import cpp_rows
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
from datadist.bench.pools import pool_rows
from datadist.bench.puller import (
    Context,
)
from datadist.bench.same_host import same_host_rows
from datadist.bench.stall import ROWS as STALL_ROWS
from datadist.bench.stall import stall_rows
from datadist.bench.tcp import tcp_rows
from datadist.transport.nixl import available as nixl_available


def alignment_text(bufs: dict[str, Any], info: dict[str, Any], align: str) -> str:
    mine = sorted({a.ctypes.data % PAGE for a in bufs["contig"]} | {bufs["blocks"].ctypes.data
                                                                     % PAGE})
    theirs = sorted({a % PAGE for a in info["contig_addrs"]} | {info["blocks_addr"] % PAGE})
    how = "page-aligned" if align == "page" else "numpy's own placement"
    return (f"client buffers: {how} (address mod 4096: puller {mine}, owner {theirs}); "
            "pool caches are page-aligned by datadist")


GROUPS = {"same-host": 4, "pools": 1, "tcp": 4, "calls": 8, "busy": BUSY_ROWS,
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
    if any(g in _OWNED for g in groups):
        rows, alignment = _owned_rows(sizes, repeat, align, progress, groups)
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
    owners = [([g for g in _OWNED if g in groups and g != "nixl"], False),
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
    """One group's rows, pulled from ``ctx``'s owner (the groups of ``_OWNED``)."""
    if group == "nixl":
        from datadist.bench.nixl import nixl_rows

        return nixl_rows(ctx)
    if group == "mooncake":
        from datadist.bench.mooncake import mooncake_rows

        return mooncake_rows(ctx)
    make = {"same-host": same_host_rows, "pools": pool_rows, "tcp": tcp_rows,
            "calls": calls_rows, "busy": busy_rows}[group]
    return make(ctx)


def datadist_version() -> str:
    from datadist import __version__

    return __version__


def format_table(result: dict[str, Any]) -> str:
    """The human-readable table of a result from :func:`run`."""
    head = ("what", "path", "figure", "limit", "ratio", "goal", "")
    lines = []
    for r in result["rows"]:
        unit = r["unit"]
        if not unit:  # a group that could not run here, and why
            lines.append((r["title"], "-", "skipped", "-", "-", "-", r["note"]))
            continue
        q = "p99" if r["key"].endswith("_p99") else "p50"
        fig = f"{r['figure']:.2f} {unit}" if unit != "us" else f"{r['figure']:.0f} us {q}"
        if r["limit"] is None:
            lim, ratio = "-", "-"
        else:
            lim = (f"{r['limit']:.2f} {unit}" if unit != "us" else f"{r['limit']:.0f} us")
            lim = f"{lim} ({r['limit_title']})"
            ratio = f"{r['ratio']:.2f}x"
        # Goals hold for full-size transfers only: a smaller run judges none (note below).
        ok = ("ok" if r["met"] else "MISSED") if result["at_goal_size"] else "not judged"
        lines.append((r["title"], r["path"] or "-", fig, lim, ratio, r["goal"], ok))
    widths = [max(len(str(x[i])) for x in [head, *lines]) for i in range(len(head))]
    out = [f"datadist bench: median of {result['repeat']}, {result['seconds']} s; "
           f"{result['alignment']}"]
    for i, line in enumerate([head, *lines]):
        out.append("  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)).rstrip())
        if i == 0:
            out.append("  ".join("-" * w for w in widths))
    if not result["at_goal_size"]:
        out.append("note: no goal is judged in this run: its transfers are smaller than 256 MiB "
                   "/ 8192 blocks, where fixed costs weigh more than the goals allow for; run "
                   "without --quick/--size to judge them")
    out.extend(result["peers"])
    notes = dict.fromkeys(r.get("note") for r in result["rows"] if r["unit"] and r.get("note"))
    out.extend(f"note: {n}" for n in notes)  # how a peer was driven, per row group
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """``datadist bench``: run, print the table, optionally write JSON. Returns the exit code:
    0 when every row ran (goals missed or not), 1 when the run failed."""
    from datadist.argparsing import OneLineParser  # errors on one line, as every datadist command

    ap = OneLineParser(prog="datadist bench", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="8 MiB transfers and fewer small pulls (a smoke run, seconds)")
    ap.add_argument("--size", type=int, metavar="MiB",
                    help="bytes per transfer in MiB (default 256, or 8 with --quick)")
    ap.add_argument("--repeat", type=int, default=None, metavar="N",
                    help="repetitions per figure, the median is reported (default 7, quick 3)")
    ap.add_argument("--json", metavar="PATH", help="also write the result as JSON to PATH")
    ap.add_argument("--align", choices=("page", "numpy"), default="page",
                    help="placement of client buffers (default page; see docs/performance.md)")
    ap.add_argument("--peers", action="store_true",
                    help="also run the peers' rows (Mooncake beside the TCP path) and report "
                    "NIXL / Mooncake, where they are already importable")
    ap.add_argument("--only", metavar="GROUPS", default=",".join(DEFAULT_GROUPS),
                    help=f"comma-separated row groups to run, of {','.join(GROUPS)} (default "
                    "all but cpp, the C++ API's rows, which need build/cpp/dd_bench)")
    ap.add_argument("--engine", choices=ENGINES, default=None,
                    help="the engine both processes run on: only the C++ core (native) now, "
                    "the one engine (docs/engine.md); the option stays for older commands")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    ap.add_argument("--plot", metavar="PATH",
                    help="also draw every row against its limit to PATH (.png or .svg; needs "
                    "matplotlib: pip install 'datadist[plot]')")
    ap.add_argument("--input", metavar="JSON",
                    help="run nothing: print (and --plot) a result saved with --json")
    args = ap.parse_args(argv)
    if args.plot and not args.plot.lower().endswith((".png", ".svg")):
        ap.error("--plot writes a .png or .svg file")
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
