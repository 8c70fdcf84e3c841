"""The binding's transfer entry point is memory-safe and coarse (cpp/python/module.cc
``Engine.prepare``, cpp/src/session.cc ``Session::Prepare`` / ``Run`` / ``Submit``): it takes
the local cache's id and the plan's local tensors and offsets, never addresses; the core
checks every local span against that cache's geometry (InvalidArgument, nothing written) and
holds the cache for each transfer, an issued one until it ends, with no hold of Python's.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
from api._support import DECODER_ID, PROMPT_ID, Side

import datadist as llm
from datadist.core import keys as p
from datadist.core.errors import CacheNotFound, InvalidArgument
from datadist.core.layout import U32, U64, Plan
from datadist.testing.fakes import SilentOwner

pytestmark = pytest.mark.timeout(60)

BLOCKS, BLOCK, GUARD = 4, 64, 256
SILENT_ID = 9
# The dropped pull's deadline, past the module's timeout (60 s): it never ends on its own while
# a test runs; remove_cache's wait, shorter, fails (LLM_TIMEOUT) unless the pull ended.
PULL_DEADLINE_S, REMOVE_WAIT_S = 300.0, 20.0


def _guarded(d: Side) -> tuple[llm.Cache, np.ndarray]:
    """A 2-tensor blocks cache of BLOCKS x BLOCK bytes per tensor over the head of larger
    zeroed rows: a write past a tensor's registered bytes lands in the row's GUARD tail."""
    rows = np.zeros((2, BLOCKS * BLOCK + GUARD), np.uint8)
    d.arrays.append(rows)
    desc = llm.CacheDesc(2, [BLOCKS, BLOCK], llm.DataType.DT_UINT8, llm.Placement.DEVICE)
    cache = d.cm.register_blocks_cache(desc, [int(r.ctypes.data) for r in rows], None)
    return cache, rows


def _plan(local_tensors: list[int], local_offset: int, length: int) -> Plan:
    n = len(local_tensors)
    return Plan(np.arange(n, dtype=U32), np.array(local_tensors, dtype=U32),
                np.zeros(1, dtype=U64), np.array([local_offset], dtype=U64),
                np.array([length], dtype=U64))


def test_spans_outside_the_local_cache_are_refused_by_the_core_and_nothing_is_written(pair):
    """The binding itself (no Python check before it) refuses a local tensor or span outside
    the cache, overflow included, as InvalidArgument naming it; the facade's driver too; not a
    byte lands in the memory beyond the cache."""
    src_side, d = pair
    src_side.register(2, [BLOCKS, BLOCK], blocks=True, model_id=3, seed=5)
    cache, rows = _guarded(d)
    key = p.KeyRef(p.KeyKind.BLOCKS_KEY, 0, 3, 0)
    core = d.engine._core
    cid = cache.cache_id
    bad = [
        (_plan([0, 1], BLOCKS * BLOCK - 32, BLOCK),
         f"local span [224, +64) lies outside the 256 bytes of each tensor of cache {cid}"),
        (_plan([0, 2], 0, BLOCK), f"local tensor 2 is out of range: cache {cid} has 2 tensors"),
        (_plan([0], 2**64 - 32, BLOCK), "lies outside"),  # offset + length wraps
        (_plan([0], 0, 0), "is empty"),
    ]
    for plan, why in bad:
        with pytest.raises(InvalidArgument) as err:
            core.prepare(write=False, cluster_id=PROMPT_ID, kind=int(key.kind), a=key.a, b=key.b,
                         c=key.c, unit_bytes=BLOCK, flags=0, cache_id=cache.cache_id,
                         remote_tensors=plan.remote_tensors, remote_offsets=plan.remote_offsets,
                         lengths=plan.lengths, local_tensors=plan.local_tensors,
                         local_offsets=plan.local_offsets)
        assert why in str(err.value)
        with pytest.raises(InvalidArgument, match="local"):
            d.engine.pull(PROMPT_ID, key, BLOCK, plan, cache.cache_id)
    with pytest.raises(CacheNotFound):
        plan = _plan([0], 0, BLOCK)
        core.prepare(write=False, cluster_id=PROMPT_ID, kind=int(key.kind), a=key.a, b=key.b,
                     c=key.c, unit_bytes=BLOCK, flags=0, cache_id=cache.cache_id + 100,
                     remote_tensors=plan.remote_tensors, remote_offsets=plan.remote_offsets,
                     lengths=plan.lengths, local_tensors=plan.local_tensors,
                     local_offsets=plan.local_offsets)
    assert not rows.any(), "a refused transfer wrote"
    # the last block, exactly: moved
    d.engine.pull(PROMPT_ID, key, BLOCK, _plan([0, 1], (BLOCKS - 1) * BLOCK, BLOCK),
                  cache.cache_id)
    assert rows[:, (BLOCKS - 1) * BLOCK:BLOCKS * BLOCK].any()
    assert not rows[:, BLOCKS * BLOCK:].any()


def test_no_raw_address_entry_point_is_left_for_transfers(pair):
    """``Engine.prepare`` takes keyword arguments only, and no ``local`` iovec array."""
    _, d = pair
    with pytest.raises(TypeError):
        d.engine._core.prepare(False, PROMPT_ID)  # type: ignore[call-arg]
    doc = d.engine._core.prepare.__doc__ or ""
    assert "cache_id" in doc and "local:" not in doc


def _until(cond: Callable[[], bool], seconds: float = 20.0) -> bool:
    """Polls ``cond`` until it holds or ``seconds`` pass (a state the core reaches on
    another thread); the caller asserts the outcome, never the time."""
    end = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.002)
    return True


def test_an_issued_pull_holds_its_cache_in_the_core_until_it_ends(make_side):
    """An issued pull that nobody polls, whose Python handle is dropped, still holds its
    destination (the core's task owns the hold): removing the cache waits for the transfer's
    end and returns once it ends; a prepared call for it is refused afterwards and moves
    nothing.

    The transfer ends when the test says, not at a deadline: its owner never answers and its
    deadline (PULL_DEADLINE_S) lies past the test's own timeout and past remove_cache's wait,
    so the pull is in flight for every check below however slowly this process runs, and only
    closing the owner's connection ends it. remove_cache returning at all (within its wait,
    which is shorter than the pull's deadline) shows it returned for the transfer's end."""
    d = make_side(DECODER_ID, role=2, sync_timeout=PULL_DEADLINE_S)
    cache, rows = _guarded(d)
    key = llm.CacheKeyByIdAndIndex(SILENT_ID, 1, 0)
    with SilentOwner(SILENT_ID) as owner:
        d.engine.link(SILENT_ID, *owner.address, 5.0)
        handle = d.cm.pull_blocks_async(key, cache, [], [0])
        del handle
        gc.collect()
        assert d.engine.leases(cache.cache_id) == 1, "the issued pull holds its destination"
        removed: list[float] = []
        failed: list[BaseException] = []

        def remove() -> None:
            try:
                d.engine._core.remove_cache(cache.cache_id, REMOVE_WAIT_S)
                removed.append(time.monotonic())
            except BaseException as e:  # noqa: BLE001 - reported by the test's thread
                failed.append(e)

        remover = threading.Thread(target=remove)
        remover.start()
        # remove_cache has begun (the cache is closing: no new lease) and waits for the pull
        assert _until(lambda: not d.engine.filed(cache.cache_id) or not remover.is_alive())
        assert remover.is_alive() and not removed and not failed, (removed, failed)
        assert d.engine.leases(cache.cache_id) == 1, "still held while the pull is in flight"
        ended = time.monotonic()
        owner.close()  # the pull fails at once (its connection shut down) and lets go
        remover.join(REMOVE_WAIT_S + 10)
        assert not failed, failed
        assert removed, "remove_cache did not return once the pull ended"
        assert removed[0] >= ended  # it returned after the pull's end, not before
    assert not d.engine.filed(cache.cache_id)
    with pytest.raises(llm.LLMException) as err:
        d.cm.pull_blocks(key, cache, [], [0])
    assert err.value.status_code == llm.LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    assert not rows.any()
