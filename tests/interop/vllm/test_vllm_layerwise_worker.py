"""The connector's layer-wise mode between two real processes, without vLLM (always runs).

A prefill process (``_prefill``) drives a layer-wise producer the way vLLM's worker does
(``step`` at start_load_kv, ``save_layer`` per layer, ``wait_for_save``, ``poll`` at
get_finished, ``release`` when the request ends); this process is the decoder: it announces
its plan and waits for DONE. Every layer's bytes are checked where they landed.
"""

from __future__ import annotations

import multiprocessing as mp
import time

import numpy as np
import pytest

import datadist as llm_datadist
from datadist.integrations.vllm import layerwise
from datadist.integrations.vllm.layerwise import (
    LayerwiseRecvTask,
    LayerwiseRemote,
    LayerwiseStep,
)
from datadist.integrations.vllm.settings import Settings, WorkerAddress
from datadist.integrations.vllm.worker import DatadistWorker, KvLayout

pytestmark = pytest.mark.timeout(90)

BLOCKS, SHAPE, LAYERS, BLOCK_SIZE = 16, (2, 32, 8), 3, 32
TAG = "7c" * 16
PROMPT = 150  # 5 blocks, the last one partly filled
SRC = [9, 4, 11, 2, 7]  # the prefill's blocks of the prompt


def _kv(fill: float) -> tuple[list[np.ndarray], KvLayout]:
    arrs = [np.full((BLOCKS, *SHAPE), fill, np.float32) for _ in range(LAYERS)]
    return arrs, KvLayout([a.ctypes.data for a in arrs], BLOCKS, SHAPE,
                          llm_datadist.DataType.DT_FLOAT, 1)


def _prefill(addr_q, cmd_q, out_q, settings: dict) -> None:
    """Commands: ("run", plan_first, chunks, ok, saves): compute the prompt in ``chunks``
    steps (waiting first for the decoder's plan when ``plan_first``; calling save_layer
    after each layer when ``saves``), end the request, report (freed, requests pushed);
    ("refuse",); "stop" ends."""
    arrs, layout = _kv(0.0)
    w = DatadistWorker(Settings(mode="layerwise", **settings), producer=True, consumer=False)
    w.start(layout)
    lw = w.lw_producer
    assert lw is not None
    addr_q.put((w.address.host, w.address.port, w.cluster_id))
    while True:
        cmd = cmd_q.get(timeout=60)
        if cmd == "stop":
            break
        if cmd[0] == "refuse":
            lw.refuse(TAG)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                w.poll_sent()
                time.sleep(0.005)
            continue
        _, plan_first, chunks, ok, saves = cmd
        if plan_first:
            deadline = time.monotonic() + 20
            while not any(bytes(lw.inbox[s, :16]) == bytes.fromhex(TAG)
                          for s in layerwise.window(bytes.fromhex(TAG))):
                assert time.monotonic() < deadline, "no plan"
                w.poll_sent()
                time.sleep(0.005)
        done = 0
        step = -(-PROMPT // chunks)
        while done < PROMPT:
            n = min(step, PROMPT - done)
            lw.step([LayerwiseStep("p1", TAG, SRC, done, n, PROMPT, BLOCK_SIZE)])
            for layer in range(LAYERS):
                # the model writes this step's tokens of the layer, then vLLM saves it
                for t in range(done, done + n):
                    arrs[layer][SRC[t // BLOCK_SIZE], :, t % BLOCK_SIZE] = 1000 * layer + t
                if saves:
                    lw.save_layer(layer)
            lw.wait_for_save()
            w.poll_sent()
            done += n
        lw.release("p1", ok)
        freed: set[str] = set()
        deadline = time.monotonic() + 30
        while "p1" not in freed and time.monotonic() < deadline:
            freed |= w.poll_sent()
            time.sleep(0.005)
        out_q.put((sorted(freed), lw.pushed))
    w.close()


@pytest.fixture
def prefill():
    ctx = mp.get_context("spawn")
    procs = []

    def start(**settings):
        addr_q, cmd_q, out_q = ctx.Queue(), ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=_prefill, args=(addr_q, cmd_q, out_q, settings), daemon=True)
        p.start()
        procs.append(p)
        return p, addr_q.get(timeout=30), cmd_q, out_q

    yield start
    for p in procs:
        p.kill()
        p.join(5)


def _decoder(**kw) -> tuple[DatadistWorker, list[np.ndarray]]:
    arrs, layout = _kv(-1.0)
    w = DatadistWorker(Settings(mode="layerwise", **kw), producer=False, consumer=True)
    w.start(layout)
    return w, arrs


def _task(addr, local=(1, 3, 5, 7, 9), rid="d1") -> LayerwiseRecvTask:
    return LayerwiseRecvTask(rid, list(local),
                             LayerwiseRemote(TAG, [WorkerAddress(*addr)], BLOCK_SIZE))


def _wait(w: DatadistWorker, timeout: float = 30) -> tuple[set[str], set[str]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, failed = w.poll_recv()
        if done:
            return done, failed
        time.sleep(0.005)
    raise AssertionError("the layer-wise receive never ended")


def _expected(local) -> dict[int, np.ndarray]:
    """What each of the decoder's blocks holds once the prompt's last len(local) blocks
    landed (tokens past the prompt: the prefill's untouched zeros)."""
    n = -(-PROMPT // BLOCK_SIZE)
    want = {}
    for i, dst in enumerate(local):
        b = n - len(local) + i
        arr = np.zeros((LAYERS, *SHAPE), np.float32)
        for layer in range(LAYERS):
            for t in range(b * BLOCK_SIZE, min(PROMPT, (b + 1) * BLOCK_SIZE)):
                arr[layer, :, t % BLOCK_SIZE] = 1000 * layer + t
        want[dst] = arr
    return want


def _check(arrs, local) -> None:
    for dst, arr in _expected(local).items():
        for layer in range(LAYERS):
            assert (arrs[layer][dst] == arr[layer]).all(), (dst, layer)
    others = [b for b in range(BLOCKS) if b not in local]
    assert all((a[others] == -1).all() for a in arrs)  # nothing else written


@pytest.mark.parametrize(("chunks", "saves"), [(1, True), (3, True), (2, False)])
def test_each_layer_is_pushed_into_the_decoders_blocks(prefill, chunks, saves):
    """The plan is in before the prefill computes: every step pushes each layer as it is
    saved (chunked prefill: a block split across steps is pushed again, complete). Without
    the saves (the step began after its layers ran), each step's blocks go at its end."""
    _, addr, cmd_q, out_q = prefill()
    w, arrs = _decoder()
    try:
        w.submit_layerwise([_task(addr)])
        cmd_q.put(("run", True, chunks, True, saves))
        assert _wait(w) == ({"d1"}, set())
        _check(arrs, (1, 3, 5, 7, 9))
        assert out_q.get(timeout=30) == (["p1"], 1)
        assert w.stats.requests_pulled == 1 and w.stats.blocks_pulled == 5
        assert not w.active
        cmd_q.put("stop")
    finally:
        w.close()


def test_a_plan_after_the_prefill_gets_every_layer_at_once(prefill):
    """The decoder announces after the prefill computed the prompt (and vLLM ended the
    request): the producer pushes every layer then, and frees the blocks after DONE. A
    local prefix hit: only the prompt's last 2 blocks come."""
    _, addr, cmd_q, out_q = prefill()
    cmd_q.put(("run", False, 1, True, True))
    time.sleep(1.0)
    w, arrs = _decoder()
    try:
        w.submit_layerwise([_task(addr, local=(6, 8))])
        assert _wait(w) == ({"d1"}, set())
        _check(arrs, (6, 8))
        assert out_q.get(timeout=30) == (["p1"], 1)
        cmd_q.put("stop")
    finally:
        w.close()


def test_a_decoder_that_gives_up_gets_no_push_after_it(prefill):
    """No KV within layerwise_timeout_s: the decoder writes ABANDONED into its slot, waits
    out a push's deadline, and fails the request; the prefill, computing later, pushes
    nothing into the blocks the decoder gave up, and frees its own."""
    _, addr, cmd_q, out_q = prefill()
    w, arrs = _decoder(layerwise_timeout_s=0.5, sync_kv_timeout_ms=500)
    try:
        t0 = time.monotonic()
        w.submit_layerwise([_task(addr)])
        assert _wait(w) == ({"d1"}, {"d1"})
        took = time.monotonic() - t0
        assert 0.5 + 0.5 <= took < 10, took  # the grace after the ABANDON landed
        cmd_q.put(("run", True, 1, True, True))  # its plan is still there, ABANDONED
        assert out_q.get(timeout=30) == (["p1"], 0)
        assert all((a == -1).all() for a in arrs)
        cmd_q.put("stop")
    finally:
        w.close()


def test_a_dead_prefill_fails_the_request_at_the_next_heartbeat(prefill):
    proc, addr, _, _ = prefill()
    w, arrs = _decoder(layerwise_timeout_s=60)
    try:
        w.submit_layerwise([_task(addr)])
        deadline = time.monotonic() + 20
        while w.lw_consumer is not None and not any(
                r.step is layerwise._R.WAIT for r in w.lw_consumer._recvs):
            assert time.monotonic() < deadline
            assert w.poll_recv() == (set(), set())
            time.sleep(0.005)
        proc.kill()
        proc.join(10)
        t0 = time.monotonic()
        assert _wait(w) == ({"d1"}, {"d1"})
        assert time.monotonic() - t0 < 10  # a heartbeat, not the 60 s timeout
    finally:
        w.close()


def test_a_request_vllm_ended_before_its_first_step_fails_fast_on_the_decoder(prefill):
    """vLLM ended the prefill request before it computed anything: the producer marks the
    decoder's plan REFUSED, and the decoder's next heartbeat fails the request."""
    _, addr, cmd_q, _ = prefill()
    w, arrs = _decoder(layerwise_timeout_s=60)
    try:
        w.submit_layerwise([_task(addr)])
        t0 = time.monotonic()
        cmd_q.put(("refuse",))
        assert _wait(w) == ({"d1"}, {"d1"})
        assert time.monotonic() - t0 < 10
        assert all((a == -1).all() for a in arrs)
        cmd_q.put("stop")
    finally:
        w.close()


def test_a_dead_decoder_costs_the_prefill_nothing_but_its_pushes(prefill):
    """The decoder announced its plan, then went away: the prefill's link or pushes fail,
    nothing is reported pushed, and the blocks are freed when the request ends."""
    _, addr, cmd_q, out_q = prefill(abort_timeout_s=60)
    w, _ = _decoder()
    w.submit_layerwise([_task(addr)])
    deadline = time.monotonic() + 20
    while w.lw_consumer is not None and not any(
            r.step is layerwise._R.WAIT for r in w.lw_consumer._recvs):
        assert time.monotonic() < deadline
        w.poll_recv()
        time.sleep(0.005)
    w.close()  # finalize: its listener and KV cache are gone
    cmd_q.put(("run", True, 1, True, True))
    assert out_q.get(timeout=40) == (["p1"], 0)  # freed long before abort_timeout_s
    cmd_q.put("stop")


def test_a_pull_mode_decoder_refuses_layerwise_requests():
    arrs, layout = _kv(-1.0)
    w = DatadistWorker(Settings(), producer=False, consumer=True)
    w.start(layout)
    try:
        w.submit_layerwise([_task(("127.0.0.1", 1, 5))])
        assert w.poll_recv() == ({"d1"}, {"d1"})
    finally:
        w.close()
