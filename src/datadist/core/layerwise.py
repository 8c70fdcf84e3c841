"""Layer-wise asynchronous transfer: send each layer as soon as it is computed.

Who calls: the loop is the round-9 form of ``transfer_cache_async``'s, which now runs its
layers in the core (``api/async_transfer.py`` ``_CoreLoop``, ``cpp/src/session.h``
LayerRun) and uses this module's loop threads and DEPTH; its spans are planned in the core
(``cpp/src/plan.h`` PlanLayerSpans, Session::PrepareLayerPushes). The loop itself stays
for ``python -m datadist.bench.stages --async`` (the two side by side) and its tests. It builds
one :class:`LayerJob` per destination and starts a :class:`LayerwiseTransfer`; one of this
module's loop threads then calls the user's ``synchronize`` for each layer some job needs, in
layer order, and hands that layer to every job that needs it. A job *issues* its layer (the
core's asynchronous push, run on the core's workers) and returns at once, so the loop goes on
to ``synchronize(i+1)`` while layer i's bytes move: the wait for layer i+1 (the user's
computation) and the planning of it overlap layer i's transfer, and consecutive layers reach
the link back to back. The loop thread waits for an issued layer only when ``DEPTH`` layers
are in flight (layer i is synchronized once layer i - DEPTH ended), and at the end.

Rules:

1. ``synchronize(i)`` is called at most once per layer, only for layers some live job needs.
   False aborts every job that needs layer i (PARAM_INVALID, as LLM-DataDist reports it); an
   exception from it aborts them with the task's default error. The transfer stops there:
   no job is sent another layer (rule 2).
2. A job that fails to send a layer reports the error's code, and the whole transfer stops
   there, as LLM-DataDist's (``v2/llm_utils.py`` ``TransferCacheJob.transfer_layers``
   returns at the first failure): no later layer of any job is issued once the failure is
   seen, nor the failing layer to the jobs after it (at most ``DEPTH - 1`` later layers can
   have been issued before an asynchronous failure is seen; they end as they end and change
   nothing). A job stopped before its last layer ended reports nothing (None).
3. Outcomes are settled in layer order: a job's code is that of its first failing layer in
   layer order (an earlier layer still in flight is waited for before a later failure is
   reported), and SUCCESS once its last layer and every one before it ended well. A job
   never started reports nothing (None in ``get_results``). ``done()`` is called once
   every issued layer has ended (or its wait ran out: TIMEOUT).

The loop threads are this module's (:class:`_LoopThreads`), kept between transfers: a
transfer does not pay a thread's start. They call user code (``synchronize``) and so hold
the GIL then; the core's threads never do.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from datadist.core.errors import Code, DatadistError

log = logging.getLogger(__name__)

# Layers issued and not yet seen to end, at most. Layer i is synchronized once layer i - DEPTH
# ended, so with 2 layer i-1 moves while layer i is awaited and planned, and is queued behind
# nothing but layer i-1 once issued: the link stays busy back to back. More would only let
# more layers go out after a failure nobody has seen yet.
DEPTH = 2
IDLE_KEEP = 30.0  # s an idle loop thread waits for the next transfer before it exits


class Pending(Protocol):
    """An issued layer (``NativeHandle`` and what :class:`LayerJob` sends return)."""

    def done(self) -> bool: ...  # never blocks

    def wait(self, timeout_s: float | None = None) -> bool: ...  # blocks, without the GIL

    def error(self) -> DatadistError | None: ...  # once ended


class Ended:
    """An outcome known when the layer was issued: success, or the error that refused it (a
    refusal of the engine's, a synchronizer's answer). A job's ``send`` may return one among
    the parts of a layer it could issue only in part."""

    def __init__(self, error: DatadistError | None = None) -> None:
        self._error = error

    def done(self) -> bool:
        return True

    def wait(self, timeout_s: float | None = None) -> bool:
        return True

    def error(self) -> DatadistError | None:
        return self._error


class _All:
    """Several issued transfers of one layer of one job (a raw-address destination sends each
    tensor apart): ended when all ended, failed with the first failure in order."""

    def __init__(self, parts: Sequence[Pending]) -> None:
        self.parts = list(parts)

    def done(self) -> bool:
        return all(p.done() for p in self.parts)

    def wait(self, timeout_s: float | None = None) -> bool:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for p in self.parts:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not p.wait(left):
                return False
        return True

    def error(self) -> DatadistError | None:
        for p in self.parts:
            err = p.error()
            if err is not None:
                return err
        return None


@dataclass(frozen=True)
class LayerJob:
    """One destination: the source layers it takes (ascending) and how to send one.

    ``send(i)`` issues source layer i and returns what says when it ended (a
    :class:`Pending`, or several for one layer), or None when it ended in the call
    (successfully); it raises DatadistError for a layer it cannot issue. It is called on the
    loop thread and must not block on the transfer."""

    layers: Sequence[int]
    send: Callable[[int], Pending | Sequence[Pending] | None]


class _LoopThreads:
    """The threads layer-wise transfers run their loops on: one per transfer running, each
    kept IDLE_KEEP seconds after its transfer for the next one. Thread-safe; :meth:`run`
    never blocks."""

    def __init__(self, keep_s: float = IDLE_KEEP) -> None:
        self._cond = threading.Condition()
        self._work: deque[Callable[[], None]] = deque()
        self._idle = 0
        self._keep_s = keep_s

    def run(self, fn: Callable[[], None]) -> None:
        with self._cond:
            if self._idle > len(self._work):  # a waiting thread takes it
                self._work.append(fn)
                self._cond.notify()
                return
        threading.Thread(target=self._serve, args=(fn,), name="datadist-layerwise",
                         daemon=True).start()

    def _serve(self, fn: Callable[[], None]) -> None:
        while True:
            try:
                fn()
            except Exception:  # the loop reports its own failures; this is a bug
                log.exception("layer-wise transfer loop failed")
            with self._cond:
                self._idle += 1
                self._cond.wait_for(lambda: bool(self._work), timeout=self._keep_s)
                self._idle -= 1
                if not self._work:
                    return
                fn = self._work.popleft()


    def forked(self) -> None:
        """In a child after fork: the parent's loop threads do not exist here."""
        self._cond = threading.Condition()
        self._work.clear()
        self._idle = 0


_THREADS = _LoopThreads()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: _THREADS.forked())


class LayerwiseTransfer:
    """Runs the jobs on a loop thread. ``report(index, code)`` and ``done()`` are called
    from that thread; they must not block. ``wait_s``: how long an issued layer is waited
    for at most (None: until it ends; the core ends every transfer by its own deadline); one
    that does not end by then is reported TIMEOUT."""

    def __init__(
        self,
        num_layers: int,
        synchronize: Callable[[int], bool],
        jobs: Sequence[LayerJob],
        report: Callable[[int, Code], None],
        done: Callable[[], None],
        sync_error: Code = Code.TIMEOUT,
        wait_s: float | None = None,
    ) -> None:
        self.num_layers = num_layers
        self._synchronize = synchronize
        self._jobs = list(jobs)
        self._report = report
        self._done = done
        self._sync_error = sync_error
        self._wait_s = wait_s
        n = len(self._jobs)
        self._wanted = [set(j.layers) for j in self._jobs]
        self._last = [j.layers[-1] if len(j.layers) else -1 for j in self._jobs]
        self._issuing = [bool(w) for w in self._wanted]  # may issue more layers
        self._settled = [False] * n  # its code reported
        # issued layers not yet settled, in layer order: (layer, [(job, pending)])
        self._inflight: deque[tuple[int, list[tuple[int, Pending]]]] = deque()

    def start(self) -> LayerwiseTransfer:
        """Hands the loop to a loop thread; returns at once."""
        _THREADS.run(self._run)
        return self

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            try:
                while self._inflight:
                    self._settle_oldest()
            finally:
                self._done()

    def _loop(self) -> None:
        for layer in range(self.num_layers):
            self._reap()  # failures seen so far stop their jobs before this layer
            needing = [k for k, w in enumerate(self._wanted) if self._issuing[k] and layer in w]
            if not needing:
                continue
            while len(self._inflight) >= DEPTH:  # at most DEPTH - 1 moving while we wait
                self._settle_oldest()
            needing = [k for k in needing if self._issuing[k]]  # a failure just seen
            if not needing:
                continue
            try:
                ready = bool(self._synchronize(layer))
                code = Code.PARAM_INVALID
            except Exception:  # user code: report, never kill the thread silently
                log.exception("synchronize_layer(%d) raised", layer)
                ready, code = False, self._sync_error
            issued: list[tuple[int, Pending]] = []
            if not ready:
                log.warning("layer %d was not synchronized: %d destination(s) aborted",
                            layer, len(needing))
                refused = DatadistError(f"layer {layer} was not synchronized", code=code)
                for k in needing:
                    issued.append((k, Ended(refused)))
                self._stop()
            else:
                for k in needing:
                    if self._issuing[k]:  # not if an earlier job's failed at this layer
                        issued.append((k, self._issue(k, layer)))
            self._inflight.append((layer, issued))

    def _stop(self) -> None:
        """A failure: no job is sent another layer (rule 2)."""
        self._issuing = [False] * len(self._issuing)

    def _issue(self, k: int, layer: int) -> Pending:
        try:
            got = self._jobs[k].send(layer)
        except DatadistError as e:  # logged when settled, in layer order
            self._stop()
            return Ended(e)
        except Exception as e:  # a bug: this transfer stops, the loop thread goes on
            log.exception("sending layer %d to destination %d failed", layer, k)
            self._stop()
            return Ended(DatadistError(f"{type(e).__name__}: {e}", code=Code.FAILED))
        if got is None:
            return Ended()
        parts = list(got) if isinstance(got, Sequence) else [got]
        if any(p.done() and p.error() is not None for p in parts):
            self._stop()  # refused in part, or failed at once: no later layer
        return _All(parts) if len(parts) != 1 else parts[0]

    def _reap(self) -> None:
        """Settles the oldest issued layers that have ended, never blocking."""
        while self._inflight and all(p.done() for _, p in self._inflight[0][1]):
            self._settle_oldest()

    def _settle_oldest(self) -> None:
        """Waits for the oldest issued layer (without the GIL, up to ``wait_s``) and reports
        what it decides: a job's first failure, or its success at its last layer."""
        layer, issued = self._inflight.popleft()
        for k, pending in issued:
            # done() first: a wait hands the GIL away, and a busy interpreter takes up to its
            # switch interval to give it back; most layers have ended by now
            if pending.done() or pending.wait(self._wait_s):
                err = pending.error()
                code = Code.SUCCESS if err is None else err.code
            else:
                code = Code.TIMEOUT
            if self._settled[k]:
                continue  # failed at an earlier layer: reported then
            if code != Code.SUCCESS:
                log.warning("sending layer %d to destination %d failed: %s", layer, k,
                            pending.error() or "not ended in time")
                self._stop()
                self._settled[k] = True
                self._report(k, code)
            elif layer == self._last[k]:
                self._settled[k] = True
                self._report(k, Code.SUCCESS)


__all__ = ["DEPTH", "Ended", "LayerJob", "LayerwiseTransfer", "Pending"]
