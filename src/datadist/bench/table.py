"""The benchmark's table: what ``datadist bench`` prints, from a result of
:func:`datadist.bench.runner.run` (or its saved JSON, ``--input``).

Who calls: ``runner.main`` and ``runner._replay``, once per run; pure formatting, never blocks.

Every line fits in :data:`WIDTH` columns (long row titles wrap within their column, the
notes wrap too) and every column has a name. One ratio direction throughout: the ``x limit``
column is the row's speed against its limit, higher is better, 1.00x is the limit (figure /
limit for a throughput, limit / figure for a time), and the goals are stated on that scale.
The limit column has the figure's unit; the limits' names are footnotes (``[1]`` under the
table), so the table stays narrow.
"""

from __future__ import annotations

import textwrap
from typing import Any

from datadist.bench.plot import goal_speed, speed

WIDTH = 100
HEAD = ("row", "path", "figure", "limit", "x limit", "goal", "verdict")
GAP = "  "


def _figure(row: dict[str, Any], value: float) -> str:
    unit = row["unit"]
    if unit == "us":
        q = "p99" if row["key"].endswith("_p99") else "p50"
        return f"{value:.0f} us {q}"
    return f"{value:.2f} {unit}"


def _goal(row: dict[str, Any]) -> str:
    """The row's goal on the ``x limit`` scale (">= 0.50x"), or its word ("reported")."""
    g = goal_speed(row)
    if g is None:
        return str(row.get("goal") or "-")
    if row.get("unit") == "ms":  # planning: its goal is a time, and the row's limit
        return str(row["goal"])
    return f">= {g:.2f}x"


def _cells(result: dict[str, Any], notes: dict[str, int]) -> list[tuple[str, ...]]:
    """One tuple of cells per row; the limits' names numbered into ``notes``."""
    lines: list[tuple[str, ...]] = []
    for r in result["rows"]:
        if not r["unit"]:  # a group that could not run here; its reason is a note below
            lines.append((r["title"], "-", "skipped", "-", "-", "-", "-"))
            continue
        lim = "-"
        if r.get("limit") is not None:
            n = notes.setdefault(str(r.get("limit_title") or "limit"), len(notes) + 1)
            lim = f"{r['limit']:.0f} [{n}]" if r["unit"] == "us" else f"{r['limit']:.2f} [{n}]"
        elif r["unit"] == "ms":
            lim = "(goal)"
        v = speed(r)
        ratio = f"{v:.2f}x" if v is not None else "-"
        # Goals hold for full-size transfers only: a smaller run judges none (note below).
        verdict = ("ok" if r["met"] else "MISSED") if result["at_goal_size"] else "not judged"
        lines.append((r["title"], r.get("path") or "-", _figure(r, r["figure"]), lim, ratio,
                      _goal(r), verdict))
    return lines


def format_table(result: dict[str, Any]) -> str:
    """The human-readable table of a result, at most :data:`WIDTH` columns wide."""
    notes: dict[str, int] = {}
    lines = _cells(result, notes)
    widths = [max(len(str(x[i])) for x in [HEAD, *lines]) for i in range(len(HEAD))]
    # the row titles take what the other columns leave, and wrap within it
    widths[0] = max(16, min(widths[0], WIDTH - sum(widths[1:]) - len(GAP) * (len(HEAD) - 1)))
    out = textwrap.wrap(f"datadist bench: median of {result['repeat']}, {result['seconds']} s; "
                        f"{result['alignment']}", WIDTH, subsequent_indent="  ")
    out.append("limit: the same work without datadist (in the figure's unit; [n]: named below); "
               "x limit: the row's speed against it, higher is better, 1.00x = the limit")
    for i, line in enumerate([HEAD, *lines]):
        title = textwrap.wrap(str(line[0]), widths[0]) or [""]
        first = (title[0], *line[1:])
        out.append(GAP.join(str(c).ljust(w) for c, w in zip(first, widths, strict=True))
                   .rstrip())
        out.extend(f"  {rest}" for rest in textwrap.wrap(" ".join(title[1:]), widths[0] - 2))
        if i == 0:
            out.append(GAP.join("-" * w for w in widths))
    for name, n in notes.items():
        out.extend(textwrap.wrap(f"[{n}] {name}", WIDTH, subsequent_indent="    "))
    if not result["at_goal_size"]:
        out.append("note: no goal is judged in this run: its transfers are smaller than 256 MiB "
                   "/ 8192 blocks, where fixed costs weigh more than the goals allow for; run "
                   "without --quick/--size to judge them")
    out.extend(result["peers"])
    reasons = dict.fromkeys(r.get("note") for r in result["rows"] if r.get("note"))
    out.extend(f"note: {n}" for n in reasons)  # a skipped group's reason, how a peer was driven
    return "\n".join(wrapped for line in out for wrapped in _wrap(line))


def _wrap(line: str) -> list[str]:
    """``line`` in lines of at most WIDTH columns."""
    if len(line) <= WIDTH:
        return [line]
    return textwrap.wrap(line, WIDTH, subsequent_indent="  ")
