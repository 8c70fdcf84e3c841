"""The engine: one per process, owning the registry, the pools, the listener and the links.

Who calls: the api facade (``LLMDataDist``, ``CacheManager``), with typed arguments; the
transports call back into it as the owner side of the protocol (:class:`RequestHandler`).

Blocking: ``link``/``unlink``/``pull``/``push`` block up to their deadline; everything else
returns at once (``unregister`` waits for live leases, bounded). Thread-safe.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from datadist.core import auth
from datadist.core.errors import (
    AlreadyLinked,
    Busy,
    Closed,
    DatadistError,
    DeviceOutOfMemory,
    InvalidArgument,
    LinkFailed,
    NotLinked,
    OutOfMemory,
    RemoteProtocolError,
)
from datadist.core.layout import Geometry, Plan, check_source_spans, wire_layout
from datadist.core.links import HostIdentity, Link, choose_path, forced_path, greet
from datadist.core.registry import CacheEntry, KeyId, Lease, Registry
from datadist.memory import shared
from datadist.memory.pool import HostPool, PoolConfig
from datadist.transport.base import PathKind, PeerInfo
from datadist.transport.iov import allow_same_host_readers, make_iov
from datadist.transport.paths import TcpPath
from datadist.transport.tcp import Channel, ServerConnection, TcpListener
from datadist.transport.tls import TlsConfig
from datadist.wire import protocol as p

log = logging.getLogger(__name__)

HOST, DEVICE = 0, 1
CLOSE_LEASE_WAIT = 5.0  # seconds finalize waits for transfers still using local memory
_TCP = TcpPath()


@dataclass(frozen=True)
class EngineConfig:
    cluster_id: int
    role: int
    listen: tuple[str, int] | None = None
    sync_timeout: float = 1.0  # seconds, bounds every pull and push
    device_pool: PoolConfig | None = None
    host_pool: PoolConfig | None = None
    transport: str | None = None
    secret: bytes | None = None  # shared secret peers must prove at link time
    verify: bool = False  # end-to-end CRC-32 of every pull
    tls: TlsConfig | None = None  # mutual TLS on every connection


def _check_local_plan(plan: Plan, entry: CacheEntry) -> None:
    """The local side of a plan must fit the cache as it was registered (the caller's
    CacheDesc may have changed since): never read or write past registered memory."""
    g = entry.geometry
    if len(plan.local_tensors) and int(plan.local_tensors.max()) >= g.num_tensors:
        raise InvalidArgument(f"cache {entry.cache_id} has {g.num_tensors} tensors")
    check_source_spans(plan.local_offsets, plan.lengths, g.tensor_bytes)


class Engine:
    """Typed core of datadist. Created by ``LLMDataDist.init``, closed by ``finalize``."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.role = config.role
        self.identity = HostIdentity.current()
        self.forced = forced_path(config.transport)
        self.registry = Registry()
        self._pools: dict[int, HostPool] = {}
        self._links: dict[int, Link] = {}
        self._reverse: dict[int, Link] = {}  # listener's ends of peers' links (inbound)
        self._inbound: dict[tuple[int, str], PeerInfo] = {}
        self._hellos: dict[int, int] = {}  # handshakes so far, by peer cluster id
        self._linking: set[int] = set()  # clusters link() is connecting to right now
        self._lock = threading.Lock()
        self._closed = False
        self._stop = threading.Event()  # set at close: ends the reverse channels we serve
        self._readers_allowed = False
        self.listener: TcpListener | None = None
        self._tls_client = config.tls.client_context() if config.tls else None
        try:
            for placement, cfg in ((DEVICE, config.device_pool), (HOST, config.host_pool)):
                if cfg is not None:
                    name = "datadist-device-pool" if placement == DEVICE else "datadist-host-pool"
                    pool = HostPool(cfg.memory_size, cfg.page_shift, name)
                    self._pools[placement] = pool
                    shared.register_arena(pool.base, pool.size, pool.fd)
            if config.listen is not None:
                self.start_listening(*config.listen)
        except BaseException:
            self.close()
            raise

    def __repr__(self) -> str:
        return (
            f"<Engine cluster={self.config.cluster_id} role={self.role} "
            f"listen={self.listen_address} links={len(self._links)} "
            f"inbound={len(self._inbound)} caches={len(self.registry.entries())}>"
        )

    # ------------------------------------------------------------------ lifecycle

    @property
    def listen_address(self) -> tuple[str, int] | None:
        if self.listener is None:
            return None
        return (self.listener.host, self.listener.port)

    def start_listening(self, host: str, port: int) -> None:
        if self.listener is not None:
            self.listener.close()
        self.listener = self.make_listener(host, port)
        log.debug("same-host readers: %s", allow_same_host_readers())

    def make_listener(self, host: str, port: int) -> TcpListener:
        """A started listener serving this engine, with TLS when configured. Every listener
        of the engine (its own, two-sided link ones) comes from here."""
        server_tls = self.config.tls.server_context() if self.config.tls else None
        return TcpListener(host, port, self, server_tls).start()

    def stop_listening(self) -> None:
        if self.listener is not None:
            self.listener.close()
            self.listener = None

    def close(self) -> None:
        """Tear everything down. Idempotent; does not raise."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            links = [*self._links.values(), *self._reverse.values()]
            self._links.clear()
            self._reverse.clear()
        self._stop.set()
        for link in links:
            link.close()
        if self.listener is not None:
            self.listener.close()
        entries = self.registry.clear()
        leased = self.registry.wait_unleased(entries, CLOSE_LEASE_WAIT)
        for pool in self._pools.values():
            shared.ARENAS.remove(pool.base)
            if leased:
                # A transfer still holds pool memory: leak the mapping rather than unmap it
                # under a copy (which would crash the process).
                log.warning("finalize: %d caches still in transfer; pool memory left mapped",
                            leased)
                continue
            pool.close()
        self._pools.clear()

    def _check_open(self) -> None:
        if self._closed:
            raise Closed("the engine is finalized")

    # ------------------------------------------------------------------ caches

    def register(
        self,
        geometry: Geometry,
        addrs: list[int],
        *,
        placement: int,
        keys: list[KeyId | None] = (),  # type: ignore[assignment]
        blocks_model_id: int | None = None,
        remote_accessible: bool = True,
    ) -> CacheEntry:
        self._check_open()
        if any(a <= 0 for a in addrs):
            raise InvalidArgument("tensor addresses must be non-zero")
        arr = np.asarray(addrs, dtype=np.uint64)
        return self.registry.add(
            geometry, arr, owned=False, placement=placement, keys=keys,
            blocks_model_id=blocks_model_id, remote_accessible=remote_accessible,
            shm=shared.lookup(arr, geometry.tensor_bytes),
        )

    def allocate(
        self,
        geometry: Geometry,
        *,
        placement: int,
        keys: list[KeyId | None] = (),  # type: ignore[assignment]
        blocks_model_id: int | None = None,
    ) -> CacheEntry:
        """Carve a cache from the pool of its placement. One allocation, tensors
        page-aligned inside it."""
        self._check_open()
        pool = self._pools.get(placement)
        if pool is None:
            what = "mem_pool_cfg" if placement == DEVICE else "host_mem_pool_cfg"
            raise InvalidArgument(
                f"no memory pool for {'DEVICE' if placement == DEVICE else 'HOST'} "
                f"placement: set {what}"
            )
        self.registry.check_keys(list(keys), geometry.units)
        step = -(-geometry.tensor_bytes // pool.page) * pool.page
        try:
            base = pool.allocate(step * geometry.num_tensors)
        except OutOfMemory as e:
            if placement == DEVICE:
                raise DeviceOutOfMemory(str(e)) from None
            raise
        addrs = base + step * np.arange(geometry.num_tensors, dtype=np.uint64)
        try:
            return self.registry.add(
                geometry, addrs, owned=True, placement=placement, keys=keys,
                blocks_model_id=blocks_model_id, free=lambda: pool.free(base),
                shm=shared.lookup(addrs, geometry.tensor_bytes),
            )
        except BaseException:
            pool.free(base)
            raise

    def deallocate(self, cache_id: int, *, blocks: bool = False) -> None:
        self.registry.deallocate(cache_id, drop_keys=blocks)

    def unregister(self, cache_id: int) -> None:
        self.registry.unregister(cache_id)

    def remove_key(self, key: KeyId) -> None:
        self.registry.remove_key(key)

    # ------------------------------------------------------------------ links

    def _hello(self, reverse: bool = False) -> p.Hello:
        """A fresh Hello: with a secret, a fresh nonce for the challenge; ``reverse`` for the
        reverse channel of a link."""
        ident = self.identity
        secret = self.config.secret
        features = (p.FEATURE_AUTH if secret else 0) | (p.FEATURE_REVERSE if reverse else 0)
        return p.Hello(
            self.config.cluster_id, self.role, ident.pid, ident.pid_ns, ident.boot_id,
            features, auth.nonce() if secret else b"",
        )

    def link(self, cluster_id: int, host: str, port: int, timeout: float) -> Link:
        """Connect to a peer's listener and check it is who we asked for. Blocks <= timeout.

        One link to a cluster at a time: a second call while the first is still connecting
        is AlreadyLinked at once (its reverse channel would replace the first's at the
        peer)."""
        self._check_open()
        with self._lock:
            if cluster_id in self._links or cluster_id in self._linking:
                raise AlreadyLinked(f"cluster {cluster_id} is already linked")
            self._linking.add(cluster_id)
        try:
            link = self.open_link(cluster_id, host, port, timeout)
            try:
                self.adopt_link(link)
            except AlreadyLinked:
                link.close()
                raise
        finally:
            with self._lock:
                self._linking.discard(cluster_id)
        return link

    def unlink(self, cluster_id: int, timeout: float, force: bool = False) -> None:
        """Drop our end of the link to ``cluster_id``: the one we made (``link``) and the
        one the peer made to us (its reverse channel), whichever exist.

        Without ``force``: wait (up to ``timeout``) for a transfer in flight to finish, tell
        the peer, then close; a link still busy after the timeout raises Busy
        (LLM_LINK_BUSY) and stays up. With ``force``: close our end at once; a transfer in
        flight fails with LLM_LINK_FAILED. NotLinked when neither end exists.
        """
        with self._lock:
            link = self._links.get(cluster_id)
            inbound = self._reverse.get(cluster_id)
        if link is None and inbound is None:
            raise NotLinked(f"cluster {cluster_id} is not linked")
        for one in (link, inbound):
            if one is not None:
                self._drop(one, timeout, force)

    def _drop(self, link: Link, timeout: float, force: bool) -> None:
        cluster_id = link.cluster_id
        if not force:
            deadline = time.monotonic() + timeout
            if not link.lock.acquire(timeout=timeout):
                raise Busy(f"link to cluster {cluster_id} is busy with a transfer")
            try:
                if not link.chan.closed:
                    try:
                        link.chan.call(p.Bye(), deadline)
                    except DatadistError as e:
                        log.info("unlink of cluster %d: peer not told (%s)", cluster_id, e)
            finally:
                link.lock.release()
        with self._lock:
            table = self._reverse if link.inbound else self._links
            if table.get(cluster_id) is link:
                del table[cluster_id]
        link.close()

    def get_link(self, cluster_id: int) -> Link:
        """The link transfers to ``cluster_id`` use: the one we made, else the one the peer
        made to us (its reverse channel). NotLinked if neither."""
        with self._lock:
            link = self._links.get(cluster_id) or self._reverse.get(cluster_id)
        if link is None:
            raise NotLinked(f"cluster {cluster_id} is not linked")
        return link

    def check_link(self, cluster_id: int, timeout: float) -> None:
        """Round-trip a Ping on the link; raises NotLinked, Timeout or BrokenLink."""
        link = self.get_link(cluster_id)
        deadline = time.monotonic() + timeout
        reply = link.run(deadline,
                         lambda path, chan: chan.call(p.Ping(cluster_id), deadline))
        if not isinstance(reply, p.Pong):
            raise RemoteProtocolError(f"expected Pong, got {type(reply).__name__}")

    def links(self) -> list[Link]:
        with self._lock:
            return list(self._links.values())

    def has_links(self) -> bool:
        """Any link alive, either end. Reverse channels the linker has closed are dropped
        here (nothing else notices them: the listener never reads an idle one)."""
        with self._lock:
            for cid, link in list(self._reverse.items()):
                if link.chan.closed or (not link.lock.locked() and link.chan.peer_gone()):
                    del self._reverse[cid]
                    link.close()
            return bool(self._links or self._inbound or self._reverse)

    # ------------------------------------------------------------------ transfers

    def pull(
        self,
        cluster_id: int,
        key: p.KeyRef,
        unit_bytes: int,
        plan: Plan,
        dst_cache_id: int,
        timeout: float | None = None,
    ) -> None:
        """Read ``plan`` from the remote cache ``key`` names into local cache ``dst_cache_id``.

        Blocks until every byte has landed or the deadline (``sync_timeout``) passes.
        """
        self._check_open()
        deadline = time.monotonic() + (timeout if timeout is not None else self.config.sync_timeout)
        entry = self.registry.hold(dst_cache_id)
        try:
            _check_local_plan(plan, entry)
            link = self.get_link(cluster_id)
            local = make_iov(*plan.local_iov(entry.addrs))
            flags = p.ReadFlags.CHECKSUM if self.config.verify else p.ReadFlags.NONE
            msg = p.Read(key, unit_bytes, flags, plan.remote_tensors, plan.remote_offsets,
                         plan.lengths, wire_layout(entry.geometry))
            link.run(deadline,
                     lambda path, chan: path.read(chan, msg, local, deadline))
        finally:
            self.registry.unhold(entry)

    def push(
        self,
        cluster_id: int,
        key: p.KeyRef,
        unit_bytes: int,
        plan: Plan,
        src_cache_id: int,
        timeout: float | None = None,
    ) -> None:
        """Write local cache ``src_cache_id`` per ``plan`` into the remote cache ``key`` names."""
        self._check_open()
        deadline = time.monotonic() + (timeout if timeout is not None else self.config.sync_timeout)
        entry = self.registry.hold(src_cache_id)
        try:
            _check_local_plan(plan, entry)
            link = self.get_link(cluster_id)
            local = make_iov(*plan.local_iov(entry.addrs))
            msg = p.Write(key, unit_bytes, 0, plan.remote_tensors, plan.remote_offsets,
                          plan.lengths, wire_layout(entry.geometry))
            # Pushes go over the control channel: the owner must check the spans before
            # anything lands, which is what the two-step Write does.
            link.run(deadline,
                     lambda path, chan: _TCP.write(chan, msg, local, deadline))
        finally:
            self.registry.unhold(entry)

    # ------------------------------------------------------------------ owner side

    def on_hello(self, hello: p.Hello, address: str) -> p.Welcome:
        if self._closed:
            raise Closed("finalized")
        ident = self.identity
        if (hello.cluster_id == self.config.cluster_id and hello.pid == ident.pid
                and ident.same_host(hello.boot_id, hello.pid_ns)):
            # Ourselves. Another process with our cluster id is a peer like any other: the
            # V0 vllm-ascend connector gives both sides cluster id = local rank.
            raise LinkFailed("a link from this engine to itself")
        peer = PeerInfo(hello.cluster_id, hello.role, hello.pid, hello.pid_ns, hello.boot_id,
                        address)
        if not hello.features & p.FEATURE_REVERSE:
            with self._lock:
                self._inbound[peer.key] = peer
                self._hellos[peer.cluster_id] = self._hellos.get(peer.cluster_id, 0) + 1
        secret = self.config.secret
        if secret is None:
            return p.Welcome(self.config.cluster_id, self.role, ident.pid, ident.pid_ns,
                             ident.boot_id, p.FEATURE_REVERSE)
        proof = auth.server_proof(secret, hello.proof, auth.nonce(), self.config.cluster_id,
                                  hello.cluster_id)
        return p.Welcome(self.config.cluster_id, self.role, ident.pid, ident.pid_ns,
                         ident.boot_id, p.FEATURE_AUTH | p.FEATURE_REVERSE, proof)

    def check_auth(self, hello: p.Hello, welcome: p.Welcome, proof: bytes) -> None:
        secret = self.config.secret
        parts = auth.split_server_proof(welcome.proof)
        if secret is None or parts is None:
            raise LinkFailed("no challenge was issued")
        want = auth.client_proof(secret, hello.proof, parts[0], self.config.cluster_id,
                                 hello.cluster_id)
        if not auth.same(want, proof):
            raise LinkFailed(f"cluster {hello.cluster_id} failed to prove the shared secret")

    def open_read(self, peer: PeerInfo, msg: p.Read) -> Lease:
        same_host = self.identity.same_host(peer.boot_id, peer.pid_ns)
        return self.registry.open(msg.key, msg.unit_bytes, msg.tensors, msg.offsets,
                                  msg.lengths, layout=msg.layout,
                                  shm=same_host and bool(msg.flags & p.ReadFlags.SHM))

    def close_read(self, lease: Lease, ok: bool) -> None:
        self.registry.close(lease, ok)

    def open_write(self, peer: PeerInfo, msg: p.Write) -> Lease:
        return self.registry.open(msg.key, msg.unit_bytes, msg.tensors, msg.offsets, msg.lengths,
                                  layout=msg.layout)

    def close_write(self, lease: Lease, ok: bool) -> None:
        self.registry.close(lease, ok, consume=False)

    def on_bye(self, peer: PeerInfo) -> None:
        """The linker unlinked politely: its reverse channel goes with its control channel."""
        with self._lock:
            self._inbound.pop(peer.key, None)
            inbound = self._reverse.get(peer.cluster_id)
            if inbound is not None and inbound.welcome.pid == peer.pid \
                    and inbound.welcome.boot_id == peer.boot_id:
                del self._reverse[peer.cluster_id]
            else:
                inbound = None
        if inbound is not None:
            inbound.close()

    def adopt_reverse(self, peer: PeerInfo, chan: object) -> Callable[[], None]:
        """A linker's reverse channel arrived (the listener's end of its link): register it
        as the link to ``peer.cluster_id`` for transfers from this side. A newer one from
        the same cluster replaces the old. Returns the release of the link's lock, held
        until the serving thread has sent the handshake's last frame."""
        assert isinstance(chan, Channel)
        welcome = p.Welcome(peer.cluster_id, peer.role, peer.pid, peer.pid_ns, peer.boot_id)

        def cannot_reconnect(deadline: float) -> tuple[Channel, p.Welcome]:
            raise LinkFailed(f"cluster {peer.cluster_id} closed its link to us; it is "
                             "re-opened only when that cluster links again")

        path, reason = choose_path(self.forced, self.identity, welcome)
        link = Link(peer.cluster_id, *_split_address(peer.address), chan, welcome, path,
                    f"inbound, {reason}", cannot_reconnect, inbound=True)
        with self._lock:
            if self._closed:
                return chan.close  # finalized meanwhile: the connection just ends
            link.lock.acquire()
            old = self._reverse.get(peer.cluster_id)
            self._reverse[peer.cluster_id] = link
        if old is not None:
            old.close()
        log.debug("link.inbound %r", link)
        return link.lock.release

    def on_disconnect(self, peer: PeerInfo) -> None:
        with self._lock:
            self._inbound.pop(peer.key, None)

    def inbound_peers(self) -> list[PeerInfo]:
        with self._lock:
            return list(self._inbound.values())

    def hello_count(self, cluster_id: int) -> int:
        """How many connections ``cluster_id`` has opened to us so far (reverse channels
        not counted): two-sided links see a member join by it."""
        with self._lock:
            return self._hellos.get(cluster_id, 0)

    # ------------------------------------------------------------------ two-sided links
    # core/comm.py connects to every member first and makes the links usable only once all
    # members are up, so that transfers before then get NOT_YET_LINK.

    def open_link(self, cluster_id: int, host: str, port: int, timeout: float,
                  reverse: bool = True) -> Link:
        """Connect and check the peer exactly as :meth:`link`, but do not register the link
        (transfers cannot use it yet): :meth:`adopt_link` does. With ``reverse`` (and a peer
        that takes them) also open the reverse channel and serve the peer's requests on it,
        so that the peer can use the link too. Blocks <= timeout."""
        self._check_open()

        def connect(deadline: float) -> tuple[Channel, p.Welcome]:
            return greet(host, port, cluster_id, self._hello, self.config.secret, deadline,
                         self._tls_client)

        deadline = time.monotonic() + timeout
        chan, welcome = connect(deadline)
        path, reason = choose_path(self.forced, self.identity, welcome)
        link = Link(cluster_id, host, port, chan, welcome, path, reason, connect)
        if reverse and welcome.features & p.FEATURE_REVERSE:
            try:
                self._open_reverse(link, deadline)
            except DatadistError:
                link.close()
                raise
        return link

    def _open_reverse(self, link: Link, deadline: float) -> None:
        """Open ``link``'s reverse channel and serve the peer's requests on it (a thread of
        ours, ended by unlink or close)."""
        if not self._readers_allowed:
            allow_same_host_readers()  # the peer may read our memory with cross-memory attach
            self._readers_allowed = True
        chan, welcome = greet(link.host, link.port, link.cluster_id,
                              lambda: self._hello(reverse=True), self.config.secret, deadline,
                              self._tls_client)
        peer = PeerInfo(welcome.cluster_id, welcome.role, welcome.pid, welcome.pid_ns,
                        welcome.boot_id, chan.address)
        link.served = chan
        threading.Thread(target=self._serve_reverse, args=(chan, peer),
                         name=f"datadist-reverse-{link.cluster_id}", daemon=True).start()

    def _serve_reverse(self, chan: Channel, peer: PeerInfo) -> None:
        try:
            ServerConnection(chan, self, self._stop, peer=peer).run()
        finally:
            chan.close()

    def adopt_link(self, link: Link) -> None:
        """Register a link from :meth:`open_link`. AlreadyLinked (link left open) if that
        cluster is linked already; Closed (link closed) after close."""
        with self._lock:
            if self._closed:
                link.close()
                raise Closed("the engine is finalized")
            if link.cluster_id in self._links:
                raise AlreadyLinked(f"cluster {link.cluster_id} is already linked")
            self._links[link.cluster_id] = link
        log.debug("link.complete %r", link)


def _split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port) if port.isdigit() else 0


__all__ = ["DEVICE", "HOST", "Engine", "EngineConfig", "PathKind"]
