"""The engine's view of llm_datadist's values: a ``CacheDesc`` as a core ``Geometry``, a
cache key as the wire's ``KeyRef``.

Who calls: the api modules that move data (cache_manager, local_ops, v1), on every call;
pure functions, never block.
"""

from __future__ import annotations

import functools
import math

from datadist.api.enums import DataType
from datadist.api.status import llm_errors, raise_if_false
from datadist.api.types import BlocksCacheKey, CacheDesc, CacheKey, CacheKeyByIdAndIndex
from datadist.core import layout
from datadist.core.keys import KeyKind, KeyRef

_U64 = 2**64 - 1


def layer_pair(r: range | None) -> tuple[int, int] | None:
    """A checked layer range (step 1) as the ``(start, stop)`` pair Engine.prepare_pull takes."""
    return None if r is None else (r.start, r.stop)


def geometry_of(desc: CacheDesc, *, blocks: bool) -> layout.Geometry:
    """The engine's view of a CacheDesc. Memoised: every pull asks for it, and it is a pure
    function of the description."""
    return _geometry(desc.num_tensors, tuple(desc.shape), desc.data_type, blocks)


@functools.lru_cache(maxsize=4096)
def _geometry(num_tensors: int, shape: tuple[int, ...], dtype: DataType,
              blocks: bool) -> layout.Geometry:
    raise_if_false(len(shape) >= 1, "cache shape must have at least one dim")
    raise_if_false(len(shape) <= 32, "cache shape must have at most 32 dims")
    raise_if_false(all(d > 0 for d in shape), f"shape dims must be > 0: {list(shape)}")
    raise_if_false(num_tensors > 0, "num_tensors must be > 0")
    raise_if_false(dtype != DataType.DT_STRING, "DT_STRING has no fixed size")
    with llm_errors():
        return layout.Geometry(num_tensors, math.prod(shape) * dtype.itemsize, shape[0], blocks,
                               layout.layout_tag(dtype.value, shape[1:]))


def describe(desc: CacheDesc, *, blocks: bool) -> str:
    """A cache as a mismatch error shows it, in the caller's terms: "2 tensors of [4, 8, 8]
    DT_FLOAT16, 128 bytes per block". Who calls: the checks that compare two caches (or a
    cache and a peer's), for both sides; only when they raise."""
    shape = list(desc.shape)
    per = "block" if blocks else "batch slot"
    try:
        unit = math.prod(shape[1:]) * desc.data_type.itemsize
    except (TypeError, ValueError):  # DT_STRING and the like: no size to give
        return f"{desc.num_tensors} tensors of {shape} {desc.data_type.name}"
    return f"{desc.num_tensors} tensors of {shape} {desc.data_type.name}, {unit} bytes per {per}"


def key_ref(key: CacheKey | CacheKeyByIdAndIndex | BlocksCacheKey) -> KeyRef:
    """How the wire names a remote cache for each of llm_datadist's key kinds."""
    if isinstance(key, CacheKey):
        return KeyRef(KeyKind.CACHE_KEY, key.req_id, key.model_id, key.prefix_id)
    if isinstance(key, CacheKeyByIdAndIndex):
        return KeyRef(KeyKind.CACHE_ID, key.cache_id & _U64, key.batch_index, 0)
    return KeyRef(KeyKind.BLOCKS_KEY, 0, key.model_id & _U64, 0)
