"""Where a same-host 16 KiB pull's microseconds go between two processes (issue "Per call and
per layer at the limit", item 1; docs/performance.md, "Where the same-host small pull's
microseconds go").

An owner process registers a blocks cache of 64 x 16 KiB; this process links to it and times,
interleaved, p50 and p10 in us:

- ``pull_blocks`` of one block pair, always the same, and ``pull_walk`` walking the 64 pairs
  the bench's small-pull rows use (block i % 64 into block 7i % 64);
- ``core.run`` of the request's prepared call (the binding and the core, no facade), the
  same pair and walking (``core_walk``);
- raw ``process_vm_readv`` of the same 16 KiB through ctypes, the same pair (``raw``) and
  walking (``raw_walk``), and on this process's own memory (``raw_self``).

With ``pin``, both processes run on one CPU (as the bench's latency rows do). Blocks for a
few seconds. Usage: ``python benchmarks/small_pull_walk.py [pin]``.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

BLOCK, N = 16 << 10, 64
OWNER, PULLER = 1, 2


def owner(q: Any, stop: Any) -> None:
    import datadist as ll

    dd = ll.LLMDataDist(ll.LLMRole.PROMPT, OWNER)
    cfg = ll.LLMConfig()
    cfg.listen_ip_info = "127.0.0.1:0"
    cfg.local_comm_res = ""
    dd.init(cfg.generate_options())
    buf = np.arange(N * BLOCK, dtype=np.uint8).reshape(N, BLOCK)
    desc = ll.CacheDesc(1, [N, BLOCK], ll.DataType.DT_UINT8, ll.Placement.HOST)
    dd.cache_manager.register_blocks_cache(desc, [buf.ctypes.data], ll.BlocksCacheKey(OWNER, 0))
    q.put((os.getpid(), buf.ctypes.data, dd.engine.listen_address[1]))
    stop.wait()
    dd.finalize()


def main() -> None:
    import datadist as ll
    from datadist.bench.harness import one_cpu
    from datadist.bench.limits import RawCma, iov

    ctx = mp.get_context("spawn")
    q, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=owner, args=(q, stop))
    proc.start()
    pid, addr, port = q.get(timeout=60)
    dd = ll.LLMDataDist(ll.LLMRole.DECODER, PULLER)
    cfg = ll.LLMConfig()
    cfg.local_comm_res = ""
    dd.init(cfg.generate_options())
    try:
        mine = np.zeros((N, BLOCK), np.uint8)
        cm = dd.cache_manager
        cache = cm.register_blocks_cache(
            ll.CacheDesc(1, [N, BLOCK], ll.DataType.DT_UINT8, ll.Placement.HOST),
            [mine.ctypes.data], ll.BlocksCacheKey(PULLER, 0))
        c = ll.LLMClusterInfo()
        c.remote_cluster_id = OWNER
        c.append_local_ip_info("127.0.0.1", 0)
        c.append_remote_ip_info("127.0.0.1", port)
        dd.link_clusters([c], 5000)
        key = ll.BlocksCacheKey(OWNER, 0)
        core_run = dd.engine._core.run
        calls = []
        for i in range(N):
            cm.pull_blocks(key, cache, [i % N], [i * 7 % N])
            calls.append(cm._pull_blocks_request(key, cache, [i % N], [i * 7 % N], {}).prepared())

        def raw_of(i: int, remote_pid: int, remote_base: int) -> Callable[[], None]:
            return RawCma(remote_pid).prepare(
                iov(np.array([mine.ctypes.data + i * 7 % N * BLOCK], np.uint64),
                    np.array([BLOCK], np.uint64)),
                iov(np.array([remote_base + i % N * BLOCK], np.uint64),
                    np.array([BLOCK], np.uint64)))

        raws = [raw_of(i, pid, addr) for i in range(N)]
        walk = {k: itertools.count() for k in ("pull", "core", "raw")}
        fns: dict[str, Callable[[], object]] = {
            "pull_blocks": lambda: cm.pull_blocks(key, cache, [3], [21]),
            "pull_walk": lambda: cm.pull_blocks(key, cache, [(i := next(walk["pull"])) % N],
                                                [i * 7 % N]),
            "core.run": lambda: core_run(calls[3], 5.0),
            "core_walk": lambda: core_run(calls[next(walk["core"]) % N], 5.0),
            "raw": raws[3],
            "raw_walk": lambda: raws[next(walk["raw"]) % N](),
            "raw_self": raw_of(3, os.getpid(), mine.ctypes.data + BLOCK),
        }
        samples: dict[str, list[float]] = {k: [] for k in fns}
        with one_cpu(os.getpid(), pid) if "pin" in sys.argv else contextlib.nullcontext():
            for _ in range(20):
                for k, fn in fns.items():
                    for _ in range(500):
                        t0 = time.perf_counter_ns()
                        fn()
                        samples[k].append((time.perf_counter_ns() - t0) / 1e3)
        print(f"path {dd.engine.last_moved(OWNER)}, load {os.getloadavg()[0]:.1f}")
        for k, v in samples.items():
            print(f"  {k:12s} p50 {np.median(v):6.2f}  p10 {np.percentile(v, 10):6.2f} us")
    finally:
        stop.set()
        dd.finalize()
        proc.join(10)


if __name__ == "__main__":
    main()
