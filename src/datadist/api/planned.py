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
from collections.abc import Hashable
from typing import Any

from datadist.api.types import BlocksCacheKey, CacheKey, CacheKeyByIdAndIndex
from datadist.core.prepared import KEPT, SMALL_REQUEST, Prepared

_LAYER_KWARGS = frozenset(("src_layer_range", "dst_layer_range", "tensor_num_per_layer"))


def new_map() -> Prepared[Any]:
    """A map of planned requests (at most KEPT, and KEPT_ROWS spans in all)."""
    return Prepared(KEPT, lambda req: int(req.call.spans))


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
    ``int`` (exactly) or None by itself (None: another keyword or value type). One loop, no
    generator: a per-layer pull passes here once a layer."""
    if not kwargs:
        return ()
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
    """The key of a ``pull_blocks`` call (None: it has none, take the full path)."""
    key = key_fields(src_cache_key)
    src = blocks_bytes(src_blocks)
    dst = blocks_bytes(dst_blocks)
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
