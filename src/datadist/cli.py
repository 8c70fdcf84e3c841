"""The ``datadist`` command: ``demo`` (the main job), ``bench``, ``info``, ``probe``.

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
from collections.abc import Callable
from typing import Any

import numpy as np

from datadist.argparsing import OneLineParser

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
        conn.send(("error", _one_line(e), None, None))
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
        engine = "native (C++ core)" if getattr(d.engine, "native", False) else "python"
        print(f"  engine: {engine}; link to cluster {PROMPT_ID}: path={link.path_name} "
              f"({link.reason})")
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
    from datadist.core.config import HostIdentity, forced_path
    from datadist.core.layout import make_iov
    from datadist.core.local import IOV_MAX, CmaRefused, vm_copy

    ident = HostIdentity.current()
    print(f"datadist {datadist.__version__}")
    _info_native()
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
    _info_engine()
    _info_nixl()
    if args.peer:
        _info_peer(args)
    return 0


def _info_engine() -> None:
    """The engine LLMDataDist.init gets here (the native core, the only one), for a
    configuration from this environment's settings (DATADIST_TRANSPORT, TLS,
    checksums, NIXL serving), or why it would refuse that configuration."""
    from datadist.api.llm_datadist import _secret, _tls
    from datadist.core import native
    from datadist.core.config import EngineConfig

    try:
        config = EngineConfig(cluster_id=1, role=2, transport=os.environ.get("DATADIST_TRANSPORT"),
                              secret=_secret({}), tls=_tls({}),
                              verify=os.environ.get("DATADIST_VERIFY_CHECKSUM", "") == "1",
                              nixl_serve=os.environ.get("DATADIST_NIXL_SERVE") == "1")
    except Exception as e:  # noqa: BLE001 - report, do not crash
        print(f"engine: cannot tell ({e})")
        return
    ok, why = native.available()
    if not ok:
        print(f"engine: none here: the native core is not available ({why}); "
              "docs/native-build.md")
        return
    refused = native.refusal(config)
    if refused is None:
        print("engine: native, the only one (the C++ core serves and moves bytes without the "
              "GIL, on every path: tcp, the local channel's cma / shm, NIXL)")
    else:
        print(f"engine: native, but init would refuse this configuration: {refused}")
    has_tls, what = native.tls_available()
    print(f"core TLS: {what}" if has_tls else
          f"core TLS: none, TLS configurations are refused ({what})")


def _info_peer(args: argparse.Namespace) -> None:
    """Link to ``--peer`` as a pull would, with the engine this host's configuration gets
    (``native.engine_for``: the core under auto; the same secret, TLS and transport settings
    from the environment), and say which path the pull will take and why, and the peer's
    metrics (STATS). Each step (link, the path probe, STATS) blocks <= ``--timeout``;
    CliError for what fails."""
    from datadist.api.llm_datadist import _secret, _tls
    from datadist.api.status import LLMException
    from datadist.core import native
    from datadist.core.address import format_host_port, parse_host_port
    from datadist.core.config import EngineConfig
    from datadist.core.errors import DatadistError

    try:
        host, port = parse_host_port(args.peer)
        if args.own_id == args.cluster_id:
            raise CliError(f"--own-id and --cluster-id are both {args.cluster_id}: a link "
                           "needs two clusters")
        eng = native.engine_for(EngineConfig(
            cluster_id=args.own_id, role=2, transport=args.transport,
            secret=_secret({}), tls=_tls({}),
            nixl_whole_process=os.environ.get("DATADIST_NIXL_ALLOW_WHOLE_PROCESS_ACCESS") == "1"))
    except (DatadistError, LLMException) as e:
        raise CliError(f"--peer {args.peer!r}: {e}") from None
    try:
        try:
            eng.link(args.cluster_id, host, port, args.timeout)
            path, reason = _first_pull_path(eng, args.cluster_id, args.timeout)
        except DatadistError as e:
            raise CliError(f"cannot link to cluster {args.cluster_id} at "
                           f"{format_host_port(host, port)}: {e}") from None
        print(f"link to cluster {args.cluster_id} at {format_host_port(host, port)}: "
              f"path={path} ({reason})")
        try:
            stats = eng.peer_stats(args.cluster_id, args.timeout)
        except DatadistError as e:  # an older peer, or another implementation
            print(f"peer metrics: not available ({e})")
        else:
            print("\n".join(metrics_lines(stats)))
    finally:
        eng.close()


def _first_pull_path(eng: Any, cluster_id: int, timeout: float) -> tuple[str, str]:
    """The path (and why) the first pull on ``eng``'s link to ``cluster_id`` will take: the
    link's, unless the kernel refuses cross-memory attach to the owner, which the core learns
    at a first pull (asked now, as it asks then). Blocks <= timeout (the core waits for the
    link)."""
    eng.probe_cma(cluster_id, timeout)
    link = eng.get_link(cluster_id)
    return str(link.path_name), str(link.reason)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds == float("inf"):
        return "> 100 s"
    return f"{seconds * 1e6:.0f} us" if seconds < 1e-3 else f"{seconds * 1e3:.1f} ms"


ROLE_NAMES = {1: "PROMPT", 2: "DECODER", 3: "MIX"}  # LLMRole's values, as Engine.stats has them


def metrics_lines(stats: dict[str, Any]) -> list[str]:
    """``datadist info``'s view of a process's metrics (a peer's ``Engine.stats()``).

    ``serve_lease`` counts whole-cache leases granted to same-host readers: the reads under
    a lease copy the owner's memory without asking it, so only the reader counts them (its
    ``pull`` rows); the owner's line says so instead of "0 bytes"."""
    role = stats.get("role")
    out = [f"peer metrics: cluster {stats.get('cluster_id')}, role "
           f"{ROLE_NAMES.get(role, role) if isinstance(role, int) else role}"]

    def line(name: str, m: dict[str, Any]) -> str:
        errors = ", ".join(f"{k} x{v}" for k, v in sorted(m.get("errors", {}).items()))
        failed = f"; failed: {errors}" if errors else ""
        if name.startswith("serve_lease"):
            return (f"  {name}: {m.get('transfers', 0)} leases granted (the reads under a "
                    "lease go to the owner's memory directly: the reader counts their "
                    f"transfers and bytes, the owner cannot){failed}")
        return (f"  {name}: {m.get('transfers', 0)} transfers, {m.get('bytes', 0):,} bytes, "
                f"p50 <= {_duration(m.get('p50_s'))}, p99 <= {_duration(m.get('p99_s'))}"
                + failed)

    total = stats.get("total") or {}
    if not total:
        out.append("  no transfers yet")
    for op, m in sorted(total.items()):
        out.append(line(op, m))
    for cid, ops in sorted((stats.get("links") or {}).items()):
        for op, m in sorted(ops.items()):
            out.append(line(f"{op} with cluster {cid}", m))
    return out


def _info_native() -> None:
    """The native core (datadist._core): built or not, and how it was built."""
    from datadist.core import native_build

    ok, what = native_build.native_available()
    if not ok:
        print(f"native core: not available ({what})")
        return
    info = native_build.build_info()
    print(f"native core: built, {what}: " +
          ", ".join(f"{key} {value}" for key, value in sorted(info.items())))


def _info_nixl() -> None:
    """The NIXL data path: installed or not, which backends NIXL offers here, and the C API
    library the core loads."""
    from datadist.core import nixl_wheel as nixl

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
    lib = nixl.library()
    print(f"nixl C API: {lib} (the core drives NIXL through it)" if lib else
          f"nixl C API: {nixl.CAPI} not found beside {module}: the core cannot use NIXL")
    serve = os.environ.get("DATADIST_NIXL_SERVE", "")
    whole = os.environ.get("DATADIST_NIXL_ALLOW_WHOLE_PROCESS_ACCESS", "") == "1"
    print("nixl serving: " + ("on" if serve == "1" else "off") +
          f" (DATADIST_NIXL_SERVE={serve!r}, or the option datadist.NixlServe; needs "
          "enable_remote_cache_accessible)")
    unchecked = nixl.unchecked_transports()
    print("nixl transports: " + (
        "RDMA verbs only (UCX_TLS): memory keys checked by the NIC, but UCX's software RMA "
        "still answers any address" if unchecked is None else f"keys UNCHECKED ({unchecked})")
        + ": a NIXL peer can reach the whole process; serving NIXL is "
        + ("ALLOWED (DATADIST_NIXL_ALLOW_WHOLE_PROCESS_ACCESS=1)" if whole else
           "refused unless datadist.NixlAllowWholeProcessAccess is set"))


def cmd_probe(args: argparse.Namespace) -> int:
    """``datadist probe HOST:PORT``: one line, what a link there would meet (datadist/probe.py)."""
    from datadist.api.status import LLMException
    from datadist.core.errors import DatadistError
    from datadist.probe import main_args

    try:
        found = main_args(args.peer, args.cluster_id, args.own_id, args.timeout)
    except (DatadistError, LLMException) as e:
        raise CliError(f"probe {args.peer!r}: {e}") from None
    print(f"{found.kind}: {found.text}")
    return 0 if found.ok else 1


def cmd_bench(argv: list[str]) -> int:
    from datadist import bench

    return bench.main(argv)


class CliError(Exception):
    """A failure the CLI reports as one line (and exit code 1), without a traceback."""


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if isinstance(e, CliError) else f"{type(e).__name__}: {text}"


def _count(lo: int, hi: int) -> Callable[[str], int]:
    """An argparse type: an int in [lo, hi]."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{value} is out of range [{lo}, {hi}]")
        return value

    parse.__name__ = "int"
    return parse


def _demo_memory_check(args: argparse.Namespace) -> None:
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


def main(argv: list[str] | None = None) -> int:
    """Run one command. Every failure is one line on stderr and a non-zero exit code
    (argument errors 2, the rest 1); DATADIST_DEBUG=1 shows the traceback as well."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("datadist: interrupted", file=sys.stderr)
        return 130
    except SystemExit:
        raise
    except Exception as e:  # noqa: BLE001 - the CLI's one place that reports errors
        if os.environ.get("DATADIST_DEBUG") == "1":
            import traceback

            traceback.print_exc()
        print(f"datadist: error: {_one_line(e)}", file=sys.stderr)
        return 1


def _version() -> str:
    from datadist import __version__

    return __version__


def _main(argv: list[str] | None = None) -> int:
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
    parser = OneLineParser(
        prog="datadist", description="datadist: the LLM-DataDist KV-cache transfer API for "
        "Linux hosts. Commands: demo (the main job), info, probe, bench.",
        epilog="Start with 'datadist demo'; 'datadist COMMAND --help' tells more.")
    parser.add_argument("--version", action="version", version=f"datadist {_version()}")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    demo = sub.add_parser("demo", help="a PROMPT and a DECODER on this host, moving real caches",
                          description="Start a PROMPT process and a DECODER (this process) on "
                          "this host, move real caches between them, check every byte and "
                          "print what moved and how fast, once per data path.")
    demo.add_argument("--layers", type=_count(1, 4096), default=8,
                      help="model layers, K and V each (default 8)")
    demo.add_argument("--blocks", type=_count(2, 1 << 24), default=512,
                      help="blocks per paged cache (at least 2: half of them are pulled)")
    demo.add_argument("--seq", type=_count(1, 1 << 24), default=512, help="tokens per request")
    demo.add_argument("--batch", type=_count(1, 4096), default=4,
                      help="requests (batch slots)")
    demo.add_argument("--transport", nargs="+", default=["auto", "tcp"],
                      choices=["auto", "tcp", "cma", "shm"],
                      help="data paths to run, one PROMPT process each (default: auto tcp; "
                           "auto is the path datadist picks by itself)")
    demo.add_argument("--llm", action="store_true",
                      help="the transformer demo instead (needs the [llm] extra); its own "
                           "options follow, see 'datadist demo --llm --help'")
    demo.set_defaults(fn=cmd_demo)
    info = sub.add_parser("info", help="this host's data paths; with --peer, which path a link "
                                       "uses and why",
                          description="Say which data paths this host offers; with --peer, link "
                          "to a running PROMPT as a pull would and say which path it takes.")
    info.add_argument("--peer", help="ip:port (or [ipv6]:port) of a datadist listener")
    info.add_argument("--cluster-id", type=_count(0, 2**64 - 1), default=1,
                      help="the peer's cluster id (default 1)")
    info.add_argument("--own-id", type=_count(0, 2**64 - 1), default=2**63 - 1,
                      help="the cluster id this probe links as (default 2**63-1; any id the "
                           "peer does not use)")
    info.add_argument("--timeout", type=float, default=3.0, help="seconds to link (3)")
    info.add_argument("--transport", choices=["auto", "tcp", "cma", "shm", "nixl"],
                      help="force the link's path (default: DATADIST_TRANSPORT, else auto)")
    info.set_defaults(fn=cmd_info)
    probe = sub.add_parser("probe", help="why a link to a listener fails (or that it would work)",
                           description="Walk a link's handshake to HOST:PORT and say where it "
                           "stops: port closed, not a datadist listener, TLS, protocol version, "
                           "cluster id, shared secret. Secret and TLS files are taken from the "
                           "environment, as a link takes them. Exit code 0 when a link would "
                           "be made, 1 otherwise.")
    probe.add_argument("peer", metavar="HOST:PORT", help="the listener's address")
    probe.add_argument("--cluster-id", type=_count(0, 2**64 - 1),
                       help="the cluster id you link to (default: any; the probe says which)")
    probe.add_argument("--own-id", type=_count(0, 2**64 - 1), default=2**63 - 1,
                       help="the cluster id the probe says it is (default 2**63-1)")
    probe.add_argument("--timeout", type=float, default=3.0, help="seconds per step (3)")
    probe.set_defaults(fn=cmd_probe)
    # listed for --help; main() hands `bench ...` to the benchmark's own parser
    sub.add_parser("bench", help="the benchmark: every data path against its limit (see "
                                 "'datadist bench --help')")
    if not argv:  # a bare 'datadist' shows what it can do instead of an error
        parser.print_help()
        return 0
    args = parser.parse_args(argv)
    if args.cmd == "demo":
        _demo_memory_check(args)
    if args.cmd in ("info", "probe") and not 0 < args.timeout <= 3600:
        parser.error(f"argument --timeout: {args.timeout} is out of range (0, 3600]")
    return int(args.fn(args))


if __name__ == "__main__":
    raise SystemExit(main())
