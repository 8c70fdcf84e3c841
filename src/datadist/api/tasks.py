"""``CacheTask``: the handle ``transfer_cache_async`` returns."""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from datadist.api.checks import check_int
from datadist.api.status import LLMStatusCode

if TYPE_CHECKING:
    from datadist._core import LayerRun

log = logging.getLogger(__name__)


class CacheTask:
    """Results of an asynchronous layer-wise transfer, one entry per transfer config.

    ``synchronize`` waits for every layer and returns the first failure code (or the task's
    default timeout code if the wait ends first); ``get_results`` returns each config's code,
    None for a config whose layers were never started.

    Who fills it: ``api/async_transfer.py``. Once the core's layer-wise run exists
    (:meth:`_attach`, before the transfer call returns), the caller's wait is the run's own
    (``LayerRun.wait``, without the GIL): the last layer's end wakes the caller directly, and
    the outcomes are the run's. A layer that has not ended ``wait_s`` after the last one did
    is given up on (TIMEOUT for every destination with a layer let go and no outcome), as
    the core ends each layer by its own deadline before that. Without a run (the engine
    finalized first), the outcomes are set by :meth:`_set` and the end by :meth:`_finish`.
    """

    def __init__(self, num_configs: int,
                 default_error: LLMStatusCode = LLMStatusCode.LLM_TIMEOUT) -> None:
        self._results: list[LLMStatusCode | None] = [None] * num_configs
        self._done = threading.Event()
        self._default_error = default_error
        self._lock = threading.Lock()
        self._run: LayerRun | None = None
        self._wait_s = 0.0
        self._warned: set[int] = set()
        self._looped_at: float | None = None  # when the loop thread let its last layer go

    def _attach(self, run: LayerRun, wait_s: float) -> None:
        """The core's run this task waits on (before the task is handed out)."""
        self._run, self._wait_s = run, wait_s

    def _looped(self) -> None:
        """From the loop thread: every layer it will let go is let go (or the run stopped);
        from here the run's own end is what the task waits for."""
        self._looped_at = time.monotonic()

    def _set(self, index: int, code: LLMStatusCode) -> None:
        with self._lock:
            prev = self._results[index]
            if prev is None or prev == LLMStatusCode.LLM_SUCCESS:
                self._results[index] = code

    def _finish(self) -> None:
        self._done.set()

    def _wait(self, timeout_in_millis: int | None) -> bool:
        check_int("timeout_in_millis", timeout_in_millis, "uint32")  # None: wait for the end
        timeout = None if timeout_in_millis is None else timeout_in_millis / 1000
        run = self._run
        if run is None:
            return self._done.wait(timeout)
        over = self._wait_run(run, timeout)
        self._collect(run)
        return over

    def _wait_run(self, run: LayerRun, timeout: float | None) -> bool:
        """Waits for the run to be over, up to ``timeout``; gives it up (abandon: TIMEOUT) once
        the loop thread let its layers go and no layer ended for ``wait_s`` (a layer awaited
        from the user's synchronizer is the user's time, as it always was). True when over or
        given up."""
        now = time.monotonic()
        end = None if timeout is None else now + timeout
        last, since = run.ended(), now
        while True:
            looped = self._looped_at  # the give-up clock runs from the later of the two
            wait = self._wait_s if looped is None else max(since, looped) + self._wait_s - now
            if end is not None:
                wait = min(wait, end - now)
            if run.wait(max(0.0, wait)):
                return True
            now = time.monotonic()
            ended = run.ended()
            if ended != last:
                last, since = ended, now
            elif looped is not None and now - max(since, looped) >= self._wait_s:
                run.abandon(int(LLMStatusCode.LLM_TIMEOUT), "a layer did not end in time")
                return True
            if end is not None and now >= end:
                return False

    def _collect(self, run: LayerRun) -> None:
        """The run's outcomes so far into the results (each failure logged once)."""
        with self._lock:
            for k, got in enumerate(run.results()):
                if got is None:
                    continue
                code, why = got
                if code != LLMStatusCode.LLM_SUCCESS and k not in self._warned:
                    self._warned.add(k)
                    log.warning("transfer_cache_async to destination %d failed: %s", k, why)
                self._results[k] = LLMStatusCode(int(code))

    def synchronize(self, timeout_in_millis: int | None = None) -> LLMStatusCode:
        if not self._wait(timeout_in_millis):
            return self._default_error
        with self._lock:
            for r in self._results:
                if r is not None and r != LLMStatusCode.LLM_SUCCESS:
                    return r
        return LLMStatusCode.LLM_SUCCESS

    def get_results(self, timeout_in_millis: int | None = None) -> list[LLMStatusCode | None]:
        self._wait(timeout_in_millis)
        with self._lock:
            return list(self._results)
