"""The core's issued transfers (``NativeEngine.pull_async`` / ``push_async``) in one process:
the queue of its fixed set of workers, a queued transfer's deadline, close, and the bound on
threads. The core's workers are busied by pulls from a silent owner (datadist.testing.fakes:
it welcomes the link, as another host, and then never answers). The
engine-agnostic behaviour of ``TransferHandle`` is tested between two processes
(tests/e2e/test_async_handles.py).
"""

from __future__ import annotations

import dataclasses
import os
import threading

import numpy as np
import pytest
from api._support import DECODER_ID, PROMPT_ID, Side, code, units

import datadist as llm
from datadist.core.native import ASYNC_THREADS
from datadist.testing.fakes import SilentOwner

pytestmark = pytest.mark.timeout(30)

S = llm.LLMStatusCode
SILENT_ID = 9


def _busy_workers(d: Side, owner: SilentOwner) -> list[llm.TransferHandle]:
    """Links ``d`` to the silent owner and occupies every worker of its engine with a pull
    there (each waits out ``d``'s sync timeout). Checksummed pulls: plain ones of one TCP
    link run back to back on one worker (pipelined), checksummed ones each on its own."""
    d.engine.link(SILENT_ID, *owner.address, 5.0)
    blocker, _ = d.register(2, [4, 64])
    key = llm.CacheKeyByIdAndIndex(SILENT_ID, 1, 0)
    plain = d.engine.config
    d.engine.config = dataclasses.replace(plain, verify=True)
    try:
        return [d.cm.pull_cache_async(key, blocker, 0) for _ in range(ASYNC_THREADS)]
    finally:
        d.engine.config = plain


def test_a_transfer_queued_past_its_deadline_fails_with_timeout_and_moves_nothing(make_side):
    p = make_side(PROMPT_ID)
    d = make_side(DECODER_ID, role=2, sync_timeout=1.0)
    d.engine.link(PROMPT_ID, *p.engine.listen_address, 5.0)
    _, a = p.register(2, [4, 64], seed=1)
    dst, b = d.register(2, [4, 64])
    with SilentOwner(SILENT_ID) as owner:
        blockers = _busy_workers(d, owner)
        d.engine.config = dataclasses.replace(d.engine.config, sync_timeout=0.05)
        handle = d.cm.pull_cache_async(llm.CacheKeyByIdAndIndex(PROMPT_ID, 1, 2), dst, 0)
        threading.Event().wait(0.2)  # its deadline passes while it is queued
        assert not handle.done()
        with code(S.LLM_TIMEOUT):
            handle.wait(10)
        for h in blockers:  # the first waits for the silent owner, the rest for the link
            with pytest.raises(llm.LLMException) as err:
                h.wait(10)
            assert err.value.status_code in (S.LLM_TIMEOUT, S.LLM_LINK_BUSY), err.value
    assert not b.any()
    d.engine.config = dataclasses.replace(d.engine.config, sync_timeout=2.0)
    # the next one runs at once and moves the bytes
    d.cm.pull_cache_async(llm.CacheKeyByIdAndIndex(PROMPT_ID, 1, 2), dst, 0).wait(10)
    np.testing.assert_array_equal(units(b, 4)[:, 0], units(a, 4)[:, 2])


def _closed_with_queued(make_side) -> list[llm.TransferHandle]:
    """Closes an engine whose workers are all busy and five more transfers are queued; checks
    close ends every one of them at once (the queued never started: nothing moved), which
    lets their local cache go, and returns the queued ones' handles."""
    p = make_side(PROMPT_ID)
    d = make_side(DECODER_ID, role=2, sync_timeout=60.0)  # deadlines far beyond this test
    d.engine.link(PROMPT_ID, *p.engine.listen_address, 5.0)
    p.register(2, [4, 64], seed=1)
    dst, b = d.register(2, [4, 64])
    with SilentOwner(SILENT_ID) as owner:
        blockers = _busy_workers(d, owner)
        handles = [d.cm.pull_cache_async(llm.CacheKeyByIdAndIndex(PROMPT_ID, 1, 0), dst, 0)
                   for _ in range(5)]
        threading.Event().wait(0.1)
        assert not any(h.done() for h in handles + blockers)
        assert d.engine.leases(dst.cache_id) == 5  # each queued transfer holds the local cache
        closer = threading.Thread(target=d.engine.close)
        closer.start()
        for h in handles + blockers:  # running ones fail through their closed link
            with pytest.raises(llm.LLMException):
                h.wait(10)
        closer.join(10)
        assert not closer.is_alive()
    assert d.engine._core.caches_in_use(0.0) == 0  # and each let go of its hold (in the core)
    assert not b.any()
    return handles


def test_close_fails_queued_transfers_at_once_with_engine_finalized(make_side):
    """A transfer finalize drops from the queue ends at once, LLM_ENGINE_FINALIZED, as
    docs/compatibility.md says (cpp/src/tasks.cc Executor::Close said LLM_FAILED)."""
    for h in _closed_with_queued(make_side):
        assert h.exception().status_code == S.LLM_ENGINE_FINALIZED
        assert "finalized before the transfer started" in str(h.exception())


def _threads() -> int:
    """This process's threads, native ones included (the core's are not Python's)."""
    return len(os.listdir("/proc/self/task"))


def test_workers_start_at_the_first_transfer_and_stay_at_their_count(pair):
    """The core's fixed set of workers: none before the first issued transfer, then
    ASYNC_THREADS, and no more for 64 transfers at once. Each pull moves 128 KiB, over what
    the core copies in the issuing thread (64 KiB under a lease): every one goes to a worker."""
    p, d = pair
    _, a = p.register(2, [16, 65536], seed=3, blocks=True, model_id=5)
    dst, b = d.register(2, [16, 65536], blocks=True)
    key = llm.BlocksCacheKey(PROMPT_ID, 5)
    before = _threads()
    d.cm.pull_blocks_async(key, dst, [0], [15]).wait(10)
    started = _threads() - before
    assert 0 < started <= ASYNC_THREADS, started
    handles = [d.cm.pull_blocks_async(key, dst, [i % 16], [15 - i % 16]) for i in range(64)]
    peak = _threads()
    for h in handles:
        peak = max(peak, _threads())
        h.wait(10)
    assert peak - before <= ASYNC_THREADS + 1, f"{peak - before} more threads"
    np.testing.assert_array_equal(units(b, 16)[:, ::-1], units(a, 16))
