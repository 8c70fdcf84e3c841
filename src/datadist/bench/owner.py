"""The owner side of a run: a spawned child process that serves its caches through datadist
and the same tensors through plain sockets (the TCP and round-trip limits).

Who calls: :func:`datadist.bench.runner.run`, once per run (:func:`start_owner` blocks until
the child has set up, at most 120 s; :func:`stop_owner` until it has exited, at most 15 s).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import socket
import struct
import threading
import time
from dataclasses import asdict
from typing import Any

import numpy as np

from datadist.bench.harness import (
    BLOCKS_MODEL,
    CHUNK,
    LAYER_BLOCK,
    LAYER_BLOCKS,
    LAYERS,
    LAYERS_MODEL,
    OWNER_ID,
    SMALL_BLOCK,
    SMALL_CACHE_BLOCKS,
    SMALL_MODEL,
    BenchError,
    PythonWork,
    Sizes,
    aligned_array,
    array_at,
    fill_pattern,
    pattern_seed,
    recv_exact,
    recv_into_exact,
)
from datadist.bench.limits import serve_scatter
from datadist.bench.pools import allocate_pool_blocks, pool_blocks_bytes
from datadist.bench.tcp import register_tiny_blocks


class PlainServer:
    """The plain-socket side of the limits, in the owner process.

    A connection's first byte picks its mode: ``E`` echoes 16-byte messages (the round-trip
    limit), ``S`` answers each 8-byte count with that many bytes of the source tensors, sent
    with ``sendall`` in 4 MiB chunks (the TCP throughput limit), ``B`` sends blocks of the
    blocks cache with ``sendmsg`` (the scatter limit, :func:`.limits.serve_scatter`).
    """

    def __init__(self, tensors: list[np.ndarray], blocks: np.ndarray) -> None:
        self.tensors = tensors
        self.blocks = blocks
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            mode = recv_exact(conn, 1)
            if mode == b"E":
                buf = bytearray(16)
                while recv_into_exact(conn, buf):
                    conn.sendall(buf)
            elif mode == b"S":
                while True:
                    head = recv_exact(conn, 8)
                    if not head:
                        return
                    self._stream(conn, struct.unpack("<Q", head)[0])
            elif mode == b"B":
                serve_scatter(conn, self.blocks)
        except (OSError, BenchError):
            pass
        finally:
            conn.close()

    def _stream(self, conn: socket.socket, n: int) -> None:
        views = [t.data for t in self.tensors]  # memoryview(t)
        i = 0
        while n:
            v = views[i % len(views)]
            for off in range(0, min(n, len(v)), CHUNK):
                m = min(CHUNK, n, len(v) - off)
                conn.sendall(v[off : off + m])
                n -= m
            i += 1


def owner_main(conn: Any, sizes_dict: dict[str, int], align: str,
               mooncake: bool = False, nixl: bool = False) -> None:
    """The child: serve the caches through datadist and the plain sockets (and, with
    ``mooncake``, through a Mooncake engine: bench/mooncake.py) until told to quit. With
    ``nixl`` it serves NIXL too (with the whole-process allowance, docs/security.md): the
    runner starts such an owner for the nixl rows alone. Both run on the C++ core.

    Speaks to the parent over ``conn``: one dict with what it set up (or ``{"error": ...}``),
    then waits for ``"quit"``; ``"busy-start"`` starts a thread of Python work here and
    ``"busy-stop"`` ends it and answers (rounds, seconds) (bench/busy.py).
    """
    import datadist as llm_datadist

    try:
        sizes = Sizes(**sizes_dict)
        dd = llm_datadist.LLMDataDist(llm_datadist.LLMRole.PROMPT, OWNER_ID)
        cfg = llm_datadist.LLMConfig()
        cfg.listen_ip_info = "127.0.0.1:0"
        cfg.local_comm_res = ""
        cfg.enable_remote_cache_accessible = True  # the layer-wise push row writes into it
        if nixl:
            # The NIXL rows: serving NIXL is opt-in, and a bench on one host runs UCX over
            # transports that check no memory key; its own processes trust each other.
            cfg.nixl_serve = True
            cfg.nixl_allow_whole_process_access = True
        cfg.host_mem_pool_cfg = json.dumps(
            {"memory_size": sizes.pool_bytes + pool_blocks_bytes(sizes)})
        dd.init(cfg.generate_options())
        cm = dd.cache_manager
        host = llm_datadist.Placement.HOST
        u8 = llm_datadist.DataType.DT_UINT8

        tensors = [aligned_array(sizes.tensor_bytes, align) for _ in range(sizes.contig_tensors)]
        for t, arr in enumerate(tensors):
            fill_pattern(arr, pattern_seed(1, t))
        contig_desc = llm_datadist.CacheDesc(sizes.contig_tensors, [1, sizes.tensor_bytes], u8,
                                             host)
        contig = cm.register_cache(contig_desc, [a.ctypes.data for a in tensors])

        blocks = aligned_array(sizes.cache_blocks * sizes.block_bytes, align)
        fill_pattern(blocks, pattern_seed(2, 0))
        blocks_desc = llm_datadist.CacheDesc(1, [sizes.cache_blocks, sizes.block_bytes], u8, host)
        cm.register_blocks_cache(blocks_desc, [blocks.ctypes.data],
                                 llm_datadist.BlocksCacheKey(OWNER_ID, BLOCKS_MODEL))

        small = aligned_array(SMALL_CACHE_BLOCKS * SMALL_BLOCK, align)
        fill_pattern(small, pattern_seed(3, 0))
        small_desc = llm_datadist.CacheDesc(1, [SMALL_CACHE_BLOCKS, SMALL_BLOCK], u8, host)
        small_cache = cm.register_blocks_cache(small_desc, [small.ctypes.data],
                                               llm_datadist.BlocksCacheKey(OWNER_ID, SMALL_MODEL))

        layers = aligned_array(2 * LAYERS * LAYER_BLOCKS * LAYER_BLOCK, align)
        fill_pattern(layers, pattern_seed(5, 0))
        layers_desc = llm_datadist.CacheDesc(2 * LAYERS, [LAYER_BLOCKS, LAYER_BLOCK], u8, host)
        cm.register_blocks_cache(layers_desc, [layers.ctypes.data + t * LAYER_BLOCKS * LAYER_BLOCK
                                               for t in range(2 * LAYERS)],
                                 llm_datadist.BlocksCacheKey(OWNER_ID, LAYERS_MODEL))

        pooled = cm.allocate_cache(contig_desc)
        for t, addr in enumerate(pooled.tensor_addrs):
            fill_pattern(array_at(addr, sizes.tensor_bytes), pattern_seed(4, t))

        register_tiny_blocks(llm_datadist, cm, blocks)
        allocate_pool_blocks(llm_datadist, cm, sizes)
        server = PlainServer(tensors, blocks)
        listen = dd.listen_address
        assert listen is not None
        peer: dict[str, Any] = {}
        if mooncake:
            from datadist.bench import mooncake as mc

            try:  # kept alive (peer["engine"]) until this process exits
                peer["engine"], peer["mooncake_port"] = mc.serve([*tensors, blocks, small])
            except Exception as e:  # the parent says why its rows cannot run
                peer["mooncake_error"] = f"{type(e).__name__}: {e}"
        conn.send({
            **{k: v for k, v in peer.items() if k != "engine"},
            "pid": os.getpid(),
            "port": listen[1],
            "plain_port": server.port,
            "contig_id": contig.cache_id,
            "contig_addrs": [a.ctypes.data for a in tensors],
            "blocks_addr": blocks.ctypes.data,
            "small_addr": small.ctypes.data,
            "small_id": small_cache.cache_id,  # the C++ driver's pulls name it (bench/cpp.py)
            "pool_id": pooled.cache_id,
            "pool_addrs": list(pooled.tensor_addrs),
        })
    except BaseException as e:  # the parent reports it; a traceback in a child is lost
        import traceback

        conn.send({"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"})
        return
    work: PythonWork | None = None
    try:
        while (msg := conn.recv()) != "quit":
            if msg == "busy-start":  # the busy rows (bench/busy.py): Python work beside us
                work = PythonWork().start()
            elif msg == "busy-stop" and work is not None:
                conn.send(work.stop())
                work = None
    except EOFError:
        pass
    finally:
        dd.finalize()


def start_owner(sizes: Sizes, align: str, mooncake: bool = False,
                nixl: bool = False) -> tuple[Any, Any, dict[str, Any]]:
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=owner_main, args=(there, asdict(sizes), align, mooncake, nixl),
                       name="datadist-bench-owner", daemon=True)
    proc.start()
    there.close()
    deadline = time.monotonic() + 120
    while not here.poll(0.2):
        if not proc.is_alive() or time.monotonic() > deadline:
            proc.kill()
            raise BenchError(f"the owner process did not start (exit code {proc.exitcode})")
    try:
        info = here.recv()
    except EOFError:
        proc.join(5)
        raise BenchError(f"the owner process died (exit code {proc.exitcode})") from None
    if "error" in info:
        proc.join(5)
        raise BenchError(f"the owner process failed:\n{info['error']}")
    return proc, here, info


def stop_owner(proc: Any, conn: Any) -> None:
    with contextlib.suppress(OSError):  # the owner may be gone already
        conn.send("quit")
    proc.join(10)
    if proc.is_alive():
        proc.kill()
        proc.join(5)
    conn.close()
