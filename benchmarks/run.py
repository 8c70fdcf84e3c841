#!/usr/bin/env python3
"""Run datadist's benchmark: ``python benchmarks/run.py [--quick] [--json PATH] ...``.

The same as ``datadist bench``; see benchmarks/README.md for what each row means.
"""

from __future__ import annotations

import sys

from datadist.bench import main

if __name__ == "__main__":  # the owner is a spawned child: it must not re-run this
    sys.exit(main())
