"""``CacheManager``: llm_datadist's cache-manager-mode API over the engine.

Who calls: user code, through ``LLMDataDist.cache_manager``. Argument parsing and the
TypeError / ValueError / LLMException semantics live here; geometry and transfers are the
core's. Pulls and pushes block until done or ``sync_kv_timeout``; the rest returns at once.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from datadist.api import async_transfer, local_ops, planned, types
from datadist.api.checks import check_int, check_isinstance, int_list
from datadist.api.enums import Memtype, Placement
from datadist.api.geometry import (
    describe,
    geometry_of,
    key_ref,
)
from datadist.api.notices import NotListeningWarning
from datadist.api.status import (
    LLMException,
    LLMStatusCode,
    check_same_session,
    llm_errors,
    raise_if_false,
    to_llm_exception,
)
from datadist.api.transfer_handle import TransferHandle
from datadist.api.types import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    LayerSynchronizer,
    MemInfo,
    TransferConfig,
    TransferWithCacheKeyConfig,
    check_layer_range,
)
from datadist.core import layout, native
from datadist.core.errors import CacheNotFound, DatadistError, InvalidArgument
from datadist.core.keys import KeyId, key_id
from datadist.core.native import PULL_BLOCKS, PULL_SLOT, PULL_SLOT_TO_BLOCKS, NativeEngine
from datadist.memory import mapped
from datadist.memory.user import user_memory

if TYPE_CHECKING:  # the core's prepared transfer, from its stub
    from datadist._core import Call

_U64 = 2**64 - 1




def local_keys(cache_keys: Any) -> list[KeyId | None]:
    check_isinstance("cache_keys", cache_keys, (list, tuple), allow_none=False)
    for k in cache_keys:
        check_isinstance("cache_key", k, CacheKey, allow_none=False)
    return [key_id(k.req_id, k.prefix_id, k.model_id) for k in cache_keys]


def parse_layer_kwargs(kwargs: dict[str, Any], func: str = "",
                       num_tensors: int = 0) -> tuple[Any, Any, int]:
    """The layer arguments of a pull: (src range, dst range, tensors per layer), with
    tensor_num_per_layer checked (uint32, > 0; ``func`` and ``num_tensors``, the local
    cache's, go into the original's text). The ranges are checked by
    :func:`check_pull_ranges`, later, as v2/cache_manager.py pull_cache / pull_blocks do. Other
    keywords are ignored, as there (it reads the three with ``kwargs.get``)."""
    if not kwargs:  # the usual call: every layer, two tensors per layer
        return None, None, 2
    src = kwargs.get("src_layer_range")
    dst = kwargs.get("dst_layer_range")
    n = kwargs.get("tensor_num_per_layer", 2)
    check_int("tensor_num_per_layer", n, "uint32", allow_none=False)
    raise_if_false(n > 0, f"[{func}] param check failed, tensor_num_per_layer ({n}) is invalid, "
                          f"should [1, {num_tensors}]")
    return src, dst, n


def check_pull_ranges(src: Any, dst: Any) -> None:
    """A pull's layer ranges, as v2/llm_utils.py layer_range_to_tensor_indices checks them
    (both types, both steps, then each start and end), its texts; then datadist's own rule
    (``check_layer_range``: a range that is not empty)."""
    check_isinstance("src_layer_range", src, range)
    check_isinstance("dst_layer_range", dst, range)
    for name, rng in (("src_layer_range", src), ("dst_layer_range", dst)):
        raise_if_false(rng is None or rng.step == 1,
                       f"param check failed, {name} step must be 1.")
    for name, rng in (("src_layer_range", src), ("dst_layer_range", dst)):
        if rng is not None and len(rng):
            raise_if_false(rng[0] >= 0, f"{name} is invalid, the start value:{rng[0]} is < 0")
            check_int(name, rng[0], "uint32", allow_none=False)
            check_int(name, rng[-1], "uint32", allow_none=False)
        check_layer_range(name, rng)



def push_layers(num_tensors: int, src: Any, dst: Any, n: Any,
                func: str) -> tuple[range | None, range | None, int]:
    """A push's layer arguments, checked as v2/cache_manager.py push_cache / push_blocks do:
    tensor_num_per_layer (uint32, > 0), each range (``check_layer_range``), then the two
    ranges as long as each other, a missing one being every local layer."""
    check_int("tensor_num_per_layer", n, "uint32", allow_none=False)
    raise_if_false(n > 0, f"[{func}] param check failed, tensor_num_per_layer ({n}) is invalid, "
                          f"should [1, {num_tensors}]")
    check_layer_range("src_layer_range", src)
    check_layer_range("dst_layer_range", dst)
    layers = num_tensors // n
    raise_if_false((layers if src is None else len(src)) == (layers if dst is None else len(dst)),
                   "src_layer_range size should be equal to size of dst_layer_range size.")
    return src, dst, n


def push_tensor_pairs(num_tensors: int, src_range: range | None, dst_range: range | None,
                      n: int) -> tuple[int, int, int]:
    """The tensor pairs of a push, as the original's push_cache / push_blocks: remote tensor
    ``remote_first + i`` <- local tensor ``local_first + i`` for ``i < count``, returned as
    ``(remote_first, local_first, count)`` (the core makes the pairs: PlanPush). One native
    layer-wise transfer per layer of ``src_range`` (default: every local layer) into the same
    position of ``dst_range`` (default: every *local* layer too, so a source range alone must
    cover them all); each transfer refuses a local cache whose tensor count is not a multiple
    of ``n`` (LayerWiseTransferJob::Prepare). A source of fewer tensors than one layer has no
    layer at all: the original then transfers nothing and reports success; datadist pushes
    the tensors there are (the same code, and the only reading under which the call does
    anything)."""
    if num_tensors < n and src_range is None and dst_range is None:
        return 0, 0, num_tensors
    layers = num_tensors // n
    src = (0, layers) if src_range is None else (src_range.start, src_range.stop)
    dst = (0, layers) if dst_range is None else (dst_range.start, dst_range.stop)
    raise_if_false(src[1] - src[0] == dst[1] - dst[0],
                   "src_layer_range size should be equal to size of dst_layer_range size.")
    raise_if_false(num_tensors % n == 0,
                   f"the source's num_tensors {num_tensors} is not a multiple of "
                   f"tensor_num_per_layer {n}")
    raise_if_false(src[1] <= layers,
                   f"src_layer_range {range(*src)} is out of range [0, {layers}) of the source")
    return dst[0] * n, src[0] * n, (src[1] - src[0]) * n


def _not_own(engine: NativeEngine, cluster_id: int) -> None:
    """Cache-manager mode refuses pulls naming our own cluster id, as the original's
    native LLMDataDistV2::PullCache does ("data can not be pulled from own cluster",
    LLM_PARAM_INVALID), even when a peer shares the id. Legacy mode (KvCacheManager) has no
    such rule: vllm-ascend's V0 connector pulls from a peer with its own id."""
    if cluster_id == engine.config.cluster_id:
        raise InvalidArgument(f"data can not be pulled from own cluster:{cluster_id}")


# pull_cache's refusal of a CacheKey in remote-cache-accessible mode: the original's
# TypeError text (v2/cache_manager.py pull_cache), then the mode and what to use instead.
_BY_ID_ONLY = (
    "cache_key only support ['CacheKeyByIdAndIndex'], but got CacheKey: pull_cache takes a "
    "CacheKey only while enable_remote_cache_accessible is off (llm.EnableRemoteCacheAccessible"
    " is '1' here; local_comm_res turns it on unless it is set). Use "
    "CacheKeyByIdAndIndex(cluster_id, cache_id, batch_index) with the peer's cache id, or set "
    "LLMConfig.enable_remote_cache_accessible = False to pull by CacheKey (docs/modes.md)")


def _refusal(err: DatadistError, func: str, cache: Cache, *, blocks: bool) -> LLMException:
    """The LLMException a transfer's DatadistError ``err`` is raised as (``func``: the API
    call's name, as ``llm_errors`` maps it): a peer's refusal of a mismatch (another dtype,
    block size or block shape: its text speaks of "the requester's" cache, which the peer
    knows only by its layout) gets this side's cache as the caller described it appended, so
    that the error shows both sides. Raised ``from err``. Called in an ``except`` clause, so
    a transfer that succeeds costs nothing (two context managers cost ~1.2 us a call)."""
    exc = to_llm_exception(err, func)
    if exc.status_code is LLMStatusCode.LLM_PARAM_INVALID and "the requester's" in str(exc):
        exc = LLMException(f"{exc} (the requester's cache, here: "
                           f"{describe(cache.cache_desc, blocks=blocks)})",
                           status_code=exc.status_code)
    return exc


class _Request:
    """A checked transfer call: the engine and the core's prepared call (planned, checked
    and made by the core: Engine.prepare_pull / prepare_push), for the blocking and issued
    forms; a planned pull's is kept for its repeats (api/planned.py)."""

    __slots__ = ("engine", "call")

    def __init__(self, engine: NativeEngine, call: Call) -> None:
        self.engine = engine
        self.call = call

    def prepared(self) -> Call:
        """The core's call."""
        return self.call


def _core_call(func: str, make: Callable[[], Call]) -> Call:
    """The core's call ``make`` makes, its refusals as ``func``'s LLMException: a local cache
    that is gone without a prefix (as the registry's answer always was), anything else (a
    plan the core refuses, the request's size, a local span) with it."""
    try:
        return make()
    except CacheNotFound as e:
        raise to_llm_exception(e, "") from e
    except DatadistError as e:
        raise to_llm_exception(e, func) from e


def _prepare_pull(func: str, engine: NativeEngine, key: Any, cache_id: int, kind: int,
                  src_range: range | None, dst_range: range | None, n: int,
                  **spec: Any) -> Call:
    """The core's pull of ``key`` into local cache ``cache_id``, planned and checked there
    (NativeEngine.prepare_pull; refusals as :func:`_core_call`); then cache-manager mode's
    own-cluster rule."""
    call = _core_call(func, lambda: engine.prepare_pull(
        key.cluster_id, key_ref(key), cache_id, kind,
        src_layers=None if src_range is None else (src_range.start, src_range.stop),
        dst_layers=None if dst_range is None else (dst_range.start, dst_range.stop),
        tensor_num_per_layer=n, **spec))
    with llm_errors(func):
        _not_own(engine, key.cluster_id)
    return call


class CacheManager:
    """Caches, keys and transfers in cache-manager mode. Obtain via ``cache_manager``."""

    def __init__(self, engine: NativeEngine, *, remote_cache_accessible: bool = False,
                 mem_pool: bool = False, host_mem_pool: bool = False,
                 two_sided: bool = False) -> None:
        self._engine = engine
        self._enable_remote_cache_accessible = remote_cache_accessible
        self._enabled_mem_pool = mem_pool
        self._enable_host_mem_pool = host_mem_pool
        self._is_call_linked = False
        self._initialized = True
        self._kept: dict[int, list[Any]] = {}  # cache id -> memory objects registered
        self._planned = planned.new_map(engine)  # pulls' checked calls, by their arguments
        # A llm.LocalCommRes rank table: two-sided links (LLMDataDist.link) listen on its
        # ports, so a PROMPT without listen_ip_info is expected; nothing to warn about.
        self._told_not_listening = two_sided

    def set_is_call_linked(self) -> None:
        self._is_call_linked = True

    def _engine_or_raise(self, code: LLMStatusCode = LLMStatusCode.LLM_PARAM_INVALID
                         ) -> NativeEngine:
        """Every operation's first step: a manager of a finalized session (``finalize()``, or
        an ``init()`` after it that made a new manager) is refused, LLMException with the
        code the original's wrapper answers once ``finalize_v2`` dropped its engine
        (src/python/llm_wrapper/llm_datadist_v2_wrapper.cc): ``code`` is LLM_FAILED for
        allocate / register / unregister (their ge::FAILED), LLM_PARAM_INVALID for the rest
        (LLM_CHECK_NOTNULL, src/llm_datadist/common/llm_log.h). Unlike there, before the
        arguments are checked, and also for a manager an ``init()`` replaced (the original's
        would act on the new engine with the old session's cache ids)."""
        if not self._initialized:
            raise LLMException("llm datadist is not initialized: it was finalized, and this "
                               "CacheManager's engine is gone (init() again, then use "
                               "LLMDataDist.cache_manager)",
                               status_code=code)
        return self._engine

    def _invalidate(self) -> None:
        self._initialized = False
        self._planned.clear()  # found by nobody from now (every call checks the above first)

    def _own(self, name: str, cache: Cache) -> Cache:
        """A Cache handle this manager made (or an unregistered ``create_cpu_cache``).

        A handle from another manager (one that ``finalize()`` invalidated before a new
        ``init()``) names a cache id of a finished session: the new session may have reused
        the id for another cache. It is refused as an unknown cache, LLM_KV_CACHE_NOT_EXIST,
        before its id is looked at.
        """
        check_same_session(name, cache.cache_id, cache._cache_manager, self)
        return cache

    # ------------------------------------------------------------------ registration

    def _remote_accessible(self, desc: CacheDesc, value: bool | None) -> bool:
        check_isinstance("remote_accessible", value, bool)
        if value is True and self._is_call_linked:
            raise LLMException("you can not register remote accessible cache after link.",
                               status_code=LLMStatusCode.LLM_PARAM_INVALID)
        # datadist serves every registered cache to linked peers unless told otherwise:
        # remote_accessible=False keeps a cache private.
        return value is not False

    def _addrs(self, addrs: Any, desc: CacheDesc, geo: layout.Geometry,
               func: str) -> tuple[list[int], list[Any]]:
        """The tensor addresses of a registration, and the objects to keep alive with it.

        An item is an int address or (datadist extension) a CPU torch tensor or a buffer
        (numpy array) whose size must cover one tensor of ``desc``. Every tensor's range must
        be mapped readable and writable in this process, checked once here: otherwise
        LLM_PARAM_INVALID naming the tensor and the range, instead of a crash at the first
        transfer.
        """
        # A list, as in llm_datadist's register_cache / register_blocks_cache: a tuple is a
        # TypeError there.
        check_isinstance("addrs", addrs, list, allow_none=False)
        raise_if_false(len(addrs) > 0, "addrs can not be empty.")
        with llm_errors(func):
            mems = [user_memory(a, f"addrs[{i}]") for i, a in enumerate(addrs)]
        for m in mems:
            check_int("addr", m.addr, "uint64", allow_none=False)
        raise_if_false(len(addrs) == desc.num_tensors,
                       f"addrs length should be equal to num_tensors. ({len(addrs)} addrs, "
                       f"num_tensors={desc.num_tensors})")
        raise_if_false(all(m.addr != 0 for m in mems), "addr can not be zero.")
        need = geo.tensor_bytes
        for i, m in enumerate(mems):
            raise_if_false(m.nbytes is None or m.nbytes >= need,
                           f"addrs[{i}] holds {m.nbytes} bytes but {desc} needs {need} bytes "
                           "per tensor")
        raise_if_false(all(m.addr <= _U64 - need for m in mems),
                       "a tensor's range passes the end of the address space")
        bases = np.array([m.addr for m in mems], dtype=np.uint64)
        with llm_errors(func):
            # GPU memory (a DEVICE cache on a CUDA host) is not mapped for the CPU: the CUDA
            # runtime vouches for it instead (NIXL then registers it as VRAM)
            gpu = native.cuda_device if desc.placement == Placement.DEVICE else None
            mapped.check_ranges([f"tensor {i}" for i in range(len(mems))], bases,
                                np.full(len(mems), need, dtype=np.uint64), func, gpu=gpu)
        return [m.addr for m in mems], [m.owner for m in mems if m.owner is not None]

    def register_cache(self, cache_desc: CacheDesc, addrs: list[int],
                       cache_keys: tuple[CacheKey, ...] | list[CacheKey] = (),
                       remote_accessible: bool | None = None) -> Cache:
        """Register user memory (one address per tensor) as a contiguous cache."""
        engine = self._engine_or_raise(LLMStatusCode.LLM_FAILED)
        # v2/cache_manager.py register_cache's order: the types, the after-link rule, then
        # the addresses' count and values
        check_isinstance("cache_desc", cache_desc, CacheDesc, allow_none=False)
        check_isinstance("addrs", addrs, list, allow_none=False)
        keys = local_keys(cache_keys)
        ra = self._remote_accessible(cache_desc, remote_accessible)
        raise_if_false(len(addrs) > 0, "addrs can not be empty.")
        geo = geometry_of(cache_desc, blocks=False)
        addr_list, keep = self._addrs(addrs, cache_desc, geo, "register_cache")
        with llm_errors("register_cache"):
            entry = engine.register(geo, addr_list, placement=int(cache_desc.placement),
                                    keys=keys, remote_accessible=ra)
        self._keep(entry.cache_id, keep)
        self._check_listening(engine)
        return Cache(entry.cache_id, cache_desc, addr_list, self, True, False)

    def register_blocks_cache(self, cache_desc: CacheDesc, addrs: list[int],
                              blocks_cache_key: BlocksCacheKey | None = None,
                              remote_accessible: bool | None = None) -> Cache:
        """Register user memory as a paged cache: shape[0] is the number of blocks."""
        engine = self._engine_or_raise(LLMStatusCode.LLM_FAILED)
        check_isinstance("cache_desc", cache_desc, CacheDesc, allow_none=False)
        check_isinstance("addrs", addrs, list, allow_none=False)
        check_isinstance("blocks_cache_key", blocks_cache_key, BlocksCacheKey)
        ra = self._remote_accessible(cache_desc, remote_accessible)
        raise_if_false(len(addrs) > 0, "addrs can not be empty.")
        geo = geometry_of(cache_desc, blocks=True)
        addr_list, keep = self._addrs(addrs, cache_desc, geo, "register_blocks_cache")
        model = None if blocks_cache_key is None else blocks_cache_key.model_id & _U64
        with llm_errors("register_blocks_cache"):
            entry = engine.register(geo, addr_list, placement=int(cache_desc.placement),
                                    blocks_model_id=model, remote_accessible=ra)
        self._keep(entry.cache_id, keep)
        self._check_listening(engine)
        return Cache(entry.cache_id, cache_desc, addr_list, self, True, True)

    def _check_listening(self, engine: NativeEngine) -> None:
        """After a PROMPT's first registration or allocation: warn once when it listens
        nowhere, so that no DECODER can link to it (its links would fail at once)."""
        if self._told_not_listening or engine.role != 1 or engine.listener is not None:
            return
        self._told_not_listening = True
        warnings.warn(
            "this PROMPT registers caches but listens nowhere: no DECODER can link to it to "
            "pull them (set LLMConfig.listen_ip_info = 'ip:port'; ignore this if it only "
            "pushes over links it makes, or joins a two-sided link with link())",
            NotListeningWarning, stacklevel=3)

    def _keep(self, cache_id: int, owners: list[Any]) -> None:
        """Hold the arrays / tensors a registration was given until it is unregistered (or
        this manager goes away with its session)."""
        if owners:
            self._kept[cache_id] = owners

    def unregister_cache(self, cache_id: int) -> None:
        """Forget a registered cache; unknown ids are fine. Waits for transfers using it."""
        engine = self._engine_or_raise(LLMStatusCode.LLM_FAILED)
        check_int("cache_id", cache_id, "int64", allow_none=False)
        with llm_errors("unregister_cache"):
            engine.unregister(cache_id)
        self._kept.pop(cache_id, None)  # unregister waited for transfers using the memory

    # ------------------------------------------------------------------ pools

    def _check_pool(self, desc: CacheDesc) -> None:
        """v2/cache_manager.py allocate_cache / allocate_blocks_cache, after the types: a
        tensor count above zero, then a pool configured for the placement; their texts, then
        (datadist's addition) the setting that gives the missing pool and the ones there are."""
        raise_if_false(desc.num_tensors > 0, "num_tensors should be bigger than zero.")
        device = desc.placement == Placement.DEVICE
        if (self._enabled_mem_pool and device) or (self._enable_host_mem_pool and not device):
            return
        want = ("LLMConfig.mem_pool_cfg (option llm.MemPoolConfig)" if device else
                "LLMConfig.host_mem_pool_cfg (option llm.HostMemPoolConfig)")
        have = [name for name, on in (("Placement.DEVICE", self._enabled_mem_pool),
                                      ("Placement.HOST", self._enable_host_mem_pool)) if on]
        raise LLMException(
            "you should config memory pool firstly and then set placement that matches it. "
            f"(a {desc.placement.name} cache is allocated from the pool that {want} gives, "
            "e.g. '{\"memory_size\": 1073741824}', set before init(); this LLMDataDist has "
            + (f"a pool for {' and '.join(have)} only" if have else "no pool") + ")",
            status_code=LLMStatusCode.LLM_PARAM_INVALID)

    def allocate_cache(self, cache_desc: CacheDesc,
                       cache_keys: tuple[CacheKey, ...] | list[CacheKey] = ()) -> Cache:
        """Allocate a contiguous cache from the pool of its placement; key i binds slot i."""
        engine = self._engine_or_raise(LLMStatusCode.LLM_FAILED)
        check_isinstance("cache_desc", cache_desc, CacheDesc, allow_none=False)
        keys = local_keys(cache_keys)
        self._check_pool(cache_desc)
        geo = geometry_of(cache_desc, blocks=False)
        with llm_errors("allocate_cache"):
            entry = engine.allocate(geo, placement=int(cache_desc.placement), keys=keys)
        self._check_listening(engine)
        return Cache(entry.cache_id, cache_desc, entry.addrs.tolist(), self, False, False)

    def allocate_blocks_cache(self, cache_desc: CacheDesc,
                              blocks_cache_key: BlocksCacheKey | None = None) -> Cache:
        engine = self._engine_or_raise(LLMStatusCode.LLM_FAILED)
        check_isinstance("cache_desc", cache_desc, CacheDesc, allow_none=False)
        check_isinstance("blocks_cache_key", blocks_cache_key, BlocksCacheKey)
        self._check_pool(cache_desc)
        geo = geometry_of(cache_desc, blocks=True)
        model = None if blocks_cache_key is None else blocks_cache_key.model_id & _U64
        with llm_errors("allocate_blocks_cache"):
            entry = engine.allocate(geo, placement=int(cache_desc.placement),
                                    blocks_model_id=model)
        self._check_listening(engine)
        return Cache(entry.cache_id, cache_desc, entry.addrs.tolist(), self, False, True)

    def deallocate_cache(self, cache: Cache) -> None:
        """Drop the cache id; memory is freed once no key holds it. Unknown: no-op."""
        engine = self._engine_or_raise()
        check_isinstance("cache", cache, Cache, allow_none=False)
        self._own("cache", cache)
        raise_if_false(not cache.is_blocks_cache,
                       "param check failed, cache can not be blocks cache.")
        with llm_errors("deallocate_cache"):
            engine.deallocate(cache.cache_id)
        if not cache._is_registered:
            cache._clear()

    def deallocate_blocks_cache(self, cache: Cache) -> None:
        engine = self._engine_or_raise()
        check_isinstance("cache", cache, Cache, allow_none=False)
        self._own("cache", cache)
        raise_if_false(cache.is_blocks_cache, "param check failed, cache should be blocks cache.")
        with llm_errors("deallocate_blocks_cache"):
            engine.deallocate(cache.cache_id, blocks=True)
        if not cache._is_registered:
            cache._clear()

    def remove_cache_key(self, cache_key: CacheKey) -> None:
        """Unbind a key of an allocated cache. Unknown keys, and keys on registered memory,
        are a no-op."""
        engine = self._engine_or_raise()
        check_isinstance("cache_key", cache_key, CacheKey, allow_none=False)
        k = key_id(cache_key.req_id, cache_key.prefix_id, cache_key.model_id)
        if k is not None:
            engine.remove_key(k)

    # ------------------------------------------------------------------ pulls

    def _check_local(self, engine: NativeEngine, cache: Cache) -> layout.Geometry:
        """The local cache as it was registered (KV_CACHE_NOT_EXIST if gone). Plans use this
        geometry, not the Cache's CacheDesc, which the caller may have changed since."""
        try:
            return engine.cache(cache.cache_id).geometry
        except DatadistError as e:
            raise to_llm_exception(e, "") from e

    def _check_cache_key(self, key: Any) -> None:
        if isinstance(key, CacheKey):  # the original's CacheManager.check_cache_key, its texts
            types.check_cache_key(key)

    def pull_cache(self, cache_key: CacheKey | CacheKeyByIdAndIndex, cache: Cache,
                   batch_index: int = 0, size: int = -1, **kwargs: Any) -> None:
        """Read one remote batch slot into slot ``batch_index`` of ``cache``.

        The key kinds depend on the mode (docs/modes.md), as in llm_datadist: a
        ``CacheKeyByIdAndIndex`` (the remote cache's id and batch slot) always; a ``CacheKey``
        (a request's key, bound by the peer's ``allocate_cache``) only while
        ``enable_remote_cache_accessible`` is off, which ``local_comm_res`` turns on unless it
        is set to False: there a CacheKey is a TypeError that says so.

        Blocks until done; LLMException LLM_TIMEOUT after ``sync_kv_timeout``.
        """
        if self._initialized:  # a planned call's hit, run in one native call (api/planned.py)
            try:
                if self._planned.run_slot(cache_key, cache, batch_index, size, kwargs,
                                          self._engine.config.sync_timeout):
                    return
            except DatadistError as e:
                raise _refusal(e, "pull_cache", cache, blocks=False) from e
        req = self._pull_cache_request(cache_key, cache, batch_index, size, kwargs)
        try:
            req.engine.run(req.prepared())
        except DatadistError as e:
            raise _refusal(e, "pull_cache", cache, blocks=False) from e

    def pull_cache_async(self, cache_key: CacheKey | CacheKeyByIdAndIndex, cache: Cache,
                         batch_index: int = 0, size: int = -1,
                         **kwargs: Any) -> TransferHandle:
        """:meth:`pull_cache`, issued (datadist extension): the same parameters and argument
        checks (TypeError / ValueError / LLMException raised here, before anything is
        issued); returns a :class:`~datadist.TransferHandle` at once, which reports the
        transfer's outcome (every failure of the transfer itself, not linked included)."""
        req = self._pull_cache_request(cache_key, cache, batch_index, size, kwargs)
        try:
            return TransferHandle(req.engine.submit(req.prepared()), "pull_cache_async")
        except DatadistError as e:  # refused before anything was issued (its cache gone)
            raise _refusal(e, "pull_cache_async", cache, blocks=False) from e

    def _pull_cache_request(self, cache_key: Any, cache: Any, batch_index: Any, size: Any,
                            kwargs: dict[str, Any]) -> _Request:
        """pull_cache's checks and plan, or those of an earlier call with the same arguments
        (api/planned.py); the engine's arguments. The session must be open
        (``_engine_or_raise``, as every call's first check)."""
        engine = self._engine_or_raise()
        # The plan was made for this Cache's id (the key holds the Cache), whose geometry the
        # core never changes: the core refuses the transfer (CacheNotFound) once the cache
        # is gone, and its spans were checked against that cache (Session::Prepare), so a
        # hit needs no look of its own.
        call = self._planned.find_slot(cache_key, cache, batch_index, size, kwargs)
        if call is not None:
            return _Request(engine, call)
        req = self._check_pull_cache(cache_key, cache, batch_index, size, kwargs)
        self._planned.put_slot(cache_key, cache, batch_index, size, kwargs, req.call)
        return req

    def _check_pull_cache(self, cache_key: Any, cache: Any, batch_index: Any, size: Any,
                          kwargs: dict[str, Any]) -> _Request:
        """pull_cache's checks, in the original's order; the engine's arguments."""
        engine = self._engine_or_raise()
        # v2/cache_manager.py pull_cache's order: the key's type (for the mode), the cache,
        # batch_index, size, the kind of cache, size's value, tensor_num_per_layer, the key's
        # ids, the layer ranges; the registry (the native layer there) after them all
        if self._enable_remote_cache_accessible:
            if isinstance(cache_key, CacheKey):
                raise TypeError(_BY_ID_ONLY)
            check_isinstance("cache_key", cache_key, CacheKeyByIdAndIndex, allow_none=False)
        else:
            check_isinstance("cache_key", cache_key, (CacheKey, CacheKeyByIdAndIndex),
                             allow_none=False)
        check_isinstance("cache", cache, Cache, allow_none=False)
        self._own("cache", cache)
        check_int("batch_index", batch_index, "uint32", allow_none=False)
        check_int("size", size, "int64", allow_none=False)
        raise_if_false(not cache.is_blocks_cache,
                       "param check failed, cache can not be blocks cache.")
        raise_if_false(size == -1 or size > 0,
                       f"[pull_cache] param check failed, size ({size}) is invalid, should be "
                       "= -1 or > 0")
        src_range, dst_range, n = parse_layer_kwargs(kwargs, "pull_cache",
                                                     cache.cache_desc.num_tensors)
        self._check_cache_key(cache_key)
        check_pull_ranges(src_range, dst_range)
        return _Request(engine, _prepare_pull(
            "pull_cache", engine, cache_key, cache.cache_id, PULL_SLOT, src_range, dst_range, n,
            batch_index=batch_index, size=size))

    def pull_blocks(self, src_cache_key: CacheKey | CacheKeyByIdAndIndex | BlocksCacheKey,
                    dst_cache: Cache, src_blocks: tuple[int, ...] | list[int] = (),
                    dst_blocks: tuple[int, ...] | list[int] = (), **kwargs: Any) -> None:
        """Read remote blocks ``src_blocks[i]`` into local blocks ``dst_blocks[i]``; with a
        CacheKey / CacheKeyByIdAndIndex, split a contiguous remote slot into the blocks."""
        if self._initialized:  # a planned call's hit, run in one native call (api/planned.py)
            try:
                if self._planned.run_blocks(src_cache_key, dst_cache, src_blocks, dst_blocks,
                                            kwargs, self._engine.config.sync_timeout):
                    return
            except DatadistError as e:
                raise _refusal(e, "pull_blocks", dst_cache, blocks=True) from e
        req = self._pull_blocks_request(src_cache_key, dst_cache, src_blocks, dst_blocks,
                                        kwargs)
        try:
            req.engine.run(req.prepared())
        except DatadistError as e:
            raise _refusal(e, "pull_blocks", dst_cache, blocks=True) from e

    def pull_blocks_async(self, src_cache_key: CacheKey | CacheKeyByIdAndIndex | BlocksCacheKey,
                          dst_cache: Cache, src_blocks: tuple[int, ...] | list[int] = (),
                          dst_blocks: tuple[int, ...] | list[int] = (),
                          **kwargs: Any) -> TransferHandle:
        """:meth:`pull_blocks`, issued (datadist extension): as :meth:`pull_cache_async`."""
        req = self._pull_blocks_request(src_cache_key, dst_cache, src_blocks, dst_blocks,
                                        kwargs)
        try:
            return TransferHandle(req.engine.submit(req.prepared()), "pull_blocks_async")
        except DatadistError as e:  # refused before anything was issued (its cache gone)
            raise _refusal(e, "pull_blocks_async", dst_cache, blocks=True) from e

    def _pull_blocks_request(self, src_cache_key: Any, dst_cache: Any, src_blocks: Any,
                             dst_blocks: Any, kwargs: dict[str, Any]) -> _Request:
        """pull_blocks's checks and plan, or those of an earlier call with the same arguments
        (api/planned.py); the engine's arguments. As :meth:`_pull_cache_request`."""
        engine = self._engine_or_raise()
        call = self._planned.find_blocks(src_cache_key, dst_cache, src_blocks, dst_blocks, kwargs)
        if call is not None:
            return _Request(engine, call)
        req = self._check_pull_blocks(src_cache_key, dst_cache, src_blocks, dst_blocks, kwargs)
        self._planned.put_blocks(src_cache_key, dst_cache, src_blocks, dst_blocks, kwargs,
                                 req.call)
        return req

    def _check_pull_blocks(self, src_cache_key: Any, dst_cache: Any, src_blocks: Any,
                           dst_blocks: Any, kwargs: dict[str, Any]) -> _Request:
        """pull_blocks's checks, in the original's order; the engine's arguments."""
        engine = self._engine_or_raise()
        check_isinstance("src_cache_key", src_cache_key,
                         (CacheKey, CacheKeyByIdAndIndex, BlocksCacheKey), allow_none=False)
        check_isinstance("dst_cache", dst_cache, Cache, allow_none=False)
        self._own("dst_cache", dst_cache)
        src = int_list("src_blocks", src_blocks, "uint64", types=(list, tuple, np.ndarray))
        dst = int_list("dst_blocks", dst_blocks, "uint64", types=(list, tuple, np.ndarray))
        # v2/cache_manager.py pull_blocks's order after the types: the kind of cache,
        # dst_blocks, tensor_num_per_layer, the key's rules, then the layer ranges
        raise_if_false(dst_cache.is_blocks_cache,
                       "param check failed, dst_cache should be blocks cache.")
        raise_if_false(len(dst) > 0, "dst_blocks can not be empty.")
        src_range, dst_range, n = parse_layer_kwargs(kwargs, "pull_blocks",
                                                     dst_cache.cache_desc.num_tensors)
        by_blocks = isinstance(src_cache_key, BlocksCacheKey)
        if by_blocks:
            raise_if_false(len(src) > 0, "src_blocks can not be empty.")
        else:
            self._check_cache_key(src_cache_key)
            raise_if_false(len(src) == 0, "src_blocks should be empty when src_cache_key is not "
                                          "instance of BlocksCacheKey.")
        check_pull_ranges(src_range, dst_range)
        if by_blocks:
            call = _prepare_pull("pull_blocks", engine, src_cache_key, dst_cache.cache_id,
                                 PULL_BLOCKS, src_range, dst_range, n, src_blocks=src,
                                 dst_blocks=dst)
        else:
            call = _prepare_pull("pull_blocks", engine, src_cache_key, dst_cache.cache_id,
                                 PULL_SLOT_TO_BLOCKS, src_range, dst_range, n, dst_blocks=dst)
        return _Request(engine, call)

    # ------------------------------------------------------------------ pushes

    def _require_remote_accessible(self, what: str) -> None:
        if not self._enable_remote_cache_accessible:
            raise LLMException(f"{what} is only supported while enable_remote_cache_accessible "
                               "is True (this LLMDataDist runs in cache-manager mode without "
                               "it: set LLMConfig.enable_remote_cache_accessible = True, or "
                               "local_comm_res, on both sides; docs/modes.md)",
                               status_code=LLMStatusCode.LLM_PARAM_INVALID)

    def push_cache(self, dst_cache_key: CacheKeyByIdAndIndex, src_cache: Cache,
                   src_batch_index: int = 0, src_layer_range: range | None = None,
                   dst_layer_range: range | None = None, size: int = -1,
                   tensor_num_per_layer: int = 2) -> None:
        """Write local slot ``src_batch_index`` into the remote cache id / batch slot."""
        req = self._push_cache_request(dst_cache_key, src_cache, src_batch_index,
                                       src_layer_range, dst_layer_range, size,
                                       tensor_num_per_layer)
        try:
            req.engine.run(req.prepared())
        except DatadistError as e:
            raise _refusal(e, "push_cache", src_cache, blocks=False) from e

    def push_cache_async(self, dst_cache_key: CacheKeyByIdAndIndex, src_cache: Cache,
                         src_batch_index: int = 0, src_layer_range: range | None = None,
                         dst_layer_range: range | None = None, size: int = -1,
                         tensor_num_per_layer: int = 2) -> TransferHandle:
        """:meth:`push_cache`, issued (datadist extension): as :meth:`pull_cache_async`."""
        req = self._push_cache_request(dst_cache_key, src_cache, src_batch_index,
                                       src_layer_range, dst_layer_range, size,
                                       tensor_num_per_layer)
        try:
            return TransferHandle(req.engine.submit(req.prepared()), "push_cache_async")
        except DatadistError as e:  # refused before anything was issued (its cache gone)
            raise _refusal(e, "push_cache_async", src_cache, blocks=False) from e

    def _push_cache_request(self, dst_cache_key: Any, src_cache: Any, src_batch_index: Any,
                            src_layer_range: Any, dst_layer_range: Any, size: Any,
                            tensor_num_per_layer: Any) -> _Request:
        """push_cache's checks, in the original's order; the engine's arguments."""
        engine = self._engine_or_raise()
        # v2/cache_manager.py push_cache's order: the mode, the types, the kind of cache, the
        # layers, then the size; the registry (the native layer there) after them all
        self._require_remote_accessible("push_cache")
        check_isinstance("dst_cache_key", dst_cache_key, CacheKeyByIdAndIndex, allow_none=False)
        check_isinstance("src_cache", src_cache, Cache, allow_none=False)
        self._own("src_cache", src_cache)
        check_int("src_batch_index", src_batch_index, "uint32", allow_none=False)
        raise_if_false(not src_cache.is_blocks_cache,
                       "param check failed, cache can not be blocks cache.")
        src_range, dst_range, n = push_layers(src_cache.cache_desc.num_tensors, src_layer_range,
                                              dst_layer_range, tensor_num_per_layer,
                                              "push_cache")
        check_int("size", size, "int64", allow_none=False)
        raise_if_false(size == -1,
                       f"[push_cache] param check failed, size ({size}) is invalid, should be "
                       "= -1.")
        geo = self._check_local(engine, src_cache)
        remote, local, count = push_tensor_pairs(geo.num_tensors, src_range, dst_range, n)
        return _Request(engine, _core_call("push_cache", lambda: engine.prepare_push(
            dst_cache_key.cluster_id, key_ref(dst_cache_key), src_cache.cache_id, blocks=False,
            batch_index=src_batch_index, size=size, remote_first=remote, local_first=local,
            count=count)))

    def push_blocks(self, dst_cache_key: BlocksCacheKey, src_cache: Cache,
                    src_blocks: tuple[int, ...] | list[int] = (),
                    dst_blocks: tuple[int, ...] | list[int] = (),
                    src_layer_range: range | None = None, dst_layer_range: range | None = None,
                    tensor_num_per_layer: int = 2) -> None:
        """Write local blocks ``src_blocks[i]`` into remote blocks ``dst_blocks[i]``."""
        req = self._push_blocks_request(dst_cache_key, src_cache, src_blocks, dst_blocks,
                                        src_layer_range, dst_layer_range, tensor_num_per_layer)
        try:
            req.engine.run(req.prepared())
        except DatadistError as e:
            raise _refusal(e, "push_blocks", src_cache, blocks=True) from e

    def push_blocks_async(self, dst_cache_key: BlocksCacheKey, src_cache: Cache,
                          src_blocks: tuple[int, ...] | list[int] = (),
                          dst_blocks: tuple[int, ...] | list[int] = (),
                          src_layer_range: range | None = None,
                          dst_layer_range: range | None = None,
                          tensor_num_per_layer: int = 2) -> TransferHandle:
        """:meth:`push_blocks`, issued (datadist extension): as :meth:`pull_cache_async`."""
        req = self._push_blocks_request(dst_cache_key, src_cache, src_blocks, dst_blocks,
                                        src_layer_range, dst_layer_range, tensor_num_per_layer)
        try:
            return TransferHandle(req.engine.submit(req.prepared()), "push_blocks_async")
        except DatadistError as e:  # refused before anything was issued (its cache gone)
            raise _refusal(e, "push_blocks_async", src_cache, blocks=True) from e

    def _push_blocks_request(self, dst_cache_key: Any, src_cache: Any, src_blocks: Any,
                             dst_blocks: Any, src_layer_range: Any, dst_layer_range: Any,
                             tensor_num_per_layer: Any) -> _Request:
        """push_blocks's checks, in the original's order; the engine's arguments."""
        engine = self._engine_or_raise()
        # v2/cache_manager.py push_blocks's order, as push_cache's
        self._require_remote_accessible("push_blocks")
        check_isinstance("dst_cache_key", dst_cache_key, BlocksCacheKey, allow_none=False)
        check_isinstance("src_cache", src_cache, Cache, allow_none=False)
        self._own("src_cache", src_cache)
        src = int_list("src_blocks", src_blocks, "uint64", types=(list, tuple, np.ndarray))
        dst = int_list("dst_blocks", dst_blocks, "uint64", types=(list, tuple, np.ndarray))
        raise_if_false(src_cache.is_blocks_cache,
                       "param check failed, cache should be blocks cache.")
        raise_if_false(len(dst) > 0, "dst_blocks can not be empty.")
        src_range, dst_range, n = push_layers(src_cache.cache_desc.num_tensors, src_layer_range,
                                              dst_layer_range, tensor_num_per_layer,
                                              "push_blocks")
        geo = self._check_local(engine, src_cache)
        remote, local, count = push_tensor_pairs(geo.num_tensors, src_range, dst_range, n)
        return _Request(engine, _core_call("push_blocks", lambda: engine.prepare_push(
            dst_cache_key.cluster_id, key_ref(dst_cache_key), src_cache.cache_id, blocks=True,
            src_blocks=src, dst_blocks=dst, remote_first=remote, local_first=local,
            count=count)))

    # ------------------------------------------------------------------ local copies
    # Argument rules shared with the legacy KvCacheManager live in api/local_ops.py and
    # api/async_transfer.py.

    @staticmethod
    def _ref(cache: Cache) -> local_ops.CacheRef:
        return local_ops.CacheRef(cache.cache_id, cache.cache_desc, cache.is_blocks_cache,
                                  cache.tensor_addrs)

    def copy_cache(self, dst: Cache, src: Cache, dst_batch_index: int = 0,
                   src_batch_index: int = 0, offset: int = 0, size: int = -1,
                   req_id: int | None = None) -> None:
        """Copy slot ``src_batch_index`` of every tensor of ``src`` into slot
        ``dst_batch_index`` of the same tensor of ``dst``: ``size`` bytes from ``offset``
        within the slot (-1: the rest of the source slot). Local; blocks until done.

        Neither cache may be a blocks cache; both need the same tensor count; ``offset`` and
        ``size`` must fit both slots (PARAM_INVALID). ``req_id`` is only for logs.
        """
        engine = self._engine_or_raise()
        check_isinstance("dst", dst, Cache, allow_none=False)
        self._own("dst", dst)
        check_isinstance("src", src, Cache, allow_none=False)
        self._own("src", src)
        check_int("dst_batch_index", dst_batch_index, "uint32", allow_none=False)
        check_int("src_batch_index", src_batch_index, "uint32", allow_none=False)
        check_int("offset", offset, "uint64", allow_none=False)
        check_int("size", size, "int64", allow_none=False)
        local_ops.check_copy_cache(self._ref(dst), self._ref(src), size)
        check_int("req_id", req_id, "uint64")  # after the caches and size, as the original
        local_ops.copy_cache(engine, self._ref(dst), self._ref(src), dst_batch_index,
                             src_batch_index, offset, size)

    def copy_blocks(self, cache: Cache, copy_block_info: dict[int, list[int]]) -> None:
        """Copy blocks within one blocks cache: ``{src_block: [dst_block, ...]}``. Local;
        blocks until done. A block may not be both a source and a destination, nor a
        destination twice (PARAM_INVALID); an empty dict copies nothing."""
        engine = self._engine_or_raise()
        check_isinstance("cache", cache, Cache, allow_none=False)
        self._own("cache", cache)
        check_isinstance("copy_block_info", copy_block_info, dict, allow_none=False)
        local_ops.copy_blocks(engine, self._ref(cache), copy_block_info)

    def swap_blocks(self, src_cache: Cache, dst_cache: Cache, src_to_dst: dict[int, int]) -> None:
        """Copy blocks ``{src: dst}`` HOST -> DEVICE (swap in) or DEVICE -> HOST (swap out);
        the HOST side is typically ``Cache.create_cpu_cache``. Both blocks caches, with the
        same block bytes and tensor count. Same placement on both sides: PARAM_INVALID.
        On a host without CUDA, DEVICE memory is host memory too: a swap is a host copy."""
        engine = self._engine_or_raise()
        check_isinstance("src_cache", src_cache, Cache, allow_none=False)
        self._own("src_cache", src_cache)
        check_isinstance("dst_cache", dst_cache, Cache, allow_none=False)
        self._own("dst_cache", dst_cache)
        local_ops.swap_blocks(engine, self._ref(src_cache), self._ref(dst_cache), src_to_dst)

    def remap_registered_memory(self, mem_infos: MemInfo | list[MemInfo]) -> None:
        """Re-pin registered device memory after a memory fault (reserved in LLM-DataDist).

        The arguments are checked as LLM-DataDist does (a MemInfo or a list of them, each
        MEM_TYPE_DEVICE, addr != 0, size > 0; else LLM_PARAM_INVALID), then accepted as a
        no-op: datadist's memory is host memory (or CUDA memory through torch), which has no
        physical remapping to redo; transfers already use the registered addresses.
        """
        self._engine_or_raise()
        raise_if_false(isinstance(mem_infos, (list, MemInfo)),
                       f"mem_infos type only support list of MemInfo or MemInfo, but got "
                       f"{type(mem_infos)}.")
        infos = mem_infos if isinstance(mem_infos, list) else [mem_infos]
        for i, info in enumerate(infos):
            raise_if_false(isinstance(info, MemInfo),
                           f"mem_infos[{i}] type only support MemInfo, but got {type(info)}.")
            raise_if_false(info.mem_type == Memtype.MEM_TYPE_DEVICE,
                           "check mem_info.mem_type failed, only support "
                           f"Memtype.MEM_TYPE_DEVICE, index={i}.")
            raise_if_false(info.addr != 0,
                           f"check mem_info.addr failed, addr can not be zero, index={i}.")
            raise_if_false(info.size > 0,
                           f"check mem_info.size failed, size must be > 0, index={i}.")

    # ------------------------------------------------------------------ layer-wise

    def transfer_cache_async(self, src_cache: Cache, layer_synchronizer: LayerSynchronizer,
                             transfer_configs: list[TransferConfig | TransferWithCacheKeyConfig],
                             src_block_indices: list[int] | None = None,
                             dst_block_indices: list[int] | None = None,
                             dst_block_memory_size: int | None = None) -> Any:
        """Send ``src_cache`` layer by layer to every destination of ``transfer_configs``:
        layer i goes out as soon as ``layer_synchronizer.synchronize_layer(i, None)`` returns
        True (False aborts the destinations needing layer i with LLM_PARAM_INVALID).

        Returns a ``CacheTask`` at once. Destinations are ``TransferConfig`` (raw addresses
        of a cache the peer registered) without remote-cache-accessible, else
        ``TransferWithCacheKeyConfig`` (a push by key); the other kind is a TypeError. See
        :mod:`datadist.api.async_transfer` for blocks and every rule.
        """
        engine = self._engine_or_raise()
        check_isinstance("src_cache", src_cache, Cache, allow_none=False)
        self._own("src_cache", src_cache)
        return async_transfer.start_transfer(
            engine, src_cache.cache_id, src_cache.cache_desc, layer_synchronizer,
            transfer_configs, src_block_indices, dst_block_indices, dst_block_memory_size,
            key_configs=self._enable_remote_cache_accessible,
            default_error=LLMStatusCode.LLM_TIMEOUT)

    @staticmethod
    def check_cache_key(cache_key: CacheKey) -> None:
        """Exactly one of ``req_id`` and ``prefix_id`` valid, else LLM_PARAM_INVALID."""
        types.check_cache_key(cache_key)


__all__ = ["CacheManager", "Placement"]
