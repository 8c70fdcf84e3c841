"""The connector's layer-wise mode between two real processes, without vLLM (always runs).

A prefill process (``_prefill``) drives a layer-wise producer the way vLLM's worker does
(``step`` at start_load_kv, ``save_layer`` per layer, ``wait_for_save``, ``poll`` at
get_finished, ``release`` when the request ends); this process is the decoder: it follows the
prefill's record and pulls each layer once written. Every layer's bytes are checked where
they landed.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pytest

import datadist as llm_datadist
from datadist.integrations.vllm import layerwise, worker
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
    """Commands: ("run", chunks, ok, saves, pauses): compute the prompt in ``chunks`` steps
    (calling save_layer after each layer when ``saves``; after saving a layer of
    ``pauses`` in the last step, say ("paused", layer) and wait for "go"), end the request,
    report ("end", freed, served, abandoned, pushes issued, seconds from the end to the
    free); ("refuse",); "stop" ends."""
    arrs, layout = _kv(0.0)
    w = DatadistWorker(Settings(mode="layerwise", **settings), producer=True, consumer=False)
    w.start(layout)
    lw = w.lw_producer
    assert lw is not None and w.address is not None
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
        _, chunks, ok, saves, pauses = cmd
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
                if layer in pauses and done + n >= PROMPT:
                    out_q.put(("paused", layer))
                    assert cmd_q.get(timeout=60) == "go"
            lw.wait_for_save()
            w.poll_sent()
            done += n
        lw.release("p1", ok)
        t0 = time.monotonic()
        freed: set[str] = set()
        deadline = time.monotonic() + 30
        while "p1" not in freed and time.monotonic() < deadline:
            freed |= w.poll_sent()
            time.sleep(0.005)
        pushes = llm_datadist.metrics()["total"].get("push", {}).get("transfers", 0)
        out_q.put(("end", sorted(freed), lw.served, lw.abandoned, pushes,
                   time.monotonic() - t0))
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
        if p.pid is not None:
            with __import__("contextlib").suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGCONT)
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
        time.sleep(0.002)
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


def _has_layer(arrs, local, layer) -> bool:
    return all((arrs[layer][dst] == arr[layer]).all() for dst, arr in _expected(local).items())


def _check(arrs, local) -> None:
    for dst, arr in _expected(local).items():
        for layer in range(LAYERS):
            assert (arrs[layer][dst] == arr[layer]).all(), (dst, layer)
    others = [b for b in range(BLOCKS) if b not in local]
    assert all((a[others] == -1).all() for a in arrs)  # nothing else written


def _until(cond, w: DatadistWorker, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        assert w.poll_recv() == (set(), set())
        time.sleep(0.002)


@pytest.mark.parametrize(("chunks", "saves"), [(1, True), (3, True), (2, False)])
def test_each_layer_is_pulled_by_the_decoder_as_it_is_written(prefill, chunks, saves):
    """The decoder is there before the prefill computes: it pulls each layer as the
    prefill's record says it was saved (chunked prefill: a block split across steps comes
    once complete). Without the saves (the step began after its layers ran), each step's
    blocks come at its end. The prefill moves no KV itself (no push), the decoder does not
    listen, and the prefill frees its blocks on the decoder's acknowledgement."""
    _, addr, cmd_q, out_q = prefill(abort_timeout_s=60)
    w, arrs = _decoder()
    try:
        assert w.address is None  # a layer-wise decoder no longer listens
        w.submit_layerwise([_task(addr)])
        _until(lambda: w.lw_consumer is not None and any(
            r.step is layerwise._R.FIND for r in w.lw_consumer._recvs), w)
        cmd_q.put(("run", chunks, True, saves, ()))
        assert _wait(w) == ({"d1"}, set())
        _check(arrs, (1, 3, 5, 7, 9))
        end, freed, served, abandoned, pushes, took = out_q.get(timeout=30)
        assert (end, freed, served, abandoned, pushes) == ("end", ["p1"], 1, 0, 0)
        assert took < 10  # acknowledged, not the 60 s abort timeout
        assert w.stats.requests_pulled == 1 and w.stats.blocks_pulled == 5
        assert llm_datadist.metrics()["total"]["pull"]["bytes"] >= 5 * LAYERS * 2 * 32 * 8 * 4
        assert not w.active
        cmd_q.put("stop")
    finally:
        w.close()


def test_layers_come_while_the_prefill_is_stopped(prefill):
    """The copies are the decoder's: once the prefill announced layers 0 and 1 and was
    stopped (SIGSTOP: none of its threads runs) before writing the last, both layers land
    in the decoder's blocks and the last does not; resumed, the prefill writes it and the
    request completes."""
    proc, addr, cmd_q, out_q = prefill()
    w, arrs = _decoder()
    local = (1, 3, 5, 7, 9)
    try:
        w.submit_layerwise([_task(addr)])
        cmd_q.put(("run", 1, True, True, (0, 1)))
        assert out_q.get(timeout=30) == ("paused", 0)
        _until(lambda: _has_layer(arrs, local, 0), w)  # (the KV cache's lease granted)
        cmd_q.put("go")
        assert out_q.get(timeout=30) == ("paused", 1)
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            _until(lambda: _has_layer(arrs, local, 1), w)
            assert (arrs[2][list(local)] == -1).all()
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        cmd_q.put("go")
        assert _wait(w) == ({"d1"}, set())
        _check(arrs, local)
        assert out_q.get(timeout=30)[:3] == ("end", ["p1"], 1)
        cmd_q.put("stop")
    finally:
        w.close()


def test_an_idle_step_reads_the_prefill_s_record_once_a_millisecond(prefill, monkeypatch):
    """While the prefill is still computing (its record says layer 0 of 3 is written), an
    idle step's wait reads the record at most once a millisecond (it read it every 0.3 ms:
    a quarter of a CPU in the decode worker for the whole prefill, taken from the prefill
    on a small host). Once the record says every layer is written, the wait ends with the
    request, in that same call."""
    _, addr, cmd_q, out_q = prefill(abort_timeout_s=60)
    w, arrs = _decoder()
    local = (1, 3, 5, 7, 9)
    try:
        w.submit_layerwise([_task(addr)])
        cmd_q.put(("run", 1, True, True, (0,)))
        assert out_q.get(timeout=30) == ("paused", 0)
        _until(lambda: _has_layer(arrs, local, 0), w)
        sleeps: list[float] = []
        real_sleep = time.sleep

        def sleep(s: float) -> None:  # what the wait asks for between its reads
            sleeps.append(s)
            real_sleep(s)

        reads = llm_datadist.metrics()["total"]["pull"]["transfers"]
        monkeypatch.setattr(worker.time, "sleep", sleep)
        t0 = time.monotonic()
        assert w.wait_recv(0.3) is True  # a request to follow: it waited its time
        took = time.monotonic() - t0
        monkeypatch.undo()
        reads = llm_datadist.metrics()["total"]["pull"]["transfers"] - reads
        assert 0.3 <= took < 2
        assert sleeps and all(s >= worker.LW_POLL_S for s in sleeps[:-1]), sleeps[:5]
        assert 0 < reads <= len(sleeps) + 1, (reads, len(sleeps))
        assert w.poll_recv() == (set(), set())
        cmd_q.put("go")  # the prefill writes layers 1 and 2, then says COMPLETE
        deadline = time.monotonic() + 20
        while not (w.lw_consumer is not None and any(
                r.complete for r in w.lw_consumer._recvs)):
            assert time.monotonic() < deadline
            done, failed = w.poll_recv()
            if done:  # it may end at the read that first sees COMPLETE
                break
            time.sleep(0.001)
        else:
            assert w.wait_recv(5.0) is True
            done, failed = w.poll_recv()
        assert (done, failed) == ({"d1"}, set())
        _check(arrs, local)
        assert out_q.get(timeout=30)[:3] == ("end", ["p1"], 1)
        cmd_q.put("stop")
    finally:
        w.close()


def test_a_decoder_after_the_prefill_gets_every_layer_at_once(prefill):
    """The decoder comes after the prefill computed the prompt (and vLLM ended the
    request): it pulls every layer then, and the prefill frees the blocks on its
    acknowledgement. A local prefix hit: only the prompt's last 2 blocks come."""
    _, addr, cmd_q, out_q = prefill(abort_timeout_s=60)
    cmd_q.put(("run", 1, True, True, ()))
    time.sleep(1.0)
    w, arrs = _decoder()
    try:
        w.submit_layerwise([_task(addr, local=(6, 8))])
        assert _wait(w) == ({"d1"}, set())
        _check(arrs, (6, 8))
        assert out_q.get(timeout=30)[:3] == ("end", ["p1"], 1)
        cmd_q.put("stop")
    finally:
        w.close()


def test_a_decoder_that_gives_up_stops_pulling_and_tells_the_prefill(prefill):
    """No KV within layerwise_timeout_s (the prefill stalls after layer 0): the decoder
    issues no pull after that, reports the request failed once its pulls ended, and
    acknowledges ABANDONED: the prefill frees its blocks at the request's end, not after its
    abort timeout."""
    _, addr, cmd_q, out_q = prefill(abort_timeout_s=60)
    w, arrs = _decoder(layerwise_timeout_s=1.5)
    local = (1, 3, 5, 7, 9)
    try:
        t0 = time.monotonic()
        w.submit_layerwise([_task(addr)])
        cmd_q.put(("run", 1, True, True, (0,)))
        assert out_q.get(timeout=30) == ("paused", 0)
        assert _wait(w) == ({"d1"}, {"d1"})
        assert 1.5 <= time.monotonic() - t0 < 10
        assert _has_layer(arrs, local, 0)
        cmd_q.put("go")  # the prefill writes the other layers: nobody pulls them
        end, freed, served, abandoned, _, took = out_q.get(timeout=30)
        assert (end, freed, served, abandoned) == ("end", ["p1"], 0, 1)
        assert took < 10
        assert (arrs[1][list(local)] == -1).all() and (arrs[2][list(local)] == -1).all()
        cmd_q.put("stop")
    finally:
        w.close()


def test_a_decoder_without_its_prefill_gives_up_after_its_timeout(prefill):
    _, addr, cmd_q, _ = prefill()
    w, arrs = _decoder(layerwise_timeout_s=0.5)
    try:
        t0 = time.monotonic()
        w.submit_layerwise([_task(addr)])
        assert _wait(w) == ({"d1"}, {"d1"})
        assert 0.5 <= time.monotonic() - t0 < 10
        assert all((a == -1).all() for a in arrs)
        cmd_q.put("stop")
    finally:
        w.close()


def test_a_dead_prefill_fails_the_request_at_once(prefill):
    proc, addr, cmd_q, out_q = prefill()
    w, arrs = _decoder(layerwise_timeout_s=60)
    try:
        w.submit_layerwise([_task(addr)])
        cmd_q.put(("run", 1, True, True, (0,)))
        assert out_q.get(timeout=30) == ("paused", 0)
        _until(lambda: _has_layer(arrs, (1, 3, 5, 7, 9), 0), w)
        proc.kill()
        proc.join(10)
        t0 = time.monotonic()
        assert _wait(w) == ({"d1"}, {"d1"})
        assert time.monotonic() - t0 < 5  # its next read, not the 60 s timeout
    finally:
        w.close()


def test_a_request_vllm_ended_before_its_first_step_fails_fast_on_the_decoder(prefill):
    """vLLM ended the prefill request before it computed anything: the producer's record
    says REFUSED, and the decoder's next read fails the request."""
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


def test_a_dead_decoder_costs_the_prefill_its_blocks_until_the_abort_timeout(prefill):
    """The decoder pulled layer 0, then went away: the prefill computes on undisturbed,
    and frees the blocks abort_timeout_s after the request ended (nobody acknowledged)."""
    _, addr, cmd_q, out_q = prefill(abort_timeout_s=2)
    w, arrs = _decoder()
    w.submit_layerwise([_task(addr)])
    cmd_q.put(("run", 1, True, True, (0,)))
    assert out_q.get(timeout=30) == ("paused", 0)
    _until(lambda: _has_layer(arrs, (1, 3, 5, 7, 9), 0), w)
    w.close()
    cmd_q.put("go")
    end, freed, served, _, _, took = out_q.get(timeout=40)
    assert (end, freed, served) == ("end", ["p1"], 0)
    assert 2 <= took < 10
    cmd_q.put("stop")


def test_record_hash_rejects_a_torn_read():
    rec = np.zeros(layerwise.HEADER, np.uint8)
    p = layerwise.Progress(bytes.fromhex(TAG), layerwise.OPEN, 5, 5, 0, 5, 2)
    layerwise.write_progress(rec, p)
    assert layerwise.read_progress(rec) == p
    assert (p.avail(1), p.avail(2)) == (5, 0)
    torn = rec.copy()
    torn[36] = 3  # layers from a newer write, the rest (and the hash) older
    assert layerwise.read_progress(torn) is None


def test_a_pull_mode_decoder_refuses_layerwise_requests():
    arrs, layout = _kv(-1.0)
    w = DatadistWorker(Settings(), producer=False, consumer=True)
    w.start(layout)
    try:
        w.submit_layerwise([_task(("127.0.0.1", 1, 5))])
        assert w.poll_recv() == ({"d1"}, {"d1"})
    finally:
        w.close()
