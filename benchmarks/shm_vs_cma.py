#!/usr/bin/env python3
"""Shared memory or cross-memory attach: the measurement behind the core's ``shm::Pays``.

``python benchmarks/shm_vs_cma.py [SPAN_BYTES,...] [SPAN_COUNTS,...]``: a forked child holds a
memfd (as datadist's pools and ``shared_empty`` allocate it) and a numpy array; the parent
copies N random spans of L bytes out of it three ways, interleaved, medians of 7:

* shm: memmove per span from our read-only mapping of the child's memfd (``local_copy``);
* cma_memfd: ``process_vm_readv`` of the same spans of the memfd (``vm_copy``);
* cma_numpy: ``process_vm_readv`` of the numpy array (transparent huge pages): the reference.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from datadist.core.layout import make_iov
from datadist.core.local import local_copy, vm_copy
from datadist.memory.pool import map_shared, shareable_map

TOTAL = 256 << 20
SIZE = TOTAL * 5 // 4


def _aligned(n: int) -> np.ndarray:
    raw = np.empty(n + 4096, np.uint8)
    off = (-raw.ctypes.data) % 4096
    return raw[off : off + n]


def _child(conn: Any) -> None:
    m = shareable_map("bench", SIZE)
    np.ctypeslib.as_array((ctypes.c_uint8 * SIZE).from_address(m.addr)).fill(3)
    b = _aligned(SIZE)
    b.fill(4)
    conn.send((os.getpid(), m.fd, m.addr, b.ctypes.data, m.backing))
    conn.recv()


def main() -> None:
    ctx = mp.get_context("fork")
    here, there = ctx.Pipe()
    child = ctx.Process(target=_child, args=(there,))
    child.start()
    pid, fd, maddr, naddr, backing = here.recv()
    f = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY)
    mine = map_shared(f, SIZE, writable=False)
    os.close(f)
    dst = _aligned(SIZE)
    dst.fill(0)
    rng = np.random.default_rng(1)
    lengths = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else
                                "4096,16384,32768,65536").split(",")]
    counts = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "256,1024,8192").split(",")]
    print(f"memfd on {backing} pages")
    for size in lengths:
        for want in counts:
            n = min(want, TOTAL // size)
            blocks = SIZE // size
            src = rng.permutation(blocks)[:n].astype(np.uint64) * np.uint64(size)
            dsto = rng.permutation(blocks)[:n].astype(np.uint64) * np.uint64(size)
            ln = np.full(n, size, np.uint64)
            local = make_iov(dst.ctypes.data + dsto, ln)
            ways: dict[str, Callable[[], None]] = {
                "shm": partial(local_copy, local, make_iov(mine + src, ln)),
                "cma_memfd": partial(vm_copy, pid, local, make_iov(maddr + src, ln)),
                "cma_numpy": partial(vm_copy, pid, local, make_iov(naddr + src, ln)),
            }
            times: dict[str, list[float]] = {k: [] for k in ways}
            for fn in ways.values():
                fn()
            for _ in range(7):
                for k, fn in ways.items():
                    t = time.perf_counter()
                    fn()
                    times[k].append(time.perf_counter() - t)
            figs = "  ".join(f"{k} {n * size / np.median(v) / 1e9:5.2f}" for k, v in times.items())
            print(f"{n:6d} x {size >> 10:4d} KiB: {figs} GB/s", flush=True)
    here.send("quit")
    child.join()


if __name__ == "__main__":
    main()
