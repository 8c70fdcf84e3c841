"""``CacheTask`` waiting on the core's layer-wise run (``api/tasks.py``): the caller's wait is
the run's own, and a layer that does not end is given up on by the waiting caller, counted
from when the loop thread let its last layer go (time in the user's synchronizer is the
user's). Driven with a stand-in run whose layers never end; nothing moves."""

from __future__ import annotations

import threading
import time

import datadist as llm
from datadist.api.tasks import CacheTask

S = llm.LLMStatusCode


class StuckRun:
    """A run whose steps never end: ``wait`` returns only once abandoned."""

    def __init__(self) -> None:
        self.abandoned: list[tuple[int, str]] = []
        self._gone = threading.Event()

    def wait(self, timeout_s: float) -> bool:
        return self._gone.wait(timeout_s)

    def ended(self) -> int:
        return 0

    def abandon(self, code: int, why: str) -> None:
        self.abandoned.append((code, why))
        self._gone.set()

    def results(self) -> list[tuple[int, str] | None]:
        return [self.abandoned[0]] if self.abandoned else [None]


def test_a_layer_never_ending_is_given_up_once_the_loop_let_it_go() -> None:
    run = StuckRun()
    task = CacheTask(1)
    task._attach(run, 0.05)  # type: ignore[arg-type]
    # the loop thread is still in the user's synchronizer: the caller's own timeout, no give-up
    t0 = time.monotonic()
    assert task.synchronize(200) == S.LLM_TIMEOUT
    assert time.monotonic() - t0 >= 0.19 and run.abandoned == []
    assert task.get_results(0) == [None]
    task._looped()  # every layer let go: from here wait_s without a layer ending gives up
    t0 = time.monotonic()
    assert task.synchronize(None) == S.LLM_TIMEOUT
    assert time.monotonic() - t0 < 5.0
    assert [code for code, _ in run.abandoned] == [int(S.LLM_TIMEOUT)]
    assert task.get_results(0) == [S.LLM_TIMEOUT]
