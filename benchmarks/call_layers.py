"""Why two tools disagree on 32 per-layer pulls of 1 MiB against one pull of the same 32 MiB
(docs/performance.md, round 14): ``datadist bench --only calls`` (``same_host_per_layer``)
and ``python -m datadist.bench.stages`` time the same comparison in different settings. This
script times it in each setting, and in between, so that one difference at a time changes:

- ``self``: the owner engine in this process, as the stages tool runs it;
- ``process``: the same owner code in a spawned child process, the same puller code here;
- ``bench``: the bench's own owner process (``bench/owner.py``) and puller (``bench/puller.py``:
  an ``LLMDataDist`` with the bench's configuration).

In each setting, these loops against one pull_blocks of all 32 layers:

- ``bench loop``: the key, the block list and the layer ranges made per call (the bench's
  ``Puller.pull_layer``);
- ``made once``: every argument made before timing, the call alone;
- ``raw``: process_vm_readv through ctypes, 32 calls of one layer's two spans against one call
  of all 64 (not in ``bench``: its owner does not say where its layers are).

and two orders: ``pairs`` (one figure, one limit, in turn: the bench's ``interleave``) and
``batches`` (20 figures, then 20 limits, a round: the stages tool's ``p50_us``). Each sample's
wall time, the process's CPU time, and its minor page faults and involuntary context switches
(getrusage) are kept; the medians and the ratio limit / figure are printed (higher is better,
as the bench's ratio), and the median of the ratios of sample i of each side (``paired``:
what the machine's drift, both sides slower together, does not move).

    python benchmarks/call_layers.py                  # every setting
    python benchmarks/call_layers.py --where process --samples 200
    python benchmarks/call_layers.py --async          # transfer_cache_async, bench setting

Who runs it: a person, by hand; nothing imports it. Blocks for a few seconds a setting.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import time
from collections.abc import Callable
from typing import Any

import numpy as np

OWNER, PULLER, MODEL = 1, 2, 1
LAYERS, LAYER_BLOCKS, LAYER_BLOCK = 32, 16, 32 << 10
HALF = LAYER_BLOCKS * LAYER_BLOCK  # one tensor of a layer (K or V): 512 KiB


def _owner_engine(lsrc: np.ndarray) -> Any:
    """An owner engine serving ``lsrc`` (2 x 32 tensors of 16 blocks of 32 KiB) as the stages
    tool's layers cache; returns (engine, its cache manager)."""
    from datadist import BlocksCacheKey, CacheDesc, DataType, Placement
    from datadist.api.cache_manager import CacheManager
    from datadist.core.config import EngineConfig
    from datadist.core.native import NativeEngine

    owner = NativeEngine(EngineConfig(cluster_id=OWNER, role=1, listen=("127.0.0.1", 0)))
    ocm = CacheManager(owner, remote_cache_accessible=False)
    desc = CacheDesc(2 * LAYERS, [LAYER_BLOCKS, LAYER_BLOCK], DataType.DT_UINT8, Placement.DEVICE)
    ocm.register_blocks_cache(desc, [int(a.ctypes.data) for a in lsrc],
                              BlocksCacheKey(OWNER, MODEL))
    return owner, ocm


def _layers_src() -> np.ndarray:
    return np.random.default_rng(2).integers(0, 256, (2 * LAYERS, HALF), dtype=np.uint8)


def _owner_child(conn: Any) -> None:
    """The ``process`` setting's owner: the stages tool's owner code in a process of its own.
    Sends (pid, port, tensor addresses), then serves until told to quit."""
    lsrc = _layers_src()
    owner, _ = _owner_engine(lsrc)
    try:
        address = owner.listen_address
        assert address is not None
        conn.send((os.getpid(), address[1], [int(a.ctypes.data) for a in lsrc]))
        conn.recv()
    finally:
        owner.close()


def _puller(port: int) -> tuple[Any, Any, Any, np.ndarray]:
    """The stages tool's puller: its engine, cache manager, layers cache and memory."""
    from datadist import CacheDesc, DataType, Placement
    from datadist.api.cache_manager import CacheManager
    from datadist.core.config import EngineConfig
    from datadist.core.native import NativeEngine

    puller = NativeEngine(EngineConfig(cluster_id=PULLER, role=2))
    pcm = CacheManager(puller, remote_cache_accessible=False)
    ldst = np.zeros((2 * LAYERS, HALF), dtype=np.uint8)
    desc = CacheDesc(2 * LAYERS, [LAYER_BLOCKS, LAYER_BLOCK], DataType.DT_UINT8, Placement.DEVICE)
    cache = pcm.register_blocks_cache(desc, [int(a.ctypes.data) for a in ldst], None)
    puller.link(OWNER, "127.0.0.1", port, 5.0)
    return puller, pcm, cache, ldst


def _loops(cm: Any, cache: Any, key_of: Callable[[], Any], dst: np.ndarray,
           raw: tuple[int, list[int]] | None) -> dict[str, tuple[Callable[[], None],
                                                                  Callable[[], None]]]:
    """Each loop and its limit. ``raw``: the owner's pid and its 64 tensors' addresses."""
    from datadist.bench.limits import RawCma, iov

    def bench_loop() -> None:
        for i in range(LAYERS):  # as Puller.pull_layer: key, blocks, ranges made per call
            r = range(i, i + 1)
            cm.pull_blocks(key_of(), cache, list(range(LAYER_BLOCKS)),
                           list(range(LAYER_BLOCKS)), src_layer_range=r, dst_layer_range=r)

    key, blocks = key_of(), list(range(LAYER_BLOCKS))
    ranges = [range(i, i + 1) for i in range(LAYERS)]

    def made_once() -> None:
        for r in ranges:
            cm.pull_blocks(key, cache, blocks, blocks, src_layer_range=r, dst_layer_range=r)

    def one_pull() -> None:
        cm.pull_blocks(key, cache, blocks, blocks)

    loops = {"bench loop": (bench_loop, one_pull), "made once": (made_once, one_pull)}
    if raw is not None:
        pid, addrs = raw
        cma = RawCma(pid)

        def spans(ts: list[int]) -> tuple[np.ndarray, np.ndarray]:
            return (iov([int(dst[t].ctypes.data) for t in ts], [HALF] * len(ts)),
                    iov([addrs[t] for t in ts], [HALF] * len(ts)))

        calls = [cma.prepare(*spans([2 * i, 2 * i + 1])) for i in range(LAYERS)]
        whole = cma.prepare(*spans(list(range(2 * LAYERS))))

        def raw_layers() -> None:
            for c in calls:
                c()

        loops["raw"] = (raw_layers, whole)
    return loops


def _sample(fn: Callable[[], None], out: list[tuple[float, float, int, int]]) -> None:
    r0, c0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.process_time(), time.perf_counter()
    fn()
    t1, c1, r1 = time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
    out.append((t1 - t0, c1 - c0, r1.ru_minflt - r0.ru_minflt, r1.ru_nivcsw - r0.ru_nivcsw))


def _measure(fig: Callable[[], None], lim: Callable[[], None], order: str,
             samples: int) -> tuple[list[Any], list[Any]]:
    f: list[tuple[float, float, int, int]] = []
    g: list[tuple[float, float, int, int]] = []
    fig()
    lim()
    if order == "pairs":
        for _ in range(samples):
            _sample(fig, f)
            _sample(lim, g)
    else:
        for _ in range(max(1, samples // 20)):
            for _ in range(20):
                _sample(fig, f)
            for _ in range(20):
                _sample(lim, g)
    return f, g


def _report(where: str, loops: dict[str, Any], samples: int) -> None:
    print(f"{where}: 32 per-layer pulls of 1 MiB against one pull of 32 MiB "
          f"(medians; ratio = limit / figure)")
    print(f"  {'loop':11s} {'order':8s} {'figure us':>10s} {'limit us':>9s} {'ratio':>6s} "
          f"{'paired':>6s} {'CPU ratio':>9s} {'faults f/l':>11s} {'preempt f/l':>12s}")
    for name, (fig, lim) in loops.items():
        for order in ("pairs", "batches"):
            f, g = _measure(fig, lim, order, samples)
            fa, ga = np.array(f), np.array(g)
            wf, wg = np.median(fa[:, 0]) * 1e6, np.median(ga[:, 0]) * 1e6
            cf, cg = np.median(fa[:, 1]), np.median(ga[:, 1])
            paired = np.median(ga[:, 0] / fa[:, 0])  # sample i of each side: drift cancels
            print(f"  {name:11s} {order:8s} {wf:10.0f} {wg:9.0f} {wg / wf:6.3f} {paired:6.3f} "
                  f"{cg / cf:9.3f} {np.mean(fa[:, 2]):5.1f}/{np.mean(ga[:, 2]):<5.1f} "
                  f"{np.mean(fa[:, 3]):5.2f}/{np.mean(ga[:, 3]):<5.2f}", flush=True)


def _self(samples: int) -> None:
    from datadist import BlocksCacheKey

    lsrc = _layers_src()
    owner, _ = _owner_engine(lsrc)
    try:
        address = owner.listen_address
        assert address is not None
        puller, pcm, cache, ldst = _puller(address[1])
        try:
            loops = _loops(pcm, cache, lambda: BlocksCacheKey(OWNER, MODEL), ldst,
                           (os.getpid(), [int(a.ctypes.data) for a in lsrc]))
            _report("self (the owner engine in this process)", loops, samples)
            assert np.array_equal(ldst, lsrc)
        finally:
            puller.close()
    finally:
        owner.close()


def _process(samples: int) -> None:
    from datadist import BlocksCacheKey

    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    child = ctx.Process(target=_owner_child, args=(there,), daemon=True)
    child.start()
    try:
        if not here.poll(60):
            raise RuntimeError("the owner process did not start")
        pid, port, addrs = here.recv()
        puller, pcm, cache, ldst = _puller(port)
        try:
            loops = _loops(pcm, cache, lambda: BlocksCacheKey(OWNER, MODEL), ldst, (pid, addrs))
            _report("process (the same owner code in a child process)", loops, samples)
            assert np.array_equal(ldst, _layers_src())
        finally:
            puller.close()
    finally:
        here.send("quit")
        child.join(10)


def _bench(samples: int, async_: bool = False) -> None:
    from datadist.bench.harness import (
        LAYERS_MODEL,
        OWNER_ID,
        SMALL_BLOCK,
        SMALL_CACHE_BLOCKS,
        Sizes,
        aligned_array,
    )
    from datadist.bench.owner import start_owner, stop_owner
    from datadist.bench.puller import Puller

    sizes = Sizes.preset(True)
    bufs = {
        "contig": [aligned_array(sizes.tensor_bytes, "page") for _ in range(sizes.contig_tensors)],
        "blocks": aligned_array(sizes.cache_blocks * sizes.block_bytes, "page"),
        "small": aligned_array(SMALL_CACHE_BLOCKS * SMALL_BLOCK, "page"),
        "layers": aligned_array(2 * LAYERS * LAYER_BLOCKS * LAYER_BLOCK, "page"),
    }
    proc, conn, info = start_owner(sizes, "page", mooncake=False, nixl=False)
    try:
        p = Puller(info, sizes, bufs, "auto", remote_accessible=True)
        try:
            ll = p.ll
            loops = _loops(p.dd.cache_manager, p.layers,
                           lambda: ll.BlocksCacheKey(OWNER_ID, LAYERS_MODEL), bufs["layers"], None)

            def pull_layers() -> None:  # the bench's own loop (bench/calls.py)
                for i in range(LAYERS):
                    p.pull_layer(i)

            loops["Puller"] = (pull_layers, lambda: p.pull_layer(None))
            if async_:  # transfer_cache_async of the 32 layers against one push, one pull
                cm, cache = p.dd.cache_manager, p.layers
                key, blocks = ll.BlocksCacheKey(OWNER_ID, LAYERS_MODEL), list(range(LAYER_BLOCKS))
                loops = {"async/push": (p.push_layers_async,
                                        lambda: cm.push_blocks(key, cache, blocks, blocks)),
                         "async/pull": (p.push_layers_async, lambda: p.pull_layer(None))}
            _report(f"bench (its owner process and puller; {p.mechanism()})", loops, samples)
        finally:
            p.close()
    finally:
        stop_owner(proc, conn)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--where", choices=("self", "process", "bench"), action="append",
                    help="the settings to run (default: all three)")
    ap.add_argument("--samples", type=int, default=100, help="samples of each side a loop")
    ap.add_argument("--async", dest="async_", action="store_true",
                    help="instead: transfer_cache_async of the 32 layers (the bench's) against "
                    "one push_blocks and one pull_blocks of them, in the bench's setting")
    args = ap.parse_args()
    if args.async_:
        _bench(args.samples, async_=True)
        return
    for where in args.where or ["self", "process", "bench"]:
        {"self": _self, "process": _process, "bench": _bench}[where](args.samples)


if __name__ == "__main__":
    main()
