"""TCP: the control channel of every link, and the data path between hosts.

Who calls: the engine. ``TcpListener`` serves peers (one thread per connection, calling the
engine's :class:`RequestHandler`); ``open_channel`` opens a client's connection (a
:class:`~datadist.transport.channel.Channel`, TLS-wrapped when configured), used by the client
side of a link with a per-call deadline.

Bulk bytes never pass through Python buffers: the owner ``writev``s straight from registered
memory, the puller ``readv``s straight into the destination (see ``transport.iov``).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import selectors
import socket
import ssl
import threading
import time
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import numpy as np

from datadist.core.errors import (
    BrokenLink,
    Busy,
    DatadistError,
    InvalidArgument,
    LinkFailed,
    NotSupported,
    ProtocolError,
    RemoteProtocolError,
    Timeout,
)
from datadist.transport.address import family, format_host_port
from datadist.transport.base import LeaseT, PeerInfo, RequestHandler
from datadist.transport.channel import Channel, tune
from datadist.transport.iov import (
    crc_iov,
    iov_nbytes,
)
from datadist.transport.tls import TlsChannel
from datadist.wire import protocol as p

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT = 10.0  # seconds the server waits for a new connection's Hello
FRAME_TIMEOUT = 30.0  # seconds a frame may take to arrive once its first byte has
# The owner gives up on a reader that stops reading after this long at most; a reader that
# keeps its window shut is usually dropped sooner, by TCP_USER_TIMEOUT (USER_TIMEOUT_MS).
SERVE_SEND_TIMEOUT = 120.0
# Grants (same-host reads, a lease per grant until the reader's RELEASE): an honest reader
# holds one at a time per connection (a link serialises its transfers) and releases it right
# after its copy. More outstanding on one connection are refused; one not released within
# GRANT_TTL seconds is released by the owner (its memory may then be freed and reused), and
# within RECLAIM_GRACE seconds once its owner wants the memory back (the cache deallocated or
# being unregistered), so that a silent peer cannot keep a pool exhausted.
MAX_GRANTS_PER_CONNECTION = 4
# The NIXL messages a peer may send us; which of them a connection serves: _nixl_misplaced.
_NIXL_REQUESTS = (p.NixlMdRequest, p.NixlRead, p.NixlWrite, p.NixlLease, p.NixlRevoke)
# A NIXL grant keeps its request's span arrays until the Release: the grants outstanding on
# one connection may hold at most one largest frame's worth, what serving one request holds.
MAX_GRANTED_REQUEST_BYTES = p.MAX_PAYLOAD
GRANT_TTL = 30.0
RECLAIM_GRACE = 5.0
# Largest frame a server reads before the handshake (and authentication) completed: a HELLO
# or AUTH is under 100 bytes. Bigger frames are refused before anything is buffered.
HANDSHAKE_MAX_FRAME = 4096
REFUSE_TIMEOUT = 2.0  # seconds a refused connection gets to send its HELLO (see _Doorman)
MAX_REFUSING = 64  # refused connections waited on at once; more are closed without a word
ACCEPT_BACKOFF = (0.05, 1.0)  # seconds the accept loop pauses after a failure: first, most





# ---------------------------------------------------------------------------------- serving


_Listener = TypeVar("_Listener", bound="TcpListener[Any]")


class ConnBudget:
    """The connections one engine serves at once, over all its listeners (TCP and the local
    channel share one): at most ``max_conns`` in all and ``max_per_peer`` per peer key (an
    IP address; a uid on the local channel, which a fork does not multiply). Thread-safe;
    ``take`` and ``give`` are called by the listeners' accept loops and serving threads."""

    def __init__(self, max_conns: int = 256, max_per_peer: int = 32) -> None:
        if max_conns < 1 or max_per_peer < 1:
            raise InvalidArgument(
                f"connection caps must be >= 1, got {max_conns} and {max_per_peer}")
        self.max_conns = max_conns
        self.max_per_peer = max_per_peer
        self._lock = threading.Lock()
        self._total = 0
        self._per_peer: dict[str, int] = {}

    def take(self, key: str) -> str:
        """Count one more connection of ``key``: "" when taken, else why not (over which
        cap; nothing counted)."""
        with self._lock:
            if self._total >= self.max_conns:
                return f"{self._total} connections"
            held = self._per_peer.get(key, 0)
            if held >= self.max_per_peer:
                return f"{held} connections from {key}"
            self._total += 1
            self._per_peer[key] = held + 1
            return ""

    def give(self, key: str) -> None:
        """A connection ``take`` counted ended."""
        with self._lock:
            self._total -= 1
            n = self._per_peer.get(key, 0) - 1
            if n > 0:
                self._per_peer[key] = n
            else:
                self._per_peer.pop(key, None)


def open_channel(host: str, port: int, deadline: float,
                 tls: ssl.SSLContext | None = None) -> Channel:
    """A client's connection to ``host:port`` within the deadline, TLS when ``tls`` is given
    (the handshake runs here). Raises LinkFailed or Timeout."""
    chan = Channel.connect(host, port, deadline)
    if tls is not None:
        return TlsChannel.wrap_client(chan, tls, deadline)
    return chan


class TcpListener(Generic[LeaseT]):
    """Accepts peers and serves each connection on its own thread.

    ``start`` binds (port 0 picks a free port; ``port`` tells which) and returns at once.
    ``close`` stops accepting, closes every connection and joins the threads (bounded).

    At most ``max_conns`` connections are served at once, ``max_per_peer`` of them from one
    IP address; a connection over either cap is refused (see :class:`_Doorman`). ``budget``,
    when given, holds those caps instead, shared with the engine's other listeners. A failure
    to set a connection up (no thread can be started: a pids limit, memory) drops that
    connection, pauses accepting for a moment (ACCEPT_BACKOFF, doubling) and goes on: the
    accept loop itself never dies of it.
    """

    def __init__(self, host: str, port: int, handler: RequestHandler[LeaseT],
                 tls: ssl.SSLContext | None = None, *, sock: socket.socket | None = None,
                 max_conns: int = 256, max_per_peer: int = 32,
                 budget: ConnBudget | None = None) -> None:
        self.budget = budget if budget is not None else ConnBudget(max_conns, max_per_peer)
        self.handler = handler
        self.tls = tls
        self.max_conns = self.budget.max_conns
        self.max_per_peer = self.budget.max_per_peer
        if sock is None:  # TCP; a bound ``sock`` is the local channel's (transport/local.py)
            sock = socket.socket(family(host), socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError as e:
                sock.close()
                raise LinkFailed(f"cannot listen on {format_host_port(host, port)}: "
                                 f"{e.strerror or e}") from e
            self.host, self.port = sock.getsockname()[:2]
        else:
            self.host, self.port = host, port
        self._sock = sock
        self._sock.listen(128)
        self._sock.setblocking(False)  # accepted when select says so; a vanished one: skip
        self._closing = threading.Event()
        self._conns: set[Channel] = set()
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()
        self._doorman = _Doorman()
        self.refused = 0  # connections refused over a cap, for logs and tests
        self._thread = threading.Thread(
            target=self._accept_loop, name=f"datadist-listen-{self.port}", daemon=True
        )

    def __repr__(self) -> str:
        return f"<TcpListener {self.host}:{self.port} conns={len(self._conns)}>"

    def start(self: _Listener) -> _Listener:
        self._thread.start()
        return self

    def close(self, timeout: float = 5.0) -> None:
        if self._closing.is_set():
            return
        self._closing.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        with self._lock:
            conns = list(self._conns)
            threads = list(self._threads)
        for c in conns:
            # Shut down, do not close: the serving thread may be inside a send on this fd,
            # and closes it on its way out (a closed fd number can be reused at once).
            c.shutdown()
        deadline = time.monotonic() + timeout
        for t in [self._thread, *threads]:
            if t.is_alive() and t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))
        if not self._thread.is_alive():
            self._sock.close()  # else the accept loop closes it on its way out

    def _accept_loop(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._sock, selectors.EVENT_READ, None)
        backoff = 0.0
        try:
            while not self._closing.is_set():
                for key, _ in sel.select(self._doorman.wait_time(0.5)):
                    if key.data is not None:
                        self._doorman.step(sel, key.data)
                        continue
                    if self._closing.is_set():
                        return
                    if self._accept_one(sel):
                        backoff = 0.0
                        continue
                    # Setting the connection up failed (no thread, no memory): pause, so a
                    # flood does not spin us, then keep serving.
                    lo, hi = ACCEPT_BACKOFF
                    backoff = min(hi, max(lo, backoff * 2))
                    time.sleep(backoff)
                self._doorman.expire(sel)
        except Exception:  # noqa: BLE001 - the last line of defence of a serving process
            log.exception("the accept loop of %s:%d failed; no new peers are accepted",
                          self.host, self.port)
        finally:
            self._doorman.close_all(sel)
            sel.close()
            if self._closing.is_set():
                self._sock.close()

    def _accept_one(self, sel: selectors.BaseSelector) -> bool:
        """Accept one connection and start serving it (or refuse it over a cap). False when
        setting it up failed and the loop should back off."""
        try:
            sock, addr = self._sock.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return True  # gone before we got to it
        except OSError as e:  # EMFILE, ENFILE, ENOBUFS, ENOMEM: out of something
            if not self._closing.is_set():
                log.warning("accept on %s:%d failed: %s", self.host, self.port,
                            e.strerror or e)
            return False
        try:
            ip, address = self._peer_of(sock, addr)
        except OSError as e:  # the peer went away before we looked at it
            log.info("dropping a connection at accept: %s", e)
            sock.close()
            return True
        over = self.budget.take(ip)
        if over:
            self.refused += 1
            if self.refused & (self.refused - 1) == 0:  # 1st, 2nd, 4th, ...: no log flood
                log.warning("refusing %s: %s already (cap %d, %d per peer; %d refused so "
                            "far)", address, over, self.max_conns, self.max_per_peer,
                            self.refused)
            self._doorman.refuse(sel, sock, f"too many connections to this owner ({over})",
                                 tls=self.tls is not None)
            return True
        chan: Channel | None = None
        counted = True  # our slot in the budget, until _forget (or we) give it back
        try:
            chan = self._channel(sock, addr)
            t = threading.Thread(target=self._serve, args=(chan, ip),
                                 name=f"datadist-serve-{address}", daemon=True)
            with self._lock:
                if self._closing.is_set():
                    chan.close()
                    counted = False
                    self.budget.give(ip)
                    return True
                self._conns.add(chan)
                self._threads.add(t)
                counted = False  # _forget gives it back
            try:
                t.start()
            except BaseException:
                self._forget(chan, t, ip)
                raise
            return True
        except Exception as e:  # noqa: BLE001 - RuntimeError (no thread), MemoryError, OSError
            log.warning("cannot serve %s (%s: %s); dropped, accepting again shortly",
                        address, type(e).__name__, e)
            if chan is not None:
                chan.close()
            else:
                sock.close()
            if counted:
                self.budget.give(ip)
            return False

    def _peer_of(self, sock: socket.socket, addr: tuple[Any, ...]) -> tuple[str, str]:
        """(the key the per-peer cap counts by, a printable address) of an accepted socket."""
        return addr[0], format_host_port(addr[0], addr[1])

    def _channel(self, sock: socket.socket, addr: tuple[Any, ...]) -> Channel:
        """The Channel for an accepted socket (TLS-wrapped when configured)."""
        tune(sock)
        address = format_host_port(addr[0], addr[1])
        if self.tls is not None:
            return TlsChannel.wrap_server(sock, address, self.tls)
        return Channel(sock, address)

    def _forget(self, chan: Channel, thread: threading.Thread, ip: str) -> None:
        with self._lock:
            if chan not in self._conns:
                return
            self._conns.discard(chan)
            self._threads.discard(thread)
        self.budget.give(ip)

    def _serve(self, chan: Channel, ip: str) -> None:
        handed_over = False
        try:
            if self.tls is not None:
                assert isinstance(chan, TlsChannel)  # _channel wraps every socket with TLS on
                try:
                    chan.handshake(time.monotonic() + HANDSHAKE_TIMEOUT)
                except DatadistError as e:
                    log.info("TLS handshake from %s failed: %s", chan.address, e)
                    return
            conn = ServerConnection(chan, self.handler, self._closing)
            conn.run()
            handed_over = conn.handed_over
        finally:
            if not handed_over:  # a reverse channel belongs to the engine's link now
                chan.close()
            self._forget(chan, threading.current_thread(), ip)


class _Doorman:
    """Refuses connections over the listener's caps, on the accept loop's thread (no thread
    per refused connection): it reads the connection's first frame (at most
    HANDSHAKE_MAX_FRAME bytes, for at most REFUSE_TIMEOUT), answers it with ERROR
    LLM_LINK_FAILED carrying that frame's request id, and closes. The peer's ``link``
    fails with a message that says why; nothing new on the wire. With TLS (no handshake is
    spent on a refused connection) and past MAX_REFUSING, it closes without a word."""

    def __init__(self) -> None:
        self._pending: dict[socket.socket, tuple[float, bytearray, str]] = {}

    def wait_time(self, idle: float) -> float:
        if not self._pending:
            return idle
        first = min(d for d, _, _ in self._pending.values())
        return max(0.0, min(idle, first - time.monotonic()))

    def refuse(self, sel: selectors.BaseSelector, sock: socket.socket, why: str, *,
               tls: bool) -> None:
        if tls or len(self._pending) >= MAX_REFUSING:
            _close_now(sock)
            return
        sock.setblocking(False)
        self._pending[sock] = (time.monotonic() + REFUSE_TIMEOUT, bytearray(), why)
        sel.register(sock, selectors.EVENT_READ, sock)

    def step(self, sel: selectors.BaseSelector, sock: socket.socket) -> None:
        """The refused connection is readable: read on, answer once its frame is whole."""
        if sock not in self._pending:
            return
        _, buf, why = self._pending[sock]
        try:
            data = sock.recv(HANDSHAKE_MAX_FRAME + p.HEADER_SIZE - len(buf))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        buf += data
        done = not data
        if len(buf) >= p.HEADER_SIZE:
            try:
                head = p.decode_header(bytes(buf[: p.HEADER_SIZE]))
            except ProtocolError:
                done = True
            else:
                if head.length > HANDSHAKE_MAX_FRAME:
                    done = True
                elif len(buf) >= p.HEADER_SIZE + head.length:
                    frame = p.encode(p.Error(int(LinkFailed.code), why), head.request_id)
                    with contextlib.suppress(OSError):
                        sock.send(frame)
                    done = True
        if done:
            self._drop(sel, sock)

    def expire(self, sel: selectors.BaseSelector) -> None:
        now = time.monotonic()
        for sock in [s for s, (d, _, _) in self._pending.items() if d <= now]:
            self._drop(sel, sock)

    def close_all(self, sel: selectors.BaseSelector) -> None:
        for sock in list(self._pending):
            self._drop(sel, sock)

    def _drop(self, sel: selectors.BaseSelector, sock: socket.socket) -> None:
        self._pending.pop(sock, None)
        with contextlib.suppress(KeyError, ValueError):
            sel.unregister(sock)
        _close_now(sock)


def _close_now(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


class ServerConnection(Generic[LeaseT]):
    """The owner's side of one connection: handshake, then requests until the peer leaves.

    Two cases besides the plain one (docs/protocol.md, "Reverse channels"):

    * a Hello with FEATURE_REVERSE: after the handshake the connection is handed to the
      engine (``handler.adopt_reverse``) as a link on which *we* send requests; ``run``
      returns with ``handed_over`` set and the caller must not close the channel;
    * ``peer`` given: the handshake already happened the other way round (we opened this
      connection as a reverse channel); serve the peer's requests at once. A Bye then only
      ends the connection.
    """

    _lease_ids = itertools.count(1)

    def __init__(self, chan: Channel, handler: RequestHandler[LeaseT], closing: threading.Event,
                 peer: PeerInfo | None = None) -> None:
        self.chan = chan
        self.handler = handler
        self.closing = closing
        self.peer: PeerInfo | None = peer  # set once the handshake completed
        self.reverse = peer is not None  # serving over a connection we opened
        self.handed_over = False
        self.leases: dict[int, tuple[LeaseT, float]] = {}  # grants: lease, when granted
        self._granted: dict[int, int] = {}  # NIXL grants: lease id -> its request's bytes
        # A TCP read with CHECKSUM whose bytes are sent, awaiting the requester's verdict
        # (RELEASE with lease id 0 and the read's request id): (request id, lease).
        self.unsettled: tuple[int, LeaseT] | None = None

    def _wait_request(self) -> tuple[int, p.Message] | None:
        """The next frame: its first byte may take as long as the connection lives (an idle
        link), the rest must follow within FRAME_TIMEOUT (a peer that stops mid-frame is
        dropped, and its thread freed). Woken by close."""
        while not self.closing.is_set():
            if self.leases:
                self._expire_grants()
            if self.chan.wait_readable(1.0):
                return self.chan.recv(time.monotonic() + FRAME_TIMEOUT)
        return None

    def run(self) -> None:
        try:
            if not self.reverse:
                self._handshake()
                if self.handed_over:  # a reverse channel: the engine's now
                    return
            while True:
                got = self._wait_request()
                if got is None:
                    return
                rid, msg = got
                if self.unsettled is not None and self._settle(rid, msg):
                    continue
                if not self._dispatch(rid, msg):
                    return
        except (BrokenLink, Timeout):
            pass  # the peer went away or stalled: nothing to answer
        except RemoteProtocolError as e:
            log.warning("closing connection from %s: %s", self.chan.address, e)
            self._try_send(p.Error(e.code, str(e)))
        finally:
            for lease, _ in self.leases.values():
                self.handler.close_read(lease, False)
            self.leases.clear()
            if self.unsettled is not None:
                self.handler.settle_read(self.unsettled[1], False)
                self.unsettled = None
            if self.peer is not None and not self.reverse and not self.handed_over:
                self.handler.on_disconnect(self.peer)

    def _settle(self, rid: int, msg: p.Message) -> bool:
        """Settle the read awaiting its verdict with the frame that came after it: a RELEASE
        with lease id 0 and that read's request id is the verdict (True: consumed here);
        anything else means the requester did not confirm, and the read counts as failed
        (False: dispatch the frame as usual)."""
        assert self.unsettled is not None
        (want, lease), self.unsettled = self.unsettled, None
        verdict = isinstance(msg, p.Release) and msg.lease_id == 0 and rid == want
        self.handler.settle_read(lease, verdict and isinstance(msg, p.Release) and msg.ok)
        return verdict

    def _try_send(self, msg: p.Message, rid: int = 0) -> None:
        with contextlib.suppress(DatadistError):
            self.chan.send(msg, time.monotonic() + 1.0, rid)

    def _handshake(self) -> None:
        """HELLO, WELCOME and, with a secret, AUTH / OK. Frames are capped at
        HANDSHAKE_MAX_FRAME until it completed; only then is the peer registered
        (``on_peer_ready``). A reverse channel is handed to the engine *before* the
        handshake's last frame goes out, so that the link is registered here by the time the
        client's ``link_clusters`` returns."""
        rid, hello = self.chan.recv(time.monotonic() + HANDSHAKE_TIMEOUT, HANDSHAKE_MAX_FRAME)
        if not isinstance(hello, p.Hello):
            raise RemoteProtocolError(f"expected Hello, got {type(hello).__name__}")
        try:
            welcome = self.handler.on_hello(hello, self.chan.address)
        except DatadistError as e:
            self._try_send(p.Error(int(e.code), str(e)), rid)
            raise BrokenLink("peer refused") from e
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT
        last: p.Message = welcome
        if welcome.features & p.FEATURE_AUTH:
            self.chan.send(welcome, deadline, rid)
            # Nothing but the client's proof is accepted until it checks out.
            rid, msg = self.chan.recv(deadline, HANDSHAKE_MAX_FRAME)
            try:
                if not isinstance(msg, p.Auth):
                    raise LinkFailed("this server requires a shared secret; authenticate first")
                self.handler.check_auth(hello, welcome, msg.proof)
            except DatadistError as e:
                self._try_send(p.Error(int(LinkFailed.code), str(e)), rid)
                raise BrokenLink("peer failed to authenticate") from e
            last = p.Ok()
        # The link token: the one we issued this control channel, or the one a reverse
        # channel's Hello echoed (checked by adopt_reverse).
        token = (p.split_token(hello.proof, hello.features)[1]
                 if hello.features & p.FEATURE_REVERSE
                 else p.split_token(welcome.proof, welcome.features)[1])
        self.peer = PeerInfo(
            hello.cluster_id, hello.role, hello.pid, hello.pid_ns, hello.boot_id,
            self.chan.address, local=self.chan.local_cred, token=token,
        )
        self._send_last(hello, last, deadline, rid)

    def _send_last(self, hello: p.Hello, msg: p.Message, deadline: float, rid: int) -> None:
        """The handshake's last frame; the peer counts as linked to us from just before it.
        For a reverse channel the engine registers the link first, locked until this frame is out (a
        transfer must not share the socket with it), so the link exists by the time the
        client's ``link_clusters`` returns. A reverse channel the engine does not take
        (a token that is not a live control channel's of that cluster, finalizing, at its
        cap) is answered with that error instead, which the client reports as its link's
        outcome."""
        assert self.peer is not None
        if not hello.features & p.FEATURE_REVERSE:
            # Registered before its last frame goes out: the client may open its reverse
            # channel (echoing this channel's link token) the moment it has that frame. A
            # send that fails ends the connection, and on_disconnect forgets the peer.
            self.handler.on_peer_ready(self.peer)
            self.chan.send(msg, deadline, rid)
            return
        try:
            release = self.handler.adopt_reverse(self.peer, self.chan)
        except DatadistError as e:
            log.info("reverse channel from %s refused: %s", self.chan.address, e)
            self._try_send(p.Error(int(e.code), str(e)), rid)
            raise BrokenLink("reverse channel refused") from e
        self.handed_over = True
        try:
            self.chan.send(msg, deadline, rid)
        finally:
            release()

    def _dispatch(self, rid: int, msg: p.Message) -> bool:
        """Handle one request; False ends the connection."""
        assert self.peer is not None
        deadline = time.monotonic() + SERVE_SEND_TIMEOUT
        if isinstance(msg, p.Read):
            try:
                lease = self.handler.open_read(self.peer, msg)
            except DatadistError as e:
                self.chan.send(p.Error(int(e.code), str(e)), deadline, rid)
                return True
            if msg.flags & p.ReadFlags.GRANT:
                if len(self.leases) >= MAX_GRANTS_PER_CONNECTION:
                    self.handler.close_read(lease, False)
                    self.chan.send(p.Error(int(Busy.code), (
                        f"{len(self.leases)} grants are still not released on this "
                        "connection")), deadline, rid)
                    return True
                lease_id = next(self._lease_ids)
                self.leases[lease_id] = (lease, time.monotonic())
                shm = getattr(lease, "shm", None)
                if shm is not None:
                    self.chan.send(p.ShmGrant(lease_id, *shm), deadline, rid)
                else:
                    self.chan.send(p.Grant(lease_id, lease.bases), deadline, rid)
                if msg.flags & p.ReadFlags.CHECKSUM:
                    self._send_checksum(lease.iovecs(), deadline, rid)
                return True
            ok = False
            verified = bool(msg.flags & p.ReadFlags.CHECKSUM)
            try:
                iov = lease.iovecs()
                # the answer frame and the bytes in one writev: one segment for a small read
                self.chan.send_iov(iov, deadline, head=p.ReadData(lease.nbytes), request_id=rid)
                if verified:
                    self._send_checksum(iov, deadline, rid)
                ok = True
            finally:
                if ok and verified:
                    # The requester checks the CRC and says so (RELEASE, lease id 0): only
                    # then may the read consume its key. The memory is free meanwhile.
                    self.handler.sent_read(lease)
                    self.unsettled = (rid, lease)
                else:
                    self.handler.close_read(lease, ok)
            return True
        if isinstance(msg, _NIXL_REQUESTS) and self._nixl_misplaced(rid, msg, deadline):
            return True
        if isinstance(msg, (p.NixlRead, p.NixlWrite)):
            return self._nixl_grant(rid, msg, deadline)
        if isinstance(msg, (p.NixlLease, p.NixlRevoke)):
            return self._nixl_lease(rid, msg)
        if isinstance(msg, p.NixlMdRequest):
            md: p.NixlMd | p.Error
            try:
                md = self.handler.nixl_metadata()
            except DatadistError as e:
                md = p.Error(int(e.code), str(e))
            self.chan.send(md, deadline, rid)
            return True
        if isinstance(msg, p.Release):
            held = self.leases.pop(msg.lease_id, None)
            if held is not None:
                self.handler.close_read(held[0], msg.ok)
            return True
        if isinstance(msg, p.Write):
            return self._write(rid, msg, deadline)
        if isinstance(msg, p.Ping):
            self.chan.send(p.Pong(msg.nonce), deadline, rid)
            return True
        if isinstance(msg, p.LeaseRequest):
            lease_msg: p.CacheLease | p.Error
            try:
                lease_msg = self.handler.lease_cache(self.peer, msg)
            except DatadistError as e:
                lease_msg = p.Error(int(e.code), str(e))
            self.chan.send(lease_msg, deadline, rid)
            return True
        if isinstance(msg, p.StatsRequest):
            body = json.dumps(self.handler.stats(self.peer), separators=(",", ":")).encode()
            self.chan.send(p.Stats(body), deadline, rid)
            return True
        if isinstance(msg, p.Bye):
            if not self.reverse:
                self.handler.on_bye(self.peer)
            self._try_send(p.Ok(), rid)
            return False
        raise RemoteProtocolError(f"unexpected {type(msg).__name__} from a client")

    def _expire_grants(self) -> None:
        """Release grants their reader kept past GRANT_TTL, or past RECLAIM_GRACE when the
        memory is wanted back (as failed reads: no key is consumed), so that a peer cannot
        pin caches, and the pool, for as long as it likes."""
        now = time.monotonic()
        for lease_id, (lease, since) in list(self.leases.items()):
            age = now - since
            if age >= GRANT_TTL or (age >= RECLAIM_GRACE and lease.wanted_back()):
                del self.leases[lease_id]
                log.warning("grant %d to %s not released after %.1f s: released", lease_id,
                            self.chan.address, age)
                self.handler.close_read(lease, False)

    def _nixl_misplaced(self, rid: int, msg: p.Message, deadline: float) -> bool:
        """A NIXL request on the wrong kind of connection is refused (NotSupported), the
        connection kept: on a reverse channel (we linked; the peer is the owner we read from)
        only NixlRevoke is the owner's to send, and never anything that would hand the owner
        our NIXL agent, grants or leases; on any other connection NixlRevoke is not the
        client's to send. True: refused."""
        if self.reverse == isinstance(msg, p.NixlRevoke):
            return False
        where = "a reverse channel" if self.reverse else "a client's connection"
        self.chan.send(p.Error(int(NotSupported.code),
                               f"{type(msg).__name__} is not served on {where}"), deadline, rid)
        return True

    def _nixl_grant(self, rid: int, msg: p.NixlRead | p.NixlWrite, deadline: float) -> bool:
        """NIXL data path: grant the checked spans (the client READs or WRITEs them through
        NIXL) and hold the lease until its Release (or the connection ends)."""
        assert self.peer is not None  # set by the handshake, before any request
        size = msg.tensors.nbytes + msg.offsets.nbytes + msg.lengths.nbytes
        self._granted = {i: n for i, n in self._granted.items() if i in self.leases}
        if (len(self.leases) >= MAX_GRANTS_PER_CONNECTION
                or sum(self._granted.values()) + size > MAX_GRANTED_REQUEST_BYTES):
            self.chan.send(p.Error(int(Busy.code), (
                f"{len(self.leases)} grants ({sum(self._granted.values())} bytes of requests) "
                "are still not released on this connection")), deadline, rid)
            return True
        lease_id = next(self._lease_ids)
        try:
            lease, grant = self.handler.open_nixl(self.peer, msg, lease_id)
        except DatadistError as e:
            self.chan.send(p.Error(int(e.code), str(e)), deadline, rid)
            return True
        self.leases[lease_id] = (lease, time.monotonic())  # expires as grants do
        self._granted[lease_id] = size
        self.chan.send(grant, deadline, rid)
        if msg.flags & p.ReadFlags.CHECKSUM:
            self._send_checksum(lease.iovecs(), deadline, rid)
        return True

    def _nixl_lease(self, rid: int, msg: p.NixlLease | p.NixlRevoke) -> bool:
        """A reader asks for a NIXL lease on a whole cache (owner side), or, on a reverse
        channel, the owner revokes one of ours (reader side: answered once no read under it
        is in flight, which may take a while: the deadline starts after)."""
        assert self.peer is not None
        answer: p.Message
        try:
            if isinstance(msg, p.NixlLease):
                answer = self.handler.open_nixl_lease(self.peer, msg, self.chan.shutdown)
            else:
                self.handler.nixl_revoke(self.peer, msg)
                answer = p.Ok()
        except DatadistError as e:
            answer = p.Error(int(e.code), str(e))
        self.chan.send(answer, time.monotonic() + SERVE_SEND_TIMEOUT, rid)
        return True

    def _send_checksum(self, iov: np.ndarray, deadline: float, rid: int) -> None:
        """The CRC of the source spans, computed after they were sent (TCP) or while the
        reader holds the lease (grants): a change under the reader's feet shows up."""
        self.chan.send(p.Checksum(crc_iov(iov), iov_nbytes(iov)), deadline, rid)

    def _write(self, rid: int, msg: p.Write, deadline: float) -> bool:
        """Push, in two steps: the owner checks the destination spans and answers Ok (send)
        or Error (nothing is sent, the connection stays usable); then the raw bytes land
        straight in the destination and a final Ok confirms them."""
        assert self.peer is not None  # set by the handshake, before any request
        try:
            lease = self.handler.open_write(self.peer, msg)
        except DatadistError as e:
            self.chan.send(p.Error(int(e.code), str(e)), deadline, rid)
            return True
        ok = False
        try:
            self.chan.send(p.Ok(), deadline, rid)
            self.chan.recv_iov(lease.iovecs(), deadline)
            ok = True
        finally:
            self.handler.close_write(lease, ok)
        self.chan.send(p.Ok(), deadline, rid)
        return True
