"""The limits measured in the puller: raw ``process_vm_readv``, ``memcpy`` and plain sockets.

Each is prepared before timing, so a timed call is the system calls and nothing else.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import socket
import struct
from collections.abc import Callable

import numpy as np

from datadist.bench.harness import (
    CHUNK,
    U64,
    BenchError,
    recv_exact,
    recv_into_exact,
)


class RawCma:
    """process_vm_readv straight through ctypes: the same-host limit. Batches are prepared
    before timing, so a timed call is the system calls and nothing else."""

    def __init__(self, pid: int) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self._fn = libc.process_vm_readv
        self._fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p,
                             ctypes.c_ulong, ctypes.c_ulong]
        self._fn.restype = ctypes.c_ssize_t
        self.pid = pid
        self.iov_max = os.sysconf("SC_IOV_MAX")

    def prepare(self, local: np.ndarray, remote: np.ndarray) -> Callable[[], None]:
        """``local``/``remote``: (n, 2) uint64 iovec arrays of equal span lengths."""
        batches = []
        for s in range(0, len(local), self.iov_max):
            lb = np.ascontiguousarray(local[s : s + self.iov_max], dtype=U64)
            rb = np.ascontiguousarray(remote[s : s + self.iov_max], dtype=U64)
            batches.append((lb, rb, lb.ctypes.data, rb.ctypes.data, len(lb),
                            int(lb[:, 1].sum())))
        fn, pid = self._fn, self.pid

        def run() -> None:
            for _lb, _rb, lp, rp, n, want in batches:
                got = fn(pid, lp, n, rp, n, 0)
                if got != want:
                    err = ctypes.get_errno()
                    raise BenchError(f"process_vm_readv moved {got} of {want} bytes: "
                                     f"{os.strerror(err) if got < 0 else 'short'}")

        return run


def iov(bases: list[int] | np.ndarray, lengths: list[int] | np.ndarray) -> np.ndarray:
    out = np.empty((len(bases), 2), dtype=U64)
    out[:, 0] = bases
    out[:, 1] = lengths
    return out


class MemcpyLimit:
    """memcpy (ctypes.memmove) between two mmap'd, page-aligned, warm buffers."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._maps = [mmap.mmap(-1, nbytes) for _ in range(2)]
        self._views = [np.frombuffer(m, dtype=np.uint8) for m in self._maps]
        for v in self._views:
            v.fill(1)  # commit the pages: the limit is the warm copy
        self.src, self.dst = (v.ctypes.data for v in self._views)

    def __call__(self) -> None:
        ctypes.memmove(self.dst, self.src, self.nbytes)

    def close(self) -> None:
        self._views.clear()  # drop the buffer exports before unmapping
        for m in self._maps:
            m.close()


class PlainClient:
    """The puller's ends of the plain-socket limits: a stream and an echo connection."""

    def __init__(self, port: int) -> None:
        self.stream = socket.create_connection(("127.0.0.1", port), timeout=60)
        self.echo = socket.create_connection(("127.0.0.1", port), timeout=60)
        for s in (self.stream, self.echo):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.settimeout(None)  # plain blocking calls: a timeout would add a poll per call
        self.stream.sendall(b"S")
        self.echo.sendall(b"E")
        self._ping = bytearray(b"datadist-bench16")
        self._pong = bytearray(16)

    def receive(self, dst: list[np.ndarray], nbytes: int) -> None:
        """Ask for ``nbytes`` and ``recv_into`` them, 4 MiB at a time, across ``dst``."""
        self.stream.sendall(struct.pack("<Q", nbytes))
        views = [d.data for d in dst]  # memoryview(d)
        i = 0
        while nbytes:
            v = views[i % len(views)]
            end = min(nbytes, len(v))
            got = 0
            while got < end:
                n = self.stream.recv_into(v[got : min(end, got + CHUNK)])
                if not n:
                    raise BenchError("the owner closed the plain stream")
                got += n
            nbytes -= end
            i += 1

    def round_trip(self) -> None:
        self.echo.sendall(self._ping)
        if not recv_into_exact(self.echo, self._pong):
            raise BenchError("the owner closed the echo connection")

    def close(self) -> None:
        self.stream.close()
        self.echo.close()


def _batches(memory: np.ndarray, block: int, ids: np.ndarray) -> list[tuple[list[memoryview], int]]:
    """Memoryviews of blocks ``ids`` of ``memory`` (flat uint8), IOV_MAX per batch, with each
    batch's byte count: what one ``sendmsg`` / ``recvmsg_into`` takes."""
    view = memory.data.cast("B")
    iov_max = os.sysconf("SC_IOV_MAX")
    starts = (ids.astype(np.int64) * block).tolist()
    out = []
    for k in range(0, len(starts), iov_max):
        part = starts[k : k + iov_max]
        out.append(([view[s : s + block] for s in part], block * len(part)))
    return out


def serve_scatter(conn: socket.socket, memory: np.ndarray) -> None:
    """The owner's end of the scatter limit (a plain-socket connection in mode ``B``): the
    client names a block size and the source block ids once; then every 8-byte request is
    answered with those blocks of ``memory``, ``sendmsg`` of IOV_MAX blocks at a time."""
    head = recv_exact(conn, 16)
    if not head:
        return
    block, n = struct.unpack("<QQ", head)
    ids = np.frombuffer(recv_exact(conn, 8 * n), dtype=U64)
    if len(ids) != n or (n and (int(ids.max()) + 1) * block > memory.nbytes):
        raise BenchError("scatter limit: blocks outside the owner's buffer")
    batches = _batches(memory, block, ids)
    while recv_exact(conn, 8):
        for bufs, want in batches:
            sent = conn.sendmsg(bufs)
            if sent != want:  # interrupted: the rest the plain way
                rest = b"".join(bytes(b) for b in bufs)[sent:]
                conn.sendall(rest)


class ScatterClient:
    """The puller's end of the scatter limit: blocks ``src_ids`` of the owner's blocks buffer
    into blocks ``dst_ids`` of ``dst`` (flat uint8), ``recvmsg_into`` with MSG_WAITALL of
    IOV_MAX blocks at a time. The memoryviews are made before timing."""

    def __init__(self, port: int, dst: np.ndarray, block: int, src_ids: np.ndarray,
                 dst_ids: np.ndarray) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.settimeout(None)
        ids = np.ascontiguousarray(src_ids, dtype=U64)
        self.sock.sendall(b"B" + struct.pack("<QQ", block, len(ids)) + ids.tobytes())
        self._batches = _batches(dst, block, dst_ids)
        self.nbytes = block * len(dst_ids)
        self._ask = struct.pack("<Q", self.nbytes)

    def __call__(self) -> None:
        self.sock.sendall(self._ask)
        for bufs, want in self._batches:
            got = self.sock.recvmsg_into(bufs, 0, socket.MSG_WAITALL)[0]
            if got != want:
                self._finish(bufs, got)

    def _finish(self, bufs: list[memoryview], got: int) -> None:
        """A short ``recvmsg_into`` (a signal, or the owner gone): the rest buffer by buffer."""
        for b in bufs:
            if got >= len(b):
                got -= len(b)
                continue
            if not recv_into_exact(self.sock, b[got:]):
                raise BenchError("the owner closed the scatter connection")
            got = 0

    def close(self) -> None:
        self.sock.close()
