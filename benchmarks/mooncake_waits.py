"""Mooncake alone: which way of waiting and batching is its fastest here (issue 27 item 1).

    python benchmarks/mooncake_waits.py [--repeat 5]        # MC_TCP_PROTO=1 for its legacy framing

Two Mooncake TCP engines in this process (P2P handshake, no etcd), 256 MiB moved each way,
the ways interleaved, the median of --repeat printed: blocks of 32 KiB (8192, shuffled) by
synchronous batches of 256 and 2048 and by asynchronous batches posted back to back and waited
for once; 256 MiB as 4 or 16 spans posted asynchronously and looked at every 200 us, or read
synchronously. The bytes are checked after each way's warm-up. bench/mooncake.py uses what
this shows to be Mooncake's best; docs/performance.md has the figures.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

import numpy as np

N, BLOCK = 256 << 20, 32 << 10


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    os.environ.setdefault("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "16384")
    os.environ.setdefault("MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER", "16384")
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    try:
        from mooncake.engine import TransferEngine  # type: ignore[import-not-found,import-untyped,unused-ignore]
    except ImportError:
        print("needs mooncake-transfer-engine-non-cuda", file=sys.stderr)
        return 2

    def engine() -> object:
        e = TransferEngine()
        if e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
            raise SystemExit("Mooncake's initialize failed")
        return e

    src = np.arange(N // 8, dtype=np.uint64).view(np.uint8)
    dst = np.zeros(N, np.uint8)
    a, b = engine(), engine()
    a.register_memory(src.ctypes.data, N)  # type: ignore[attr-defined]
    b.register_memory(dst.ctypes.data, N)  # type: ignore[attr-defined]
    target = f"127.0.0.1:{a.get_rpc_port()}"  # type: ignore[attr-defined]
    n = N // BLOCK
    perm = np.random.default_rng(1).permutation(n)
    d = [dst.ctypes.data + int(i) * BLOCK for i in perm]
    s = [src.ctypes.data + i * BLOCK for i in range(n)]
    lens = [BLOCK] * n
    e: object = b

    def sync(batch: int) -> None:
        for i in range(0, n, batch):
            if e.batch_transfer_sync_read(target, d[i:i + batch], s[i:i + batch],  # type: ignore[attr-defined]
                                          lens[i:i + batch]) != 0:
                raise SystemExit("a read failed")

    def pipelined(batch: int) -> None:
        ids = [e.batch_transfer_async_read(target, d[i:i + batch], s[i:i + batch],  # type: ignore[attr-defined]
                                           lens[i:i + batch]) for i in range(0, n, batch)]
        if e.get_batch_transfer_status(ids) != 0:  # type: ignore[attr-defined]
            raise SystemExit("a read failed")

    def polled(spans: int) -> None:
        c = N // spans
        pending = [e.batch_transfer_async_read(target, [dst.ctypes.data + k * c],  # type: ignore[attr-defined]
                                               [src.ctypes.data + k * c], [c])
                   for k in range(spans)]
        while pending:
            time.sleep(200e-6)
            left = []
            for bid in pending:
                rc = e.transfer_check_status(bid)  # type: ignore[attr-defined]
                if rc < 0:
                    raise SystemExit("a read failed")
                if rc == 0:
                    left.append(bid)
            pending = left

    def contig_sync(spans: int) -> None:
        c = N // spans
        for k in range(spans):
            if e.transfer_sync_read(target, dst.ctypes.data + k * c,  # type: ignore[attr-defined]
                                    src.ctypes.data + k * c, c) != 0:
                raise SystemExit("a read failed")

    ways: dict[str, tuple[Callable[[], None], bool]] = {
        "blocks, sync batches of 256": (lambda: sync(256), True),
        "blocks, sync batches of 2048": (lambda: sync(2048), True),
        "blocks, async 2048 pipelined": (lambda: pipelined(2048), True),
        "256 MiB, 4 spans polled 200 us": (lambda: polled(4), False),
        "256 MiB, 16 spans polled 200 us": (lambda: polled(16), False),
        "256 MiB, 4 spans sync": (lambda: contig_sync(4), False),
    }
    want_blocks = src.view(np.uint64).reshape(n, -1)
    for name, (fn, blocks) in ways.items():  # warm, and the bytes checked
        dst.fill(0)
        fn()
        got = dst.view(np.uint64).reshape(n, -1)
        ok = np.array_equal(got[perm], want_blocks) if blocks else np.array_equal(dst, src)
        if not ok:
            raise SystemExit(f"{name}: wrong bytes")
    res: dict[str, list[float]] = {k: [] for k in ways}
    for _ in range(args.repeat):
        for name, (fn, _) in ways.items():
            t0 = time.perf_counter()
            fn()
            res[name].append(N / (time.perf_counter() - t0) / 1e9)
    proto = os.environ.get("MC_TCP_PROTO", "default")
    print(f"Mooncake TCP, MC_TCP_PROTO={proto}, median of {args.repeat}:")
    for name, v in res.items():
        print(f"  {name:34s} {np.median(v):.2f} GB/s  ({', '.join(f'{x:.2f}' for x in v)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
