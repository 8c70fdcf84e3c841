"""The core's layer-wise run (``cpp/src/session.h`` LayerRun, ``NativeEngine.layers``):
transfer_cache_async's loop out of Python (issue 37). Driven here directly, with prepared
pulls on two engines in this process (``test_gil_hold``'s pair), one step per layer:

* the steps run in order, every call once, and nothing is planned per step;
* a step's own deadline ends a transfer that stalls (TIMEOUT, the core's), and no step
  starts after it;
* a refusal (a layer not synchronized) is settled after the steps before it;
* a step let go after the engine closed fails with ENGINE_FINALIZED;
* misuse (a call added after the first go, a step let go out of order) is InvalidArgument.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from test_gil_hold import OWNER_ID, Pair, Proxy, make_pair, stalled_pair  # noqa: F401

from datadist.core.errors import Code, InvalidArgument
from datadist.core.layout import Geometry, plan_slot

pytestmark = pytest.mark.timeout(60)

LAYERS = 4
SLOT = 4096


def slots(pr: Pair) -> tuple[list[object], np.ndarray, np.ndarray]:
    """LAYERS prepared pulls of one slot each (layer i: slot i of the owner's tensor into
    slot i of ours), and the source and destination arrays."""
    size = LAYERS * SLOT
    src = np.random.default_rng(3).integers(0, 256, size, dtype=np.uint8)
    dst = np.zeros(size, np.uint8)
    s = pr.owner.register(Geometry(1, size, LAYERS), [src.ctypes.data], placement=0)
    d = pr.puller.register(Geometry(1, size, LAYERS), [dst.ctypes.data], placement=0)
    pr._keep = (src, dst)  # type: ignore[attr-defined]
    calls = []
    for i in range(LAYERS):
        plan = plan_slot(d.geometry, i, (np.zeros(1, np.uint32), np.zeros(1, np.uint32)))
        key = pr.key.__class__(pr.key.kind, s.cache_id, i)
        calls.append(pr.puller.prepared(False, OWNER_ID, key, 0, plan, d.cache_id))
    return calls, src, dst


def test_steps_run_in_order_once_each(make_pair) -> None:  # noqa: F811
    pr = make_pair(None)
    pr.link()
    calls, src, dst = slots(pr)
    run = pr.puller.layers(1, LAYERS, 2, 5.0)
    for i, call in enumerate(calls):
        run.add(i, 0, call)
    for i in range(LAYERS):
        run.go(i)
        assert run.wait_ended(i + 1, 5.0)
        # layer i landed once step i ended, and no later one yet (not let go)
        np.testing.assert_array_equal(dst[:(i + 1) * SLOT], src[:(i + 1) * SLOT])
        assert not dst[(i + 1) * SLOT:].any()
    run.close()
    assert run.wait(5.0)
    assert run.results() == [(0, "")]
    assert run.calls_run == LAYERS and run.ended() == LAYERS


def test_a_stalled_step_ends_by_its_deadline_and_nothing_starts_after(stalled_pair) -> None:  # noqa: F811
    """The proxy forwards nothing: step 0's pull ends with the core's TIMEOUT by the step's
    own deadline (0.5 s from its start), the destination reports it, and step 2 and after
    are never started (width 2: step 1 may have started beside step 0)."""
    pr, proxy = stalled_pair
    proxy.stalled = False
    calls, _, _ = slots(pr)
    proxy.stalled = True
    run = pr.puller.layers(1, LAYERS, 2, 0.5)
    for i, call in enumerate(calls):
        run.add(i, 0, call)
    t0 = time.monotonic()
    run.go(0)
    run.go(1)
    assert run.wait_ended(1, 5.0)
    assert run.stopped()
    with pytest.raises(InvalidArgument):
        run.add(0, 0, calls[0])  # nothing is added once a step went
    for i in range(2, LAYERS):
        run.go(i)  # let go after the failure: never started
    run.close()
    assert run.wait(5.0)
    took = time.monotonic() - t0
    assert 0.4 < took < 4.0, took
    (got,) = run.results()
    # TIMEOUT, or LINK_BUSY when step 1 (started beside it) took the link first and step 0's
    # deadline passed waiting for it: either way the stalled link's deadline, in step 0.
    assert got is not None and got[0] in (Code.TIMEOUT, Code.LINK_BUSY), got
    assert run.calls_run <= 2


def test_a_refusal_is_settled_after_the_steps_before_it(stalled_pair) -> None:  # noqa: F811
    """Step 0 stalls (TIMEOUT), then step 1 is refused (not synchronized: PARAM_INVALID)
    while step 0 still runs: the destination reports step 0's TIMEOUT, its first failure in
    layer order, as LLM-DataDist's sequential loop would."""
    pr, proxy = stalled_pair
    proxy.stalled = False
    calls, _, _ = slots(pr)
    proxy.stalled = True
    run = pr.puller.layers(1, LAYERS, 2, 0.5)
    for i, call in enumerate(calls):
        run.add(i, 0, call)
    run.go(0)
    run.refuse(1, int(Code.PARAM_INVALID), "layer 1 was not synchronized")
    assert run.results() == [None]  # step 0 still running: nothing settled
    assert run.wait(5.0)
    (got,) = run.results()
    assert got is not None and got[0] == Code.TIMEOUT, got


def test_a_refusal_alone_is_the_destination_s_outcome(make_pair) -> None:  # noqa: F811
    pr = make_pair(None)
    pr.link()
    calls, src, dst = slots(pr)
    run = pr.puller.layers(2, LAYERS, 2, 5.0)
    for i, call in enumerate(calls):
        run.add(i, 0, call)
    run.add(0, 1, calls[0])  # destination 1 takes layer 0 only
    run.go(0)
    run.refuse(1, int(Code.PARAM_INVALID), "layer 1 was not synchronized")
    assert run.wait(5.0)
    assert run.results() == [(int(Code.PARAM_INVALID), "layer 1 was not synchronized"),
                             (0, "")]
    np.testing.assert_array_equal(dst[:SLOT], src[:SLOT])
    assert not dst[SLOT:].any()


def test_a_step_let_go_after_the_engine_closed_fails_finalized(make_pair) -> None:  # noqa: F811
    pr = make_pair(None)
    pr.link()
    calls, _, _ = slots(pr)
    run = pr.puller.layers(1, LAYERS, 2, 5.0)
    for i, call in enumerate(calls):
        run.add(i, 0, call)
    pr.puller._core.close(0.0)  # the workers are gone: a step queued now never runs
    run.go(0)
    run.close()
    assert run.wait(5.0)
    (got,) = run.results()
    assert got is not None and got[0] == Code.ENGINE_FINALIZED, got
    assert run.calls_run == 0


def test_misuse_is_invalid_argument(make_pair) -> None:  # noqa: F811
    pr = make_pair(None)
    calls, _, _ = slots(pr)
    run = pr.puller.layers(1, 2, 2, 5.0)
    with pytest.raises(InvalidArgument):
        run.add(2, 0, calls[0])  # no such step
    with pytest.raises(InvalidArgument):
        run.add(0, 1, calls[0])  # no such destination
    run.add(0, 0, calls[0])
    with pytest.raises(InvalidArgument):
        run.go(1)  # out of order


# ============================================================ layers let go together, merged

TENSOR = 8192


def by_tensor(pr: Pair, layers: int = 8, owner_tensors: int | None = None,
              tensor: int = TENSOR) -> tuple[list[object], np.ndarray, np.ndarray]:
    """``layers`` prepared pulls that the core can merge (issue 37): one key (the owner's cache
    by id, slot 0), the same span, layer i its tensor i (a layer push by key is made so: one
    call a layer, the tensors apart). The owner's cache has ``owner_tensors`` tensors (fewer:
    the later layers' pulls name tensors it has not)."""
    owner_tensors = layers if owner_tensors is None else owner_tensors
    src = np.random.default_rng(5).integers(0, 256, (owner_tensors, tensor), dtype=np.uint8)
    dst = np.zeros((layers, tensor), np.uint8)
    s = pr.owner.register(Geometry(owner_tensors, tensor, 1),
                          [int(src[t].ctypes.data) for t in range(owner_tensors)], placement=0)
    d = pr.puller.register(Geometry(layers, tensor, 1),
                           [int(dst[t].ctypes.data) for t in range(layers)], placement=0)
    pr._keep = (src, dst)  # type: ignore[attr-defined]
    key = pr.key.__class__(pr.key.kind, s.cache_id, 0)
    calls = []
    for i in range(layers):
        t = np.array([i], np.uint32)
        calls.append(pr.puller.prepared(False, OWNER_ID, key, 0, plan_slot(d.geometry, 0, (t, t)),
                                        d.cache_id))
    return calls, src, dst


def started_alone(run: object) -> None:
    """Waits until a worker took the one step let go (its request counted before it is sent)."""
    deadline = time.monotonic() + 5.0
    while run.requests_run < 1:  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, "no worker started step 0"
        time.sleep(0.001)


def held_then_let_go(pr: Pair, proxy: Proxy, calls: list[object], width: int = 1) -> object:
    """Step 0 sent and held in the stalled proxy while every other step is let go, then the
    proxy forwards again: the worker that ends step 0 finds the rest let go together."""
    run = pr.puller.layers(1, len(calls), width, 5.0)
    for i, call in enumerate(calls):
        run.add(i, 0, call)
    assert run.merges()
    run.go(0)
    started_alone(run)  # a worker took step 0 alone: its request goes to the stalled proxy
    for i in range(1, len(calls)):
        run.go(i)
    run.close()
    proxy.stalled = False
    assert run.wait(5.0)
    return run


def test_steps_let_go_together_go_in_one_request(stalled_pair) -> None:  # noqa: F811
    """Step 0 held while steps 1-7 are let go: the worker ending step 0 sends 1-7 in one
    request (their tensors together), every byte lands where its step put it, and the one
    destination succeeds. Before: a request a step (8)."""
    pr, proxy = stalled_pair
    proxy.stalled = False
    calls, src, dst = by_tensor(pr)
    proxy.stalled = True
    run = held_then_let_go(pr, proxy, calls)
    assert run.results() == [(0, "")]
    np.testing.assert_array_equal(dst, src)
    assert run.calls_run == 8 and run.ended() == 8
    assert run.requests_run == 2  # step 0 alone, then 1-7 merged


def test_a_failure_in_a_merged_request_lands_on_its_own_step(stalled_pair) -> None:  # noqa: F811
    """The owner's cache has 5 tensors: the merged request of steps 1-7 names tensors 5-7 and
    is refused whole; replayed a step at a time, steps 1-4 land, step 5 fails with the
    owner's refusal (PARAM_INVALID, its tensor named) and nothing after it runs."""
    pr, proxy = stalled_pair
    proxy.stalled = False
    calls, src, dst = by_tensor(pr, owner_tensors=5)
    proxy.stalled = True
    run = held_then_let_go(pr, proxy, calls)
    (got,) = run.results()
    assert got is not None and got[0] == Code.PARAM_INVALID and "tensor 5" in got[1], got
    np.testing.assert_array_equal(dst[:5], src)
    assert not dst[5:].any()
    assert run.stopped() and run.ended() == 8
    assert run.requests_run == 1 + 1 + 5  # step 0; 1-7 merged; 1-5 replayed


SPLIT_LAYERS = 12
MIB = 1 << 20


def split_run(pr: Pair, proxy: Proxy, owner_tensors: int | None = None
              ) -> tuple[object, np.ndarray, np.ndarray]:
    """SPLIT_LAYERS steps of 1 MiB on a run of width 2, steps 2 on let go while both workers
    are held in the stalled proxy (step 0, and step 1: a call the core cannot merge with the
    next, another owner cache's), then the proxy forwards again: the first worker free finds
    10 MiB let go together, takes its half (steps 2-6) and leaves the rest (7-11) to the
    next worker free, each half one request."""
    proxy.stalled = False
    calls, src, dst = by_tensor(pr, layers=SPLIT_LAYERS, owner_tensors=owner_tensors, tensor=MIB)
    one = src[1].copy()  # layer 1 from a cache of its own: another key, never merged
    s1 = pr.owner.register(Geometry(1, MIB, 1), [int(one.ctypes.data)], placement=0)
    d = pr.puller.register(Geometry(1, MIB, 1), [int(dst[1].ctypes.data)], placement=0)
    t0 = np.zeros(1, np.uint32)
    calls[1] = pr.puller.prepared(False, OWNER_ID, pr.key.__class__(pr.key.kind, s1.cache_id, 0),
                                  0, plan_slot(d.geometry, 0, (t0, t0)), d.cache_id)
    pr._keep = (pr._keep, one)  # type: ignore[attr-defined]
    proxy.stalled = True
    run = pr.puller.layers(1, len(calls), 2, 5.0)
    run.add_all(0, 0, calls, 1)
    assert run.go(0) is False
    started_alone(run)
    run.go(1)
    deadline = time.monotonic() + 5.0
    while run.requests_run < 2:  # the second worker took step 1 alone (not mergeable)
        assert time.monotonic() < deadline, "no worker started step 1"
        time.sleep(0.001)
    for i in range(2, len(calls)):
        run.go(i)
    run.close()
    proxy.stalled = False
    assert run.wait(10.0)
    return run, src, dst


def test_a_large_batch_is_split_between_the_workers(stalled_pair) -> None:  # noqa: F811
    """Steps 2-11 let go together (10 MiB) go in two requests, one per worker (kSplitBytes),
    every byte where its step put it, and the one destination succeeds. Before: one request
    of the ten on one worker (3 requests in all)."""
    pr, proxy = stalled_pair
    run, src, dst = split_run(pr, proxy)
    assert run.results() == [(0, "")]
    np.testing.assert_array_equal(dst, src)
    assert run.calls_run == SPLIT_LAYERS and run.ended() == SPLIT_LAYERS
    assert run.requests_run == 4  # steps 0 and 1 alone, 2-6 and 7-11 apart


def test_a_failure_in_a_split_batch_s_second_part_lands_on_its_step(stalled_pair) -> None:  # noqa: F811
    """The owner's cache has 9 tensors: the second part (steps 7-11) is refused whole and
    replayed a step at a time: 7 and 8 land, 9 fails (its tensor named), the first part
    landed whole, nothing after 9 lands."""
    pr, proxy = stalled_pair
    run, src, dst = split_run(pr, proxy, owner_tensors=9)
    (got,) = run.results()
    assert got is not None and got[0] == Code.PARAM_INVALID and "tensor 9" in got[1], got
    np.testing.assert_array_equal(dst[:9], src)
    assert not dst[9:].any()
    assert run.stopped() and run.ended() == SPLIT_LAYERS
    assert run.requests_run == 4 + 3  # 0; 1; 2-6; 7-11; 7, 8, 9 replayed


def test_a_failure_in_a_split_batch_s_first_part_is_the_outcome(stalled_pair) -> None:  # noqa: F811
    """The owner's cache has 5 tensors: the first part (steps 2-6) fails at step 5 when
    replayed; the second part (whether it ran or not: every step of it fails too) settles
    after it, so the destination's outcome is step 5's, and no byte past tensor 4 lands."""
    pr, proxy = stalled_pair
    run, src, dst = split_run(pr, proxy, owner_tensors=5)
    (got,) = run.results()
    assert got is not None and got[0] == Code.PARAM_INVALID and "tensor 5" in got[1], got
    np.testing.assert_array_equal(dst[:5], src[:5])
    assert not dst[5:].any()
    assert run.stopped()


def test_add_all_puts_each_call_in_its_step(make_pair) -> None:  # noqa: F811
    """add_all(first, job, calls, per_step): calls[i] in step first + i // per_step, as add
    each; a destination or steps out of range, a missing call or per_step 0 add nothing
    (InvalidArgument), and nothing once a step went."""
    pr = make_pair(None)
    pr.link()
    calls, src, dst = slots(pr)
    run = pr.puller.layers(2, LAYERS + 1, 1, 5.0)
    with pytest.raises(InvalidArgument):
        run.add_all(2, 0, calls, 1)  # steps 2-5 of 5
    with pytest.raises(InvalidArgument):
        run.add_all(0, 2, calls, 1)  # no destination 2
    with pytest.raises(InvalidArgument):
        run.add_all(0, 0, calls, 0)
    with pytest.raises((InvalidArgument, TypeError)):
        run.add_all(0, 0, [calls[0], None], 1)
    run.add_all(1, 1, calls[:2], 2)  # destination 1: both calls in step 1
    run.add_all(1, 0, calls[2:], 1)  # destination 0: steps 1 and 2
    for i in range(LAYERS + 1):
        assert run.go(i) is False
        with pytest.raises(InvalidArgument):
            run.add_all(LAYERS, 0, calls[:1], 1)
    run.close()
    assert run.wait(5.0)
    assert run.results() == [(0, ""), (0, "")]
    assert run.calls_run == LAYERS
    np.testing.assert_array_equal(dst, src)


def test_go_after_abandon_does_nothing(make_pair) -> None:  # noqa: F811
    """A run given up on (abandon) takes go and refuse without complaint: the loop letting
    steps go may not have seen it yet. go says the run stopped; nothing runs."""
    pr = make_pair(None)
    pr.link()
    calls, src, dst = slots(pr)
    run = pr.puller.layers(1, LAYERS, 1, 5.0)
    for i, call in enumerate(calls):
        run.add(i, 0, call)
    run.abandon(int(Code.TIMEOUT), "given up")
    assert run.go(0) is True
    run.refuse(1, int(Code.PARAM_INVALID), "not synchronized")
    assert run.wait(1.0) and run.calls_run == 0
    assert not dst.any()


def test_a_merged_batch_has_the_time_its_steps_would_have_had(make_pair) -> None:  # noqa: F811
    """A slow link (16 KiB every 50 ms): one layer of 64 KiB takes about 0.2 s, within its
    0.8 s step deadline; steps 1-7 merged take about 1.4 s. The batch has the deadline its 7
    steps would have had one after another, and lands whole. Before: one step's deadline
    for the batch (TIMEOUT), then a replay under that spent deadline (TIMEOUT again)."""
    pr = make_pair("tcp")
    proxy = Proxy(pr.owner.listen_address, delay=0.05, chunk=16 << 10)  # 16 KiB / 50 ms
    try:
        pr.link(proxy.address)
        calls, src, dst = by_tensor(pr, tensor=64 << 10)
        proxy.stalled = True
        run = pr.puller.layers(1, len(calls), 1, 0.8)
        for i, call in enumerate(calls):
            run.add(i, 0, call)
        run.go(0)
        started_alone(run)
        for i in range(1, len(calls)):
            run.go(i)
        run.close()
        proxy.stalled = False
        assert run.wait(30.0)
        assert run.results() == [(0, "")], run.results()
        np.testing.assert_array_equal(dst, src)
        assert run.requests_run == 2  # step 0 alone, then 1-7 merged, never replayed
    finally:
        proxy.stalled = False
        proxy.close()


def test_layers_released_together_on_one_host(make_pair) -> None:  # noqa: F811
    """The same-host (leased) path: 16 steps of 1 MiB let go back to back, one worker: bytes
    right, one outcome, and fewer requests than steps (the worker ending step 0, a copy of
    1 MiB, takes the ones let go meanwhile, microseconds each)."""
    pr = make_pair(None)
    pr.link()
    calls, src, dst = by_tensor(pr, layers=16, tensor=1 << 20)
    run = pr.puller.layers(1, 16, 1, 5.0)
    for i, call in enumerate(calls):
        run.add(i, 0, call)
    run.go(0)
    started_alone(run)
    for i in range(1, 16):
        run.go(i)
    run.close()
    assert run.wait(5.0)
    assert run.results() == [(0, "")]
    np.testing.assert_array_equal(dst, src)
    assert run.calls_run == 16
    assert run.requests_run < 16


def test_steps_of_several_destinations_are_never_merged(make_pair) -> None:  # noqa: F811
    """Two destinations a step (their order within a step is a rule: a failure stops the ones
    after it), or calls the core cannot join (other keys): merges() is False and each call is
    its own request."""
    pr = make_pair(None)
    pr.link()
    calls, src, dst = by_tensor(pr, layers=4)
    run = pr.puller.layers(2, 2, 2, 5.0)
    for i in range(2):
        run.add(i, 0, calls[2 * i])
        run.add(i, 1, calls[2 * i + 1])
    assert not run.merges()
    run.go(0)
    run.go(1)
    run.close()
    assert run.wait(5.0)
    assert run.results() == [(0, ""), (0, "")]
    np.testing.assert_array_equal(dst, src)
    assert run.requests_run == 4
    slot_calls, _, _ = slots(make_pair(None))  # one key a slot: never one request
    run = pr.puller.layers(1, LAYERS, 2, 5.0)
    for i, call in enumerate(slot_calls):
        run.add(i, 0, call)
    assert not run.merges()


def _switches() -> int:
    """This thread's voluntary context switches so far (Linux: /proc/thread-self/status)."""
    with open("/proc/thread-self/status") as f:
        for line in f:
            if line.startswith("voluntary_ctxt_switches:"):
                return int(line.split()[1])
    raise AssertionError("no voluntary_ctxt_switches in /proc/thread-self/status")


@pytest.mark.skipif(not __import__("os").path.exists("/proc/thread-self/status"),
                    reason="counts a thread's context switches in /proc")
def test_a_waiter_sleeps_until_the_run_is_over(make_pair) -> None:  # noqa: F811
    """A thread in ``wait`` (the caller's synchronize) is woken once, when the run is over, not
    at every step let go or ended (each such wake-up takes a CPU from the copies to go back to
    sleep; on the old code it was woken about twice a step)."""
    import threading

    pr = make_pair(None)
    pr.link()
    steps = 16
    calls, src, dst = by_tensor(pr, layers=steps, tensor=4096)
    run = pr.puller.layers(1, steps, 1, 5.0)
    for i, call in enumerate(calls):
        run.add(i, 0, call)
    waiting = threading.Event()
    got: list[object] = []

    def waiter() -> None:
        before = _switches()
        waiting.set()
        got.append(run.wait(10.0))
        got.append(_switches() - before)

    t = threading.Thread(target=waiter)
    t.start()
    assert waiting.wait(5.0)
    time.sleep(0.05)  # the waiter is asleep in wait
    for i in range(steps):
        run.go(i)
        assert run.wait_ended(i + 1, 5.0)  # each step ends while the waiter waits
    run.close()
    t.join(10.0)
    assert got[0] is True
    np.testing.assert_array_equal(dst, src)
    # asleep once, woken once at the end (a switch or two for the GIL beside it)
    assert got[1] <= 4, f"the waiter went to sleep {got[1]} times over {steps} steps"
