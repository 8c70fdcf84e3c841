"""``TransferHandle``: what ``pull_cache_async`` and its siblings return (a datadist extension).

Who calls: user code and integrations (the vLLM connector) that issue transfers from a
serving loop and poll them, instead of blocking a thread per transfer (NIXL's post-then-check
pattern). ``done()`` and ``status`` never block; ``wait`` blocks its caller only, holding no
lock of datadist's.

The handle is written against :class:`EngineTransfer`, the three methods of the engine's
in-flight transfer (``core/native.py``'s ``NativeHandle``, over the core's), so tests and
tools may hand it anything that has them.
"""

from __future__ import annotations

from typing import Protocol

from datadist.api.status import LLMStatusCode, code_to_status, to_llm_exception
from datadist.core.errors import DatadistError


class EngineTransfer(Protocol):
    """An engine's in-flight transfer, as ``NativeEngine.pull_async`` / ``push_async`` return it.

    Contract: thread-safe; ``done`` and ``error`` never block; ``wait(timeout_s)`` blocks
    its caller up to ``timeout_s`` seconds (None: until the end) without holding anything
    the engine's serving side needs, and returns whether the transfer has finished.
    ``error()`` is None while running and after success; after a failure it is the failure:
    a core ``DatadistError`` (its ``code`` the status) or an ``LLMException``.
    """

    def done(self) -> bool: ...

    def wait(self, timeout_s: float | None = None) -> bool: ...

    def error(self) -> BaseException | None: ...


class TransferHandle:
    """An issued pull or push (datadist extension, beside llm_datadist's blocking calls).

    ``done()`` says whether it has finished (never blocks); ``wait(timeout)`` blocks until it
    has and raises its failure, the LLMException (same status code) the blocking call would
    have raised, LLM_TIMEOUT when its own deadline (``sync_kv_timeout``, counted from the
    call) passed; ``status`` is None while it runs, then ``LLM_SUCCESS`` or the failure's
    code; ``exception()`` is the failure or None. The local cache it reads or writes stays
    held until it finishes (``unregister_cache`` waits for it, as for a blocking call in
    another thread); its memory must stay valid as long as for a blocking call.
    """

    __slots__ = ("_exc", "_func", "_transfer")

    def __init__(self, transfer: EngineTransfer, func: str) -> None:
        self._transfer = transfer
        self._func = func
        self._exc: BaseException | None = None

    def __repr__(self) -> str:
        status = self.status
        state = "running" if status is None else str(status)
        return f"<TransferHandle {self._func} {state}>"

    def done(self) -> bool:
        """True once the transfer has finished, successfully or not. Never blocks."""
        return self._transfer.done()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the transfer finishes, up to ``timeout`` seconds (None: no limit).

        Raises:
            TypeError / ValueError: ``timeout`` not a number, or negative.
            TimeoutError: ``timeout`` passed first; the transfer goes on (wait again, or
                poll ``done()``).
            LLMException: the transfer failed, with the status code the blocking call would
                have raised (LLM_TIMEOUT when its own deadline passed).
        """
        if timeout is not None:
            if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
                raise TypeError(f"timeout should be a number of seconds or None, "
                                f"but got {type(timeout)}")
            if not timeout >= 0:
                raise ValueError(f"timeout should be >= 0, got {timeout}")
        if not self._transfer.wait(None if timeout is None else float(timeout)):
            raise TimeoutError(f"{self._func}: still running after {timeout} s")
        exc = self.exception()
        if exc is not None:
            raise exc

    @property
    def status(self) -> LLMStatusCode | None:
        """None while running; then LLM_SUCCESS or the failure's status code. Never blocks."""
        if not self._transfer.done():
            return None
        exc = self.exception()
        if exc is None:
            return LLMStatusCode.LLM_SUCCESS
        code = getattr(exc, "status_code", LLMStatusCode.LLM_FAILED)
        return code_to_status(int(code))

    def exception(self) -> BaseException | None:
        """The failure (an LLMException for every failure the engine reports), or None
        while running or after success. Never blocks."""
        if self._exc is None and self._transfer.done():
            err = self._transfer.error()
            if isinstance(err, DatadistError):
                exc: BaseException = to_llm_exception(err, self._func)
                exc.__cause__ = err
                self._exc = exc
            else:
                self._exc = err
        return self._exc


__all__ = ["EngineTransfer", "TransferHandle"]
