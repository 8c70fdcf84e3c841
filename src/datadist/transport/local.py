"""The local channel: the same protocol over an abstract unix socket, with kernel-verified peers.

Why: the same-host paths (cross-memory attach, shared memory) read another process's memory
by pid. Whatever a peer *says* about itself in HELLO / WELCOME (boot id, pid namespace, pid)
a remote peer can say too. A unix socket cannot be reached from another host, and the kernel
tells each end who is on the other one (``SO_PEERCRED``: pid, uid, gid, translated into the
caller's pid namespace). So "same host" means exactly: this connection is a unix socket, and
the pid a puller reads is the one the kernel reported for it, never one a frame carried.

An owner that listens also serves on the abstract name :func:`local_name` of its own pid and
cluster id, and sets ``FEATURE_LOCAL`` in WELCOME. A puller that gets such a WELCOME over TCP
(with its own boot id) connects there, runs the whole handshake again on the unix socket and,
if that works, uses the unix connection as the link's control channel. Abstract names live in
the network namespace: processes in different ones fall back to TCP.

Who calls: the engine (``LocalListener``, owner side) and ``core.links`` (``connect_local``,
puller side). ``connect_local`` does not block past its deadline (a local connect is
immediate or refused).
"""

from __future__ import annotations

import itertools
import os
import socket
import ssl
import struct
import time
from dataclasses import dataclass

from datadist.core.errors import LinkFailed, Timeout
from datadist.transport.base import LeaseT, RequestHandler
from datadist.transport.channel import Channel
from datadist.transport.tcp import ConnBudget, TcpListener
from datadist.transport.tls import TlsChannel

__all__ = ["LocalCred", "LocalListener", "connect_local", "local_name", "peer_cred"]

_CRED = struct.Struct("iII")  # struct ucred: pid, uid, gid
_serial = itertools.count(1)


@dataclass(frozen=True, slots=True)
class LocalCred:
    """Who the kernel says is on the other end of a unix socket (pid 0: not visible from our
    pid namespace)."""

    pid: int
    uid: int
    gid: int

    def may_read_us(self) -> bool:
        """Whether the kernel would let this peer read our memory: the same uid, or root.
        Grants (addresses) go only to such peers."""
        return self.pid > 0 and self.uid in (os.getuid(), 0)

    def we_may_read(self) -> bool:
        """Whether we could read the peer's memory: the same uid, or we are root."""
        return self.pid > 0 and os.getuid() in (self.uid, 0)


def local_name(pid: int, cluster_id: int) -> bytes:
    """The abstract socket name an owner with ``pid`` (in its own pid namespace) and
    ``cluster_id`` serves on: ``"\\0datadist-v1.<pid>.<cluster_id>"``."""
    return b"\0" + f"datadist-v1.{pid}.{cluster_id}".encode()


def peer_cred(sock: socket.socket) -> LocalCred:
    """SO_PEERCRED of a connected unix socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size)
    return LocalCred(*_CRED.unpack(raw))


def _describe(cred: LocalCred) -> str:
    return f"local pid {cred.pid} uid {cred.uid} #{next(_serial)}"


def connect_local(name: bytes, deadline: float,
                  tls: ssl.SSLContext | None = None) -> Channel:
    """Connect to the abstract socket ``name``; the channel's ``local_cred`` says who
    answered. Raises LinkFailed (nobody serves that name) or Timeout."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise Timeout("no time left for the local channel")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.settimeout(left)
        sock.connect(name)
        sock.setblocking(True)
        cred = peer_cred(sock)
    except TimeoutError:
        sock.close()
        raise Timeout("connecting to the local channel timed out") from None
    except OSError as e:
        sock.close()
        raise LinkFailed(f"no local channel: {e.strerror or e}") from e
    chan = Channel(sock, _describe(cred))
    if tls is not None:
        chan = TlsChannel.wrap_client(chan, tls, deadline)
    chan.local_cred = cred
    return chan


class LocalListener(TcpListener[LeaseT]):
    """A :class:`TcpListener` on an abstract unix socket: the same serving, and every
    channel it accepts carries the peer's kernel-verified ``local_cred``.

    ``budget``: the connection caps, shared with the engine's TCP listener (one budget for
    both); local peers count per verified uid, so a process that forks gains nothing.

    Raises LinkFailed if the name is taken (another process, or another engine of ours with
    the same cluster id): the engine then serves TCP only.
    """

    def __init__(self, name: bytes, handler: RequestHandler[LeaseT],
                 tls: ssl.SSLContext | None = None, budget: ConnBudget | None = None) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.bind(name)
        except OSError as e:
            sock.close()
            raise LinkFailed(f"cannot serve the local channel {name[1:]!r}: "
                             f"{e.strerror or e}") from e
        self.name = name
        super().__init__("", 0, handler, tls, sock=sock, budget=budget)

    def __repr__(self) -> str:
        return f"<LocalListener {self.name[1:].decode()} conns={len(self._conns)}>"

    def _peer_of(self, sock: socket.socket, addr: object) -> tuple[str, str]:
        """Local peers are counted per verified uid (they share no address; a per-pid count
        would let a fork multiply it)."""
        cred = peer_cred(sock)
        return f"uid {cred.uid}", _describe(cred)

    def _channel(self, sock: socket.socket, addr: object) -> Channel:
        cred = peer_cred(sock)
        sock.setblocking(True)
        address = _describe(cred)
        chan: Channel
        if self.tls is not None:
                chan = TlsChannel.wrap_server(sock, address, self.tls)
        else:
            chan = Channel(sock, address)
        chan.local_cred = cred
        return chan
