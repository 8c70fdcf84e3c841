"""``datadist demo``: a PROMPT process and a DECODER (this process) on this host move real
caches through the public API (``import datadist as llm_datadist``), check every byte and
print what moved and how fast, once per data path. ``demo --llm`` is datadist/demos/llm.py."""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time
from typing import Any

import numpy as np

from datadist.cli.common import CliError, count, one_line

PROMPT_ID, DECODER_ID = 1, 2
BLOCK_SIZE = 16  # tokens per block
KV_HEADS, HEAD_DIM = 8, 128


def _prompt_main(conn: Any, layers: int, num_blocks: int, seq: int, batch: int) -> None:
    """The PROMPT side: register client memory, allocate from the pool, serve until told."""
    import datadist as llm_datadist

    try:
        d = llm_datadist.LLMDataDist(llm_datadist.LLMRole.PROMPT, PROMPT_ID)
        cfg = llm_datadist.LLMConfig()
        cfg.device_id = 0
        cfg.enable_cache_manager = True
        cfg.listen_ip_info = "127.0.0.1:0"
        pool_bytes = 2 * layers * batch * seq * KV_HEADS * HEAD_DIM * 2 + (64 << 20)
        cfg.host_mem_pool_cfg = f'{{"memory_size": {pool_bytes}}}'
        d.init(cfg.generate_options())
        cm = d.cache_manager
        rng = np.random.default_rng(7)
        dt = llm_datadist.DataType.DT_FLOAT16
        host = llm_datadist.Placement.HOST
        # 1. a paged KV cache in client memory: 2 tensors (K, V) per layer
        blocks = [rng.standard_normal((num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM),
                                      dtype=np.float32).astype(np.float16)
                  for _ in range(2 * layers)]
        desc = llm_datadist.CacheDesc(2 * layers, [num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM],
                                      dt, host)
        cm.register_blocks_cache(desc, [b.ctypes.data for b in blocks],
                                 llm_datadist.BlocksCacheKey(PROMPT_ID, 0))
        # 2. request-keyed contiguous caches allocated from datadist's pool
        cdesc = llm_datadist.CacheDesc(2 * layers, [batch, seq, KV_HEADS, HEAD_DIM], dt, host)
        keys = [llm_datadist.CacheKey(PROMPT_ID, req_id=1000 + i) for i in range(batch)]
        cache = cm.allocate_cache(cdesc, keys)
        contig = []
        for addr in cache.tensor_addrs:
            view = _view(addr, (batch, seq, KV_HEADS, HEAD_DIM))
            view[...] = rng.standard_normal(view.shape, dtype=np.float32)
            contig.append(view.copy())
        conn.send(("ready", d.listen_address, blocks, contig))
        conn.recv()  # wait until the decoder is done
        d.finalize()
    except BaseException as e:  # forward the failure to the parent, as one line
        conn.send(("error", one_line(e), None, None))
        raise SystemExit(1) from e


def _view(addr: int, shape: tuple[int, ...]) -> np.ndarray:
    import ctypes

    n = int(np.prod(shape))
    buf = (ctypes.c_uint16 * n).from_address(addr)
    arr: np.ndarray = np.frombuffer(memoryview(buf), dtype=np.float16).reshape(shape)
    return arr


def _warm(shape: tuple[int, ...]) -> np.ndarray:
    """A zeroed fp16 array whose pages are already touched, as a serving engine's KV cache is
    (np.zeros maps lazily, and the first pull would time page faults, not the transfer)."""
    a = np.empty(shape, np.float16)
    a.fill(0)
    return a


def _gbps(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:6.2f} GB/s" if seconds > 0 else "   inf"


def _run_decoder(address: tuple[str, int], transport: str, layers: int, num_blocks: int,
                 seq: int, batch: int, blocks_src: list[np.ndarray],
                 contig_src: list[np.ndarray]) -> list[tuple[str, int, float, bool]]:
    import datadist as llm_datadist

    d = llm_datadist.LLMDataDist(llm_datadist.LLMRole.DECODER, DECODER_ID)
    cfg = llm_datadist.LLMConfig()
    cfg.device_id = 0
    cfg.enable_cache_manager = True
    cfg.sync_kv_timeout = 20000
    if transport != "auto":
        cfg.transport = transport
    d.init(cfg.generate_options())
    rows: list[tuple[str, int, float, bool]] = []
    try:
        cm = d.cache_manager
        info = llm_datadist.LLMClusterInfo()
        info.remote_cluster_id = PROMPT_ID
        info.append_local_ip_info("127.0.0.1", 0)
        info.append_remote_ip_info(address[0], address[1])
        code, codes = d.link_clusters([info], 5000)
        if code != llm_datadist.LLMStatusCode.LLM_SUCCESS:
            raise CliError(f"link_clusters failed: {code} {codes}")
        link = d.engine.links()[0]
        print(f"  link to cluster {PROMPT_ID}: path={link.path_name} ({link.reason})")
        dt = llm_datadist.DataType.DT_FLOAT16
        host = llm_datadist.Placement.HOST
        rng = np.random.default_rng(11)

        # pull_blocks: a request of num_blocks/2 random blocks, all layers
        dst_blocks_arr = [_warm((num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM))
                          for _ in range(2 * layers)]
        bdesc = llm_datadist.CacheDesc(2 * layers, [num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM],
                                       dt, host)
        bcache = cm.register_blocks_cache(bdesc, [b.ctypes.data for b in dst_blocks_arr])
        n = num_blocks // 2
        src = rng.choice(num_blocks, n, replace=False)
        dst = rng.choice(num_blocks, n, replace=False)
        nbytes = n * blocks_src[0][0].nbytes * 2 * layers
        t = time.perf_counter()
        cm.pull_blocks(llm_datadist.BlocksCacheKey(PROMPT_ID, 0), bcache, src.tolist(),
                       dst.tolist())
        dt_s = time.perf_counter() - t
        ok = all(np.array_equal(dst_blocks_arr[i][dst], blocks_src[i][src])
                 for i in range(2 * layers))
        rows.append((f"pull_blocks {n} random blocks x {2 * layers} tensors", nbytes, dt_s, ok))

        # pull_blocks, layer range: the second half of the layers only
        half = layers // 2 or 1
        for a in dst_blocks_arr:
            a[...] = 0
        t = time.perf_counter()
        cm.pull_blocks(llm_datadist.BlocksCacheKey(PROMPT_ID, 0), bcache, src.tolist(),
                       dst.tolist(), src_layer_range=range(layers - half, layers),
                       dst_layer_range=range(0, half))
        dt_s = time.perf_counter() - t
        ok = all(np.array_equal(dst_blocks_arr[i][dst], blocks_src[2 * (layers - half) + i][src])
                 for i in range(2 * half))
        ok = ok and not any(dst_blocks_arr[i].any() for i in range(2 * half, 2 * layers))
        rows.append((f"pull_blocks layers [{layers - half}, {layers}) -> [0, {half})",
                     n * blocks_src[0][0].nbytes * 2 * half, dt_s, ok))

        # pull_cache by CacheKey: each request's slot, once (keys are consumed)
        mine = [_warm((batch, seq, KV_HEADS, HEAD_DIM)) for _ in range(2 * layers)]
        cdesc = llm_datadist.CacheDesc(2 * layers, [batch, seq, KV_HEADS, HEAD_DIM], dt, host)
        ccache = cm.register_cache(cdesc, [m.ctypes.data for m in mine])
        t = time.perf_counter()
        for i in range(batch):
            cm.pull_cache(llm_datadist.CacheKey(PROMPT_ID, req_id=1000 + i), ccache,
                          batch_index=batch - 1 - i)
        dt_s = time.perf_counter() - t
        ok = all(np.array_equal(mine[t_][batch - 1 - i], contig_src[t_][i])
                 for t_ in range(2 * layers) for i in range(batch))
        rows.append((f"pull_cache by CacheKey, {batch} requests", mine[0].nbytes * 2 * layers,
                     dt_s, ok))
        try:
            cm.pull_cache(llm_datadist.CacheKey(PROMPT_ID, req_id=1000), ccache)
            consumed = False
        except llm_datadist.LLMException as e:
            consumed = e.status_code == llm_datadist.LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
        rows.append(("second pull of a consumed key -> LLM_KV_CACHE_NOT_EXIST", 0, 0.0, consumed))
        cm.unregister_cache(bcache.cache_id)
        cm.unregister_cache(ccache.cache_id)
        d.unlink_clusters([info], 5000)
    finally:
        d.finalize()
    return rows


def _start_prompt(layers: int, num_blocks: int, seq: int, batch: int) -> Any:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_prompt_main, args=(child, layers, num_blocks, seq, batch),
                       daemon=True)
    proc.start()
    if not parent.poll(60):
        proc.kill()
        raise CliError("the PROMPT process did not start within 60 s")
    try:
        status, address, blocks_src, contig_src = parent.recv()
    except EOFError:
        proc.join(5)
        raise CliError(f"the PROMPT process exited (code {proc.exitcode}) before it was "
                       "ready") from None
    if status != "ready":
        proc.join(5)
        raise CliError(f"the PROMPT process failed: {address}")
    return proc, parent, address, blocks_src, contig_src


def cmd_demo(args: argparse.Namespace) -> int:
    """``datadist demo``: one PROMPT process per ``--transport``, this process pulls from it;
    blocks until every path ran (a PROMPT that does not start in 60 s is a CliError). Exit
    code 0 when every byte verified, 1 otherwise."""
    layers, num_blocks, seq, batch = args.layers, args.blocks, args.seq, args.batch
    print(f"datadist demo: a PROMPT process and a DECODER (this process, pid {os.getpid()}) "
          f"on this host")
    print(f"  caches: {2 * layers} tensors ({layers} layers of K and V), fp16; paged: "
          f"{num_blocks} blocks of {BLOCK_SIZE}x{KV_HEADS}x{HEAD_DIM}; contiguous: {batch} "
          f"requests of {seq} tokens, allocated from the PROMPT's pool with req_id keys")
    all_ok = True
    for transport in args.transport:
        proc, conn, address, blocks_src, contig_src = _start_prompt(layers, num_blocks, seq,
                                                                    batch)
        try:
            print(f"\n[{transport}] PROMPT pid {proc.pid} listens on {address[0]}:{address[1]}")
            rows = _run_decoder(address, transport, layers, num_blocks, seq, batch,
                                blocks_src, contig_src)
        finally:
            conn.send("done")
            proc.join(10)
            if proc.is_alive():
                proc.kill()
        print(f"  {'what':58} {'bytes':>12} {'time':>9} {'speed':>11}  verified")
        for what, nbytes, secs, ok in rows:
            speed = _gbps(nbytes, secs) if nbytes else ""
            tm = f"{secs * 1e3:7.1f}ms" if nbytes else ""
            print(f"  {what:58} {nbytes:12,d} {tm:>9} {speed:>11}  {'yes' if ok else 'NO'}")
            all_ok &= ok
    print("\nall bytes verified" if all_ok else "\nVERIFICATION FAILED")
    return 0 if all_ok else 1


def check_memory(args: argparse.Namespace) -> None:
    """Refuse a demo whose caches (both processes) would not fit in this host's memory."""
    block = BLOCK_SIZE * KV_HEADS * HEAD_DIM * 2
    per_side = 2 * args.layers * (args.blocks * block + args.batch * args.seq * KV_HEADS
                                  * HEAD_DIM * 2)
    need = 3 * per_side  # the PROMPT's caches, the DECODER's, and the copies sent across
    try:
        have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return
    if need > have // 2:
        raise CliError(f"these demo sizes need about {need / 2**30:.1f} GiB, more than half "
                       f"of this host's {have / 2**30:.1f} GiB: use fewer --layers, --blocks, "
                       "--seq or --batch")


def add_parser(sub: Any) -> None:
    """The ``demo`` subcommand's options (``datadist --help`` lists it)."""
    demo = sub.add_parser("demo", help="a PROMPT and a DECODER on this host, moving real caches",
                          description="Start a PROMPT process and a DECODER (this process) on "
                          "this host, move real caches between them, check every byte and "
                          "print what moved and how fast, once per data path.")
    demo.add_argument("--layers", type=count(1, 4096), default=8,
                      help="model layers, K and V each (default 8)")
    demo.add_argument("--blocks", type=count(2, 1 << 24), default=512,
                      help="blocks per paged cache (at least 2: half of them are pulled)")
    demo.add_argument("--seq", type=count(1, 1 << 24), default=512, help="tokens per request")
    demo.add_argument("--batch", type=count(1, 4096), default=4,
                      help="requests (batch slots)")
    demo.add_argument("--transport", nargs="+", default=["auto", "tcp"],
                      choices=["auto", "tcp", "cma", "shm"],
                      help="data paths to run, one PROMPT process each (default: auto tcp; "
                           "auto is the path datadist picks by itself)")
    demo.add_argument("--llm", action="store_true",
                      help="the transformer demo instead (needs the [llm] extra); its own "
                           "options follow, see 'datadist demo --llm --help'")
    demo.set_defaults(fn=cmd_demo)
