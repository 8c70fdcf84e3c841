"""``CacheTask``: the handle ``transfer_cache_async`` returns."""

from __future__ import annotations

import threading

from datadist.api.checks import check_int
from datadist.api.status import LLMStatusCode


class CacheTask:
    """Results of an asynchronous layer-wise transfer, one entry per transfer config.

    ``synchronize`` waits for every layer and returns the first failure code (or the task's
    default timeout code if the wait ends first); ``get_results`` returns each config's code,
    None for a config whose layers were never started.
    """

    def __init__(self, num_configs: int,
                 default_error: LLMStatusCode = LLMStatusCode.LLM_TIMEOUT) -> None:
        self._results: list[LLMStatusCode | None] = [None] * num_configs
        self._done = threading.Event()
        self._default_error = default_error
        self._lock = threading.Lock()

    def _set(self, index: int, code: LLMStatusCode) -> None:
        with self._lock:
            prev = self._results[index]
            if prev is None or prev == LLMStatusCode.LLM_SUCCESS:
                self._results[index] = code

    def _finish(self) -> None:
        self._done.set()

    def _wait(self, timeout_in_millis: int | None) -> bool:
        check_int("timeout_in_millis", timeout_in_millis, "uint32")  # None: wait for the end
        return self._done.wait(None if timeout_in_millis is None else timeout_in_millis / 1000)

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
