#!/usr/bin/env python3
"""What planning costs a pull (docs/performance.md, "The core plans the Python face's pulls").

``python benchmarks/pull_planning.py``: in one process, interleaved (5 rounds of 1000 calls
each), for never-seen one-block requests (4096 block pairs in a shuffled cycle, more than any
memo keeps; one layer of a 4-tensor blocks cache of 64 x 16 KiB blocks):

* ``python plan + Engine.prepare``: the stage the core's planner replaced, as main planned a
  pull before it (the tensor pairs as arrays, ``layout.plan_blocks``, ``Engine.prepare``);
* ``Engine.prepare_pull``: the core plans, checks and prepares the same request.

``--api``: through ``CacheManager.pull_blocks`` between two engines of this process, same host
(p50 us of a repeated request, of a request never seen before, and of a pull of every tensor),
a run any tree's build can make (it uses only ``CacheManager`` and the engine's public calls):
run it with each tree's interpreter, alternating. Blocks a few seconds.

``--large``: ``Engine.prepare_pull`` of 10k and 100k random (uncoalesced) block pairs into a
2-tensor blocks cache of 64-byte blocks (docs/performance.md, "Large requests"): p50 ms of 31
calls each, interleaved, and the 100k / 10k ratio (10x: linear in the spans). A run any tree's
build can make: run it with each tree's interpreter, alternating.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import numpy as np

from datadist.core.config import HOST, EngineConfig
from datadist.core.native import NativeEngine

BLOCKS, BLOCK = 64, 16384


def p50s(fns: dict[str, Callable[[], object]], n: int = 1000, rounds: int = 5) -> None:
    samples: dict[str, list[float]] = {k: [] for k in fns}
    clock = time.perf_counter_ns
    for _ in range(rounds):
        for k, fn in fns.items():
            for _ in range(50):
                fn()
            for _ in range(n):
                t0 = clock()
                fn()
                samples[k].append((clock() - t0) / 1e3)
    for k, v in samples.items():
        print(f"{k:34s} p50 {float(np.median(v)):7.2f} us")


def stage() -> None:
    from datadist.core.keys import KeyKind, KeyRef
    from datadist.core.layout import U32, Geometry, plan_blocks
    from datadist.core.native import PULL_BLOCKS

    e = NativeEngine(EngineConfig(cluster_id=8, role=2))
    arrs = [np.zeros(BLOCKS * BLOCK, np.uint8) for _ in range(4)]
    geo = Geometry(4, BLOCKS * BLOCK, BLOCKS, True)
    ent = e.register(geo, [int(a.ctypes.data) for a in arrs], placement=HOST)
    key = KeyRef(KeyKind.BLOCKS_KEY, 0, 1, 0)
    order = np.random.default_rng(7).permutation(BLOCKS * BLOCKS).tolist()
    i = [0]

    def nxt() -> tuple[np.ndarray, np.ndarray]:
        o = order[i[0] % len(order)]
        i[0] += 1
        return np.array([o // BLOCKS], np.uint64), np.array([o % BLOCKS], np.uint64)

    def old() -> None:
        s, d = nxt()
        tensors = (np.arange(2, 4, dtype=U32), np.arange(2, 4, dtype=U32))  # layer 1 of 2
        e.prepared(False, 1, key, BLOCK, plan_blocks(geo, s, d, tensors), ent.cache_id)

    def new() -> None:
        s, d = nxt()
        e.prepare_pull(1, key, ent.cache_id, PULL_BLOCKS, src_blocks=s, dst_blocks=d,
                       src_layers=(1, 2), dst_layers=(1, 2))

    try:
        p50s({"python plan + Engine.prepare": old, "Engine.prepare_pull": new})
    finally:
        e.close()


def api() -> None:
    from datadist.api.cache_manager import CacheManager
    from datadist.api.enums import DataType, Placement
    from datadist.api.types import BlocksCacheKey, CacheDesc

    owner = NativeEngine(EngineConfig(cluster_id=1, role=1, listen=("127.0.0.1", 0)))
    puller = NativeEngine(EngineConfig(cluster_id=2, role=2))
    try:
        ocm, pcm = CacheManager(owner), CacheManager(puller)
        src = np.random.default_rng(1).integers(0, 256, (4, BLOCKS * BLOCK), dtype=np.uint8)
        dst = np.zeros_like(src)
        desc = CacheDesc(4, [BLOCKS, BLOCK], DataType.DT_UINT8, Placement.DEVICE)
        ocm.register_blocks_cache(desc, [int(a.ctypes.data) for a in src], BlocksCacheKey(1, 5))
        cache = pcm.register_blocks_cache(desc, [int(a.ctypes.data) for a in dst], None)
        address = owner.listen_address
        assert address is not None
        puller.link(1, *address, 5.0)
        key, r = BlocksCacheKey(1, 5), range(1, 2)
        order = np.random.default_rng(7).permutation(BLOCKS * BLOCKS).tolist()
        i = [0]

        def new() -> None:
            o = order[i[0] % len(order)]
            i[0] += 1
            pcm.pull_blocks(key, cache, [o // BLOCKS], [o % BLOCKS], src_layer_range=r,
                            dst_layer_range=r)

        p50s({
            "repeated, one layer (2 x 16 KiB)": lambda: pcm.pull_blocks(
                key, cache, [5], [9], src_layer_range=r, dst_layer_range=r),
            "each request new, one layer": new,
            "repeated, every tensor (4 x 16 KiB)": lambda: pcm.pull_blocks(key, cache, [5], [9]),
        }, n=500)
    finally:
        puller.close()
        owner.close()


def large(sizes: tuple[int, ...] = (10_000, 100_000), rounds: int = 31) -> None:
    from datadist.core.keys import KeyKind, KeyRef
    from datadist.core.layout import Geometry
    from datadist.core.native import PULL_BLOCKS

    e = NativeEngine(EngineConfig(cluster_id=8, role=2))
    try:
        key = KeyRef(KeyKind.BLOCKS_KEY, 0, 1, 0)
        rng = np.random.default_rng(7)
        cases = []
        for n in sizes:
            arrs = [np.zeros(n * 64, np.uint8) for _ in range(2)]
            ent = e.register(Geometry(2, n * 64, n, True), [int(a.ctypes.data) for a in arrs],
                             placement=HOST)
            src, dst = rng.permutation(n).astype(np.uint64), rng.permutation(n).astype(np.uint64)
            cases.append((n, ent.cache_id, src, dst, arrs))
        samples: dict[int, list[float]] = {n: [] for n in sizes}
        for _ in range(rounds):
            for n, cache_id, src, dst, _arrs in cases:
                t0 = time.perf_counter_ns()
                call = e.prepare_pull(1, key, cache_id, PULL_BLOCKS, src_blocks=src,
                                      dst_blocks=dst)
                samples[n].append((time.perf_counter_ns() - t0) / 1e6)
                del call
        p50 = {n: float(np.median(v)) for n, v in samples.items()}
        for n in sizes:
            print(f"prepare_pull, {n:7d} uncoalesced blocks  p50 {p50[n]:7.3f} ms")
        print(f"{sizes[-1]} / {sizes[0]} blocks: {p50[sizes[-1]] / p50[sizes[0]]:.1f}x the time "
              f"for {sizes[-1] / sizes[0]:.0f}x the spans")
    finally:
        e.close()


if __name__ == "__main__":
    if "--api" in sys.argv[1:]:
        api()
    elif "--large" in sys.argv[1:]:
        large()
    else:
        stage()
