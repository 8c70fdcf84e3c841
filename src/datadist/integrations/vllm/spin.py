"""Keep the Python engine's threads alive inside a vLLM worker process (no vLLM import at
load time).

Who calls: the connector's WORKER instance, once, in the worker process, after its datadist
engine has started (:func:`share_gil_for`). Nothing blocks.

Only the Python engine needs this: its serving and transfer threads run Python and wait for
the GIL. The native engine (``engine.native`` True) never takes the GIL on its threads, so
vLLM's loop is left alone with it.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from typing import Any

SPIN_MODULE = "vllm.distributed.device_communicators.shm_broadcast"


def share_gil_for(engine: object, active: Callable[[], bool], sleep_s: float) -> bool:
    """:func:`share_gil_while` for the Python engine only; with a native engine
    (``engine.native`` True) vLLM's loop is not touched. Returns whether it was patched."""
    if getattr(engine, "native", False):
        return False
    return share_gil_while(active, sleep_s)


def share_gil_while(active: Callable[[], bool], sleep_s: float) -> bool:
    """Make vLLM's worker loop give other Python threads of this process the GIL while
    ``active()`` says datadist has work.

    vLLM's worker polls its message queue in a tight loop of ``os.sched_yield()``, which
    releases the GIL for well under a microsecond: a thread waiting for the GIL is woken at
    each release but loses the race to take it, and since it was woken rather than timed
    out it never asks the holder to drop the GIL; datadist's serving and pulling threads
    (pure Python) starved for seconds that way while the engine stepped. While datadist is
    active the loop sleeps ``sleep_s`` instead, long enough for a waiting thread to take
    the GIL. Returns whether vLLM's loop was found.
    """
    try:
        shm_broadcast: Any = importlib.import_module(SPIN_MODULE)  # vLLM: untyped
    except ImportError:
        return False
    original = getattr(shm_broadcast, "sched_yield", None)
    if original is None or sleep_s <= 0:
        return False
    plain = getattr(original, "__wrapped__", original)

    def sched_yield() -> None:
        if active():
            time.sleep(sleep_s)
        else:
            plain()

    # A function attribute (as functools.wraps sets it): mypy does not model those.
    sched_yield.__wrapped__ = plain  # type: ignore[attr-defined]
    shm_broadcast.sched_yield = sched_yield
    return True
