"""``python -m datadist.bench``: the same as ``datadist bench``."""

import sys

from datadist.bench.runner import main

if __name__ == "__main__":  # the owner is a spawned child: it must not re-run this
    sys.exit(main())
