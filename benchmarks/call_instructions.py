"""Instructions per pull call, counted by callgrind: the per-call cost of the Python API on
a shared, noisy machine, where wall-clock figures drift by tens of percent and instruction
counts do not (issue 23's per-call goals; docs/performance.md, "Per-call cost").

    python benchmarks/call_instructions.py                 # every case, both transports
    python benchmarks/call_instructions.py --case small --transport tcp

For each case the puller (this process, re-run under ``valgrind --tool=callgrind``) makes
``--warm`` pulls and then ``--calls`` more inside one ``functools.reduce``; callgrind collects
only in that C function (``--toggle-collect=functools_reduce``, which counts the thread that
entered it: the caller's), so the count divided by ``--calls`` is what one call costs the
calling thread (Python, the binding, the core's user-space code; not the kernel's work, not
the core's other threads, nor the owner, a child process not under valgrind that runs on
the core too).

Cases: ``small`` (pull_blocks of one 16 KiB block by BlocksCacheKey, 64 block pairs in
turn, as the bench's latency rows), ``slot`` (pull_cache by CacheKeyByIdAndIndex of one
16 KiB slot), ``key`` (pull_cache by CacheKey), ``layer`` (pull_blocks of 4 blocks of one
layer with layer ranges, 8 layers in turn), ``async`` (pull_blocks_async of one block, then
wait on its handle).

With ``--leased`` the same-host puller runs with ``benchmarks/pidfd_shim.c`` preloaded
(compiled here with ``cc``): valgrind 3.19 has no ``pidfd_open``, so without it the core
finds no way to watch the owner, takes no whole-cache lease, and the same-host figures are
those of the granted / streamed path (a round trip to the owner a pull), not the leased copy
every same-host pull takes outside valgrind. The shim answers ``pidfd_open`` with a pipe
nobody writes (a live owner to ``poll``); the user-space instructions counted are the leased
path's. Figures before round 13 were taken without it.

Who runs it: a person, by hand (docs/performance.md); nothing imports it. Needs valgrind.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Any

OWNER_ID, PULLER_ID = 71, 72
SMALL_MODEL, LAYERS_MODEL = 5, 6
BLOCK = 16 << 10
BLOCKS = 64
LAYERS, LAYER_BLOCKS = 8, 4
CASES = ("small", "slot", "key", "layer", "async")


def _owner() -> None:
    """The child: serve a small blocks cache, a layers cache and a contiguous cache with
    keys until stdin closes; print what the puller needs as one JSON line."""
    import numpy as np

    import datadist as ll

    dd = ll.LLMDataDist(ll.LLMRole.PROMPT, OWNER_ID)
    cfg = ll.LLMConfig()
    cfg.listen_ip_info = "127.0.0.1:0"
    cfg.local_comm_res = ""
    dd.init(cfg.generate_options())
    cm, u8, host = dd.cache_manager, ll.DataType.DT_UINT8, ll.Placement.HOST
    small = np.arange(BLOCKS * BLOCK, dtype=np.uint8)
    cm.register_blocks_cache(ll.CacheDesc(1, [BLOCKS, BLOCK], u8, host), [small.ctypes.data],
                             ll.BlocksCacheKey(OWNER_ID, SMALL_MODEL))
    layers = [np.zeros(LAYER_BLOCKS * BLOCK, dtype=np.uint8) for _ in range(2 * LAYERS)]
    cm.register_blocks_cache(ll.CacheDesc(2 * LAYERS, [LAYER_BLOCKS, BLOCK], u8, host),
                             [a.ctypes.data for a in layers],
                             ll.BlocksCacheKey(OWNER_ID, LAYERS_MODEL))
    slots = np.zeros(4 * BLOCK, dtype=np.uint8)
    contig = cm.register_cache(ll.CacheDesc(1, [4, BLOCK], u8, host), [slots.ctypes.data],
                               [ll.CacheKey(OWNER_ID, req_id=r) for r in range(4)])
    listen = dd.listen_address
    assert listen is not None
    print(json.dumps({"port": listen[1], "contig_id": contig.cache_id}), flush=True)
    sys.stdin.read()
    dd.finalize()


def _puller(case: str, transport: str, port: int, contig_id: int, warm: int,
            calls: int) -> None:
    """The measured side: link, ``warm`` pulls, then ``calls`` pulls of ``case``."""
    import numpy as np

    import datadist as ll

    dd = ll.LLMDataDist(ll.LLMRole.DECODER, PULLER_ID)
    cfg = ll.LLMConfig()
    cfg.local_comm_res = ""
    cfg.transport = transport
    cfg.sync_kv_timeout = 600000
    cfg.enable_remote_cache_accessible = False  # pulls by CacheKey too
    dd.init(cfg.generate_options())
    cm, u8, host = dd.cache_manager, ll.DataType.DT_UINT8, ll.Placement.HOST
    small = np.zeros(BLOCKS * BLOCK, dtype=np.uint8)
    small_c = cm.register_blocks_cache(ll.CacheDesc(1, [BLOCKS, BLOCK], u8, host),
                                       [small.ctypes.data])
    layers = [np.zeros(LAYER_BLOCKS * BLOCK, dtype=np.uint8) for _ in range(2 * LAYERS)]
    layers_c = cm.register_blocks_cache(ll.CacheDesc(2 * LAYERS, [LAYER_BLOCKS, BLOCK], u8,
                                                     host), [a.ctypes.data for a in layers])
    slots = np.zeros(4 * BLOCK, dtype=np.uint8)
    slot_c = cm.register_cache(ll.CacheDesc(1, [4, BLOCK], u8, host), [slots.ctypes.data])
    cluster = ll.LLMClusterInfo()
    cluster.remote_cluster_id = OWNER_ID
    cluster.append_local_ip_info("127.0.0.1", 0)
    cluster.append_remote_ip_info("127.0.0.1", port)
    code, _ = dd.link_clusters([cluster], 600000)
    assert code == ll.LLMStatusCode.LLM_SUCCESS, code
    bkey = ll.BlocksCacheKey(OWNER_ID, SMALL_MODEL)
    lkey = ll.BlocksCacheKey(OWNER_ID, LAYERS_MODEL)
    idkey = ll.CacheKeyByIdAndIndex(OWNER_ID, contig_id, 1)
    ckey = ll.CacheKey(OWNER_ID, req_id=2)
    blocks = list(range(LAYER_BLOCKS))
    ranges = [range(i, i + 1) for i in range(LAYERS)]

    def one(i: int) -> None:
        if case == "small":
            cm.pull_blocks(bkey, small_c, [i % BLOCKS], [(i * 7) % BLOCKS])
        elif case == "slot":
            cm.pull_cache(idkey, slot_c, i % 4)
        elif case == "key":
            cm.pull_cache(ckey, slot_c, i % 4)
        elif case == "layer":
            r = ranges[i % LAYERS]
            cm.pull_blocks(lkey, layers_c, blocks, blocks, src_layer_range=r,
                           dst_layer_range=r)
        else:
            h = cm.pull_blocks_async(bkey, small_c, [i % BLOCKS], [(i * 7) % BLOCKS])
            h.wait()
            assert h.done()

    for i in range(warm):
        one(i)
    functools.reduce(lambda _, i: one(i), range(warm, warm + calls), None)
    dd.finalize()


def _instructions(out: str) -> int:
    total = 0
    for name in os.listdir(out):
        with open(os.path.join(out, name)) as f:
            for line in f:
                m = re.match(r"summary: (\d+)", line) or re.match(r"totals: (\d+)", line)
                if m:
                    total += int(m.group(1))
                    break
    return total


def _shim(out: str) -> str:
    """benchmarks/pidfd_shim.c compiled into ``out``; its path."""
    so = os.path.join(out, "pidfd_shim.so")
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pidfd_shim.c")
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", so, src, "-ldl"], check=True)
    return so


def _measure(case: str, transport: str, owner: dict[str, Any], warm: int,
             calls: int, keep: str | None = None, preload: str | None = None) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = keep or tmp
        cmd = ["valgrind", "--tool=callgrind", "--trace-children=no", "--collect-atstart=no",
               "--toggle-collect=functools_reduce", f"--callgrind-out-file={out}/cg.%p",
               sys.executable, __file__, "--puller", case, "--transport", transport,
               "--port", str(owner["port"]), "--contig-id", str(owner["contig_id"]),
               "--warm", str(warm), "--calls", str(calls)]
        env = dict(os.environ, PYTHONHASHSEED="0")
        if preload and transport == "auto":
            env["LD_PRELOAD"] = preload
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        return _instructions(out) / calls


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", choices=CASES, action="append")
    ap.add_argument("--transport", choices=("auto", "tcp"), action="append")
    ap.add_argument("--warm", type=int, default=200)
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--leased", action="store_true",
                    help="same host: preload benchmarks/pidfd_shim.c so that valgrind runs "
                         "the leased path")
    ap.add_argument("--keep", metavar="DIR",
                    help="keep callgrind's output in DIR (callgrind_annotate --inclusive=yes "
                         "DIR/cg.* breaks a call down by function)")
    ap.add_argument("--owner", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--puller", choices=CASES, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--contig-id", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.owner:
        _owner()
        return 0
    if a.puller:
        _puller(a.puller, a.transport[0], a.port, a.contig_id, a.warm, a.calls)
        return 0
    shim_dir = tempfile.TemporaryDirectory()
    preload = _shim(shim_dir.name) if a.leased else None
    child = subprocess.Popen([sys.executable, __file__, "--owner"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        owner = json.loads(child.stdout.readline())
        for transport in a.transport or ["auto", "tcp"]:
            for case in a.case or list(CASES):
                keep = None
                if a.keep:
                    keep = os.path.join(a.keep, f"{case}-{transport}")
                    os.makedirs(keep, exist_ok=True)
                per = _measure(case, transport, owner, a.warm, a.calls, keep, preload)
                where = "same host" if transport == "auto" else "TCP"
                print(f"{case:6} {where:9} {per:10.0f} instructions per call", flush=True)
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(30)
        shim_dir.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
