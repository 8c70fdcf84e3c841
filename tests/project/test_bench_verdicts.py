"""``datadist bench --quick`` judges no goal and says so (issue 25, item 8): its figures are
taken at sizes the goals were not set for, so no row reads MISSED; a full-size run judges."""

from __future__ import annotations

from datadist.bench.runner import format_table


def _result(at_goal_size: bool) -> dict:
    row = {"key": "tcp_small", "title": "small pull", "path": "tcp", "unit": "us",
           "figure": 900.0, "limit": 100.0, "limit_title": "ping", "ratio": 9.0,
           "goal": "<= 3x", "met": False}
    fast = {**row, "key": "tcp_pull", "title": "big pull", "unit": "GB/s", "figure": 1.0,
            "limit": 2.0, "ratio": 0.5, "goal": ">= 0.8x", "met": False}
    return {"rows": [row, fast], "repeat": 3, "seconds": 1.0, "alignment": "page",
            "at_goal_size": at_goal_size, "peers": []}


def test_a_quick_run_judges_no_goal_and_says_so() -> None:
    table = format_table(_result(at_goal_size=False))
    assert "MISSED" not in table and "missed" not in table
    assert table.count("not judged") == 2
    assert "no goal is judged in this run" in table


def test_a_full_run_judges_every_goal() -> None:
    table = format_table(_result(at_goal_size=True))
    assert table.count("MISSED") == 2 and "not judged" not in table
    assert "no goal is judged" not in table
