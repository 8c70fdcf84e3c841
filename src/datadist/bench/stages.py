"""Where the time of one small pull goes, stage by stage (issue 37 item 1; docs/performance.md,
round 8): the same 16 KiB pull of one block entered at each layer of the Python face, in one
process (an owner engine and a puller engine, as the API tests run them), against raw
``process_vm_readv`` of the same bytes on one host. Each stage's p50 over interleaved runs;
a stage's cost is its p50 less the next one's.

- ``pull_blocks``: the facade (``CacheManager.pull_blocks``: the planned request's lookup,
  the cache-alive checks, the error mapping), then everything below;
- ``engine.run``: the driver (``NativeEngine.run`` with the request's prepared call: the
  finalized check); beside, the path of an unplanned request (every argument check, the
  core's planning and prepared call: ``Engine.prepare_pull``, then the run);
- ``core.run``: the binding (``Engine.run``: the deadline, the GIL hold) and the core
  (``Session::Run``: the local cache's hold, the link's lookup, the metrics; ``Link::Read``:
  the lease's checks, the copy);
- ``process_vm_readv``: the copy alone, through ctypes (its own call cost included).

With ``--async``: transfer_cache_async of the 32 layers against one push_blocks of them.

With ``--maps``: the small pull with and without the one memo map of its path (the planned
requests, each holding the core's prepared call), what it saves.

Also the 32 per-layer pulls of 1 MiB against one pull of the same 32 MiB (the calls group's
row), on the same engines, and on one host its limit: 32 calls of raw ``process_vm_readv``
of 1 MiB against one of the 32 MiB. Who calls: ``python -m datadist.bench.stages [--tcp]`` by hand.
Blocks while it runs (a few seconds).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from datadist import BlocksCacheKey, CacheDesc, DataType, Placement
from datadist.api.cache_manager import CacheManager
from datadist.bench.limits import RawCma, iov
from datadist.core.config import EngineConfig
from datadist.core.native import NativeEngine

OWNER, PULLER, MODEL = 1, 2, 0
BLOCK = 16 << 10
BLOCKS = 64
LAYERS, LAYER_BLOCKS, LAYER_BLOCK = 32, 16, 32 << 10


def p50_us(fns: dict[str, Callable[[], object]], n: int, rounds: int) -> dict[str, float]:
    """Each function ``n`` times per round, the functions interleaved round by round; the
    median of every call's time in us."""
    samples: dict[str, list[float]] = {k: [] for k in fns}
    clock = time.perf_counter_ns
    for _ in range(rounds):
        for k, fn in fns.items():
            out = samples[k]
            for _ in range(n):
                t0 = clock()
                fn()
                out.append((clock() - t0) / 1e3)
    return {k: float(np.median(v)) for k, v in samples.items()}


def stages(label: str, puller: NativeEngine, pcm: CacheManager, key: BlocksCacheKey,
           cache: Any, src: list[int], dst: list[int], kwargs: dict[str, Any],
           raw: list[tuple[int, int, int]] | None, n: int, rounds: int) -> None:
    """Prints the p50 of one pull_blocks entered at each stage, and each stage's share.
    ``raw``: (local, remote, length) spans in this process for process_vm_readv."""
    pcm.pull_blocks(key, cache, src, dst, **kwargs)
    req = pcm._pull_blocks_request(key, cache, src, dst, kwargs)
    call = req.prepared()
    engine_run = req.engine.run
    core_run = puller._core.run
    fns: dict[str, Callable[[], object]] = {
        "pull_blocks": lambda: pcm.pull_blocks(key, cache, src, dst, **kwargs),
        "engine.run": lambda: engine_run(call),
        "core.run": lambda: core_run(call, 5.0),
    }
    if raw is not None:
        fns["process_vm_readv"] = RawCma(os.getpid()).prepare(
            iov([a for a, _, _ in raw], [n for _, _, n in raw]),
            iov([b for _, b, _ in raw], [n for _, _, n in raw]))
    # beside the stages: the unplanned path (every argument check, the core plans and
    # prepares the call: Engine.prepare_pull), then the run
    fns["unplanned"] = lambda: engine_run(
        pcm._check_pull_blocks(key, cache, src, dst, kwargs).prepared())
    got = p50_us(fns, n, rounds)
    aside = got.pop("unplanned")
    print(f"{label} ({puller.last_moved(OWNER) or 'tcp'}), p50 us:")
    names = list(got)
    for i, k in enumerate(names):
        below = got[names[i + 1]] if i + 1 < len(names) else 0.0
        print(f"  {k:18s} {got[k]:8.2f}   this stage: {got[k] - below:8.2f}")
    print(f"  (pull_blocks unplanned: checked, planned by the core, run: {aside:.2f})")


class _Off:
    """A planned-pull map that never keeps anything (``--maps``: the path without it)."""

    def run_blocks(self, *args: object) -> bool:
        return False

    def find_blocks(self, *args: object) -> None:
        return None

    def put_blocks(self, *args: object) -> bool:
        return False

    def clear(self) -> None:
        pass


def maps(puller: NativeEngine, pcm: CacheManager, pull: Callable[[], None], n: int,
         rounds: int) -> None:
    """Prints the p50 of one small ``pull`` with each memo map of its path taken away in turn
    (docs/performance.md, round 9): every map left must save a measured figure. Each setting
    runs in its own batches of ``n`` calls, the settings interleaved."""
    # A pull's path has one map left: the planned requests (api/planned.py), each holding the
    # core's prepared call; without it every call checks its arguments and the core plans.
    kept = pcm._planned

    def use(planned: bool = True) -> None:
        pcm._planned = kept if planned else _Off()  # type: ignore[assignment]

    settings: dict[str, dict[str, bool]] = {
        "shipped": {},
        "no planned-request map": {"planned": False},
    }
    samples: dict[str, list[float]] = {k: [] for k in settings}
    clock = time.perf_counter_ns
    try:
        for _ in range(rounds):
            for name, setting in settings.items():
                use(**setting)
                for _ in range(20):  # warm this setting
                    pull()
                out = samples[name]
                for _ in range(n):
                    t0 = clock()
                    pull()
                    out.append((clock() - t0) / 1e3)
    finally:
        use()
    print("16 KiB pull_blocks with each memo map taken away, p50 us:")
    for name, v in samples.items():
        print(f"  {name:30s} {float(np.median(v)):8.2f}")


def async_layers(ocm: CacheManager, pcm: CacheManager, lsrc: np.ndarray, ldst: np.ndarray,
                 ldesc: CacheDesc, n: int, rounds: int) -> None:
    """transfer_cache_async of the 32 layers of 1 MiB (a push by key, layer by layer, every
    layer ready at once) against its limit, one push_blocks of all 32 layers, interleaved
    call by call; prints each p50 and the ratio of the limit's p50 to the figure's (issue 37
    item 2: >= 0.95x). Pushes the puller's layers into a second owner cache."""
    from datadist import LayerSynchronizer, LLMStatusCode, TransferWithCacheKeyConfig
    from datadist.api import async_transfer

    class Ready(LayerSynchronizer):
        def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
            return True

    back = np.zeros_like(lsrc)
    ocm.register_blocks_cache(ldesc, [int(a.ctypes.data) for a in back],
                              BlocksCacheKey(OWNER, MODEL + 2))
    cache = pcm.register_blocks_cache(ldesc, [int(a.ctypes.data) for a in ldst], None)
    ldst[:] = lsrc
    blocks = list(range(LAYER_BLOCKS))
    key = BlocksCacheKey(OWNER, MODEL + 2)
    cfg = TransferWithCacheKeyConfig(key, range(LAYERS), range(LAYERS))
    ready = Ready()

    def layerwise() -> None:
        task = pcm.transfer_cache_async(cache, ready, [cfg], blocks, blocks)
        if task.synchronize(60000) != LLMStatusCode.LLM_SUCCESS:
            raise RuntimeError("transfer_cache_async failed")

    def one_push() -> None:
        pcm.push_blocks(key, cache, blocks, blocks)

    def python_loop() -> None:  # the same, with the round start's loop in Python
        real = async_transfer._CoreLoop
        async_transfer._CoreLoop = _PythonLoop  # type: ignore[assignment,misc]
        try:
            layerwise()
        finally:
            async_transfer._CoreLoop = real  # type: ignore[misc]

    for fn in (layerwise, python_loop):
        back[:] = 0
        fn()
        assert np.array_equal(back, lsrc)
    fns = {"core loop": layerwise, "python loop": python_loop, "one push_blocks": one_push}
    cpu: dict[str, list[float]] = {k: [] for k in fns}

    def timed_cpu(k: str, fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:  # the process's CPU time (every thread): robust to a busy machine
            t0 = time.process_time()
            fn()
            cpu[k].append((time.process_time() - t0) * 1e6)
        return run

    got = p50_us({k: timed_cpu(k, fn) for k, fn in fns.items()}, n, rounds)
    lim = got["one push_blocks"]
    print(f"transfer_cache_async of 32 x 1 MiB against one push of 32 MiB ({lim:.0f} us, CPU "
          f"{float(np.median(cpu['one push_blocks'])):.0f} us), p50:")
    for k in ("core loop", "python loop"):
        print(f"  {k:12s} {got[k]:8.0f} us: {lim / got[k]:.3f}x; CPU of the process "
              f"{float(np.median(cpu[k])):8.0f} us")


class _PythonLoop:
    """transfer_cache_async's loop as the round start ran it (``core/layerwise.py``: each
    layer's calls submitted from Python, DEPTH layers in flight), on the same prepared calls:
    the comparison ``--async`` prints beside the core's loop, in the same run."""

    def __init__(self, engine: NativeEngine, synchronize: Callable[[int, int | None], bool],
                 jobs: Any, report: Callable[[int, int], None], done: Callable[[], None],
                 sync_error: Any, wait_s: float, task: Any = None) -> None:
        from datadist.core import layerwise as lw
        # ``task`` is not attached a run: it waits for ``done``, as every task did then

        def send(job: Any) -> Callable[[int], list[Any]]:
            return lambda i: [engine.submit(c) for c in job.calls(i)]

        self._loop = lw.LayerwiseTransfer(
            max(j.layers.stop for j in jobs), lambda i: synchronize(i, None),
            [lw.LayerJob(j.layers, send(j)) for j in jobs], report, done,
            sync_error=sync_error, wait_s=wait_s)

    def start(self) -> None:
        self._loop.start()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Where the time of one small pull goes.")
    ap.add_argument("--tcp", action="store_true", help="force TCP (no same-host path)")
    ap.add_argument("-n", type=int, default=2000, help="calls per stage per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--maps", action="store_true",
                    help="only the small pull with each memo map of its path taken away")
    ap.add_argument("--async", dest="async_", action="store_true",
                    help="only transfer_cache_async of 32 layers against one push of them")
    args = ap.parse_args(argv)
    owner = NativeEngine(EngineConfig(cluster_id=OWNER, role=1, listen=("127.0.0.1", 0)))
    puller = NativeEngine(EngineConfig(cluster_id=PULLER, role=2,
                                       transport="tcp" if args.tcp else None))
    try:
        ocm = CacheManager(owner, remote_cache_accessible=args.async_)
        pcm = CacheManager(puller, remote_cache_accessible=args.async_)
        src = np.random.default_rng(1).integers(0, 256, (1, BLOCKS * BLOCK), dtype=np.uint8)
        dst = np.zeros_like(src)
        desc = CacheDesc(1, [BLOCKS, BLOCK], DataType.DT_UINT8, Placement.DEVICE)
        ocm.register_blocks_cache(desc, [src.ctypes.data], BlocksCacheKey(OWNER, MODEL))
        small = pcm.register_blocks_cache(desc, [dst.ctypes.data], None)
        lsrc = np.random.default_rng(2).integers(
            0, 256, (2 * LAYERS, LAYER_BLOCKS * LAYER_BLOCK), dtype=np.uint8)
        ldst = np.zeros_like(lsrc)
        ldesc = CacheDesc(2 * LAYERS, [LAYER_BLOCKS, LAYER_BLOCK], DataType.DT_UINT8,
                          Placement.DEVICE)
        ocm.register_blocks_cache(ldesc, [int(a.ctypes.data) for a in lsrc],
                                  BlocksCacheKey(OWNER, MODEL + 1))
        layers = pcm.register_blocks_cache(ldesc, [int(a.ctypes.data) for a in ldst], None)
        address = owner.listen_address
        assert address is not None
        host, port = address
        puller.link(OWNER, host, port, 5.0)
        key = BlocksCacheKey(OWNER, MODEL)
        pcm.pull_blocks(key, small, [5], [9])
        pcm.pull_blocks(key, small, [5], [9])  # the lease (same host) exists from here
        assert np.array_equal(dst[0, 9 * BLOCK:10 * BLOCK], src[0, 5 * BLOCK:6 * BLOCK])
        if args.async_:
            async_layers(ocm, pcm, lsrc, ldst, ldesc, max(5, args.n // 200), args.rounds)
            return
        if args.maps:
            maps(puller, pcm, lambda: pcm.pull_blocks(key, small, [5], [9]), args.n, args.rounds)
            return
        where = "TCP" if args.tcp else "same host"
        raw = None if args.tcp else [(dst.ctypes.data + 9 * BLOCK, src.ctypes.data + 5 * BLOCK,
                                      BLOCK)]
        stages(f"16 KiB pull, {where}", puller, pcm, key, small, [5], [9], {}, raw,
               args.n, args.rounds)
        lkey = BlocksCacheKey(OWNER, MODEL + 1)
        r = range(3, 4)
        lraw = None if args.tcp else [
            (int(ldst[t].ctypes.data), int(lsrc[t].ctypes.data), LAYER_BLOCKS * LAYER_BLOCK)
            for t in (6, 7)]  # layer 3: tensors 6 and 7 (K, V)
        stages(f"1 MiB layer pull, {where}", puller, pcm, lkey, layers,
               list(range(LAYER_BLOCKS)), list(range(LAYER_BLOCKS)),
               {"src_layer_range": r, "dst_layer_range": r}, lraw, max(20, args.n // 20),
               args.rounds)
        blocks = list(range(LAYER_BLOCKS))

        def per_layer() -> None:
            for i in range(LAYERS):
                r = range(i, i + 1)
                pcm.pull_blocks(BlocksCacheKey(OWNER, MODEL + 1), layers, blocks, blocks,
                                src_layer_range=r, dst_layer_range=r)

        def one_pull() -> None:
            pcm.pull_blocks(BlocksCacheKey(OWNER, MODEL + 1), layers, blocks, blocks)

        lay = p50_us({"32 per-layer pulls": per_layer, "one pull": one_pull}, 20, args.rounds)
        assert np.array_equal(ldst, lsrc)
        print(f"32 x 1 MiB per-layer: {lay['32 per-layer pulls']:.0f} us, one 32 MiB pull: "
              f"{lay['one pull']:.0f} us: {lay['one pull'] / lay['32 per-layer pulls']:.3f}x")
        if not args.tcp:  # the limit: the same 32 calls and one call of raw process_vm_readv
            cma = RawCma(os.getpid())
            half = LAYER_BLOCKS * LAYER_BLOCK

            def spans(ts: list[int]) -> tuple[np.ndarray, np.ndarray]:
                return (iov([int(ldst[t].ctypes.data) for t in ts], [half] * len(ts)),
                        iov([int(lsrc[t].ctypes.data) for t in ts], [half] * len(ts)))

            calls = [cma.prepare(*spans([2 * i, 2 * i + 1])) for i in range(LAYERS)]
            whole = cma.prepare(*spans(list(range(2 * LAYERS))))

            def raw_layers() -> None:
                for c in calls:
                    c()

            lim = p50_us({"32 calls": raw_layers, "one call": whole}, 20, args.rounds)
            print(f"raw process_vm_readv, 32 calls of 1 MiB: {lim['32 calls']:.0f} us, one of "
                  f"32 MiB: {lim['one call']:.0f} us: {lim['one call'] / lim['32 calls']:.3f}x")
    finally:
        puller.close()
        owner.close()


if __name__ == "__main__":
    main()
