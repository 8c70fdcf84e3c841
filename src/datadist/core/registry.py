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
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from datadist.core.dtypes import in_elements
from datadist.core.errors import (
    CacheNotFound,
    InvalidArgument,
    NotSupported,
    Timeout,
)
from datadist.core.layout import (
    U64,
    Geometry,
    check_layouts,
    check_source_spans,
    max_int,
    span_outside,
)
from datadist.transport.fence import Fence
from datadist.transport.iov import iovecs, span_iov
from datadist.wire.protocol import KeyKind, KeyRef

log = logging.getLogger(__name__)

UINT64_MAX = 2**64 - 1
# Most spans (tensors x spans per tensor, counted after the expansion) one peer request may
# name. The owner builds one iovec per span (16 bytes, plus numpy temporaries while it is
# built), so without a cap a sub-megabyte Read (40k tensor indexes x 40k spans) makes it
# allocate tens of GB. 2**22 spans cost the owner ~200 MB at the peak and a few hundred ms,
# and still cover 26k uncoalesced blocks in each of 160 tensors. Requesters check their own
# plans against it (core/native.py), so an honest request is never refused by the owner.
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
    # whole-cache leases of same-host readers (Registry.lease_cache): revoked when the entry
    # leaves its id or model id, drained before its memory goes
    fence: Fence | None = None
    # revoked fences a new one replaced (the cache was leased again): copies under them
    # must end too before the memory goes
    old_fences: list[Fence] = field(default_factory=list)
    draining: bool = False  # released, but a leased copy is still in flight

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
        on it then expires sooner. Lock-free: a stale answer only moves
        an expiry by one sweep."""
        e = self.entry
        return e.closing or (not e.id_held and not e.keys)

    def iov(self) -> tuple[np.ndarray, np.ndarray]:
        return span_iov(self.bases, self.offsets, self.lengths)

    def iovecs(self) -> np.ndarray:
        """The leased spans as an ``(n, 2)`` iovec array."""
        return iovecs(self.bases, self.offsets, self.lengths)


# The one answer to an address-keyed write the owner refuses for where it points.
ADDRESS_REFUSED = ("the addresses do not lie inside one tensor of a remote-accessible "
                   "registered cache (spans of >= 1 byte)")


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


def _revoke(entry: CacheEntry) -> None:
    """End the whole-cache leases of ``entry``: no leased copy starts from now on."""
    if entry.fence is not None:
        entry.fence.revoke()


def _drained(entry: CacheEntry) -> bool:
    """No leased copy of ``entry`` in flight, under its fence or any fence it had before
    (meaningful once revoked). Old fences found drained are closed."""
    if entry.old_fences:
        busy = [f for f in entry.old_fences if not f.drained()]
        for f in entry.old_fences:
            if f not in busy:
                f.close()
        entry.old_fences = busy
        if busy:
            return False
    return entry.fence is None or entry.fence.drained()


def close_fences(entry: CacheEntry) -> None:
    """Close every fence of ``entry`` (finalize, once nothing is in flight). Readers keep
    their own files, with the revoked flag set."""
    for f in entry.old_fences:
        f.close()
    entry.old_fences = []
    if entry.fence is not None:
        entry.fence.close()


def _check_servable(entry: CacheEntry) -> None:
    if entry.closing:
        raise CacheNotFound(f"cache {entry.cache_id} is being unregistered")
    if not entry.remote_accessible:
        raise InvalidArgument(f"cache {entry.cache_id} is not remote accessible")


def check_read(g: Geometry, cache_id: int | None, slot: int, unit_bytes: int,
               tensors: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, layout: int,
               whole: bool = False) -> int:
    """Every check of a request's spans against the cache it names (the owner's, or a
    reader's own with a lease on the whole cache; ``cache_id`` None: a remote cache whose id
    the reader does not know): tensor indexes, request size, block size, batch index, span
    bounds, layouts. Returns the byte offset of the source unit within each tensor (0 for
    block addressing, ``slot``: -1). Raises InvalidArgument."""
    name = "the remote cache" if cache_id is None else f"cache {cache_id}"
    if whole and len(tensors) != g.num_tensors:
        raise InvalidArgument(
            f"the requester's cache has {len(tensors)} tensors, {name} {g.num_tensors}: a pull "
            "without layer ranges needs the same count on both sides")
    if len(tensors) and max_int(tensors) >= g.num_tensors:
        raise InvalidArgument(
            f"tensor {max_int(tensors)} out of range: {name} has {g.num_tensors}"
        )
    check_request_size(tensors, offsets)
    if slot < 0:
        if unit_bytes and unit_bytes != g.unit_bytes:
            raise InvalidArgument(
                f"block size mismatch: the requester's blocks hold "
                f"{in_elements(unit_bytes, layout)}, {name}'s "
                f"{in_elements(g.unit_bytes, g.layout)}"
            )
        base, limit = 0, g.tensor_bytes
        bad = span_outside(offsets, lengths, limit) if g.is_blocks else None
        if bad is not None and bad[1]:  # in blocks, as the destination side says it
            last = (bad[0] + max(bad[1], 1) - 1) // g.unit_bytes
            raise InvalidArgument(f"src block {last} out of range: {name} has {g.units} "
                                  "blocks")
    else:
        if slot >= g.units:
            raise InvalidArgument(
                f"batch index {slot} out of range: {name} has {g.units}"
            )
        # A slot read may run past the slot into the following ones (a contiguous
        # source split into blocks reads the whole tensor from slot 0), never past
        # the tensor.
        base, limit = slot * g.unit_bytes, g.tensor_bytes - slot * g.unit_bytes
    check_source_spans(offsets, lengths, limit)
    check_layouts(g.layout, layout, blocks=slot < 0, what=name)
    return base


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
                old = self._blocks.get(blocks_model_id)
                if old is not None:  # leases through the model id named the old cache
                    _revoke(old)
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
        """Give the memory back once nothing holds the entry: no id, key or lease, and no
        leased copy in flight (else a thread waits for those to drain). Lock held."""
        if entry.released or entry.id_held or entry.keys or entry.leases or entry.draining:
            return
        _revoke(entry)
        if not _drained(entry):
            entry.draining = True
            threading.Thread(target=self._release_drained, args=(entry,), daemon=True,
                             name=f"datadist-drain-{entry.cache_id}").start()
            return
        entry.released = True
        self._live.discard(entry)
        close_fences(entry)
        if entry.free is not None:
            entry.free()
        self._changed.notify_all()

    def _release_drained(self, entry: CacheEntry) -> None:
        """Wait (without end: a reader stopped mid-copy keeps the memory, which is safe)
        until no leased copy of ``entry`` is in flight, then release it."""
        pause, waited, warned = 0.0005, 0.0, False
        while True:
            time.sleep(pause)
            waited += pause
            pause = min(pause * 2, 0.05)
            with self._lock:
                if _drained(entry):
                    entry.draining = False
                    self._maybe_release(entry)
                    return
            if waited > 5 and not warned:
                warned = True
                log.warning("cache %d: a same-host reader has been copying from it for %.0f "
                            "s; its memory is kept until the copy ends", entry.cache_id, waited)

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
            _revoke(entry)
            while entry.leases or not _drained(entry):
                left = deadline - time.monotonic()
                if left <= 0:
                    entry.closing = False
                    raise Timeout(
                        f"cache {cache_id} is still being transferred after {wait:.0f} s; "
                        "it stays registered"
                    )
                # leased copies end without telling us: poll the fence meanwhile
                self._changed.wait(left if _drained(entry) else min(left, 0.001))
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
            _revoke(entry)  # leases by cache id (or model id) end with the id
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
                busy = sum(1 for e in entries if e.leases or e.draining or not _drained(e))
                left = deadline - time.monotonic()
                if not busy or left <= 0:
                    return busy
                self._changed.wait(min(left, 0.001))

    def clear(self) -> list[CacheEntry]:
        """Drop everything (finalize): no id, key or model id resolves any more. Returns
        every entry whose memory was not released yet, however it was held (a deallocated
        cache still bound to a key, one whose last reader is still at work), so that the
        caller can wait for their leases before it unmaps the memory."""
        with self._lock:
            entries = list(self._live)
            for e in entries:
                e.closing = True
                _revoke(e)
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
            # unregister (and finalize's wait_unleased) waits for the last hold (a pull into
            # the cache, in another thread or issued): without this it slept its whole 30 s
            # bound. Both mark the entry closing before they wait, under this lock: only
            # then is there anyone to wake (a Condition's notify costs ~1 us a pull).
            if entry.closing:
                self._changed.notify_all()

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
        whole: bool = False,
    ) -> Lease:
        """Owner side of a peer's read (``read``) or write: resolve, bounds-check, lease.
        ``whole``: the read names every tensor of the requester's cache (ReadFlags.WHOLE).

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
                _check_servable(entry)
            else:
                entry, slot = self._named(key)
            base = check_read(entry.geometry, entry.cache_id, slot, unit_bytes, tensors,
                              offsets, lengths, layout, whole)
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

    def _named(self, key: KeyRef) -> tuple[CacheEntry, int]:
        """The servable entry a CACHE_ID or BLOCKS_KEY key names, and its source unit (-1 for
        block addressing). Lock held."""
        if key.kind == KeyKind.CACHE_ID:
            found = self._by_id.get(key.a)
            if found is None:
                raise CacheNotFound(f"cache {key.a} does not exist")
            slot = key.b
        else:
            found = self._blocks.get(key.b)
            if found is None:
                raise CacheNotFound(
                    f"no blocks cache registered for model_id={key.b} (the owner must "
                    "register_blocks_cache with BlocksCacheKey(its cluster id, "
                    f"{key.b}))")
            slot = -1
        _check_servable(found)
        return found, slot

    def lease_cache(self, key: KeyRef) -> tuple[CacheEntry, Fence]:
        """Owner side of a whole-cache lease (same-host readers; wire CacheLease): the
        entry a CACHE_ID or BLOCKS_KEY key names, and its live fence (made here, or anew
        after a revocation). The fence is revoked and drained before the entry's memory can
        go (unregister, the pool getting it back, finalize) and revoked when its
        BlocksCacheKey is bound to another cache. Raises as :meth:`open` does."""
        if key.kind not in (KeyKind.CACHE_ID, KeyKind.BLOCKS_KEY):
            raise InvalidArgument("a cache lease names a cache by id or BlocksCacheKey")
        with self._lock:
            entry, _ = self._named(key)
            if entry.fence is None or entry.fence.revoked:
                try:
                    fence = Fence()
                except OSError as e:  # out of fds or memory: the reader asks per request
                    raise NotSupported(f"no fence for a cache lease: {e}") from e
                if entry.fence is not None:
                    entry.old_fences.append(entry.fence)
                entry.fence = fence
            return entry, entry.fence

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

        Every refusal that depends on our memory (no cache holds the lowest address, a cache
        that is not remote accessible or is being unregistered holds it, a span leaves the
        tensor, a span of 0 bytes) is one InvalidArgument (LLM_PARAM_INVALID) with one
        message, ADDRESS_REFUSED: a peer (never given our addresses) cannot tell "nothing
        here" from "memory here, refused", so it cannot map our address space by probing.
        A malformed request is InvalidArgument too.
        """
        if len(tensors) != 1 or int(tensors[0]) != 0:
            raise InvalidArgument("an address write names exactly one pseudo-tensor, 0")
        if not len(lengths) or len(offsets) != len(lengths):
            raise InvalidArgument("an address write needs spans")
        check_request_size(tensors, offsets)
        if not bool(lengths.all()):
            raise InvalidArgument(ADDRESS_REFUSED)
        first = int(offsets.min())
        with self._lock:
            found: tuple[CacheEntry, int] | None = None
            for entry in self._by_id.values():
                size = entry.geometry.tensor_bytes
                hit = np.flatnonzero((entry.addrs <= first) & (first < entry.addrs + size))
                if hit.size and entry.remote_accessible and not entry.closing:
                    found = (entry, int(entry.addrs[hit[0]]))
                    break
            if found is None:
                raise InvalidArgument(ADDRESS_REFUSED)
            entry, start = found
            try:
                # offsets below start wrap to huge values and fail the check, as they should
                check_source_spans(offsets - np.uint64(start), lengths,
                                   entry.geometry.tensor_bytes)
            except InvalidArgument:
                raise InvalidArgument(ADDRESS_REFUSED) from None
            entry.leases += 1
            # As for any lease: the base is the tensor's, the offsets relative to it.
            base = np.uint64(start)
            return Lease(entry, np.array([base], dtype=U64), tensors, offsets - base, lengths,
                         None, None)
