"""Rows of the cost of one call: layer-wise pulls against one pull of the same bytes, the
asynchronous layer-wise forms (transfer_cache_async, against one pull and against one push of
the same bytes; per-layer pull_blocks_async issued ahead), pulls of a few hundred blocks
against raw ``process_vm_readv`` of the same iovecs, and the p99 of a small pull against the
p99 of a plain round trip (the per-call cost issue's rows).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from datadist.bench.harness import (
    LAYER_BLOCK,
    LAYER_BLOCKS,
    LAYERS,
    LAYERS_MODEL,
    OWNER_ID,
    SMALL_BLOCK,
    SMALL_CACHE_BLOCKS,
    U64,
    BenchError,
    Row,
    aligned_array,
    at_most,
    check_pattern,
    interleave,
    one_cpu,
    pattern_seed,
    throughput_row,
)
from datadist.bench.limits import RawCma, iov
from datadist.bench.puller import Context, Puller, alternate_runs, latency_row

LAYER_BYTES = 2 * LAYER_BLOCKS * LAYER_BLOCK  # K and V of one layer
# 32 per-layer pulls of 1 MiB against one pull of the same bytes (GB/s over GB/s), by path:
# issue "One engine, native" asks >= 0.95x on one host and >= 0.9x over TCP (until then both
# were 1 / 1.1: at most 1.1x the time of one pull).
PER_LAYER_GOALS = {"same host": 0.95, "TCP": 0.9}
# The asynchronous layer-wise forms (issue 37 item 2): transfer_cache_async of the 32 layers,
# and 32 per-layer pull_blocks_async issued in a row, >= 0.95x of their limit on both paths.
ASYNC_LAYERS_GOAL = 0.95
FEW_BLOCKS = {256: 0.85, 1024: 0.9}  # blocks pulled -> goal against raw process_vm_readv
CALLS = 20  # pulls per sample of the few-blocks rows: one is too short to time alone
LAYER_LOOPS = 5  # loops of 32 per-layer pulls (and of one pull) per sample of the per-layer rows


def _times(fn: Callable[[], object]) -> Callable[[], None]:
    def run() -> None:
        for _ in range(CALLS):
            fn()
    return run


def calls_rows(ctx: Context) -> list[Row]:
    rows: list[Row] = []
    for transport, where in (("auto", "same host"), ("tcp", "TCP")):
        p = ctx.puller(transport, remote_accessible=True)
        try:
            rows.append(_per_layer_row(ctx, p, where))
            if transport == "tcp":
                rows.append(_plain_per_layer_row(ctx))
            rows += _async_rows(ctx, p, where)
            rows.append(_ahead_row(ctx, p, where))
            if transport == "auto":
                rows += _few_blocks_rows(ctx, p)
                rows.append(_p99_row(ctx, p))
                rows.append(_small_vs_raw_row(ctx, p))
                rows.append(_never_seen_row(ctx, p))
        finally:
            p.close()
    return rows


def _layer_pulls(p: Puller) -> tuple[Callable[[], None], Callable[[], None]]:
    """The 32 per-layer pull_blocks and the one pull_blocks of every layer, with their
    arguments made once (the key, the block list, each layer's range), as a layer-wise
    caller makes them once a request (the same blocks every layer): the rows time datadist's
    calls, not the making of their arguments. Made per call (``Puller.pull_layer``) they cost
    a BlocksCacheKey and two block lists a layer, about 1 us: 1.5 points of the per-layer
    ratio (docs/performance.md, round 14)."""
    cm, cache = p.dd.cache_manager, _layers_cache(p)
    key = p.ll.BlocksCacheKey(OWNER_ID, LAYERS_MODEL)
    blocks = list(range(LAYER_BLOCKS))
    ranges = [range(i, i + 1) for i in range(LAYERS)]
    pull = cm.pull_blocks

    def per_layer() -> None:
        for r in ranges:
            pull(key, cache, blocks, blocks, src_layer_range=r, dst_layer_range=r)

    def every_layer() -> None:
        pull(key, cache, blocks, blocks)

    return per_layer, every_layer


def _per_layer_row(ctx: Context, p: Puller, where: str) -> Row:
    """32 per-layer pull_blocks of 1 MiB against one pull_blocks of the 32 layers. A sample is
    LAYER_LOOPS of each (about 15 ms of copies on one host): a single 3 ms loop swings by
    several percent with the machine, more than the per-call cost this row is for."""
    layers = ctx.bufs["layers"]
    per_layer, every_layer = _layer_pulls(p)
    for label, pull in (("one pull of every layer", every_layer), ("per-layer pulls", per_layer)):
        layers.fill(0)  # rule 2: what arrived is the owner's
        pull()
        check_pattern(layers, pattern_seed(5, 0), f"{where} {label}")

    def loops(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            for _ in range(LAYER_LOOPS):
                fn()
        return run

    ctx.progress.set_label(f"{where}: per-layer pulls")
    f, lim = interleave(loops(per_layer), loops(every_layer), ctx.repeat, ctx.progress)
    key = "same_host" if where == "same host" else "tcp"
    return throughput_row(
        f"{key}_per_layer", f"{LAYERS} per-layer pull_blocks of {LAYER_BYTES >> 20} MiB, "
        f"{where}", LAYER_LOOPS * LAYERS * LAYER_BYTES, p.mechanism(), f,
        f"one pull_blocks of all {LAYERS} layers", lim, PER_LAYER_GOALS[where])


def _plain_per_layer_row(ctx: Context) -> Row:
    """What a request per layer costs a plain socket, beside ``tcp_per_layer``: 32 request /
    reply exchanges of 1 MiB (8-byte count, then the bytes, ``recv_into``) against one of
    32 MiB, on the run's plain stream to the owner process. Each request drains the pipe the
    one large reply keeps full (the sender waits for the request's trip, the reader for the
    reply's last bytes), so a plain socket pays per request too; ``tcp_per_layer`` is read
    against this row's ratio. Reported, no goal. Lands in a buffer of its own: the layers
    cache holds the owner's pattern, which the push rows after it write back."""
    layers = aligned_array(LAYERS * LAYER_BYTES, "page")
    views = [layers[i * LAYER_BYTES:(i + 1) * LAYER_BYTES] for i in range(LAYERS)]

    def per_layer() -> None:
        for v in views:
            ctx.plain.receive([v], LAYER_BYTES)

    def every_layer() -> None:
        ctx.plain.receive([layers], LAYERS * LAYER_BYTES)

    per_layer()
    every_layer()
    ctx.progress.set_label("TCP: per-layer plain-socket requests")
    f, lim = interleave(per_layer, every_layer, ctx.repeat, ctx.progress)
    row = throughput_row(
        "tcp_per_layer_plain", f"plain socket: {LAYERS} request/replies of "
        f"{LAYER_BYTES >> 20} MiB, against one of {LAYERS * LAYER_BYTES >> 20} MiB",
        LAYERS * LAYER_BYTES, "tcp", f, "one request/reply of every layer's bytes", lim, 0.0)
    row.goal = "reported"
    return row


def _async_rows(ctx: Context, p: Puller, where: str) -> list[Row]:
    """transfer_cache_async of the 32 layers (a push, layer by layer), against one pull of the
    same bytes (the fastest way to move them), then against one push_blocks of all 32 layers
    (the same push in one call: what the layer loop itself costs). The puller's layers cache
    holds the owner's pattern by now (the per-layer row checked it), so the pushes write the
    owner's bytes back unchanged; checked after."""
    ctx.progress.set_label(f"{where}: transfer_cache_async")
    f, lim = interleave(p.push_layers_async, lambda: p.pull_layer(None), ctx.repeat,
                        ctx.progress)
    key = "same_host" if where == "same host" else "tcp"
    title = f"transfer_cache_async of {LAYERS} layers of {LAYER_BYTES >> 20} MiB, {where}"
    rows = [throughput_row(
        f"{key}_async_layers", title, LAYERS * LAYER_BYTES, p.mechanism(), f,
        f"one pull_blocks of all {LAYERS} layers", lim, ASYNC_LAYERS_GOAL)]
    blocks = list(range(LAYER_BLOCKS))
    cm, cache = p.dd.cache_manager, _layers_cache(p)
    owner_layers = p.ll.BlocksCacheKey(OWNER_ID, LAYERS_MODEL)

    def push_all() -> None:
        cm.push_blocks(owner_layers, cache, blocks, blocks)

    push_all()
    ctx.progress.set_label(f"{where}: transfer_cache_async against one push")
    f, lim = interleave(p.push_layers_async, push_all, ctx.repeat, ctx.progress)
    rows.append(throughput_row(
        f"{key}_async_layers_push", f"{title}, against one push", LAYERS * LAYER_BYTES,
        p.mechanism(), f, f"one push_blocks of all {LAYERS} layers", lim, ASYNC_LAYERS_GOAL))
    layers = ctx.bufs["layers"]
    layers.fill(0)
    p.pull_layer(None)
    check_pattern(layers, pattern_seed(5, 0), f"{where} pull after transfer_cache_async")
    return rows


def _ahead_row(ctx: Context, p: Puller, where: str) -> Row:
    """A layer-wise pull issued ahead (issue 37 item 2): pull_blocks_async of each of the 32
    layers issued in a row, then each waited for, against one pull_blocks of all of them.
    The issued pulls overlap (the core's workers; on one link over TCP, queued back to
    back)."""
    layers = ctx.bufs["layers"]
    blocks = list(range(LAYER_BLOCKS))
    cm, cache = p.dd.cache_manager, _layers_cache(p)
    owner_layers = p.ll.BlocksCacheKey(OWNER_ID, LAYERS_MODEL)
    ranges = [range(i, i + 1) for i in range(LAYERS)]

    def ahead() -> None:
        handles = [cm.pull_blocks_async(owner_layers, cache, blocks, blocks,
                                        src_layer_range=r, dst_layer_range=r) for r in ranges]
        for h in handles:
            h.wait()

    layers.fill(0)  # rule 2: what arrived is the owner's
    ahead()
    check_pattern(layers, pattern_seed(5, 0), f"{where} pull_blocks_async issued ahead")
    ctx.progress.set_label(f"{where}: layer-wise pulls issued ahead")
    f, lim = interleave(ahead, lambda: p.pull_layer(None), ctx.repeat, ctx.progress)
    key = "same_host" if where == "same host" else "tcp"
    return throughput_row(
        f"{key}_pull_ahead", f"{LAYERS} pull_blocks_async of {LAYER_BYTES >> 20} MiB issued "
        f"ahead, {where}", LAYERS * LAYER_BYTES, p.mechanism(), f,
        f"one pull_blocks of all {LAYERS} layers", lim, ASYNC_LAYERS_GOAL)


def _layers_cache(p: Puller) -> Any:
    """The puller's layers cache (the run's buffers have one for these rows)."""
    if p.layers is None:
        raise BenchError("no layers cache: the run's buffers have no 'layers'")
    return p.layers


def _few_blocks_rows(ctx: Context, p: Puller) -> list[Row]:
    s, info, rows = ctx.sizes, ctx.info, []
    cma = RawCma(info["pid"])
    bb = np.uint64(s.block_bytes)
    for n, goal in FEW_BLOCKS.items():
        if n > s.blocks:  # a small run: no such row (its progress steps pass)
            ctx.progress.step(n=ctx.repeat)
            continue
        src, dst = ctx.src_ids[:n], ctx.dst_ids[:n]
        raw = cma.prepare(iov(ctx.bufs["blocks"].ctypes.data + dst.astype(U64) * bb,
                              np.full(n, bb, dtype=U64)),
                          iov(info["blocks_addr"] + src.astype(U64) * bb,
                              np.full(n, bb, dtype=U64)))
        src_l, dst_l = src.tolist(), dst.tolist()
        raw()
        p.pull_blocks(src_l, dst_l)
        ctx.progress.set_label(f"same-host pull_blocks of {n} blocks")
        f, lim = interleave(_times(functools.partial(p.pull_blocks, src_l, dst_l)),
                            _times(raw), ctx.repeat, ctx.progress)
        rows.append(throughput_row(
            f"same_host_pull_blocks_{n}",
            f"same-host pull_blocks, {n} x {s.block_bytes >> 10} KiB",
            CALLS * n * s.block_bytes, p.mechanism(), f,
            "raw process_vm_readv, same iovecs", lim, goal))
    return rows


def _never_seen_row(ctx: Context, p: Puller) -> Row:
    """A server's usual small pull: every request names blocks no request named before, so
    nothing prepared for earlier ones applies (the plan, the checked iovecs). Block pairs
    are taken from a shuffled list of all 64 x 64, each once (the run makes fewer pulls);
    reported beside the plain round trip, no goal."""
    n = SMALL_CACHE_BLOCKS
    order = np.random.default_rng(7).permutation(n * n).tolist()
    row = latency_row(ctx, p, "same_host_small_new", "small pull, never-seen request, same host",
                      lambda i: p.pull_small(order[i % len(order)] // n, order[i % len(order)] % n),
                      goal=None)
    row.title = "small pull, one 16 KiB block, same host, each request new"
    return row


def _small_vs_raw_row(ctx: Context, p: Puller) -> Row:
    """The small pull against raw ``process_vm_readv`` of the very same 16 KiB (issue 37: a
    Python pull on one host <= 2x it). Both walk the 64 block pairs the small-pull rows use
    (block i % 64 into block 7i % 64: 2 MiB touched on each side), one call per sample, in
    alternating runs: a limit that copied one block over and over would keep its pages in
    the caches and the TLB, and measured so it is 2-2.5 us (about half) faster than the same
    call walking the blocks (docs/performance.md, "Where the same-host small pull's
    microseconds go")."""
    n = SMALL_CACHE_BLOCKS
    cma = RawCma(ctx.info["pid"])
    local, remote = ctx.bufs["small"].ctypes.data, ctx.info["small_addr"]
    raws = [cma.prepare(iov(np.array([local + (i * 7) % n * SMALL_BLOCK], dtype=U64),
                            np.array([SMALL_BLOCK], dtype=U64)),
                        iov(np.array([remote + i % n * SMALL_BLOCK], dtype=U64),
                            np.array([SMALL_BLOCK], dtype=U64))) for i in range(n)]
    turn = [0]

    def raw() -> None:
        raws[turn[0] % n]()
        turn[0] += 1

    ctx.progress.set_label("small pull against raw process_vm_readv")
    with one_cpu(os.getpid(), ctx.info["pid"]):
        pulls, lims = alternate_runs(ctx, lambda i: p.pull_small(i % n, (i * 7) % n), raw)
    row = Row("same_host_small_vs_raw", "small pull, one 16 KiB block, same host, p50", "us",
              float(np.median(pulls)), "raw process_vm_readv of the same 16 KiB, p50",
              float(np.median(lims)), path=p.mechanism(), figure_samples=pulls,
              limit_samples=lims)
    return at_most(row, 2.0)


def _p99_row(ctx: Context, p: Puller) -> Row:
    p50 = latency_row(ctx, p, "same_host_small_p99", "small pull, same host, p99")
    figure = float(np.percentile(p50.figure_samples, 99))
    limit = float(np.percentile(p50.limit_samples, 99))
    row = Row(p50.key, "small pull, one 16 KiB block, same host, p99", "us", figure,
              "16-byte request/reply on a plain socket, p99", limit, path=p50.path,
              figure_samples=p50.figure_samples, limit_samples=p50.limit_samples)
    return at_most(row, 3.0)
