"""Transfers issued now and finished later: the Python engine's asynchronous pulls and pushes.

Who calls: ``Engine.pull_async`` / ``push_async`` issue a :class:`Job` to the engine's
:class:`TransferPool` and hand its :class:`Transfer` to the caller (through the facade's
``datadist.TransferHandle``); ``Engine.close`` closes the pool.

Theory of operation. A serving engine issues many transfers and polls them from one thread
(NIXL's post-then-check pattern), so nothing here starts a thread per transfer: a pool of at
most ``size`` threads per engine, started one by one as queued work needs them (none before
the first transfer), runs the jobs in issue order. A transfer's deadline starts when it is
issued, as a blocking call's does when it is called: a job still queued when its deadline
passes fails with Timeout without moving a byte. ``close`` fails every queued job at once
(Closed: LLM_ENGINE_FINALIZED) and lets the running ones end on their own (the engine closes
their links, so they end soon).

Rule 1: a job's ``finish`` (release the local cache it holds, record metrics) runs exactly
    once, whether the job ran, failed, or was aborted, and before its Transfer says done.
Rule 2: nothing here blocks the issuing thread; ``Transfer.wait`` blocks only its caller, on
    an Event (the GIL released while it waits).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from datadist.core.errors import Closed

#: Threads one engine runs asynchronous transfers on, at most.
POOL_THREADS = 4


class Transfer:
    """One issued transfer, as the engine completes it: ``done()``, ``wait(timeout_s)``,
    ``error()``. Thread-safe; the facade's ``TransferHandle`` wraps it (and the native
    engine's handle has the same three methods)."""

    __slots__ = ("_done", "_error", "what")

    def __init__(self, what: str) -> None:
        self.what = what
        self._done = threading.Event()
        self._error: BaseException | None = None

    def __repr__(self) -> str:
        state = ("running" if not self._done.is_set() else
                 "ok" if self._error is None else f"failed: {self._error!r}")
        return f"<Transfer {self.what} {state}>"

    def done(self) -> bool:
        """True once the transfer has finished, successfully or not. Never blocks."""
        return self._done.is_set()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block up to ``timeout_s`` seconds (None: until it ends); True when finished."""
        return self._done.wait(timeout_s)

    def error(self) -> BaseException | None:
        """Why it failed (a core DatadistError for every failure the engine knows), None
        while running or after success. Never blocks."""
        return self._error if self._done.is_set() else None

    def _finish(self, error: BaseException | None) -> None:
        self._error = error
        self._done.set()


class Job:
    """A queued transfer: ``body`` moves the bytes (raises on failure), ``finish(error)``
    releases what the issue took and records the outcome (Rule 1)."""

    __slots__ = ("body", "finish", "transfer")

    def __init__(self, transfer: Transfer, body: Callable[[], None],
                 finish: Callable[[BaseException | None], None]) -> None:
        self.transfer = transfer
        self.body = body
        self.finish = finish

    def run(self) -> None:
        error: BaseException | None = None
        try:
            self.body()
        except BaseException as e:  # noqa: BLE001 - every failure is the transfer's outcome
            error = e
        self.abort(error)

    def abort(self, error: BaseException | None) -> None:
        try:
            self.finish(error)
        finally:
            self.transfer._finish(error)


class TransferPool:
    """At most ``size`` threads running queued :class:`Job` s in issue order; a thread is
    started only when a job is queued and every started thread is busy."""

    def __init__(self, size: int = POOL_THREADS, name: str = "datadist-transfer") -> None:
        if size < 1:
            raise ValueError(f"a transfer pool needs at least one thread, not {size}")
        self._size = size
        self._name = name
        self._cv = threading.Condition()
        self._queue: deque[Job] = deque()
        self._threads: list[threading.Thread] = []
        self._busy = 0
        self._closed = False

    def __repr__(self) -> str:
        return (f"<TransferPool threads={len(self._threads)}/{self._size} busy={self._busy} "
                f"queued={len(self._queue)}{' closed' if self._closed else ''}>")

    @property
    def threads(self) -> int:
        """Threads started so far (tests)."""
        return len(self._threads)

    def submit(self, job: Job) -> None:
        """Queue ``job``; never blocks. After :meth:`close` the job is aborted at once
        (Closed)."""
        with self._cv:
            if not self._closed:
                self._queue.append(job)
                idle = len(self._threads) - self._busy
                if len(self._queue) > idle and len(self._threads) < self._size:
                    t = threading.Thread(target=self._work, daemon=True,
                                         name=f"{self._name}-{len(self._threads)}")
                    self._threads.append(t)
                    t.start()
                else:
                    self._cv.notify()
                return
        job.abort(Closed("the engine is finalized: the transfer was not started"))

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                job = self._queue.popleft()
                self._busy += 1
            try:
                job.run()
            finally:
                with self._cv:
                    self._busy -= 1

    def close(self) -> None:
        """Fail every queued job (Closed) and let the threads end once idle. Idempotent;
        never blocks beyond the queued jobs' ``finish``. Called by Engine.close first."""
        with self._cv:
            self._closed = True
            queued = list(self._queue)
            self._queue.clear()
            self._cv.notify_all()
        for job in queued:
            job.abort(Closed("the engine was finalized before this transfer started"))

    def join(self, wait: float) -> None:
        """Wait up to ``wait`` s for the running jobs to end (after :meth:`close`; Engine.close
        calls it once the links are closed, which ends running transfers soon)."""
        with self._cv:
            threads = list(self._threads)
        deadline = time.monotonic() + wait
        for t in threads:
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))


__all__ = ["POOL_THREADS", "Job", "Transfer", "TransferPool"]
