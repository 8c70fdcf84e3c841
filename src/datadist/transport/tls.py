"""TLS for links that cross untrusted networks (an option).

Who calls: ``tcp.open_channel`` and ``TcpListener`` when the engine has a :class:`TlsConfig`.
Both ends present a certificate signed by the configured CA (mutual TLS); peers are
identified by cluster id in the handshake that follows, not by host name (deployments link by
IP address), so host names are not checked.

The price: encrypted bytes cannot go straight from registered memory to the socket with
``writev``/``readv``. A TLS channel sends and receives each span through ``SSLSocket`` on a
view of the memory, one call per span (coalesced spans: a run of blocks, not a block), and
runs at the speed of the cipher rather than of the wire. Same-host paths are not affected:
their bytes never touch the network.
"""

from __future__ import annotations

import ctypes
import socket
import ssl
import time

import numpy as np

from datadist.core.errors import BrokenLink, LinkFailed, Timeout
from datadist.transport.channel import Channel
from datadist.transport.iov import SockIo, sock_readv


def _span_view(base: int, n: int) -> memoryview:
    return memoryview((ctypes.c_char * n).from_address(base)).cast("B")


class TlsChannel(Channel):
    """A :class:`Channel` over an ``SSLSocket``: the same framing and deadlines, with the
    bulk paths going through the TLS layer span by span."""

    sock: ssl.SSLSocket

    @classmethod
    def wrap_client(cls, chan: Channel, ctx: ssl.SSLContext, deadline: float) -> TlsChannel:
        """TLS handshake as a client on a connected channel; bounded by the deadline."""
        try:
            chan.sock.setblocking(True)
            tls = ctx.wrap_socket(chan.sock, do_handshake_on_connect=False)
        except (OSError, ssl.SSLError) as e:
            chan.close()
            raise LinkFailed(f"TLS setup with {chan.address} failed: {e}") from e
        out = cls(tls, chan.address)
        out.handshake(deadline)
        return out

    @classmethod
    def wrap_server(cls, sock: socket.socket, address: str, ctx: ssl.SSLContext) -> TlsChannel:
        sock.setblocking(True)
        return cls(ctx.wrap_socket(sock, server_side=True, do_handshake_on_connect=False),
                   address)

    def handshake(self, deadline: float) -> None:
        try:
            self._arm(deadline)
            self.sock.do_handshake()
        except TimeoutError:
            self.close()
            raise Timeout(f"TLS handshake with {self.address} timed out") from None
        except (OSError, ssl.SSLError) as e:
            self.close()
            raise LinkFailed(f"TLS handshake with {self.address} failed: {e}") from e

    def wait_readable(self, timeout: float) -> bool:
        if not self.closed and self.sock.pending():
            return True
        return super().wait_readable(timeout)

    def peer_gone(self) -> bool:
        if not self.closed and self.sock.pending():
            return True
        return super().peer_gone()

    # The socket's own timeout (poll inside the ssl module) replaces SO_RCVTIMEO, which
    # OpenSSL would report as an error rather than as a timeout.
    def _arm(self, deadline: float, expired: bool = False) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise Timeout(f"deadline passed on the connection to {self.address}")
        self.sock.settimeout(left)

    def _send_bytes(self, data: bytes | memoryview, deadline: float) -> None:
        try:
            self._send_view(memoryview(data).cast("B"), deadline)
        except (Timeout, BrokenLink):
            self.close()
            raise

    def _send_view(self, view: memoryview, deadline: float) -> None:
        sent = 0
        while sent < len(view):
            self._arm(deadline)
            try:
                sent += self.sock.send(view[sent:])
            except TimeoutError:
                raise Timeout(f"sending to {self.address} timed out") from None
            except (OSError, ssl.SSLError) as e:
                raise BrokenLink(f"TLS send to {self.address} failed: {e}") from e

    def _recv_some(self, view: memoryview, deadline: float) -> int:
        """One receive into ``view``: at least a byte, or Timeout / BrokenLink."""
        self._arm(deadline)
        try:
            n = self.sock.recv_into(view)
        except TimeoutError:
            raise Timeout(f"receiving from {self.address} timed out") from None
        except (OSError, ssl.SSLError) as e:
            raise BrokenLink(f"TLS receive from {self.address} failed: {e}") from e
        if not n:
            raise BrokenLink(f"connection to {self.address} closed by the peer")
        return n

    def _recv_view(self, view: memoryview, deadline: float) -> None:
        got = 0
        while got < len(view):
            got += self._recv_some(view[got:], deadline)

    def _fill(self, n: int, deadline: float) -> None:
        if self._rend - self._rpos >= n:
            return
        if self._rpos + n > len(self._rbuf):
            have = self._rend - self._rpos
            self._rbuf[:have] = self._rbuf[self._rpos : self._rend]
            self._rpos, self._rend = 0, have
        while self._rend - self._rpos < n:
            self._rend += self._recv_some(self._rview[self._rend :], deadline)

    def _take(self, n: int, deadline: float) -> bytearray:
        if n <= len(self._rbuf):
            return super()._take(n, deadline)
        out = bytearray(n)
        have = self._rend - self._rpos
        out[:have] = self._rview[self._rpos : self._rend]
        self._rpos = self._rend = 0
        self._recv_view(memoryview(out)[have:], deadline)
        return out

    def _io(self, fn: SockIo, iov: np.ndarray, deadline: float) -> None:
        """Bulk spans, one TLS call per span (see the module docstring)."""
        move = self._recv_view if fn is sock_readv else self._send_view
        try:
            for base, n in iov.tolist():
                move(_span_view(base, n), deadline)
        except (Timeout, BrokenLink):
            self.close()
            raise
