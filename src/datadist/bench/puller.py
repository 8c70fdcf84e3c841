"""The puller (decoder) side of a run: one LLMDataDist linked to the owner, the checks of
what arrived (rule 2), and the small-pull latency row shared by every path.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from datadist.bench.harness import (
    BLOCKS_MODEL,
    LAYER_BLOCK,
    LAYER_BLOCKS,
    LAYERS,
    LAYERS_MODEL,
    OWNER_ID,
    PULLER_ID,
    SMALL_BLOCK,
    SMALL_CACHE_BLOCKS,
    SMALL_MODEL,
    BenchError,
    Progress,
    Row,
    Sizes,
    array_at,
    at_most,
    check_blocks,
    check_pattern,
    one_cpu,
    pattern_seed,
)
from datadist.bench.limits import PlainClient


class Puller:
    """The decoder side: one LLMDataDist, its caches, and a link to the owner.

    Buffers are allocated once by the caller and registered again for each transport, since
    one process holds one initialized LLMDataDist at a time.
    """

    def __init__(self, info: dict[str, Any], sizes: Sizes, bufs: dict[str, Any],
                 transport: str, remote_accessible: bool = False) -> None:
        import datadist as llm_datadist

        self.ll = llm_datadist
        self.info = info
        self.sizes = sizes
        cfg = llm_datadist.LLMConfig()
        cfg.local_comm_res = ""
        cfg.host_mem_pool_cfg = json.dumps({"memory_size": sizes.pool_bytes})
        cfg.sync_kv_timeout = 60000
        cfg.transport = transport
        if transport == "nixl":  # one host: UCX transports without checked keys (bench owner)
            cfg.nixl_allow_whole_process_access = True
        if remote_accessible:  # pushes by key (transfer_cache_async's TransferWithCacheKeyConfig)
            cfg.enable_remote_cache_accessible = True
        self.dd = llm_datadist.LLMDataDist(llm_datadist.LLMRole.DECODER, PULLER_ID)
        self.dd.init(cfg.generate_options())
        try:
            self._setup(bufs)
        except BaseException:
            self.dd.finalize()
            raise

    def _setup(self, bufs: dict[str, Any]) -> None:
        ll, s, cm = self.ll, self.sizes, self.dd.cache_manager
        host, u8 = ll.Placement.HOST, ll.DataType.DT_UINT8
        contig_desc = ll.CacheDesc(s.contig_tensors, [1, s.tensor_bytes], u8, host)
        self.contig = cm.register_cache(contig_desc, [a.ctypes.data for a in bufs["contig"]])
        self.blocks = cm.register_blocks_cache(
            ll.CacheDesc(1, [s.cache_blocks, s.block_bytes], u8, host),
            [bufs["blocks"].ctypes.data], ll.BlocksCacheKey(PULLER_ID, BLOCKS_MODEL))
        self.small = cm.register_blocks_cache(
            ll.CacheDesc(1, [SMALL_CACHE_BLOCKS, SMALL_BLOCK], u8, host),
            [bufs["small"].ctypes.data], ll.BlocksCacheKey(PULLER_ID, SMALL_MODEL))
        self._small_key = ll.BlocksCacheKey(OWNER_ID, SMALL_MODEL)
        self.pooled = cm.allocate_cache(contig_desc)
        self.layers = None
        if "layers" in bufs:  # the layer-wise rows' cache (bench/calls.py)
            tensor = LAYER_BLOCKS * LAYER_BLOCK
            # DEVICE: transfer_cache_async refuses HOST sources (as the original); without a
            # GPU a DEVICE cache is host memory (docs/compatibility.md)
            self.layers = cm.register_blocks_cache(
                ll.CacheDesc(2 * LAYERS, [LAYER_BLOCKS, LAYER_BLOCK], u8, ll.Placement.DEVICE),
                [bufs["layers"].ctypes.data + t * tensor for t in range(2 * LAYERS)],
                ll.BlocksCacheKey(PULLER_ID, LAYERS_MODEL))
        cluster = ll.LLMClusterInfo()
        cluster.remote_cluster_id = OWNER_ID
        cluster.append_local_ip_info("127.0.0.1", 0)
        cluster.append_remote_ip_info("127.0.0.1", self.info["port"])
        code, _ = self.dd.link_clusters([cluster], 10000)
        if code != ll.LLMStatusCode.LLM_SUCCESS:
            raise BenchError(f"link to the owner failed: {code}")
        self.path = self.dd.engine.get_link(OWNER_ID).path_name

    def mechanism(self) -> str:
        """The link's path, and on the same host what moved the last request (shm or cma):
        the core's link's path name and its last pull's mechanism."""
        from datadist.core.native import NativeEngine

        engine = self.dd.engine
        if not isinstance(engine, NativeEngine):  # there is one engine: the core
            raise BenchError(f"the puller runs on {type(engine).__name__}, not the core")
        name, last = engine.get_link(OWNER_ID).path_name, engine.last_moved(OWNER_ID)
        return f"{name}/{last}" if last in ("shm", "cma") and last != name else name

    def pull_contig(self) -> None:
        key = self.ll.CacheKeyByIdAndIndex(OWNER_ID, self.info["contig_id"], 0)
        self.dd.cache_manager.pull_cache(key, self.contig, 0)

    def pull_pool(self) -> None:
        key = self.ll.CacheKeyByIdAndIndex(OWNER_ID, self.info["pool_id"], 0)
        self.dd.cache_manager.pull_cache(key, self.pooled, 0)

    def pull_blocks(self, src: list[int], dst: list[int]) -> None:
        key = self.ll.BlocksCacheKey(OWNER_ID, BLOCKS_MODEL)
        self.dd.cache_manager.pull_blocks(key, self.blocks, src, dst)

    def pull_small(self, src: int, dst: int) -> None:
        """One 16 KiB block. The key is made once (a BlocksCacheKey's argument checks cost
        ~3 us, more than the facade's whole hit path: the row times the pull, as the C++
        row times PullKvBlocks with its key made)."""
        self.dd.cache_manager.pull_blocks(self._small_key, self.small, [src], [dst])

    def pull_small_async(self, src: int, dst: int) -> Any:
        """:meth:`pull_small`, issued: returns the ``datadist.TransferHandle`` at once (the
        busy rows poll it between rounds of Python work, bench/busy.py)."""
        return self.dd.cache_manager.pull_blocks_async(self._small_key, self.small, [src], [dst])

    def pull_layer(self, layer: int | None) -> None:
        """Every block of one layer (1 MiB), or with None of all layers (32 MiB)."""
        key = self.ll.BlocksCacheKey(OWNER_ID, LAYERS_MODEL)
        blocks = list(range(LAYER_BLOCKS))
        if self.layers is None:
            raise BenchError("no layers cache: the run's buffers have no 'layers'")
        if layer is None:
            self.dd.cache_manager.pull_blocks(key, self.layers, blocks, blocks)
        else:
            r = range(layer, layer + 1)
            self.dd.cache_manager.pull_blocks(key, self.layers, blocks, blocks,
                                              src_layer_range=r, dst_layer_range=r)

    def push_layers_async(self) -> None:
        """transfer_cache_async of every layer's blocks into the owner's layers cache, layer by
        layer as a model would (every layer ready at once here); waits for the task."""
        ll = self.ll
        blocks = list(range(LAYER_BLOCKS))
        if self.layers is None:
            raise BenchError("no layers cache: the run's buffers have no 'layers'")
        cfg = ll.TransferWithCacheKeyConfig(ll.BlocksCacheKey(OWNER_ID, LAYERS_MODEL),
                                            range(LAYERS), range(LAYERS))
        task = self.dd.cache_manager.transfer_cache_async(self.layers, _Ready(ll), [cfg], blocks,
                                                          blocks)
        code = task.synchronize(60000)
        if code != ll.LLMStatusCode.LLM_SUCCESS:
            raise BenchError(f"transfer_cache_async failed: {code}")

    def close(self) -> None:
        self.dd.finalize()


def _Ready(ll: Any) -> Any:  # noqa: N802 - a class made on demand (datadist imported late)
    class Ready(ll.LayerSynchronizer):  # type: ignore[misc]
        def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
            return True

    return Ready()


@dataclass
class Context:
    """Everything one run shares: sizes, the owner's answer, the puller's buffers."""

    sizes: Sizes
    repeat: int
    info: dict[str, Any]
    bufs: dict[str, Any]
    src_ids: np.ndarray
    dst_ids: np.ndarray
    progress: Progress
    plain: PlainClient
    owner: Any = None  # the pipe to the owner process (its busy-start / busy-stop commands)

    def puller(self, transport: str, remote_accessible: bool = False) -> Puller:
        """A :class:`Puller` linked to the owner over ``transport``. Who calls: every row
        module, once per path it times."""
        return Puller(self.info, self.sizes, self.bufs, transport, remote_accessible)

    @property
    def src_list(self) -> list[int]:
        ids: list[int] = self.src_ids.tolist()
        return ids

    @property
    def dst_list(self) -> list[int]:
        ids: list[int] = self.dst_ids.tolist()
        return ids


def check_contig(tensors: list[np.ndarray], tag: int, what: str) -> None:
    for t, arr in enumerate(tensors):
        check_pattern(arr, pattern_seed(tag, t), what)


def pool_views(p: Puller) -> list[np.ndarray]:
    return [array_at(a, p.sizes.tensor_bytes) for a in p.pooled.tensor_addrs]


def warm_and_check(ctx: Context, p: Puller, label: str) -> None:
    """Rule 2: one untimed pull of each kind into zeroed memory, then check the bytes."""
    ctx.progress.set_label(f"{label}: warm-up and check")
    for arr in ctx.bufs["contig"]:
        arr.fill(0)
    p.pull_contig()
    check_contig(ctx.bufs["contig"], 1, f"{label} pull")
    ctx.bufs["blocks"].fill(0)
    p.pull_blocks(ctx.src_list, ctx.dst_list)
    check_blocks(ctx.bufs["blocks"].reshape(ctx.sizes.cache_blocks, -1), ctx.src_ids,
                  ctx.dst_ids, ctx.sizes.block_bytes, pattern_seed(2, 0), f"{label} pull_blocks")
    for v in pool_views(p):
        v.fill(0)
    p.pull_pool()
    check_contig(pool_views(p), 4, f"{label} pull of a pool-allocated cache")
    ctx.bufs["small"].fill(0)
    p.pull_small(5, 9)
    small = ctx.bufs["small"].reshape(SMALL_CACHE_BLOCKS, -1)
    check_blocks(small, np.array([5]), np.array([9]), SMALL_BLOCK, pattern_seed(3, 0),
                  f"{label} small pull")


ECHO_TITLE = "16-byte request/reply on a plain socket, p50"
REPLY_TITLE = (f"8-byte request -> {SMALL_BLOCK >> 10} KiB reply on a plain socket "
               "(Python at both ends), p50")


def latency_row(ctx: Context, p: Puller, key: str, title: str,
                pull: Callable[[int], None] | None = None, goal: float | None = 2.0,
                limit: Callable[[], None] | None = None, limit_title: str = ECHO_TITLE) -> Row:
    """p50 of one 16 KiB block pulls, and of plain round trips, in alternating runs.
    ``pull(i)`` makes the i-th pull (default: :func:`small_walk`, so a request repeats);
    ``limit()`` one plain round trip (default: a 16-byte request/reply; :func:`reply_trip`
    is the request of a count answered with 16 KiB), named by ``limit_title``; ``goal``: the
    most the p50 may be, in round trips (None: reported, no goal).

    Runs, not single alternating calls: a same-host pull ends with a one-way Release that the
    owner handles after the pull returned, and a round trip measured right then would wait for
    the owner's GIL and flatter the ratio.
    """
    ctx.progress.set_label(title)
    with one_cpu(os.getpid(), ctx.info["pid"]):
        pulls, rtts = _latencies(ctx, pull or small_walk(p), limit or ctx.plain.round_trip)
    row = Row(key, title, "us", float(np.median(pulls)), limit_title, float(np.median(rtts)),
              path=p.mechanism(), figure_samples=pulls, limit_samples=rtts)
    return at_most(row, goal)


def small_walk(p: Puller) -> Callable[[int], None]:
    """The small-pull rows' i-th pull: source block ``i % 64`` into block ``i * 7 % 64`` (64
    block pairs in turn, so a request repeats). The C++ driver's rows walk the same pairs."""
    return lambda i: p.pull_small(i % SMALL_CACHE_BLOCKS, (i * 7) % SMALL_CACHE_BLOCKS)


def reply_trip(ctx: Context) -> Callable[[], None]:
    """One plain round trip that carries what a small pull carries: an 8-byte count asked on
    the plain stream, answered with :data:`SMALL_BLOCK` bytes ``recv_into`` a buffer of ours
    (the limit of the rows against a request -> 16 KiB reply)."""
    dst = [np.empty(SMALL_BLOCK, dtype=np.uint8)]
    dst[0].fill(0)  # its pages committed before timing
    return lambda: ctx.plain.receive(dst, SMALL_BLOCK)


def _latencies(ctx: Context, pull: Callable[[int], None],
               limit: Callable[[], None]) -> tuple[list[float], list[float]]:
    # the pause: a same-host pull by request ends with a one-way Release the owner handles
    return alternate_runs(ctx, pull, limit, pause=0.001)


def alternate_runs(ctx: Context, pull: Callable[[int], None], limit: Callable[[], None],
                   pause: float = 0.0) -> tuple[list[float], list[float]]:
    """Latency samples in us of ``pull(i)`` and of ``limit()``: :func:`alternate` with runs
    of ``limit`` calls, each run after ``pause`` seconds."""
    return alternate(ctx, pull, lambda k: timed_calls(lambda _: limit(), 0, k), pause_before=pause)


def alternate(ctx: Context, pull: Callable[[int], None], other: Callable[[int], list[float]],
              pause_before: float = 0.0, pause_after: float = 0.0,
              ) -> tuple[list[float], list[float]]:
    """Latency samples in us of ``pull(i)`` and of another side's calls: 10 warm-up pulls
    and ``other(10)``, then ``repeat`` runs of ``small_iters / repeat`` pulls (i counting on
    from 10), each followed, ``pause_before`` seconds later, by ``other(k)``, which makes k
    calls and returns their times, and a pause of ``pause_after``. A progress step a run.
    Who calls: the latency rows (this module's, bench/calls.py, nixl.py, mooncake.py) and
    the two faces' rows (bench/cpp.py, where ``other`` is the C++ driver's pulls)."""
    per_step = max(1, ctx.sizes.small_iters // ctx.repeat)
    for i in range(10):  # warm both ends' code paths
        pull(i)
    other(10)
    pulls: list[float] = []
    others: list[float] = []
    n = 10
    for _ in range(ctx.repeat):
        pulls += timed_calls(pull, n, per_step)
        n += per_step
        if pause_before:
            time.sleep(pause_before)
        others += other(per_step)
        if pause_after:
            time.sleep(pause_after)
        ctx.progress.step()
    return pulls, others


def timed_calls(fn: Callable[[int], object], start: int, count: int) -> list[float]:
    """The time in us of each of ``fn(start)``, ``fn(start + 1)``, ... (``count`` calls),
    each between two clock reads."""
    out = []
    clock = time.perf_counter
    for n in range(start, start + count):
        t0 = clock()
        fn(n)
        out.append((clock() - t0) * 1e6)
    return out
