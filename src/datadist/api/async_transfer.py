"""Argument handling for ``transfer_cache_async``, shared by ``CacheManager`` and the legacy
``KvCacheManager``.

Who calls: those facades. Everything is checked here, synchronously (TypeError, ValueError,
LLMException PARAM_INVALID), before the layer loop starts (:class:`_CoreLoop`: every layer's
push prepared once and handed to the core's LayerRun, each layer let go to the core's workers
as soon as it is synchronized); after that, failures are codes in the returned
:class:`CacheTask`, one per transfer config. Returns at once; never blocks on a transfer.

Destinations:

* ``TransferConfig(dst_cluster_id, dst_addrs, src_layer_range, src_batch_index)``: raw
  addresses in the peer's memory, two per layer (K, V). Each address is sent as a write the
  peer resolves on its own side (wire ``KeyKind.ADDRESS``): the bytes land only if they fall
  inside one tensor of a cache the peer registered or allocated (remote accessible).
  Cache-manager mode without remote-cache-accessible, and legacy mode.
* ``TransferWithCacheKeyConfig(cache_key, src_layer_range, dst_layer_range,
  src_batch_index)``: a push by key (``CacheKeyByIdAndIndex`` slot, or ``BlocksCacheKey``
  blocks), layer ``src.start + k`` of the source into layer ``dst.start + k``. Cache-manager
  mode with remote-cache-accessible.

Block indices: ``src_block_indices`` + ``dst_block_indices`` (same length) send blocks;
``dst_block_indices`` alone cuts the source slot into ``dst_block_memory_size`` chunks.
Blocks into a contiguous destination are not supported.

A blocks-cache source *without* block indices is what LLM-DataDist's transfer_cache_async
sample does (hicann/hixl examples/python/transfer_cache_async_sample.py). The original checks
indices only when given, and its native side (src/llm_datadist/data_transfer/
layer_wise_transfer_job.cc, LayerWiseTransferJob::Prepare) then treats the source as a
cache whose batch is one block: a blocks cache is registered with batch size 1 and stride =
one block (cache_manager.cc, CreateCacheEntry), so

* without ``dst_block_indices`` (GenerateCacheToCacheTask) block 0 of each tensor of the
  layer goes to the destination slot (``CacheKeyByIdAndIndex``: its batch index;
  ``BlocksCacheKey``: offset 0, i.e. block 0), and ``src_batch_index`` must be 0;
* with ``dst_block_indices`` only (GenerateCacheToBlocksTask) the whole source tensor is cut
  into ``dst_block_memory_size`` chunks, chunk k to destination block k.

A contiguous source into a ``BlocksCacheKey`` destination without block indices is the
same cache-to-cache copy: the source slot lands at the start of each destination tensor.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np

from datadist.api.checks import check_int, check_isinstance, int_list
from datadist.api.enums import Placement
from datadist.api.status import LLMStatusCode, llm_errors, raise_if_false
from datadist.api.tasks import CacheTask
from datadist.api.types import (
    BlocksCacheKey,
    CacheDesc,
    CacheKeyByIdAndIndex,
    LayerSynchronizer,
    TransferConfig,
    TransferWithCacheKeyConfig,
    check_layer_range,
)
from datadist.core import layerwise
from datadist.core.errors import Code, DatadistError
from datadist.core.keys import KeyKind, KeyRef
from datadist.core.layout import Geometry
from datadist.core.native import (
    LAYER_BLOCKS,
    LAYER_SLOT,
    LAYER_SLOT_TO_BLOCKS,
    NativeEngine,
)

if TYPE_CHECKING:
    from datadist._core import Call, LayerRun

log = logging.getLogger(__name__)

TENSORS_PER_LAYER = 2  # hard-coded by LLM-DataDist for this API
WAIT_GRACE = 5.0  # s past an issued layer's own deadline that its end is waited for
_U64 = 2**64 - 1
_NO_BLOCKS = np.zeros(0, dtype=np.uint64)


def _invalid(message: str) -> NoReturn:
    """LLM_PARAM_INVALID with ``message`` (made only when a check fails: formatting every
    check's text cost each call a few microseconds)."""
    raise_if_false(False, message)
    raise AssertionError  # unreachable


def _block_indices(name: str, value: Any) -> np.ndarray | None:
    if value is None:
        return None
    indices: np.ndarray = int_list(name, value, "uint64", types=(list, tuple))
    return indices


def _layers(cfg: Any, num_layers: int) -> range:
    rng = cfg.src_layer_range if cfg.src_layer_range is not None else range(num_layers)
    if not 0 <= rng.start < rng.stop <= num_layers:
        _invalid(f"src_layer_range: {rng} out of range, src_layer_num = {num_layers}")
    return rng


def start_transfer(
    engine: NativeEngine,
    cache_id: int,
    desc: CacheDesc,
    layer_synchronizer: Any,
    transfer_configs: Any,
    src_block_indices: Any,
    dst_block_indices: Any,
    dst_block_memory_size: Any,
    *,
    key_configs: bool,
    default_error: LLMStatusCode,
) -> CacheTask:
    """Check everything, then start the layer-wise thread. See the module docstring."""
    raise_if_false(desc.placement != Placement.HOST,
                   "src cache not support placement HOST")  # v2/cache_manager.py's text
    # dst before src, as v2/llm_utils.py transfer_cache_async checks them
    dst_blocks = _block_indices("dst_block_indices", dst_block_indices)
    src_blocks = _block_indices("src_block_indices", src_block_indices)
    check_int("dst_block_memory_size", dst_block_memory_size, "uint64")
    has_src_blocks = src_blocks is not None and src_blocks.size > 0
    has_dst_blocks = dst_blocks is not None and dst_blocks.size > 0
    if src_blocks is not None and has_src_blocks:
        raise_if_false(dst_blocks is not None and has_dst_blocks,
                       "transfer from blocks to cache is not supported: give "
                       "dst_block_indices")
        assert dst_blocks is not None
        if len(src_blocks) != len(dst_blocks):
            _invalid(f"num_block_indices mismatches, src_num = {len(src_blocks)}, "
                     f"dst_num = {len(dst_blocks)}")
    elif has_dst_blocks:
        raise_if_false(dst_block_memory_size is not None,
                       "dst_block_memory_size must be set when transfer from cache to blocks")
    check_isinstance("layer_synchronizer", layer_synchronizer, LayerSynchronizer,
                     allow_none=False)
    check_isinstance("transfer_configs", transfer_configs, (list, tuple), allow_none=False)
    kind = TransferWithCacheKeyConfig if key_configs else TransferConfig
    for cfg in transfer_configs:
        if not isinstance(cfg, kind):
            # the original's check_isinstance(..., inner_class) text, and its prefix
            prefix = "While enable_remote_cache_accessible is True, " if key_configs else ""
            raise TypeError(f"{prefix}transfer_configs inner type only support "
                            f"[{kind.__name__}], but got {type(cfg)}.")
    if not (has_dst_blocks or dst_block_memory_size in (None, 0)):
        _invalid(f"dst_block_memory_size ({dst_block_memory_size}) is neither None nor 0 "
                 "while dst is not blocks")
    if desc.num_tensors % TENSORS_PER_LAYER != 0:
        _invalid(f"cache_desc.num_tensors ({desc.num_tensors}) is not even")
    with llm_errors("transfer_cache_async"):
        entry = engine.cache(cache_id)
    geo = entry.geometry
    raise_if_false(geo.is_blocks or not has_src_blocks,
                   "src_block_indices need a blocks cache source")
    if geo.is_blocks and not has_src_blocks:
        # The original's view of a blocks cache without indices (module docstring): one
        # batch slot of one block for a cache-to-cache copy, the whole tensor when cut into
        # destination blocks.
        geo = (Geometry(geo.num_tensors, geo.tensor_bytes, 1, False, geo.layout) if has_dst_blocks
               else Geometry(geo.num_tensors, geo.tensor_bytes, geo.units, False, geo.layout))
        raise_if_false(all(_src_unit(cfg) == 0 for cfg in transfer_configs),
                       "src_batch_index must be 0 for a blocks cache source")
    num_layers = desc.num_tensors // TENSORS_PER_LAYER
    dbb = int(dst_block_memory_size or 0)
    jobs = [
        _job(engine, cache_id, geo, cfg, num_layers, src_blocks if has_src_blocks else None,
             dst_blocks if has_dst_blocks else None, dbb)
        for cfg in transfer_configs
    ]
    task = CacheTask(len(jobs), default_error)
    _CoreLoop(
        engine,
        layer_synchronizer.synchronize_layer,
        jobs,
        lambda k, code: task._set(k, LLMStatusCode(int(code))),
        task._finish,
        sync_error=Code(int(default_error)),
        # each layer ends by its own deadline (sync_kv_timeout from its start, in the core);
        # waited for a little longer, then TIMEOUT, should the core not end it
        wait_s=engine.config.sync_timeout + WAIT_GRACE,
        task=task,
    ).start()
    return task


def _src_unit(cfg: Any) -> int:
    """The source batch slot a config sends. A ``BlocksCacheKey`` destination always takes
    slot 0: the original passes batch index 0 for it whatever ``src_batch_index`` says
    (llm_utils.TransferCacheJob.transfer_layer)."""
    if isinstance(getattr(cfg, "cache_key", None), BlocksCacheKey):
        return 0
    return int(cfg.src_batch_index)


def _job(engine: NativeEngine, cache_id: int, geo: Any, cfg: Any, num_layers: int,
         src_blocks: np.ndarray | None, dst_blocks: np.ndarray | None,
         dbb: int) -> _Job:
    """One destination: the face's checks of its config, then every layer's calls prepared
    by the core in one call (spans planned and checked there), kept by the engine."""
    # The original's checks, in its order (v2/llm_utils.py TransferCacheJob.
    # check_transfer_config): with source blocks, src_batch_index must be 0; then the layer
    # range, then (TransferConfig) the number of addresses; its texts start each message.
    src_unit = _src_unit(cfg)
    if src_blocks is not None and src_unit != 0:
        _invalid(f"Invalid TransferConfig, src_batch_index ({src_unit}) "
                 "!= 0 while src is blocks")
    layers = _layers(cfg, num_layers)
    n = TENSORS_PER_LAYER

    def check_unit() -> None:
        # datadist's own check, after the original's: the original checks src_batch_index
        # of a contiguous source natively (its result is the task's); here it is refused at
        # the call, with the text the original has for the range (check_transfer_config)
        if src_blocks is None and src_unit >= geo.units:
            _invalid(f"Invalid TransferConfig, src_batch_index ({src_unit}) out of range: "
                     f"[0, {geo.units})")

    # The spans of a layer, their bounds and every raw address's overflow are the core's
    # (Session::PrepareLayerPushes, PlanLayerSpans): every layer's calls made here, at once,
    # its refusals raised from this call.
    if src_blocks is not None:
        kind, blocks_dbb = LAYER_BLOCKS, dbb  # 0: a source block apart
    elif dst_blocks is not None:
        kind, blocks_dbb = LAYER_SLOT_TO_BLOCKS, dbb
    else:
        kind, blocks_dbb = LAYER_SLOT, 0

    def prepare(cluster: int, ref: KeyRef, unit_bytes: int, dst_first: int,
                dst_addrs: Sequence[int] = ()) -> list[Call]:
        with llm_errors("transfer_cache_async"):
            return engine.prepare_layer_pushes(
                cluster, ref, unit_bytes, cache_id, kind=kind, src_unit=src_unit,
                src_blocks=src_blocks if src_blocks is not None else _NO_BLOCKS,
                dst_blocks=dst_blocks if dst_blocks is not None else _NO_BLOCKS,
                dst_block_bytes=blocks_dbb, src_first=layers.start, dst_first=dst_first,
                layers=len(layers), tensors_per_layer=n, dst_addrs=dst_addrs)

    if isinstance(cfg, TransferConfig):
        cluster = cfg.dst_cluster_id
        if len(cfg.dst_addrs) != len(layers) * n:
            _invalid(f"expect {len(layers) * n} dst_addrs, but len(dst_addrs) = "
                     f"{len(cfg.dst_addrs)}, range = {layers}")
        check_unit()
        raise_if_false(all(a != 0 for a in cfg.dst_addrs), "dst_addrs must be non-zero")
        # each tensor has its own destination address: one push each, in order
        by_tensor = prepare(cluster, KeyRef(KeyKind.ADDRESS), 0, 0, list(cfg.dst_addrs))
        return _Job(layers, lambda i: by_tensor[(i - layers.start) * n:
                                                (i - layers.start + 1) * n], by_tensor, n)

    check_unit()
    key = cfg.cache_key
    check_isinstance("cache_key", key, (BlocksCacheKey, CacheKeyByIdAndIndex), allow_none=False)
    check_layer_range("src_layer_range", cfg.src_layer_range)
    check_layer_range("dst_layer_range", cfg.dst_layer_range)
    raise_if_false(cfg.src_layer_range is not None and cfg.dst_layer_range is not None,
                   "TransferWithCacheKeyConfig needs src_layer_range and dst_layer_range")
    if len(cfg.src_layer_range) != len(cfg.dst_layer_range):
        _invalid(f"src_layer_range {cfg.src_layer_range} and dst_layer_range "
                 f"{cfg.dst_layer_range} differ in length")
    cluster = key.cluster_id  # equal to ours is fine: another process may share it (V0)
    if isinstance(key, CacheKeyByIdAndIndex):
        raise_if_false(dst_blocks is None, "a CacheKeyByIdAndIndex destination is contiguous: "
                       "dst_block_indices are not supported")
        ref = KeyRef(KeyKind.CACHE_ID, key.cache_id & _U64, key.batch_index, 0)
        unit_bytes = 0
    else:
        assert isinstance(key, BlocksCacheKey)
        ref = KeyRef(KeyKind.BLOCKS_KEY, 0, key.model_id & _U64, 0)
        # Without destination blocks the copy lands at offset 0 of each tensor (the
        # original's batch index 0 of a blocks cache): no block size to check.
        unit_bytes = (dbb or geo.unit_bytes) if dst_blocks is not None else 0
    # one push per layer; kept by the engine for the next transfer of the same layers
    by_layer = prepare(cluster, ref, unit_bytes, cfg.dst_layer_range.start)
    return _Job(layers, lambda i: by_layer[i - layers.start:i - layers.start + 1], by_layer)


# Layers let go and not ended yet, at most, and the core's steps at once: layer i is
# synchronized once layer i - AHEAD ended (as the Python loop's DEPTH was), so layer i - 1
# moves while layer i is awaited and the core overlaps two layers' copies, and at most
# AHEAD - 1 layers are synchronized (and started) past a failure nobody has seen yet. The core
# starts no layer once it has seen a failure.
AHEAD = layerwise.DEPTH
# Layers let go and not ended yet, at most, when the core can merge the run's layers (one
# destination, one call a layer by key: LayerRun.merges): the loop runs ahead of the core, so
# layers the synchronizer gives back together (already computed) reach the core before a
# worker starts them, and one request carries them all (issue 37: one system call or one
# round trip for several layers). At most MERGE_AHEAD - 1 layers are then synchronized past a
# failure nobody has seen yet; none of them is sent once the core saw it.
MERGE_AHEAD = 64


@dataclass(frozen=True)
class _Job:
    """One destination: the source layers it takes (ascending) and the core's prepared calls
    of one layer, in order (a layer whose calls cannot be had raises: its failure, in order).
    ``prepared``: every layer's calls at once, layer-major, ``per_layer`` a layer
    (Engine.prepare_layer_pushes made them all when the transfer was asked for), handed to
    the run in one core call; without it, layer by layer from ``calls``."""

    layers: range
    calls: Callable[[int], Sequence[Call]]
    prepared: Sequence[Call] | None = None
    per_layer: int = 1


class _CoreLoop:
    """transfer_cache_async's layer loop with its transfers in the core (issue 37).

    In the caller's thread (:meth:`start`): every layer's calls (prepared once) handed to a
    core LayerRun (``cpp/src/session.h``), which the task waits on (``CacheTask``: the last
    layer's end wakes the caller's ``synchronize`` itself). Then on a loop thread
    (``core/layerwise.py``'s, kept between transfers), for each layer some destination needs,
    in order, the user's ``synchronize`` (Python, on this thread: no core thread takes the
    GIL) and the layer let go (``go``: never blocks). The core's workers run the layers let go
    in order, AHEAD at once, while this thread synchronizes the next; where the core can merge
    layers (``merges``: one destination, one call a layer), this thread runs up to MERGE_AHEAD
    layers ahead, and a worker sends the layers let go meanwhile in one request. The rules are
    LLM-DataDist's (``v2/llm_utils.py`` TransferCacheJob.transfer_layers), as
    ``core/layerwise.py`` states them: False from ``synchronize`` is PARAM_INVALID for the
    destinations needing that layer, an exception the task's default error; the first failure
    stops the transfer (the core starts no layer once it saw it, and settles outcomes in layer
    order); a destination succeeds at its last layer, and one never reached reports None. The
    loop thread returns once every layer is let go (or the run stopped); the task reads the
    outcomes from the run. ``report(k, code)`` and ``done()`` end the task without a run (the
    engine finalized, or a bug before any layer was let go)."""

    def __init__(self, engine: NativeEngine, synchronize: Callable[[int, int | None], bool],
                 jobs: list[_Job], report: Callable[[int, int], None],
                 done: Callable[[], None], sync_error: Code, wait_s: float,
                 task: CacheTask) -> None:
        self._engine = engine
        self._synchronize = synchronize
        self._jobs = jobs
        self._report = report
        self._done = done
        self._sync_error = sync_error
        self._wait_s = wait_s
        self._task = task

    def start(self) -> None:
        """Makes the run and fills it (the core's calls: no wait), attaches it to the task,
        then hands the loop to a loop thread; returns at once."""
        jobs = self._jobs
        steps = (list(jobs[0].layers) if len(jobs) == 1
                 else sorted(set().union(*(set(j.layers) for j in jobs))))
        try:
            run = self._engine.layers(len(self._jobs), len(steps), AHEAD)
        except DatadistError as e:  # finalized: the first destination's first layer fails
            if self._jobs:
                first = min(range(len(self._jobs)), key=lambda k: self._jobs[k].layers[0])
                self._report(first, int(e.code))
            self._done()
            return
        try:
            last = self._fill(run, steps)
            ahead = MERGE_AHEAD if run.merges() else AHEAD
        except Exception:  # a bug: nothing was let go, nothing is settled
            log.exception("layer-wise transfer failed")
            run.abandon(int(Code.FAILED), "the layer loop failed")
            self._done()
            return
        self._task._attach(run, self._wait_s)
        layerwise._THREADS.run(lambda: self._run(run, steps[:last + 1], ahead))

    def _run(self, run: LayerRun, steps: list[int], ahead: int) -> None:
        try:
            self._loop(run, steps, ahead)
        except Exception:  # a bug: what was not settled stays None
            log.exception("layer-wise transfer failed")
            run.abandon(int(Code.FAILED), "the layer loop failed")
        finally:
            self._task._looped()
            self._done()

    def _fill(self, run: LayerRun, steps: list[int]) -> int:
        """Every layer's calls, handed to the run now (prepared by the core when the transfer
        was asked for, and kept for the next transfer of the same layers): a destination's
        prepared calls in one core call (its layers are consecutive steps), else layer by
        layer; a layer whose calls cannot be had (or a destination the run refuses: a bug)
        is its failure, in order. Returns the last step the run can reach (the first refused
        one stops it: no layer after it is awaited)."""
        last = len(steps) - 1
        many = len(self._jobs) > 1
        for k, job in enumerate(self._jobs):
            first = steps.index(job.layers.start) if many else 0
            if job.prepared is not None:
                try:
                    run.add_all(first, k, job.prepared, job.per_layer)
                    continue
                except Exception as e:  # a bug: this destination fails at its first layer
                    log.exception("handing destination %d's layers to the run failed", k)
                    code = e.code if isinstance(e, DatadistError) else Code.FAILED
                    run.add_refusal(first, k, int(code), f"{type(e).__name__}: {e}")
                    last = min(last, first)
                    continue
            for s, layer in enumerate(job.layers, first):
                try:
                    for call in job.calls(layer):
                        run.add(s, k, call)
                except DatadistError as e:
                    run.add_refusal(s, k, int(e.code), str(e))
                    last = min(last, s)
                    break
                except Exception as e:  # a bug: this destination fails there
                    log.exception("preparing layer %d for destination %d failed", layer, k)
                    run.add_refusal(s, k, int(Code.FAILED), f"{type(e).__name__}: {e}")
                    last = min(last, s)
                    break
        return last

    def _loop(self, run: LayerRun, steps: list[int], ahead: int) -> bool:
        """Synchronizes each layer and lets it go, at most ``ahead`` layers let go and not
        ended; True when a wait ran out (abandoned)."""
        # Per layer, as little Python as can be (a layer of 1 MiB copies in about 100 us on
        # one host): go says whether the run stopped, and a wait for an earlier layer is
        # followed by stopped(), so a failure seen stops the loop before the next layer is
        # awaited, as a stopped() before each did.
        synchronize, go, wait_s = self._synchronize, run.go, self._wait_s
        try:
            if run.stopped():  # given up on before the first layer
                return False
            for s, layer in enumerate(steps):
                if s >= ahead:
                    if not run.wait_ended(s - ahead + 1, wait_s):
                        run.abandon(int(Code.TIMEOUT),
                                    f"layer {steps[s - ahead]} did not end in time")
                        return True
                    if run.stopped():  # seen while waiting: no later layer is awaited
                        return False
                try:
                    ready = bool(synchronize(layer, None))
                except Exception:  # user code: report, never kill the thread silently
                    log.exception("synchronize_layer(%d) raised", layer)
                    ready, code = False, self._sync_error
                else:
                    code = Code.PARAM_INVALID
                if not ready:
                    log.warning("layer %d was not synchronized", layer)
                    run.refuse(s, int(code), f"layer {layer} was not synchronized")
                    return False
                if go(s):  # a failure: no later layer is awaited
                    return False
            return False
        finally:
            run.close()


__all__ = ["start_transfer"]
