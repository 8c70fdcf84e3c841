"""The benchmark's goals of issue "One engine, native" and its rows of pulls issued and
polled by a busy thread: how rows are judged, the busy thread's polling loop, the one engine
(``--engine`` takes only the core). Fakes stand for datadist here; never timings.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from datadist.bench import busy, calls, same_host, tcp
from datadist.bench.harness import BenchError, Row, at_most, throughput_row
from datadist.bench.runner import format_table


def _row(key: str, figure: float, limit: float) -> Row:
    return Row(key, key, "us", figure, "limit", limit)


# ----------------------------------------------------------------------------- judging


def test_at_most_meets_up_to_the_goal_and_misses_past_it() -> None:
    assert at_most(_row("a", 15.0, 10.0), 1.5).met is True
    missed = at_most(_row("a", 15.1, 10.0), 1.5)
    assert missed.met is False and missed.goal == "<= 1.50x"
    reported = at_most(_row("a", 99.0, 10.0), None)
    assert reported.met is True and reported.goal == "reported"
    assert at_most(_row("a", 1.0, 0.0), 2.0).met is False  # no limit: nothing to be within


def test_small_pull_goals_are_the_issues_per_path() -> None:
    """16 KiB p50: same host <= 1.5x the round trip, TCP <= 2x (1.7x meets one, not the
    other)."""
    assert at_most(_row("same_host_small", 17.0, 10.0), same_host.SMALL_GOAL).met is False
    assert at_most(_row("tcp_small", 17.0, 10.0), tcp.SMALL_GOAL).met is True


def test_per_layer_goals_are_the_issues_per_path() -> None:
    """32 per-layer pulls: >= 0.95x one pull on one host, >= 0.9x over TCP (0.92x meets TCP's
    only); the asynchronous layer-wise forms >= 0.95x on both."""
    def judged(where: str) -> Row:
        # 1 GB in 1 s (figure) against 1 GB in 0.92 s (limit): 0.92x
        return throughput_row("k", "t", 10**9, "p", [1.0], "lim", [0.92],
                              calls.PER_LAYER_GOALS[where])

    assert judged("same host").met is False and judged("same host").goal == ">= 0.95x"
    assert judged("TCP").met is True and judged("TCP").goal == ">= 0.90x"
    async_form = throughput_row("k", "t", 10**9, "p", [1.0], "lim", [0.92],
                                calls.ASYNC_LAYERS_GOAL)
    assert async_form.met is False and async_form.goal == ">= 0.95x"


@pytest.mark.parametrize(("key", "goal"), [
    ("busy_owner_tcp", {"p50": 1.3, "p99": 3.0}),
    ("busy_async_same_host", {"p50": 1.3, "p99": None}),
    ("busy_async_tcp", {"p50": 1.3, "p99": None}),
    ("busy_owner_same_host", {"p50": None, "p99": None}),
    ("busy_puller_tcp", {"p50": None, "p99": None}),
])
def test_busy_rows_are_judged_by_the_issues_goals(key: str, goal: dict[str, float | None]) -> None:
    """The busy owner over TCP (p50 <= 1.3x idle, p99 <= 3x) and the busy thread's own pulls
    (p50 <= 1.3x) are judged; the other busy rows are reported."""
    idle = [10.0] * 99 + [20.0]
    for times in (1.25, 1.35):
        rows = busy.latency_rows(key, "t", [x * times for x in idle], idle, "idle", "tcp", "n")
        assert [r.key for r in rows] == [f"{key}_p50", f"{key}_p99"]
        for r, q in zip(rows, ("p50", "p99"), strict=True):
            want = goal[q]
            if want is None:
                assert r.goal == "reported" and r.met is True, r
            else:
                assert r.goal == f"<= {want:.2f}x", r
                assert r.met is (times <= want), r
            assert r.figure_samples and r.limit_samples == idle


def test_a_full_run_marks_a_missed_busy_goal() -> None:
    row = busy.latency_rows("busy_owner_tcp", "owner busy", [40.0] * 3, [10.0] * 3, "idle",
                            "tcp", "n")[0]
    result = {"rows": [row.to_json()], "repeat": 3, "seconds": 1.0, "alignment": "page",
              "at_goal_size": True, "peers": []}
    assert "MISSED" in format_table(result)


# ----------------------------------------------------------------------------- polled pulls


class FakeHandle:
    """A TransferHandle that is done after ``polls`` calls of done()."""

    def __init__(self, polls: int, error: BaseException | None = None) -> None:
        self.left, self.error, self.polls = polls, error, 0

    def done(self) -> bool:
        self.polls += 1
        self.left -= 1
        return self.left <= 0

    def exception(self) -> BaseException | None:
        return self.error if self.left <= 0 else None


def test_polled_pulls_issue_the_next_once_one_is_done_and_count_the_work() -> None:
    issued: list[int] = []
    handles: list[FakeHandle] = []

    def issue(i: int) -> FakeHandle:
        issued.append(i)
        handles.append(FakeHandle(polls=3))
        return handles[-1]

    lat, steps, secs = busy.polled_pulls(issue, 5, first=7, max_s=60.0)
    assert issued == [7, 8, 9, 10, 11]
    assert len(lat) == 5 and all(x > 0 for x in lat)
    assert all(h.polls == 3 for h in handles)  # polled until done, then left alone
    assert steps == 5 * 3 * busy.POLL_STEPS  # a round of work before every poll
    assert secs > 0


def test_polled_pulls_stop_after_max_s_with_at_least_one_pull() -> None:
    lat, steps, _ = busy.polled_pulls(lambda i: FakeHandle(polls=1), 10**6, max_s=0.0)
    assert len(lat) == 1 and steps == busy.POLL_STEPS


def test_polled_pulls_fail_the_run_on_a_failed_pull() -> None:
    with pytest.raises(BenchError, match="pull_blocks_async failed"):
        busy.polled_pulls(lambda i: FakeHandle(polls=2, error=RuntimeError("gone")), 3)


def test_polled_work_alone_runs_the_same_loop_for_the_time_given() -> None:
    steps = busy.polled_work_alone(0.01)
    assert steps > 0 and steps % busy.POLL_STEPS == 0


def test_the_busy_groups_rows_match_its_progress_steps() -> None:
    """Per repeat and path: owner 3 steps, puller 3 + 3 (async pulls count 2, their work 1);
    the progress bar's total is the rows' count (runner.GROUPS)."""
    from datadist.bench.runner import GROUPS

    assert busy.ROWS == GROUPS["busy"] == 2 * (3 + 6)


# ----------------------------------------------------------------------------- engine
# One engine now (the C++ core): --engine takes only "native" (older commands keep running),
# and a result names no engines.


def test_format_table_replays_a_result_saved_when_engines_were_named() -> None:
    result: dict[str, Any] = {"rows": [], "repeat": 1, "seconds": 1.0, "alignment": "page",
                              "at_goal_size": True, "peers": []}
    plain = format_table(result)
    result.update(engines={"owner": "python", "puller (same host)": "python"},
                  engine_asked="python")
    assert format_table(result) == plain
    assert "engines" not in plain and "python" not in plain


def run_bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "datadist.bench", *args], capture_output=True,
                          text=True, timeout=150)


@pytest.mark.parametrize("engine", ["fast", "python", "auto"])
def test_engine_option_takes_only_the_core(engine: str) -> None:
    proc = run_bench("--engine", engine)
    assert proc.returncode == 2 and "--engine" in proc.stderr, proc.stderr


@pytest.mark.timeout(150)
def test_engine_native_runs_both_processes_on_the_core(tmp_path: Path) -> None:
    """``--engine native`` (the commands in docs/performance.md) still runs: the owner (a
    spawned child) and the puller link over the core's TCP path, and the result names no
    engines any more."""
    out = tmp_path / "tcp.json"
    proc = run_bench("--quick", "--size", "1", "--repeat", "1", "--only", "tcp",
                     "--engine", "native", "--no-progress", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert "engines" not in result and "engine_asked" not in result
    rows = {r["key"]: r for r in result["rows"]}
    assert rows["tcp_pull"]["path"] == "tcp", rows["tcp_pull"]
    assert "engines" not in proc.stdout
