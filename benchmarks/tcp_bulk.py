"""Where a bulk TCP pull's time goes, thread by thread, against the plain socket it is held to
(the bench's ``tcp_pull`` and ``tcp_pull_blocks`` rows; docs/performance.md, "Round 15: a
bulk TCP pull's milliseconds").

    python benchmarks/tcp_bulk.py                 # 12 samples of each, 256 MiB
    python benchmarks/tcp_bulk.py --samples 20 --size 64

The bench's own owner process and puller (``datadist.bench.owner``, ``datadist.bench.puller``)
over ``transport = "tcp"`` on one host, and the bench's plain socket between the same two
processes. Each sample is one transfer of each kind (a datadist pull of the contiguous
cache, a datadist pull_blocks of as many bytes in 32 KiB blocks, the plain socket's
``sendall`` / ``recv_into``), in alternating order. Around each transfer the script reads
``/proc/<pid>/task/*/schedstat`` and ``status`` of the owner's threads, the puller's, and the
kernel's ``ksoftirqd`` threads (which take over the loopback's receive processing when a
softirq runs too long): for each, the time it ran, the time it waited runnable for a CPU (run
queue), and its voluntary and involuntary context switches. It prints the medians per
transfer, so that the wall clock's gap can be set against CPU spent and CPU waited for.

Who runs it: a person, by hand; nothing imports it. Blocks while it runs (about a second a
sample at 256 MiB).
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import time
from collections.abc import Callable

import numpy as np

from datadist.bench.harness import SMALL_BLOCK, SMALL_CACHE_BLOCKS, Sizes, aligned_array
from datadist.bench.limits import PlainClient
from datadist.bench.owner import start_owner, stop_owner
from datadist.bench.puller import Puller

# per thread: ns run, ns waited runnable, voluntary and involuntary switches
Counts = tuple[int, int, int, int]


def thread_counts(pid: int) -> dict[str, Counts]:
    """Every thread of ``pid``: its name (with its id) and its counts."""
    out: dict[str, Counts] = {}
    for task in glob.glob(f"/proc/{pid}/task/*"):
        try:
            with open(f"{task}/comm") as f:
                name = f.read().strip()
            with open(f"{task}/schedstat") as f:
                run, wait, _ = (int(x) for x in f.read().split())
            switches = {}
            with open(f"{task}/status") as f:
                for line in f:
                    if "ctxt_switches" in line:
                        k, v = line.split(":")
                        switches[k] = int(v)
        except (OSError, ValueError):
            continue  # the thread ended meanwhile
        out[f"{name}[{task.rsplit('/', 1)[1]}]"] = (
            run, wait, switches.get("voluntary_ctxt_switches", 0),
            switches.get("nonvoluntary_ctxt_switches", 0))
    return out


def group_of(side: str, thread: str) -> str:
    """A thread's line in the table: the owner's I/O threads, its other threads, the
    puller's threads, ksoftirqd."""
    if side == "kernel":
        return "ksoftirqd"
    if side == "owner":
        return "owner: datadist-io" if thread.startswith("datadist-io") else "owner: other"
    return "puller"


def snapshot(pids: dict[str, list[int]]) -> dict[tuple[str, str], Counts]:
    snap: dict[tuple[str, str], Counts] = {}
    for side, ids in pids.items():
        for pid in ids:
            for thread, counts in thread_counts(pid).items():
                snap[(side, thread)] = counts
    return snap


def delta(before: dict[tuple[str, str], Counts],
          after: dict[tuple[str, str], Counts]) -> dict[str, list[float]]:
    """Per group: ms run, ms waited, voluntary, involuntary switches, over the threads that
    existed at both ends."""
    out: dict[str, list[float]] = {}
    for key, b in after.items():
        a = before.get(key)
        if a is None:
            continue
        g = out.setdefault(group_of(*key), [0.0, 0.0, 0.0, 0.0])
        g[0] += (b[0] - a[0]) / 1e6
        g[1] += (b[1] - a[1]) / 1e6
        g[2] += b[2] - a[2]
        g[3] += b[3] - a[3]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=12)
    ap.add_argument("--size", type=int, default=256, help="MiB a transfer")
    args = ap.parse_args()
    sizes = Sizes.preset(False, args.size)
    bufs = {
        "contig": [aligned_array(sizes.tensor_bytes, "page") for _ in range(sizes.contig_tensors)],
        "blocks": aligned_array(sizes.cache_blocks * sizes.block_bytes, "page"),
        "small": aligned_array(SMALL_CACHE_BLOCKS * SMALL_BLOCK, "page"),
    }
    rng = np.random.default_rng(2024)
    src = rng.permutation(sizes.cache_blocks)[: sizes.blocks].tolist()
    dst = rng.permutation(sizes.cache_blocks)[: sizes.blocks].tolist()
    proc, conn, info = start_owner(sizes, "page")
    plain = PlainClient(info["plain_port"])
    puller = Puller(info, sizes, bufs, "tcp")
    try:
        kinds: dict[str, Callable[[], None]] = {
            "datadist pull_cache": puller.pull_contig,
            "datadist pull_blocks": lambda: puller.pull_blocks(src, dst),
            "plain socket": lambda: plain.receive(bufs["contig"], sizes.contig_bytes),
        }
        ksoftirqd = [int(p) for p in os.popen("pgrep ksoftirqd").read().split()]
        pids = {"owner": [proc.pid], "puller": [os.getpid()], "kernel": ksoftirqd}
        for fn in kinds.values():
            fn()  # warm
        walls: dict[str, list[float]] = {k: [] for k in kinds}
        groups: dict[str, dict[str, list[list[float]]]] = {k: {} for k in kinds}
        order = list(kinds)
        for i in range(args.samples):
            for kind in order if i % 2 == 0 else order[::-1]:
                before = snapshot(pids)
                t0 = time.perf_counter()
                kinds[kind]()
                walls[kind].append((time.perf_counter() - t0) * 1e3)
                for g, v in delta(before, snapshot(pids)).items():
                    groups[kind].setdefault(g, []).append(v)
        print(f"{args.samples} samples of {args.size} MiB each, medians per transfer; "
              f"load {os.getloadavg()[0]:.1f}")
        print(f"{'transfer':22s} {'thread(s)':20s} {'run ms':>7s} {'queued ms':>9s} "
              f"{'vol sw':>7s} {'invol sw':>8s}")
        for kind in kinds:
            wall = statistics.median(walls[kind])
            gbs = sizes.contig_bytes / wall / 1e6
            print(f"{kind:22s} {'wall':20s} {wall:7.1f}  ({gbs:.2f} GB/s)")
            total = 0.0
            for g in sorted(groups[kind]):
                cols = [statistics.median(c) for c in zip(*groups[kind][g], strict=True)]
                total += cols[0]
                print(f"{'':22s} {g:20s} {cols[0]:7.1f} {cols[1]:9.1f} {cols[2]:7.1f} "
                      f"{cols[3]:8.1f}")
            print(f"{'':22s} {'CPU, all of them':20s} {total:7.1f}")
    finally:
        puller.close()
        plain.close()
        stop_owner(proc, conn)


if __name__ == "__main__":
    main()
