"""One framed connection over a stream socket: the unit every transport talks through.

Who calls: transport/tcp.py (listeners, ``open_channel``), transport/tls.py (its TLS
subclass), transport/local.py (the local channel) and the paths that move bytes over it.
Sockets block, with send and receive timeouts that ``Channel._arm`` keeps inside the caller's
deadline, so nothing here can hang past it; waiting in the kernel rather than in ``poll``
lets a bulk transfer be one system call per batch.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import math
import select
import socket
import struct
import time
from typing import TYPE_CHECKING

import numpy as np

from datadist.core.errors import (
    BrokenLink,
    LinkFailed,
    ProtocolError,
    RemoteProtocolError,
    Timeout,
    error_for_code,
)
from datadist.transport.address import format_host_port
from datadist.transport.iov import (
    SockIo,
    make_iov,
    sock_readv,
    sock_writev,
)
from datadist.wire import protocol as p

if TYPE_CHECKING:
    from datadist.transport.local import LocalCred


log = logging.getLogger(__name__)

RECV_BUFFER = 64 << 10  # read-ahead for frames (see Channel)
ARM_SLACK = 0.02  # seconds a blocking call may run past its deadline (timer granularity)
KEEPALIVE = (5, 2, 3)  # idle seconds, interval, probes: a vanished host is noticed in ~11 s
USER_TIMEOUT_MS = 15000  # unacknowledged data for this long fails the connection


def tune(sock: socket.socket) -> None:
    """Low latency, autotuned buffers, and liveness from the kernel (no heartbeat thread): TCP
    keepalive notices a peer host that vanished while the link is idle, TCP_USER_TIMEOUT one
    that stops acknowledging mid-transfer."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle, intvl, cnt = KEEPALIVE
    for opt, val in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", intvl), ("TCP_KEEPCNT", cnt),
                     ("TCP_USER_TIMEOUT", USER_TIMEOUT_MS)):
        if hasattr(socket, opt):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), val)
    # No SO_SNDBUF/SO_RCVBUF: a fixed size turns off the kernel's buffer autotuning, and
    # rmem_max/wmem_max cap it (208 KiB on a stock kernel: a window far below a fast link's
    # bandwidth-delay product). Autotuning grows to tcp_rmem/tcp_wmem's maximum by itself and
    # measured as fast or faster on loopback (the bench's TCP rows).
    # Blocking, with SO_RCVTIMEO/SO_SNDTIMEO kept inside each call's deadline (Channel._arm):
    # a bulk transfer is then one system call per 4 MiB (see iov.SEND_CHUNK), not a poll per
    # buffer-full.
    sock.setblocking(True)


class Channel:
    """One framed connection. Not thread-safe: its owner serialises calls (a link lock).

    Every call takes an absolute ``deadline`` (``time.monotonic()``); past it, Timeout.
    After any error the channel is closed: a half-read stream cannot be resynchronised.
    """

    # Set on unix-socket channels (transport/local.py): who the kernel says the peer is.
    local_cred: LocalCred | None = None

    def __init__(self, sock: socket.socket, address: str) -> None:
        self.sock = sock
        self.address = address
        self.fd = sock.fileno()
        self._rid = itertools.count(1)
        self._last_rid = 0
        self.closed = False
        # Frames are read through a small buffer: a reply's header, payload and (for a small
        # read) its raw bytes usually arrive in one segment and cost one recv. Raw bytes that
        # were read ahead are copied out first by recv_iov.
        self._rbuf = bytearray(RECV_BUFFER)
        self._rview = memoryview(self._rbuf)
        self._rbuf_addr = ctypes.addressof(ctypes.c_char.from_buffer(self._rbuf))
        self._rpos = self._rend = 0
        self._armed = math.inf  # the SO_RCVTIMEO/SO_SNDTIMEO now set, in seconds

    def __repr__(self) -> str:
        return f"<Channel {self.address} {'closed' if self.closed else 'open'}>"

    @classmethod
    def connect(cls, host: str, port: int, deadline: float) -> Channel:
        """Open a plain TCP connection within the deadline (``tcp.open_channel`` adds TLS).
        Raises LinkFailed or Timeout."""
        where = format_host_port(host, port)
        left = deadline - time.monotonic()
        if left <= 0:
            raise Timeout(f"no time left to connect to {where}")
        try:
            sock = socket.create_connection((host, port), timeout=left)
        except TimeoutError:
            raise Timeout(f"connecting to {where} timed out") from None
        except ConnectionRefusedError as e:
            raise LinkFailed(f"cannot connect to {where}: Connection refused: nothing "
                             "listens there (a PROMPT "
                             "must set LLMConfig.listen_ip_info = 'ip:port' to be linked to)"
                             ) from e
        except OSError as e:
            raise LinkFailed(f"cannot connect to {where}: {e.strerror or e}") from e
        tune(sock)
        return cls(sock, where)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)
            self.sock.close()

    def shutdown(self) -> None:
        """Wake any thread blocked on this connection (it fails with BrokenLink) without
        releasing the fd, which its user closes. Safe from another thread."""
        if not self.closed:
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)

    def wait_readable(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for something to read (or the peer closing). Server side:
        the wait between requests, which has no deadline of its own."""
        self._guard()
        if self._rend > self._rpos:
            return True
        p_ = select.poll()
        p_.register(self.fd, select.POLLIN | select.POLLERR | select.POLLHUP)
        return bool(p_.poll(timeout * 1000.0))

    def peer_gone(self) -> bool:
        """True if an idle channel has anything to read: between requests the server sends
        nothing, so readable means it closed (FIN/RST) or broke the protocol. Never blocks."""
        if self.closed or self._rend > self._rpos:
            return True
        p_ = select.poll()
        p_.register(self.fd, select.POLLIN | select.POLLERR | select.POLLHUP)
        return bool(p_.poll(0))

    def _guard(self) -> None:
        if self.closed:
            raise BrokenLink(f"connection to {self.address} is closed")

    # ------------------------------------------------------------------ framing

    def _arm(self, deadline: float, expired: bool = False) -> None:
        """Keep the socket's timeouts within ``deadline`` before a blocking call.

        A blocking call can wait for the timeout in force, so that must not run past the
        deadline (by more than ARM_SLACK); after a timeout expired (``expired``) it is set to
        all the time left. Both are rare: successive calls with similar deadlines reuse the
        setting, so a request usually costs no setsockopt at all. Raises Timeout past the
        deadline.
        """
        left = deadline - time.monotonic()
        if left <= 0:
            raise Timeout(f"deadline passed on the connection to {self.address}")
        if not expired and self._armed <= left + ARM_SLACK:
            return
        sec = int(left)
        tv = struct.pack("@ll", sec, max(1, int((left - sec) * 1e6)))
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
        except OSError as e:  # closed under us
            raise BrokenLink(f"connection to {self.address}: {e.strerror or e}") from e
        self._armed = left

    def send(self, msg: p.Message, deadline: float, request_id: int = 0) -> None:
        self._guard()
        self._send_bytes(p.encode(msg, request_id), deadline)

    def send_raw(self, buf: np.ndarray, deadline: float) -> None:
        self._guard()
        self._send_bytes(buf.data.cast("B"), deadline)  # memoryview(buf)

    def _send_bytes(self, data: bytes | memoryview, deadline: float) -> None:
        view = memoryview(data)
        sent, expired = 0, False
        try:
            while sent < len(view):
                self._arm(deadline, expired)
                try:
                    sent += self.sock.send(view[sent:])
                    expired = False
                except BlockingIOError:
                    expired = True
                except OSError as e:
                    raise BrokenLink(f"socket error: {e.strerror or e}") from e
        except (Timeout, BrokenLink):
            self.close()
            raise

    def _fill(self, n: int, deadline: float) -> None:
        """Buffer at least ``n <= RECV_BUFFER`` unread bytes."""
        if self._rend - self._rpos >= n:
            return
        if self._rpos + n > RECV_BUFFER:  # move the unread bytes to the front
            have = self._rend - self._rpos
            ctypes.memmove(self._rbuf_addr, self._rbuf_addr + self._rpos, have)
            self._rpos, self._rend = 0, have
        expired = False
        while self._rend - self._rpos < n:
            self._arm(deadline, expired)
            try:
                got = self.sock.recv_into(self._rview[self._rend :])
                expired = False
            except BlockingIOError:
                expired = True
                continue
            except OSError as e:
                raise BrokenLink(f"socket error: {e.strerror or e}") from e
            if not got:
                raise BrokenLink(f"connection to {self.address} closed by the peer")
            self._rend += got

    def _take(self, n: int, deadline: float) -> bytearray:
        """The next ``n`` bytes of the stream, as a new bytearray."""
        if n <= RECV_BUFFER:
            self._fill(n, deadline)
            out = bytearray(self._rview[self._rpos : self._rpos + n])
            self._rpos += n
            return out
        out = bytearray(n)  # a frame bigger than the buffer: read its tail straight in
        have = self._rend - self._rpos
        out[:have] = self._rview[self._rpos : self._rend]
        self._rpos = self._rend = 0
        arr = np.frombuffer(out, dtype=np.uint8)
        iov = make_iov(np.array([arr.ctypes.data + have], dtype=np.uint64),
                       np.array([n - have], dtype=np.uint64))
        sock_readv(self.fd, iov, deadline, self._arm)
        return out

    def recv_exact(self, n: int, deadline: float) -> bytearray:
        self._guard()
        try:
            return self._take(n, deadline)
        except (Timeout, BrokenLink):
            self.close()
            raise

    @property
    def last_request_id(self) -> int:
        """The request id of the last :meth:`call` (a follow-up frame carries it)."""
        return self._last_rid

    def recv(self, deadline: float, limit: int = p.MAX_PAYLOAD) -> tuple[int, p.Message]:
        """Receive one frame. Raw bytes that follow ReadData/Write are left for recv_iov.
        A payload longer than ``limit`` is a protocol error, raised before it is read."""
        self._guard()
        try:
            self._fill(p.HEADER_SIZE, deadline)
            head = p.decode_header(self._rview[self._rpos : self._rpos + p.HEADER_SIZE])
            if head.length > limit:
                raise RemoteProtocolError(
                    f"frame of {head.length} bytes exceeds the {limit} allowed here")
            self._rpos += p.HEADER_SIZE
            payload = self._take(head.length, deadline)
        except (Timeout, BrokenLink):
            self.close()
            raise
        return head.request_id, p.decode_payload(head.type, payload)

    def send_iov(self, iov: np.ndarray, deadline: float, head: p.Message | None = None,
                 request_id: int = 0) -> None:
        """Send the bytes ``iov`` names; with ``head``, that frame first, in the same
        system call (a small read's answer is then one segment)."""
        self._guard()
        frame = None
        if head is not None:
            frame = p.encode(head, request_id)
            first = np.empty((len(iov) + 1, 2), dtype=np.uint64)
            addr = ctypes.cast(ctypes.c_char_p(frame), ctypes.c_void_p).value
            assert addr is not None  # a bytes object's buffer is never NULL
            first[0, 0] = addr
            first[0, 1] = len(frame)
            first[1:] = iov
            iov = first
        self._io(sock_writev, iov, deadline)
        del frame  # kept alive until the bytes are sent

    def recv_iov(self, iov: np.ndarray, deadline: float) -> None:
        """Receive exactly the bytes ``iov`` names, straight into memory."""
        self._guard()
        if self._rend > self._rpos:
            part, iov = self._drain(iov)
            if part is not None:  # the rest of a span the read-ahead began
                self._io(sock_readv, part, deadline)
        if len(iov):
            self._io(sock_readv, iov, deadline)

    def _drain(self, iov: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
        """Copy read-ahead bytes into the front of ``iov``. Returns what is still to read: the
        rest of a span the read-ahead ended in (a one-span iovec, or None), then the spans
        after it (a view of ``iov``: a big request's iovecs are never copied here)."""
        have = self._rend - self._rpos
        if len(iov) == 1:  # the common small read: no numpy beyond two scalars
            base, n = int(iov[0, 0]), int(iov[0, 1])
            used = min(n, have)
            ctypes.memmove(base, self._rbuf_addr + self._rpos, used)
            self._rpos += used
            return None, (iov[:0] if used == n else
                          np.array([[base + used, n - used]], np.uint64))
        iov = np.ascontiguousarray(iov, dtype=np.uint64)
        # The spans the read-ahead can reach: at most ``have`` of them (spans are >= 1 byte);
        # a short look first, as spans are usually far longer than a byte.
        window = iov[: min(len(iov), 64)]
        if int(window[:, 1].sum()) < have:
            window = iov[: min(len(iov), have)]
        if not window[:, 1].all():  # zero-length spans (rare): drop them, then look again
            iov = iov[iov[:, 1] != 0]
            window = iov[: min(len(iov), have)]
        src = self._rbuf_addr + self._rpos
        ends = np.cumsum(window[:, 1])
        k = int(np.searchsorted(ends, have, side="right"))  # spans covered entirely
        for base, n in window[:k].tolist():
            ctypes.memmove(base, src, n)
            src += n
        used = int(ends[k - 1]) if k else 0
        rest, part = iov[k:], None
        if len(rest) and have > used:
            took = have - used
            base, n = int(rest[0, 0]), int(rest[0, 1])
            ctypes.memmove(base, src, took)
            part = np.array([[base + took, n - took]], dtype=np.uint64)
            rest = rest[1:]
            used = have
        self._rpos += used
        return part, rest

    def _io(self, fn: SockIo, iov: np.ndarray, deadline: float) -> None:
        try:
            fn(self.fd, iov, deadline, self._arm)
        except (Timeout, BrokenLink):
            self.close()
            raise

    # ------------------------------------------------------------------ client calls

    def call(self, msg: p.Message, deadline: float) -> p.Message:
        """Send a request and return its answer frame; an Error frame raises its error."""
        self._last_rid = next(self._rid) & 0xFFFFFFFF
        self.send(msg, deadline, self._last_rid)
        return self.answer(deadline)

    def answer(self, deadline: float) -> p.Message:
        """The next answer to the last request sent with :meth:`call` (a request may have
        several, e.g. a push's go-ahead and its confirmation); an Error frame raises."""
        rid = self._last_rid
        try:
            got_rid, reply = self.recv(deadline)
        except ProtocolError:
            self.close()
            raise
        if got_rid != rid:
            self.close()
            raise RemoteProtocolError(f"answer to request {got_rid}, expected {rid}")
        if isinstance(reply, p.Error):
            raise error_for_code(reply.code, reply.message)
        return reply

