#!/usr/bin/env python3
"""Local copies through the public API: ``copy_blocks``, ``swap_blocks`` and ``copy_cache``.

``python benchmarks/local_copies.py [REPEAT]``: one engine (no listener) with a DEVICE blocks
cache and a HOST blocks cache of 2 tensors x 8192 blocks x 4 KiB (numpy memory, registered),
and two contiguous caches of 4 tensors x 4 slots x 4 MiB. Times, medians of REPEAT (default 15):

* copy_blocks: 2048 scattered blocks (no two adjacent: 2048 spans a tensor) within one cache;
* copy_blocks_runs: 2048 blocks in runs of 64 (32 spans a tensor);
* swap_blocks: 2048 scattered blocks DEVICE -> HOST;
* copy_cache: one 4 MiB slot of every tensor (16 MiB);

and, as the limit in the same run, numpy copying the same bytes (``numpy_blocks``: the 2048
scattered blocks of both tensors by fancy indexing; ``numpy_slot``: the 16 MiB of copy_cache).

It calls only the public API. ``--old DIR``: the local copies of an earlier tree instead,
its ``core/local.py`` and ``api/local_ops.py`` copied into DIR (``git show
0352665:src/datadist/core/local.py > DIR/local.py``, the same for ``local_ops.py``), over this
build's core: Python's planning and memmove executor against the core's copy, alternated in
one run (docs/performance.md, "Round 9").
"""

from __future__ import annotations

import statistics
import sys
import time
import warnings
from collections.abc import Callable

import numpy as np

import datadist as llm
from datadist.api.cache_manager import CacheManager
from datadist.core.config import EngineConfig
from datadist.core.native import NativeEngine

BLOCKS, BLOCK, TENSORS = 8192, 4096, 2
N = 2048


def _register(cm: CacheManager, keep: list[np.ndarray], tensors: int, shape: list[int],
              placement: llm.Placement, blocks: bool) -> llm.Cache:
    desc = llm.CacheDesc(tensors, shape, llm.DataType.DT_UINT8, placement)
    arr = np.random.default_rng(len(keep)).integers(0, 256, (tensors, desc.size), np.uint8)
    keep.append(arr)
    addrs = [int(arr[i].ctypes.data) for i in range(tensors)]
    if blocks:
        return cm.register_blocks_cache(desc, addrs)
    return cm.register_cache(desc, addrs)


def _median_us(fn: Callable[[], None], repeat: int) -> float:
    fn()  # warm
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _use_old(directory: str) -> None:
    """The facade's local copies from ``directory``'s local.py and local_ops.py (an earlier
    tree's), in place of this tree's."""
    import importlib.util

    from datadist.api import cache_manager

    def load(name: str, path: str) -> object:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        return mod

    import datadist.core

    datadist.core.local = load("datadist.core.local",  # type: ignore[attr-defined]
                               f"{directory}/local.py")
    cache_manager.local_ops = load("datadist.api.local_ops",  # type: ignore[assignment]
                                   f"{directory}/local_ops.py")


def main() -> None:
    args = sys.argv[1:]
    if args[:1] == ["--old"]:
        _use_old(args[1])
        args = args[2:]
    repeat = int(args[0]) if args else 15
    warnings.simplefilter("ignore")  # "registers caches but listens nowhere": as meant here
    engine = NativeEngine(EngineConfig(cluster_id=77, role=1))
    cm = CacheManager(engine)
    keep: list[np.ndarray] = []
    dev = _register(cm, keep, TENSORS, [BLOCKS, BLOCK], llm.Placement.DEVICE, True)
    host = _register(cm, keep, TENSORS, [BLOCKS, BLOCK], llm.Placement.HOST, True)
    a = _register(cm, keep, 4, [4, 4 << 20], llm.Placement.DEVICE, False)
    b = _register(cm, keep, 4, [4, 4 << 20], llm.Placement.DEVICE, False)
    rng = np.random.default_rng(0)
    evens = rng.permutation(np.arange(0, BLOCKS, 2))[:N].tolist()
    odds = rng.permutation(np.arange(1, BLOCKS, 2))[:N].tolist()
    scattered = {s: [d] for s, d in zip(evens, odds, strict=True)}
    runs_src = [r * 128 + i for r in range(N // 64) for i in range(64)]
    runs = {s: [s + 64] for s in runs_src}
    swap = dict(zip(evens, odds, strict=True))
    dev_arr = keep[0].reshape(TENSORS, BLOCKS, BLOCK)
    host_arr = keep[1].reshape(TENSORS, BLOCKS, BLOCK)
    slot_a = keep[2].reshape(4, 4, -1)
    slot_b = keep[3].reshape(4, 4, -1)

    def numpy_blocks() -> None:
        host_arr[:, odds] = dev_arr[:, evens]

    def numpy_slot() -> None:
        np.copyto(slot_b[:, 1], slot_a[:, 2])

    rows = {
        "numpy_blocks": numpy_blocks,
        "copy_blocks": lambda: cm.copy_blocks(dev, scattered),
        "copy_blocks_runs": lambda: cm.copy_blocks(dev, runs),
        "swap_blocks": lambda: cm.swap_blocks(dev, host, swap),
        "numpy_slot": numpy_slot,
        "copy_cache": lambda: cm.copy_cache(b, a, dst_batch_index=1, src_batch_index=2),
    }
    for name, fn in rows.items():
        print(f"{name:18s} {_median_us(fn, repeat):10.1f} us")
    engine.close()


if __name__ == "__main__":
    main()
