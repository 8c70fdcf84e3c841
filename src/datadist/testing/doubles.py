"""Small test doubles the test suites share.

Who uses it: tests only (the GIL tests, the copy tests, the transfer_cache_async tests).
Nothing here blocks beyond what its docstring says.
"""

from __future__ import annotations

import threading
from typing import Any


class BusyCounter:
    """A pure-Python thread counting loop steps until the ``with`` block ends. It runs only
    while it holds the GIL, so ``steps`` tells how much the interpreter let it run. Its exit
    joins the thread (at most 10 s)."""

    def __init__(self) -> None:
        self.steps = 0
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop:
            self.steps += 1

    def __enter__(self) -> BusyCounter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop = True
        self._thread.join(10)


class Spy:
    """An object standing in for ``real`` with some attributes replaced (``replaced``); every
    other attribute is the real one's. For objects whose bound methods are read-only (the
    core's engine)."""

    def __init__(self, real: Any, **replaced: Any) -> None:
        self._real = real
        self.__dict__.update(replaced)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


__all__ = ["BusyCounter", "Spy"]
