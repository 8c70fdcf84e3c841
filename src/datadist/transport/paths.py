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

import numpy as np

from datadist.core.errors import RemoteProtocolError
from datadist.core.layout import span_iov
from datadist.transport.base import TransportCaps
from datadist.transport.iov import CmaRefused, iov_nbytes, make_iov, vm_copy
from datadist.transport.tcp import Channel
from datadist.wire import protocol as p

__all__ = ["CmaPath", "CmaRefused", "TcpPath"]


def _expect(reply: p.Message, kind: type, chan: Channel) -> None:
    if not isinstance(reply, kind):
        chan.close()
        raise RemoteProtocolError(f"expected {kind.__name__}, got {type(reply).__name__}")


class TcpPath:
    caps = TransportCaps("tcp", same_host_only=False, one_sided=False)

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

    def write(self, chan: Channel, msg: p.Write, local: np.ndarray, deadline: float) -> None:
        reply = chan.call(msg, deadline)
        _expect(reply, p.Ok, chan)
        chan.send_iov(local, deadline)
        _, done = chan.recv(deadline)
        if isinstance(done, p.Error):
            from datadist.core.errors import error_for_code

            raise error_for_code(done.code, done.message)
        _expect(done, p.Ok, chan)


class CmaPath:
    caps = TransportCaps("cma", same_host_only=True, one_sided=True)

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def read(self, chan: Channel, msg: p.Read, local: np.ndarray, deadline: float) -> None:
        msg = p.Read(msg.key, msg.unit_bytes, msg.flags | p.ReadFlags.GRANT, msg.tensors,
                     msg.offsets, msg.lengths)
        grant = chan.call(msg, deadline)
        _expect(grant, p.Grant, chan)
        assert isinstance(grant, p.Grant)
        if len(grant.bases) != len(msg.tensors):
            chan.close()
            raise RemoteProtocolError("grant does not match the request")
        remote = make_iov(*span_iov(grant.bases, msg.offsets, msg.lengths))
        ok = False
        try:
            vm_copy(self.pid, local, remote)
            ok = True
        finally:
            chan.send(p.Release(grant.lease_id, ok), deadline)
