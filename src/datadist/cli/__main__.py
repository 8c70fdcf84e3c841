"""``python -m datadist.cli``: the ``datadist`` command."""

from datadist.cli import main

raise SystemExit(main())
