"""The stall rows of ``datadist bench`` (bench/stall.py, issue 35's goal): how they are judged
and which stalls the attack mix holds, without starting an owner (the run itself:
test_bench_smoke.py; the attack against a real owner: tests/security/test_slow_clients.py)."""

from __future__ import annotations

import os
from collections import Counter

import pytest

from datadist.bench import stall
from datadist.bench.harness import BenchError

CLEAN = [[100e-6] * 99 + [1e-3]] * 3  # seconds per pull, a list per repetition


def test_rows_meet_their_goals_within_them() -> None:
    attacked = [[140e-6] * 99 + [4e-3]] * 3  # p50 1.4x, p99 about 4x
    rows = {r.key: r for r in stall.latency_rows(2, CLEAN, attacked, [])}
    assert set(rows) == {"stall_tcp_io2_p50", "stall_tcp_io2_p99"}
    assert rows["stall_tcp_io2_p50"].ratio == pytest.approx(1.4)
    assert all(r.met for r in rows.values()), rows
    assert rows["stall_tcp_io2_p99"].goal == "<= 5.00x"
    assert len(rows["stall_tcp_io2_p50"].figure_samples) == 3


def test_a_slow_p99_misses_and_a_failed_pull_misses_both() -> None:
    slow = {r.key: r for r in stall.latency_rows(8, CLEAN, [[100e-6] * 95 + [9e-3] * 5] * 3,
                                                 [])}
    assert slow["stall_tcp_io8_p50"].met and not slow["stall_tcp_io8_p99"].met
    failed = stall.latency_rows(8, CLEAN, [[100e-6] * 100] * 3, ["LLMException: LLM_TIMEOUT"])
    assert not any(r.met for r in failed)
    assert all("1 of 300 pulls under attack failed" in r.note for r in failed)


def test_same_host_rows_are_named_by_their_path() -> None:
    rows = stall.latency_rows(2, CLEAN, CLEAN, [], [(180, 20)], "same host", "cma")
    assert [r.key for r in rows] == ["stall_same_host_io2_p50", "stall_same_host_io2_p99"]
    assert rows[0].path == "cma" and "same host" in rows[0].title
    assert "open and unanswered once placed: 180-180, refused in the handshake: 20-20" in \
        rows[0].note


def test_wrong_bytes_fail_the_run() -> None:
    with pytest.raises(BenchError, match="not the owner's"):
        stall.latency_rows(2, CLEAN, CLEAN, ["pull 3: the bytes that arrived are not the owner's"])


def test_the_standard_mix_is_200_stalls_before_and_after_authentication() -> None:
    stalls = stall.standard_mix(200, True, True)
    assert len(stalls) == 200
    by = Counter((s.channel, s.stage in ("pre", "auth")) for s in stalls)
    if os.getuid() == 0:
        assert by == {("tcp", True): 50, ("tcp", False): 50, ("local", True): 50,
                      ("local", False): 50}
    assert {s.how for s in stalls} == set(stall.HOWS) - {"client_hello", "largest_frame"}
    per_source = Counter((s.channel, s.source) for s in stalls)
    assert max(per_source.values()) <= 64  # an owner's per-address / per-uid cap
