"""The connector's datadist worker in two real processes, without vLLM (always runs).

A producer process holds a "finished request" in a numpy KV cache; a consumer process pulls
it the way the decode side of the connector does: link, mailbox check, pull_blocks, DONE.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import threading
import time

import numpy as np
import pytest

import datadist as llm_datadist
from datadist.integrations.vllm.scheduler import RecvTask, SendTask
from datadist.integrations.vllm.settings import RemoteRequest, Settings
from datadist.integrations.vllm.worker import DatadistWorker, KvLayout

pytestmark = pytest.mark.timeout(60)

BLOCKS, SHAPE, LAYERS = 16, (2, 32, 8), 2
TAG = "5a" * 16


def _kv(fill: float = 0.0) -> tuple[list[np.ndarray], KvLayout]:
    arrs = [np.full((BLOCKS, *SHAPE), fill, np.float32) for _ in range(LAYERS)]
    return arrs, KvLayout([a.ctypes.data for a in arrs], BLOCKS, SHAPE,
                          llm_datadist.DataType.DT_FLOAT, 1)


def _producer(addr_q, cmd_q, out_q, abort_timeout_s: float, extra: int = 0) -> None:
    arrs, layout = _kv()
    for layer, a in enumerate(arrs):
        for b in range(BLOCKS):
            a[b] = 100 * layer + b
    w = DatadistWorker(Settings(abort_timeout_s=abort_timeout_s), producer=True,
                       consumer=False)
    w.start(layout)
    w.hold([SendTask("p1", 3, TAG)])
    # ``extra`` more finished requests: q<i> holds blocks i and i + 1 in slot 10 + i
    w.hold([SendTask(f"q{i}", 10 + i, f"{i:02x}" * 16) for i in range(extra)])
    addr_q.put((w.address.host, w.address.port, w.cluster_id))
    # Commands: "stop", or a list of request ids: stop once all of them are freed (the test
    # waits for the consumer's DONE to land rather than guessing how long it takes).
    freed: set[str] = set()
    deadline = time.monotonic() + 30
    cmd = None
    while time.monotonic() < deadline:
        freed |= w.poll_sent()
        if cmd is None and not cmd_q.empty():
            cmd = cmd_q.get()
        if cmd == "stop" or (isinstance(cmd, list) and set(cmd) <= freed):
            break
        time.sleep(0.01)
    freed |= w.poll_sent()  # DONEs that landed since the last step
    out_q.put((sorted(freed), w.stats.sent_notified, w.stats.sent_expired))
    w.close()


@pytest.fixture
def producer():
    ctx = mp.get_context("spawn")
    procs = []

    def start(abort_timeout_s: float = 30.0, extra: int = 0):
        addr_q, cmd_q, out_q = ctx.Queue(), ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=_producer, args=(addr_q, cmd_q, out_q, abort_timeout_s, extra),
                        daemon=True)
        p.start()
        procs.append(p)
        return p, addr_q.get(timeout=30), cmd_q, out_q

    yield start
    for p in procs:
        p.kill()
        p.join(5)


def _consumer(**kw) -> tuple[DatadistWorker, list[np.ndarray]]:
    arrs, layout = _kv(-1.0)
    w = DatadistWorker(Settings(**kw), producer=False, consumer=True)
    w.start(layout)
    return w, arrs


def _task(addr, blocks=(5, 9, 3), local=(0, 1, 2), tokens=70, *, rid="d1", remote="p1",
          slot=3, tag=TAG) -> RecvTask:
    host, port, cid = addr
    params = {"remote_block_ids": list(blocks), "remote_num_tokens": tokens,
              "remote_request_id": remote,
              "datadist": {"workers": [[host, port, cid]], "block_size": 32, "slot": slot,
                           "tag": tag}}
    return RecvTask(rid, list(local), RemoteRequest.parse(params))


def _wait(w: DatadistWorker, timeout: float = 30) -> tuple[set[str], set[str]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, failed = w.poll_recv()
        if done:
            return done, failed
        time.sleep(0.01)
    raise AssertionError("pull never finished")


def test_pull_copies_every_layer_and_frees_the_producer(producer):
    proc, addr, cmd_q, out_q = producer()
    w, arrs = _consumer()
    try:
        w.submit([_task(addr)])
        assert w.active
        assert _wait(w) == ({"d1"}, set())
        # Reported as soon as the KV landed; the DONE push (Rule 3) ends in a later step.
        deadline = time.monotonic() + 10
        while w.active and time.monotonic() < deadline:
            assert w.poll_recv() == (set(), set())  # reported once only
            time.sleep(0.005)
        assert not w.active
        for layer, a in enumerate(arrs):
            for src, dst in zip((5, 9, 3), (0, 1, 2), strict=True):
                assert (a[dst] == 100 * layer + src).all()
            assert (a[3:] == -1).all()  # nothing else written
        assert (w.stats.requests_pulled, w.stats.blocks_pulled) == (1, 3)
        assert w.stats.bytes_pulled == 3 * LAYERS * int(np.prod(SHAPE)) * 4
        cmd_q.put(["p1"])  # stop once the consumer's DONE freed p1 (or the deadline passed)
        freed, notified, expired = out_q.get(timeout=40)
        assert (freed, notified, expired) == (["p1"], 1, 0)  # freed by DONE, not by timeout
    finally:
        w.close()


def test_blocks_freed_by_timeout_fail_the_pull(producer):
    proc, addr, cmd_q, out_q = producer(abort_timeout_s=0.2)
    time.sleep(1.0)  # the producer frees the request and clears its slot
    w, arrs = _consumer(hold_grace_s=0.3)
    try:
        w.submit([_task(addr)])
        assert _wait(w) == ({"d1"}, {"d1"})
        assert (arrs[0] == -1).all()  # nothing was pulled
        cmd_q.put("stop")
        assert out_q.get(timeout=30)[2] == 1  # expired
    finally:
        w.close()


def test_dead_producer_fails_the_pull_within_the_deadline(producer):
    proc, addr, _, _ = producer()
    proc.kill()
    proc.join(10)
    w, _ = _consumer(link_timeout_ms=1000, sync_kv_timeout_ms=1000)
    try:
        t0 = time.monotonic()
        w.submit([_task(addr)])
        assert _wait(w) == ({"d1"}, {"d1"})
        assert time.monotonic() - t0 < 5
        assert w.stats.pull_failures == 1
    finally:
        w.close()


def test_more_local_blocks_than_the_prefill_holds_fails(producer):
    _, addr, _, _ = producer()
    w, _ = _consumer()
    try:
        w.submit([_task(addr, local=(0, 1, 2, 4))])
        assert _wait(w) == ({"d1"}, {"d1"})
    finally:
        w.close()


def test_kv_both_worker_serves_and_pulls(producer):
    _, addr, _, _ = producer()
    arrs, layout = _kv(-1.0)
    w = DatadistWorker(Settings(), producer=True, consumer=True)
    w.start(layout)
    try:
        assert w.address is not None and w.address.port > 0  # serves as a producer
        w.hold([SendTask("mine", 0, "11" * 16)])
        assert w.active and w.poll_sent() == set()
        w.submit([_task(addr)])
        assert _wait(w) == ({"d1"}, set())
        assert (arrs[1][0] == 100 + 5).all()
    finally:
        w.close()


def test_many_requests_pull_at_once_without_a_thread_each(producer):
    """The consumer issues its transfers and polls them from poll_recv: no puller thread,
    and the thread count does not grow with the requests in flight."""
    n = 12
    _, addr, cmd_q, out_q = producer(extra=n)
    w, arrs = _consumer()
    try:
        before = threading.active_count()
        w.submit([_task(addr, blocks=(i, i + 1), local=(i, i + 1), tokens=64, rid=f"d{i}",
                        remote=f"q{i}", slot=10 + i, tag=f"{i:02x}" * 16)
                  for i in range(0, n, 2)])
        done: set[str] = set()
        peak = before
        deadline = time.monotonic() + 30
        while len(done) < n // 2 and time.monotonic() < deadline:
            got, failed = w.poll_recv()
            assert not failed
            done |= got
            peak = max(peak, threading.active_count())
            time.sleep(0.002)
        assert done == {f"d{i}" for i in range(0, n, 2)}
        assert not any(t.name.startswith("datadist-puller") for t in threading.enumerate())
        assert peak - before <= 6, f"{peak - before} threads for {n // 2} requests"
        for layer, a in enumerate(arrs):
            for b in range(n):
                assert (a[b] == 100 * layer + b).all()
        cmd_q.put("stop")
        freed, notified, _ = out_q.get(timeout=30)
        assert notified == n // 2 and {f"q{i}" for i in range(0, n, 2)} <= set(freed)
    finally:
        w.close()


def test_a_producer_being_linked_blocks_no_step(producer):
    """Links are made off the engine's step: while the link to an unresponsive producer is
    being made (it accepts and never answers, so the link takes its whole 3 s timeout), every
    poll_recv returns at once and a linked producer's request is pulled; the unresponsive
    one's request fails once its link times out. (Before, poll_recv linked inline and held
    the step for the whole link timeout.)"""
    _, addr, _, _ = producer()
    mute = socket.socket()
    mute.bind(("127.0.0.1", 0))
    mute.listen(8)  # the kernel completes connections; nobody ever answers HELLO
    w, arrs = _consumer(link_timeout_ms=3000)
    try:
        w.submit([_task(("127.0.0.1", mute.getsockname()[1], 4242), rid="stuck"),
                  _task(addr)])
        slowest, done, failed, when = 0.0, set(), set(), {}
        deadline = time.monotonic() + 30
        while "stuck" not in done and time.monotonic() < deadline:
            t0 = time.monotonic()
            got, bad = w.poll_recv()
            slowest = max(slowest, time.monotonic() - t0)
            for rid in got:
                when[rid] = time.monotonic()
            done |= got
            failed |= bad
            time.sleep(0.005)
        assert done == {"d1", "stuck"} and failed == {"stuck"}
        assert when["d1"] < when["stuck"]  # pulled while the other link was still being made
        assert (arrs[0][0] == 5).all()
        assert slowest < 1.0, f"a step took {slowest:.2f} s: it waited for a link"
    finally:
        w.close()
        mute.close()


def test_prefill_workers_are_linked_before_the_first_request(producer):
    """``prefill_workers``: the decoder links to them at start-up, off the step, so the
    first request's first step finds its link made and issues its mailbox read at once
    (before, the link was started by that request and the step that issued the read came
    later). A refused address and an unresponsive one fail no start-up and hold no step: the
    refused one's request links again at first sight, and fails as it would without the
    setting."""
    _, addr, _, _ = producer()
    host, port, cid = addr
    mute = socket.socket()
    mute.bind(("127.0.0.1", 0))
    mute.listen(8)  # accepts, never answers HELLO: its pre-link takes the whole timeout
    refused = socket.socket()
    refused.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
    t0 = time.monotonic()
    w, arrs = _consumer(link_timeout_ms=2000, prefill_workers=(
        f"{host}:{port}", f"127.0.0.1:{refused.getsockname()[1]}",
        f"127.0.0.1:{mute.getsockname()[1]}"))
    try:
        assert time.monotonic() - t0 < 1.5, "start-up waited for a pre-link"
        deadline = time.monotonic() + 10
        while not any(link.cluster_id == cid for link in w.engine.links()):
            assert time.monotonic() < deadline, "no pre-link to the prefill worker"
            time.sleep(0.005)
        events: list[tuple[str, str]] = []
        w.on_event = lambda rid, ev: events.append((rid, ev))
        w.submit([_task(addr)])
        first = w.poll_recv()
        assert ("d1", "linked") in events, "the first request's step waited for a link"
        # (Warmed at the pre-link, a same-host pull can end in this very step.)
        assert (first if first[0] else _wait(w)) == ({"d1"}, set())
        assert (arrs[0][0] == 5).all()
        # The refused address: its request links again (and fails, as without the setting).
        w.submit([_task(("127.0.0.1", refused.getsockname()[1], 4243), rid="gone")])
        assert _wait(w) == ({"gone"}, {"gone"})
    finally:
        w.close()
        mute.close()
        refused.close()


def test_a_pre_link_is_usable_before_its_warm_up_ends(producer):
    """The pre-link's warm-up (reads of the producer's caches, each up to
    ``sync_kv_timeout_ms``) runs after its link is filed: requests waiting for the pre-link
    go on at once, whatever the warm-up waits for. Before, the link was filed only after the
    warm-up (a slow producer held the first requests up to three read timeouts)."""
    from datadist.integrations.vllm.worker import _Linker

    _, addr, _, _ = producer()
    host, port, cid = addr
    w, _ = _consumer()
    release = threading.Event()
    warming = threading.Event()

    def slow_warm(cluster_id: int) -> None:
        warming.set()
        release.wait(30)

    linker = _Linker(w._dd, 5000, warm=slow_warm)
    try:
        linker.prelink(host, port)
        deadline = time.monotonic() + 10
        while linker.state(cid) != linker.UP:
            assert time.monotonic() < deadline, "the link waited for its warm-up"
            time.sleep(0.005)
        assert warming.wait(10) and not release.is_set()
    finally:
        release.set()
        linker.close(5.0)
        w.close()


def test_prefill_workers_setting_is_checked():
    assert Settings.from_extra_config(
        {"prefill_workers": "10.0.0.1:7000, [::1]:7001"}).prefill_workers == (
        "10.0.0.1:7000", "[::1]:7001")
    assert Settings.from_extra_config({}).prefill_workers == ()
    for bad in (["10.0.0.1"], ["10.0.0.1:0"], [7000], 7000, ["::1:7000"], ["localhost:7000"]):
        with pytest.raises(ValueError, match="prefill_workers"):
            Settings.from_extra_config({"prefill_workers": bad})


def test_an_idle_step_waits_for_the_pull_in_flight(producer):
    """wait_recv (the connector calls it on a step that scheduled nothing) returns False at
    once with nothing in flight, else blocks until the KV pull in flight ended, so the
    poll_recv right after reports the request in this step, not the next."""
    _, addr, _, _ = producer()
    w, arrs = _consumer()
    try:
        assert w.wait_recv(5.0) is False
        w.submit([_task(addr)])
        deadline = time.monotonic() + 30
        while True:  # until it is reported, or its KV pull is in flight
            got, _ = w.poll_recv()
            if got or (w._pulls and w._pulls[0].step.name == "PULL"):
                break
            assert time.monotonic() < deadline
            time.sleep(0.001)
        if not got:  # the KV pull is in flight: wait for it, then it is reported at once
            assert w.wait_recv(10.0) is True
            assert w._pulls[0].handle is not None and w._pulls[0].handle.done()
            got, failed = w.poll_recv()
            assert not failed
        assert got == {"d1"}
        assert (arrs[0][0] == 5).all()
    finally:
        w.close()
