"""The engine: one per process, owning the registry, the pools, the listener and the links.

Who calls: the api facade (``LLMDataDist``, ``CacheManager``), with typed arguments; the
transports call back into it as the owner side of the protocol (:class:`RequestHandler`).

Blocking: ``link``/``unlink``/``pull``/``push`` block up to their deadline; everything else
returns at once (``unregister`` waits for live leases, bounded). ``pull_async``/``push_async``
return a ``core.transfers.Transfer`` at once and run on the engine's transfer pool (at most
POOL_THREADS threads). Thread-safe.
"""

from __future__ import annotations

import contextlib
import functools
import hmac
import itertools
import logging
import secrets
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import numpy as np

from datadist.core import auth, metrics
from datadist.core.config import (
    DEVICE,
    HOST,
    EngineConfig,
    HostIdentity,
    PathKind,
    forced_path,
)
from datadist.core.errors import (
    AlreadyLinked,
    BrokenLink,
    Busy,
    CacheNotFound,
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
    Timeout,
    UnlinkFailed,
)
from datadist.core.layout import Geometry, Plan, check_source_spans, max_int, wire_layout
from datadist.core.links import Connected, Link, connect, greet
from datadist.core.prepared import KEPT, SMALL_REQUEST, Prepared
from datadist.core.registry import (
    CacheEntry,
    KeyId,
    Lease,
    Registry,
    check_read,
    check_request_size,
    close_fences,
)
from datadist.core.transfers import POOL_THREADS, Job, Transfer, TransferPool
from datadist.memory import mapped, shared
from datadist.memory.pool import HostPool
from datadist.memory.spans import shm_pays
from datadist.transport.address import split_address
from datadist.transport.base import PeerInfo
from datadist.transport.channel import Channel
from datadist.transport.iov import PTRACER, CmaRefused
from datadist.transport.local import LocalListener, local_name
from datadist.transport.paths import CmaPath, LeasedCopy, TcpPath, lease_key
from datadist.transport.tcp import ConnBudget, ServerConnection, TcpListener
from datadist.wire import protocol as p

log = logging.getLogger(__name__)

NIXL_REVOKE_WAIT = 5.0  # seconds an owner waits for readers to give NIXL leases back
# Seconds a listener waits for a live-looking reverse channel to answer a Ping before a newer
# one of the same cluster id (another control channel's) may replace it: a linker whose old
# channels died unseen (a cut wire, a host that lost power) relinks; a live one keeps its link.
REVERSE_PROBE = 0.5
# NIXL leases one reader connection may hold (one per cache it reads): each is revoked on
# unregister and finalize, and pins its cache until then.
MAX_NIXL_LEASES_PER_PEER = 1024
CLOSE_LEASE_WAIT = 5.0  # seconds finalize waits for transfers still using local memory
# Grants (same-host reads) one verified peer process may hold at once, over all its
# connections (each connection also caps its own: transport/tcp.py).
MAX_GRANTS_PER_PEER = 16
_TCP = TcpPath()
# Keys a same-host reader may hold a whole-cache lease through (no key to consume).
_LEASABLE = (p.KeyKind.CACHE_ID, p.KeyKind.BLOCKS_KEY)
_F = TypeVar("_F", bound=Callable[..., None])


def _record(op: str, cluster_id: int, plan: Plan, t0: float,
            error: BaseException | None) -> None:
    """Record one transfer's outcome in :data:`metrics.PROCESS`: its duration since ``t0``,
    its bytes when it succeeded, its status code's name when it failed."""
    dt = time.perf_counter() - t0
    if error is None:
        metrics.PROCESS.record(op, cluster_id, plan.nbytes, dt)
    elif isinstance(error, DatadistError):
        metrics.PROCESS.record(op, cluster_id, 0, dt, Code(error.code).status_name)
    else:
        metrics.PROCESS.record(op, cluster_id, 0, dt, "LLM_FAILED")


def _counted(op: str) -> Callable[[_F], _F]:
    """Record a transfer method's outcome (:func:`_record`)."""

    def wrap(fn: _F) -> _F:
        @functools.wraps(fn)
        def counted(self: Any, cluster_id: int, key: Any, unit_bytes: int, plan: Plan,
                    *args: Any, **kwargs: Any) -> None:
            t0 = time.perf_counter()
            try:
                fn(self, cluster_id, key, unit_bytes, plan, *args, **kwargs)
            except BaseException as e:
                _record(op, cluster_id, plan, t0, e)
                raise
            _record(op, cluster_id, plan, t0, None)

        # Called exactly as ``fn`` (same parameters, passed through): ``fn``'s type.
        return cast(_F, counted)

    return wrap


@dataclass(eq=False)
class _CacheLease:
    """A NIXL reader's lease on a whole cache of ours (Engine.open_nixl_lease)."""

    lease: Lease
    peer: tuple[int, str]  # its connection
    cluster_id: int
    pid: int
    drop: Callable[[], None]  # shuts its connection down


def _reverse_gone(link: Link) -> bool:
    """A reverse channel its linker closed (or broke: it is readable while idle, as
    Channel.peer_gone). One busy with a transfer is not gone. Never blocks."""
    return link.chan.closed or (not link.lock.locked() and link.chan.peer_gone())


def _answers_ping(link: Link, cluster_id: int) -> bool:
    """Does the reverse channel ``link`` answer a Ping within REVERSE_PROBE s? A channel busy
    with a transfer counts as live (the transfer has its own deadline); one that does not
    answer is closed. Called by the listener, without its lock, before a newer reverse
    channel of the same cluster id may replace ``link``; blocks up to REVERSE_PROBE s."""
    if not link.lock.acquire(blocking=False):
        return True
    try:
        reply = link.chan.call(p.Ping(cluster_id), time.monotonic() + REVERSE_PROBE)
        return isinstance(reply, p.Pong)
    except (DatadistError, OSError):
        link.chan.close()
        return False
    finally:
        link.lock.release()


def _revoke(msg: p.NixlRevoke, deadline: float, _path: Any, chan: Channel) -> None:
    """Send a revoke on a reader's reverse channel and wait for its Ok."""
    got = chan.call(msg, deadline)
    if not isinstance(got, p.Ok):
        raise RemoteProtocolError(f"expected Ok to a NixlRevoke, got {type(got).__name__}")


def _check_local_plan(plan: Plan, entry: CacheEntry) -> bool:
    """The local side of a plan must fit the cache as it was registered (the caller's
    CacheDesc may have changed since): never read or write past registered memory. And the
    request must be one an owner accepts (span count), or it is refused here, before a
    byte moves."""
    check_request_size(plan.remote_tensors, plan.remote_offsets)
    g = entry.geometry
    if len(plan.local_tensors) and max_int(plan.local_tensors) >= g.num_tensors:
        raise InvalidArgument(f"cache {entry.cache_id} has {g.num_tensors} tensors")
    check_source_spans(plan.local_offsets, plan.lengths, g.tensor_bytes)
    return True


def checked_local_iov(kept: Prepared[np.ndarray], plan: Plan, entry: CacheEntry) -> np.ndarray:
    """The local spans of ``plan`` in ``entry``'s memory as an iovec array, once the plan is
    checked against the cache (InvalidArgument if it does not fit). Kept in ``kept`` for small
    plans, so a plan that repeats is checked once (read-only: transports edit copies). Both
    engines' pulls and pushes call it."""
    if plan.num_spans > SMALL_REQUEST:
        _check_local_plan(plan, entry)
        return plan.local_iovecs(entry.addrs)

    def build() -> np.ndarray:
        _check_local_plan(plan, entry)
        iov = plan.local_iovecs(entry.addrs)
        iov.flags.writeable = False
        return iov

    return kept.get((plan, entry), build)


def _connect_nixl(path: Any, chan: Channel, connect: Callable[[float], tuple[Channel, Any]],
                  deadline: float, welcome: p.Welcome
                  ) -> tuple[Channel, p.Welcome, Any, str]:
    """Load the peer's NIXL metadata over the fresh link. A peer without NIXL (it answers
    an Error, or, before protocol.md's NIXL messages, closes the connection) or whose
    metadata our NIXL refuses (LinkFailed: another NIXL version) gets TCP."""
    try:
        path.connect(chan, deadline)
        return chan, welcome, path, "forced nixl (UCX; metadata over the link)"
    except (NotSupported, RemoteProtocolError, BrokenLink, LinkFailed) as e:
        path.close()
        log.warning("nixl forced but the peer offers no NIXL agent (%s); using tcp", e)
        if chan.closed:  # a fresh channel: its Welcome (its link token) is the link's now
            chan, welcome = connect(deadline)
        return chan, welcome, TcpPath(), f"nixl forced but the peer offers no NIXL agent: {e}"


class Engine:
    """Typed core of datadist. Created by ``LLMDataDist.init``, closed by ``finalize``."""

    #: The Python engine: its serving and transfer threads need the GIL (the native engine,
    #: ``datadist._core``, says True). The vLLM connector keeps its GIL workaround for False.
    native = False

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
        # link tokens of the live control channels peers opened to us, by connection: a
        # reverse channel is adopted only with one of its cluster's (adopt_reverse)
        self._tokens: dict[tuple[int, str], tuple[int, bytes]] = {}
        self._linking: set[int] = set()  # clusters link() is connecting to right now
        self._lock = threading.Lock()
        self._closed = False
        self._stop = threading.Event()  # set at close: ends the reverse channels we serve
        # pull_async / push_async run here: a few threads, started by the first ones
        self._transfers = TransferPool(POOL_THREADS, f"datadist-xfer-{config.cluster_id}")
        # One budget of connections for every listener of ours (TCP and the local channel)
        self._budget = ConnBudget(config.max_connections, config.max_connections_per_peer)
        self.listener: TcpListener[Lease] | None = None
        self.local_listener: LocalListener[Lease] | None = None
        self._grants: dict[int, int] = {}  # verified peer pid -> grants outstanding
        self.nixl: Any = None  # transport.nixl.NixlAgent when the transport is nixl
        # open NIXL leases: id(lease) -> (peer key, fresh, is a write); each keeps the agent
        # progressing
        self._nixl_leases: dict[int, tuple[tuple[int, str], bool, bool]] = {}
        self._nixl_wired: set[tuple[int, str]] = set()  # connections with a completed read
        self._nixl_lock = threading.Lock()
        # local iovecs of small plans checked against a local cache, by plan and cache
        self._local_iovs: Prepared[np.ndarray] = Prepared(KEPT, len)
        # checked iovecs of small leased reads, by plan, local cache and lease
        self._leased_iovs: Prepared[LeasedCopy] = Prepared(KEPT, LeasedCopy.rows)
        # read leases on whole caches (NixlLease), revoked before their memory goes: by id
        self._nixl_held: dict[int, _CacheLease] = {}
        self._nixl_lease_ids = itertools.count(1)
        self._nixl_closing: set[int] = set()  # cache ids being revoked: no new lease on them
        self._nixl_epoch = 0  # bumped when a blocks model id may name another cache
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
        owner that serves NIXL: :meth:`nixl_refusal`). The pools and the registered caches
        are registered with it once (private ones only where we serve no NIXL:
        :meth:`_nixl_register`). Raises InvalidArgument (PARAM_INVALID) without NIXL
        installed."""
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

    def _nixl_register(self, agent: Any, entry: CacheEntry) -> None:
        """Register ``entry`` with our NIXL agent. A NIXL registration is readable (and
        writable) by whoever holds the metadata, whatever our control channel says, so a
        private cache (``remote_accessible=False``) is never registered by a process that
        serves NIXL; one that does not (a reader: its destination must be registered to
        read into it) registers it marked private, and its agent then hands out no
        metadata at all (NixlAgent.metadata)."""
        from datadist.transport.nixl import memory_kind

        if not entry.remote_accessible and self.config.nixl_serve:
            return
        mem, dev = memory_kind(int(entry.addrs[0]), entry.placement == DEVICE)
        agent.register(entry.cache_id, entry.addrs, entry.geometry.tensor_bytes, mem, dev,
                       private=not entry.remote_accessible)

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

    def make_listener(self, host: str, port: int) -> TcpListener[Lease]:
        """A started listener serving this engine, with TLS when configured. Every listener
        of the engine (its own, two-sided link ones) comes from here."""
        server_tls = self.config.tls.server_context() if self.config.tls else None
        listener = TcpListener(host, port, self, server_tls, budget=self._budget).start()
        self._serve_local(server_tls)
        return listener

    def _serve_local(self, server_tls: ssl.SSLContext | None) -> None:
        """Serve the local channel (transport/local.py) too, once, unless TCP is forced:
        same-host peers are verified there, and only there get grants. Its connections count
        in the engine's one budget (``datadist.MaxConnections`` / ``MaxConnectionsPerPeer``),
        with the TCP listener's."""
        with self._lock:
            if self.local_listener is not None or self.forced == PathKind.TCP or self._closed:
                return
            name = local_name(self.identity.pid, self.config.cluster_id)
            try:
                self.local_listener = LocalListener(name, self, server_tls,
                                                    budget=self._budget).start()
            except LinkFailed as e:
                log.info("same-host peers will use tcp: %s", e)

    def stop_listening(self) -> None:
        """Stop serving new peers (switch_role away from listening): the TCP listener and the
        local channel both close (as the C++ owner's SetRole does); a later
        :meth:`start_listening` opens both again. Who calls: the facade, with no link alive."""
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        with self._lock:
            local, self.local_listener = self.local_listener, None
        if local is not None:
            local.close()

    def close(self) -> None:
        """Tear everything down. Idempotent; does not raise."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            links = [*self._links.values(), *self._reverse.values()]
        self._transfers.close()  # queued asynchronous transfers fail (ENGINE_FINALIZED)
        self._nixl_revoke(lambda held: True)  # while the reverse channels are up
        with self._lock:
            self._links.clear()
            self._reverse.clear()
        self._stop.set()
        for link in links:
            link.close()
        if self.listener is not None:
            self.listener.close()
        if self.local_listener is not None:
            self.local_listener.close()
        if PTRACER.release(id(self)):
            log.info("same-host readers: %s", PTRACER.state)
        # Running asynchronous transfers end with their links (or their deadline); their
        # local caches are held until then, which the wait below covers too.
        self._transfers.join(CLOSE_LEASE_WAIT)
        # Every cache not yet released, however it is held (a deallocated cache still bound
        # to a key counts): a serving thread may still be reading any of them.
        entries = self.registry.clear()
        leased = self.registry.wait_unleased(entries, CLOSE_LEASE_WAIT)
        if not leased:  # nothing in flight: the fences go (else leaked, as the pools are)
            for entry in entries:
                close_fences(entry)
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
        keys: Sequence[KeyId | None] = (),
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
        self._nixl_model_moved(blocks_model_id, entry)
        return entry

    def allocate(
        self,
        geometry: Geometry,
        *,
        placement: int,
        keys: Sequence[KeyId | None] = (),
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
            entry = self.registry.add(
                geometry, addrs, owned=True, placement=placement, keys=keys,
                blocks_model_id=blocks_model_id, free=lambda: pool.free(base),
                shm=shared.lookup(addrs, geometry.tensor_bytes),
            )
        except BaseException:
            pool.free(base)
            raise
        self._nixl_model_moved(blocks_model_id, entry)
        return entry

    def deallocate(self, cache_id: int, *, blocks: bool = False) -> None:
        with self._nixl_revoking(cache_id):  # NIXL readers let go of it first
            self.registry.deallocate(cache_id, drop_keys=blocks)

    def unregister(self, cache_id: int) -> None:
        with self._nixl_revoking(cache_id):  # NIXL readers let go of it first
            self.registry.unregister(cache_id)  # waits for readers (leases) first
        if self.nixl is not None:
            with self._nixl_lock:
                self.nixl.deregister(cache_id)

    def remove_key(self, key: KeyId) -> None:
        self.registry.remove_key(key)

    # ------------------------------------------------------------------ links

    def _hello(self, reverse: bool = False, token: bytes = b"") -> p.Hello:
        """A fresh Hello: with a secret, a fresh nonce for the challenge; ``reverse`` for the
        reverse channel of a link, echoing ``token``, the link token the peer issued our
        control channel (none from a peer that issues none)."""
        ident = self.identity
        secret = self.config.secret
        features = (p.FEATURE_AUTH if secret else 0) | (p.FEATURE_REVERSE if reverse else 0)
        proof = auth.nonce() if secret else b""
        if reverse and token:
            features |= p.FEATURE_TOKEN
            proof += token
        return p.Hello(
            self.config.cluster_id, self.role, ident.pid, ident.pid_ns, ident.boot_id,
            features, proof,
        )

    def link(self, cluster_id: int, host: str, port: int, timeout: float,
             as_announced: bool = False) -> Link:
        """Connect to a peer's listener and check it is who we asked for. Blocks <= timeout.

        ``as_announced``: file the link under the cluster id the peer announces, whatever
        ``cluster_id`` says (LLM-DataDist's LinkMsgHandler never compares them); the
        returned link's ``cluster_id`` is that id. One link to a cluster at a time: a second
        call while the first is still connecting is AlreadyLinked at once (its reverse
        channel would replace the first's at the peer)."""
        self._check_open()
        with self._lock:
            if cluster_id in self._links or cluster_id in self._linking:
                raise AlreadyLinked(f"cluster {cluster_id} is already linked")
            self._linking.add(cluster_id)
        try:
            link = self.open_link(cluster_id, host, port, timeout, as_announced=as_announced)
            try:
                self.adopt_link(link)
            except AlreadyLinked:
                link.close()
                raise
        finally:
            with self._lock:
                self._linking.discard(cluster_id)
        return link

    def unlink(self, cluster_id: int, timeout: float, force: bool = False,
               quiet_inbound: bool = False) -> None:
        """Drop our end of the link to ``cluster_id``: the one we made (``link``) and the
        one the peer made to us (its reverse channel), whichever exist.

        Without ``force``: wait (up to ``timeout``) for a transfer in flight to finish, tell
        the peer, then close; a link still busy after the timeout raises Busy
        (LLM_LINK_BUSY) and stays up; a peer that could not be told (gone, its connection
        broken) raises UnlinkFailed (LLM_UNLINK_FAILED, as the original's unlink when it
        cannot reach the peer) after our end is closed. With ``force``: close our end at
        once; a transfer in flight fails with LLM_LINK_FAILED. NotLinked when neither end
        exists. ``quiet_inbound``: the peer's end (its reverse channel) is closed as with
        ``force`` whatever ``force`` says: the peer's link is its own to unlink, so failing
        to tell it is no failure of ours (the HIXL backend's rule; both ends may unlink at
        once there).
        """
        with self._lock:
            link = self._links.get(cluster_id)
            inbound = self._reverse.get(cluster_id)
        if link is None and inbound is None:
            raise NotLinked(f"cluster {cluster_id} is not linked")
        untold: UnlinkFailed | None = None
        for one in (link, inbound):
            if one is not None:
                try:
                    self._drop(one, timeout, force or (quiet_inbound and one is inbound))
                except UnlinkFailed as e:
                    untold = e
        if untold is not None:
            raise untold

    def _drop(self, link: Link, timeout: float, force: bool) -> None:
        cluster_id = link.cluster_id
        untold: UnlinkFailed | None = None
        if not force:
            deadline = time.monotonic() + timeout
            if not link.lock.acquire(timeout=timeout):
                raise Busy(f"link to cluster {cluster_id} is busy with a transfer")
            try:
                try:
                    if link.chan.closed or link.chan.peer_gone():
                        link.chan.close()
                        if link.inbound:  # its reverse channel: only the peer can reopen it
                            raise BrokenLink("its connection is closed")
                        link.reconnect(deadline)  # as the original, which always dials anew
                    link.chan.call(p.Bye(), deadline)
                except DatadistError as e:
                    log.info("unlink of cluster %d: peer not told (%s)", cluster_id, e)
                    untold = UnlinkFailed(f"cluster {cluster_id} could not be told of the "
                                          f"unlink ({e}); our end is closed")
            finally:
                link.lock.release()
        with self._lock:
            table = self._reverse if link.inbound else self._links
            if table.get(cluster_id) is link:
                del table[cluster_id]
        link.close()
        if untold is not None:
            raise untold

    def get_link(self, cluster_id: int) -> Link:
        """The link transfers to ``cluster_id`` use: the one we made, else the one the peer
        made to us (its reverse channel). NotLinked if neither."""
        with self._lock:
            link = self._links.get(cluster_id) or self._reverse.get(cluster_id)
        if link is None:
            raise NotLinked(f"cluster {cluster_id} is not linked (link_clusters or link first)")
        return link

    def check_link(self, cluster_id: int, timeout: float) -> None:
        """Round-trip a Ping on the link; raises NotLinked, Timeout or BrokenLink."""
        link = self.get_link(cluster_id)
        deadline = time.monotonic() + timeout
        reply = link.run(deadline,
                         lambda path, chan: chan.call(p.Ping(cluster_id), deadline))
        if not isinstance(reply, p.Pong):
            raise RemoteProtocolError(f"expected Pong, got {type(reply).__name__}")

    def stats(self, peer: PeerInfo | None = None) -> dict[str, Any]:
        """The process's transfer metrics (``metrics.snapshot``), JSON-ready, with who we
        are. Called by the facade and tests for the whole process (``peer`` None), and by a serving
        thread for a peer's StatsRequest: then only that peer's own series (what we did
        for and with its cluster id: ``links`` holds its id alone, ``total`` is the same
        series), never other peers' ids, counts, bytes or latencies; none while that id's
        live reverse channel belongs to another control channel (a connection claiming
        the id of a linked peer)."""
        if peer is None:
            return metrics.stats(self.config.cluster_id, self.role)
        snap = metrics.snapshot()
        with self._lock:
            rev = self._reverse.get(peer.cluster_id)
            # The id is only a claim: while that cluster's link has a live reverse channel,
            # its series are its control channel's (the token the channel echoed), not any
            # connection's that names the id.
            foreign = (rev is not None and not _reverse_gone(rev)
                       and not hmac.compare_digest(rev.token, peer.token))
        own = {} if foreign else snap["links"].get(peer.cluster_id, {})
        return {"cluster_id": self.config.cluster_id, "role": self.role, "total": own,
                "links": {str(peer.cluster_id): own} if own else {}}

    def peer_stats(self, cluster_id: int, timeout: float) -> dict[str, Any]:
        """Ask a linked peer for its metrics (``stats``) over the link. Blocks <= timeout;
        NotLinked, Timeout, or a RemoteProtocolError from a peer that does not know the
        request (an older or another implementation)."""
        link = self.get_link(cluster_id)
        deadline = time.monotonic() + timeout
        reply = link.run(deadline,
                         lambda path, chan: chan.call(p.StatsRequest(), deadline))
        if not isinstance(reply, p.Stats):
            raise RemoteProtocolError(f"expected Stats, got {type(reply).__name__}")
        return metrics.parse_stats(reply.json)

    def links(self) -> list[Link]:
        with self._lock:
            return list(self._links.values())

    def has_links(self) -> bool:
        """Any link alive, either end. Reverse channels the linker has closed are dropped
        here (nothing else notices them: the listener never reads an idle one)."""
        with self._lock:
            self._prune_reverse()
            return bool(self._links or self._inbound or self._reverse)

    def reverse_ids(self) -> list[int]:
        """The cluster ids whose reverse channels to our listener are live now (our ends of
        their links), ascending; ones their linkers closed are dropped first (as
        :meth:`has_links`). For tests and tools; never blocks."""
        with self._lock:
            self._prune_reverse()
            return sorted(self._reverse)

    def _prune_reverse(self) -> None:
        """Drop the reverse channels their linkers closed (self._lock held; never blocks)."""
        for cid, link in list(self._reverse.items()):
            if _reverse_gone(link):
                del self._reverse[cid]
                link.close()

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
        deadline = self._deadline(timeout)
        entry = self.registry.hold(dst_cache_id)
        try:
            self._pull_held(cluster_id, key, unit_bytes, plan, entry, deadline)
        finally:
            self.registry.unhold(entry)

    def pull_async(
        self,
        cluster_id: int,
        key: p.KeyRef,
        unit_bytes: int,
        plan: Plan,
        dst_cache_id: int,
        timeout: float | None = None,
    ) -> Transfer:
        """:meth:`pull`, issued: returns at once a :class:`Transfer` that a pool thread
        completes (``done()``, ``wait(timeout_s)``, ``error()``). Never raises: every failure,
        an unknown local cache or a finalized engine included, is the transfer's ``error()``.
        The deadline starts now; the local cache is held (its memory kept, ``unregister``
        waiting) from now until the transfer ends. Metrics as :meth:`pull`'s."""
        return self._issue("pull", cluster_id, plan, dst_cache_id, timeout,
                           lambda entry, deadline: self._pull_held(
                               cluster_id, key, unit_bytes, plan, entry, deadline))

    def _deadline(self, timeout: float | None) -> float:
        return time.monotonic() + (timeout if timeout is not None else self.config.sync_timeout)

    def _issue(self, op: str, cluster_id: int, plan: Plan, cache_id: int,
               timeout: float | None,
               body: Callable[[CacheEntry, float], None]) -> Transfer:
        """Hold the local cache, then queue ``body(entry, deadline)`` on the transfer pool."""
        t0 = time.perf_counter()
        deadline = self._deadline(timeout)
        transfer = Transfer(f"{op} cluster={cluster_id} cache={cache_id}")
        try:
            self._check_open()
            entry = self.registry.hold(cache_id)
        except DatadistError as e:
            _record(op, cluster_id, plan, t0, e)
            transfer._finish(e)
            return transfer

        def run() -> None:
            if time.monotonic() >= deadline:  # queued behind others past its deadline
                raise Timeout(f"the {op} waited in the queue past its deadline; nothing moved")
            body(entry, deadline)

        def finish(error: BaseException | None) -> None:
            self.registry.unhold(entry)
            _record(op, cluster_id, plan, t0, error)

        self._transfers.submit(Job(transfer, run, finish))
        return transfer

    def _pull_held(self, cluster_id: int, key: p.KeyRef, unit_bytes: int, plan: Plan,
                   entry: CacheEntry, deadline: float) -> None:
        """The body of a pull into ``entry``, which the caller holds."""
        local = self._local_iov(plan, entry)
        link = self.get_link(cluster_id)
        if (key.kind in _LEASABLE and isinstance(link.path, CmaPath) and link.path.leases
                and not self.config.verify
                and self._move_leased(link, link.path, key, unit_bytes, plan, entry, local,
                                      deadline)):
            return
        flags = p.ReadFlags.CHECKSUM if self.config.verify else p.ReadFlags.NONE
        if plan.whole:
            flags |= p.ReadFlags.WHOLE
        msg = p.Read(key, unit_bytes, flags, plan.remote_tensors, plan.remote_offsets,
                     plan.lengths, wire_layout(entry.geometry))
        link.run(deadline,
                 lambda path, chan: path.read(chan, msg, local, deadline))

    def _local_iov(self, plan: Plan, entry: CacheEntry) -> np.ndarray:
        return checked_local_iov(self._local_iovs, plan, entry)

    def _move_leased(self, link: Link, path: CmaPath, key: p.KeyRef, unit_bytes: int,
                     plan: Plan, entry: CacheEntry, local: np.ndarray, deadline: float,
                     write: bool = False) -> bool:
        """Same host, a cache named by id or BlocksCacheKey: copy from it (or, ``write``,
        into it) under a whole-cache lease (asked for once per link, cache and direction),
        checking the request against the lease exactly as the owner would. False when there
        is no usable lease (the owner revoked it, the kernel refused the copy, the owner is
        gone): nothing was copied and the caller asks the owner, whose answer is then the
        outcome."""
        lkey = lease_key(key, write)
        rc = path.remote.get(lkey)
        if rc is None:
            try:
                rc = link.run(deadline, lambda cur, chan: (
                    cur.lease(chan, key, deadline, write) if cur is path and cur.leases
                    else None))
            except NotSupported:  # the owner cannot lease now (no fence): ask per request
                return False
            if rc is None:
                return False

        def prepare() -> LeasedCopy:
            m = rc.msg
            geometry = Geometry(len(m.addrs), m.tensor_bytes, m.units, m.is_blocks, m.layout)
            slot = key.b if key.kind == p.KeyKind.CACHE_ID else -1
            base = check_read(geometry, m.cache_id, slot, unit_bytes, plan.remote_tensors,
                              plan.remote_offsets, plan.lengths, wire_layout(entry.geometry),
                              plan.whole and not write)
            cma, shm = CmaPath.leased_sources(rc, plan.remote_tensors, base,
                                              plan.remote_offsets, plan.lengths)
            return LeasedCopy(local, cma, shm, plan.nbytes,
                              shm_pays(len(plan.remote_tensors), plan.lengths))

        slot_key = key.b if key.kind == p.KeyKind.CACHE_ID else -1
        try:
            if plan.num_spans <= SMALL_REQUEST:
                copy = self._leased_iovs.get((plan, entry, rc, slot_key, unit_bytes), prepare)
            else:
                copy = prepare()
        except InvalidArgument:
            if rc.fence.revoked():  # checked against a cache the key no longer names:
                path.forget(rc)  # the owner's answer is the outcome
                return False
            raise
        try:
            return path.copy_leased(rc, copy)
        except (CmaRefused, BrokenLink) as e:
            log.info("leased %s cluster %d failed (%s): asking the owner",
                     "write to" if write else "read from", link.cluster_id, e)
            path.forget_leases()
            return False

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
        deadline = self._deadline(timeout)
        entry = self.registry.hold(src_cache_id)
        try:
            self._push_held(cluster_id, key, unit_bytes, plan, entry, deadline)
        finally:
            self.registry.unhold(entry)

    def push_async(
        self,
        cluster_id: int,
        key: p.KeyRef,
        unit_bytes: int,
        plan: Plan,
        src_cache_id: int,
        timeout: float | None = None,
    ) -> Transfer:
        """:meth:`push`, issued: as :meth:`pull_async` (the source cache held until the
        transfer ends)."""
        return self._issue("push", cluster_id, plan, src_cache_id, timeout,
                           lambda entry, deadline: self._push_held(
                               cluster_id, key, unit_bytes, plan, entry, deadline))

    def _push_held(self, cluster_id: int, key: p.KeyRef, unit_bytes: int, plan: Plan,
                   entry: CacheEntry, deadline: float) -> None:
        """The body of a push from ``entry``, which the caller holds."""
        local = self._local_iov(plan, entry)
        link = self.get_link(cluster_id)
        msg = p.Write(key, unit_bytes, 0, plan.remote_tensors, plan.remote_offsets,
                      plan.lengths, wire_layout(entry.geometry))
        if (key.kind in _LEASABLE and isinstance(link.path, CmaPath) and link.path.leases
                and self._move_leased(link, link.path, key, unit_bytes, plan, entry,
                                      local, deadline, write=True)):
            return
        # Pushes go over the control channel (the owner must check the spans before
        # anything lands, which is what the two-step Write does), on the same host under
        # a write lease, or, on the NIXL path, as one NIXL WRITE into spans the owner
        # checked and leased (NixlWrite).
        link.run(deadline, lambda path, chan: (
            path if path.caps.name == "nixl" else _TCP).write(chan, msg, local, deadline))

    # ------------------------------------------------------------------ owner side

    def on_hello(self, hello: p.Hello, address: str) -> p.Welcome:
        if self._closed:
            raise Closed("finalized")
        ident = self.identity
        if (hello.cluster_id == self.config.cluster_id and hello.pid == ident.pid
                and ident.boot_id == hello.boot_id and ident.pid_ns == hello.pid_ns):
            # Ourselves. Another process with our cluster id is a peer like any other: the
            # V0 vllm-ascend connector gives both sides cluster id = local rank.
            raise LinkFailed("a link from this engine to itself")
        # The peer is registered only once its handshake completed (on_peer_ready).
        secret = self.config.secret
        features = p.FEATURE_REVERSE
        if self.local_listener is not None:
            features |= p.FEATURE_LOCAL | p.FEATURE_LEASE
        proof = b""
        if secret is not None:
            features |= p.FEATURE_AUTH
            nonce = p.split_token(hello.proof, hello.features)[0]
            proof = auth.server_proof(secret, nonce, auth.nonce(), self.config.cluster_id,
                                      hello.cluster_id)
        if not hello.features & p.FEATURE_REVERSE:
            # A control channel: its link token, which only its reverse channel may echo.
            features |= p.FEATURE_TOKEN
            proof += secrets.token_bytes(p.LINK_TOKEN_BYTES)
        return p.Welcome(self.config.cluster_id, self.role, ident.pid, ident.pid_ns,
                         ident.boot_id, features, proof)

    def check_auth(self, hello: p.Hello, welcome: p.Welcome, proof: bytes) -> None:
        secret = self.config.secret
        parts = auth.split_server_proof(p.split_token(welcome.proof, welcome.features)[0])
        if secret is None or parts is None:
            raise LinkFailed("no challenge was issued")
        nonce = p.split_token(hello.proof, hello.features)[0]
        want = auth.client_proof(secret, nonce, parts[0], self.config.cluster_id,
                                 hello.cluster_id)
        if not auth.same(want, proof):
            raise LinkFailed(f"cluster {hello.cluster_id} failed to prove the shared secret")

    def on_peer_ready(self, peer: PeerInfo) -> None:
        """The handshake (and authentication, when required) succeeded: only now is the
        peer an inbound link (switch_role, the two-sided link's connected-back step)."""
        with self._lock:
            if not self._closed:
                self._inbound[peer.key] = peer
                self._hellos[peer.cluster_id] = self._hellos.get(peer.cluster_id, 0) + 1
                if peer.token:
                    self._tokens[peer.key] = (peer.cluster_id, peer.token)

    def _serving(self, op: str, peer: PeerInfo, open_: Callable[[], Lease]) -> Lease:
        """Open a lease for a peer's request, counted in the metrics as ``op`` (``serve_read``,
        ``serve_write``) for that peer: a refusal now, the outcome when the lease ends."""
        t0 = time.perf_counter()
        try:
            lease = open_()
        except DatadistError as e:
            metrics.PROCESS.record(op, peer.cluster_id, 0, time.perf_counter() - t0,
                                   Code(e.code).status_name)
            raise
        lease.served = (op, peer.cluster_id, t0)
        return lease

    def _served(self, lease: Lease, ok: bool) -> None:
        """A served request ended (once per lease): its bytes, or LLM_FAILED."""
        if lease.served is None:
            return
        op, cluster_id, t0 = lease.served
        lease.served = None
        metrics.PROCESS.record(op, cluster_id, lease.nbytes if ok else 0,
                               time.perf_counter() - t0, None if ok else "LLM_FAILED")

    def open_read(self, peer: PeerInfo, msg: p.Read) -> Lease:
        """Check a read and lease what it names (counted as ``serve_read``)."""
        return self._serving("serve_read", peer, lambda: self._open_read(peer, msg))

    def _open_read(self, peer: PeerInfo, msg: p.Read) -> Lease:
        """A GRANT (the reader copies from our memory itself) only for a peer the kernel
        verified on this host, allowed to read us, and within MAX_GRANTS_PER_PEER: nobody
        else learns our addresses."""
        whole = bool(msg.flags & p.ReadFlags.WHOLE)
        if not msg.flags & p.ReadFlags.GRANT:
            lease = self.registry.open(msg.key, msg.unit_bytes, msg.tensors, msg.offsets,
                                       msg.lengths, layout=msg.layout, whole=whole)
            self._check_own_memory(lease, "read", read=True)
            return lease
        pid = self._take_grant(peer)
        try:
            lease = self.registry.open(msg.key, msg.unit_bytes, msg.tensors, msg.offsets,
                                       msg.lengths, layout=msg.layout,
                                       shm=bool(msg.flags & p.ReadFlags.SHM), whole=whole)
        except BaseException:
            self._drop_grant(pid)
            raise
        lease.grantee = pid
        if lease.shm is None and self.config.allow_ptrace and PTRACER.acquire(id(self)):
            log.info("same-host readers: %s", PTRACER.state)  # the first cma grant
        return lease

    def lease_cache(self, peer: PeerInfo, msg: p.LeaseRequest) -> p.CacheLease:
        """A whole-cache lease (same host, local channel only, as grants): the reader then
        checks and copies its reads of that cache itself, fenced (Registry.lease_cache).
        Counted as ``serve_lease``; the reads under it are counted by the reader only."""
        t0 = time.perf_counter()
        try:
            cred = peer.local
            if cred is None or not cred.may_read_us():
                raise InvalidArgument("cache leases are granted only on the local channel, to "
                                      "peers allowed to read this process's memory")
            write = bool(msg.flags & p.LEASE_WRITE)
            if write and not self.config.remote_cache_accessible:
                raise InvalidArgument(
                    "this owner runs without enable_remote_cache_accessible: writes by key or "
                    "cache id are refused")
            entry, fence = self.registry.lease_cache(msg.key)
        except DatadistError as e:
            metrics.PROCESS.record("serve_lease", peer.cluster_id, 0, time.perf_counter() - t0,
                                   Code(e.code).status_name)
            raise
        shm = entry.shm is not None and bool(msg.flags & p.ReadFlags.SHM) and not write
        if not shm and self.config.allow_ptrace and PTRACER.acquire(id(self)):
            log.info("same-host readers: %s", PTRACER.state)  # the first cma lease
        metrics.PROCESS.record("serve_lease", peer.cluster_id, 0, time.perf_counter() - t0)
        g = entry.geometry
        if shm and entry.shm is not None:
            fds, inos, offs = entry.shm
        else:
            fds, inos, offs = (np.empty(0, np.int32), np.empty(0, np.uint64),
                               np.empty(0, np.uint64))
        return p.CacheLease(entry.cache_id, g.tensor_bytes, g.units, g.is_blocks, g.layout,
                            fence.fd, fence.ino, entry.addrs, fds, inos, offs)

    def _take_grant(self, peer: PeerInfo) -> int:
        cred = peer.local
        if cred is None:
            raise InvalidArgument("same-host reads (GRANT) are served only on the local "
                                  "channel, to peers the kernel verified on this host")
        if not cred.may_read_us():
            raise InvalidArgument(f"pid {cred.pid} (uid {cred.uid}) may not read this "
                                  "process's memory: read without GRANT")
        with self._lock:
            held = self._grants.get(cred.pid, 0)
            if held >= MAX_GRANTS_PER_PEER:
                raise Busy(f"pid {cred.pid} holds {held} grants not released yet")
            self._grants[cred.pid] = held + 1
        return cred.pid

    def _drop_grant(self, pid: int) -> None:
        with self._lock:
            left = self._grants.get(pid, 0) - 1
            if left > 0:
                self._grants[pid] = left
            else:
                self._grants.pop(pid, None)

    def close_read(self, lease: Lease, ok: bool) -> None:
        self._served(lease, ok)
        got = self._nixl_leases.pop(id(lease), None) if self._nixl_leases else None
        if got is not None:  # a NIXL read or write (open_nixl)
            peer_key, fresh, write = got
            self.registry.close(lease, ok, consume=not write)
            if ok:
                self._nixl_wired.add(peer_key)
            self.nixl.pump_release(fresh)
            return
        try:
            self.registry.close(lease, ok)
        finally:
            if lease.grantee:
                self._drop_grant(lease.grantee)

    def sent_read(self, lease: Lease) -> None:
        """The bytes of a read are sent; its verdict (settle_read) comes later."""
        self._served(lease, True)
        self.registry.unlease(lease)

    def settle_read(self, lease: Lease, ok: bool) -> None:
        self.registry.settle(lease, ok)

    def nixl_refusal(self) -> str | None:
        """Why this process serves no NIXL peer (None: it does). NIXL hands a peer memory
        keys it uses without asking us, so serving is consent, given by options only:
        datadist.NixlServe (off by default); enable_remote_cache_accessible (a NIXL
        registration cannot be made read-only: an owner that refuses writes cannot serve
        NIXL); and datadist.NixlAllowWholeProcessAccess, on every UCX transport (RDMA verbs
        too: UCX's software RMA emulation serves any address; transport/nixl.py,
        whole_process_reach).
        Asked on every NIXL request (NixlMdRequest, NixlRead, NixlWrite, NixlLease) and by
        ``datadist info``; never blocks."""
        if not self.config.nixl_serve:
            return "this owner does not serve NIXL (datadist.NixlServe / DATADIST_NIXL_SERVE)"
        if not self.config.remote_cache_accessible:
            return ("this owner refuses remote writes (enable_remote_cache_accessible off) and "
                    "NIXL registrations cannot be made read-only: it does not serve NIXL")
        return self._nixl_unchecked()

    def _nixl_unchecked(self) -> str | None:
        """Why NIXL here would let a peer reach this whole process without the operator's
        leave (datadist.NixlAllowWholeProcessAccess), or None where that leave is given."""
        if self.config.nixl_whole_process:
            return None
        from datadist.transport.nixl import whole_process_reach

        return (f"{whole_process_reach()}: a NIXL peer could read and write this whole process; "
                "not without datadist.NixlAllowWholeProcessAccess "
                "(DATADIST_NIXL_ALLOW_WHOLE_PROCESS_ACCESS)")

    def _serving_nixl(self) -> Any:
        """Our NIXL agent for a NIXL request, created if need be. Checked on every request:
        NotSupported (the reader then uses TCP) where :meth:`nixl_refusal` says no or NIXL
        is not installed."""
        if self._closed:
            raise Closed("finalized")
        why = self.nixl_refusal()
        if why is not None:
            raise NotSupported(why)
        try:
            return self.ensure_nixl()
        except InvalidArgument as e:
            raise NotSupported(str(e)) from None

    def nixl_metadata(self) -> p.NixlMd:
        md: p.NixlMd = self._serving_nixl().metadata()
        return md

    def open_nixl(self, peer: PeerInfo, msg: p.NixlRead | p.NixlWrite, lease_id: int
                  ) -> tuple[Lease, p.NixlGrant]:
        """The owner's side of a NIXL pull or push: the key is resolved and the spans are
        checked (registry.open) before anything NIXL sees them; the grant names our agent.
        A write lease never consumes its key (as open_write)."""
        # A reader may come back to a restarted owner without asking for metadata first:
        # the grant names the new agent, and the reader loads it then.
        nixl = self._serving_nixl()
        write = isinstance(msg, p.NixlWrite)

        def open_() -> Lease:
            if write:  # the rules of _open_write: the data path does not change them
                self._check_writable(msg.key)
            return self.registry.open(msg.key, msg.unit_bytes, msg.tensors, msg.offsets,
                                      msg.lengths, layout=msg.layout, read=not write,
                                      whole=bool(msg.flags & p.ReadFlags.WHOLE))

        lease = self._serving("serve_write" if write else "serve_read", peer, open_)
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
        self._nixl_leases[id(lease)] = (peer.key, fresh, write)
        nixl.pump_acquire(fresh)
        # The client adds its offsets to the bases; raw-address offsets are absolute already.
        bases = (np.zeros(len(msg.tensors), np.uint64) if msg.key.kind == p.KeyKind.ADDRESS
                 else lease.bases)
        return lease, p.NixlGrant(lease_id, nixl.name.encode(), nixl.generation, mem, dev,
                                  bases)

    def open_nixl_lease(self, peer: PeerInfo, msg: p.NixlLease,
                        drop: Callable[[], None]) -> p.NixlLeased:
        """See :meth:`_open_nixl_lease`; counted as ``serve_lease`` (the reads under it are
        counted by the reader only)."""
        t0 = time.perf_counter()
        try:
            got = self._open_nixl_lease(peer, msg, drop)
        except DatadistError as e:
            metrics.PROCESS.record("serve_lease", peer.cluster_id, 0, time.perf_counter() - t0,
                                   Code(e.code).status_name)
            raise
        metrics.PROCESS.record("serve_lease", peer.cluster_id, 0, time.perf_counter() - t0)
        return got

    def _open_nixl_lease(self, peer: PeerInfo, msg: p.NixlLease,
                         drop: Callable[[], None]) -> p.NixlLeased:
        """A read lease on a whole cache for a NIXL reader (docs/protocol.md, "NIXL leases"):
        resolved and checked as a NixlRead of the whole cache, pinned like any lease until we
        revoke it on the reader's reverse channel (unregister, deallocate, a blocks model id
        registered again, finalize) or the connection ends. ``drop`` shuts the connection
        down: what a revoke the reader does not answer comes to."""
        nixl = self._serving_nixl()
        with self._lock:
            rev = self._reverse.get(peer.cluster_id)
        # The reverse channel of this very connection (the token it echoed): a connection
        # that only claims the reader's cluster id, pid and boot id gets no lease revoked on
        # another's channel.
        if rev is None or rev.chan.closed or rev.welcome.pid != peer.pid \
                or rev.welcome.boot_id != peer.boot_id \
                or not hmac.compare_digest(rev.token, peer.token):
            raise NotSupported("no reverse channel from this reader to revoke a lease on: "
                               "read by request")
        with self._nixl_lock:
            held = sum(1 for h in self._nixl_held.values() if h.peer == peer.key)
        if held >= MAX_NIXL_LEASES_PER_PEER:
            raise NotSupported(f"this reader holds {held} NIXL leases already: read by request")
        key = msg.key
        whole = (p.KeyRef(key.kind, key.a, 0, 0) if key.kind == p.KeyKind.CACHE_ID
                 else p.KeyRef(key.kind, 0, key.b, 0))
        epoch = self._nixl_epoch
        # Pins the whole cache; the span (its first byte) only has to pass the checks, which
        # refuse spans of 0 bytes (issue 21 item 2).
        lease = self.registry.open(whole, msg.unit_bytes, np.zeros(1, np.uint32),
                                   np.zeros(1, np.uint64), np.ones(1, np.uint64))
        lease_id = next(self._nixl_lease_ids)
        try:
            entry, g = lease.entry, lease.entry.geometry
            with self._nixl_lock:
                mem, dev = nixl.grant_info(entry.addrs, g.tensor_bytes)
                if self._closed or entry.cache_id in self._nixl_closing or (
                        key.kind == p.KeyKind.BLOCKS_KEY and epoch != self._nixl_epoch):
                    raise CacheNotFound(f"cache {entry.cache_id} is going: read by request")
                self._nixl_held[lease_id] = _CacheLease(lease, peer.key, peer.cluster_id,
                                                        peer.pid, drop)
        except BaseException:
            self.registry.close(lease, False, consume=False)
            raise
        nixl.pump_acquire(False)  # a lease is asked for only after a completed NIXL read
        return p.NixlLeased(lease_id, nixl.name.encode(), nixl.generation, mem, dev,
                            key.kind == p.KeyKind.BLOCKS_KEY, g.tensor_bytes, g.unit_bytes,
                            g.units, g.layout, entry.addrs)

    @contextlib.contextmanager
    def _nixl_revoking(self, cache_id: int) -> Iterator[None]:
        """Around unregister / deallocate: no new NIXL lease on the cache, the readers'
        leases revoked (each reader answers once its reads under it are done)."""
        if not self._nixl_held:
            yield
            return
        with self._nixl_lock:
            self._nixl_closing.add(cache_id)
        try:
            self._nixl_revoke(lambda held: held.lease.entry.cache_id == cache_id)
            yield
        finally:
            with self._nixl_lock:
                self._nixl_closing.discard(cache_id)

    def _nixl_model_moved(self, model_id: int | None, entry: CacheEntry) -> None:
        """A blocks model id now names ``entry``: leases on the cache it named go."""
        if model_id is None:
            return
        with self._nixl_lock:
            self._nixl_epoch += 1
        self._nixl_revoke(lambda held: held.lease.entry is not entry
                          and held.lease.entry.blocks_model_id == model_id)

    def _nixl_revoke(self, pick: Callable[[_CacheLease], bool]) -> None:
        """Revoke the NIXL cache leases ``pick`` selects: NixlRevoke on each reader's reverse
        channel, answered once no read under it is in flight. A reader that does not answer
        within NIXL_REVOKE_WAIT (stopped, gone, its reverse channel down) has its connection
        shut down: its reads then fail (it checks the connection after each leased read)."""
        by_reader: dict[tuple[int, str], list[tuple[int, _CacheLease]]] = {}
        with self._nixl_lock:
            for i, held in self._nixl_held.items():
                if pick(held):
                    by_reader.setdefault(held.peer, []).append((i, held))
        # One deadline per reader, the readers at once: a reader that answers each revoke
        # just in time cannot make unregister or finalize wait NIXL_REVOKE_WAIT once per lease
        # it took, nor make another reader run out of time.
        if not by_reader:
            return
        deadline = time.monotonic() + NIXL_REVOKE_WAIT
        with ThreadPoolExecutor(len(by_reader), thread_name_prefix="datadist-nixl-revoke") as pool:
            list(pool.map(lambda doomed: self._nixl_revoke_reader(doomed, deadline),
                          by_reader.values()))  # list(): a reader's unexpected error is raised

    def _nixl_revoke_reader(self, doomed: list[tuple[int, _CacheLease]],
                            deadline: float) -> None:
        for lease_id, held in doomed:
            with self._lock:
                rev = self._reverse.get(held.cluster_id)
            try:
                if rev is None or rev.welcome.pid != held.pid:
                    raise BrokenLink("the reader's reverse channel is gone")
                if time.monotonic() >= deadline:
                    raise Timeout("the revoke's time is spent")
                rev.run(deadline, functools.partial(_revoke, p.NixlRevoke(lease_id), deadline))
            except DatadistError as e:
                gone = rev is None or rev.chan.closed or rev.closing
                log.log(logging.INFO if gone else logging.WARNING,
                        "NIXL lease %d of cluster %d not given back (%s): its connection is "
                        "shut down", lease_id, held.cluster_id, e)
                held.drop()
            self._nixl_end(lease_id)

    def _nixl_end(self, lease_id: int) -> None:
        with self._nixl_lock:
            held = self._nixl_held.pop(lease_id, None)
        if held is not None:
            self.registry.close(held.lease, False, consume=False)
            self.nixl.pump_release(False)

    def nixl_revoke(self, peer: PeerInfo, msg: p.NixlRevoke) -> None:
        """Reader side: the owner ``peer`` revokes a lease (on our reverse channel). Returns
        once no read under it is in flight and none will start; Timeout if one still is."""
        with self._lock:
            link = self._links.get(peer.cluster_id)
        revoke = getattr(link.path, "revoke", None) if link is not None else None
        if revoke is not None and not revoke(msg.lease_id, NIXL_REVOKE_WAIT):
            raise Timeout(f"a NIXL read under lease {msg.lease_id} is still in flight")

    def open_write(self, peer: PeerInfo, msg: p.Write) -> Lease:
        """Check a peer's write into our memory and lease it (counted as ``serve_write``)."""
        return self._serving("serve_write", peer, lambda: self._open_write(msg))

    def _check_writable(self, key: p.KeyRef) -> None:
        if not self.config.remote_cache_accessible and key.kind != p.KeyKind.ADDRESS:
            raise InvalidArgument(
                "this owner runs without enable_remote_cache_accessible: writes by key or "
                "cache id are refused"
            )

    def _open_write(self, msg: p.Write) -> Lease:
        self._check_writable(msg.key)
        lease = self.registry.open(msg.key, msg.unit_bytes, msg.tensors, msg.offsets,
                                   msg.lengths, layout=msg.layout, read=False)
        self._check_own_memory(lease, "write", read=False)
        return lease

    def _check_own_memory(self, lease: Lease, what: str, *, read: bool) -> None:
        """Before we stream a peer's request from or into our memory ourselves: memory a user
        registered may have been freed behind our back since (a caller's bug, but the peer
        must get an error frame, not a connection cut mid-answer). The first and last byte of
        each tensor the request touches are probed, one system call; pool memory is ours and
        skips it. Raises DEVICE_MEM_ERROR (the lease closed, nothing consumed)."""
        entry = lease.entry
        if entry.owned:
            return
        bases = entry.addrs[lease.tensors].tolist()  # Python ints: usually a few
        last = entry.geometry.tensor_bytes - 1
        probes = bases + [b + last for b in bases]
        bad = mapped.first_unreadable(probes)
        if bad is None:
            return
        tensor = int(lease.tensors[bad % len(bases)])
        if read:
            self.registry.close(lease, False)
        else:
            self.registry.close(lease, False, consume=False)
        log.error("cache %d: tensor %d's memory at %#x is not mapped any more (freed after "
                  "register_cache?); a peer's %s of it is refused", entry.cache_id, tensor,
                  int(probes[bad]), what)
        raise DatadistError(f"the owner's memory of cache {entry.cache_id} tensor {tensor} is "
                            "not mapped any more (freed after it was registered)",
                            code=Code.DEVICE_MEM_ERROR)

    def close_write(self, lease: Lease, ok: bool) -> None:
        self._served(lease, ok)
        self.registry.close(lease, ok, consume=False)

    def on_bye(self, peer: PeerInfo) -> None:
        """The linker unlinked politely: its reverse channel goes with its control channel."""
        with self._lock:
            self._inbound.pop(peer.key, None)
            self._tokens.pop(peer.key, None)
            inbound = self._reverse.get(peer.cluster_id)
            # Its own reverse channel (the token this channel issued), or one whose control
            # channel is gone (the linker reconnected it) if the Hellos name one process: a
            # stranger's control channel of that id cannot end a live link by claiming a pid.
            if inbound is not None and (
                    (peer.token and hmac.compare_digest(inbound.token, peer.token))
                    or (inbound.welcome.pid == peer.pid
                        and inbound.welcome.boot_id == peer.boot_id
                        and not self._token_live(peer.cluster_id, inbound.token))):
                del self._reverse[peer.cluster_id]
            else:
                inbound = None
        if inbound is not None:
            inbound.close()

    def adopt_reverse(self, peer: PeerInfo, chan: object) -> Callable[[], None]:
        """A linker's reverse channel arrived (the listener's end of its link): register it
        as the link to ``peer.cluster_id`` for transfers from this side, if its Hello echoed
        the link token of a live control channel of that cluster (the peer that linked;
        compared in constant time). A newer one replaces a live old one only if it echoes
        the old one's token, the control channel that token belongs to is gone, or the old
        one does not answer a Ping within REVERSE_PROBE s (its linker's channels died unseen,
        a cut wire): another control channel of that id (anyone may open one) cannot take a
        live link. Blocks up to REVERSE_PROBE s in that last case. Returns
        the release of the link's lock, held until the serving thread has sent the
        handshake's last frame. Raises LinkFailed (no such token, a live reverse channel of
        another live control channel, as many reverse channels as ``max_connections``
        already, or ``max_connections_per_peer`` from its address, or finalizing): the
        serving thread answers the Hello's handshake with that error, and the linker's link
        fails with LLM_LINK_FAILED."""
        assert isinstance(chan, Channel)
        welcome = p.Welcome(peer.cluster_id, peer.role, peer.pid, peer.pid_ns, peer.boot_id)

        def cannot_reconnect(deadline: float) -> Connected:
            raise LinkFailed(f"cluster {peer.cluster_id} closed its link to us; it is "
                             "re-opened only when that cluster links again")

        # The reverse channel is a TCP connection the peer opened: its bytes carry every
        # transfer (the peer grants direct reads only on its local channel, to peers the
        # kernel verified there).
        link = Link(peer.cluster_id, *split_address(peer.address), chan, welcome, TcpPath(),
                    "inbound, over the peer's reverse channel", cannot_reconnect, inbound=True,
                    token=peer.token)
        with self._lock:
            if self._closed:
                raise LinkFailed("this listener is finalizing: it takes no reverse channel")
            if not self._holds_token(peer):
                raise LinkFailed(
                    f"a reverse channel for cluster {peer.cluster_id} must come from the peer "
                    "holding that cluster's control channel to us (its link token)")
            if (peer.cluster_id not in self._reverse
                    and len(self._reverse) >= self.config.max_connections):
                self._prune_reverse()  # closed ones do not count
            if (peer.cluster_id not in self._reverse
                    and len(self._reverse) >= self.config.max_connections):
                raise LinkFailed(f"too many reverse channels ({len(self._reverse)}) to this "
                                 "listener")
            # ... and max_connections_per_peer from one address, like connections: one host
            # (closing each control channel once its reverse channel is up) cannot fill the
            # table and so refuse every other peer's link.
            if self._reverse_from(link.host, peer.cluster_id) >= \
                    self.config.max_connections_per_peer:
                self._prune_reverse()
            held = self._reverse_from(link.host, peer.cluster_id)
            if held >= self.config.max_connections_per_peer:
                raise LinkFailed(f"too many reverse channels ({held}) from {link.host} to "
                                 "this listener")
            old = self._reverse.get(peer.cluster_id)
            contested = (old is not None and not _reverse_gone(old)
                         and not hmac.compare_digest(old.token, peer.token)
                         and self._token_live(peer.cluster_id, old.token))
        if contested and old is not None and _answers_ping(old, peer.cluster_id):
            # Another control channel of that id (a stranger may open one: the id is only a
            # claim) must not take a live link from the one it belongs to.
            raise LinkFailed(
                f"cluster {peer.cluster_id} already has a reverse channel to this "
                "listener, belonging to another of its control channels, which is live")
        with self._lock:
            if self._closed:
                raise LinkFailed("this listener is finalizing: it takes no reverse channel")
            if self._reverse.get(peer.cluster_id) is not old:  # another adoption meanwhile
                raise LinkFailed(f"cluster {peer.cluster_id} linked again meanwhile")
            link.lock.acquire()
            self._reverse[peer.cluster_id] = link
        if old is not None:
            old.close()
        log.debug("link.inbound %r", link)
        return link.lock.release

    def _reverse_from(self, host: str, cluster_id: int) -> int:
        """How many reverse channels of other clusters than ``cluster_id`` came from
        ``host`` (self._lock held)."""
        return sum(1 for cid, link in self._reverse.items()
                   if link.host == host and cid != cluster_id)

    def _holds_token(self, peer: PeerInfo) -> bool:
        """``peer.token`` is the link token of a live control channel of ``peer.cluster_id``
        (self._lock held)."""
        return self._token_live(peer.cluster_id, peer.token)

    def _token_live(self, cluster_id: int, token: bytes) -> bool:
        """``token`` is the link token of a live control channel of ``cluster_id``
        (self._lock held). Every candidate is compared, in constant time."""
        ok = False
        for cid, live in self._tokens.values():
            if cid == cluster_id:
                ok |= hmac.compare_digest(live, token)
        return ok and len(token) == p.LINK_TOKEN_BYTES

    def on_disconnect(self, peer: PeerInfo) -> None:
        with self._lock:
            self._inbound.pop(peer.key, None)
            self._tokens.pop(peer.key, None)
        self._nixl_wired.discard(peer.key)
        if self._nixl_held:
            with self._nixl_lock:
                gone = [i for i, held in self._nixl_held.items() if held.peer == peer.key]
            for lease_id in gone:  # the connection is gone, and with it the reader's lease
                self._nixl_end(lease_id)

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
                  reverse: bool = True, as_announced: bool = False) -> Link:
        """Connect and check the peer exactly as :meth:`link`, but do not register the link
        (transfers cannot use it yet): :meth:`adopt_link` does. With ``reverse`` (and a peer
        that takes them) also open the reverse channel and serve the peer's requests on it,
        so that the peer can use the link too. ``as_announced``: see :meth:`link`; reconnects
        then expect the id first announced. Blocks <= timeout."""
        self._check_open()
        expect: int | None = None if as_announced else cluster_id

        def greet_tcp(deadline: float) -> tuple[Channel, p.Welcome]:
            got = connect(host, port, expect, self._hello, self.config.secret, deadline,
                          self._tls_client, PathKind.TCP, self.identity)
            return got.chan, got.welcome

        def connect_(deadline: float) -> Connected:
            """On every connect and reconnect: the path chosen anew; NIXL's metadata
            loaded over the fresh channel (a peer without NIXL gets tcp)."""
            got = connect(host, port, expect, self._hello, self.config.secret, deadline,
                          self._tls_client, self.forced, self.identity, self.nixl)
            if got.path.caps.name != "nixl":
                return got
            unchecked = self._nixl_unchecked()
            if unchecked is not None:  # our UCX would serve the owner anything of ours
                got.path.close()
                log.warning("nixl forced but not usable here (%s); using tcp", unchecked)
                return Connected(got.chan, got.welcome, TcpPath(),
                                 f"nixl forced but not usable here: {unchecked}")
            chan, welcome, path, reason = _connect_nixl(got.path, got.chan, greet_tcp, deadline,
                                                        got.welcome)
            return Connected(chan, welcome, path, reason)

        deadline = time.monotonic() + timeout
        chan, welcome, path, reason = connect_(deadline)
        expect = welcome.cluster_id
        link = Link(expect, host, port, chan, welcome, path, reason, connect_)
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
        # A TCP channel: the peer reads and writes our memory through its bytes (grants, and
        # so cross-memory attach, are served only on the local channel).
        # It proves it comes from us with the token the peer issued our control channel
        # (the one live now: after a move to the local channel, that channel's).
        token = p.split_token(link.welcome.proof, link.welcome.features)[1]
        chan, welcome = greet(link.host, link.port, link.cluster_id,
                              lambda: self._hello(reverse=True, token=token),
                              self.config.secret, deadline, self._tls_client)
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


__all__ = ["DEVICE", "HOST", "Engine", "EngineConfig", "PathKind"]
