"""A fake owner that speaks the wire protocol just well enough to fail on purpose.

Who calls: tests of what a puller does when its peer breaks *mid-transfer*, which a real
prompt cannot be made to do on cue. Run :func:`fake_owner_main` in a peer process
(:class:`datadist.testing.procs.Peer`); it reports its ``(ip, port)``, accepts one
connection, answers the Hello, and answers the first Read with a ``ReadData`` frame
announcing the right byte count followed by only part of the bytes. It then reports
``"partial"`` and does what ``behaviour`` says:

* ``"stall"``: keep the connection open and send nothing more (until the parent closes us);
* ``"exit"``: exit at once, so the kernel closes the connection (FIN);
* ``"reset"``: close with SO_LINGER 0, so the puller sees a reset (RST);
* ``"oversize"``: announce one byte more than was asked for (a lying owner), then stall.

The Welcome carries an all-zero boot id, so every puller treats the fake as another host and
uses the TCP path.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
from collections.abc import Callable
from typing import TypeVar

from datadist.testing.procs import PeerLink
from datadist.wire import protocol as p

__all__ = ["BEHAVIOURS", "EchoOwner", "FakeServer", "SilentOwner", "fake_owner_main"]

BEHAVIOURS = ("stall", "exit", "reset", "oversize")
_S = TypeVar("_S", bound="FakeServer")


def _next_message(conn: socket.socket, decoder: p.FrameDecoder,
                  pending: list[tuple[int, object]]) -> tuple[int, object]:
    while not pending:
        data = conn.recv(65536)
        if not data:
            raise EOFError("the puller closed the connection")
        pending.extend(decoder.feed(data))
    return pending.pop(0)


def fake_owner_main(link: PeerLink, cluster_id: int, behaviour: str) -> None:
    if behaviour not in BEHAVIOURS:
        raise ValueError(f"unknown behaviour {behaviour!r}; use one of {BEHAVIOURS}")
    server = socket.create_server(("127.0.0.1", 0))
    link.send(server.getsockname()[:2])
    conn, _ = server.accept()
    decoder = p.FrameDecoder()
    pending: list[tuple[int, object]] = []
    rid, hello = _next_message(conn, decoder, pending)
    if not isinstance(hello, p.Hello):
        raise AssertionError(f"expected Hello, got {hello!r}")
    conn.sendall(p.encode(p.Welcome(cluster_id, 1, os.getpid(), 0, b"\0" * 16), rid))
    rid, read = _next_message(conn, decoder, pending)
    if not isinstance(read, p.Read):
        raise AssertionError(f"expected Read, got {read!r}")
    total = int(read.lengths.sum()) * len(read.tensors)
    if behaviour == "oversize":
        conn.sendall(p.encode(p.ReadData(total + 1), rid))
    else:
        conn.sendall(p.encode(p.ReadData(total), rid) + b"\xa5" * (total // 2))
    link.send("partial")
    if behaviour == "exit":
        os._exit(0)
    if behaviour == "reset":
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()
    # stall (and after a reset, idle): hold on until the parent tells us to stop
    with contextlib.suppress(EOFError, OSError):
        link.recv()


class FakeServer:
    """What the fake owners share: a listener on 127.0.0.1 (``port``; 0 picks one) and, with
    ``local_name``, one on that abstract unix name; one accepting thread per listener and one
    serving thread per connection, running the subclass's ``_serve(conn)``. Connections get
    ``conn_timeout`` (None: block). ``close`` stops accepting, waits for the accepting threads
    (so a later owner may bind the same names) and shuts every connection down. A context
    manager; nothing blocks the caller. Subclasses set their own state before calling
    ``__init__``: connections may arrive at once."""

    def __init__(self, *, port: int = 0, local_name: bytes | None = None,
                 conn_timeout: float | None = 10.0) -> None:
        self._closing = threading.Event()
        self._conn_timeout = conn_timeout
        self._conns: list[socket.socket] = []
        tcp = socket.create_server(("127.0.0.1", port), backlog=16)
        self.address: tuple[str, int] = tcp.getsockname()[:2]
        self._listeners = [tcp]
        if local_name is not None:
            unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            unix.bind(local_name)
            unix.listen(16)
            self._listeners.append(unix)
        self._accepting = [threading.Thread(target=self._accept, args=(s,), daemon=True)
                           for s in self._listeners]
        for s, t in zip(self._listeners, self._accepting, strict=True):
            s.settimeout(0.2)
            t.start()

    def close(self) -> None:
        self._closing.set()
        for t in self._accepting:
            t.join(5)
        for s in self._listeners:
            s.close()
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()

    def __enter__(self: _S) -> _S:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self, server: socket.socket) -> None:
        while not self._closing.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(self._conn_timeout)
            self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        raise NotImplementedError


class EchoOwner(FakeServer):
    """A fake owner that *claims* to be on the puller's host (tests of the same-host trust
    model, tests/security/test_same_host_trust.py).

    Its WELCOME echoes the boot id, pid namespace and pid of the puller's HELLO and sets
    FEATURE_LOCAL (unless ``boot_id`` is given: then it says that boot id, another host); a
    READ with the GRANT flag is answered with a GRANT naming ``grant_addr`` for every tensor
    (what a remote attacker would send to make the puller copy its own memory), any other READ
    with READ_DATA of ``fill`` bytes. ``local_name``: also serve that abstract unix name (a
    local squatter). ``shm_grant``: a READ with GRANT | SHM is answered with what it returns
    for that READ (an SHM_GRANT naming whatever memfds a lying owner names; None: as without
    SHM). ``reads`` records the flags of every READ. Serves on threads until ``close``; every
    wait is bounded by the sockets' timeouts.
    """

    def __init__(self, cluster_id: int, *, grant_addr: int = 0, port: int = 0,
                 boot_id: bytes | None = None, local_name: bytes | None = None,
                 fill: int = 0x5A,
                 shm_grant: Callable[[p.Read], p.ShmGrant | None] | None = None) -> None:
        self.cluster_id, self.grant_addr, self.boot_id, self.fill = (cluster_id, grant_addr,
                                                                     boot_id, fill)
        self.shm_grant = shm_grant
        self.reads: list[int] = []
        super().__init__(port=port, local_name=local_name)

    def _serve(self, conn: socket.socket) -> None:
        import numpy as np

        decoder = p.FrameDecoder()
        pending: list[tuple[int, object]] = []
        with contextlib.suppress(EOFError, OSError), conn:
            rid, hello = _next_message(conn, decoder, pending)
            assert isinstance(hello, p.Hello)
            if self.boot_id is None:
                welcome = p.Welcome(self.cluster_id, 1, hello.pid, hello.pid_ns, hello.boot_id,
                                    p.FEATURE_LOCAL)
            else:
                welcome = p.Welcome(self.cluster_id, 1, hello.pid, hello.pid_ns, self.boot_id)
            conn.sendall(p.encode(welcome, rid))
            lease = 0
            while not self._closing.is_set():
                rid, msg = _next_message(conn, decoder, pending)
                if isinstance(msg, p.Read):
                    self.reads.append(int(msg.flags))
                    shm = (self.shm_grant(msg) if self.shm_grant is not None
                           and msg.flags & p.ReadFlags.GRANT and msg.flags & p.ReadFlags.SHM
                           else None)
                    if shm is not None:
                        conn.sendall(p.encode(shm, rid))
                    elif msg.flags & p.ReadFlags.GRANT and self.grant_addr:
                        lease += 1
                        bases = np.full(len(msg.tensors), self.grant_addr, dtype=np.uint64)
                        conn.sendall(p.encode(p.Grant(lease, bases), rid))
                    else:
                        n = int(msg.lengths.sum()) * len(msg.tensors)
                        conn.sendall(p.encode(p.ReadData(n), rid) + bytes([self.fill]) * n)
                elif isinstance(msg, p.Ping):
                    conn.sendall(p.encode(p.Pong(msg.nonce), rid))
                elif isinstance(msg, p.Bye):
                    conn.sendall(p.encode(p.Ok(), rid))
                    return
                elif not isinstance(msg, p.Release):
                    return


class SilentOwner(FakeServer):
    """An owner in this process that welcomes every connection (cluster ``cluster_id``, an
    all-zero boot id: another host, so pullers take the TCP path) and then reads every request
    and answers none: transfers to it stay in flight until their deadlines, holding the link
    and the puller's workers (tests of what waits behind them: unlink, a second transfer,
    close). ``address`` is where it listens. A context manager; leaving it closes every
    connection. Serving runs on daemon threads; nothing blocks the caller."""

    def __init__(self, cluster_id: int) -> None:
        self.cluster_id = cluster_id
        super().__init__(conn_timeout=None)

    def _serve(self, conn: socket.socket) -> None:
        decoder = p.FrameDecoder()
        welcomed = False
        with contextlib.suppress(OSError):
            while chunk := conn.recv(1 << 16):
                for rid, msg in decoder.feed(chunk):
                    if not welcomed and isinstance(msg, p.Hello):
                        conn.sendall(p.encode(p.Welcome(self.cluster_id, 1, os.getpid(), 0,
                                                        b"\0" * 16), rid))
                        welcomed = True
