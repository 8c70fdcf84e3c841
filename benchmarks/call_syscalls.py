"""System calls per call, counted by strace: what a same-host pull, a per-layer pull and
transfer_cache_async ask of the kernel besides the copy (docs/performance.md, round 13).

    python benchmarks/call_syscalls.py                # every case
    python benchmarks/call_syscalls.py --case layer

One process holds an owner engine and a puller engine (as the API tests and
``datadist.bench.stages`` run them) on one host; it is run under ``strace -f -c`` twice, with
``--calls`` and with five times as many calls of the case, and the difference of the two
counts divided by the difference of the call counts is printed, per system call: what one
call costs, set-up and teardown cancelled out. Every thread of the process counts (the
core's workers, the owner's threads).

Cases: ``small`` (pull_blocks of one 16 KiB block), ``layer`` (pull_blocks of one 1 MiB layer,
16 blocks of 32 KiB, K and V, with layer ranges, 32 layers in turn), ``async``
(transfer_cache_async of those 32 layers, then synchronize), ``push`` (one push_blocks of the
32 layers: the async case's limit).

Who runs it: a person, by hand (docs/performance.md); nothing imports it. Needs strace.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

CASES = ("small", "layer", "async", "push")
LAYERS, LAYER_BLOCKS, LAYER_BLOCK, BLOCK = 32, 16, 32 << 10, 16 << 10


def _run_case(case: str, calls: int) -> None:
    """The traced process: link, warm, then ``calls`` calls of ``case``."""
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

    owner = NativeEngine(EngineConfig(cluster_id=1, role=1, listen=("127.0.0.1", 0)))
    puller = NativeEngine(EngineConfig(cluster_id=2, role=2))
    ocm = CacheManager(owner, remote_cache_accessible=True)
    pcm = CacheManager(puller, remote_cache_accessible=True)
    u8, dev = DataType.DT_UINT8, Placement.DEVICE
    small_src = np.ones((1, 64 * BLOCK), np.uint8)
    small_dst = np.zeros_like(small_src)
    sdesc = CacheDesc(1, [64, BLOCK], u8, dev)
    ocm.register_blocks_cache(sdesc, [small_src.ctypes.data], BlocksCacheKey(1, 0))
    small = pcm.register_blocks_cache(sdesc, [small_dst.ctypes.data], None)
    lsrc = np.ones((2 * LAYERS, LAYER_BLOCKS * LAYER_BLOCK), np.uint8)
    ldst = np.zeros_like(lsrc)
    ldesc = CacheDesc(2 * LAYERS, [LAYER_BLOCKS, LAYER_BLOCK], u8, dev)
    ocm.register_blocks_cache(ldesc, [int(a.ctypes.data) for a in lsrc], BlocksCacheKey(1, 1))
    layers = pcm.register_blocks_cache(ldesc, [int(a.ctypes.data) for a in ldst], None)
    address = owner.listen_address
    assert address is not None
    puller.link(1, address[0], address[1], 5.0)
    skey, lkey = BlocksCacheKey(1, 0), BlocksCacheKey(1, 1)
    blocks = list(range(LAYER_BLOCKS))
    ranges = [range(i, i + 1) for i in range(LAYERS)]

    class Ready(LayerSynchronizer):
        def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
            return True

    ready = Ready()
    cfg = TransferWithCacheKeyConfig(lkey, range(LAYERS), range(LAYERS))

    def one(i: int) -> None:
        if case == "small":
            pcm.pull_blocks(skey, small, [i % 64], [(i * 7) % 64])
        elif case == "layer":
            r = ranges[i % LAYERS]
            pcm.pull_blocks(lkey, layers, blocks, blocks, src_layer_range=r, dst_layer_range=r)
        elif case == "async":
            task = pcm.transfer_cache_async(layers, ready, [cfg], blocks, blocks)
            assert task.synchronize(60000) == LLMStatusCode.LLM_SUCCESS
        else:
            pcm.push_blocks(lkey, layers, blocks, blocks)

    for i in range(64):
        one(i)
    for i in range(calls):
        one(i)
    puller.close()
    owner.close()


def _counts(case: str, calls: int) -> dict[str, int]:
    with tempfile.TemporaryDirectory() as out:
        path = os.path.join(out, "strace.txt")
        subprocess.run(["strace", "-f", "-c", "-o", path, sys.executable, __file__, "--traced",
                        case, "--calls", str(calls)], check=True, stdout=subprocess.DEVNULL)
        got: dict[str, int] = {}
        with open(path) as f:
            for line in f:
                m = re.match(r"\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:\d+\s+)?(\w+)\s*$", line)
                if m and m.group(2) != "total":
                    got[m.group(2)] = int(m.group(1))
        return got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", choices=CASES, action="append")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--traced", choices=CASES, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.traced:
        _run_case(a.traced, a.calls)
        return 0
    for case in a.case or list(CASES):
        few, many = _counts(case, a.calls), _counts(case, 5 * a.calls)
        per = {k: (many.get(k, 0) - few.get(k, 0)) / (4 * a.calls) for k in set(few) | set(many)}
        shown = {k: v for k, v in sorted(per.items(), key=lambda kv: -kv[1]) if v >= 0.05}
        total = sum(shown.values())
        print(f"{case:6} {total:6.2f} system calls a call: "
              + ", ".join(f"{k} {v:.2f}" for k, v in shown.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
