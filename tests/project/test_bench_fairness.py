"""The benchmark's fairness mechanics and its chart (issue 27). Never timings.

- warm_both: every side gets the same untimed warm-up into the same zeroed buffers, and a
  side that moved wrong bytes fails the run;
- the peers' rows (Mooncake, NIXL) warm every callable they time, on both sides, and check
  its bytes (a run in a subprocess with the row modules' ``warm_both`` / ``interleave``
  recorded);
- ``--plot`` writes a PNG or SVG that parses (header and size), ``--input`` replays a saved
  result; both skip cleanly where matplotlib (or Mooncake / NIXL) is not installed.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from datadist.bench import harness
from datadist.bench.harness import BenchError, check_pattern, fill_pattern, warm_both

RESULT = {
    "datadist_version": "0.1.0", "sizes": {"contig_bytes": 8 << 20}, "repeat": 3,
    "alignment": "page-aligned", "seconds": 1.0, "at_goal_size": False,
    "host": {"cpus": 2}, "peers": [],
    "rows": [
        {"key": "tcp_pull", "title": "TCP pull, 8 MiB", "unit": "GB/s", "figure": 3.0,
         "limit": 2.5, "limit_title": "plain socket", "goal": ">= 0.90x", "met": True,
         "path": "tcp", "note": ""},
        {"key": "tcp_small", "title": "small pull, TCP", "unit": "us", "figure": 140.0,
         "limit": 7.0, "limit_title": "round trip", "goal": "<= 2.00x", "met": False,
         "path": "tcp", "note": ""},
        {"key": "mooncake_pull", "title": "TCP pull beside Mooncake TCP, 8 MiB",
         "unit": "GB/s", "figure": 2.0, "limit": 1.5, "limit_title": "Mooncake read",
         "goal": "reported", "met": True, "path": "tcp", "note": "Mooncake async wait"},
        {"key": "plan_numpy", "title": "plan 100k blocks", "unit": "ms", "figure": 0.7,
         "limit": None, "limit_title": "", "goal": "< 5 ms", "met": True, "path": "",
         "note": ""},
        {"key": "cpp_skipped", "title": "C++ API rows", "unit": "", "figure": 0.0,
         "limit": None, "limit_title": "", "goal": "", "met": None, "path": "",
         "note": "not built"},
    ],
}
for _r in RESULT["rows"]:  # type: ignore[attr-defined]
    _r["ratio"] = _r["figure"] / _r["limit"] if _r["limit"] else None  # as Row.to_json


# ----------------------------------------------------------------------------- warm_both


def test_warm_both_warms_every_side_into_zeroed_buffers_and_checks_it() -> None:
    src = np.empty(1 << 16, dtype=np.uint8)
    fill_pattern(src, 7)
    dst = np.empty_like(src)
    events: list[str] = []

    def side(name: str) -> tuple[str, Callable[[], None]]:
        def run() -> None:
            assert not dst.any(), f"{name} was not given zeroed buffers"
            events.append(name)
            dst[:] = src
        return name, run

    def reset() -> None:
        events.append("reset")
        dst.fill(0)

    def check(what: str) -> None:
        events.append(f"check {what}")
        check_pattern(dst, 7, what)

    warm_both([side("datadist"), side("peer")], reset, check)
    assert events == ["reset", "datadist", "check datadist", "reset", "peer", "check peer"]


def test_warm_both_fails_the_run_on_a_side_that_moved_wrong_bytes() -> None:
    src = np.empty(1 << 16, dtype=np.uint8)
    fill_pattern(src, 7)
    dst = np.zeros_like(src)
    ran: list[str] = []

    def good() -> None:
        ran.append("good")
        dst[:] = src

    def bad() -> None:  # fast, and wrong: one byte off
        ran.append("bad")
        dst[:] = src
        dst[12345] ^= 1

    with pytest.raises(BenchError, match="bad side"):
        warm_both([("good side", good), ("bad side", bad), ("never", good)],
                  lambda: dst.fill(0), lambda what: check_pattern(dst, 7, what))
    assert ran == ["good", "bad"]


# ----------------------------------------------------------------------------- peers' rows

_RECORD = r"""
import json, sys
from datadist.bench import harness, runner
from datadist.bench import {mod} as m
warmed, timed = [], []
real_warm, real_interleave = m.warm_both, m.interleave
def warm_both(sides, reset, check):
    checked = []
    real_warm(sides, reset, lambda what: (checked.append(what), check(what)))
    warmed.extend(fn for _, fn in sides)
    assert [w for w, _ in sides] == checked, (sides, checked)
def interleave(a, b, repeat, progress):
    timed.append([a in warmed, b in warmed, getattr(a, "__name__", "?"),
                  getattr(b, "__name__", "?")])
    return real_interleave(a, b, repeat, progress)
m.warm_both, m.interleave = warm_both, interleave
sizes = harness.Sizes.preset(True, 1)
result = runner.run(sizes, 2, groups=("{group}",),
                    progress=harness.Progress(runner.timed_steps(2, ("{group}",)), enabled=False))
print(json.dumps({{"timed": timed, "rows": [r["key"] for r in result["rows"]],
                   "notes": [r["note"] for r in result["rows"]]}}))
"""


def _recorded_run(mod: str, group: str) -> dict[str, object]:
    proc = subprocess.run([sys.executable, "-c", _RECORD.format(mod=mod, group=group)],
                          capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


@pytest.mark.timeout(180)
def test_mooncake_rows_warm_and_check_both_sides_before_timing() -> None:
    from datadist.bench import mooncake

    if mooncake.available() is None:
        pytest.skip("Mooncake is not installed (pip install mooncake-transfer-engine-non-cuda)")
    out = _recorded_run("mooncake", "mooncake")
    timed = out["timed"]
    assert isinstance(timed, list) and len(timed) == 2  # 256 MiB-like and blocks rows
    for a_warm, b_warm, a, b in timed:
        assert a_warm and b_warm, f"{a} / {b} timed without the same warm-up"
    assert out["rows"] == ["mooncake_pull", "mooncake_pull_blocks", "mooncake_small"]
    notes = out["notes"]
    assert isinstance(notes, list) and all("async wait" in n and "queue 16384" in n
                                           for n in notes), notes


@pytest.mark.timeout(180)
def test_nixl_rows_warm_and_check_every_side_and_both_progress_settings() -> None:
    from datadist.core import nixl_wheel as nixl

    if nixl.available() is None:
        pytest.skip("NIXL is not installed (pip install nixl-cu12)")
    out = _recorded_run("nixl", "nixl")
    timed = out["timed"]
    assert isinstance(timed, list) and len(timed) == 4  # 2 rows x progress thread off / on
    for a_warm, b_warm, a, b in timed:
        assert a_warm and b_warm, f"{a} / {b} timed without the same warm-up"
    rows = out["rows"]
    assert isinstance(rows, list)
    assert {"nixl_pull", "nixl_pull_prog", "nixl_pull_blocks_prog", "nixl_small_prog"} <= set(
        rows)
    notes = out["notes"]
    assert isinstance(notes, list) and any("UCX transports" in n for n in notes), notes


# ----------------------------------------------------------------------------- the chart


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    w, h = struct.unpack(">II", data[16:24])
    return w, h


def test_plot_writes_a_png_with_a_bar_per_row(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from datadist.bench.plot import plot

    out = plot(RESULT, tmp_path / "bench.png")
    w, h = _png_size(out.read_bytes())
    assert w > 300 and h > 100
    fewer = dict(RESULT, rows=RESULT["rows"][:1])  # type: ignore[index]
    _, h1 = _png_size(plot(fewer, tmp_path / "one.png").read_bytes())
    assert h1 < h  # the chart grows with its rows


def test_plot_writes_an_svg_that_parses(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from datadist.bench.plot import plot

    out = plot(RESULT, tmp_path / "bench.svg")
    root = ET.parse(out).getroot()
    assert root.tag.endswith("svg") and float(root.get("width", "0").rstrip("pt")) > 0
    text = out.read_text()
    assert "Mooncake" in text and "TCP pull, 8 MiB" in text  # the rows' titles are drawn


def test_plot_speeds_put_the_limit_at_one_and_right_is_better() -> None:
    from datadist.bench.plot import goal_speed, is_peer, speed

    rows = {r["key"]: r for r in RESULT["rows"]}  # type: ignore[attr-defined]
    assert speed(rows["tcp_pull"]) == pytest.approx(1.2)  # throughput: figure / limit
    assert speed(rows["tcp_small"]) == pytest.approx(0.05)  # time: limit / figure
    assert speed(rows["plan_numpy"]) == pytest.approx(5 / 0.7)  # against its goal
    assert speed(rows["cpp_skipped"]) is None
    assert is_peer(rows["mooncake_pull"]) and not is_peer(rows["tcp_pull"])
    assert goal_speed(rows["tcp_pull"]) == pytest.approx(0.9)  # ">= 0.90x"
    assert goal_speed(rows["tcp_small"]) == pytest.approx(0.5)  # "<= 2.00x" of a time
    assert goal_speed(rows["plan_numpy"]) == 1.0 and goal_speed(rows["mooncake_pull"]) is None


def test_cli_input_replays_a_saved_result_and_plots_it(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    from datadist.bench import main

    saved = tmp_path / "result.json"
    saved.write_text(json.dumps(RESULT))
    png = tmp_path / "chart.png"
    assert main(["--input", str(saved), "--plot", str(png)]) == 0
    assert _png_size(png.read_bytes())[0] > 0
    out = capsys.readouterr().out
    assert "TCP pull, 8 MiB" in out and "note: Mooncake async wait" in out


def test_cli_refuses_a_plot_format_it_cannot_write(capsys: pytest.CaptureFixture[str]) -> None:
    from datadist.bench import main

    with pytest.raises(SystemExit) as e:
        main(["--plot", "chart.jpg", "--only", "plan"])
    assert e.value.code == 2 and "--plot" in capsys.readouterr().err


def test_plot_without_matplotlib_says_what_to_install(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from datadist.bench.plot import plot

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(BenchError, match=r"datadist\[plot\]"):
        plot(RESULT, tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_harness_is_importable_without_matplotlib() -> None:
    """The bench imports matplotlib only when --plot is used."""
    code = ("import sys; import datadist.bench, datadist.bench.runner; "
            "print('matplotlib' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stderr
    assert harness.PAGE > 0


# ----------------------------------------------------------------------------- busy rows


def test_python_work_counts_rounds_and_stops() -> None:
    """The busy rows' thread of Python work (harness.PythonWork): it runs until stopped and
    reports the rounds it did in the time it ran."""
    import threading
    import time

    work = harness.PythonWork().start()
    time.sleep(0.05)
    rounds, secs = work.stop()
    assert rounds > 0 and secs >= 0.05
    assert not any(t.name == "bench-python-work" and t.is_alive()
                   for t in threading.enumerate())


def test_a_run_with_plot_writes_the_chart(tmp_path: Path) -> None:
    """``datadist bench --plot`` after a real (planning-only, in-process) run."""
    pytest.importorskip("matplotlib")
    from datadist.bench import main

    svg = tmp_path / "plan.svg"
    assert main(["--quick", "--repeat", "2", "--only", "plan", "--no-progress", "--plot",
                 str(svg)]) == 0
    root = ET.parse(svg).getroot()
    assert root.tag.endswith("svg") and "plan 100k blocks" in svg.read_text()
