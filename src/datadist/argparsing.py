"""The argument parser of every ``datadist`` command (``datadist``, ``bench``, ``demo --llm``).

Who calls: cli.py, bench/runner.py and demos/llm.py, when they parse their arguments; it
prints and exits on a bad argument, as argparse does.
"""

from __future__ import annotations

import argparse
from typing import NoReturn


class OneLineParser(argparse.ArgumentParser):
    """argparse, with its errors on one line (exit code 2), not usage plus error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")
