"""The engine: the Python API over the C++ core (``datadist._core``).

Who calls: ``LLMDataDist.init`` creates one :class:`NativeEngine` per instance
(:func:`engine_for`); the facade (``datadist/api``) calls it for caches, links, pull / push
and their asynchronous forms. It is the only engine: the C++ API (``llm_datadist.h``) runs on
the same core, so both APIs share one implementation of every protocol rule.

What runs where: the facade checks arguments and plans transfers (``core/layout.py``); the
core's registry (cpp/src/registry.h) is the only one: it numbers every cache this module
files there, binds its keys and model id, holds it for local transfers, consumes keys when
peers read them; this module asks it (:meth:`NativeEngine.cache`) and keeps no copy. The
pools are the core's too (cpp/src/pool.h): its registry carves pool caches and gives their
pages back itself once nothing holds them. Accepting, handshakes, peers' requests, reverse
channels, same-host grants, NIXL and leases run on the core's native threads and never take
the GIL; a pull or push issued here releases the GIL for its whole duration; asynchronous ones
run on the core's fixed set of workers and are polled without the GIL. The core raises
datadist's own error classes (``datadist.core.errors``), chosen by its binding from one
code-to-class table (cpp/python/module.cc, ``PyError``).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from datadist.core import keys as p  # p.KeyRef, p.ReadFlags
from datadist.core import metrics, native_build
from datadist.core.config import DEVICE, HOST, OPT_TRANSPORT, EngineConfig, HostIdentity, PathKind
from datadist.core.errors import (
    AlreadyLinked,
    Closed,
    DatadistError,
    DeviceOutOfMemory,
    InvalidArgument,
    NotLinked,
    NotSupported,
    OutOfMemory,
)
from datadist.core.keys import KeyId
from datadist.core.layout import Geometry, Plan
from datadist.core.options import parse_options
from datadist.core.prepared import KEPT, SMALL_REQUEST, Prepared
from datadist.memory import shared

if TYPE_CHECKING:  # the core's types, from its generated stub (src/datadist/_core/*.pyi)
    from datadist._core import Call, Engine, Handle, LayerRun, PendingLink, PlannedPulls, UserCache

log = logging.getLogger("datadist.native")

UNREGISTER_WAIT = 30.0  # s an unregister waits for peers' transfers of the cache
CLOSE_WAIT = 5.0  # s finalize waits for them
ASYNC_THREADS = 4  # the core's workers for asynchronous transfers, whatever their number


def core_module() -> ModuleType | None:
    """``datadist._core``; None when it is not built or does not load (:func:`available`
    says why). For tests and tools: the engine imports the module itself once this says it
    loads (``from datadist import _core``), so that mypy reads its stub."""
    if native_build.native_available()[0]:
        return importlib.import_module(native_build.MODULE)
    return None


def available() -> tuple[bool, str]:
    """Is the native core importable here, and if not why (for ``datadist info``)."""
    return native_build.native_available()


def tls_available() -> tuple[bool, str]:
    """Does the built core have TLS (OpenSSL found when it was built), and which OpenSSL or
    why not. ``(False, why)`` when the core is not built. For :func:`refusal` and
    ``datadist info``; returns at once."""
    if core_module() is None:
        return False, available()[1]
    from datadist import _core as mod

    has, what = mod.tls()
    return bool(has), str(what)


def cuda_device(addr: int) -> int | None:
    """The CUDA device whose memory ``addr`` is (device or managed memory), or None: host
    memory, no CUDA runtime on this host, or no core. Who calls: registration of a
    DEVICE-placed cache whose range is not mapped readable and writable in this process (GPU
    memory is not), through :func:`datadist.memory.mapped.check_ranges`. May load the CUDA
    runtime on its first call; does not hold the GIL while asking it."""
    if core_module() is None:
        return None
    from datadist import _core as mod

    return mod.cuda_device(addr)


def refusal(config: EngineConfig) -> str | None:
    """What in ``config`` this host's core cannot run (None: it can): TLS where the core
    was built without OpenSSL. Returns at once; :func:`engine_for` raises with it."""
    if config.tls is not None:
        has, what = tls_available()
        if not has:
            return f"TLS (datadist.TlsCert...) needs a core built with OpenSSL 3: {what}"
    return None


def load_nixl(library: str = "") -> str | None:
    """Hand the installed NIXL to the core (``_core.nixl_load``), once per process, with the
    environment NIXL needs here (core/nixl_wheel.py: UCX's ib module kept out
    where the host has no RDMA device): ``library`` (``datadist.NixlLibrary``) when given,
    else the nixl-cu12 wheel's. Returns why NIXL cannot be used, None once loaded.
    Called by :class:`NativeEngine` when it serves NIXL; blocks while NIXL loads."""
    from datadist import _core as mod
    from datadist.core import nixl_wheel as nixl

    lib = library or nixl.library()
    if lib is None:
        return "NIXL is not installed: pip install 'datadist[nixl]' (the nixl-cu12 wheel)"
    nixl._skip_unusable_ib()
    ok, why = mod.nixl_load(lib)
    return None if ok else str(why)


@dataclass(frozen=True, eq=False)
class CacheEntry:
    """One of the core's caches as it was filed: what the facade plans with. A snapshot the
    core's registry gives (:meth:`NativeEngine.cache`, and register / allocate return one);
    nothing keeps it in step, and nothing needs to: a cache's id, geometry and addresses never
    change while it is filed, and the core never reuses an id."""

    cache_id: int
    geometry: Geometry
    addrs: np.ndarray  # uint64, base address of each tensor (read-only)
    owned: bool  # allocated from a pool (True) or registered user memory (False)
    placement: int = HOST
    remote_accessible: bool = True

    def __repr__(self) -> str:
        g = self.geometry
        kind = "blocks" if g.is_blocks else "cache"
        return (f"<CacheEntry {kind} id={self.cache_id} tensors={g.num_tensors} "
                f"units={g.units} unit_bytes={g.unit_bytes} owned={self.owned}>")


def _wire_keys(keys: Sequence[KeyId | None]) -> list[tuple[int, int, bool] | None]:
    """The core's form of a cache's keys, slot by slot: (value, model_id, is_prefix) or None
    (the padding key)."""
    return [None if k is None else (k.value, k.model_id, k.is_prefix) for k in keys]


@dataclass(frozen=True)
class NativeLink:
    """What the facade and tools see of a link of the native engine (a snapshot). Two
    snapshots are equal when they show the same link: the same cluster id, end and core link
    (``serial``, which the core never reuses), whatever its path and reason then; a link that
    replaced another under the same id compares unequal."""

    cluster_id: int
    path_name: str = field(compare=False)
    inbound: bool = False
    reason: str = field(default="", compare=False)
    serial: int = 0  # the core's Link::serial (0: not known)

    @property
    def path(self) -> str:
        return self.path_name


@dataclass(frozen=True)
class Listening:
    """Where the core listens (``engine.listener`` for the facade and tools)."""

    host: str
    port: int


class NativeListener:
    """A listener of the native engine beside its main one (:meth:`NativeEngine.make_listener`)."""

    def __init__(self, core: Engine, key: int, host: str, port: int) -> None:
        self._core, self._key = core, key
        self.host, self.port = host, port

    def close(self) -> None:
        self._core.stop_also(self._key)


class NativeHandle:
    """An asynchronous transfer of the native engine: the core's handle. The core holds the
    local cache from the submit until the transfer ends (Session::Submit: the task owns the
    hold), so unregistering or deallocating it waits for the transfer, polled or not.
    ``done`` never blocks; ``wait`` blocks without the GIL. The core counts the transfer in its
    metrics when it ends, polled or not."""

    def __init__(self, handle: Handle, op: str, cluster_id: int) -> None:
        self._handle = handle
        self._op, self._cluster_id = op, cluster_id

    def __repr__(self) -> str:
        state = "running" if not self._handle.done() else f"ended: {self.error()!r}"
        return f"<NativeHandle {self._op} cluster {self._cluster_id} {state}>"

    def done(self) -> bool:
        return bool(self._handle.done())

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block (without the GIL) up to ``timeout_s`` seconds, None: until it ends."""
        if timeout_s is None:
            while not self._handle.wait(3600.0):
                pass
            return True
        return bool(self._handle.wait(max(0.0, timeout_s)))

    def error(self) -> DatadistError | None:
        err = self._handle.error()
        return err  # the core's error class for its code


# Session::PreparePull's kinds of pull (PullSpec::Kind, cpp/src/plan.h).
PULL_SLOT, PULL_BLOCKS, PULL_SLOT_TO_BLOCKS = 0, 1, 2
LAYER_SLOT, LAYER_BLOCKS, LAYER_SLOT_TO_BLOCKS = 0, 1, 2  # prepare_layer_pushes kinds
_NO_BLOCKS = np.zeros(0, dtype=np.uint64)
_U64 = 2**64 - 1
_NO_BLOCKS.flags.writeable = False


class NativeEngine:
    """The engine the facade calls (caches, links, pull / push and their asynchronous
    forms), run by the C++ core. Created by ``LLMDataDist.init``, closed by ``finalize``."""

    def __init__(self, config: EngineConfig) -> None:
        if core_module() is None:
            raise InvalidArgument(available()[1])
        from datadist import _core as mod
        self.config = config
        self._closed = False
        self._lock = threading.Lock()
        # the facade's planned pulls (planned_pulls), closed with the engine
        self._planned: weakref.WeakSet[PlannedPulls] = weakref.WeakSet()
        self._listen: tuple[str, int] | None = None
        # the core's prepared transfers, by (plan, local cache id, cluster, key, unit bytes,
        # write): a repeated pull converts nothing (a plan is compared by identity). Safe
        # whatever happens to the cache: every run holds it in the core and refuses one that
        # is gone or no longer the memory the call was made for (Session::Run).
        self._calls: Prepared[Call] = Prepared(KEPT, lambda call: int(call.spans))
        # transfer_cache_async's calls of one destination's layers (prepare_layer_pushes), by
        # its whole spec: a model's next transfer of the same layers prepares nothing.
        self._layer_calls: Prepared[list[Call]] = Prepared(
            KEPT, lambda calls: sum(int(call.spans) for call in calls))
        self._core_module = mod
        self._core = mod.Engine(config.cluster_id, config.role, ASYNC_THREADS)
        self._core.set_model_map(True)  # BlocksCacheKey model ids name caches (bind_model)
        self._core.set_remote_writes(config.remote_cache_accessible)
        try:
            # A config made without LLMDataDist.init (tools, tests) leaves the transport to
            # the table's variable and default.
            forced = config.transport or str(
                parse_options({})[OPT_TRANSPORT][0])
            if (forced == PathKind.NIXL or config.nixl_serve) \
                    and (why := load_nixl(config.nixl_library)) is not None:
                if forced == PathKind.NIXL:  # a reader without NIXL: init fails, saying why
                    raise InvalidArgument(f"transport 'nixl' needs NIXL: pip install "
                                          f"'datadist[nixl]' ({why})")
                # An owner without NIXL: readers are refused (FEATURE_NOT_ENABLED) with why.
                log.info("serving NIXL asked for, but %s", why)
            # What the forced transport means for links is the core's rule (options.h
            # ApplyTransport), the one the C++ API uses.
            tls = config.tls
            self._core.open(secret=config.secret or b"", transport=forced,
                            allow_ptrace=config.allow_ptrace,
                            max_conns=config.max_connections,
                            max_per_peer=config.max_connections_per_peer,
                            tls_cert=tls.cert_file if tls else "",
                            tls_key=tls.key_file if tls else "",
                            tls_ca=tls.ca_file if tls else "",
                            nixl_serve=config.nixl_serve,
                            nixl_whole_process=config.nixl_whole_process)
            for placement, cfg in ((DEVICE, config.device_pool), (HOST, config.host_pool)):
                if cfg is not None:  # the core's pools (pool.h): OutOfMemory if not mapped
                    self._core.open_pool(device=placement == DEVICE,
                                         memory_size=cfg.memory_size, page_shift=cfg.page_shift)
            if config.listen is not None:
                self.start_listening(*config.listen)
        except BaseException:
            self.close()
            raise

    def __repr__(self) -> str:
        return (f"NativeEngine(cluster_id={self.config.cluster_id}, role={self.role}, "
                f"listen={self._listen})")

    # ------------------------------------------------------------------ identity

    @property
    def role(self) -> int:
        return int(self._core.role)

    @role.setter
    def role(self, value: int) -> None:
        self._core.role = int(value)

    def _check_open(self) -> None:
        if self._closed:
            raise Closed("the engine is finalized")

    # ------------------------------------------------------------------ listening

    def set_local_comm_res(self, text: str | None) -> None:
        """``llm.LocalCommRes`` as ``init`` got it (None: absent): the core checks it when
        linking, as LLM-DataDist parses it then (a text that is not JSON, or of a version
        other than 1.0 / 1.2, fails ``link`` with InvalidArgument on either end; the core's
        Engine::SetLocalCommRes). Who calls: the facade's ``init``. Never blocks."""
        self._core.set_local_comm_res(text is not None, text or "")

    @property
    def identity(self) -> HostIdentity:
        """Who this engine says it is in its HELLOs and WELCOMEs (pid, pid namespace, boot
        id): the core runs in this process, so the process's. Never blocks."""
        return HostIdentity.current()

    @property
    def listen_address(self) -> tuple[str, int] | None:
        return self._listen

    @property
    def listener(self) -> Listening | None:
        return None if self._listen is None else Listening(*self._listen)

    def start_listening(self, host: str, port: int) -> None:
        """Listen at host:port (0: any port), replacing where we listened. LinkFailed."""
        self._check_open()
        bound = self._core.listen(host, port)
        self._listen = (host, int(bound))

    def stop_listening(self) -> None:
        self._core.stop_listening()
        self._listen = None

    # ------------------------------------------------------------------ caches

    def _file(self, geometry: Geometry, addrs: np.ndarray, *, owned: bool, placement: int,
              keys: Sequence[KeyId | None], blocks_model_id: int | None,
              remote_accessible: bool = True) -> CacheEntry:
        """File a cache in the core's registry, which numbers it and binds its keys (key i ->
        slot i) and model id, all or nothing (InvalidArgument). Blocks without the GIL while
        NIXL registers it."""
        g = geometry
        # Caches in shareable memory (our pools, shared_empty arrays): the core serves
        # same-host readers their memfds (SHM_GRANT, CACHE_LEASE) to map and memcpy from.
        found = shared.lookup(addrs, g.tensor_bytes)
        shm = None if found is None else tuple(a.tolist() for a in found)
        cache_id = self._core.add_cache(
            g.num_tensors, g.tensor_bytes, g.units, g.layout, addrs, allocated=owned,
            remote_accessible=remote_accessible, blocks=g.is_blocks, device=placement == DEVICE,
            shm=shm, keys=_wire_keys(keys), model_id=blocks_model_id)
        addrs.flags.writeable = False
        return CacheEntry(int(cache_id), g, addrs, owned, placement, remote_accessible)

    def cache(self, cache_id: int) -> CacheEntry:
        """What the core's registry says of a filed cache (geometry, addresses, kind).
        CacheNotFound for an unknown, deallocated or unregistered id. Never blocks."""
        (num_tensors, tensor_bytes, units, blocks, layout, addrs, allocated, device,
         remote_accessible, _) = self._core.cache_info(cache_id)
        addrs.flags.writeable = False
        return CacheEntry(cache_id, Geometry(int(num_tensors), int(tensor_bytes), int(units),
                                             bool(blocks), int(layout)),
                          addrs, bool(allocated), DEVICE if device else HOST,
                          bool(remote_accessible))

    def leases(self, cache_id: int) -> int:
        """How many transfers hold the cache now (peers' reads and writes, our pulls, pushes
        and local copies; tests). CacheNotFound for an unknown id. Never blocks."""
        return int(self._core.cache_info(cache_id)[9])

    def filed(self, cache_id: int) -> bool:
        """Whether a cache is filed under ``cache_id`` now (not deallocated, unregistered or
        being unregistered): all a plan made for it needs to know, as the core never reuses an
        id and a filed cache's geometry never changes. Never blocks."""
        return bool(self._core.filed(cache_id))

    def cache_ids(self) -> list[int]:
        """The ids of the caches filed now, ascending (tools, tests). Never blocks."""
        return [int(i) for i in self._core.cache_ids()]

    def key_bound(self, key: KeyId) -> bool:
        """Whether ``key`` is bound to a cache now (false once a peer's read consumed it, or
        after remove_key). Never blocks."""
        return bool(self._core.key_bound(key.value, key.model_id, key.is_prefix))

    @contextlib.contextmanager
    def held(self, cache_id: int) -> Iterator[CacheEntry]:
        """The cache, held by the core for the ``with`` body (a local copy's side): it cannot
        be unregistered, and its pool memory not freed, under the body. CacheNotFound for an
        unknown cache or one being unregistered. Never blocks."""
        hold = self._core.hold(cache_id)
        try:
            yield self.cache(cache_id)
        finally:
            hold.release()

    def user_cache(self, geometry: Geometry, addrs: np.ndarray) -> UserCache:
        """The caller's memory that is never filed (a ``create_cpu_cache``), described for
        :meth:`copy_slot` / :meth:`copy_blocks`: ``geometry``'s tensors at ``addrs``.
        InvalidArgument for a zero address or a tensor past the end of the address space.
        Never blocks."""
        return self._core_module.UserCache(num_tensors=geometry.num_tensors,
                                           tensor_bytes=geometry.tensor_bytes,
                                           units=geometry.units, addrs=addrs)

    def copy_slot(self, src: int | UserCache, dst: int | UserCache, *, src_unit: int, dst_unit: int,
                  offset: int = 0, size: int = -1) -> int:
        """Copy slot ``src_unit`` of every tensor of ``src`` into slot ``dst_unit`` of the same
        tensor of ``dst`` (filed caches' ids or :meth:`user_cache` memory): ``size`` bytes from
        ``offset`` in the slot on both sides, -1 the rest of the source slot. One core call
        (Session::CopySlot, the C++ API's CopyKvCache too): it holds both caches (CacheNotFound
        for one not filed), plans the copy (PlanSlotCopy: InvalidArgument with the Python API's
        texts), checks every span against both and copies. Returns the bytes copied. Blocks on
        memory only, without the GIL for copies over 1 MiB."""
        self._check_open()
        return int(self._core.copy_slot(src=src, dst=dst, src_unit=src_unit, dst_unit=dst_unit,
                                        offset=offset, size=size))

    def copy_blocks(self, src: int | UserCache, dst: int | UserCache, src_blocks: np.ndarray,
                    dst_blocks: np.ndarray) -> int:
        """Copy block ``src_blocks[i]`` of every tensor of ``src`` into block ``dst_blocks[i]``
        of the same tensor of ``dst`` (uint64 arrays; filed caches' ids or :meth:`user_cache`
        memory), runs adjacent on both sides as one copy. One core call (Session::CopyBlocks,
        the C++ API's CopyKvBlocks too): it holds both caches (CacheNotFound for one not filed),
        plans the copy (PlanBlockCopy: InvalidArgument with the Python API's texts; a
        destination named twice, and within one cache a block both read and written, are
        refused), checks every span against both and copies. Returns the bytes copied. Blocks
        on memory only, without the GIL for copies over 1 MiB."""
        self._check_open()
        return int(self._core.copy_blocks(src=src, dst=dst, src_blocks=src_blocks,
                                          dst_blocks=dst_blocks))

    def register(self, geometry: Geometry, addrs: list[int], *, placement: int,
                 keys: Sequence[KeyId | None] = (), blocks_model_id: int | None = None,
                 remote_accessible: bool = True) -> CacheEntry:
        """File the caller's memory as a cache (register_cache / register_blocks_cache).
        InvalidArgument for bad addresses or keys. Blocks while NIXL registers it."""
        self._check_open()
        if any(a <= 0 for a in addrs):
            raise InvalidArgument("tensor addresses must be non-zero")
        arr = np.asarray(addrs, dtype=np.uint64)
        return self._file(geometry, arr, owned=False, placement=placement, keys=keys,
                          blocks_model_id=blocks_model_id, remote_accessible=remote_accessible)

    def pool_used(self, placement: int) -> int | None:
        """Bytes allocated now from the pool of ``placement`` (DEVICE or HOST); None without
        one (or once closed). Tests and tools; never blocks."""
        info = self._core.pool_info(device=placement == DEVICE)
        return None if info is None else int(info[1])

    def allocate(self, geometry: Geometry, *, placement: int,
                 keys: Sequence[KeyId | None] = (),
                 blocks_model_id: int | None = None) -> CacheEntry:
        """Carve a cache from the pool of its placement and file it, in one core call
        (Registry::Allocate): pool caches nothing holds any more are released first, the keys
        are checked first (a bad key is InvalidArgument, never an out-of-memory), the core
        gives the pages back itself once nothing holds the cache. InvalidArgument without a
        pool; OutOfMemory (DeviceOutOfMemory for DEVICE) when it has no room. Blocks without
        the GIL while NIXL registers it."""
        self._check_open()
        g = geometry
        try:
            cache_id = self._core.allocate(
                g.num_tensors, g.tensor_bytes, g.units, g.layout, blocks=g.is_blocks,
                device=placement == DEVICE, keys=_wire_keys(keys), model_id=blocks_model_id)
        except OutOfMemory as e:
            if placement == DEVICE:
                raise DeviceOutOfMemory(str(e)) from None
            raise
        return self.cache(int(cache_id))

    def deallocate(self, cache_id: int, *, blocks: bool = False) -> None:
        """Drop a pool cache's id (and keys, for blocks caches); the core gives its memory back
        to the pool once no key and no transfer holds it any more. Blocks without the GIL
        while its NIXL leases are revoked."""
        self._core.deallocate(cache_id, blocks)

    def unregister(self, cache_id: int) -> None:
        """Has the core drop the cache once no transfer holds it (peers', and ours, blocking
        or issued: the core holds the local cache of each until it ends), waiting up to
        UNREGISTER_WAIT; Timeout and the cache stays registered if one outlives the wait.
        Blocks without the GIL."""
        self._core.remove_cache(cache_id, UNREGISTER_WAIT)

    def remove_key(self, key: KeyId) -> None:
        """remove_cache_key: unbind a key of a pool cache (no-op for unknown keys and keys on
        registered memory); a deallocated cache it alone held goes back to its pool."""
        self._core.unbind_key(key.value, key.model_id, key.is_prefix)

    # ------------------------------------------------------------------ links

    def link(self, cluster_id: int, host: str, port: int, timeout: float,
             as_announced: bool = False) -> NativeLink:
        """Connect to a peer's listener (blocks <= timeout, without the GIL); filed under
        the id the peer announces with ``as_announced``. AlreadyLinked, LinkFailed, Timeout."""
        self._check_open()
        cid = self._core.connect(cluster_id, host, port, timeout, take_peer_id=as_announced)
        return NativeLink(int(cid), str(self._core.link_path(cid) or "tcp"),
                          reason=str(self._core.link_reason(cid) or ""))

    def link_many(self, peers: list[tuple[int, str, int]], timeout: float,
                  as_announced: bool = False) -> list[tuple[int, int, str]]:
        """Link to every (cluster_id, host, port) at once (the core's Session::LinkMany),
        each within ``timeout``: [(code, filed cluster id, why)], code 0 on success."""
        self._check_open()
        return [(int(code), int(filed), str(why))
                for code, filed, why in self._core.link_many(peers, timeout, as_announced)]

    def unlink_many(self, peers: list[tuple[int, str, int]], timeout: float, *, force: bool,
                    hixl: bool) -> list[tuple[int, str]]:
        """CANN's unlink of every (cluster_id, host or "", port) at once (the core's
        Session::UnlinkMany): [(code, why)], code 0 on success."""
        return [(int(code), str(why))
                for code, why in self._core.unlink_many(peers, timeout, force=force, hixl=hixl)]

    def unlink(self, cluster_id: int, timeout: float, force: bool = False,
               quiet_inbound: bool = False) -> None:
        """Unlink both ends; NotLinked, Busy, UnlinkFailed."""
        self._core.unlink(cluster_id, timeout, force=force, quiet_inbound=quiet_inbound)

    def get_link(self, cluster_id: int) -> NativeLink:
        path = self._core.link_path(cluster_id)
        if path is None:
            raise NotLinked(f"cluster {cluster_id} is not linked (link_clusters or link first)")
        own, inbound = self._core.linked(cluster_id)
        return NativeLink(cluster_id, str(path), inbound=not own,
                          reason=str(self._core.link_reason(cluster_id) or ""),
                          serial=int(self._core.link_serial(cluster_id) or 0))

    def probe_cma(self, cluster_id: int, timeout: float) -> None:
        """On a cma link, ask the kernel now whether it lets us read the owner's memory; a
        refusal changes the link's path and reason (:meth:`get_link`) as the first pull would
        change them. Who calls: ``datadist info --peer``, to say the path a pull will take.
        Blocks <= timeout while a transfer holds the link; NotLinked, Timeout."""
        self._core.probe_cma(cluster_id, timeout)

    def last_moved(self, cluster_id: int) -> str:
        """How the last pull on our link to ``cluster_id`` moved its bytes: "shm" (memcpy
        from the owner's mapped memfd), "cma", "stream" or "" (none yet, or no such link).
        For tests and tools; never blocks."""
        return str(self._core.link_moved(cluster_id) or "")

    def check_link(self, cluster_id: int, timeout: float) -> None:
        self._core.ping(cluster_id, timeout)

    def links(self) -> list[NativeLink]:
        out = []
        for cid in self._core.link_ids(False):
            path = self._core.link_path(cid)
            if path is not None:
                out.append(NativeLink(int(cid), str(path),
                                      reason=str(self._core.link_reason(cid) or ""),
                                      serial=int(self._core.link_serial(cid) or 0)))
        return out

    def reverse_ids(self) -> list[int]:
        """The cluster ids whose reverse channels to our listener are live now (our ends of
        their links), ascending; ones their linkers closed are dropped first (as
        :meth:`has_links`). For tests and tools; blocks only while it closes those."""
        return sorted(int(cid) for cid in self._core.link_ids(True))

    def has_links(self) -> bool:
        return bool(self._core.has_links())

    def last_link_failure(self, cluster_id: int) -> str:
        return str(self._core.last_link_failure(cluster_id))

    # ------------------------------------------------------------------ two-sided links
    # core/comm.py (link() with rank tables): every member connects to every other, links
    # become usable only once all are up; a member joins when its control channel reaches us.

    def make_listener(self, host: str, port: int) -> NativeListener:
        """One more listener (a comm's rank-table address), serving as the main one."""
        self._check_open()
        key = self._core.listen_also(host, port)
        return NativeListener(self._core, int(key), host, port)

    def open_link(self, cluster_id: int, host: str, port: int, timeout: float,
                  reverse: bool = True, as_announced: bool = False) -> PendingLink:
        """Connect and check as :meth:`link` without filing the link (:meth:`adopt_link`
        does); with ``reverse`` also its reverse channel. Blocks <= timeout."""
        self._check_open()
        return self._core.open_link(cluster_id, host, port, timeout, take_peer_id=as_announced,
                                    reverse=reverse)

    def adopt_link(self, link: PendingLink) -> None:
        """File a link from :meth:`open_link`. AlreadyLinked (left open) when that cluster is
        linked already; Closed (link closed) after close."""
        if self._closed:
            link.close()
            raise Closed("the engine is finalized")
        self._core.adopt_link(link)

    def inbound_peers(self) -> list[NativeLink]:
        """The peers whose control channels to us are live now."""
        return [NativeLink(int(cid), "tcp", inbound=True)
                for cid in sorted(set(self._core.inbound_control()))]

    def hello_count(self, cluster_id: int) -> int:
        """How many control channels ``cluster_id`` opened to us so far."""
        return int(self._core.hello_count(cluster_id))

    # ------------------------------------------------------------------ transfers

    def _refused(self, op: str, cluster_id: int, t0: float, error: BaseException) -> None:
        code = int(error.code) if isinstance(error, DatadistError) else 0xFFFFFFFF
        self._core_module.metrics_record(op, cluster_id, 0, time.perf_counter() - t0, code)

    def _call(self, cluster_id: int, key: p.KeyRef, unit_bytes: int, plan: Plan,
              cache_id: int, write: bool) -> Call:
        """The core's prepared transfer of ``plan`` into (from) local cache ``cache_id``:
        the core checks every local span against that cache's geometry (InvalidArgument) and
        makes the local spans from its own registry's addresses (CacheNotFound for an
        unknown cache). Made once for small plans and kept; larger ones each time."""
        small = plan.num_spans <= SMALL_REQUEST
        ident = (plan, cache_id, cluster_id, key, unit_bytes, write)
        call = self._calls.find(ident) if small else None
        if call is None:
            flags = int(p.ReadFlags.WHOLE) if plan.whole and not write else 0
            if self.config.verify and not write:  # the owner's CRC-32 of what it sent, checked
                flags |= int(p.ReadFlags.CHECKSUM)
            call = self._core.prepare(
                write=write, cluster_id=cluster_id, kind=int(key.kind), a=key.a, b=key.b,
                c=key.c, unit_bytes=unit_bytes, flags=flags, cache_id=cache_id,
                remote_tensors=plan.remote_tensors, remote_offsets=plan.remote_offsets,
                lengths=plan.lengths, local_tensors=plan.local_tensors,
                local_offsets=plan.local_offsets)
            if small:
                self._calls.put(ident, call)
        return call

    def prepared(self, write: bool, cluster_id: int, key: p.KeyRef, unit_bytes: int,
                 plan: Plan, cache_id: int) -> Call:
        """The core's prepared pull (``write`` False) or push of ``plan`` (:meth:`_call`),
        for :meth:`run` and :meth:`submit` any number of times; a refusal (finalized, no such
        local cache, spans outside it) counted as the core counts the transfers it is handed
        (metrics). Never blocks."""
        t0 = time.perf_counter()
        try:
            if self._closed:
                raise Closed("the engine is finalized")
            return self._call(cluster_id, key, unit_bytes, plan, cache_id, write)
        except BaseException as e:
            self._refused("push" if write else "pull", cluster_id, t0, e)
            raise

    def prepare_pull(self, cluster_id: int, key: p.KeyRef, cache_id: int, kind: int, *,
                     batch_index: int = 0, size: int = -1, src_offset: int = 0,
                     dst_offset: int = 0, src_blocks: np.ndarray = _NO_BLOCKS,
                     dst_blocks: np.ndarray = _NO_BLOCKS,
                     src_layers: tuple[int, int] | None = None,
                     dst_layers: tuple[int, int] | None = None,
                     tensor_num_per_layer: int = 2) -> Call:
        """A pull into local cache ``cache_id``, planned, checked and made ready to run
        (:meth:`run`, :meth:`submit`) by the core in one call (Session::PreparePull): the
        core holds the cache (CacheNotFound), plans the pull against its geometry with the
        Python API's rules and texts (InvalidArgument; ``kind``: PULL_SLOT, PULL_BLOCKS or
        PULL_SLOT_TO_BLOCKS), and checks the request's size and every local span. Layer
        ranges are half-open ``(start, stop)`` pairs. A refusal after planning is counted by
        the core; one of a finalized engine here (Closed). Never blocks."""
        if self._closed:
            error = Closed("the engine is finalized")
            self._refused("pull", cluster_id, time.perf_counter(), error)
            raise error
        # A range past 64 bits (the legacy API checks only 0 <= start < stop) is refused by the
        # core as any range past the largest tensor index, not by the binding's conversion.
        if src_layers is not None and src_layers[1] > _U64:
            src_layers = (min(src_layers[0], _U64 - 1), _U64)
        if dst_layers is not None and dst_layers[1] > _U64:
            dst_layers = (min(dst_layers[0], _U64 - 1), _U64)
        return self._core.prepare_pull(
            cluster_id, int(key.kind), key.a, key.b, key.c, self.config.verify, cache_id, kind,
            batch_index, size, src_offset, dst_offset, src_blocks, dst_blocks, src_layers,
            dst_layers, tensor_num_per_layer)

    def prepare_push(self, cluster_id: int, key: p.KeyRef, cache_id: int, *, blocks: bool,
                     remote_first: int, local_first: int, count: int, batch_index: int = 0,
                     size: int = -1, src_blocks: np.ndarray = _NO_BLOCKS,
                     dst_blocks: np.ndarray = _NO_BLOCKS) -> Call:
        """A push from local cache ``cache_id``, planned, checked and made ready to run by the
        core in one call (Session::PreparePush), as :meth:`prepare_pull`: remote tensor
        ``remote_first + i`` <- local tensor ``local_first + i`` for ``i < count``, then local
        slot ``batch_index`` (``size`` bytes, -1: all of it), or, with ``blocks``, local blocks
        ``src_blocks`` into remote blocks ``dst_blocks``. Never blocks."""
        if self._closed:
            error = Closed("the engine is finalized")
            self._refused("push", cluster_id, time.perf_counter(), error)
            raise error
        return self._core.prepare_push(
            cluster_id, int(key.kind), key.a, key.b, key.c, cache_id, blocks, batch_index, size,
            src_blocks, dst_blocks, remote_first, local_first, count)

    def prepare_layer_pushes(self, cluster_id: int, key: p.KeyRef, unit_bytes: int,
                             cache_id: int, *, kind: int, src_unit: int = 0,
                             src_blocks: np.ndarray = _NO_BLOCKS,
                             dst_blocks: np.ndarray = _NO_BLOCKS, dst_block_bytes: int = 0,
                             src_first: int, dst_first: int, layers: int,
                             tensors_per_layer: int,
                             dst_addrs: Sequence[int] = ()) -> list[Call]:
        """transfer_cache_async's pushes of one destination, every layer's, planned, checked and
        made ready to run by the core in one call (Session::PrepareLayerPushes): source layer
        ``src_first + k`` into destination layer ``dst_first + k`` for ``k < layers``, each
        layer's spans those of ``kind`` (LAYER_SLOT, LAYER_BLOCKS, LAYER_SLOT_TO_BLOCKS), one
        call per layer by key, one per tensor of each layer (layer-major) to ``dst_addrs``.
        InvalidArgument with the Python API's texts, CacheNotFound. The calls are kept for the
        next transfer of the same layers (block lists of up to SMALL_REQUEST blocks): the
        core's runs hold the cache and refuse one that is gone or other memory. A refusal of
        a finalized engine here (Closed), counted. Called on the caller's thread by
        api/async_transfer.py; never blocks."""
        if self._closed:
            error = Closed("the engine is finalized")
            self._refused("push", cluster_id, time.perf_counter(), error)
            raise error
        keep = max(len(src_blocks), len(dst_blocks)) <= SMALL_REQUEST
        ident = None
        if keep:
            ident = (cluster_id, key, unit_bytes, cache_id, kind, src_unit, src_blocks.tobytes(),
                     dst_blocks.tobytes(), dst_block_bytes, src_first, dst_first, layers,
                     tensors_per_layer, tuple(dst_addrs))
            kept = self._layer_calls.find(ident)
            if kept is not None:
                return kept
        calls = self._core.prepare_layer_pushes(
            cluster_id=cluster_id, key_kind=int(key.kind), a=key.a, b=key.b, c=key.c,
            unit_bytes=unit_bytes, cache_id=cache_id, kind=kind, src_unit=src_unit,
            src_blocks=src_blocks, dst_blocks=dst_blocks, dst_block_bytes=dst_block_bytes,
            src_first=src_first, dst_first=dst_first, layers=layers,
            tensors_per_layer=tensors_per_layer,
            dst_addrs=np.asarray(dst_addrs, dtype=np.uint64) if dst_addrs else _NO_BLOCKS)
        if ident is not None:
            self._layer_calls.put(ident, calls)
        return calls

    def _closed_refusal(self, call: Call) -> Closed:
        error = Closed("the engine is finalized")
        self._refused("push" if call.write else "pull", int(call.cluster_id),
                      time.perf_counter(), error)
        return error

    def planned_pulls(self, size: int, max_weight: int, small_request: int,
                      key_types: tuple[type, type, type]) -> PlannedPulls:
        """A map of the facade's planned pulls on this engine (cpp/python/planned.h): up to
        ``size`` prepared calls and ``max_weight`` local spans, keyed by the pull's arguments
        (block lists of at most ``small_request`` items; ``key_types``: the three cache key
        classes, BlocksCacheKey, CacheKeyByIdAndIndex, CacheKey), whose hit runs the kept call
        as :meth:`run` does, in the same call. Closed with the engine (:meth:`close`): from then
        on nothing is found there, and the caller's full path answers. Never blocks."""
        from datadist import _core as mod
        m = mod.PlannedPulls(self._core, size, max_weight, small_request, *key_types)
        with self._lock:
            if self._closed:
                m.close()
            self._planned.add(m)
        return m

    def run(self, call: Call, timeout: float | None = None) -> None:
        """A prepared pull or push (:meth:`prepared`), blocking: counted by the core, which
        holds the call's local cache for the transfer (CacheNotFound when it is gone;
        Session::Run). Blocks until every byte landed (or the owner confirmed) or the
        deadline; the GIL is kept until the core would wait (cpp/python/gil.h): a leased
        same-host copy never gives it up. Straight-line: every pull passes here."""
        if self._closed:
            raise self._closed_refusal(call)
        self._core.run(call, self.config.sync_timeout if timeout is None else timeout)

    def submit(self, call: Call, timeout: float | None = None) -> NativeHandle:
        """:meth:`run`, issued to the core's workers; returns at once. The core holds the
        call's local cache from now until the transfer ends (CacheNotFound, counted, when it
        is gone: nothing is issued). A pull of up to 64 KiB that the link's whole-cache lease
        covers is copied in this call instead (a local copy that waits for nobody): its
        handle has ended when it returns."""
        if self._closed:
            raise self._closed_refusal(call)
        handle = self._core.submit(call, self.config.sync_timeout if timeout is None
                                   else timeout)  # counted by the core, refused or not
        return NativeHandle(handle, "push" if call.write else "pull", int(call.cluster_id))

    def pull(self, cluster_id: int, key: p.KeyRef, unit_bytes: int, plan: Plan,
             dst_cache_id: int, timeout: float | None = None) -> None:
        """Read ``plan`` from the remote cache ``key`` names into local cache
        ``dst_cache_id`` (:meth:`prepared`, then :meth:`run`)."""
        self.run(self.prepared(False, cluster_id, key, unit_bytes, plan, dst_cache_id), timeout)

    def push(self, cluster_id: int, key: p.KeyRef, unit_bytes: int, plan: Plan,
             src_cache_id: int, timeout: float | None = None) -> None:
        """Write local cache ``src_cache_id`` per ``plan`` into the remote cache ``key``
        names (:meth:`prepared`, then :meth:`run`)."""
        self.run(self.prepared(True, cluster_id, key, unit_bytes, plan, src_cache_id), timeout)

    # ------------------------------------------------------------------ metrics

    def stats(self) -> dict[str, Any]:
        """The process's transfer metrics (the core's counters), JSON-ready, with who we
        are: what STATS answers a peer. Never blocks."""
        return metrics.stats(self.config.cluster_id, self.role)

    def peer_stats(self, cluster_id: int, timeout: float) -> dict[str, Any]:
        """Ask a linked peer for its metrics over the link (STATS_REQUEST, sent by the
        core without the GIL). Blocks <= timeout; NotLinked, Timeout, or a
        RemoteProtocolError from a peer that does not know the request."""
        raw = self._core.peer_stats(cluster_id, timeout)
        return metrics.parse_stats(raw)

    def pull_async(self, cluster_id: int, key: p.KeyRef, unit_bytes: int, plan: Plan,
                   dst_cache_id: int, timeout: float | None = None) -> NativeHandle:
        """:meth:`pull`, issued (:meth:`submit`); returns at once."""
        return self.submit(self.prepared(False, cluster_id, key, unit_bytes, plan, dst_cache_id),
                           timeout)

    def push_async(self, cluster_id: int, key: p.KeyRef, unit_bytes: int, plan: Plan,
                   src_cache_id: int, timeout: float | None = None) -> NativeHandle:
        """:meth:`push`, issued (:meth:`submit`); returns at once."""
        return self.submit(self.prepared(True, cluster_id, key, unit_bytes, plan, src_cache_id),
                           timeout)

    def layers(self, jobs: int, steps: int, width: int,
               timeout: float | None = None) -> LayerRun:
        """A layer-wise run in the core of ``steps`` steps for ``jobs`` destinations
        (transfer_cache_async's loop; ``cpp/src/session.h`` LayerRun): the caller adds every
        layer's prepared calls
        (:meth:`prepared`), then lets each layer go as it is synchronized; the core's workers
        start the layers in order, up to ``width`` at once, each within ``timeout``
        (sync_timeout) of its start. The run
        keeps the core alive. Never blocks; Closed once finalized."""
        if self._closed:
            raise Closed("the engine is finalized")
        return self._core.layers(jobs, steps, width,
                                 self.config.sync_timeout if timeout is None else timeout)

    # ------------------------------------------------------------------ closing

    def close(self) -> None:
        """Stop serving, close every link, drop every cache. Idempotent; does not raise."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            planned = list(self._planned)
        for m in planned:  # their hits miss from now: the caller's full path answers closed
            m.close()
        # The core stops serving, fails the queued asynchronous transfers (their holds go),
        # closes every link (so every transfer ends, letting its hold go) and drops every
        # cache and its pools without waiting; then it waits (CLOSE_WAIT) for the caches
        # still held (a peer's copy, a pull of another thread). A pool goes with its last
        # cache: one still held keeps its pool mapped (leaked), never unmapped under the copy.
        try:
            self._core.close(0.0)
        except Exception as e:  # noqa: BLE001 - closing must not raise
            log.warning("closing the native engine: %s", e)
        try:
            leased = int(self._core.caches_in_use(CLOSE_WAIT))
            if leased:
                log.warning("finalize: %d caches still in transfer; their memory left mapped",
                            leased)
        except Exception as e:  # noqa: BLE001 - closing must not raise
            log.warning("closing the native engine: %s", e)


def engine_for(config: EngineConfig) -> NativeEngine:
    """The engine ``LLMDataDist.init`` runs with: the native core, the only one.
    Raises NotSupported when the core is not built or does not load here (docs/native-build.md)
    or cannot run ``config`` on this host (:func:`refusal`: TLS on a core built without
    OpenSSL)."""
    ok, why = available()
    if not ok:
        raise NotSupported(f"datadist's native core is not available: {why}")
    reason = refusal(config)
    if reason is not None:
        raise NotSupported(f"the native core cannot run this configuration: {reason}")
    return NativeEngine(config)


__all__ = ["NativeEngine", "NativeHandle", "NativeLink", "available", "engine_for", "refusal",
           "tls_available", "AlreadyLinked"]
