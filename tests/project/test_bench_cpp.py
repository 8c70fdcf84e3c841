"""``datadist bench --only cpp``: the C++ API's rows, run by the C++ driver, beside their
limits; and the group skipped, saying why, when the driver is not built. Asserts that the
rows exist with sane numbers, never how fast anything was."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from datadist.bench import cpp
from datadist.bench.harness import BenchError
from datadist.bench.table import format_table

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(600)

KEYS = {"cpp_same_host_small": "us", "cpp_same_host_pull_blocks": "GB/s",
        "cpp_tcp_small": "us", "cpp_tcp_pull_blocks": "GB/s",
        # the C++ TCP pull against a plain 16 B -> 16 KiB round trip (the driver's own owner)
        "cpp_tcp_small_vs_reply": "us",
        # the Python face's small pull against the C++ face's, same owner and CPU (bench/cpp.py)
        "same_host_small_vs_cpp": "us", "tcp_small_vs_cpp": "us"}


def _bench(build: Path, tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], dict]:
    out = tmp_path / "bench.json"
    env = dict(os.environ, DATADIST_CPP_BUILD_DIR=str(build),
               PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "datadist.bench", "--only", "cpp", "--quick",
                           "--size", "2", "--repeat", "2", "--no-progress", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    return proc, json.loads(out.read_text())


def test_cpp_rows_beside_their_limits(cpp_build, tmp_path):
    proc, result = _bench(cpp_build, tmp_path)
    rows = {r["key"]: r for r in result["rows"]}
    assert set(rows) == set(KEYS)
    for key, unit in KEYS.items():
        r = rows[key]
        assert r["unit"] == unit
        assert math.isfinite(r["figure"]) and r["figure"] > 0, r
        assert math.isfinite(r["limit"]) and r["limit"] > 0, r
        assert len(r["figure_samples"]) >= 2 and isinstance(r["met"], bool), r
    # the table printed is the saved result's, every row in it (titles wrap within 100
    # columns: tests/project/test_bench_table.py)
    assert format_table(result) in proc.stdout
    assert rows["cpp_same_host_pull_blocks"]["path"] == "cma"
    assert rows["cpp_tcp_pull_blocks"]["path"] == "tcp"
    assert rows["tcp_small_vs_cpp"]["path"] == "tcp"
    assert rows["same_host_small_vs_cpp"]["path"] != "tcp"
    for key in ("cpp_tcp_small_vs_reply", "same_host_small_vs_cpp", "tcp_small_vs_cpp"):
        r = rows[key]
        assert len(r["limit_samples"]) == len(r["figure_samples"]), r
        assert r["ratio"] == pytest.approx(r["figure"] / r["limit"]), r
    # the reply row times the very pulls of the TCP small row, against another limit
    assert (rows["cpp_tcp_small_vs_reply"]["figure_samples"]
            == rows["cpp_tcp_small"]["figure_samples"])
    assert rows["same_host_small_vs_cpp"]["goal"] == "<= 1.20x"
    assert rows["cpp_tcp_small_vs_reply"]["goal"] == "<= 1.50x"


def test_the_attached_driver_says_why_it_cannot_pull(cpp_build, tmp_path):
    """``dd_bench --attach`` to an owner that is not there: the face rows' driver fails with
    a BenchError that says why (its exit code and its own words), within its deadline."""
    exe = cpp_build / "dd_bench"
    info = {"port": _closed_port(), "small_id": 3}
    with (pytest.raises(BenchError, match="(?s)did not start: exit code 1: .*link failed"),
          cpp.Attached(exe, info, tcp=True)):
        pass


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_cpp_rows_skipped_without_the_driver(tmp_path):
    _, result = _bench(tmp_path / "nothing-built-here", tmp_path)
    (row,) = result["rows"]
    assert row["key"] == "cpp_skipped" and "is not built" in row["note"]
