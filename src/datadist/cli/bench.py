"""``datadist bench``: the benchmark (datadist/bench), which parses its own options."""

from __future__ import annotations

from typing import Any


def cmd_bench(argv: list[str]) -> int:
    """Run the benchmark with ``argv`` (everything after ``bench``)."""
    from datadist import bench

    return bench.main(argv)


def add_parser(sub: Any) -> None:
    """``bench`` in ``datadist --help``'s list only: main() hands ``bench ...`` to the
    benchmark's own parser (an argparse REMAINDER would not take options that start with a
    dash)."""
    # listed for --help; main() hands `bench ...` to the benchmark's own parser
    sub.add_parser("bench", help="how fast datadist moves caches here, each data path beside "
                                 "its limit (see 'datadist bench --help')")
