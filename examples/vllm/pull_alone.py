"""The pull mode's KV pull outside vLLM: a 4,001-token prompt of bench_pd.py's model
(126 blocks x 8 layers of 128 KiB: 126 MiB) pulled by a decoder process bound to one CPU,
the way the connector pulls it (one ``pull_blocks`` for every block and layer), against
raw ``process_vm_readv`` of the same blocks (one iovec per block and layer, one call per
layer), and optionally beside a ``sched_yield`` spinner on the decoder's CPU (what vLLM's
engine core does while its worker waits).

    python examples/vllm/pull_alone.py [--scatter] [--spin]

``--scatter``: both sides' blocks drawn at random (61 runs) instead of consecutive. Needs
two CPUs (the prefill on CPU 0, the decoder on CPU 1) and Linux. Prints medians of 12
[min-max]. docs/vllm.md, "The pull mode's pull".
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import statistics
import sys
import time

import numpy as np

BLOCKS, SHAPE, LAYERS, N = 256, (8, 32, 128), 8, 126  # float32: 128 KiB a block and layer
BLOCK_BYTES = int(np.prod(SHAPE)) * 4


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _prefill(q: mp.Queue, stop: mp.Queue) -> None:
    """The owner: the connector's producer worker, on CPU 0, its KV cache filled with 1."""
    import datadist as llm_datadist
    from datadist.integrations.vllm.settings import Settings
    from datadist.integrations.vllm.worker import DatadistWorker, KvLayout

    os.sched_setaffinity(0, {0})
    arrs = [np.ones((BLOCKS, *SHAPE), np.float32) for _ in range(LAYERS)]
    w = DatadistWorker(Settings(), producer=True, consumer=False)
    w.start(KvLayout([a.ctypes.data for a in arrs], BLOCKS, SHAPE,
                     llm_datadist.DataType.DT_FLOAT, 1))
    assert w.address is not None
    q.put((w.address.host, w.address.port, w.cluster_id, os.getpid(),
           [a.ctypes.data for a in arrs]))
    stop.get(timeout=600)
    w.close()


def _spin() -> None:
    os.sched_setaffinity(0, {1})
    while True:
        os.sched_yield()


def main() -> int:
    import datadist as llm_datadist
    from datadist.integrations.vllm.settings import KV_MODEL_ID

    scatter, spin = "--scatter" in sys.argv, "--spin" in sys.argv
    ctx = mp.get_context("spawn")
    q, stop = ctx.Queue(), ctx.Queue()
    owner = ctx.Process(target=_prefill, args=(q, stop), daemon=True)
    owner.start()
    host, port, cid, pid, addrs = q.get(timeout=120)
    os.sched_setaffinity(0, {1})  # before datadist's threads start: they inherit it
    spinner = ctx.Process(target=_spin, daemon=True) if spin else None
    if spinner is not None:
        spinner.start()
    arrs = [np.zeros((BLOCKS, *SHAPE), np.float32) for _ in range(LAYERS)]
    dd = llm_datadist.LLMDataDist(llm_datadist.LLMRole.DECODER, 7)
    cfg = llm_datadist.LLMConfig()
    cfg.device_id, cfg.local_comm_res = 0, ""
    dd.init(cfg.generate_options())
    try:
        kv = dd.cache_manager.register_blocks_cache(
            llm_datadist.CacheDesc(LAYERS, [BLOCKS, *SHAPE], llm_datadist.DataType.DT_FLOAT),
            [a.ctypes.data for a in arrs])
        info = llm_datadist.LLMClusterInfo()
        info.remote_cluster_id = cid
        info.append_local_ip_info("0.0.0.0", 0)
        info.append_remote_ip_info(host, port)
        code, _ = dd.link_clusters([info], timeout=5000)
        assert code == llm_datadist.LLMStatusCode.LLM_SUCCESS, code
        rng = np.random.default_rng(0)
        src = (sorted(rng.choice(BLOCKS, N, replace=False).tolist()) if scatter
               else list(range(N)))
        dst = (sorted(rng.choice(BLOCKS, N, replace=False).tolist()) if scatter
               else list(range(100, 100 + N)))
        key = llm_datadist.BlocksCacheKey(cid, KV_MODEL_ID)
        libc = ctypes.CDLL(None, use_errno=True)
        iovs = []
        for t in range(LAYERS):  # built once: the raw limit times only the system calls
            loc = (_Iovec * N)(*[_Iovec(arrs[t].ctypes.data + d * BLOCK_BYTES, BLOCK_BYTES)
                                 for d in dst])
            rem = (_Iovec * N)(*[_Iovec(addrs[t] + s * BLOCK_BYTES, BLOCK_BYTES) for s in src])
            iovs.append((loc, rem))

        def raw() -> None:
            for loc, rem in iovs:
                got = libc.process_vm_readv(pid, loc, N, rem, N, 0)
                if got != N * BLOCK_BYTES:
                    raise OSError(ctypes.get_errno(), "process_vm_readv")

        def pull() -> None:
            dd.cache_manager.pull_blocks(key, kv, src, dst)

        pull()
        raw()
        times: dict[str, list[float]] = {"pull": [], "raw": []}
        for _ in range(12):
            for name, fn in (("pull", pull), ("raw", raw)):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        assert all((a[dst] == 1.0).all() for a in arrs), "wrong bytes"
        m = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        runs = 1 + sum(b != a + 1 for a, b in zip(src, src[1:], strict=False))
        print(("beside a sched_yield spinner on its CPU: " if spin else "")
              + f"{runs} run(s) of blocks, 126 MiB: pull_blocks {m['pull']:.1f} ms "
              f"[{min(times['pull']) * 1e3:.1f}-{max(times['pull']) * 1e3:.1f}] "
              f"({126 / 1024 / m['pull'] * 1e3:.1f} GiB/s), raw process_vm_readv "
              f"{m['raw']:.1f} ms [{min(times['raw']) * 1e3:.1f}-"
              f"{max(times['raw']) * 1e3:.1f}], pull/raw {m['pull'] / m['raw']:.2f}; "
              f"load {os.getloadavg()[0]:.1f}", flush=True)
    finally:
        dd.finalize()
        stop.put(1)
        owner.join(30)
        if spinner is not None:
            spinner.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
