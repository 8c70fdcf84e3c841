"""Where the time of one transfer_cache_async goes on one host: wall and CPU a transfer, per
thread (the caller, the loop thread, the core's workers, the owner's threads), against one
push_blocks of the same bytes (docs/performance.md, round 15).

    python benchmarks/async_cpu.py                     # 32 layers of 1 MiB
    python benchmarks/async_cpu.py --tiny              # 32 layers of 2 x 16 x 64 B: no copy

One process holds an owner engine and a puller engine (as ``benchmarks/call_syscalls.py``).
CPU is each thread's ``/proc/self/task/<tid>/schedstat`` (ns on the CPU), read before and
after ``--calls`` transfers; ``caller before return`` is ``time.thread_time`` around
``transfer_cache_async`` alone. Under ``valgrind --tool=callgrind`` (``--calls`` small) the
instruction counts of every thread give the same split without the machine's noise.

Who runs it: a person, by hand; nothing imports it.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time


def _cpu() -> dict[int, tuple[str, int]]:
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        out[int(tid)] = (name, ns)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="32 layers of 2 x 16 x 64 B")
    ap.add_argument("--case", choices=("async", "push", "both"), default="both")
    ap.add_argument("--warm", type=int, default=50)
    ap.add_argument("--instructions", action="store_true",
                    help="run under callgrind with --calls and 3x --calls; print the "
                    "instructions a call, per thread kind (the difference of the two)")
    a = ap.parse_args()
    if a.instructions:
        return _instructions(a)

    import numpy as np

    from datadist import (
        BlocksCacheKey,
        CacheDesc,
        DataType,
        LayerSynchronizer,
        LLMStatusCode,
        Placement,
        TransferWithCacheKeyConfig,
    )
    from datadist.api.cache_manager import CacheManager
    from datadist.core.config import EngineConfig
    from datadist.core.native import NativeEngine

    layers_n, blocks_n, block = (32, 16, 64) if a.tiny else (32, 16, 32 << 10)
    owner = NativeEngine(EngineConfig(cluster_id=1, role=1, listen=("127.0.0.1", 0)))
    puller = NativeEngine(EngineConfig(cluster_id=2, role=2))
    ocm = CacheManager(owner, remote_cache_accessible=True)
    pcm = CacheManager(puller, remote_cache_accessible=True)
    u8, dev = DataType.DT_UINT8, Placement.DEVICE
    lsrc = np.ones((2 * layers_n, blocks_n * block), np.uint8)
    ldst = np.zeros_like(lsrc)
    ldesc = CacheDesc(2 * layers_n, [blocks_n, block], u8, dev)
    ocm.register_blocks_cache(ldesc, [int(x.ctypes.data) for x in lsrc], BlocksCacheKey(1, 1))
    layers = pcm.register_blocks_cache(ldesc, [int(x.ctypes.data) for x in ldst], None)
    address = owner.listen_address
    assert address is not None
    puller.link(1, address[0], address[1], 5.0)
    lkey = BlocksCacheKey(1, 1)
    blocks = list(range(blocks_n))

    class Ready(LayerSynchronizer):
        def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
            return True

    ready = Ready()
    cfg = TransferWithCacheKeyConfig(lkey, range(layers_n), range(layers_n))
    main_tid = threading.get_native_id()
    before_return: list[float] = []

    def async_one() -> None:
        t0 = time.thread_time_ns()
        task = pcm.transfer_cache_async(layers, ready, [cfg], blocks, blocks)
        before_return.append((time.thread_time_ns() - t0) / 1e3)
        assert task.synchronize(60000) == LLMStatusCode.LLM_SUCCESS

    def push_one() -> None:
        pcm.push_blocks(lkey, layers, blocks, blocks)

    cases = {"async": async_one, "push": push_one}
    names = list(cases) if a.case == "both" else [a.case]
    for fn in cases.values():
        for _ in range(a.warm):
            fn()
    for r in range(a.rounds):
        for name in names:
            fn = cases[name]
            before_return.clear()
            c0 = _cpu()
            t0 = time.perf_counter_ns()
            for _ in range(a.calls):
                fn()
            wall = (time.perf_counter_ns() - t0) / 1e3 / a.calls
            c1 = _cpu()
            groups: dict[str, float] = {}
            for tid, (nm, ns) in c1.items():
                d = (ns - c0.get(tid, (nm, 0))[1]) / 1e3 / a.calls
                if d < 0.05:
                    continue
                label = "caller" if tid == main_tid else nm
                groups[label] = groups.get(label, 0.0) + d
            total = sum(groups.values())
            parts = ", ".join(f"{k} {v:.1f}"
                              for k, v in sorted(groups.items(), key=lambda x: -x[1]))
            extra = (f"; caller before return {statistics.median(before_return):.1f}"
                     if before_return else "")
            print(f"round {r} {name}: wall {wall:.1f} us, CPU {total:.1f} us ({parts}){extra}",
                  flush=True)
    puller.close()
    owner.close()
    return 0


def _kind(text: str, first: bool) -> str:
    if first:
        return "caller"
    if "_PyEval_EvalFrameDefault" in text:
        return "loop thread"
    return "core threads"  # the workers, the owner's (the core has no symbols to tell them by)


def _instructions(a: argparse.Namespace) -> int:
    """Callgrind, every thread apart (--separate-threads), at --calls and 3x --calls."""
    here = os.path.abspath(__file__)
    shim = os.path.join(os.path.dirname(here), "pidfd_shim.c")
    counts: dict[int, dict[str, int]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        so = os.path.join(tmp, "shim.so")
        subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", so, shim, "-ldl"], check=True)
        for n in (a.calls, 3 * a.calls):
            out = os.path.join(tmp, str(n))
            os.mkdir(out)
            cmd = ["valgrind", "--tool=callgrind", "--separate-threads=yes",
                   f"--callgrind-out-file={out}/cg", sys.executable, here, "--calls", str(n),
                   "--rounds", "1", "--warm", str(a.warm), "--case", a.case]
            if a.tiny:
                cmd.append("--tiny")
            env = dict(os.environ, PYTHONHASHSEED="0", LD_PRELOAD=so)
            subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
            got: dict[str, int] = {}
            for name in sorted(os.listdir(out)):
                with open(os.path.join(out, name)) as f:
                    text = f.read()
                m = re.search(r"^(?:summary|totals): (\d+)", text, re.M)
                kind = _kind(text, name.endswith("-01"))
                got[kind] = got.get(kind, 0) + (int(m.group(1)) if m else 0)
            counts[n] = got
    lo, hi = counts[a.calls], counts[3 * a.calls]
    per = {k: (hi.get(k, 0) - lo.get(k, 0)) / (2 * a.calls) for k in set(lo) | set(hi)}
    parts = ", ".join(f"{k} {v:,.0f}" for k, v in sorted(per.items(), key=lambda x: -x[1]))
    print(f"{a.case}: {sum(per.values()):,.0f} instructions a call ({parts})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
