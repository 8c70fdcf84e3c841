"""Prepared transfers: plans and iovecs kept for requests that repeat.

Disaggregated serving repeats itself: the same block list is pulled layer by layer, the same
small request is made for every step. Building a plan and its iovecs costs tens of
microseconds of numpy on arrays of a few elements, more than the copy of a 16 KiB block
itself; :class:`Prepared` keeps the last results, keyed by the exact inputs they were built
from (so a hit is the same result a build would give).

Who calls: the API layer (planned requests, api/planned.py: a pull's checked arguments and
the call the core planned for them, Engine.prepare_pull; only small requests, whose keys are
cheap to hash) and the engine (the core's prepared calls: of a raw plan, keyed by plan, local
cache, cluster, key and direction; of transfer_cache_async's destinations, every layer's
calls keyed by the whole spec, Engine.prepare_layer_pushes: the core checks the local spans
when it makes one, and every run holds the cache and refuses one that is gone). What each
map saves is measured in docs/performance.md ("Round 9"; a pull's one map: "The core plans
the Python face's pulls and pushes"). Thread-safe; never blocks beyond a dict update.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

__all__ = ["KEPT", "KEPT_ROWS", "SMALL_REQUEST", "Prepared"]

_V = TypeVar("_V")

# Requests with at most this many blocks (or spans) are prepared (their keys hash in a few
# microseconds at most, and a kept request holds some tens of KiB); larger ones are built each
# time, where the build is a small part of the copy.
SMALL_REQUEST = 1024
# Values kept per map of requests: every layer of a layer-wise transfer is its own request
# (its own plan and iovecs), and a least-recently-used map smaller than the cycle of requests
# a model repeats never hits (80 layers to 4 destinations: 320).
KEPT = 512
# And at most this many rows (spans, iovecs) in all the values of a map: a server whose
# requests never repeat fills its maps with requests of up to SMALL_REQUEST spans, ~16 bytes
# a span for each array kept: 2 MiB an array here, whatever the request sizes.
KEPT_ROWS = 1 << 17


class Prepared(Generic[_V]):
    """A least-recently-used map of at most ``size`` built values, and, with ``weight``, of
    values whose weights add up to at most ``max_weight`` (the newest is always kept)."""

    def __init__(self, size: int = 128, weight: Callable[[_V], int] | None = None,
                 max_weight: int = KEPT_ROWS) -> None:
        self.size = size
        self._items: OrderedDict[Hashable, _V] = OrderedDict()
        self._lock = threading.Lock()
        self._weight = weight
        self._max_weight = max_weight
        self._weights: dict[Hashable, int] = {}
        self.total = 0  # the kept values' weight

    def __len__(self) -> int:
        return len(self._items)

    def find(self, key: Hashable) -> _V | None:
        """The value kept for ``key`` (now the most recently used), or None."""
        got = self._items.get(key)
        if got is not None:
            try:  # noqa: SIM105 - as in get
                self._items.move_to_end(key)
            except KeyError:
                pass
        return got

    def put(self, key: Hashable, value: _V) -> None:
        """Keep ``value`` for ``key`` (replacing what was kept), evicting as :meth:`get`."""
        self._store(key, value)

    def get(self, key: Hashable, build: Callable[[], _V]) -> _V:
        """The value built for ``key``, building it (outside the lock) on a miss. What
        ``build`` raises is raised and nothing is kept."""
        got = self._items.get(key)  # a hit takes no lock: each OrderedDict call is atomic
        if got is not None:
            try:  # noqa: SIM105 - contextlib.suppress costs ~1 us, on every hit
                self._items.move_to_end(key)
            except KeyError:  # evicted meanwhile: it is still the value
                pass
            return got
        value = build()
        self._store(key, value)
        return value

    def _store(self, key: Hashable, value: _V) -> None:
        w = self._weight(value) if self._weight is not None else 0
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)  # a replaced value is the newest too
            self.total += w - self._weights.get(key, 0)
            self._weights[key] = w
            while len(self._items) > self.size or (self.total > self._max_weight
                                                   and len(self._items) > 1):
                old, _ = self._items.popitem(last=False)
                self.total -= self._weights.pop(old, 0)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._weights.clear()
            self.total = 0
