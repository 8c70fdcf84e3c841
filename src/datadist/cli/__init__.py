"""The ``datadist`` command: ``demo`` (the main job), ``info``, ``probe``, ``bench``, one
module each (cli/demo.py, info.py, probe.py, bench.py); this module parses the command line,
runs the command and turns every failure into one line and an exit code.

The console entry point is ``datadist.cli:main`` (pyproject); ``python -m datadist.cli`` runs
the same (cli/__main__.py).
"""

from __future__ import annotations

import os
import sys

from datadist.argparsing import OneLineParser
from datadist.cli import bench, demo, info, probe
from datadist.cli.common import CliError, one_line
from datadist.cli.info import metrics_lines

__all__ = ["CliError", "main", "metrics_lines"]


def main(argv: list[str] | None = None) -> int:
    """Run one command. Every failure is one line on stderr and a non-zero exit code
    (argument errors 2, the rest 1); DATADIST_DEBUG=1 shows the traceback as well."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("datadist: interrupted", file=sys.stderr)
        return 130
    except SystemExit:
        raise
    except Exception as e:  # noqa: BLE001 - the CLI's one place that reports errors
        if os.environ.get("DATADIST_DEBUG") == "1":
            import traceback

            traceback.print_exc()
        print(f"datadist: error: {one_line(e)}", file=sys.stderr)
        return 1


def _version() -> str:
    from datadist import __version__

    return __version__


def _main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["demo"] and "--llm" in argv:
        # The transformer demo has its own options (some share names with the main demo's).
        from datadist.demos import llm

        rest = [a for a in argv[1:] if a != "--llm"]
        return llm.main(rest)
    if argv[:1] == ["bench"]:
        # The benchmark parses its own options (--help included); an argparse REMAINDER
        # would not take the ones that start with a dash.
        return bench.cmd_bench(argv[1:])
    parser = OneLineParser(
        prog="datadist", description="datadist: the LLM-DataDist KV-cache transfer API for "
        "Linux hosts. Commands: demo (the main job), info, probe, bench.",
        epilog="Start with 'datadist demo'; 'datadist COMMAND --help' tells more.")
    parser.add_argument("--version", action="version", version=f"datadist {_version()}")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    for command in (demo, info, probe, bench):
        command.add_parser(sub)
    if not argv:  # a bare 'datadist' shows what it can do instead of an error
        parser.print_help()
        return 0
    args = parser.parse_args(argv)
    if args.cmd == "demo":
        demo.check_memory(args)
    if args.cmd in ("info", "probe") and not 0 < args.timeout <= 3600:
        parser.error(f"argument --timeout: {args.timeout} is out of range (0, 3600]")
    return int(args.fn(args))

