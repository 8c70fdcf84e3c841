"""Value types of llm_datadist: cache descriptions, caches, keys, and the async-transfer types."""

from __future__ import annotations

import abc
import math
from typing import Any

from datadist.api.checks import check_int, check_isinstance
from datadist.api.enums import DataType, Memtype, Placement
from datadist.api.status import LLMException, LLMStatusCode, raise_if_false

UINT64_MAX = 2**64 - 1


class CacheDesc:
    """``num_tensors`` tensors of ``shape`` and ``data_type``; dim 0 counts batch slots or
    blocks. ``size`` is the bytes of one tensor."""

    def __init__(
        self,
        num_tensors: int,
        shape: list[int] | tuple[int, ...],
        data_type: DataType,
        placement: Placement = Placement.DEVICE,
        batch_dim_index: int = 0,
        seq_len_dim_index: int = -1,
        kv_tensor_format: str | None = None,
    ) -> None:
        check_int("num_tensors", num_tensors, "uint32", allow_none=False)
        check_isinstance("shape", shape, (list, tuple), allow_none=False)
        for d in shape:
            check_int("shape dim", d, "int64", allow_none=False)
        check_isinstance("data_type", data_type, DataType, allow_none=False)
        check_isinstance("placement", placement, Placement, allow_none=False)
        check_int("batch_dim_index", batch_dim_index, "int32", allow_none=False)
        check_int("seq_len_dim_index", seq_len_dim_index, "int32", allow_none=False)
        check_isinstance("kv_tensor_format", kv_tensor_format, str)
        raise_if_false(0 <= batch_dim_index < max(len(shape), 1),
                       f"batch_dim_index {batch_dim_index} out of range of shape {list(shape)}")
        raise_if_false(seq_len_dim_index == -1 or 0 <= seq_len_dim_index < len(shape),
                       f"seq_len_dim_index {seq_len_dim_index} out of range")
        self._num_tensors = num_tensors
        self._shape = list(shape)
        self._data_type = data_type
        self._placement = placement
        self._batch_dim_index = batch_dim_index
        self._seq_len_dim_index = seq_len_dim_index
        self._kv_tensor_format = kv_tensor_format

    num_tensors = property(lambda self: self._num_tensors)
    shape = property(lambda self: list(self._shape))
    data_type = property(lambda self: self._data_type)
    placement = property(lambda self: self._placement)
    batch_dim = property(lambda self: self._batch_dim_index)
    seq_len_dim_index = property(lambda self: self._seq_len_dim_index)
    kv_tensor_format = property(lambda self: self._kv_tensor_format)

    @property
    def batch_size(self) -> int:
        return self._shape[self._batch_dim_index] if self._shape else 0

    @property
    def size(self) -> int:
        """Bytes of one tensor: prod(shape) x element size."""
        if self._data_type == DataType.DT_STRING:
            raise LLMException("DT_STRING has no fixed size",
                               status_code=LLMStatusCode.LLM_PARAM_INVALID)
        return math.prod(self._shape) * self._data_type.itemsize

    def update_dim(self, dim_index: int, dim_value: int) -> None:
        check_int("dim_index", dim_index, "int32", allow_none=False)
        check_int("dim_value", dim_value, "int64", allow_none=False)
        raise_if_false(0 <= dim_index < len(self._shape), f"dim_index {dim_index} out of range")
        self._shape[dim_index] = dim_value

    def __repr__(self) -> str:
        return (
            f"CacheDesc(num_tensors={self._num_tensors}, shape={self._shape}, "
            f"data_type={self._data_type}, placement={self._placement})"
        )


class Cache:
    """A cache known to the CacheManager. Created by it, never by users (but
    ``create_cpu_cache``)."""

    def __init__(self, cache_id: int, cache_desc: CacheDesc, tensor_addrs: list[int],
                 cache_manager: Any = None, is_registered: bool = False,
                 is_blocks_cache: bool = False) -> None:
        self._cache_id = cache_id
        self._cache_desc = cache_desc
        self._tensor_addrs = list(tensor_addrs)
        self._cache_manager = cache_manager
        self._is_registered = is_registered
        self._is_blocks_cache = is_blocks_cache

    cache_id = property(lambda self: self._cache_id)
    cache_desc = property(lambda self: self._cache_desc)
    tensor_addrs = property(lambda self: list(self._tensor_addrs))
    is_blocks_cache = property(lambda self: self._is_blocks_cache)

    @classmethod
    def create_cpu_cache(cls, cache_desc: CacheDesc, addrs: list[int]) -> Cache:
        check_isinstance("cache_desc", cache_desc, CacheDesc, allow_none=False)
        check_isinstance("addrs", addrs, (list, tuple), allow_none=False)
        raise_if_false(cache_desc.placement == Placement.HOST,
                       "create_cpu_cache needs placement HOST")
        raise_if_false(len(addrs) == cache_desc.num_tensors,
                       f"{len(addrs)} addrs for {cache_desc.num_tensors} tensors")
        for a in addrs:
            check_int("addr", a, "uint64", allow_none=False)
        return cls(-1, cache_desc, list(addrs), None, True, True)

    def _clear(self) -> None:
        self._tensor_addrs = []

    def __repr__(self) -> str:
        return (
            f"Cache(cache_id = {self._cache_id}, device_tensor_addrs = "
            f"{len(self._tensor_addrs)}, is_blocks_cache = {self._is_blocks_cache})"
        )

    __str__ = __repr__


class KvCache:
    """A v1 (KvCacheManager) cache: addresses per device."""

    def __init__(self, cache_id: int, cache_desc: CacheDesc,
                 per_device_tensor_addrs: list[list[int]], kv_cache_manager: Any = None,
                 is_blocks_cache: bool = False) -> None:
        self._cache_id = cache_id
        self._cache_desc = cache_desc
        self._addrs = [list(a) for a in per_device_tensor_addrs]
        self._manager = kv_cache_manager
        self._is_blocks_cache = is_blocks_cache

    cache_id = property(lambda self: self._cache_id)
    cache_desc = property(lambda self: self._cache_desc)
    per_device_tensor_addrs = property(lambda self: [list(a) for a in self._addrs])
    is_blocks_cache = property(lambda self: self._is_blocks_cache)

    @classmethod
    def create_cpu_cache(cls, cache_desc: CacheDesc, addrs: list[int] | list[list[int]]) -> KvCache:
        check_isinstance("cache_desc", cache_desc, CacheDesc, allow_none=False)
        check_isinstance("addrs", addrs, list, allow_none=False)
        nested = addrs if addrs and isinstance(addrs[0], list) else [addrs]
        return cls(-1, cache_desc, nested, None, True)

    def __repr__(self) -> str:
        return f"KvCache(cache_id={self._cache_id}, desc={self._cache_desc})"


def _key_args(name: str, args: tuple, kwargs: dict, order: tuple[str, ...]) -> dict[str, Any]:
    """Parse llm_datadist's ``*args, **kwargs`` key constructors (``prompt_cluster_id`` alias)."""
    if len(args) + len(kwargs) > len(order):
        raise LLMException(f"{name} takes at most {len(order)} parameters",
                           status_code=LLMStatusCode.LLM_PARAM_INVALID)
    values = dict(zip(order, args))
    for k, v in kwargs.items():
        key = "cluster_id" if k == "prompt_cluster_id" else k
        if key not in order:
            raise LLMException(f"{name} got an unknown parameter {k!r}",
                               status_code=LLMStatusCode.LLM_PARAM_INVALID)
        if key in values:
            raise LLMException(f"{name} got {key!r} twice",
                               status_code=LLMStatusCode.LLM_PARAM_INVALID)
        values[key] = v
    return values


class CacheKey:
    """A request-keyed slot: ``CacheKey(cluster_id, req_id, model_id=0, prefix_id=MAX)``.

    ``cluster_id`` is the cluster that holds the cache. ``req_id = 2**64-1`` pads a slot.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        v = _key_args("CacheKey", args, kwargs, ("cluster_id", "req_id", "model_id", "prefix_id"))
        if "cluster_id" not in v or "req_id" not in v:
            raise LLMException("CacheKey needs cluster_id and req_id",
                               status_code=LLMStatusCode.LLM_PARAM_INVALID)
        v.setdefault("model_id", 0)
        v.setdefault("prefix_id", UINT64_MAX)
        for k in ("cluster_id", "req_id", "model_id", "prefix_id"):
            check_int(k, v[k], "uint64", allow_none=False)
        self._cluster_id = v["cluster_id"]
        self._req_id = v["req_id"]
        self._model_id = v["model_id"]
        self._prefix_id = v["prefix_id"]

    cluster_id = property(lambda self: self._cluster_id)
    prompt_cluster_id = property(lambda self: self._cluster_id)
    req_id = property(lambda self: self._req_id)
    model_id = property(lambda self: self._model_id)
    prefix_id = property(lambda self: self._prefix_id)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CacheKey) and self._tuple() == other._tuple()

    def __hash__(self) -> int:
        return hash(self._tuple())

    def _tuple(self) -> tuple[int, int, int, int]:
        return (self._cluster_id, self._req_id, self._model_id, self._prefix_id)

    def __repr__(self) -> str:
        return (f"CacheKey(cluster_id={self._cluster_id}, req_id={self._req_id}, "
                f"model_id={self._model_id}, prefix_id={self._prefix_id})")


class CacheKeyByIdAndIndex:
    """A remote cache by its cache_id, and a batch slot of it."""

    def __init__(self, cluster_id: int, cache_id: int, batch_index: int = 0) -> None:
        check_int("cluster_id", cluster_id, "uint64", allow_none=False)
        check_int("cache_id", cache_id, "int64", allow_none=False)
        check_int("batch_index", batch_index, "uint32", allow_none=False)
        self._cluster_id = cluster_id
        self._cache_id = cache_id
        self._batch_index = batch_index

    cluster_id = property(lambda self: self._cluster_id)
    cache_id = property(lambda self: self._cache_id)
    batch_index = property(lambda self: self._batch_index)

    def __repr__(self) -> str:
        return (f"CacheKeyByIdAndIndex(cluster_id={self._cluster_id}, "
                f"cache_id={self._cache_id}, batch_index={self._batch_index})")


class BlocksCacheKey:
    """The blocks cache a cluster registered under ``model_id``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        v = _key_args("BlocksCacheKey", args, kwargs, ("cluster_id", "model_id"))
        if "cluster_id" not in v:
            raise LLMException("BlocksCacheKey needs cluster_id",
                               status_code=LLMStatusCode.LLM_PARAM_INVALID)
        v.setdefault("model_id", 0)
        check_isinstance("cluster_id", v["cluster_id"], int, allow_none=False)
        check_isinstance("model_id", v["model_id"], int, allow_none=False)
        self._cluster_id = v["cluster_id"]
        self._model_id = v["model_id"]

    cluster_id = property(lambda self: self._cluster_id)
    prompt_cluster_id = property(lambda self: self._cluster_id)
    model_id = property(lambda self: self._model_id)

    def __repr__(self) -> str:
        return f"BlocksCacheKey(cluster_id={self._cluster_id}, model_id={self._model_id})"


class MemInfo:
    def __init__(self, mem_type: Memtype, addr: int, size: int) -> None:
        check_isinstance("mem_type", mem_type, Memtype, allow_none=False)
        check_int("addr", addr, "uint64", allow_none=False)
        check_int("size", size, "uint64", allow_none=False)
        self._mem_type, self._addr, self._size = mem_type, addr, size

    mem_type = property(lambda self: self._mem_type)
    addr = property(lambda self: self._addr)
    size = property(lambda self: self._size)


class LayerSynchronizer(abc.ABC):
    """Implemented by the user: ``synchronize_layer(i)`` returns once layer i is computed."""

    @abc.abstractmethod
    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        ...


def check_layer_range(name: str, value: Any, allow_none: bool = True) -> None:
    """A layer range is a ``range`` with step 1 and ``0 <= start < stop``."""
    check_isinstance(name, value, range, allow_none)
    if value is None:
        return
    raise_if_false(value.step == 1, f"{name} step must be 1, got {value.step}")
    raise_if_false(0 <= value.start < value.stop,
                   f"{name} must satisfy 0 <= start < stop, got {value}")


class TransferConfig:
    """A destination of ``transfer_cache_async`` by raw addresses (2 per layer)."""

    def __init__(self, dst_cluster_id: int, dst_addrs: list[int],
                 src_layer_range: range | None = None, src_batch_index: int = 0) -> None:
        self.dst_cluster_id = dst_cluster_id
        self.dst_addrs = dst_addrs
        self.src_layer_range = src_layer_range
        self.src_batch_index = src_batch_index
        self.dst_layer_range = None

    @property
    def dst_cluster_id(self) -> int:
        return self._dst_cluster_id

    @dst_cluster_id.setter
    def dst_cluster_id(self, value: int) -> None:
        check_int("dst_cluster_id", value, "uint64", allow_none=False)
        self._dst_cluster_id = value

    @property
    def dst_addrs(self) -> list[int]:
        return self._dst_addrs

    @dst_addrs.setter
    def dst_addrs(self, value: list[int]) -> None:
        check_isinstance("dst_addrs", value, (list, tuple), allow_none=False)
        for a in value:
            check_int("dst_addr", a, "uint64", allow_none=False)
        self._dst_addrs = list(value)

    @property
    def src_layer_range(self) -> range | None:
        return self._src_layer_range

    @src_layer_range.setter
    def src_layer_range(self, value: range | None) -> None:
        check_layer_range("src_layer_range", value)
        self._src_layer_range = value

    @property
    def src_batch_index(self) -> int:
        return self._src_batch_index

    @src_batch_index.setter
    def src_batch_index(self, value: int) -> None:
        check_int("src_batch_index", value, "uint32", allow_none=False)
        self._src_batch_index = value


class TransferWithCacheKeyConfig:
    """A destination of ``transfer_cache_async`` by cache key (remote-accessible mode)."""

    def __init__(self, cache_key: BlocksCacheKey | CacheKeyByIdAndIndex,
                 src_layer_range: range | None = None, dst_layer_range: range | None = None,
                 src_batch_index: int = 0) -> None:
        check_isinstance("cache_key", cache_key, (BlocksCacheKey, CacheKeyByIdAndIndex),
                         allow_none=False)
        check_layer_range("src_layer_range", src_layer_range)
        check_layer_range("dst_layer_range", dst_layer_range)
        check_int("src_batch_index", src_batch_index, "uint32", allow_none=False)
        self.cache_key = cache_key
        self.src_layer_range = src_layer_range
        self.dst_layer_range = dst_layer_range
        self.src_batch_index = src_batch_index
        self.dst_cluster_id = cache_key.cluster_id
