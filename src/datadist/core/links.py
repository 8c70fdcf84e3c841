"""Links: our connections to remote clusters, and which data path each uses.

A :class:`Link` is one end of a link: a channel to the peer, what the handshake told us
about the peer, and the data path chosen for it. Transfers on one link are serialised by its
lock, as in LLM-DataDist; a caller that cannot get the lock before its deadline gets
LLM_LINK_BUSY.

A link has two ends, as in LLM-DataDist (docs/protocol.md, "Reverse channels"):

* the *linker's* end (``link_clusters``): the control channel to the peer's listener, on
  which we send requests. The linker also opens a second connection, the reverse channel
  (``served``), on which it answers the peer's requests (a thread of the engine serves it);
* the *listener's* end (``inbound``): that reverse channel, seen from the listener, on which
  the listener sends requests to the linker. It cannot be re-opened from this side: when the
  linker goes away, transfers on it fail with LLM_LINK_FAILED.

Path choice (``connect``), on every connect and reconnect: forced by the ``transport`` option
or ``DATADIST_TRANSPORT`` (``nixl`` forces NIXL, transport/nixl.py, which ``auto`` never
picks); else a peer is on this host only if the kernel says so: its WELCOME
over TCP offers the local channel (``transport/local.py``) and a unix-socket connection to it
completes the handshake. The link then runs over that connection and reads the memory of the
pid the kernel reported for it (shared memory or cross-memory attach), never a pid a frame
named. Everything else is TCP. If the kernel refuses cross-memory attach, the link falls back
to a stream path by itself and logs why, once.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

from datadist.core import auth
from datadist.core.config import HostIdentity, PathKind, forced_path
from datadist.core.errors import (
    BrokenLink,
    Busy,
    DatadistError,
    LinkFailed,
    RemoteProtocolError,
    Timeout,
)
from datadist.transport.address import format_host_port
from datadist.transport.channel import Channel
from datadist.transport.local import LocalCred, connect_local, local_name
from datadist.transport.paths import CmaPath, CmaRefused, TcpPath
from datadist.transport.tcp import open_channel
from datadist.wire import protocol as p

log = logging.getLogger(__name__)


_R = TypeVar("_R")  # what a Link.run op returns


@dataclass(eq=False)
class Link:
    """A link to one peer cluster: its control channel, the data path chosen for it (and why),
    and a lock that serialises its transfers."""

    cluster_id: int
    host: str
    port: int
    chan: Channel
    welcome: p.Welcome
    path: Any  # TcpPath | CmaPath | transport.nixl.NixlPath
    reason: str
    connect: Callable[[float], Connected]
    lock: threading.Lock = field(default_factory=threading.Lock)
    closing: bool = False  # unlinked: the transfer holding the lock closes the channel
    inbound: bool = False  # the listener's end: requests go over the linker's reverse channel
    served: Channel | None = None  # linker's end: the reverse channel we answer requests on
    # listener's end: the link token its reverse Hello echoed (that of the control channel
    # it belongs to; only that channel's token may replace it while that channel is live)
    token: bytes = b""

    def __repr__(self) -> str:
        state = "closing" if self.closing else ("down" if self.chan.closed else "up")
        end = "inbound" if self.inbound else format_host_port(self.host, self.port)
        return (
            f"<Link cluster={self.cluster_id} {end} "
            f"path={self.path.caps.name} ({self.reason}) {state}>"
        )

    @property
    def path_name(self) -> str:
        name: str = self.path.caps.name
        return name

    def close(self) -> None:
        """Close the channel and release what the path holds (shared mappings). Idempotent.

        Never closes the socket under a transfer in flight (another thread holding the
        lock): the kernel would hand its fd number to the next connection (a relink), and
        the transfer would go on reading and writing that one. The transfer is woken by a
        shutdown instead (reads see EOF, writes fail) and closes the channel on its way out.
        """
        self.closing = True
        if self.served is not None:
            self.served.shutdown()  # its serving thread wakes, and closes it on its way out
        if not self.lock.acquire(blocking=False):
            with contextlib.suppress(OSError):
                self.chan.sock.shutdown(socket.SHUT_RDWR)
            if not self.lock.acquire(blocking=False):
                return  # run() closes it when it releases the lock
        try:
            self.chan.close()
            self.path.close()
        finally:
            self.lock.release()

    def acquire(self, deadline: float) -> None:
        """Take the link for one transfer. Transfers on a link are serialised; one that
        waits past its deadline for another (a concurrent pull, transfer_cache_async) raises
        Busy (LLM_LINK_BUSY): nothing was tried."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise Timeout(f"no time left for a transfer on the link to {self.cluster_id}")
        if not self.lock.acquire(timeout=left):
            raise Busy(f"link to cluster {self.cluster_id} stayed busy until the deadline")

    def reconnect(self, deadline: float) -> None:
        """After a timeout or a dead peer broke the channel, open a fresh one: a full
        handshake, so a restarted peer is checked (and authenticated) anew, and the path
        chosen anew (the peer behind the address may be another process, on another host)."""
        got = self.connect(deadline)
        old = self.path
        self.chan, self.welcome, self.path, self.reason = got
        old.close()
        if old.caps.name != self.path.caps.name:
            log.info("link to cluster %d now uses %s (%s)", self.cluster_id,
                     self.path.caps.name, self.reason)
        # The reverse channel is not re-opened here: a reconnect can race an unlink, and a
        # reverse channel opened for a dying link would replace, at the peer, the one of
        # the link made next. The peer's end stays down until we link again.

    def _refused(self, e: CmaRefused) -> None:
        """The kernel refused cross-memory attach (nothing was copied): keep shared memory
        where the owner's caches are in it (it needs no ptrace permission), else tcp."""
        path = self.path
        assert isinstance(path, CmaPath)
        if path.allow_shm and not path.cma_refused:
            log.warning("cross-memory attach to pid %d refused (%s); link to cluster %d uses "
                        "shared memory where it can, a stream elsewhere", path.pid, e,
                        self.cluster_id)
            path.cma_refused = True
            self.reason = f"cma refused by the kernel ({e}): shared memory, else a stream"
            return
        log.warning("cross-memory attach to pid %d refused (%s); link to cluster %d falls "
                    "back to tcp", path.pid, e, self.cluster_id)
        path.close()
        self.path, self.reason = TcpPath(), f"cma refused by the kernel: {e}"

    def run(self, deadline: float, op: Callable[[Any, Channel], _R]) -> _R:
        """Run ``op(path, chan)`` under the lock, reconnecting a channel a timeout broke
        and falling back from CMA to TCP when the kernel refuses."""
        self.acquire(deadline)
        try:
            if self.closing:
                raise BrokenLink(f"link to cluster {self.cluster_id} was unlinked")
            if self.chan.closed or self.chan.peer_gone():
                self.chan.close()
                try:
                    self.reconnect(deadline)
                except LinkFailed as e:
                    raise BrokenLink(f"link to cluster {self.cluster_id} is down: {e}") from e
            while True:  # at most: cma, then shared memory or a stream, then tcp
                try:
                    return op(self.path, self.chan)
                except CmaRefused as e:
                    self._refused(e)
        finally:
            if self.closing:  # unlinked while we ran: see close()
                self.chan.close()
                self.path.close()
            self.lock.release()


def greet(
    host: str,
    port: int,
    cluster_id: int | None,
    hello: Callable[[], p.Hello],
    secret: bytes | None,
    deadline: float,
    tls: ssl.SSLContext | None = None,
    chan: Channel | None = None,
) -> tuple[Channel, p.Welcome]:
    """Connect (or take the connected ``chan``), say Hello, check the peer is
    ``cluster_id`` (None: whichever id it announces) and, with a secret, run the challenge
    and response (core/auth.py) for the id it announced. Returns the open channel and the
    Welcome."""
    if chan is None:
        chan = open_channel(host, port, deadline, tls)
    try:
        h = hello()
        welcome = chan.call(h, deadline)
        if not isinstance(welcome, p.Welcome):
            raise LinkFailed(f"expected Welcome, got {type(welcome).__name__}")
        if cluster_id is not None and welcome.cluster_id != cluster_id:
            raise LinkFailed(
                f"the peer at {host}:{port} is cluster {welcome.cluster_id}, not {cluster_id}"
            )
        cluster_id = welcome.cluster_id
        required = bool(welcome.features & p.FEATURE_AUTH)
        if required and secret is None:
            raise LinkFailed(f"cluster {cluster_id} requires a shared secret "
                             "(DATADIST_AUTH_SECRET / LLMConfig.auth_secret)")
        if secret is not None:
            # Link tokens (protocol FEATURE_TOKEN) end both proofs: the challenge is the rest.
            server_part = p.split_token(welcome.proof, welcome.features)[0]
            nonce = p.split_token(h.proof, h.features)[0]
            parts = auth.split_server_proof(server_part) if required else None
            if parts is None:
                raise LinkFailed(f"cluster {cluster_id} did not prove the shared secret")
            server_nonce, mac = parts
            want = auth.server_proof(secret, nonce, server_nonce, cluster_id, h.cluster_id)
            if not auth.same(want[auth.NONCE_BYTES:], mac):
                raise LinkFailed(f"cluster {cluster_id} failed to prove the shared secret")
            ok = chan.call(p.Auth(auth.client_proof(secret, nonce, server_nonce, cluster_id,
                                                    h.cluster_id)), deadline)
            if not isinstance(ok, p.Ok):
                raise LinkFailed(f"expected Ok after Auth, got {type(ok).__name__}")
    except BrokenLink as e:
        chan.close()
        raise LinkFailed(f"{host}:{port} closed the connection during the handshake "
                         "(does it require TLS?)") from e
    except DatadistError:
        chan.close()
        raise
    return chan, welcome


class Connected(NamedTuple):
    """What ``connect`` returns: a greeted control channel and the path chosen for it."""

    chan: Channel
    welcome: p.Welcome
    path: Any  # TcpPath | CmaPath | NixlPath
    reason: str


def connect(
    host: str,
    port: int,
    cluster_id: int | None,
    hello: Callable[[], p.Hello],
    secret: bytes | None,
    deadline: float,
    tls: ssl.SSLContext | None,
    forced: PathKind,
    me: HostIdentity,
    nixl: Any = None,
) -> Connected:
    """Open a link's control channel and choose its data path (module docstring).

    Greets over TCP (``cluster_id`` None: whichever id the peer announces, which the local
    channel's greeting must then repeat); a peer that claims our host and offers the local
    channel is greeted again there, and the TCP connection is closed. ``nixl``: the
    engine's NixlAgent, given only when the transport is forced to nixl (the caller then
    loads the peer's metadata).
    Blocks <= deadline.
    """
    chan, welcome = greet(host, port, cluster_id, hello, secret, deadline, tls)
    cluster_id = welcome.cluster_id
    if forced == PathKind.NIXL and nixl is not None:
        from datadist.transport.nixl import NixlPath

        return Connected(chan, welcome, NixlPath(nixl), "forced nixl")
    if forced == PathKind.TCP:
        return Connected(chan, welcome, TcpPath(), "forced tcp")
    if not me.claims_same_host(welcome.boot_id):
        why = ("peer on another host" if forced == PathKind.AUTO
               else f"{forced.value} forced but the peer is on another host")
        return Connected(chan, welcome, TcpPath(), why)
    if not welcome.features & p.FEATURE_LOCAL:
        return Connected(chan, welcome, TcpPath(),
                         "peer says it is on this host but offers no local channel")
    try:
        local = connect_local(local_name(welcome.pid, cluster_id), deadline, tls)
        local, lwelcome = greet(host, port, cluster_id, hello, secret, deadline, chan=local)
    except (LinkFailed, BrokenLink, RemoteProtocolError) as e:
        log.info("cluster %d at %s:%d says it is on this host, but its local channel "
                 "failed (%s): tcp", cluster_id, host, port, e)
        return Connected(chan, welcome, TcpPath(),
                         f"peer says it is on this host, but its local channel failed: {e}")
    except BaseException:
        chan.close()
        raise
    chan.close()  # the owner sees an idle connection end: nothing to tell it
    cred = local.local_cred
    assert isinstance(cred, LocalCred)
    path, why = _local_path(forced, cred)
    if isinstance(path, CmaPath) and lwelcome.features & p.FEATURE_LEASE:
        path.leases = True  # reads of caches named by id or model id need not ask
    return Connected(local, lwelcome, path, why)


def _local_path(forced: PathKind, cred: LocalCred) -> tuple[TcpPath | CmaPath, str]:
    """The data path to a peer the kernel verified as ``cred``."""
    if not cred.we_may_read():
        return TcpPath(), (f"same host, verified by the kernel (pid {cred.pid}, uid {cred.uid}),"
                           " but not ours to read: bytes stream over the local socket")
    if forced == PathKind.CMA:
        return CmaPath(cred.pid, allow_shm=False), f"forced cma (pid {cred.pid})"
    if forced == PathKind.SHM:
        return (CmaPath(cred.pid, name="shm"),
                f"forced shm (pid {cred.pid}; cross-memory attach where the owner's memory "
                "is not shareable)")
    return (CmaPath(cred.pid),
            f"same host, verified by the kernel (pid {cred.pid}): shared memory for caches in "
            "shareable memory, cross-memory attach otherwise")


__all__ = ["Busy", "Connected", "HostIdentity", "Link", "connect", "forced_path"]
