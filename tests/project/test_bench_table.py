"""The benchmark's table and chart legend as a reader meets them (issue 38 item 12): within
100 columns, every column named, one ratio direction (``x limit``: higher is better, the
goals on the same scale), the limits' names as footnotes; the legend names only what is
drawn; ``--plot`` without matplotlib refuses before measuring anything."""

from __future__ import annotations

import importlib.util
import time

import pytest

from datadist.bench import runner
from datadist.bench.plot import GOAL_COLOUR, LIMIT_COLOUR, PEER_COLOUR, legend_entries
from datadist.bench.table import HEAD, WIDTH, format_table

LONG = "small pull, 16 KiB, same host, issued and polled by the busy thread, p50"
RESULT = {
    "repeat": 3, "seconds": 18.0, "at_goal_size": True, "peers": [],
    "alignment": "client buffers: page-aligned (address mod 4096: puller [0], owner [0]); "
                 "pool caches are page-aligned by datadist",
    "rows": [
        {"key": "tcp_pull", "title": "TCP pull, 256 MiB", "unit": "GB/s", "figure": 3.0,
         "limit": 2.0, "limit_title": "plain socket sendall/recv_into, 4 MiB chunks",
         "goal": ">= 0.90x", "met": True, "path": "tcp", "note": ""},
        {"key": "busy_small", "title": LONG, "unit": "us", "figure": 40.0, "limit": 20.0,
         "limit_title": "blocking pulls, nothing beside, p50", "goal": "<= 1.30x",
         "met": False, "path": "cma/shm", "note": ""},
        {"key": "busy_rounds", "title": "Python work kept in the owner while it pulls",
         "unit": "kround/s", "figure": 1.5, "limit": 3.0,
         "limit_title": "the same work alone, kround/s", "goal": "reported", "met": True,
         "path": "cma", "note": ""},
        {"key": "plan_numpy", "title": "plan 100k blocks, numpy arrays", "unit": "ms",
         "figure": 0.5, "limit": None, "limit_title": "", "goal": "< 5 ms", "met": True,
         "path": "", "note": ""},
        {"key": "cpp", "title": "C++ API rows", "unit": "", "figure": 0.0, "limit": None,
         "limit_title": "", "goal": "", "met": None, "path": "",
         "note": "the C++ API's rows need build/cpp/dd_bench, which is not built"},
    ],
}


def test_the_table_fits_in_100_columns_and_names_every_column() -> None:
    table = format_table(RESULT)
    # before: 200 columns wide, its last column (the verdict) without a name
    assert max(len(line) for line in table.splitlines()) <= WIDTH == 100, table
    head = next(line for line in table.splitlines() if line.startswith("row "))
    assert head.split() == ["row", "path", "figure", "limit", "x", "limit", "goal", "verdict"]
    assert all(HEAD)
    assert LONG.split(",")[0] in table and "busy thread, p50" in table  # wrapped, not cut


def test_one_ratio_direction_higher_is_better() -> None:
    table = format_table(RESULT)
    line = {r["key"]: next(x for x in table.splitlines() if x.startswith(r["title"][:20]))
            for r in RESULT["rows"] if r["unit"]}
    assert " 1.50x " in line["tcp_pull"] and ">= 0.90x" in line["tcp_pull"]  # 3.0 / 2.0
    # a time: limit / figure = 0.5 (before: 2.00x, lower is better), its goal "<= 1.30x"
    # on the same scale: >= 1 / 1.3
    assert " 0.50x " in line["busy_small"] and ">= 0.77x" in line["busy_small"]
    assert "<=" not in table
    assert " 0.50x " in line["busy_rounds"]  # a rate: figure / limit


def test_limit_names_are_footnotes_numbered_once() -> None:
    lines = format_table(RESULT).splitlines()
    assert "[1] plain socket sendall/recv_into, 4 MiB chunks" in lines
    assert "[2] blocking pulls, nothing beside, p50" in lines
    assert any("2.00 [1]" in x for x in lines) and any("20 [2]" in x for x in lines)
    assert "note: the C++ API's rows need build/cpp/dd_bench, which is not built" in lines


def test_legend_names_only_what_the_chart_draws() -> None:
    # before: the axis label named an orange "peer" colour on charts without a peer row
    assert legend_entries(True, False, True) == [(LIMIT_COLOUR, "against its limit"),
                                                 (GOAL_COLOUR, "goal")]
    assert [c for c, _ in legend_entries(True, True, False)] == [LIMIT_COLOUR, PEER_COLOUR]
    assert legend_entries(False, False, False) == []


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is not None,
                    reason="matplotlib is installed: --plot would draw")
def test_plot_without_matplotlib_refuses_before_measuring(tmp_path, capsys,
                                                          monkeypatch) -> None:
    # before: the whole run (minutes at full size) went first, then the install hint
    def no_run(*args, **kwargs):
        raise AssertionError("the run started although the chart cannot be drawn")

    monkeypatch.setattr(runner, "run", no_run)
    t = time.monotonic()
    rc = runner.main(["--quick", "--no-progress", "--plot", str(tmp_path / "chart.png")])
    out, err = capsys.readouterr()
    assert rc == 1 and out == ""
    assert "--plot needs matplotlib: pip install 'datadist[plot]'" in err
    assert time.monotonic() - t < 5
    assert not (tmp_path / "chart.png").exists()
