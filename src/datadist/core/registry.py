"""The registry: local caches, the keys peers address them by, and their lifetimes.

Theory of operation
-------------------
Every cache (registered user memory or pool-allocated) is a :class:`CacheEntry` with a
process-unique ``cache_id`` counted from 1. Peers name a cache in one of three ways, and this
module resolves each to ``(entry, source unit)``:

* ``CacheKey``: ``(req_id, model_id)`` or ``(prefix_id, model_id)`` -> a batch slot;
* ``CacheKeyByIdAndIndex``: ``cache_id`` and a batch index;
* ``BlocksCacheKey``: ``model_id`` -> the blocks cache last registered under it.

Lifetime rules (LLM-DataDist's, made safe):

1. A pool-allocated cache is held by its cache_id and by each bound key. ``deallocate``
   drops the id; the memory returns to the pool when no key and no lease holds it.
2. A successful read through a req_id key of a pool-allocated cache *consumes* the key once
   every tensor of the cache has been read (layer-wise reads add up). Prefix keys and keys on
   registered (user) memory are never consumed. A read through such a key *reserves* the
   tensors it names when it opens: a second read of any of them is refused until the first
   ends, so two concurrent readers can never both consume one key. The reservation is
   committed (tensors marked read) only once the read is known good (``settle``), and
   dropped when it failed.
3. A read or write holds a *lease* on the entry from the owner's check until the bytes have
   moved. Memory is never returned to a pool, nor an unregister allowed to finish, while a
   lease is live: a peer can never read memory that was freed or reused.
4. Every span a peer asks for is checked here against the entry's tensors (``open``); the
   transport moves only what ``open`` returned.

Thread-safe: one lock guards all maps; waiting for leases uses a condition on that lock.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from datadist.core.errors import (
    CacheNotFound,
    InvalidArgument,
    Timeout,
)
from datadist.core.layout import U64, Geometry, check_layouts, check_source_spans
from datadist.transport.iov import span_iov
from datadist.wire.protocol import KeyKind, KeyRef

UINT64_MAX = 2**64 - 1
# Most spans (tensors x spans per tensor, counted after the expansion) one peer request may
# name. The owner builds one iovec per span (16 bytes, plus numpy temporaries while it is
# built), so without a cap a sub-megabyte Read (40k tensor indexes x 40k spans) makes it
# allocate tens of GB. 2**22 spans cost the owner ~200 MB at the peak and a few hundred ms,
# and still cover 26k uncoalesced blocks in each of 160 tensors. Requesters check their own
# plans against it (core/engine.py), so an honest request is never refused by the owner.
MAX_REQUEST_SPANS = 1 << 22


@dataclass(frozen=True, slots=True)
class KeyId:
    """A local key: a req_id or a prefix_id, within a model_id. Cluster ids are not part."""

    value: int
    model_id: int
    is_prefix: bool = False


@dataclass(eq=False)
class KeyBinding:
    """A cache key bound to one slot of a cache, with which of its tensors were pulled (for
    consumption) and which have a read in flight."""

    entry: CacheEntry
    slot: int
    pulled: np.ndarray  # bool per tensor, for consumption
    reserved: np.ndarray | None = None  # bool per tensor: a read of it is in flight

    def __post_init__(self) -> None:
        if self.reserved is None:
            self.reserved = np.zeros_like(self.pulled)


@dataclass(eq=False)
class CacheEntry:
    """A registered cache: its geometry, the base address of each tensor, who owns the memory,
    and the keys bound to it."""

    cache_id: int
    geometry: Geometry
    addrs: np.ndarray  # uint64, base address of each tensor
    owned: bool  # allocated from a pool (True) or registered user memory (False)
    placement: int = 0
    remote_accessible: bool = True
    free: Callable[[], None] | None = None  # returns pool memory
    keys: set[KeyId] = field(default_factory=set)
    blocks_model_id: int | None = None
    leases: int = 0
    closing: bool = False  # being unregistered: no new transfer may start
    id_held: bool = True
    released: bool = False
    # (fds, inos, offsets) per tensor when every tensor lies in shareable memory (memfd)
    shm: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def __repr__(self) -> str:
        g = self.geometry
        kind = "blocks" if g.is_blocks else "cache"
        return (
            f"<CacheEntry {kind} id={self.cache_id} tensors={g.num_tensors} "
            f"units={g.units} unit_bytes={g.unit_bytes} owned={self.owned} "
            f"keys={len(self.keys)} leases={self.leases}>"
        )


@dataclass(eq=False)
class Lease:
    """What an owner granted for one read or write: absolute bases per requested tensor."""

    entry: CacheEntry
    bases: np.ndarray  # uint64 per requested tensor (tensor base + unit base)
    tensors: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray
    binding: KeyBinding | None
    key: KeyId | None
    shm: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # per requested tensor
    grantee: int = 0  # a grant's verified reader pid (the engine counts grants per peer)
    reserved: bool = False  # holds a reservation of binding's tensors (a consuming read)
    memory_held: bool = True  # counted in entry.leases until unlease/close
    # the engine's metrics of a request it serves: (operation, peer cluster id, start time)
    served: tuple[str, int, float] | None = None

    @property
    def nbytes(self) -> int:
        return int(self.lengths.sum()) * len(self.tensors)

    def wanted_back(self) -> bool:
        """Whether the owner wants this memory back: the cache is being unregistered, or
        nothing but leases holds it any more (deallocated, its keys gone). A peer's grant
        on it then expires sooner (transport/tcp.py). Lock-free: a stale answer only moves
        an expiry by one sweep."""
        e = self.entry
        return e.closing or (not e.id_held and not e.keys)

    def iov(self) -> tuple[np.ndarray, np.ndarray]:
        return span_iov(self.bases, self.offsets, self.lengths)


def check_request_size(tensors: np.ndarray, offsets: np.ndarray) -> None:
    """What a request may cost the owner, before any per-span work: at most
    MAX_REQUEST_SPANS spans after the tensors x spans expansion, and no tensor named twice
    (reading or writing a tensor twice in one request means nothing, and repeating one index
    is the cheapest way to multiply the expansion). Vectorised; O(T log T)."""
    if len(tensors) * len(offsets) > MAX_REQUEST_SPANS:
        raise InvalidArgument(
            f"{len(tensors)} tensors x {len(offsets)} spans exceeds the "
            f"{MAX_REQUEST_SPANS} spans one request may name"
        )
    n = len(tensors)
    if n > 1 and (len(set(tensors.tolist())) if n <= 256 else len(np.unique(tensors))) != n:
        raise InvalidArgument("a request names the same tensor more than once")


def key_id(req_id: int, prefix_id: int, model_id: int) -> KeyId | None:
    """The local key for a CacheKey's fields; None for the padding key (both unset)."""
    if req_id != UINT64_MAX:
        return KeyId(req_id, model_id, False)
    if prefix_id != UINT64_MAX:
        return KeyId(prefix_id, model_id, True)
    return None


class Registry:
    """All local caches and keys of one engine."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._ids = itertools.count(1)
        self._by_id: dict[int, CacheEntry] = {}
        self._keys: dict[KeyId, KeyBinding] = {}
        self._blocks: dict[int, CacheEntry] = {}
        # Every entry whose memory has not been released, however it is still held (by id,
        # key, blocks model id or lease): what finalize must wait for before unmapping pools.
        self._live: set[CacheEntry] = set()

    # ---------------------------------------------------------------- adding and removing

    def add(
        self,
        geometry: Geometry,
        addrs: list[int] | np.ndarray,
        *,
        owned: bool,
        placement: int = 0,
        keys: Sequence[KeyId | None] = (),
        blocks_model_id: int | None = None,
        remote_accessible: bool = True,
        free: Callable[[], None] | None = None,
        shm: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
    ) -> CacheEntry:
        """Create an entry and bind its keys (key i -> slot i). Atomic: all or nothing."""
        addr_arr = np.asarray(addrs, dtype=U64)
        if len(addr_arr) != geometry.num_tensors:
            raise InvalidArgument(
                f"{len(addr_arr)} addresses given for {geometry.num_tensors} tensors"
            )
        keys = list(keys)
        real = self.check_keys(keys, geometry.units)
        with self._lock:
            self._check_unbound(real)
            entry = CacheEntry(
                next(self._ids),
                geometry,
                addr_arr,
                owned,
                placement,
                remote_accessible,
                free,
                blocks_model_id=blocks_model_id,
                shm=shm,
            )
            self._by_id[entry.cache_id] = entry
            self._live.add(entry)
            for slot, k in enumerate(keys):
                if k is not None:
                    self._keys[k] = KeyBinding(entry, slot, np.zeros(geometry.num_tensors, bool))
                    entry.keys.add(k)
            if blocks_model_id is not None:
                self._blocks[blocks_model_id] = entry  # last writer wins
            return entry

    def check_keys(self, keys: list[KeyId | None], units: int) -> list[KeyId]:
        """The key rules of allocate/register: no more keys than slots, no duplicates, none
        bound already. Returns the real (non-padding) keys. Callers check before they
        allocate memory, so a bad key is PARAM_INVALID, never an out-of-memory."""
        if len(keys) > units:
            raise InvalidArgument(f"{len(keys)} cache keys for a batch of {units}")
        real = [k for k in keys if k is not None]
        if len(set(real)) != len(real):
            raise InvalidArgument("duplicate cache keys")
        with self._lock:
            self._check_unbound(real)
        return real

    def _check_unbound(self, keys: list[KeyId]) -> None:
        for k in keys:
            if k in self._keys:
                raise InvalidArgument(f"cache key {k} is already bound")

    def get(self, cache_id: int) -> CacheEntry:
        with self._lock:
            entry = self._by_id.get(cache_id)
        if entry is None:
            raise CacheNotFound(f"cache {cache_id} does not exist")
        return entry

    def entries(self) -> list[CacheEntry]:
        with self._lock:
            return list(self._by_id.values())

    def _unbind_all(self, entry: CacheEntry) -> None:
        for k in entry.keys:
            self._keys.pop(k, None)
        entry.keys.clear()
        if entry.blocks_model_id is not None and self._blocks.get(entry.blocks_model_id) is entry:
            del self._blocks[entry.blocks_model_id]

    def _maybe_release(self, entry: CacheEntry) -> None:
        """Give the memory back once nothing holds the entry. Lock held."""
        if entry.released or entry.id_held or entry.keys or entry.leases:
            return
        entry.released = True
        self._live.discard(entry)
        if entry.free is not None:
            entry.free()
        self._changed.notify_all()

    def unregister(self, cache_id: int, wait: float = 30.0) -> None:
        """Forget a registered cache and its keys; waits (bounded) for live leases.

        Unknown ids are a no-op. Returns once no peer can touch the memory any more. While it
        waits, no new transfer may start on the cache; if leases outlive ``wait`` it raises
        Timeout and the cache stays registered (its memory is still in use: do not free it).
        """
        deadline = time.monotonic() + wait
        with self._lock:
            entry = self._by_id.get(cache_id)
            if entry is None:
                return
            entry.closing = True
            while entry.leases:
                left = deadline - time.monotonic()
                if left <= 0:
                    entry.closing = False
                    raise Timeout(
                        f"cache {cache_id} is still being transferred after {wait:.0f} s; "
                        "it stays registered"
                    )
                self._changed.wait(left)
            del self._by_id[cache_id]
            entry.id_held = False
            self._unbind_all(entry)
            self._maybe_release(entry)

    def deallocate(self, cache_id: int, *, drop_keys: bool = False) -> None:
        """Drop the cache_id reference of a pool cache (and its keys, for blocks caches).

        The memory goes back to the pool when no key or lease holds it any more. Unknown ids
        and registered caches are a no-op.
        """
        with self._lock:
            entry = self._by_id.get(cache_id)
            if entry is None or not entry.owned:
                return
            del self._by_id[cache_id]
            entry.id_held = False
            if drop_keys:
                self._unbind_all(entry)
            self._maybe_release(entry)

    def remove_key(self, key: KeyId) -> None:
        """Unbind a key of a pool cache. Unknown keys and keys on user memory: no-op."""
        with self._lock:
            binding = self._keys.get(key)
            if binding is None or not binding.entry.owned:
                return
            del self._keys[key]
            binding.entry.keys.discard(key)
            self._maybe_release(binding.entry)

    def wait_unleased(self, entries: list[CacheEntry], wait: float) -> int:
        """Wait up to ``wait`` s until none of ``entries`` is leased; returns how many still
        are."""
        deadline = time.monotonic() + wait
        with self._lock:
            while True:
                busy = sum(1 for e in entries if e.leases)
                left = deadline - time.monotonic()
                if not busy or left <= 0:
                    return busy
                self._changed.wait(left)

    def clear(self) -> list[CacheEntry]:
        """Drop everything (finalize): no id, key or model id resolves any more. Returns
        every entry whose memory was not released yet, however it was held (a deallocated
        cache still bound to a key, one whose last reader is still at work), so that the
        caller can wait for their leases before it unmaps the memory."""
        with self._lock:
            entries = list(self._live)
            for e in entries:
                e.closing = True
            self._by_id.clear()
            self._keys.clear()
            self._blocks.clear()
            return entries

    # ---------------------------------------------------------------- leases

    def hold(self, cache_id: int) -> CacheEntry:
        """Lease a local cache for the duration of a local transfer (pull destination)."""
        with self._lock:
            entry = self._by_id.get(cache_id)
            if entry is None or entry.closing:
                raise CacheNotFound(f"cache {cache_id} does not exist")
            entry.leases += 1
            return entry

    def unhold(self, entry: CacheEntry) -> None:
        with self._lock:
            entry.leases -= 1
            self._maybe_release(entry)

    def open(
        self,
        key: KeyRef,
        unit_bytes: int,
        tensors: np.ndarray,
        offsets: np.ndarray,
        lengths: np.ndarray,
        *,
        shm: bool = False,
        layout: int = 0,
        read: bool = True,
    ) -> Lease:
        """Owner side of a peer's read (``read``) or write: resolve, bounds-check, lease.

        With ``shm``, the lease also says where each requested tensor's unit lies in
        shareable memory (when the whole cache is in it). A read through a consumable key
        reserves the tensors it names until :meth:`close` / :meth:`settle`.

        Raises CacheNotFound for an unknown key or cache (or a consumable key whose tensors
        another read has reserved), InvalidArgument for anything that does not fit the cache
        (tensor index, span, block size, batch index, a tensor named twice, too many spans).
        """
        if key.kind == KeyKind.ADDRESS:  # raw addresses (transfer_cache_async)
            return self.open_addresses(tensors, offsets, lengths)
        with self._lock:
            binding: KeyBinding | None = None
            kid: KeyId | None = None
            if key.kind == KeyKind.CACHE_KEY:
                kid = key_id(key.a, key.c, key.b)
                binding = self._keys.get(kid) if kid is not None else None
                if binding is None:
                    raise CacheNotFound(
                        f"no cache bound to req_id={key.a} prefix_id={key.c} model_id={key.b} "
                        "(the owner must allocate or register it with that CacheKey; a "
                        "successful pull consumes it)")
                entry, slot = binding.entry, binding.slot
            elif key.kind == KeyKind.CACHE_ID:
                found = self._by_id.get(key.a)
                if found is None:
                    raise CacheNotFound(f"cache {key.a} does not exist")
                entry, slot = found, key.b
            else:
                found = self._blocks.get(key.b)
                if found is None:
                    raise CacheNotFound(
                        f"no blocks cache registered for model_id={key.b} (the owner must "
                        "register_blocks_cache with BlocksCacheKey(its cluster id, "
                        f"{key.b}))")
                entry, slot = found, -1
            if entry.closing:
                raise CacheNotFound(f"cache {entry.cache_id} is being unregistered")
            if not entry.remote_accessible:
                raise InvalidArgument(f"cache {entry.cache_id} is not remote accessible")
            g = entry.geometry
            if len(tensors) and int(tensors.max()) >= g.num_tensors:
                raise InvalidArgument(
                    f"tensor {int(tensors.max())} out of range: cache {entry.cache_id} "
                    f"has {g.num_tensors}"
                )
            check_request_size(tensors, offsets)
            if slot < 0:
                if unit_bytes and unit_bytes != g.unit_bytes:
                    raise InvalidArgument(
                        f"block size mismatch: requester assumed {unit_bytes} bytes, "
                        f"cache {entry.cache_id} has {g.unit_bytes}"
                    )
                base, limit = 0, g.tensor_bytes
            else:
                if slot >= g.units:
                    raise InvalidArgument(
                        f"batch index {slot} out of range: cache {entry.cache_id} "
                        f"has {g.units}"
                    )
                # A slot read may run past the slot into the following ones (a contiguous
                # source split into blocks reads the whole tensor from slot 0), never past
                # the tensor.
                base, limit = slot * g.unit_bytes, g.tensor_bytes - slot * g.unit_bytes
            check_source_spans(offsets, lengths, limit)
            check_layouts(g.layout, layout, blocks=slot < 0, what=f"cache {entry.cache_id}")
            bases = entry.addrs[tensors] + np.uint64(base)
            shm_info = None
            if shm and entry.shm is not None:
                fds, inos, offs = entry.shm
                shm_info = (fds[tensors], inos[tensors], offs[tensors] + np.uint64(base))
            reserve = (read and binding is not None and kid is not None and entry.owned
                       and not kid.is_prefix)
            if reserve:
                assert binding is not None and binding.reserved is not None
                if bool(binding.reserved[tensors].any()):
                    raise CacheNotFound(
                        f"req_id={key.a} model_id={key.b} is being read by another request: "
                        "one read consumes it"
                    )
                binding.reserved[tensors] = True
            entry.leases += 1
            return Lease(entry, bases, tensors, offsets, lengths, binding, kid, shm_info,
                         reserved=reserve)

    def close(self, lease: Lease, ok: bool, *, consume: bool = True) -> None:
        """End a lease: :meth:`unlease`, then :meth:`settle` with ``ok and consume``. A
        successful read may consume the req_id key it came through."""
        with self._lock:
            self._unlease(lease)
            self._settle(lease, ok and consume)
            self._maybe_release(lease.entry)
            self._changed.notify_all()

    def unlease(self, lease: Lease) -> None:
        """The transfer no longer touches the memory (the bytes are sent), but whether the
        read was good is not known yet: keep the key's reservation for :meth:`settle`."""
        with self._lock:
            self._unlease(lease)
            self._maybe_release(lease.entry)
            self._changed.notify_all()

    def settle(self, lease: Lease, ok: bool) -> None:
        """The verdict on a read whose memory lease ended (:meth:`unlease`): ``ok`` commits
        its reservation (and may consume the key), otherwise it is dropped."""
        with self._lock:
            self._settle(lease, ok)
            self._maybe_release(lease.entry)
            self._changed.notify_all()

    def _unlease(self, lease: Lease) -> None:
        if lease.memory_held:
            lease.memory_held = False
            lease.entry.leases -= 1

    def _settle(self, lease: Lease, ok: bool) -> None:
        if not lease.reserved:
            return
        lease.reserved = False
        entry, b, key = lease.entry, lease.binding, lease.key
        assert b is not None and b.reserved is not None and key is not None
        b.reserved[lease.tensors] = False
        if ok and key in entry.keys and self._keys.get(key) is b:
            b.pulled[lease.tensors] = True
            if b.pulled.all():
                del self._keys[key]
                entry.keys.discard(key)

    def open_addresses(
        self, tensors: np.ndarray, offsets: np.ndarray, lengths: np.ndarray
    ) -> Lease:
        """Owner side of a write by raw addresses (``KeyKind.ADDRESS``): ``tensors`` is
        ``[0]`` and ``offsets`` are absolute addresses in our memory. Every span must lie
        inside one tensor of one remote-accessible cache (the one holding the lowest
        address); that cache is leased as for any write.

        Raises CacheNotFound when no cache holds the lowest address, InvalidArgument when
        only a cache that is not remote accessible does, when a span leaves the tensor, or
        when the request is malformed.
        """
        if len(tensors) != 1 or int(tensors[0]) != 0:
            raise InvalidArgument("an address write names exactly one pseudo-tensor, 0")
        if not len(lengths) or len(offsets) != len(lengths):
            raise InvalidArgument("an address write needs spans")
        check_request_size(tensors, offsets)
        first = int(offsets.min())
        with self._lock:
            found: tuple[CacheEntry, int] | None = None
            private: CacheEntry | None = None
            for entry in self._by_id.values():
                size = entry.geometry.tensor_bytes
                hit = np.flatnonzero((entry.addrs <= first) & (first < entry.addrs + size))
                if not hit.size:
                    continue
                if not entry.remote_accessible or entry.closing:
                    private = entry
                    continue
                found = (entry, int(entry.addrs[hit[0]]))
                break
            if found is None:
                if private is not None:
                    raise InvalidArgument(
                        f"cache {private.cache_id} is not remote accessible")
                raise CacheNotFound(f"address {first:#x} is in no registered cache")
            entry, start = found
            # offsets below start wrap to huge values and fail the check, as they should
            check_source_spans(offsets - np.uint64(start), lengths, entry.geometry.tensor_bytes)
            entry.leases += 1
            # As for any lease: the base is the tensor's, the offsets relative to it.
            base = np.uint64(start)
            return Lease(entry, np.array([base], dtype=U64), tensors, offsets - base, lengths,
                         None, None)
