"""Client sides of the data paths: how a puller moves the bytes of one request.

Who calls: the engine, holding the link's lock, with the link's control ``Channel``.

* :class:`TcpPath` asks the owner for the bytes and receives them into the destination
  spans (``readv``), or sends the source spans after the owner accepts a push (``writev``).
* :class:`CmaPath` (same host) asks the owner for a *grant*: the owner checks the spans and
  answers with the addresses, holding a lease; we copy with ``process_vm_readv`` /
  ``process_vm_writev`` and release. The kernel refusing cross-memory attach raises
  :class:`CmaRefused` *before* any byte moved, so the caller can fall back to TCP.

Both block; both finish or raise by ``deadline``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import select
import stat
import threading
from dataclasses import dataclass

import numpy as np

from datadist.core.errors import BrokenLink, DatadistError, IntegrityError, RemoteProtocolError
from datadist.memory.pool import map_shared, shrink_sealed, unmap
from datadist.memory.spans import shm_pays
from datadist.transport.base import TransportCaps
from datadist.transport.channel import Channel
from datadist.transport.fence import FenceUnavailable, FenceView
from datadist.transport.iov import (
    CmaRefused,
    VmCopy,
    crc_iov,
    iov_nbytes,
    iovecs,
    local_copy,
    vm_copy,
)
from datadist.wire import protocol as p

log = logging.getLogger(__name__)

__all__ = ["CmaPath", "CmaRefused", "RemoteCache", "TcpPath", "lease_key"]


class ShmUnavailable(DatadistError):
    """The owner's shared memory cannot be opened or mapped here: use cross-memory attach."""


def _verify(chan: Channel, msg: p.Read, local: np.ndarray, deadline: float) -> None:
    """With the CHECKSUM flag: the owner's CRC of what it sent must be ours of what landed."""
    if not msg.flags & p.ReadFlags.CHECKSUM:
        return
    ck = chan.answer(deadline)
    _expect(ck, p.Checksum, chan)
    assert isinstance(ck, p.Checksum)
    got = crc_iov(local)
    if ck.crc != got or ck.nbytes != iov_nbytes(local):
        raise IntegrityError(
            f"checksum mismatch: the owner sent crc {ck.crc:#010x} over {ck.nbytes} bytes, "
            f"{got:#010x} over {iov_nbytes(local)} bytes arrived (the source changed during "
            "the transfer, or the bytes were corrupted)"
        )


def _expect(reply: p.Message, kind: type, chan: Channel) -> None:
    if not isinstance(reply, kind):
        chan.close()
        raise RemoteProtocolError(f"expected {kind.__name__}, got {type(reply).__name__}")


class TcpPath:
    """The stream data path: every byte crosses the link's TCP (or TLS) connection; works
    between any two hosts."""

    caps = TransportCaps("tcp", same_host_only=False, one_sided=False)

    def close(self) -> None:
        pass

    def read(self, chan: Channel, msg: p.Read, local: np.ndarray, deadline: float) -> None:
        reply = chan.call(msg, deadline)
        _expect(reply, p.ReadData, chan)
        assert isinstance(reply, p.ReadData)
        if reply.nbytes != iov_nbytes(local):
            chan.close()
            raise RemoteProtocolError(
                f"owner announced {reply.nbytes} bytes, {iov_nbytes(local)} were asked for"
            )
        chan.recv_iov(local, deadline)
        if not msg.flags & p.ReadFlags.CHECKSUM:
            return
        # Tell the owner whether the CRC matched (RELEASE, lease id 0, the read's request
        # id): it consumes a req_id key only on a verified read.
        rid, ok = chan.last_request_id, False
        try:
            _verify(chan, msg, local, deadline)
            ok = True
        finally:
            if not chan.closed:
                try:
                    chan.send(p.Release(0, ok), deadline, rid)
                except DatadistError as e:
                    # Undelivered, the verdict counts as "not verified": the owner keeps the
                    # key, which is safe. The read's own outcome (the bytes, or the mismatch
                    # being raised) stands.
                    log.info("verdict on a checksummed read not delivered: %s", e)

    def write(self, chan: Channel, msg: p.Write, local: np.ndarray, deadline: float) -> None:
        reply = chan.call(msg, deadline)
        _expect(reply, p.Ok, chan)
        chan.send_iov(local, deadline)
        _expect(chan.answer(deadline), p.Ok, chan)


_TCP = TcpPath()


class LeasedCopy:
    """A checked request under a lease, prepared to run many times (the engine keeps small
    ones): the cross-memory copy between our spans and the owner's, the same spans in our
    mapping of the owner's shared memory (or None), and whether copying from that mapping
    is faster for these spans (``shm_pays``). Arrays are read-only."""

    __slots__ = ("vm", "shm", "shm_faster")

    def __init__(self, local: np.ndarray, cma: np.ndarray, shm: np.ndarray | None,
                 nbytes: int, shm_faster: bool) -> None:
        self.vm = VmCopy(local, cma, nbytes)
        if shm is not None:
            shm.flags.writeable = False
        self.shm = shm
        self.shm_faster = shm_faster

    def rows(self) -> int:
        """The iovec rows it holds (its weight in a map of kept copies)."""
        return len(self.vm.remote) * (2 if self.shm is None else 3)


@dataclass(eq=False)
class RemoteCache:
    """A reader's view of a cache it holds a whole-cache lease on (wire CacheLease): the
    owner's geometry and tensor addresses, the fence that says whether the lease still
    holds, and where each tensor is mapped here when the cache is in shareable memory."""

    key: tuple[int, int, bool]  # what it is filed under (lease_key)
    msg: p.CacheLease
    fence: FenceView
    shm_bases: np.ndarray | None  # uint64, our mapped address of each tensor, or None
    write: bool = False  # a lease to write (cross-memory attach only)


class CmaPath:
    """Same host. Asks the owner for a grant and copies itself:

    * an ``ShmGrant`` (the cache is in the owner's shareable memory, ``allow_shm``): map the
      owner's memfd once per link (``/proc/<pid>/fd/<fd>``, inode checked) and memcpy; used
      when the request has few spans or long ones (one call per span, ``shm_pays``);
    * a ``Grant``: ``process_vm_readv`` from the owner's addresses, IOV_MAX spans per call.
    """

    MAX_LEASES = 64  # leases kept per link (the oldest beyond are dropped)

    def __init__(self, pid: int, *, allow_shm: bool = True, name: str = "cma") -> None:
        self.pid = pid
        self.allow_shm = allow_shm
        self.caps = TransportCaps(name, same_host_only=True, one_sided=True)
        self._maps: dict[int, tuple[int, int, int]] = {}  # owner's fd -> (ino, addr, size)
        self.last = ""  # which mechanism moved the last request: "shm", "cma" or "stream"
        # The kernel refused cross-memory attach (the owner did not let us ptrace it): shared
        # memory, which needs no ptrace permission, for every cache that is in it; the
        # others are streamed over the control channel. Set by Link.run.
        self.cma_refused = False
        # Whole-cache leases (the owner offered FEATURE_LEASE): the caches leased so far, by
        # the key that named them; copies under them run under _fast, not the link's lock.
        self.leases = False
        self.remote: dict[tuple[int, int, bool], RemoteCache] = {}
        self._fast = threading.Lock()  # leased copies, shm mappings, close
        self._closed = False
        self._pidfd: int | None = None  # tells whether the owner exited (pid reuse)
        self._exited: select.poll | None = None

    def read(self, chan: Channel, msg: p.Read, local: np.ndarray, deadline: float) -> None:
        flags = msg.flags | p.ReadFlags.GRANT
        if self.allow_shm and (self.cma_refused
                               or shm_pays(len(msg.tensors), msg.lengths)):
            flags |= p.ReadFlags.SHM
        msg = dataclasses.replace(msg, flags=flags)
        grant = chan.call(msg, deadline)
        if isinstance(grant, p.ShmGrant):
            try:
                self._read_shm(chan, msg, grant, local, deadline)
            except ShmUnavailable as e:
                if self.cma_refused:  # nothing same-host is left: the link goes to tcp
                    raise CmaRefused(f"shared memory unavailable too: {e}") from e
                # Shared memory failed, cross-memory attach may not: stop asking for it.
                log.warning("shared memory of pid %d unavailable (%s); using cross-memory "
                            "attach", self.pid, e)
                self.allow_shm = False
                self.read(chan, dataclasses.replace(msg, flags=msg.flags & ~p.ReadFlags.SHM),
                          local, deadline)
            return
        _expect(grant, p.Grant, chan)
        assert isinstance(grant, p.Grant)
        if len(grant.bases) != len(msg.tensors):
            chan.close()
            raise RemoteProtocolError("grant does not match the request")
        if self.cma_refused:  # not in shareable memory, and we may not attach: stream it
            if msg.flags & p.ReadFlags.CHECKSUM:  # its CHECKSUM follows the grant: not ours
                _expect(chan.answer(deadline), p.Checksum, chan)
            chan.send(p.Release(grant.lease_id, False), deadline)
            plain = p.ReadFlags.GRANT | p.ReadFlags.SHM
            _TCP.read(chan, dataclasses.replace(msg, flags=msg.flags & ~plain), local, deadline)
            self.last = "stream"
            return
        remote = iovecs(grant.bases, msg.offsets, msg.lengths)
        ok = False
        try:
            vm_copy(self.pid, local, remote)
            self.last = "cma"
            _verify(chan, msg, local, deadline)
            ok = True
        finally:
            if not chan.closed:
                chan.send(p.Release(grant.lease_id, ok), deadline)

    def _read_shm(self, chan: Channel, msg: p.Read, grant: p.ShmGrant, local: np.ndarray,
                  deadline: float) -> None:
        ok = False
        try:
            if len(grant.fds) != len(msg.tensors):
                chan.close()
                raise RemoteProtocolError("shm grant does not match the request")
            with self._fast:  # leased copies use these mappings too
                self._copy_shm(msg, grant, local)
            _verify(chan, msg, local, deadline)
            ok = True
        finally:
            if not chan.closed:
                chan.send(p.Release(grant.lease_id, ok), deadline)

    def _copy_shm(self, msg: p.Read, grant: p.ShmGrant, local: np.ndarray) -> None:
        """Copy a granted read from the owner's mapped memfds. _fast held."""
        if self._closed:
            raise BrokenLink("the link was closed")
        maps = self._resolve(grant)  # every mapping this grant uses, none unmapped
        fds = grant.fds.tolist()
        bases = np.empty(len(fds), dtype=np.uint64)
        limits = np.empty(len(fds), dtype=np.uint64)
        for i, (fd, off) in enumerate(zip(fds, grant.offsets.tolist(), strict=True)):
            _, addr, size = maps[fd]
            if off > size:
                raise RemoteProtocolError("shm grant points outside the mapping")
            bases[i] = addr + off
            limits[i] = addr + size
        src = iovecs(bases, msg.offsets, msg.lengths)
        ends = src[:, 0] + src[:, 1]
        # every span must lie in the mapping its tensor came from (a lying peer must not
        # make us read our own memory out of bounds)
        limits = np.repeat(limits, len(msg.lengths))
        if len(ends) and bool((ends > limits[: len(ends)]).any()):
            raise RemoteProtocolError("shm grant spans run past the shared mapping")
        local_copy(local, src)
        self.last = "shm"

    def _resolve(self, grant: p.ShmGrant) -> dict[int, tuple[int, int, int]]:
        """fd -> (ino, address, size) for every fd ``grant`` names: the mappings we hold,
        and new ones for files we have not mapped (or whose fd number the owner reused for
        another file). Nothing this grant uses is unmapped: one fd with two inodes in one
        grant is refused, and a replaced mapping goes only once all are resolved."""
        want: dict[int, int] = {}
        for fd, ino in zip(grant.fds.tolist(), grant.inos.tolist(), strict=True):
            if want.setdefault(fd, ino) != ino:
                raise RemoteProtocolError(f"shm grant names fd {fd} with two different files")
        got: dict[int, tuple[int, int, int]] = {}
        new: list[int] = []
        try:
            for fd, ino in want.items():
                held = self._maps.get(fd)
                if held is not None and held[0] == ino:
                    got[fd] = held
                else:
                    addr, size = self._map(fd, ino)
                    got[fd] = (ino, addr, size)
                    new.append(fd)
        except BaseException:
            for fd in new:
                unmap(got[fd][1], got[fd][2])
            raise
        for fd in new:  # commit: the old file behind a reused fd number is gone for good
            old = self._maps.get(fd)
            self._maps[fd] = got[fd]
            if old is not None:
                for rc in [rc for rc in self.remote.values() if fd in rc.msg.shm_fds]:
                    self._forget(rc)  # leases whose tensors lay in the old file
                unmap(old[1], old[2])
        return got

    def _map(self, fd: int, ino: int) -> tuple[int, int]:
        """The owner's memfd ``fd``, mapped read-only here: (address, size). Only a memfd
        (or tmpfs file) with inode ``ino``, sealed against shrinking: a file the owner could
        truncate under our copy would kill us with SIGBUS. Opened non-blocking, so a FIFO
        named by a lying owner cannot hang us."""
        path = f"/proc/{self.pid}/fd/{fd}"
        try:
            f = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as e:
            raise ShmUnavailable(f"cannot open the owner's shared memory {path}: {e}") from e
        try:
            st = os.fstat(f)
            if st.st_ino != ino or not stat.S_ISREG(st.st_mode):
                raise RemoteProtocolError(f"{path} is not the memory the owner named")
            if not shrink_sealed(f):  # not hostile per se (an older owner): do without
                raise ShmUnavailable(f"{path} is not sealed against shrinking")
            if st.st_size <= 0:
                raise RemoteProtocolError(f"{path} is empty")
            addr = map_shared(f, st.st_size, writable=False)
        except OSError as e:
            raise ShmUnavailable(f"cannot map {path}: {e}") from e
        finally:
            os.close(f)
        return addr, st.st_size

    # ---------------------------------------------------------- whole-cache leases

    def lease(self, chan: Channel, key: p.KeyRef, deadline: float, write: bool = False
              ) -> RemoteCache | None:
        """Ask the owner for a lease on the cache ``key`` names (under the link's lock), to
        read it or (``write``) to write it. None when there is no lease this time (the fence
        could not be opened; where that will not change, e.g. /proc is closed to us, no lease
        is asked for again on this link); the owner's refusal (no such cache, ...) raises."""
        if self._pidfd is None:
            # Before the request: the owner's answer then proves that the pid this pidfd
            # names was still the owner's when it was opened (its socket was alive).
            try:
                self._pidfd = os.pidfd_open(self.pid)
            except OSError as e:
                log.info("no cache leases from pid %d (no pidfd: %s)", self.pid, e)
                self.leases = False
                return None
            self._exited = select.poll()
            self._exited.register(self._pidfd, select.POLLIN)
        if write:
            flags = p.LEASE_WRITE
        else:
            flags = int(p.ReadFlags.SHM if self.allow_shm else p.ReadFlags.NONE)
        got = chan.call(p.LeaseRequest(key, flags), deadline)
        _expect(got, p.CacheLease, chan)
        assert isinstance(got, p.CacheLease)
        try:
            fence = FenceView(self.pid, got.fence_fd, got.fence_ino)
        except FenceUnavailable as e:
            if e.lasting:
                log.info("no cache leases from pid %d (%s): every read asks the owner",
                         self.pid, e)
                self.leases = False
            return None  # e.g. the cache went meanwhile: this request asks the owner
        try:
            shm = (self._map_lease(got) if got.shm_fds.size and self.allow_shm and not write
                   else None)
        except ShmUnavailable as e:
            log.info("leased cache %d: shared memory unavailable (%s)", got.cache_id, e)
            shm = None
        except BaseException:
            fence.close()
            raise
        rc = RemoteCache(lease_key(key, write), got, fence, shm, write)
        with self._fast:
            if self._closed:
                fence.close()
                return None
            # Leases of caches that went (revoked) are dropped here, and the oldest beyond
            # MAX_LEASES: a reader of one cache per request must not keep a file per request.
            for k in [k for k, r in self.remote.items() if k == rc.key or r.fence.revoked()]:
                self.remote.pop(k).fence.close()
            self.remote[rc.key] = rc
            while len(self.remote) > self.MAX_LEASES:
                self.remote.pop(next(iter(self.remote))).fence.close()
        return rc

    def _map_lease(self, got: p.CacheLease) -> np.ndarray:
        """Where each tensor of a leased cache in shareable memory lies in our mappings;
        each tensor must lie inside its mapping."""
        grant = p.ShmGrant(0, got.shm_fds, got.shm_inos, got.shm_offsets)
        with self._fast:
            maps = self._resolve(grant)
        bases = np.empty(len(got.shm_fds), dtype=np.uint64)
        for i, (fd, off) in enumerate(zip(got.shm_fds.tolist(), got.shm_offsets.tolist(),
                                          strict=True)):
            _, addr, size = maps[fd]
            if off > size or size - off < got.tensor_bytes:
                raise RemoteProtocolError("cache lease: a tensor runs past its shared mapping")
            bases[i] = addr + off
        return bases

    @staticmethod
    def leased_sources(rc: RemoteCache, tensors: np.ndarray, base: int, offsets: np.ndarray,
                       lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """The source iovecs of checked spans (``Registry.check_read`` against the lease) of
        a leased cache: in the owner's memory, and in our mappings of it (or None)."""
        b = np.uint64(base)
        cma = iovecs(rc.msg.addrs[tensors] + b, offsets, lengths)
        if rc.shm_bases is None:
            return cma, None
        return cma, iovecs(rc.shm_bases[tensors] + b, offsets, lengths)

    def copy_leased(self, rc: RemoteCache, copy: LeasedCopy) -> bool:
        """Run a leased copy (:class:`LeasedCopy`): a read into our memory, or for a write
        lease our memory into the owner's spans, without asking the owner. False: nothing
        was copied, the lease is gone (revoked, or unusable here); the caller asks the owner
        instead. Raises CmaRefused (nothing copied) or BrokenLink (the owner exited: what
        was copied may not be its memory, or may not have landed in it)."""
        with self._fast:
            if self._closed or self.remote.get(rc.key) is not rc:
                return False
            use_shm = (copy.shm is not None and not rc.write
                       and (self.cma_refused or copy.shm_faster))
            if not use_shm and self.cma_refused:
                return False
            if self._exited is not None and self._exited.poll(0):
                raise BrokenLink(f"the owner process {self.pid} exited")
            if not rc.fence.enter():
                self._forget(rc)
                return False
            try:
                if use_shm:
                    assert copy.shm is not None
                    local_copy(copy.vm.local, copy.shm)
                else:
                    copy.vm.run(self.pid, write=rc.write)
            finally:
                rc.fence.leave()
            if self._exited is not None and self._exited.poll(0):
                raise BrokenLink(f"the owner process {self.pid} exited")
            self.last = "shm" if use_shm else "cma"
            return True

    def forget(self, rc: RemoteCache) -> None:
        """Drop a lease found stale (its fence revoked)."""
        with self._fast:
            self._forget(rc)

    def _forget(self, rc: RemoteCache) -> None:
        """Drop a revoked lease. _fast held."""
        if self.remote.get(rc.key) is rc:
            del self.remote[rc.key]
        rc.fence.close()

    def forget_leases(self) -> None:
        """Drop every lease (the owner is gone, or a copy failed)."""
        with self._fast:
            for rc in self.remote.values():
                rc.fence.close()
            self.remote.clear()

    def close(self) -> None:
        """Drop the leases and unmap the owner's shared memory. Idempotent; waits for a
        leased copy in flight."""
        with self._fast:
            self._closed = True
            for rc in self.remote.values():
                rc.fence.close()
            self.remote.clear()
            maps, self._maps = self._maps, {}
            for _, addr, size in maps.values():
                unmap(addr, size)
            if self._pidfd is not None:
                os.close(self._pidfd)
                self._pidfd, self._exited = None, None


def lease_key(key: p.KeyRef, write: bool = False) -> tuple[int, int, bool]:
    """What a lease is filed under: (CACHE_ID, cache id) or (BLOCKS_KEY, model id), and
    whether it is for writing."""
    return (int(key.kind), key.a if key.kind == p.KeyKind.CACHE_ID else key.b, write)
