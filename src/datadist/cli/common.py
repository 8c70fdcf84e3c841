"""What every ``datadist`` command shares: the one-line error (CliError) and argument types."""

from __future__ import annotations

import argparse
from collections.abc import Callable


class CliError(Exception):
    """A failure the CLI reports as one line (and exit code 1), without a traceback."""


def one_line(e: BaseException) -> str:
    """``e`` as the one line ``datadist: error: ...`` prints (its type named unless it is a
    CliError, whose text is already for the user)."""
    text = " ".join(str(e).split()) or type(e).__name__
    return text if isinstance(e, CliError) else f"{type(e).__name__}: {text}"


def count(lo: int, hi: int) -> Callable[[str], int]:
    """An argparse type: an int in [lo, hi]."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{value} is out of range [{lo}, {hi}]")
        return value

    parse.__name__ = "int"
    return parse
