"""The ``datadist`` command: ``demo`` (the main job), ``bench``, ``info``.

``datadist demo`` starts a PROMPT process and a DECODER (this process) on this host, moves
real caches between them through the public API (``import datadist as llm_datadist``), checks
every byte and prints what moved and how fast, on each data path.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from typing import Any

import numpy as np

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
    except BaseException as e:  # forward the failure to the parent
        import traceback

        conn.send(("error", traceback.format_exc(), None, None))
        raise SystemExit(1) from e


def _view(addr: int, shape: tuple[int, ...]) -> np.ndarray:
    import ctypes

    n = int(np.prod(shape))
    buf = (ctypes.c_uint16 * n).from_address(addr)
    return np.frombuffer(buf, dtype=np.float16).reshape(shape)


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
            raise SystemExit(f"link_clusters failed: {code} {codes}")
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
        raise SystemExit("PROMPT did not start within 60 s")
    status, address, blocks_src, contig_src = parent.recv()
    if status != "ready":
        proc.join(5)
        raise SystemExit(f"PROMPT failed:\n{address}")
    return proc, parent, address, blocks_src, contig_src


def cmd_demo(args: argparse.Namespace) -> int:
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


def cmd_info(args: argparse.Namespace) -> int:
    import datadist
    from datadist.core.links import HostIdentity, forced_path
    from datadist.transport.iov import IOV_MAX, CmaRefused, make_iov, vm_copy

    ident = HostIdentity.current()
    print(f"datadist {datadist.__version__}")
    print(f"host: boot_id={ident.boot_id.hex()} pid_ns={ident.pid_ns} pid={ident.pid}")
    print(f"IOV_MAX={IOV_MAX}")
    try:
        print(f"forced transport: {forced_path(None).value} "
              f"(DATADIST_TRANSPORT={os.environ.get('DATADIST_TRANSPORT', '')!r})")
    except Exception as e:  # noqa: BLE001 - report, do not crash
        print(f"forced transport: invalid ({e})")
    src = np.arange(4096, dtype=np.uint8)
    dst = np.zeros(4096, dtype=np.uint8)
    try:
        vm_copy(os.getpid(), make_iov(np.array([dst.ctypes.data], np.uint64),
                                      np.array([4096], np.uint64)),
                make_iov(np.array([src.ctypes.data], np.uint64), np.array([4096], np.uint64)))
        print("cross-memory attach (process_vm_readv): available")
    except CmaRefused as e:
        print(f"cross-memory attach: refused ({e}); same-host links fall back to tcp")
    _info_nixl()
    if args.peer:
        from datadist.core.engine import Engine, EngineConfig
        from datadist.transport.tcp import parse_host_port

        host, port = parse_host_port(args.peer)
        eng = Engine(EngineConfig(cluster_id=args.own_id, role=2, transport=args.transport))
        try:
            link = eng.link(args.cluster_id, host, port, 3.0)
            print(f"link to cluster {args.cluster_id} at {host}:{port}: "
                  f"path={link.path_name} ({link.reason})")
        finally:
            eng.close()
    return 0


def _info_nixl() -> None:
    """The NIXL data path: installed or not, and which backends NIXL offers here."""
    from datadist.transport import nixl

    module = nixl.available()
    if module is None:
        print("nixl: not installed (pip install 'datadist[nixl]' for the NIXL data path)")
        return
    try:
        plugins = nixl.plugins()
    except Exception as e:  # noqa: BLE001 - report, do not crash
        print(f"nixl: {module} installed but unusable ({e})")
        return
    ucx = "UCX available" if nixl.BACKEND in plugins else "no UCX backend: unusable"
    print(f"nixl: {module}, backends {', '.join(plugins)} ({ucx}; transport=nixl uses "
          f"{nixl.BACKEND})")


def cmd_bench(argv: list[str]) -> int:
    from datadist import bench

    return bench.main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["demo"] and "--llm" in argv:
        # The transformer demo has its own options (some share names with the main demo's).
        from datadist.demos import llm

        rest = [a for a in argv[1:] if a != "--llm"]
        return llm.main(rest)
    if argv[:1] == ["bench"]:
        # The benchmark parses its own options (--help included); an argparse REMAINDER
        # would not take the ones that start with a dash.
        return cmd_bench(argv[1:])
    parser = argparse.ArgumentParser(prog="datadist", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    demo = sub.add_parser("demo", help="a PROMPT and a DECODER on this host, moving real caches")
    demo.add_argument("--layers", type=int, default=8)
    demo.add_argument("--blocks", type=int, default=512, help="blocks per paged cache")
    demo.add_argument("--seq", type=int, default=512, help="tokens per request")
    demo.add_argument("--batch", type=int, default=4, help="requests (batch slots)")
    demo.add_argument("--transport", nargs="+", default=["auto", "tcp"],
                      choices=["auto", "tcp", "cma"],
                      help="data paths to run, one PROMPT process each")
    demo.add_argument("--llm", action="store_true",
                      help="the transformer demo instead (needs the [llm] extra); its own "
                           "options follow, see `datadist demo --llm --help`")
    demo.set_defaults(fn=cmd_demo)
    info = sub.add_parser("info", help="this host's data paths; with --peer, which path a link "
                                       "uses and why")
    info.add_argument("--peer", help="ip:port of a datadist listener")
    info.add_argument("--cluster-id", type=int, default=1)
    info.add_argument("--own-id", type=int, default=2**63 - 1)
    info.add_argument("--transport", choices=["auto", "tcp", "cma", "shm", "nixl"],
                      help="force the link's path (default: DATADIST_TRANSPORT, else auto)")
    info.set_defaults(fn=cmd_info)
    # listed for --help; main() hands `bench ...` to the benchmark's own parser
    sub.add_parser("bench", help="the benchmark: every data path against its limit (see "
                                 "`datadist bench --help`)")
    args = parser.parse_args(argv)
    return int(args.fn(args))


if __name__ == "__main__":
    raise SystemExit(main())
