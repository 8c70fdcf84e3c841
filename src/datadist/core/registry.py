"""The local registry: this process's caches, the keys they are bound to, and their lifetimes.

Who calls: :class:`datadist.core.native.NativeEngine` (and through it the facade,
``datadist/api``) keeps here its own bookkeeping of every cache it registers or allocates: its
``cache_id`` (counted from 1), geometry and addresses, the CacheKeys and BlocksCacheKey model id
bound to it, and the local transfers (pulls into it, local copies) that hold it. Peers never
reach this module: the engine mirrors every cache into the C++ core's registry
(``cpp/src/registry.{h,cc}``), which resolves, checks, leases and consumes what peers ask for
(the owner's rules, docs/protocol.md; its tests are ``cpp/tests/registry_test.cc``). What the
core's threads did to keys and pool memory comes back through ``NativeEngine._sync``
(:meth:`Registry.remove_key` for a consumed key; the pools free on the core's word).

Lifetime rules kept here (the core keeps the same for peers' reads):

1. A pool-allocated cache is held by its cache_id and by each bound key. ``deallocate`` drops
   the id; the entry is released (``free``) when no key and no hold is left.
2. A local transfer *holds* the entry (``hold`` / ``unhold``) from its start until its bytes
   have moved; ``unregister`` waits (bounded) for the holds, and while it waits no new hold
   is given.

The requester's own checks (``MAX_REQUEST_SPANS``, :func:`check_request_size`) and the
CacheKey -> :class:`KeyId` mapping (:func:`key_id`) live here too.

Thread-safe: one lock guards all maps; waiting for holds uses a condition on that lock. Nothing
blocks except ``unregister`` and ``wait_unleased`` (bounded by their ``wait``).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from datadist.core.errors import CacheNotFound, InvalidArgument, Timeout
from datadist.core.layout import U64, Geometry

UINT64_MAX = 2**64 - 1
# Most spans (tensors x spans per tensor, counted after the expansion) one peer request may
# name (docs/protocol.md; the core's owner refuses more, kMaxRequestSpans in
# cpp/src/registry.h). Requesters check their own plans against it (core/native.py), so an
# honest request is never refused by the owner.
MAX_REQUEST_SPANS = 1 << 22


@dataclass(frozen=True, slots=True)
class KeyId:
    """A local key: a req_id or a prefix_id, within a model_id. Cluster ids are not part."""

    value: int
    model_id: int
    is_prefix: bool = False


@dataclass(eq=False)
class CacheEntry:
    """A registered cache: its geometry, the base address of each tensor, who owns the memory,
    the keys bound to it, and how many local transfers hold it."""

    cache_id: int
    geometry: Geometry
    addrs: np.ndarray  # uint64, base address of each tensor
    owned: bool  # allocated from a pool (True) or registered user memory (False)
    placement: int = 0
    remote_accessible: bool = True
    free: Callable[[], None] | None = None  # called once when nothing holds it any more
    keys: set[KeyId] = field(default_factory=set)
    blocks_model_id: int | None = None
    leases: int = 0  # local transfers holding it (hold / unhold)
    closing: bool = False  # being unregistered or cleared: no new hold is given
    id_held: bool = True
    released: bool = False

    def __repr__(self) -> str:
        g = self.geometry
        kind = "blocks" if g.is_blocks else "cache"
        return (
            f"<CacheEntry {kind} id={self.cache_id} tensors={g.num_tensors} "
            f"units={g.units} unit_bytes={g.unit_bytes} owned={self.owned} "
            f"keys={len(self.keys)} leases={self.leases}>"
        )


def check_request_size(tensors: np.ndarray, offsets: np.ndarray) -> None:
    """A requester's check of its own plan, before it asks (the core's owner refuses the
    same): at most MAX_REQUEST_SPANS spans after the tensors x spans expansion, and no tensor
    named twice. Vectorised; O(T log T). Raises InvalidArgument."""
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
        self._keys: dict[KeyId, CacheEntry] = {}
        # Every entry not released yet, however it is still held (by id, key or hold): what
        # finalize must wait for before unmapping pools.
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
    ) -> CacheEntry:
        """Create an entry and bind its keys (key i -> slot i; the core resolves them and
        ``blocks_model_id``, kept here as the entry's). Atomic: all or nothing. Raises
        InvalidArgument (address count, keys)."""
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
            )
            self._by_id[entry.cache_id] = entry
            self._live.add(entry)
            for k in real:
                self._keys[k] = entry
                entry.keys.add(k)
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

    def _maybe_release(self, entry: CacheEntry) -> None:
        """Release the entry once nothing holds it: no id, key or hold. Lock held."""
        if entry.released or entry.id_held or entry.keys or entry.leases:
            return
        entry.released = True
        self._live.discard(entry)
        if entry.free is not None:
            entry.free()
        self._changed.notify_all()

    def unregister(self, cache_id: int, wait: float = 30.0) -> None:
        """Forget a registered cache and its keys; waits (bounded) for its holds.

        Unknown ids are a no-op. While it waits no new hold is given; if holds outlive
        ``wait`` it raises Timeout and the cache stays registered (its memory is still in use:
        do not free it).
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

        The entry is released when no key or hold keeps it any more. Unknown ids and
        registered caches are a no-op.
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
        """Unbind a key of a pool cache (remove_cache_key, or a key a peer's read consumed in
        the core). Unknown keys and keys on user memory: no-op."""
        with self._lock:
            entry = self._keys.get(key)
            if entry is None or not entry.owned:
                return
            del self._keys[key]
            entry.keys.discard(key)
            self._maybe_release(entry)

    def wait_unleased(self, entries: list[CacheEntry], wait: float) -> int:
        """Wait up to ``wait`` s until none of ``entries`` is held; returns how many still
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
        """Drop everything (finalize): no id or key resolves any more. Returns
        every entry not released yet, however it was held (a deallocated cache still bound
        to a key, one a local transfer still holds), so that the caller can wait for their
        holds before it unmaps the memory."""
        with self._lock:
            entries = list(self._live)
            for e in entries:
                e.closing = True
            self._by_id.clear()
            self._keys.clear()
            return entries

    # ---------------------------------------------------------------- holds

    def hold(self, cache_id: int) -> CacheEntry:
        """Hold a local cache for the duration of a local transfer (a pull's destination, a
        local copy's side). Raises CacheNotFound for an unknown cache or one being
        unregistered. Not blocking."""
        with self._lock:
            entry = self._by_id.get(cache_id)
            if entry is None or entry.closing:
                raise CacheNotFound(f"cache {cache_id} does not exist")
            entry.leases += 1
            return entry

    def unhold(self, entry: CacheEntry) -> None:
        """End a hold. Not blocking."""
        with self._lock:
            entry.leases -= 1
            self._maybe_release(entry)
            # unregister (and finalize's wait_unleased) waits for the last hold: wake it.
            # Both mark the entry closing before they wait, under this lock: only then is
            # there anyone to wake (a Condition's notify costs ~1 us a pull).
            if entry.closing:
                self._changed.notify_all()
