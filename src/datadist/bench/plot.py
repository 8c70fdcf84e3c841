"""The benchmark's chart: every row against its limit (or beside its peer), one bar a row.

Who calls: :func:`datadist.bench.runner.main` with ``--plot PATH``, after a run (or with
``--input JSON``, on a saved result). Blocks while matplotlib draws (about a second). The
format follows the suffix: ``.png`` or ``.svg``.

matplotlib is an optional dependency (``pip install 'datadist[plot]'``), imported only here,
only when a chart is asked for; without it :func:`plot` raises BenchError saying what to
install.

Each bar is a row's speed relative to its limit: figure / limit for throughputs, limit /
figure for times (so right is always better, and 1.0 is the limit), the table's ``x limit``
column. Rows held against a peer library (Mooncake, NIXL with its progress thread on,
datadist's own best path) are drawn in another colour: there 1.0 is the peer, not a limit.
The legend names only the colours and marks the chart draws. Planning rows have no limit; they are
drawn against their goal. The x axis is logarithmic: ratios run from a few hundredths (a
Python small pull against a bare round trip) to a few units.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from datadist.bench.harness import BenchError

FORMATS = (".png", ".svg")
PEER_WORDS = ("Mooncake", "progress thread on", "beside datadist")
PLOT_MISSING = "--plot needs matplotlib: pip install 'datadist[plot]'"
LIMIT_COLOUR, PEER_COLOUR, GOAL_COLOUR = "#3a6ea5", "#d08c2c", "#c0392b"


def plot_available() -> bool:
    """Whether :func:`plot` can draw here (matplotlib importable). ``runner.main`` asks
    before measuring anything, so that a run does not end in an install hint. Looks the
    module up without importing it (a fraction of a millisecond)."""
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def speed(row: dict[str, Any]) -> float | None:
    """A row's speed relative to its limit (right is better), or None if it has none."""
    fig, lim = row.get("figure"), row.get("limit")
    if not row.get("unit") or not fig:
        return None
    if row["unit"] == "ms":  # planning: against its goal ("< 5 ms")
        try:
            goal = float(str(row.get("goal", "")).split()[1])
        except (IndexError, ValueError):
            return None
        return goal / float(fig)
    if not lim:
        return None
    return float(lim / fig) if row["unit"] == "us" else float(fig / lim)


def goal_speed(row: dict[str, Any]) -> float | None:
    """A row's goal on the same scale as :func:`speed` (">= 0.90x" -> 0.9, "<= 2.00x" for a
    time -> 0.5, "< 5 ms" -> 1.0), or None for a reported row."""
    parts = str(row.get("goal", "")).split()
    if row.get("unit") == "ms":  # "< 5 ms": the speed scale is already goal / figure
        return 1.0 if parts[:1] == ["<"] else None
    if len(parts) != 2:
        return None
    try:
        g = float(parts[1].rstrip("x"))
    except ValueError:
        return None
    if g <= 0:
        return None
    return 1 / g if row.get("unit") == "us" else g


def is_peer(row: dict[str, Any]) -> bool:
    """Whether the row's comparison is a peer (reported side by side), not a limit."""
    text = f"{row.get('title', '')} {row.get('limit_title', '')}"
    return row.get("goal") == "reported" and any(w in text for w in PEER_WORDS)


def plot(result: dict[str, Any], path: str | Path) -> Path:
    """Draw ``result`` (what :func:`datadist.bench.runner.run` returns, or its JSON) to
    ``path``. Raises ValueError for a suffix other than .png / .svg, BenchError without
    matplotlib or without a row to draw."""
    out = Path(path)
    if out.suffix.lower() not in FORMATS:
        raise ValueError(f"--plot writes {' or '.join(FORMATS)}, not {out.suffix or 'no suffix'!r}")
    rows: list[tuple[dict[str, Any], float]] = []
    for r in result.get("rows", []):
        v = speed(r)
        if v is not None and math.isfinite(v) and v > 0:
            rows.append((r, v))
    if not rows:
        raise BenchError("no row with a figure and a limit to draw")
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FixedFormatter, FixedLocator, NullFormatter
    except ImportError as e:
        raise BenchError(PLOT_MISSING) from e

    height = 1.2 + 0.26 * len(rows)
    fig, ax = plt.subplots(figsize=(9.5, height), dpi=100)
    try:
        labels = [f"{r['title']} [{r.get('path') or '-'}]" for r, _ in rows]
        values = [v for _, v in rows]
        peers = [is_peer(r) for r, _ in rows]
        ys = list(range(len(rows)))[::-1]
        ax.barh(ys, values, color=[PEER_COLOUR if p else LIMIT_COLOUR for p in peers],
                height=0.7)
        ax.axvline(1.0, color="black", linewidth=1)
        ax.set_xscale("log")
        ax.set_yticks(ys)
        ax.set_yticklabels(labels, fontsize=7)
        for y, v in zip(ys, values, strict=True):
            ax.text(v, y, f" {v:.2f}x", va="center", fontsize=6)
        goals = [(y, goal_speed(r)) for y, (r, _) in zip(ys, rows, strict=True)]
        gy = [y for y, g in goals if g is not None]
        ax.plot([g for _, g in goals if g is not None], gy, linestyle="none", marker="|",
                markersize=11, markeredgewidth=2, color=GOAL_COLOUR)
        entries = legend_entries(any(not p for p in peers), any(peers), bool(gy))
        ax.legend(handles=_legend_handles(entries), loc="lower right", fontsize=7)
        ax.set_xlabel("speed against the limit" + (" (or the peer)" if any(peers) else "")
                      + ": right is better, 1.0 = the limit", fontsize=7)
        size = result.get("sizes", {}).get("contig_bytes", 0) >> 20
        ax.set_title(f"datadist bench {result.get('datadist_version', '')}: {size} MiB, "
                     f"median of {result.get('repeat', '?')}, "
                     f"{result.get('host', {}).get('cpus', '?')} CPUs", fontsize=9)
        ax.tick_params(axis="x", labelsize=7)
        lo, hi = min(min(values) / 1.5, 0.5), max(max(values) * 1.8, 2.0)
        ax.set_xlim(lo, hi)
        ticks = [t for t in (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20) if lo <= t <= hi]
        ax.xaxis.set_major_locator(FixedLocator(ticks))
        ax.xaxis.set_major_formatter(FixedFormatter([f"{t:g}" for t in ticks]))
        ax.xaxis.set_minor_formatter(NullFormatter())
        fig.tight_layout()
        if out.suffix.lower() == ".png":
            _save_small_png(fig, out)
        else:
            fig.savefig(out)
    finally:
        plt.close(fig)
    return out


def legend_entries(limits: bool, peers: bool, goals: bool) -> list[tuple[str, str]]:
    """The legend's entries, (colour, label): one per kind of mark the chart draws, none for a
    kind it does not draw (a chart of limit rows names no peer colour)."""
    entries = []
    if limits:
        entries.append((LIMIT_COLOUR, "against its limit"))
    if peers:
        entries.append((PEER_COLOUR, "beside a peer (1.0 = the peer)"))
    if goals:
        entries.append((GOAL_COLOUR, "goal"))
    return entries


def _legend_handles(entries: list[tuple[str, str]]) -> list[Any]:
    """matplotlib's handles for :func:`legend_entries`: a bar's patch, or the goal's tick."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    return [Line2D([], [], color=colour, marker="|", linestyle="none", markersize=11,
                   markeredgewidth=2, label=label) if colour == GOAL_COLOUR
            else Patch(color=colour, label=label) for colour, label in entries]


def _save_small_png(fig: Any, out: Path) -> None:
    """A palette PNG (a few colours suffice for bars and text): a third of the RGBA file's
    size, small enough to commit. Pillow comes with matplotlib."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    buf.seek(0)
    with Image.open(buf) as img:
        img.convert("RGB").quantize(colors=32).save(out, format="PNG", optimize=True)
