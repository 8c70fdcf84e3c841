"""Planned requests: a pull's checked arguments and the call the core planned for them
(Engine.prepare_pull), kept for the next call with the same arguments.

A serving process repeats its pulls: the same block of a small cache, the same blocks layer
by layer. Checking the arguments and planning the transfer cost more Python time than the copy
of a 16 KiB block (issue 23: ~12 us of a 23 us call). A pull whose arguments equal those of an
earlier one that passed every check gets that call's request back here, instead of checking
and planning again.

What "equal" means is the safety of this module: the key is built only from values whose every
check is a pure function of the key, and whose type is exactly the one the checks accept
(an ``int`` and not a bool, a ``range`` by its start, stop and step, a key class by its fields,
a block list by its uint64 bytes as ``array.array`` converts it, which is what
``checks.int_list`` does to a list). Anything else (a numpy array of blocks, a subclass, an
unknown keyword, a list too long to hash cheaply) has no key: the call takes the full path.
The destination ``Cache`` is part of the key by identity (held, so its id cannot name another
object). What the key cannot cover, the caller checks on every call, hit or miss: that its
session is open, and that the local cache is still registered with the geometry the plan was
made for (an unregistered or replaced cache never reuses a plan). A link change needs nothing
here: the request names the cluster, and the engine looks its link up on every transfer.

Who calls: :class:`datadist.api.cache_manager.CacheManager`, on every pull; one map per
manager (a finalized session's map goes with it). Never blocks beyond a dict update.
"""

from __future__ import annotations

import array
import threading
from collections.abc import Callable, Hashable
from typing import Any

from datadist.api.types import BlocksCacheKey, CacheKey, CacheKeyByIdAndIndex
from datadist.core.prepared import KEPT, KEPT_ROWS, SMALL_REQUEST

_LAYER_KWARGS = frozenset(("src_layer_range", "dst_layer_range", "tensor_num_per_layer"))


def new_map() -> PlannedMap:
    """A map of planned requests (at most KEPT, and KEPT_ROWS spans in all)."""
    return PlannedMap(KEPT, lambda req: int(req.call.spans))


class PlannedMap:
    """Planned requests by key: at most ``size`` of them, and of weights adding up to at most
    ``max_weight`` (the newest always kept), the least recently used going first, as
    ``core.prepared.Prepared`` keeps them, with one lookup a hit instead of two: a hit marks
    its entry used rather than moving it to the end (which hashes and compares the key
    again, a fifth of a per-layer pull's facade), and a put that must evict passes over the
    oldest entries, moving the ones used since to the end unmarked and evicting the first
    that was not (a second chance: what an LRU map keeps while the cycle of requests fits,
    this keeps too). Thread-safe: a hit is one dict get and one store; puts take a lock."""

    def __init__(self, size: int, weight: Callable[[Any], int],
                 max_weight: int = KEPT_ROWS) -> None:
        self.size = size
        self._items: dict[Hashable, list[Any]] = {}  # key -> [value, used since passed over]
        self._lock = threading.Lock()
        self._weight = weight
        self._max_weight = max_weight
        self._weights: dict[Hashable, int] = {}
        self.total = 0  # the kept values' weight

    def __len__(self) -> int:
        return len(self._items)

    def find(self, key: Hashable) -> Any | None:
        """The value kept for ``key``, marked used, or None. Never blocks."""
        got = self._items.get(key)
        if got is None:
            return None
        got[1] = True
        return got[0]

    def put(self, key: Hashable, value: Any) -> None:
        """Keep ``value`` for ``key`` (replacing what was kept), then evict down to the
        bounds (never ``key`` itself)."""
        w = self._weight(value)
        with self._lock:
            items = self._items
            items.pop(key, None)  # a replaced value is the newest too
            items[key] = [value, False]
            self.total += w - self._weights.get(key, 0)
            self._weights[key] = w
            while len(items) > self.size or (self.total > self._max_weight and len(items) > 1):
                old = next(iter(items))
                entry = items[old]
                if entry[1] or old is key:  # used since last passed over: a second chance
                    entry[1] = False
                    del items[old]
                    items[old] = entry
                    continue
                del items[old]
                self.total -= self._weights.pop(old, 0)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._weights.clear()
            self.total = 0


def key_fields(key: Any) -> tuple[Hashable, ...] | None:
    """A cache key as part of a request's key: its class and fields (None: not one of the
    three classes exactly)."""
    t = type(key)
    if t is BlocksCacheKey:
        return (1, key._cluster_id, key._model_id)
    if t is CacheKeyByIdAndIndex:
        return (2, key._cluster_id, key._cache_id, key._batch_index)
    if t is CacheKey:
        return (3, key._cluster_id, key._req_id, key._model_id, key._prefix_id)
    return None


def blocks_bytes(blocks: Any) -> bytes | None:
    """A block list as part of a key: a list or tuple of at most SMALL_REQUEST items, as the
    uint64 bytes ``checks.int_list`` makes of it (None: anything else, or items it refuses)."""
    t = type(blocks)
    if (t is not list and t is not tuple) or len(blocks) > SMALL_REQUEST:
        return None
    try:
        return array.array("Q", blocks).tobytes()
    except (TypeError, OverflowError, ValueError):
        return None


def kwargs_key(kwargs: dict[str, Any]) -> tuple[Hashable, ...] | None:
    """A pull's layer keywords as part of a key: a ``range`` by its start, stop and step, an
    ``int`` (exactly) or None by itself (None: another keyword or value type). A per-layer
    pull (both layer ranges, nothing else) is keyed flat, six ints and no name: it passes
    here once a layer, and a key of nested tuples costs its hash twice a lookup (the map's
    get and its move to the end). Any other form is a tuple of (name, ...) tuples, which
    never equals a flat one."""
    if not kwargs:
        return ()
    if len(kwargs) == 2:
        src = kwargs.get("src_layer_range")
        dst = kwargs.get("dst_layer_range")
        if type(src) is range and type(dst) is range:
            return (src.start, src.stop, src.step, dst.start, dst.stop, dst.step)
    out: list[Hashable] = []
    for k, v in kwargs.items():
        if k not in _LAYER_KWARGS:
            return None
        t = type(v)
        if t is range:
            out.append((k, v.start, v.stop, v.step))
        elif v is None or t is int:
            out.append((k, v))
        else:
            return None
    return tuple(out)


def blocks_key(src_cache_key: Any, dst_cache: Any, src_blocks: Any, dst_blocks: Any,
               kwargs: dict[str, Any]) -> tuple[Hashable, ...] | None:
    """The key of a ``pull_blocks`` call (None: it has none, take the full path). One block
    list passed as both (a layer's blocks pulled into the same blocks) is converted once."""
    key = key_fields(src_cache_key)
    src = blocks_bytes(src_blocks)
    dst = src if dst_blocks is src_blocks else blocks_bytes(dst_blocks)
    kw = kwargs_key(kwargs)
    if key is None or src is None or dst is None or kw is None:
        return None
    return ("pull_blocks", dst_cache, key, src, dst, kw)


def slot_key(cache_key: Any, cache: Any, batch_index: Any, size: Any,
             kwargs: dict[str, Any]) -> tuple[Hashable, ...] | None:
    """The key of a ``pull_cache`` call (None: it has none, take the full path)."""
    if type(batch_index) is not int or type(size) is not int:
        return None
    key = key_fields(cache_key)
    kw = kwargs_key(kwargs)
    if key is None or kw is None:
        return None
    return ("pull_cache", cache, key, batch_index, size, kw)
