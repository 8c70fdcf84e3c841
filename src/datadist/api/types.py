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
        check_isinstance("batch_dim_index", batch_dim_index, int, allow_none=False)
        check_int("seq_len_dim_index", seq_len_dim_index, "int32", allow_none=False)
        check_isinstance("kv_tensor_format", kv_tensor_format, str)
        raise_if_false(0 <= batch_dim_index < len(shape),
                       f"batch_dim_index {batch_dim_index} out of range, [0, {len(shape)})")
        raise_if_false(seq_len_dim_index == -1 or 0 <= seq_len_dim_index < len(shape),
                       f"seq_len_dim_index {seq_len_dim_index} is invalid, should be -1 or in "
                       f"range [0, {len(shape)})")
        self._num_tensors = num_tensors
        self._shape = shape  # the caller's list (or tuple), as llm_datadist keeps it
        self._data_type = data_type
        self._placement = placement
        self._batch_dim_index = batch_dim_index
        # As llm_datadist: read once here; update_dim changes the shape, not this.
        self._batch_size = shape[batch_dim_index]
        self._seq_len_dim_index = seq_len_dim_index
        self._kv_tensor_format = kv_tensor_format

    num_tensors = property(lambda self: self._num_tensors)
    shape = property(lambda self: self._shape)
    data_type = property(lambda self: self._data_type)
    placement = property(lambda self: self._placement)
    batch_dim = property(lambda self: self._batch_dim_index)
    seq_len_dim_index = property(lambda self: self._seq_len_dim_index)
    kv_tensor_format = property(lambda self: self._kv_tensor_format)

    @property
    def batch_size(self) -> int:
        """dim ``batch_dim_index`` of the shape given to the constructor (llm_datadist's
        v2/llm_types.py keeps it: ``update_dim`` leaves it as it was)."""
        return self._batch_size

    @property
    def size(self) -> int:
        """Bytes of one tensor: prod(shape) x element size."""
        if self._data_type == DataType.DT_STRING:
            raise LLMException("DT_STRING has no fixed size",
                               status_code=LLMStatusCode.LLM_PARAM_INVALID)
        if any(d < 0 for d in self._shape):  # a dynamic (-1) dim: llm_datadist fails too
            raise LLMException(f"Failed to calc tensor size, shape = {self._shape}, "
                               f"data_type = {self._data_type}")
        return math.prod(self._shape) * self._data_type.itemsize

    def update_dim(self, dim_index: int, dim_value: int) -> None:
        """Set one dim of the shape (the caller's list, changed in place). ``size`` follows
        the new shape; ``batch_size`` keeps its value, as in llm_datadist."""
        check_int("dim_index", dim_index, "int32", allow_none=False)
        check_int("dim_value", dim_value, "int64", allow_none=False)
        raise_if_false(0 <= dim_index < len(self._shape), f"dim_index {dim_index} out of range")
        shape = self._shape
        if isinstance(shape, tuple):  # the caller's tuple, kept as given: not updatable
            raise TypeError("'tuple' object does not support item assignment")
        shape[dim_index] = dim_value

    def __repr__(self) -> str:
        # llm_datadist's exact text, including the missing space before kv_tensor_format.
        return (
            f"CacheDesc(num_tensors={self._num_tensors}, shape={self._shape}, "
            f"data_type={self._data_type}, placement={self._placement}, "
            f"batch_dim_index={self._batch_dim_index}, "
            f"seq_len_dim_index={self._seq_len_dim_index},"
            f"kv_tensor_format={self._kv_tensor_format})"
        )


class Cache:
    """A cache known to the CacheManager. Created by it, never by users (but
    ``create_cpu_cache``)."""

    def __init__(self, cache_id: int, cache_desc: CacheDesc, tensor_addrs: list[int],
                 cache_manager: Any, is_registered: bool, is_blocks_cache: bool) -> None:
        check_int("cache_id", cache_id, "int64", allow_none=False)
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
        """A HOST blocks cache over user memory, for ``swap_blocks``; never registered."""
        check_isinstance("cache_desc", cache_desc, CacheDesc, allow_none=False)
        check_isinstance("addrs", addrs, list, allow_none=False)
        for a in addrs:
            check_isinstance("addrs item", a, int, allow_none=False)
        raise_if_false(cache_desc.placement == Placement.HOST, "cache_desc placement must be HOST")
        raise_if_false(len(addrs) == cache_desc.num_tensors,
                       f"cache_desc num_tensors:{cache_desc.num_tensors} not equal addrs "
                       f"num:{len(addrs)}")
        for a in addrs:
            check_int("addr", a, "uint64", allow_none=False)
        return cls(-1, cache_desc, list(addrs), None, True, True)

    def _clear(self) -> None:
        self._tensor_addrs = []

    def __str__(self) -> str:
        return (
            f"Cache(cache_id = {self._cache_id}, device_tensor_addrs = "
            f"{len(self._tensor_addrs)}, is_blocks_cache = {self._is_blocks_cache})"
        )

    __repr__ = __str__


class KvCache:
    """A v1 (KvCacheManager) cache: addresses per device (one device here).

    Created by ``KvCacheManager``, never by users (but ``create_cpu_cache``). Whether it is a
    blocks cache is the manager's business (``_is_blocks_cache``), as in llm_datadist, where
    the native side keeps it.
    """

    def __init__(self, cache_id: int, cache_desc: CacheDesc,
                 per_device_tensor_addrs: list[list[int]], kv_cache_manager: Any) -> None:
        check_int("cache_id", cache_id, "int64", allow_none=False)
        self._cache_id = cache_id
        self._cache_desc = cache_desc
        self._addrs = [list(a) for a in per_device_tensor_addrs]
        self._manager = kv_cache_manager
        self._is_blocks_cache = False
        # Set by KvCacheManager for pool caches: frees the cache if this object goes away
        # without deallocate_cache, as llm_datadist's KvCache.__del__ does.
        self._finalizer: Any = None

    cache_id = property(lambda self: self._cache_id)
    cache_desc = property(lambda self: self._cache_desc)
    per_device_tensor_addrs = property(lambda self: [list(a) for a in self._addrs])

    @classmethod
    def create_cpu_cache(cls, cache_desc: CacheDesc, addrs: list[int] | list[list[int]]) -> KvCache:
        """A HOST cache over user memory for ``swap_blocks``: ``addrs`` is one address per
        tensor, or one such list per device; every list has ``num_tensors`` ints."""
        check_isinstance("cache_desc", cache_desc, CacheDesc, allow_none=False)
        raise_if_false(cache_desc.placement == Placement.HOST, "cache_desc placement must be HOST")
        check_isinstance("addrs", addrs, list, allow_none=False)
        raise_if_false(len(addrs) > 0, "addrs length should be bigger than zero.")
        first = type(addrs[0])
        for a in addrs:
            check_isinstance("the internal element of addrs", a, (list, int), allow_none=False)
            raise_if_false(type(a) is first,
                           "the type of the internal element of addrs should be consistent.")
        nested = addrs if isinstance(addrs[0], list) else [addrs]
        for per_device in nested:
            for a in per_device:
                check_int("the internal element of addrs", a, "uint64", allow_none=False)
            raise_if_false(len(per_device) == cache_desc.num_tensors,
                           f"cache_desc num_tensors:{cache_desc.num_tensors} should be equal to "
                           f"size of addrs:{len(per_device)}")
        cache = cls(-1, cache_desc, nested, None)
        cache._is_blocks_cache = True
        return cache

    def __str__(self) -> str:
        return f"KvCache(cache_id = {self._cache_id}, num_devices = {len(self._addrs)})"

    __repr__ = __str__


def _key_args(name: str, args: tuple[Any, ...], kwargs: dict[str, Any],
              order: tuple[str, ...], required: tuple[str, ...] = ()) -> dict[str, Any]:
    """Parse llm_datadist's ``*args, **kwargs`` key constructors as it does: at most
    ``len(order)`` arguments in all; a positional argument wins over the same keyword;
    ``cluster_id`` wins over its alias ``prompt_cluster_id``; a missing ``cluster_id`` (or
    ``required`` argument) and then an unknown keyword are LLM_PARAM_INVALID, with the
    original's texts (v2/llm_types.py)."""
    if len(args) + len(kwargs) > len(order):
        raise LLMException(f"Param num is over limit ({name})",
                           status_code=LLMStatusCode.LLM_PARAM_INVALID)
    given = {**kwargs, **dict(zip(order, args, strict=False))}
    for k in ("cluster_id", *required):
        if k not in given and not (k == "cluster_id" and "prompt_cluster_id" in given):
            what = "prompt_cluster_id or cluster_id" if k == "cluster_id" else k
            raise LLMException(f"Param {what} is required ({name})",
                               status_code=LLMStatusCode.LLM_PARAM_INVALID)
    for k in given:
        if k not in order and k != "prompt_cluster_id":
            raise LLMException(f"Unsupported param:{k} ({name})",
                               status_code=LLMStatusCode.LLM_PARAM_INVALID)
    if "cluster_id" not in given and "prompt_cluster_id" in given:
        given["cluster_id"] = given["prompt_cluster_id"]
    given.pop("prompt_cluster_id", None)
    return given


class CacheKey:
    """A request-keyed slot: ``CacheKey(cluster_id, req_id, model_id=0, prefix_id=MAX)``.

    ``cluster_id`` is the cluster that holds the cache. ``req_id = 2**64-1`` pads a slot.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if not kwargs and len(args) == 2 and type(args[0]) is int and type(args[1]) is int \
                and 0 <= args[0] <= UINT64_MAX and 0 <= args[1] <= UINT64_MAX:
            # positional ints in range, the common call: what the checks below would accept
            # (a key is made per request: this is 4x cheaper than parsing the general form)
            self._cluster_id, self._req_id = args
            self._model_id, self._prefix_id = 0, UINT64_MAX
            return
        v = _key_args("CacheKey", args, kwargs, ("cluster_id", "req_id", "model_id", "prefix_id"),
                      required=("req_id",))
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

    def __repr__(self) -> str:
        return (f"CacheKey(cluster_id={self._cluster_id}, req_id={self._req_id}, "
                f"prefix_id={self._prefix_id}, model_id={self._model_id})")


def is_invalid_id(req_id_or_prefix_id: int) -> bool:
    """A req_id or prefix_id that names nothing: negative or 2**64-1."""
    return req_id_or_prefix_id < 0 or req_id_or_prefix_id == UINT64_MAX


def is_valid_id(req_id_or_prefix_id: int) -> bool:
    return not is_invalid_id(req_id_or_prefix_id)


def check_cache_key(cache_key: CacheKey) -> None:
    """A CacheKey to pull by names exactly one of req_id and prefix_id (LLM_PARAM_INVALID
    otherwise). Behind ``CacheManager.check_cache_key`` and ``KvCacheManager.check_cache_key``."""
    raise_if_false(not (is_invalid_id(cache_key.req_id) and is_invalid_id(cache_key.prefix_id)),
                   f"one of req id and prefix id should contain valid value:[0, 2**64-1), "
                   f"req id:{cache_key.req_id},prefix id:{cache_key.prefix_id}.")
    raise_if_false(not (is_valid_id(cache_key.req_id) and is_valid_id(cache_key.prefix_id)),
                   f"only one of req id and prefix id should contain valid value:[0, 2**64-1), "
                   f"req id:{cache_key.req_id}, prefix id:{cache_key.prefix_id}.")


class CacheKeyByIdAndIndex:
    """A remote cache by its cache_id, and a batch slot of it."""

    def __init__(self, cluster_id: int, cache_id: int, batch_index: int = 0) -> None:
        if not (type(cluster_id) is int and 0 <= cluster_id <= UINT64_MAX
                and type(cache_id) is int and -(2**63) <= cache_id < 2**63
                and type(batch_index) is int and 0 <= batch_index < 2**32):
            # the checks (and their errors) only when the fast test fails
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
        if not kwargs and len(args) == 2 and type(args[0]) is int and type(args[1]) is int:
            # (cluster_id, model_id) as ints, the common call (a key per request): what the
            # checks below accept, without parsing the general form
            self._cluster_id, self._model_id = args
            self._cluster_id_key = "cluster_id"
            return
        v = _key_args("BlocksCacheKey", args, kwargs, ("cluster_id", "model_id"))
        v.setdefault("model_id", 0)
        check_isinstance("cluster_id", v["cluster_id"], int, allow_none=False)
        check_isinstance("model_id", v["model_id"], int, allow_none=False)
        self._cluster_id = v["cluster_id"]
        self._model_id = v["model_id"]
        # The repr names the cluster the way the caller did (llm_datadist does the same).
        by_prompt_name = not args and "cluster_id" not in kwargs
        self._cluster_id_key = "prompt_cluster_id" if by_prompt_name else "cluster_id"

    cluster_id = property(lambda self: self._cluster_id)
    prompt_cluster_id = property(lambda self: self._cluster_id)
    model_id = property(lambda self: self._model_id)

    def __repr__(self) -> str:
        return (f"BlocksCacheKey({self._cluster_id_key}={self._cluster_id}, "
                f"model_id={self._model_id})")


class MemInfo:
    """Memory to re-map after a fault (``remap_registered_memory``): only types are checked
    here; the values are checked where they are used, as in llm_datadist."""

    def __init__(self, mem_type: Memtype, addr: int, size: int) -> None:
        check_isinstance("mem_type", mem_type, Memtype)
        check_isinstance("addr", addr, int)
        check_isinstance("size", size, int)
        self._mem_type, self._addr, self._size = mem_type, addr, size

    mem_type = property(lambda self: self._mem_type)
    addr = property(lambda self: self._addr)
    size = property(lambda self: self._size)

    def __str__(self) -> str:
        return f"MemInfo(mem_type={self._mem_type}, addr={self._addr}, size={self._size})"

    __repr__ = __str__


class LayerSynchronizer(abc.ABC):
    """Implemented by the user: ``synchronize_layer(i)`` returns once layer i is computed."""

    @abc.abstractmethod
    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        ...


def check_layer_range(name: str, layer_range: Any, allow_none: bool = True) -> None:
    """A layer range is a ``range`` with step 1 and ``0 <= start < stop``."""
    check_isinstance(name, layer_range, range, allow_none)
    if layer_range is None:
        return
    # messages formatted only on failure: a layer-wise transfer passes here once per layer
    # (the original's texts, v2/llm_types.py check_layer_range)
    if layer_range.step != 1:
        raise_if_false(False, f"check {name}.step == 1 failed")
    if not 0 <= layer_range.start < layer_range.stop:
        raise_if_false(False, f"check 0 <= range.start < range.stop failed, {name} = "
                              f"{layer_range}")


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
        self._dst_addrs = value

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

    def __str__(self) -> str:
        return (f"TransferConfig(dst_cluster_id={self._dst_cluster_id}, "
                f"dst_addrs={self._dst_addrs}, src_layer_range={self._src_layer_range}, "
                f"src_batch_index={self._src_batch_index})")

    __repr__ = __str__


class TransferWithCacheKeyConfig:
    """A destination of ``transfer_cache_async`` by cache key (remote-accessible mode).

    Both layer ranges are required when built (None is a TypeError) and must be equally long
    (else LLM_PARAM_INVALID); a ``BlocksCacheKey`` destination needs ``src_batch_index`` 0.
    The properties check what is assigned to them, but (as in llm_datadist) the setters
    accept None and do not re-compare the two lengths: ``transfer_cache_async`` checks
    the whole config again before it starts.
    """

    def __init__(self, cache_key: BlocksCacheKey | CacheKeyByIdAndIndex,
                 src_layer_range: range | None = None,  # None (the default) is a TypeError
                 dst_layer_range: range | None = None,
                 src_batch_index: int = 0) -> None:
        check_isinstance("cache_key", cache_key, (BlocksCacheKey, CacheKeyByIdAndIndex),
                         allow_none=False)
        check_layer_range("src_layer_range", src_layer_range, allow_none=False)
        check_layer_range("dst_layer_range", dst_layer_range, allow_none=False)
        assert src_layer_range is not None and dst_layer_range is not None  # checked above
        raise_if_false(len(src_layer_range) == len(dst_layer_range),
                       # the original's text, its spelling included
                       f"src_layer_range size shoulde be equal to dst_layer_range size "
                       f"({src_layer_range}, {dst_layer_range})")
        check_int("src_batch_index", src_batch_index, "uint32", allow_none=False)
        _check_blocks_batch_index(cache_key, src_batch_index)
        self._cache_key = cache_key
        self._src_layer_range: range | None = src_layer_range
        self._dst_layer_range: range | None = dst_layer_range
        self._src_batch_index = src_batch_index
        self.dst_cluster_id = cache_key.cluster_id

    @property
    def cache_key(self) -> BlocksCacheKey | CacheKeyByIdAndIndex:
        return self._cache_key

    @cache_key.setter
    def cache_key(self, value: BlocksCacheKey | CacheKeyByIdAndIndex) -> None:
        check_isinstance("cache_key", value, (BlocksCacheKey, CacheKeyByIdAndIndex))
        self._cache_key = value

    @property
    def src_layer_range(self) -> range | None:
        return self._src_layer_range

    @src_layer_range.setter
    def src_layer_range(self, value: range | None) -> None:
        check_layer_range("src_layer_range", value)
        self._src_layer_range = value

    @property
    def dst_layer_range(self) -> range | None:
        return self._dst_layer_range

    @dst_layer_range.setter
    def dst_layer_range(self, value: range | None) -> None:
        check_layer_range("dst_layer_range", value)
        self._dst_layer_range = value

    @property
    def src_batch_index(self) -> int:
        return self._src_batch_index

    @src_batch_index.setter
    def src_batch_index(self, value: int) -> None:
        _check_blocks_batch_index(self._cache_key, value)
        check_int("src_batch_index", value, "uint32", allow_none=False)
        self._src_batch_index = value

    def __repr__(self) -> str:
        return (f"TransferWithCacheKeyConfig(cache_key={self._cache_key}, "
                f"src_layer_range={self._src_layer_range}, "
                f"dst_layer_range={self._dst_layer_range}, "
                f"src_batch_index={self._src_batch_index})")


def _check_blocks_batch_index(cache_key: Any, src_batch_index: Any) -> None:
    raise_if_false(not (isinstance(cache_key, BlocksCacheKey) and src_batch_index != 0),
                   "src_batch_index shoulde be 0 when cache_key is BlocksCacheKey.")
