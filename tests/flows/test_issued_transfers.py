"""The Python engine's issued transfers (``Engine.pull_async`` / ``push_async``) in one
process: the queue, its deadline, its bound, and close. The engine-agnostic behaviour of
``TransferHandle`` is tested between two processes (tests/integration/test_async_handles.py).
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest

import datadist as llm
from datadist.core.transfers import POOL_THREADS, Job, Transfer

from ._support import PROMPT_ID, code, units

pytestmark = pytest.mark.timeout(30)

S = llm.LLMStatusCode


def _block_the_pool(engine) -> threading.Event:
    """Occupy every transfer thread of ``engine`` until the returned event is set."""
    gate = threading.Event()
    started = threading.Semaphore(0)

    def body():
        started.release()
        gate.wait()

    for i in range(POOL_THREADS):
        engine._transfers.submit(Job(Transfer(f"blocker {i}"), body, lambda err: None))
    for _ in range(POOL_THREADS):
        assert started.acquire(timeout=10)
    return gate


def test_a_transfer_queued_past_its_deadline_fails_with_timeout_and_moves_nothing(pair):
    p, d = pair
    _, a = p.register(2, [4, 64], seed=1)
    dst, b = d.register(2, [4, 64])
    gate = _block_the_pool(d.engine)
    try:
        d.engine.config = dataclasses.replace(d.engine.config, sync_timeout=0.05)
        handle = d.cm.pull_cache_async(llm.CacheKeyByIdAndIndex(PROMPT_ID, 1, 2), dst, 0)
        assert not handle.done()
        threading.Event().wait(0.1)  # its deadline passes while it is queued
    finally:
        gate.set()
    with code(S.LLM_TIMEOUT):
        handle.wait(10)
    assert "queue" in str(handle.exception())
    assert not b.any()
    d.engine.config = dataclasses.replace(d.engine.config, sync_timeout=2.0)
    # the next one runs at once and moves the bytes
    d.cm.pull_cache_async(llm.CacheKeyByIdAndIndex(PROMPT_ID, 1, 2), dst, 0).wait(10)
    np.testing.assert_array_equal(units(b, 4)[:, 0], units(a, 4)[:, 2])


def test_close_fails_queued_transfers_with_engine_finalized_and_releases_their_caches(pair):
    p, d = pair
    p.register(2, [4, 64], seed=1)
    dst, b = d.register(2, [4, 64])
    gate = _block_the_pool(d.engine)
    handles = [d.cm.pull_cache_async(llm.CacheKeyByIdAndIndex(PROMPT_ID, 1, 0), dst, 0)
               for _ in range(5)]
    entry = d.engine.registry.get(dst.cache_id)
    assert entry.leases == 5  # each queued transfer holds the local cache
    closer = threading.Thread(target=d.engine.close)
    closer.start()
    for h in handles:
        with code(S.LLM_ENGINE_FINALIZED):
            h.wait(10)
        assert "finalized before this transfer started" in str(h.exception())
    assert entry.leases == 0
    gate.set()
    closer.join(10)
    assert not closer.is_alive()
    assert not b.any()


def test_threads_stay_at_the_pool_size_with_many_transfers(pair):
    p, d = pair
    _, a = p.register(2, [64, 64], seed=3, blocks=True, model_id=5)
    dst, b = d.register(2, [64, 64], blocks=True)
    key = llm.BlocksCacheKey(PROMPT_ID, 5)
    handles = [d.cm.pull_blocks_async(key, dst, [i], [63 - i]) for i in range(64)]
    for h in handles:
        h.wait(10)
    assert d.engine._transfers.threads <= POOL_THREADS
    np.testing.assert_array_equal(units(b, 64)[:, ::-1], units(a, 64))
