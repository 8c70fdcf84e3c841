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
    assert got is not None and got[0] == Code.TIMEOUT, got
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
