"""Fence files: how an owner revokes a whole-cache lease and waits for the copies in flight.

A same-host reader holding a cache lease (wire ``CacheLease``) copies from the owner's memory
without asking first. Before that memory may be unregistered, returned to a pool or re-bound,
the owner must know that no copy is running and that none will start. A fence file does both,
with two kernel objects and no shared-memory atomics:

* a sealed memfd of one page, mapped by both processes; its first byte is the *revoked* flag,
  written by the owner only;
* ``flock`` on it: the reader holds a shared lock around every copy (taken without blocking),
  the owner takes the exclusive lock to drain.

Reader: ``enter`` = shared lock, then the flag must be 0 (else unlock: revoked); copy;
``leave``. Owner: ``revoke`` = set the flag; ``drained`` = the exclusive lock can be taken
(and is dropped at once). A copy that held the shared lock before the exclusive one was taken
finishes first; a reader that locks after sees the flag (the kernel's lock hand-over orders
the flag's store before the reader's load). A reader that dies drops its lock with its file.

Locks belong to open file descriptions, so the reader opens the file anew through
``/proc/<owner pid>/fd/<fd>`` (its own description), never a descriptor passed to it.

Who calls: ``core.registry`` (owner side: one :class:`Fence` per leased cache, revoked and
drained before the memory goes), ``transport.paths.CmaPath`` (reader side,
:class:`FenceView`). Nothing here blocks: ``drained`` is one non-blocking try; callers poll it
under their own deadline.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import stat

from datadist.core.errors import DatadistError

__all__ = ["Fence", "FenceUnavailable", "FenceView"]

PAGE = mmap.PAGESIZE
_SEALS = (getattr(fcntl, "F_SEAL_SHRINK", 0x2) | getattr(fcntl, "F_SEAL_GROW", 0x4)
          | getattr(fcntl, "F_SEAL_SEAL", 0x1))
_F_ADD_SEALS = getattr(fcntl, "F_ADD_SEALS", 1033)
_F_GET_SEALS = getattr(fcntl, "F_GET_SEALS", 1034)


class FenceUnavailable(DatadistError):
    """The owner's fence file cannot be opened or is not what it should be: no lease.
    ``lasting``: it will not work next time either (no access to the owner's /proc, a file
    that is not a sealed memfd); otherwise the fence went meanwhile (its cache was freed)."""

    def __init__(self, message: str, *, lasting: bool = False) -> None:
        super().__init__(message)
        self.lasting = lasting


class Fence:
    """Owner side: one fence file. Not thread-safe by itself (the registry's lock guards it)."""

    def __init__(self) -> None:
        self.fd = os.memfd_create("datadist-fence", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, PAGE)
            fcntl.fcntl(self.fd, _F_ADD_SEALS, _SEALS)
            self.ino = os.fstat(self.fd).st_ino
            self._map: mmap.mmap | None = mmap.mmap(self.fd, PAGE)
        except BaseException:
            os.close(self.fd)
            raise
        self.revoked = False

    def __repr__(self) -> str:
        state = "revoked" if self.revoked else "live"
        return f"<Fence fd={self.fd} ino={self.ino} {state}>"

    def revoke(self) -> None:
        """From now on no reader starts a copy under this fence. Idempotent."""
        if not self.revoked and self._map is not None:
            self._map[0] = 1
            self.revoked = True

    def drained(self) -> bool:
        """Whether no copy is in flight (one non-blocking try of the exclusive lock). Only
        meaningful after :meth:`revoke`; a closed fence is drained."""
        if self._map is None:
            return True
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        return True

    def close(self) -> None:
        """Revoke and drop our descriptor (readers keep their own: the flag stays set)."""
        self.revoke()
        if self._map is not None:
            self._map.close()
            self._map = None
            os.close(self.fd)


class FenceView:
    """Reader side: the owner's fence file, opened through /proc and mapped read-only."""

    def __init__(self, pid: int, fd: int, ino: int) -> None:
        path = f"/proc/{pid}/fd/{fd}"
        try:
            f = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as e:
            raise FenceUnavailable(f"cannot open the owner's fence {path}: {e}",
                                   lasting=e.errno in (errno.EACCES, errno.EPERM)) from e
        try:
            st = os.fstat(f)
            if st.st_ino != ino:
                raise FenceUnavailable(f"{path} is not the fence the owner named")
            if not stat.S_ISREG(st.st_mode) or st.st_size < PAGE:
                raise FenceUnavailable(f"{path} is not a fence file", lasting=True)
            if fcntl.fcntl(f, _F_GET_SEALS) & 0x2 == 0:  # F_SEAL_SHRINK: no SIGBUS under us
                raise FenceUnavailable(f"{path} is not sealed against shrinking", lasting=True)
            self._map: mmap.mmap | None = mmap.mmap(f, PAGE, prot=mmap.PROT_READ)
        except OSError as e:
            os.close(f)
            raise FenceUnavailable(f"cannot map {path}: {e}", lasting=True) from e
        except BaseException:
            os.close(f)
            raise
        self.fd = f

    def enter(self) -> bool:
        """Before a copy: False if the lease is revoked (or being revoked); True means the
        caller copies, then calls :meth:`leave`."""
        m = self._map
        if m is None:
            return False
        try:
            fcntl.flock(self.fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        if m[0]:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            return False
        return True

    def leave(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)

    def revoked(self) -> bool:
        """Whether the owner revoked the lease (a peek, no lock)."""
        return self._map is None or bool(self._map[0])

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
            os.close(self.fd)
