"""Links: our connections to remote clusters, and which data path each uses.

A :class:`Link` is the client end of one one-sided link (``link_clusters``): a control
channel to the peer's listener, what the handshake told us about the peer, and the data path
chosen for it. Transfers on one link are serialised by its lock, as in LLM-DataDist; a caller
that cannot get the lock before its deadline gets LLM_TIMEOUT.

Path choice (``choose_path``): forced by the ``transport`` option or ``DATADIST_TRANSPORT``
(``nixl`` forces NIXL, transport/nixl.py, which ``auto`` never picks), else same-host peers
(same boot id and pid namespace, not the IP address) use cross-memory attach and everything
else TCP. If the kernel refuses cross-memory attach, the link falls back
to TCP by itself and logs why, once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from datadist.core import auth
from datadist.core.errors import (
    BrokenLink,
    Busy,
    DatadistError,
    InvalidArgument,
    LinkFailed,
    Timeout,
)
from datadist.transport.base import PathKind
from datadist.transport.paths import CmaPath, CmaRefused, TcpPath
from datadist.transport.tcp import Channel
from datadist.wire import protocol as p

log = logging.getLogger(__name__)


def _read_boot_id() -> bytes:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return bytes.fromhex(f.read().strip().replace("-", ""))[:16].ljust(16, b"\0")
    except OSError:  # pragma: no cover - not Linux
        return b"\0" * 16


def _read_pid_ns() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:  # pragma: no cover
        return 0


@dataclass(frozen=True, slots=True)
class HostIdentity:
    """What makes two processes 'on the same host' for memory access."""

    boot_id: bytes
    pid_ns: int
    pid: int

    @classmethod
    def current(cls) -> HostIdentity:
        return cls(_read_boot_id(), _read_pid_ns(), os.getpid())

    def same_host(self, boot_id: bytes, pid_ns: int) -> bool:
        return self.boot_id == boot_id and self.pid_ns == pid_ns and any(self.boot_id)


def forced_path(option: str | None) -> PathKind:
    """The path the user forces: the option wins over ``DATADIST_TRANSPORT``."""
    raw = option or os.environ.get("DATADIST_TRANSPORT", "") or "auto"
    try:
        return PathKind(raw.strip().lower())
    except ValueError:
        raise InvalidArgument(
            f"unknown transport {raw!r}; use one of {[k.value for k in PathKind]}"
        ) from None


@dataclass(eq=False)
class Link:
    cluster_id: int
    host: str
    port: int
    chan: Channel
    welcome: p.Welcome
    path: Any  # TcpPath | CmaPath | transport.nixl.NixlPath
    reason: str
    connect: Callable[[float], tuple[Channel, p.Welcome]]
    lock: threading.Lock = field(default_factory=threading.Lock)
    closing: bool = False  # unlinked: the transfer holding the lock closes the channel

    def __repr__(self) -> str:
        state = "closing" if self.closing else ("down" if self.chan.closed else "up")
        return (
            f"<Link cluster={self.cluster_id} {self.host}:{self.port} "
            f"path={self.path.caps.name} ({self.reason}) {state}>"
        )

    @property
    def path_name(self) -> str:
        return self.path.caps.name

    def close(self) -> None:
        """Close the channel and release what the path holds (shared mappings). Idempotent.

        Never closes the socket under a transfer in flight (another thread holding the
        lock): the kernel would hand its fd number to the next connection (a relink), and
        the transfer would go on reading and writing that one. The transfer is woken by a
        shutdown instead (reads see EOF, writes fail) and closes the channel on its way out.
        """
        self.closing = True
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
        handshake, so a restarted peer is checked (and authenticated) anew."""
        chan, welcome = self.connect(deadline)
        old_pid = self.welcome.pid
        self.chan, self.welcome = chan, welcome
        if welcome.pid != old_pid and isinstance(self.path, CmaPath):
            # A new process behind the same address: its memory is not the old one's.
            self.path.close()
            self.path = CmaPath(welcome.pid, allow_shm=self.path.allow_shm,
                                name=self.path.caps.name)

    def run(self, deadline: float, op):  # type: ignore[no-untyped-def]
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
            try:
                return op(self.path, self.chan)
            except CmaRefused as e:
                log.warning(
                    "cross-memory attach to pid %d refused (%s); link to cluster %d falls "
                    "back to tcp", self.welcome.pid, e, self.cluster_id,
                )
                self.path.close()
                self.path, self.reason = TcpPath(), f"cma refused by the kernel: {e}"
                return op(self.path, self.chan)
        finally:
            if self.closing:  # unlinked while we ran: see close()
                self.chan.close()
                self.path.close()
            self.lock.release()


def greet(
    host: str,
    port: int,
    cluster_id: int,
    hello: Callable[[], p.Hello],
    secret: bytes | None,
    deadline: float,
    tls: ssl.SSLContext | None = None,
) -> tuple[Channel, p.Welcome]:
    """Connect, say Hello, check the peer is ``cluster_id`` and, with a secret, run the
    challenge and response (core/auth.py). Returns the open channel and the Welcome."""
    chan = Channel.connect(host, port, deadline, tls)
    try:
        h = hello()
        welcome = chan.call(h, deadline)
        if not isinstance(welcome, p.Welcome):
            raise LinkFailed(f"expected Welcome, got {type(welcome).__name__}")
        if welcome.cluster_id != cluster_id:
            raise LinkFailed(
                f"the peer at {host}:{port} is cluster {welcome.cluster_id}, not {cluster_id}"
            )
        required = bool(welcome.features & p.FEATURE_AUTH)
        if required and secret is None:
            raise LinkFailed(f"cluster {cluster_id} requires a shared secret "
                             "(DATADIST_AUTH_SECRET / LLMConfig.auth_secret)")
        if secret is not None:
            parts = auth.split_server_proof(welcome.proof) if required else None
            if parts is None:
                raise LinkFailed(f"cluster {cluster_id} did not prove the shared secret")
            server_nonce, mac = parts
            want = auth.server_proof(secret, h.proof, server_nonce, cluster_id, h.cluster_id)
            if not auth.same(want[auth.NONCE_BYTES:], mac):
                raise LinkFailed(f"cluster {cluster_id} failed to prove the shared secret")
            ok = chan.call(p.Auth(auth.client_proof(secret, h.proof, server_nonce, cluster_id,
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


def choose_path(
    forced: PathKind, me: HostIdentity, welcome: p.Welcome, nixl: Any = None
) -> tuple[Any, str]:
    """The data path of a new link and why. ``nixl``: the engine's NixlAgent, present only
    when the transport is forced to nixl (the caller then loads the peer's metadata)."""
    if forced == PathKind.NIXL and nixl is not None:
        from datadist.transport.nixl import NixlPath

        return NixlPath(nixl), "forced nixl"
    same = me.same_host(welcome.boot_id, welcome.pid_ns)
    if forced == PathKind.TCP:
        return TcpPath(), "forced tcp"
    if forced in (PathKind.CMA, PathKind.SHM):
        if not same:
            return TcpPath(), f"{forced.value} forced but the peer is on another host"
        if forced == PathKind.CMA:
            return CmaPath(welcome.pid, allow_shm=False), "forced cma"
        return (CmaPath(welcome.pid, name="shm"),
                "forced shm (cross-memory attach where the owner's memory is not shareable)")
    if same:
        return (CmaPath(welcome.pid),
                "same host (boot id and pid namespace match): shared memory for caches in "
                "shareable memory, cross-memory attach otherwise")
    return TcpPath(), "peer on another host"


__all__ = ["Busy", "HostIdentity", "Link", "choose_path", "forced_path"]
