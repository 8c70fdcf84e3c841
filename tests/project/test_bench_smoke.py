"""Smoke test of the benchmark (``datadist bench``): one tiny run end to end.

It runs as a subprocess, as users run it (one LLMDataDist per process, and the owner is a
spawned child). Asserts that every row is produced, in the table and in the JSON, with sane
numbers; never how fast anything was.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from datadist.bench import mooncake
from datadist.bench.table import format_table
from datadist.core import nixl_wheel as nixl

ROWS = {
    "same_host_pull": "GB/s", "same_host_pull_blocks": "GB/s", "same_host_pull_pool": "GB/s",
    "same_host_small": "us", "same_host_pull_blocks_pool": "GB/s", "tcp_pull": "GB/s",
    "tcp_pull_blocks": "GB/s", "tcp_pull_blocks_4k": "GB/s", "tcp_small": "us",
    # the TCP small pull against a plain request answered with as many bytes (16 KiB)
    "tcp_small_vs_reply": "us",
    "plan_numpy": "ms", "plan_lists": "ms",
    # per-call cost rows (bench/calls.py); at --size 1 (32 blocks) no 256 / 1k blocks rows
    "same_host_per_layer": "GB/s", "tcp_per_layer": "GB/s", "tcp_per_layer_plain": "GB/s",
    "same_host_small_p99": "us",
    "same_host_small_new": "us", "same_host_small_vs_raw": "us",
    "same_host_async_layers": "GB/s", "tcp_async_layers": "GB/s",
    "same_host_async_layers_push": "GB/s", "tcp_async_layers_push": "GB/s",
    "same_host_pull_ahead": "GB/s", "tcp_pull_ahead": "GB/s",
    # the busy interpreter (bench/busy.py): Python work in the owner, then in the puller
    **{f"busy_{side}_{path}_{what}": unit for side in ("owner", "puller")
       for path in ("same_host", "tcp")
       for what, unit in (("p50", "us"), ("p99", "us"), ("work", "kround/s"))},
    # the busy thread's own pulls, issued (pull_blocks_async) and polled between its rounds
    **{f"busy_async_{path}_{what}": unit for path in ("same_host", "tcp")
       for what, unit in (("p50", "us"), ("p99", "us"), ("work", "kround/s"))},
    # honest pulls beside 200 stalled clients, an owner on 2 then 8 I/O threads (bench/stall.py)
    **{f"stall_{path}_io{n}_{q}": "us" for path in ("tcp", "same_host") for n in (2, 8)
       for q in ("p50", "p99")},
}
if nixl.available() is not None:  # the optional NIXL path's rows, where NIXL is installed
    ROWS.update({"nixl_pull": "GB/s", "nixl_pull_blocks": "GB/s", "nixl_small": "us",
                 "nixl_vs_best": "GB/s", "nixl_pull_prog": "GB/s",
                 "nixl_pull_blocks_prog": "GB/s", "nixl_small_prog": "us"})
if mooncake.available() is not None:  # Mooncake beside the TCP path (--peers), if installed
    ROWS.update({"mooncake_pull": "GB/s", "mooncake_pull_blocks": "GB/s",
                 "mooncake_small": "us"})


def run_bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "datadist.bench", *args],
                          capture_output=True, text=True, timeout=200)


@pytest.mark.timeout(240)
def test_quick_run_produces_every_row(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = run_bench("--quick", "--size", "1", "--repeat", "2", "--peers", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    rows = {r["key"]: r for r in result["rows"]}
    assert set(rows) == set(ROWS)
    # the table printed is the saved result's, every row in it (titles wrap within 100
    # columns: tests/project/test_bench_table.py)
    assert format_table(result) in proc.stdout
    for key, unit in ROWS.items():
        r = rows[key]
        assert r["unit"] == unit, key
        assert math.isfinite(r["figure"]) and r["figure"] > 0, r
        assert len(r["figure_samples"]) >= 2, r  # a median of several repetitions
        assert isinstance(r["met"], bool), r
        if unit == "ms":  # planning has an absolute goal, no limit
            assert r["limit"] is None and r["ratio"] is None
        else:
            assert math.isfinite(r["limit"]) and r["limit"] > 0, r
            assert r["ratio"] == pytest.approx(r["figure"] / r["limit"])
            if key.startswith("busy_async_") and not key.endswith("_work"):
                # the busy thread's own pulls stop once a run passed ASYNC_MAX (a loaded
                # host): as many as the idle pulls at most, never none
                assert 0 < len(r["figure_samples"]) <= len(r["limit_samples"]), r
            else:
                assert len(r["limit_samples"]) == len(r["figure_samples"]), r
    for key in ("tcp_pull", "tcp_pull_blocks", "tcp_pull_blocks_4k", "tcp_small",
                "tcp_small_vs_reply"):
        assert rows[key]["path"] == "tcp", rows[key]
    for key in ("mooncake_pull", "mooncake_pull_blocks", "mooncake_small"):
        assert key not in rows or rows[key]["path"] == "tcp", rows[key]
    for key in ("same_host_pull", "same_host_pull_blocks", "same_host_small",
                "same_host_pull_blocks_pool"):
        assert rows[key]["path"] != "tcp", rows[key]
    for key in ("nixl_pull", "nixl_pull_blocks", "nixl_small", "nixl_pull_prog"):
        assert key not in rows or rows[key]["path"] == "nixl", rows[key]
    for key in ("busy_owner_tcp_p50", "busy_puller_tcp_work", "busy_async_tcp_p50"):
        assert rows[key]["path"] == "tcp", rows[key]
    # one engine (the core): the result and the table name none
    assert "engines" not in result and "engines (asked: " not in proc.stdout
    assert result["sizes"]["contig_bytes"] == 1 << 20 and not result["at_goal_size"]
    assert "address mod 4096" in result["alignment"]
    assert len(result["peers"]) == 2 and all("NIXL" in p or "Mooncake" in p
                                             for p in result["peers"])
    assert "100%" in proc.stderr  # the progress bar reached its end


@pytest.mark.timeout(60)
def test_bad_arguments_are_refused() -> None:
    proc = run_bench("--only", "nonsense")
    assert proc.returncode == 2 and "--only" in proc.stderr
    proc = run_bench("--repeat", "0")
    assert proc.returncode == 2 and "--repeat" in proc.stderr


def test_plan_rows_in_process() -> None:
    """The planning rows need no processes: checked here directly, with the real planner."""
    from datadist import bench
    from datadist.bench.plan import plan_rows

    sizes = bench.Sizes.preset(True)
    progress = bench.Progress(bench.timed_steps(2, ("plan",)), enabled=False)
    rows = plan_rows(sizes, 2, progress)
    assert [r.key for r in rows] == ["plan_numpy", "plan_lists"]
    assert progress.done == progress.total
    assert all(r.figure > 0 and len(r.figure_samples) == 2 for r in rows)


@pytest.mark.timeout(120)
def test_the_cli_form_takes_the_benchmark_options(tmp_path: Path) -> None:
    """``datadist bench --help`` and ``datadist bench --quick ...`` reach the benchmark's own
    parser (argparse's REMAINDER used to swallow options that start with a dash)."""
    cli = [sys.executable, "-m", "datadist.cli", "bench"]
    proc = subprocess.run([*cli, "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "--quick" in proc.stdout and "--only" in proc.stdout
    out = tmp_path / "plan.json"
    proc = subprocess.run([*cli, "--quick", "--repeat", "2", "--only", "plan", "--no-progress",
                           "--json", str(out)], capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr
    assert [r["key"] for r in json.loads(out.read_text())["rows"]] == ["plan_numpy",
                                                                       "plan_lists"]
