"""Peer processes for tests: run a function in a fresh interpreter and talk to it.

Who calls: tests and benchmarks that need a real second process (a PROMPT serving caches, a
fake owner misbehaving on the wire). Nothing in ``datadist`` proper imports this module.

A :class:`Peer` starts ``target(link, *args)`` in a child made with multiprocessing's
``spawn`` context, so the child is a fresh interpreter that imports datadist exactly as a
client would (no state inherited from the test process, no forked threads or locks). The
parent and the child share one duplex pipe:

* the child reports with ``link.send(obj)`` (for example the address it listens on) and
  can take commands with :func:`serve`;
* whatever the child raises comes back as its formatted traceback, and the parent raises
  :class:`PeerError` carrying it, so a failure in the child reads like a failure in the test;
* a child that dies or goes quiet makes the parent raise :class:`PeerDied` or
  :class:`PeerTimeout`, never hang: every wait in the parent takes a timeout.

Teardown is guaranteed: ``close()`` (or leaving the ``with`` block) asks the child to stop,
then SIGKILLs it (SIGTERM is no good: a SIGSTOPped child would hold it pending forever). Peers
still alive when the interpreter exits are killed by an ``atexit`` hook, and a child kills
itself when its parent dies (``PR_SET_PDEATHSIG``), so an aborted test run leaves no strays.
Start peers from the main thread: the kernel sends the death signal when the *thread* that
started the child exits.

Not thread-safe: one thread talks to one peer. A script (not pytest) that starts peers needs
the usual spawn guard, ``if __name__ == "__main__":``, around its own code.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection
from typing import Any

__all__ = [
    "Peer",
    "PeerDied",
    "PeerError",
    "PeerLink",
    "PeerTimeout",
    "serve",
]

_CTX = mp.get_context("spawn")
_PR_SET_PDEATHSIG = 1

# Frames on the pipe are (tag, payload) tuples. Child to parent:
_MSG = "msg"  # link.send(obj)
_REPLY = "reply"  # a command served by serve() returned: payload = (seq, value)
_FAIL = "fail"  # a command served by serve() raised: payload = (seq, traceback text)
_RAISE = "raise"  # the target itself raised: payload = traceback text; the child exits
_RETURN = "return"  # the target returned: payload = its value; the child exits
# Parent to child:
_CALL = "call"  # (seq, op, kwargs); seq pairs a reply with its call
_STOP = "stop"


class PeerError(AssertionError):
    """The peer raised. ``remote_traceback`` is the child's traceback, also in ``str()``.

    An AssertionError so that pytest shows it as a test failure with the child's traceback
    in the report.
    """

    def __init__(self, message: str, remote_traceback: str = "") -> None:
        text = message if not remote_traceback else (
            f"{message}\n\n--- traceback in the peer process ---\n{remote_traceback.rstrip()}"
        )
        super().__init__(text)
        self.remote_traceback = remote_traceback


class PeerDied(PeerError):
    """The peer exited (or was killed) while we waited for it."""


class PeerTimeout(PeerError):
    """The peer sent nothing before the timeout."""


class PeerLink:
    """The child's end of the pipe. Created by :class:`Peer`, handed to the target."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn

    def send(self, obj: Any) -> None:
        """Report ``obj`` (picklable) to the parent. Blocks only if the pipe is full."""
        self._conn.send((_MSG, obj))

    def recv(self, timeout: float | None = None) -> tuple[str, Any]:
        """Next (tag, payload) from the parent; raises EOFError when the parent is gone and
        TimeoutError after ``timeout`` seconds (None: wait as long as the parent lives)."""
        if timeout is not None and not self._conn.poll(timeout):
            raise TimeoutError("the parent sent nothing")
        message: tuple[str, Any] = self._conn.recv()
        return message

    def _put(self, tag: str, payload: Any) -> None:
        self._conn.send((tag, payload))


def serve(link: PeerLink, ops: Mapping[str, Callable[..., Any]]) -> None:
    """Run a command loop in the child until the parent sends stop or goes away.

    Each :meth:`Peer.call` names an op in ``ops`` and its keyword arguments; the op's return
    value goes back to the parent, and an exception goes back as its traceback (the loop
    keeps serving: one failed command does not take the peer down).
    """
    while True:
        try:
            tag, payload = link.recv()
        except (EOFError, OSError):
            return
        if tag == _STOP:
            return
        seq, op, kwargs = payload
        try:
            fn = ops[op]
        except KeyError:
            link._put(_FAIL, (seq, f"KeyError: unknown op {op!r}; known: {sorted(ops)}\n"))
            continue
        try:
            result = fn(**kwargs)
        except BaseException:  # noqa: BLE001 - everything goes back to the parent
            link._put(_FAIL, (seq, traceback.format_exc()))
        else:
            link._put(_REPLY, (seq, result))


def _die_with_parent(parent_pid: int) -> None:
    """Ask the kernel to SIGKILL us when our parent goes; exit if it already went."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)


def _child_main(
    conn: Connection,
    target: Callable[..., Any],
    args: tuple[Any, ...],
    env: Mapping[str, str | None],
    parent_pid: int,
) -> None:
    _die_with_parent(parent_pid)
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    link = PeerLink(conn)
    try:
        result = target(link, *args)
    except BaseException:  # noqa: BLE001
        with contextlib.suppress(Exception):
            link._put(_RAISE, traceback.format_exc())
        sys.exit(1)
    with contextlib.suppress(Exception):
        link._put(_RETURN, result)


# Strong references on purpose: a peer nobody closed must still be killed at exit.
_live: set[Peer] = set()


def _all_threads_stopped(pid: int) -> bool:
    """Every thread of ``pid`` in state T (stopped) or gone."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return True
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            continue
        if state not in ("T", "t", "Z", "X"):
            return False
    return True


@atexit.register
def _kill_strays() -> None:
    for peer in list(_live):
        peer.kill()


class Peer:
    """A child process running ``target(link, *args)``; see the module docstring.

    Args:
        target: a module-level function (it is pickled by reference). It should import
            datadist itself, so that ``env`` is in place first.
        args: picklable positional arguments after ``link``.
        env: environment changes in the child, applied before ``target`` runs; a value of
            None removes the variable.
        name: shown in error messages.
    """

    def __init__(
        self,
        target: Callable[..., Any],
        *args: Any,
        env: Mapping[str, str | None] | None = None,
        name: str | None = None,
    ) -> None:
        self.name = name or getattr(target, "__name__", "peer")
        self._conn, child_conn = _CTX.Pipe(duplex=True)
        self._proc = _CTX.Process(
            target=_child_main,
            args=(child_conn, target, args, dict(env or {}), os.getpid()),
            name=f"datadist-peer-{self.name}",
            daemon=True,
        )
        self._proc.start()
        child_conn.close()  # our copy: the child's end now lives only in the child
        self._finished = False
        self._result: Any = None
        self._seq = 0
        _live.add(self)

    def __repr__(self) -> str:
        return f"<Peer {self.name} pid={self.pid} {'alive' if self.alive else 'gone'}>"

    def __enter__(self) -> Peer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def pid(self) -> int:
        assert self._proc.pid is not None
        return self._proc.pid

    @property
    def alive(self) -> bool:
        return self._proc.is_alive()

    @property
    def exitcode(self) -> int | None:
        return self._proc.exitcode

    # ------------------------------------------------------------------ talking

    def _describe_exit(self) -> str:
        self._proc.join(1.0)
        code = self._proc.exitcode
        if code is None:
            return "still running"
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exit code {code}"

    def _next(self, timeout: float) -> tuple[str, Any]:
        if self._finished:
            raise PeerDied(f"peer {self.name} already finished ({self._describe_exit()})")
        try:
            ready = self._conn.poll(timeout)
        except (EOFError, OSError):
            ready = True
        if not ready:
            raise PeerTimeout(f"peer {self.name} (pid {self.pid}) sent nothing in {timeout} s")
        try:
            tag, payload = self._conn.recv()
        except (EOFError, OSError):
            self._finished = True
            raise PeerDied(
                f"peer {self.name} (pid {self.pid}) went away: {self._describe_exit()}"
            ) from None
        if tag == _RAISE:
            self._finished = True
            raise PeerError(f"peer {self.name} (pid {self.pid}) raised", payload)
        if tag == _RETURN:
            self._finished = True
            self._result = payload
        return tag, payload

    def recv(self, timeout: float = 30.0) -> Any:
        """The next object the child sent with ``link.send``.

        Raises PeerError (with the child's traceback) if the target raised, PeerDied if it
        exited, PeerTimeout after ``timeout`` seconds.
        """
        tag, payload = self._next(timeout)
        if tag != _MSG:
            raise PeerError(f"peer {self.name}: expected a message, got {tag!r}")
        return payload

    def call(self, op: str, timeout: float = 30.0, **kwargs: Any) -> Any:
        """Run ``op(**kwargs)`` in a child that is inside :func:`serve`; return its result.

        Raises PeerError carrying the child's traceback when the op raised (the child keeps
        serving), PeerDied / PeerTimeout as :meth:`recv`. The reply to a call that timed out
        is dropped when it arrives, so later calls stay paired with their own replies.
        """
        self._seq += 1
        seq = self._seq
        try:
            self._conn.send((_CALL, (seq, op, kwargs)))
        except (BrokenPipeError, OSError):
            self._finished = True
            raise PeerDied(f"peer {self.name} went away: {self._describe_exit()}") from None
        deadline = time.monotonic() + timeout
        while True:
            tag, payload = self._next(max(0.0, deadline - time.monotonic()))
            if tag not in (_REPLY, _FAIL):
                raise PeerError(f"peer {self.name}: expected the reply to {op}, got {tag!r}")
            got_seq, value = payload
            if got_seq != seq:
                continue  # the late reply to an earlier call that timed out
            if tag == _FAIL:
                raise PeerError(f"peer {self.name}: {op} raised", value)
            return value

    def join(self, timeout: float = 30.0) -> Any:
        """Wait for the target to return and give its value; raise as :meth:`recv` does."""
        deadline = time.monotonic() + timeout
        while not self._finished:
            self._next(max(0.0, deadline - time.monotonic()))
        self._proc.join(max(0.1, deadline - time.monotonic()))
        return self._result

    # ------------------------------------------------------------------ signals, teardown

    def signal(self, sig: int) -> None:
        """Send ``sig`` (SIGSTOP, SIGCONT, SIGKILL, ...) to the child."""
        os.kill(self.pid, sig)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGSTOP the child and wait until every one of its threads has stopped.

        ``kill(pid, SIGSTOP)`` returns before the stop takes effect: a thread that is
        running (or about to answer a request) may still do so. Tests that need a silent
        peer must wait for the stop, which this does by reading ``/proc/<pid>/task``.
        """
        self.signal(signal.SIGSTOP)
        deadline = time.monotonic() + timeout
        while not _all_threads_stopped(self.pid):
            if time.monotonic() > deadline:
                raise PeerTimeout(f"peer {self.name} (pid {self.pid}) did not stop in "
                                  f"{timeout} s")
            time.sleep(0.001)

    def resume(self) -> None:
        """SIGCONT a stopped child."""
        self.signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL the child and reap it. Idempotent; works on a stopped child."""
        if self._proc.exitcode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            self._proc.join(10.0)
        self._finished = True
        _live.discard(self)
        with contextlib.suppress(OSError):
            self._conn.close()

    def close(self, grace: float = 2.0) -> None:
        """Ask the child to stop (``serve`` returns), wait up to ``grace`` s, then kill."""
        if self._proc.exitcode is None and not self._conn.closed:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGCONT)  # a stopped child cannot stop itself
            with contextlib.suppress(OSError, ValueError):
                self._conn.send((_STOP, None))
            self._proc.join(grace)
        self.kill()
