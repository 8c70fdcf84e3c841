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

from datadist.testing.procs import PeerLink
from datadist.wire import protocol as p

__all__ = ["BEHAVIOURS", "fake_owner_main"]

BEHAVIOURS = ("stall", "exit", "reset", "oversize")


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
    decoder, pending = p.FrameDecoder(), []
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
