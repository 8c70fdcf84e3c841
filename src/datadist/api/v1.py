"""The legacy "v1" surface: ``KvCacheManager``, ``Tensor`` and ``TensorDesc``.

In llm_datadist these load lazily from ``llm_datadist_v1``; here too (module ``__getattr__``).

Legacy mode is what ``LLMDataDist.init`` selects when the options do not turn cache-manager
mode on. Differences from cache-manager mode, as in LLM-DataDist:

* methods are gated by role: only a DECODER pulls (``pull_cache``, ``pull_blocks``), only a
  PROMPT binds cache keys, removes them and sends with ``transfer_cache_async``; a DECODER
  may not give a ``blocks_cache_key``. A wrong role is LLM_PARAM_INVALID;
* caches come from one pool, sized by ``ge.flowGraphMemMaxSize`` (bytes), else by the sum of
  ``total_size`` over ``buf_pool_cfg``'s tiers, else ``DEFAULT_POOL_BYTES`` (1 GiB; pool
  pages are only committed when touched). Only DEVICE caches are allocated; on a host
  without CUDA, DEVICE memory is host memory;
* ``pull_cache`` takes ``src_cache_offset`` / ``dst_cache_offset``: ``size`` bytes from that
  offset in the source batch slot to that offset in the destination slot;
* caches are ``KvCache`` objects: ``per_device_tensor_addrs[0]`` are the tensor addresses,
  and ``get_cache_tensors`` wraps one tensor as a numpy-backed ``Tensor``. A pool cache whose
  ``KvCache`` goes away without ``deallocate_cache`` is deallocated (by the manager's next
  call), as llm_datadist's ``KvCache.__del__`` does: keep the object while using its memory.

Cache ids count from 1 in each process, in allocation order: old clients hard-code them.
"""

from __future__ import annotations

import collections
import contextlib
import json
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np

from datadist.api import async_transfer, local_ops
from datadist.api.cache_manager import local_keys
from datadist.api.checks import check_int, check_isinstance, int_list
from datadist.api.config import pool_bytes_option
from datadist.api.enums import DataType, LLMRole, Placement, from_numpy_dtype, numpy_dtype
from datadist.api.geometry import geometry_of, key_ref, layer_pair
from datadist.api.status import (
    LLMException,
    LLMStatusCode,
    check_same_session,
    llm_errors,
    raise_if_false,
)
from datadist.api.tasks import CacheTask
from datadist.api.transfer_handle import TransferHandle
from datadist.api.types import (
    UINT64_MAX,
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    KvCache,
    LayerSynchronizer,
    TransferConfig,
    check_cache_key,
    check_layer_range,
)
from datadist.core import layout
from datadist.core.config import DEVICE
from datadist.core.errors import DatadistError
from datadist.core.keys import key_id
from datadist.core.native import PULL_BLOCKS, PULL_SLOT, NativeEngine
from datadist.memory.pool import PoolConfig

if TYPE_CHECKING:  # the core's prepared transfer, from its stub
    from datadist._core import Call

DEFAULT_POOL_BYTES = 1 << 30
OPT_FLOW_GRAPH_MEM_MAX_SIZE = "ge.flowGraphMemMaxSize"
OPT_BUF_POOL = "llm.BufPoolCfg"
_PULL_CACHE_KWARGS = ("src_layer_range", "dst_layer_range", "src_cache_offset",
                      "dst_cache_offset", "tensor_num_per_layer")
# The engine's pull arguments: cluster id, wire key, unit bytes, plan, local cache id
_PULL_BLOCKS_KWARGS = ("src_layer_range", "dst_layer_range", "tensor_num_per_layer")


def _param_invalid(msg: str) -> LLMException:
    return LLMException(msg, status_code=LLMStatusCode.LLM_PARAM_INVALID)


def v1_pool_config(options: dict[str, str]) -> PoolConfig:
    """The legacy-mode KV pool: ``ge.flowGraphMemMaxSize``, else ``buf_pool_cfg``'s tiers,
    else ``DEFAULT_POOL_BYTES``. Called by ``LLMDataDist.init``."""
    raw = options.get(OPT_FLOW_GRAPH_MEM_MAX_SIZE)
    if raw:
        return PoolConfig(pool_bytes_option(OPT_FLOW_GRAPH_MEM_MAX_SIZE, raw))
    buf = options.get(OPT_BUF_POOL)
    if buf:
        try:
            tiers = json.loads(buf)["buf_cfg"]
            sizes = [t["total_size"] for t in tiers]
        except (ValueError, KeyError, TypeError) as e:
            raise _param_invalid(f"{OPT_BUF_POOL} is not a valid buf_cfg: {e}") from None
        for size in sizes:
            if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
                raise _param_invalid(f"{OPT_BUF_POOL}: every total_size must be an int > 0, "
                                     f"got {size!r}")
        if not sizes:
            raise _param_invalid(f"{OPT_BUF_POOL} has no memory")
        return PoolConfig(pool_bytes_option(f"{OPT_BUF_POOL} total", str(sum(sizes))))
    return PoolConfig(DEFAULT_POOL_BYTES)


class TensorDesc:
    """A tensor's data type (``DataType``) and shape, for ``Tensor`` and legacy-mode caches."""

    def __init__(self, dtype: DataType, shape: list[int] | tuple[int, ...]) -> None:
        check_isinstance("dtype", dtype, DataType, allow_none=False)
        check_isinstance("shape", shape, (list, tuple), allow_none=False)
        self._dtype, self._shape = dtype, list(shape)

    dtype = property(lambda self: self._dtype)
    shape = property(lambda self: list(self._shape))

    def __str__(self) -> str:
        return f"TensorDesc(dtype={self._dtype}, shape={self._shape})"


def _view(addr: int, dtype: np.dtype, shape: list[int]) -> np.ndarray:
    """A numpy array over ``addr`` (no copy, no check: the caller knows the memory)."""
    import ctypes

    count = int(np.prod(shape)) if shape else 1
    buf = (ctypes.c_byte * (count * dtype.itemsize)).from_address(addr)
    arr: np.ndarray = np.frombuffer(memoryview(buf), dtype=dtype).reshape(shape)
    return arr


def _checked_view(addr: int, desc: TensorDesc) -> np.ndarray:
    """A view of caller-given memory: the range must be mapped readable (PARAM_INVALID
    otherwise, instead of a SIGSEGV at the first access); read-only memory gives a
    read-only array."""
    from datadist.memory import mapped

    check_int("data", addr, "uint64", allow_none=False)
    dt = numpy_dtype(desc.dtype)
    raise_if_false(all(d >= 0 for d in desc.shape), f"shape {desc.shape} has a negative dim")
    nbytes = (int(np.prod(desc.shape, dtype=object)) if desc.shape else 1) * dt.itemsize
    raise_if_false(addr != 0 and nbytes <= 2**63 and addr <= 2**64 - 1 - nbytes,
                   f"a Tensor of {nbytes} bytes at {addr:#x} does not fit the address space")
    if nbytes == 0:
        return _view(addr, dt, desc.shape)
    base, n = np.array([addr], np.uint64), np.array([nbytes], np.uint64)
    bad = int(mapped.unmapped(base, n, write=False)[0])
    raise_if_false(bad == 0, f"a Tensor of {nbytes} bytes at {addr:#x} is not wholly mapped in "
                             f"this process (no access at {bad:#x})")
    arr = _view(addr, dt, desc.shape)
    if int(mapped.unmapped(base, n, write=True)[0]):
        arr.flags.writeable = False
    return arr


class Tensor:
    """A host tensor: wraps a numpy array, another Tensor, or a raw address plus a desc."""

    def __init__(self, data: np.ndarray | Tensor | int, tensor_desc: TensorDesc | None = None
                 ) -> None:
        check_isinstance("data", data, (np.ndarray, Tensor, int), allow_none=False)
        check_isinstance("tensor_desc", tensor_desc, TensorDesc)
        self._array: np.ndarray
        if isinstance(data, Tensor):
            self._array = data._array
        elif isinstance(data, np.ndarray):
            self._array = data
        else:
            if tensor_desc is None:
                raise LLMException("a Tensor from an address needs a tensor_desc",
                                   status_code=LLMStatusCode.LLM_PARAM_INVALID)
            self._array = _checked_view(data, tensor_desc)
        self._desc = tensor_desc or TensorDesc(from_numpy_dtype(self._array.dtype),
                                               list(self._array.shape))

    @staticmethod
    def from_tensor_tuple(tensor_tuple: tuple[int, int, list[int]]) -> Tensor:
        """A Tensor from ``(data, data_type, shape)``: ``data_type`` is the GE type number
        (``DataType.value``). In llm_datadist ``data`` is a native tensor handle; here, as in
        ``Tensor(int, desc)``, it is the address of the data."""
        data, dtype, shape = tensor_tuple
        return Tensor(data, TensorDesc(DataType(dtype), shape))

    def numpy(self, copy: bool = False) -> np.ndarray:
        """The data as numpy: a view of it (``copy=False``) or a copy. A DT_BF16 tensor comes
        back as float32 values (always a new array), as in llm_datadist: numpy has no
        bfloat16."""
        check_isinstance("copy", copy, bool)
        if self._desc.dtype is DataType.DT_BF16:
            bits = self._array.view(np.uint16).astype(np.uint32) << 16
            values: np.ndarray = bits.view(np.float32).reshape(self._array.shape)
            return values
        return self._array.copy() if copy else self._array

    def __str__(self) -> str:
        return f"Tensor({self._array},tensor_desc={self._desc})"


class KvCacheManager:
    """Legacy (non-cache-manager) mode caches and transfers; see the module docstring.

    Obtain it via ``LLMDataDist.kv_cache_manager``. Pulls block until done or
    ``sync_kv_timeout`` (LLM_TIMEOUT); ``transfer_cache_async`` returns at once; the rest
    returns when done. The role is read from the engine, so ``switch_role`` applies at once.
    """

    def __init__(self, llm_engine: NativeEngine, role: LLMRole) -> None:
        self._engine = llm_engine
        self._initialized = True
        # (cache_id, is_blocks) of pool caches whose KvCache was garbage-collected without
        # deallocate_cache; freed by the next call on this manager (_free_dropped).
        self._dropped: collections.deque[tuple[int, bool]] = collections.deque()
        # What each cache this manager allocated was allocated as: (dtype, shape). Views and
        # plans are sized from this, never from the caller's CacheDesc, which stays mutable.
        self._registered: dict[int, tuple[DataType, tuple[int, ...]]] = {}

    def __repr__(self) -> str:
        return f"<KvCacheManager {self._role} initialized={self._initialized}>"

    @property
    def _role(self) -> LLMRole:
        return LLMRole(self._engine.role)

    def is_initialized(self) -> bool:
        return self._initialized

    def _invalidate(self) -> None:
        self._initialized = False

    def _engine_or_raise(self) -> NativeEngine:
        if not self._initialized:
            raise RuntimeError("llm datadist is not initialized")
        self._free_dropped()
        return self._engine

    def _free_dropped(self) -> None:
        """Deallocate the caches whose KvCache objects went away without deallocate_cache.

        llm_datadist's ``KvCache.__del__`` deallocates at once. Here the object's finalizer
        only queues its id (the garbage collector may run while this thread holds an engine
        lock), and the next call on this manager, an allocation included, frees it.
        """
        while self._dropped:
            cache_id, blocks = self._dropped.popleft()
            self._registered.pop(cache_id, None)
            with contextlib.suppress(DatadistError):
                self._engine.deallocate(cache_id, blocks=blocks)

    def _check_role(self, func: str, role: LLMRole) -> None:
        raise_if_false(self._role == role, f"{func} is not supported by {self._role}")

    @staticmethod
    def _check_device(cache: KvCache) -> None:
        raise_if_false(cache.cache_desc.placement == Placement.DEVICE,
                       "Only support device cache")

    @staticmethod
    def _ref(cache: KvCache) -> local_ops.CacheRef:
        addrs = cache.per_device_tensor_addrs
        return local_ops.CacheRef(cache.cache_id, cache.cache_desc, cache._is_blocks_cache,
                                  addrs[0] if addrs else [])

    def _own(self, name: str, cache: KvCache) -> KvCache:
        """A handle this manager made (or an unregistered ``create_cpu_cache``). One from a
        manager that ``finalize()`` invalidated names a cache id of a finished session, which
        the new session may have given to another cache: LLM_KV_CACHE_NOT_EXIST."""
        check_same_session(name, cache.cache_id, cache._manager, self)
        return cache

    def _geometry(self, engine: NativeEngine, cache: KvCache) -> layout.Geometry:
        """The cache as it was allocated (LLM_KV_CACHE_NOT_EXIST once it is gone)."""
        with llm_errors():
            return engine.cache(cache.cache_id).geometry

    # ------------------------------------------------------------------ pool caches

    def _allocate(self, func: str, cache_desc: Any, *, blocks: bool, keys: list[Any],
                  model: int | None) -> KvCache:
        engine = self._engine_or_raise()
        raise_if_false(cache_desc.num_tensors > 0, "num_tensors should be bigger than zero")
        raise_if_false(cache_desc.placement == Placement.DEVICE,
                       "Only support allocate device cache")
        geo = geometry_of(cache_desc, blocks=blocks)
        with llm_errors(func):
            entry = engine.allocate(geo, placement=DEVICE, keys=keys, blocks_model_id=model)
        self._registered[entry.cache_id] = (cache_desc.data_type, tuple(cache_desc.shape))
        cache = KvCache(entry.cache_id, cache_desc, [entry.addrs.tolist()], self)
        cache._is_blocks_cache = blocks
        cache._finalizer = weakref.finalize(cache, self._dropped.append, (entry.cache_id, blocks))
        cache._finalizer.atexit = False
        return cache

    def allocate_cache(self, cache_desc: CacheDesc,
                       cache_keys: tuple[CacheKey, ...] | list[CacheKey] = ()) -> KvCache:
        """Allocate a contiguous cache from the pool; key i binds batch slot i (PROMPT only;
        ``req_id=2**64-1`` pads a slot). Freed once ``deallocate_cache`` was called and
        every key was pulled or removed."""
        check_isinstance("cache_desc", cache_desc, CacheDesc, allow_none=False)
        keys = local_keys(cache_keys)
        if self._role != LLMRole.PROMPT:
            raise_if_false(len(keys) == 0, f"cache_keys is not supported by {self._role}")
        return self._allocate("allocate_cache", cache_desc, blocks=False, keys=keys, model=None)

    def allocate_blocks_cache(self, cache_desc: CacheDesc,
                              blocks_cache_key: BlocksCacheKey | None = None) -> KvCache:
        """Allocate a blocks cache from the pool; a DECODER may not give a key."""
        check_isinstance("cache_desc", cache_desc, CacheDesc, allow_none=False)
        check_isinstance("blocks_cache_key", blocks_cache_key, BlocksCacheKey)
        if self._role == LLMRole.DECODER:
            raise_if_false(blocks_cache_key is None,
                           "blocks_cache_key is not supported by LLMRole.DECODER")
        model = None if blocks_cache_key is None else blocks_cache_key.model_id & UINT64_MAX
        return self._allocate("allocate_blocks_cache", cache_desc, blocks=True, keys=[],
                              model=model)

    def deallocate_cache(self, cache: KvCache) -> None:
        """Drop the cache id (both kinds); the memory goes once no key holds it. Unknown or
        already deallocated: no-op."""
        engine = self._engine_or_raise()
        check_isinstance("cache", cache, KvCache, allow_none=False)
        self._own("cache", cache)
        self._check_device(cache)
        with llm_errors("deallocate_cache"):
            engine.deallocate(cache.cache_id, blocks=cache._is_blocks_cache)
        self._registered.pop(cache.cache_id, None)
        if cache._finalizer is not None:
            cache._finalizer.detach()
        cache._addrs = []

    def remove_cache_key(self, cache_key: CacheKey) -> None:
        """PROMPT only: unbind a key so that it can no longer be pulled. Unknown: no-op."""
        engine = self._engine_or_raise()
        self._check_role("remove_cache_key", LLMRole.PROMPT)
        check_isinstance("cache_key", cache_key, CacheKey, allow_none=False)
        k = key_id(cache_key.req_id, cache_key.prefix_id, cache_key.model_id)
        if k is not None:
            engine.remove_key(k)

    # ------------------------------------------------------------------ pulls (DECODER)

    @staticmethod
    def _kwargs(kwargs: dict[str, Any], allowed: tuple[str, ...]) -> None:
        for k in kwargs:
            raise_if_false(k in allowed, f"unknown argument {k!r}; expected one of {allowed}")

    @staticmethod
    def _layers(kwargs: dict[str, Any]) -> tuple[Any, Any, int]:
        src, dst = kwargs.get("src_layer_range"), kwargs.get("dst_layer_range")
        n = kwargs.get("tensor_num_per_layer", 2)
        check_layer_range("src_layer_range", src)
        check_layer_range("dst_layer_range", dst)
        check_int("tensor_num_per_layer", n, "uint32", allow_none=False)
        raise_if_false(n > 0, f"tensor_num_per_layer ({n}) must be > 0")
        return src, dst, n

    @staticmethod
    def _offset(name: str, value: Any) -> int:
        """Unset (None) is -1; a given offset is an int64 >= 0 (else ValueError)."""
        if value is None:
            return -1
        check_int(name, value, "int64", allow_none=False)
        if value < 0:
            raise ValueError(f"{name} must be >= 0, but got {value}.")
        return int(value)

    def pull_cache(self, cache_key: CacheKey | CacheKeyByIdAndIndex, kv_cache: KvCache,
                   batch_index: int = 0, size: int = -1, **kwargs: Any) -> None:
        """DECODER only: read ``size`` bytes (-1: the rest of the local slot) of the remote
        slot, from ``src_cache_offset`` within it, into slot ``batch_index`` of ``kv_cache``
        at ``dst_cache_offset``. kwargs: ``src_layer_range``, ``dst_layer_range``,
        ``src_cache_offset``, ``dst_cache_offset``, ``tensor_num_per_layer`` (2)."""
        engine = self._engine_or_raise()
        args = self._pull_cache_args(engine, cache_key, kv_cache, batch_index, size, kwargs)
        with llm_errors("pull_cache"):
            engine.run(args)

    def pull_cache_async(self, cache_key: CacheKey | CacheKeyByIdAndIndex, kv_cache: KvCache,
                         batch_index: int = 0, size: int = -1,
                         **kwargs: Any) -> TransferHandle:
        """:meth:`pull_cache`, issued (datadist extension): the same checks, raised here;
        returns a :class:`~datadist.TransferHandle` at once (see CacheManager's)."""
        engine = self._engine_or_raise()
        args = self._pull_cache_args(engine, cache_key, kv_cache, batch_index, size, kwargs)
        return TransferHandle(engine.submit(args), "pull_cache_async")

    def _pull_cache_args(self, engine: NativeEngine, cache_key: Any, kv_cache: Any,
                         batch_index: Any, size: Any, kwargs: dict[str, Any]) -> Call:
        """pull_cache's checks after the engine's; the engine's pull arguments."""
        self._check_role("pull_cache", LLMRole.DECODER)
        self._kwargs(kwargs, _PULL_CACHE_KWARGS)
        check_isinstance("cache_key", cache_key, (CacheKey, CacheKeyByIdAndIndex),
                         allow_none=False)
        check_isinstance("kv_cache", kv_cache, KvCache, allow_none=False)
        self._own("kv_cache", kv_cache)
        self._check_device(kv_cache)
        check_int("size", size, "int64", allow_none=False)
        check_int("batch_index", batch_index, "uint32", allow_none=False)
        raise_if_false(size == -1 or size > 0, f"size ({size}) must be -1 or > 0")
        src_off = self._offset("src_cache_offset", kwargs.get("src_cache_offset"))
        dst_off = self._offset("dst_cache_offset", kwargs.get("dst_cache_offset"))
        if isinstance(cache_key, CacheKey):
            KvCacheManager.check_cache_key(cache_key)
        src_range, dst_range, n = self._layers(kwargs)
        self._geometry(engine, kv_cache)  # LLM_KV_CACHE_NOT_EXIST first, as always
        raise_if_false(not kv_cache._is_blocks_cache, "pull_cache needs a contiguous cache")
        with llm_errors("pull_cache"):
            return engine.prepare_pull(
                cache_key.cluster_id, key_ref(cache_key), kv_cache.cache_id, PULL_SLOT,
                batch_index=batch_index, size=size, src_offset=max(src_off, 0),
                dst_offset=max(dst_off, 0), src_layers=layer_pair(src_range),
                dst_layers=layer_pair(dst_range), tensor_num_per_layer=n)

    def pull_blocks(self, prompt_cache_key: BlocksCacheKey, decoder_kv_cache: KvCache,
                    prompt_blocks: list[int], decoder_blocks: list[int], **kwargs: Any) -> None:
        """DECODER only: remote block ``prompt_blocks[i]`` into ``decoder_blocks[i]``. Both
        lists non-empty, of the same length, and lists (not tuples)."""
        engine = self._engine_or_raise()
        args = self._pull_blocks_args(engine, prompt_cache_key, decoder_kv_cache, prompt_blocks,
                                      decoder_blocks, kwargs)
        with llm_errors("pull_blocks"):
            engine.run(args)

    def pull_blocks_async(self, prompt_cache_key: BlocksCacheKey, decoder_kv_cache: KvCache,
                          prompt_blocks: list[int], decoder_blocks: list[int],
                          **kwargs: Any) -> TransferHandle:
        """:meth:`pull_blocks`, issued (datadist extension): as :meth:`pull_cache_async`."""
        engine = self._engine_or_raise()
        args = self._pull_blocks_args(engine, prompt_cache_key, decoder_kv_cache, prompt_blocks,
                                      decoder_blocks, kwargs)
        return TransferHandle(engine.submit(args), "pull_blocks_async")

    def _pull_blocks_args(self, engine: NativeEngine, prompt_cache_key: Any, decoder_kv_cache: Any,
                          prompt_blocks: Any, decoder_blocks: Any,
                          kwargs: dict[str, Any]) -> Call:
        """pull_blocks's checks after the engine's; the engine's pull arguments."""
        self._check_role("pull_blocks", LLMRole.DECODER)
        self._kwargs(kwargs, _PULL_BLOCKS_KWARGS)
        check_isinstance("prompt_cache_key", prompt_cache_key, BlocksCacheKey, allow_none=False)
        check_isinstance("decoder_kv_cache", decoder_kv_cache, KvCache, allow_none=False)
        self._own("decoder_kv_cache", decoder_kv_cache)
        src = int_list("prompt_blocks", prompt_blocks, "uint64", types=(list,))
        dst = int_list("decoder_blocks", decoder_blocks, "uint64", types=(list,))
        self._check_device(decoder_kv_cache)
        raise_if_false(len(src) > 0, "prompt_blocks can not be empty")
        raise_if_false(len(dst) > 0, "decoder_blocks can not be empty")
        raise_if_false(len(src) == len(dst),
                       f"prompt_blocks ({len(src)}) and decoder_blocks ({len(dst)}) must have "
                       "the same length")
        src_range, dst_range, n = self._layers(kwargs)
        self._geometry(engine, decoder_kv_cache)  # as pull_cache
        raise_if_false(decoder_kv_cache._is_blocks_cache, "pull_blocks needs a blocks cache")
        with llm_errors("pull_blocks"):
            return engine.prepare_pull(
                prompt_cache_key.cluster_id, key_ref(prompt_cache_key),
                decoder_kv_cache.cache_id, PULL_BLOCKS, src_blocks=src, dst_blocks=dst,
                src_layers=layer_pair(src_range), dst_layers=layer_pair(dst_range),
                tensor_num_per_layer=n)

    @staticmethod
    def check_cache_key(cache_key: CacheKey) -> None:
        """Exactly one of ``req_id`` and ``prefix_id`` must be valid (neither 2**64-1 nor
        negative), else LLM_PARAM_INVALID. Called by ``pull_cache``; public, as in
        llm_datadist."""
        check_cache_key(cache_key)

    # ------------------------------------------------------------------ local copies

    def copy_cache(self, dst: KvCache, src: KvCache, dst_batch_index: int = 0,
                   src_batch_index: int = 0, offset: int = 0, size: int = -1,
                   req_id: int | None = None) -> None:
        """Copy one batch slot of every tensor (``size`` bytes from ``offset``; -1: the
        rest of the source slot). ``req_id`` is for logs only."""
        engine = self._engine_or_raise()
        check_isinstance("dst", dst, KvCache, allow_none=False)
        self._own("dst", dst)
        self._check_device(dst)
        check_isinstance("src", src, KvCache, allow_none=False)
        self._own("src", src)
        self._check_device(src)
        check_int("dst_batch_index", dst_batch_index, "uint32", allow_none=False)
        check_int("src_batch_index", src_batch_index, "uint32", allow_none=False)
        check_int("offset", offset, "uint64", allow_none=False)
        check_int("size", size, "int64", allow_none=False)
        check_isinstance("req_id", req_id, int)
        local_ops.copy_cache(engine, self._ref(dst), self._ref(src), dst_batch_index,
                             src_batch_index, offset, size)

    def copy_blocks(self, cache: KvCache, copy_block_info: dict[int, list[int]]) -> None:
        """Copy blocks within ``cache``: ``{src_block: [dst_block, ...]}``."""
        engine = self._engine_or_raise()
        check_isinstance("cache", cache, KvCache, allow_none=False)
        self._own("cache", cache)
        check_isinstance("copy_block_info", copy_block_info, dict, allow_none=False)
        self._check_device(cache)
        local_ops.copy_blocks(engine, self._ref(cache), copy_block_info)

    def swap_blocks(self, src: KvCache, dst: KvCache, src_to_dst: dict[int, int]) -> None:
        """Copy blocks HOST -> DEVICE (swap in) or DEVICE -> HOST (swap out); the HOST side is
        typically ``KvCache.create_cpu_cache``."""
        engine = self._engine_or_raise()
        check_isinstance("src", src, KvCache, allow_none=False)
        self._own("src", src)
        check_isinstance("dst", dst, KvCache, allow_none=False)
        self._own("dst", dst)
        local_ops.swap_blocks(engine, self._ref(src), self._ref(dst), src_to_dst)

    def get_cache_tensors(self, cache: KvCache, tensor_index: int = 0) -> list[Tensor]:
        """Tensor ``tensor_index`` of ``cache``, one ``Tensor`` per device (one here): a
        numpy view of the cache memory (``.numpy()``), valid until the cache is freed."""
        engine = self._engine_or_raise()
        check_isinstance("cache", cache, KvCache, allow_none=False)
        self._own("cache", cache)
        check_int("tensor_index", tensor_index, "int32", allow_none=False)
        desc = cache.cache_desc
        if cache.cache_id == local_ops.UNREGISTERED_ID:
            # create_cpu_cache: the caller's own memory, described only by its CacheDesc.
            raise_if_false(0 <= tensor_index < desc.num_tensors,
                           f"tensor_index ({tensor_index}) out of range [0, "
                           f"{desc.num_tensors})")
            tensor_desc = TensorDesc(desc.data_type, desc.shape)
            return [Tensor(int(addrs[tensor_index]), tensor_desc)  # checked: caller's memory
                    for addrs in cache.per_device_tensor_addrs]
        # A cache of ours: shape, dtype and address as allocated, whatever the CacheDesc says
        # now (update_dim after allocation must not make a view reach past the cache).
        with llm_errors("get_cache_tensors"):
            entry = engine.cache(cache.cache_id)
        registered = self._registered.get(cache.cache_id)
        g = entry.geometry
        raise_if_false(0 <= tensor_index < g.num_tensors,
                       f"tensor_index ({tensor_index}) out of range [0, {g.num_tensors})")
        shape: tuple[int, ...]
        if registered is None:  # not allocated by this manager: bytes only
            dtype, shape = DataType.DT_UINT8, (g.tensor_bytes,)
        else:
            dtype, shape = registered
        return [Tensor(_view(int(entry.addrs[tensor_index]), numpy_dtype(dtype), list(shape)),
                       TensorDesc(dtype, list(shape)))]

    # ------------------------------------------------------------------ async (PROMPT)

    def transfer_cache_async(self, src_cache: KvCache, layer_synchronizer: LayerSynchronizer,
                             transfer_configs: list[TransferConfig] | tuple[TransferConfig, ...],
                             src_block_indices: list[int] | tuple[int, ...] | None = None,
                             dst_block_indices: list[int] | tuple[int, ...] | None = None,
                             dst_block_memory_size: int | None = None) -> CacheTask:
        """PROMPT only: send ``src_cache`` layer by layer as ``layer_synchronizer`` reports
        each layer computed, to raw destination addresses (``TransferConfig``). Returns a
        CacheTask at once; its default error is LLM_WAIT_PROCESS_TIMEOUT."""
        engine = self._engine_or_raise()
        self._check_role("transfer_cache_async", LLMRole.PROMPT)
        check_isinstance("src_cache", src_cache, KvCache, allow_none=False)
        self._own("src_cache", src_cache)
        return async_transfer.start_transfer(
            engine, src_cache.cache_id, src_cache.cache_desc, layer_synchronizer,
            transfer_configs, src_block_indices, dst_block_indices, dst_block_memory_size,
            key_configs=False, default_error=LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT)


__all__ = ["KvCacheManager", "Tensor", "TensorDesc", "v1_pool_config"]
