"""The engine: one per process, owning the registry, the pools, the listener and the links.

Who calls: the api facade (``LLMDataDist``, ``CacheManager``), with typed arguments; the
transports call back into it as the owner side of the protocol (:class:`RequestHandler`).

Blocking: ``link``/``unlink``/``pull``/``push`` block up to their deadline; everything else
returns at once (``unregister`` waits for live leases, bounded). Thread-safe.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from datadist.core import auth, metrics
from datadist.core.errors import (
    AlreadyLinked,
    BrokenLink,
    Busy,
    Closed,
    Code,
    DatadistError,
    DeviceOutOfMemory,
    InvalidArgument,
    LinkFailed,
    NotLinked,
    NotSupported,
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
from datadist.transport.tcp import Channel, TcpListener
from datadist.transport.tls import TlsConfig
from datadist.wire import protocol as p

log = logging.getLogger(__name__)

HOST, DEVICE = 0, 1
CLOSE_LEASE_WAIT = 5.0  # seconds finalize waits for transfers still using local memory
_TCP = TcpPath()
_F = TypeVar("_F", bound=Callable[..., None])


def _counted(op: str) -> Callable[[_F], _F]:
    """Record a transfer method's outcome in :data:`metrics.PROCESS`: its duration, its bytes
    when it succeeded, its status code's name when it failed."""

    def wrap(fn: _F) -> _F:
        @functools.wraps(fn)
        def counted(self: Any, cluster_id: int, key: Any, unit_bytes: int, plan: Plan,
                    *args: Any, **kwargs: Any) -> None:
            t0 = time.perf_counter()
            try:
                fn(self, cluster_id, key, unit_bytes, plan, *args, **kwargs)
            except DatadistError as e:
                metrics.PROCESS.record(op, cluster_id, 0, time.perf_counter() - t0,
                                       Code(e.code).status_name)
                raise
            except BaseException:
                metrics.PROCESS.record(op, cluster_id, 0, time.perf_counter() - t0,
                                       "LLM_FAILED")
                raise
            metrics.PROCESS.record(op, cluster_id, plan.nbytes, time.perf_counter() - t0)

        return counted  # type: ignore[return-value]

    return wrap


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


def _connect_nixl(path: Any, chan: Channel, connect: Callable[[float], tuple[Channel, Any]],
                  deadline: float) -> tuple[Channel, Any, str]:
    """Load the peer's NIXL metadata over the fresh link. A peer without NIXL (it answers
    an Error, or, before protocol.md's NIXL messages, closes the connection) or whose
    metadata our NIXL refuses (LinkFailed: another NIXL version) gets TCP."""
    try:
        path.connect(chan, deadline)
        return chan, path, "forced nixl (UCX; metadata over the link)"
    except (NotSupported, RemoteProtocolError, BrokenLink, LinkFailed) as e:
        path.close()
        log.warning("nixl forced but the peer offers no NIXL agent (%s); using tcp", e)
        if chan.closed:
            chan, _ = connect(deadline)
        return chan, TcpPath(), f"nixl forced but the peer offers no NIXL agent: {e}"


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
        self._inbound: dict[tuple[int, str], PeerInfo] = {}
        self._lock = threading.Lock()
        self._closed = False
        self.listener: TcpListener | None = None
        self.nixl: Any = None  # transport.nixl.NixlAgent when the transport is nixl
        # open NIXL leases: id(lease) -> (peer key, fresh, is a write); each keeps the agent
        # progressing
        self._nixl_leases: dict[int, tuple[tuple[int, str], bool, bool]] = {}
        self._nixl_wired: set[tuple[int, str]] = set()  # connections with a completed read
        self._nixl_lock = threading.Lock()
        self._tls_client = config.tls.client_context() if config.tls else None
        try:
            for placement, cfg in ((DEVICE, config.device_pool), (HOST, config.host_pool)):
                if cfg is not None:
                    name = "datadist-device-pool" if placement == DEVICE else "datadist-host-pool"
                    pool = HostPool(cfg.memory_size, cfg.page_shift, name)
                    self._pools[placement] = pool
                    shared.register_arena(pool.base, pool.size, pool.fd)
            if self.forced == PathKind.NIXL:
                self.ensure_nixl()
            if config.listen is not None:
                self.start_listening(*config.listen)
        except BaseException:
            self.close()
            raise

    def ensure_nixl(self) -> Any:
        """Our NIXL agent (transport/nixl.py), created on first use: at init when the
        transport is nixl (a reader), else when a reader first asks for our metadata (an
        owner serves NIXL readers whenever NIXL is installed). The pools and the registered
        caches are registered with it once. Raises InvalidArgument (PARAM_INVALID) without
        NIXL installed."""
        with self._nixl_lock:
            if self.nixl is not None:
                return self.nixl
            self._check_open()
            from datadist.transport.nixl import NixlAgent

            agent = NixlAgent(self.config.cluster_id)
            try:
                for placement, pool in self._pools.items():
                    # Pools are host memory, whatever their placement.
                    agent.register(("pool", placement), np.array([pool.base], np.uint64),
                                   pool.size, p.MEM_DRAM, 0)
                for entry in self.registry.entries():
                    if not entry.owned:
                        self._nixl_register(agent, entry)
            except BaseException:
                agent.close()
                raise
            self.nixl = agent
            return agent

    @staticmethod
    def _nixl_register(agent: Any, entry: CacheEntry) -> None:
        from datadist.transport.nixl import memory_kind

        mem, dev = memory_kind(int(entry.addrs[0]), entry.placement == DEVICE)
        agent.register(entry.cache_id, entry.addrs, entry.geometry.tensor_bytes, mem, dev)

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
            links = list(self._links.values())
            self._links.clear()
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
        with self._nixl_lock:
            if self.nixl is not None:
                self.nixl.close()

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
        # Under the NIXL lock: a NIXL agent created meanwhile sees the entry, and a NIXL
        # grant for it waits for its registration (open_nixl).
        with self._nixl_lock:
            entry = self.registry.add(
                geometry, arr, owned=False, placement=placement, keys=keys,
                blocks_model_id=blocks_model_id, remote_accessible=remote_accessible,
                shm=shared.lookup(arr, geometry.tensor_bytes),
            )
            if self.nixl is not None:
                try:
                    self._nixl_register(self.nixl, entry)
                except BaseException:
                    self.registry.unregister(entry.cache_id)
                    raise
        return entry

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
        self.registry.unregister(cache_id)  # waits for readers (leases) first
        if self.nixl is not None:
            with self._nixl_lock:
                self.nixl.deregister(cache_id)

    def remove_key(self, key: KeyId) -> None:
        self.registry.remove_key(key)

    # ------------------------------------------------------------------ links

    def _hello(self) -> p.Hello:
        """A fresh Hello: with a secret, a fresh nonce for the challenge."""
        ident = self.identity
        secret = self.config.secret
        return p.Hello(
            self.config.cluster_id, self.role, ident.pid, ident.pid_ns, ident.boot_id,
            p.FEATURE_AUTH if secret else 0, auth.nonce() if secret else b"",
        )

    def link(self, cluster_id: int, host: str, port: int, timeout: float) -> Link:
        """Connect to a peer's listener and check it is who we asked for. Blocks <= timeout."""
        self._check_open()
        with self._lock:
            if cluster_id in self._links:
                raise AlreadyLinked(f"cluster {cluster_id} is already linked")
        link = self.open_link(cluster_id, host, port, timeout)
        try:
            self.adopt_link(link)
        except AlreadyLinked:
            link.close()
            raise
        return link

    def unlink(self, cluster_id: int, timeout: float, force: bool = False) -> None:
        """Drop our link.

        Without ``force``: wait (up to ``timeout``) for a transfer in flight to finish, tell
        the peer, then close; a link still busy after the timeout raises Busy
        (LLM_LINK_BUSY) and stays up. With ``force``: close our end at once; a transfer in
        flight fails with LLM_LINK_FAILED.
        """
        link = self.get_link(cluster_id)
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
            if self._links.get(cluster_id) is link:
                del self._links[cluster_id]
        link.close()

    def get_link(self, cluster_id: int) -> Link:
        with self._lock:
            link = self._links.get(cluster_id)
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
        with self._lock:
            return bool(self._links or self._inbound)

    # ------------------------------------------------------------------ transfers

    @_counted("pull")
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
        if cluster_id == self.config.cluster_id:
            raise InvalidArgument("data can not be pulled from own cluster")
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

    @_counted("push")
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
        if cluster_id == self.config.cluster_id:
            raise InvalidArgument("data can not be pushed to own cluster")
        entry = self.registry.hold(src_cache_id)
        try:
            _check_local_plan(plan, entry)
            link = self.get_link(cluster_id)
            local = make_iov(*plan.local_iov(entry.addrs))
            msg = p.Write(key, unit_bytes, 0, plan.remote_tensors, plan.remote_offsets,
                          plan.lengths, wire_layout(entry.geometry))
            # Pushes go over the control channel (the owner must check the spans before
            # anything lands, which is what the two-step Write does), or, on the NIXL path,
            # as one NIXL WRITE into spans the owner checked and leased (NixlWrite).
            link.run(deadline, lambda path, chan: (
                path if path.caps.name == "nixl" else _TCP).write(chan, msg, local, deadline))
        finally:
            self.registry.unhold(entry)

    # ------------------------------------------------------------------ owner side

    def on_hello(self, hello: p.Hello, address: str) -> p.Welcome:
        if self._closed:
            raise Closed("finalized")
        if hello.cluster_id == self.config.cluster_id:
            raise LinkFailed(f"peer uses our own cluster id {hello.cluster_id}")
        peer = PeerInfo(hello.cluster_id, hello.role, hello.pid, hello.pid_ns, hello.boot_id,
                        address)
        with self._lock:
            self._inbound[peer.key] = peer
        ident = self.identity
        secret = self.config.secret
        if secret is None:
            return p.Welcome(self.config.cluster_id, self.role, ident.pid, ident.pid_ns,
                             ident.boot_id)
        proof = auth.server_proof(secret, hello.proof, auth.nonce(), self.config.cluster_id,
                                  hello.cluster_id)
        return p.Welcome(self.config.cluster_id, self.role, ident.pid, ident.pid_ns,
                         ident.boot_id, p.FEATURE_AUTH, proof)

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
        got = self._nixl_leases.pop(id(lease), None) if self._nixl_leases else None
        if got is None:
            self.registry.close(lease, ok)
            return
        peer_key, fresh, write = got
        self.registry.close(lease, ok, consume=not write)
        if ok:
            self._nixl_wired.add(peer_key)
        self.nixl.pump_release(fresh)

    def _serving_nixl(self) -> Any:
        """Our NIXL agent for a NIXL request, created if need be; NotSupported where NIXL is
        not installed or serving it is turned off (the reader then uses TCP)."""
        if self._closed:
            raise Closed("finalized")
        if self.nixl is None and os.environ.get("DATADIST_NIXL_SERVE", "1") == "0":
            raise NotSupported("this owner does not serve NIXL readers (DATADIST_NIXL_SERVE=0)")
        try:
            return self.ensure_nixl()
        except InvalidArgument as e:
            raise NotSupported(str(e)) from None

    def nixl_metadata(self) -> p.NixlMd:
        return self._serving_nixl().metadata()

    def open_nixl(self, peer: PeerInfo, msg: p.NixlRead | p.NixlWrite, lease_id: int
                  ) -> tuple[Lease, p.NixlGrant]:
        """The owner's side of a NIXL pull or push: the key is resolved and the spans are
        checked (registry.open) before anything NIXL sees them; the grant names our agent.
        A write lease never consumes its key (as open_write)."""
        # A reader may come back to a restarted owner without asking for metadata first:
        # the grant names the new agent, and the reader loads it then.
        nixl = self.nixl or self._serving_nixl()
        lease = self.registry.open(msg.key, msg.unit_bytes, msg.tensors, msg.offsets,
                                   msg.lengths, layout=msg.layout)
        try:
            entry = lease.entry
            tensors = entry.addrs[lease.tensors], entry.geometry.tensor_bytes
            try:
                mem, dev = nixl.grant_info(*tensors)
            except NotSupported:
                with self._nixl_lock:  # registered a moment ago: its NIXL registration ends
                    mem, dev = nixl.grant_info(*tensors)
        except BaseException:
            self.registry.close(lease, False)
            raise
        fresh = peer.key not in self._nixl_wired
        self._nixl_leases[id(lease)] = (peer.key, fresh, isinstance(msg, p.NixlWrite))
        nixl.pump_acquire(fresh)
        # The client adds its offsets to the bases; raw-address offsets are absolute already.
        bases = (np.zeros(len(msg.tensors), np.uint64) if msg.key.kind == p.KeyKind.ADDRESS
                 else lease.bases)
        return lease, p.NixlGrant(lease_id, nixl.name.encode(), nixl.generation, mem, dev,
                                  bases)

    def open_write(self, peer: PeerInfo, msg: p.Write) -> Lease:
        return self.registry.open(msg.key, msg.unit_bytes, msg.tensors, msg.offsets, msg.lengths,
                                  layout=msg.layout)

    def close_write(self, lease: Lease, ok: bool) -> None:
        self.registry.close(lease, ok, consume=False)

    def on_bye(self, peer: PeerInfo) -> None:
        with self._lock:
            self._inbound.pop(peer.key, None)

    def on_disconnect(self, peer: PeerInfo) -> None:
        with self._lock:
            self._inbound.pop(peer.key, None)
        self._nixl_wired.discard(peer.key)

    def inbound_peers(self) -> list[PeerInfo]:
        with self._lock:
            return list(self._inbound.values())

    # ------------------------------------------------------------------ two-sided links
    # core/comm.py connects to every member first and makes the links usable only once all
    # members are up, so that transfers before then get NOT_YET_LINK.

    def open_link(self, cluster_id: int, host: str, port: int, timeout: float) -> Link:
        """Connect and check the peer exactly as :meth:`link`, but do not register the link
        (transfers cannot use it yet): :meth:`adopt_link` does. Blocks <= timeout."""
        self._check_open()
        if cluster_id == self.config.cluster_id:
            raise InvalidArgument("cannot link to our own cluster id")

        def connect(deadline: float) -> tuple[Channel, p.Welcome]:
            return greet(host, port, cluster_id, self._hello, self.config.secret, deadline,
                         self._tls_client)

        deadline = time.monotonic() + timeout
        chan, welcome = connect(deadline)
        path, reason = choose_path(self.forced, self.identity, welcome, self.nixl)
        if path.caps.name == "nixl":
            chan, path, reason = _connect_nixl(path, chan, connect, deadline)
        return Link(cluster_id, host, port, chan, welcome, path, reason, connect)

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


__all__ = ["DEVICE", "HOST", "Engine", "EngineConfig", "PathKind"]
