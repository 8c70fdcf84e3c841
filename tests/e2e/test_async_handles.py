"""Issued transfers (``pull_cache_async`` and its siblings) between two real processes.

The decoder (this process) issues pulls and pushes through the public API and polls or waits
on the ``datadist.TransferHandle`` s; the prompt is a spawned child (``prompt`` fixture) or a
fake owner that fails mid-transfer on cue. Nothing here names an engine: the same tests run
on whichever engine ``LLMDataDist`` selects.

What a handle promises (docs/compatibility.md, "Issued transfers"): the bytes of the blocking
call; argument errors raised at the call, before anything is issued; every failure of the
transfer itself raised by ``wait`` with the blocking call's status code; ``wait(timeout)``
expiring raises TimeoutError and leaves the transfer running; a bounded number of threads
whatever the number of handles; finalize ends every handle.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

import datadist as llm_datadist
from datadist.testing.fakes import fake_owner_main
from datadist.testing.peers import CacheSpec, Decoder, PromptConfig, RunningPrompt, pattern
from datadist.testing.procs import Peer

from ._support import PROMPT_ENV, PROMPT_ID, assert_bytes_equal, assert_zero, units

pytestmark = pytest.mark.timeout(60)

P = PROMPT_ID
S = llm_datadist.LLMStatusCode
SLOTS = CacheSpec(4, (4, 8, 64))  # 4 tensors, 4 slots of 1 KiB
BLOCKS = CacheSpec(4, (256, 2, 64))  # 256 blocks of 256 B per tensor
SEED_SLOTS, SEED_BLOCKS = 11, 12
BLOCKS_MODEL = 3
SLOTS_ID = 1
FAKE_ID = PROMPT_ID + 7
SYNC_KV_TIMEOUT_MS = 500
BOUND_S = 10.0  # 20x the timeout: only that the deadline is honoured at all

PROMPT_CONFIG = PromptConfig(
    PROMPT_ID, remote_cache_accessible=True,
    setup=(("register_cache", {"spec": SLOTS, "seed": SEED_SLOTS}),
           ("register_blocks_cache", {"spec": BLOCKS, "seed": SEED_BLOCKS,
                                      "model_id": BLOCKS_MODEL})))


def _code(call: Callable[[], object]) -> object:
    """The status code of the LLMException ``call`` raises."""
    with pytest.raises(llm_datadist.LLMException) as err:
        call()
    return err.value.status_code


def _failed(handle: llm_datadist.TransferHandle) -> llm_datadist.LLMException:
    """``handle.wait()`` raises its LLMException, which status and exception() agree on."""
    with pytest.raises(llm_datadist.LLMException) as err:
        handle.wait(BOUND_S)
    assert handle.done()
    assert handle.exception() is err.value
    assert handle.status == err.value.status_code
    return err.value


# ================================================================================ results


def test_pull_cache_async_moves_the_blocking_calls_bytes(decoder: Decoder) -> None:
    want = units(pattern(SLOTS, SEED_SLOTS), SLOTS)
    blocking, arr_b = decoder.local(SLOTS)
    issued, arr_i = decoder.local(SLOTS)
    key = llm_datadist.CacheKeyByIdAndIndex(P, SLOTS_ID, 2)
    decoder.cm.pull_cache(key, blocking, 1, src_layer_range=range(1, 2),
                          dst_layer_range=range(1, 2))
    handle = decoder.cm.pull_cache_async(key, issued, 1, src_layer_range=range(1, 2),
                                         dst_layer_range=range(1, 2))
    assert isinstance(handle, llm_datadist.TransferHandle)
    assert handle.wait(BOUND_S) is None
    assert handle.done() and handle.status == S.LLM_SUCCESS and handle.exception() is None
    assert_bytes_equal(arr_i, arr_b)
    assert_bytes_equal(units(arr_i, SLOTS)[2:, 1], want[2:, 2])
    assert_zero(units(arr_i, SLOTS)[:2])
    assert_zero(units(arr_i, SLOTS)[:, [0, 2, 3]])


def test_pull_blocks_async_moves_the_blocking_calls_bytes(decoder: Decoder) -> None:
    want = units(pattern(BLOCKS, SEED_BLOCKS), BLOCKS)
    blocking, arr_b = decoder.local(BLOCKS, blocks=True)
    issued, arr_i = decoder.local(BLOCKS, blocks=True)
    key = llm_datadist.BlocksCacheKey(P, BLOCKS_MODEL)
    src, dst = [5, 200, 17, 3], [0, 9, 255, 4]
    decoder.cm.pull_blocks(key, blocking, src, dst)
    llm_datadist.reset_metrics()
    handle = decoder.cm.pull_blocks_async(key, issued, src, dst)
    handle.wait()
    assert_bytes_equal(arr_i, arr_b)
    pulls = llm_datadist.metrics()["total"]["pull"]  # counted as a blocking pull is
    assert (pulls["transfers"], pulls["bytes"]) == (1, len(src) * BLOCKS.num_tensors *
                                                   BLOCKS.unit_bytes)
    assert_bytes_equal(units(arr_i, BLOCKS)[:, dst], want[:, src])


def test_push_blocks_async_lands_in_the_owner(transport: str, make_decoder: Callable[..., Decoder],
                                              prompt: RunningPrompt) -> None:
    dec = make_decoder(remote_cache_accessible=True)
    assert dec.link(P, prompt.address) == S.LLM_SUCCESS
    src, arr = dec.local(BLOCKS, blocks=True)
    arr[...] = np.random.default_rng(7).integers(0, 256, arr.shape, dtype=np.uint8)
    key = llm_datadist.BlocksCacheKey(P, BLOCKS_MODEL)
    # blocks 240.. of the owner, two per transport: no other test reads them
    dst = [240 + 2 * _RUN.index(transport), 241 + 2 * _RUN.index(transport)]
    dec.cm.push_blocks_async(key, src, [1, 2], dst).wait(BOUND_S)
    back, got = dec.local(BLOCKS, blocks=True)
    dec.cm.pull_blocks(key, back, dst, [1, 2])
    assert_bytes_equal(units(got, BLOCKS)[:, [1, 2]], units(arr, BLOCKS)[:, [1, 2]])


_RUN = ["tcp", "cma", "shm", "nixl"]  # a region of the owner's blocks per transport


def test_many_handles_in_flight_on_a_bounded_number_of_threads(decoder: Decoder) -> None:
    want = units(pattern(BLOCKS, SEED_BLOCKS), BLOCKS)
    cache, arr = decoder.local(BLOCKS, blocks=True)
    key = llm_datadist.BlocksCacheKey(P, BLOCKS_MODEL)
    before = threading.active_count()
    handles = [decoder.cm.pull_blocks_async(key, cache, [i], [255 - i]) for i in range(200)]
    peak = threading.active_count()
    polls = 0
    while not all(h.done() for h in handles):  # post, then check: a polling loop
        peak = max(peak, threading.active_count())
        polls += 1
        time.sleep(0.001)
    for h in handles:
        h.wait()
        assert h.status == S.LLM_SUCCESS
    assert peak - before <= 8, f"{peak - before} threads for 200 handles"
    assert_bytes_equal(units(arr, BLOCKS)[:, 255 - np.arange(200)], want[:, :200])


# ================================================================================ errors


def test_argument_errors_are_raised_at_the_call_and_issue_nothing(decoder: Decoder) -> None:
    cache, arr = decoder.local(SLOTS)
    blocks, _ = decoder.local(BLOCKS, blocks=True)
    key = llm_datadist.CacheKeyByIdAndIndex(P, SLOTS_ID, 0)
    cm = decoder.cm
    llm_datadist.reset_metrics()
    with pytest.raises(TypeError):
        cm.pull_cache_async(None, cache)
    with pytest.raises(TypeError):
        cm.pull_blocks_async(key, "cache", [], [1])
    with pytest.raises(ValueError, match="batch_index"):
        cm.pull_cache_async(key, cache, -1)
    with pytest.raises(TypeError):
        cm.pull_cache_async(key, cache, src_layer_range=[0])
    for call in (
        lambda: cm.pull_cache_async(key, cache, size=0),  # size 0
        lambda: cm.pull_cache_async(llm_datadist.CacheKeyByIdAndIndex(decoder.dd.cluster_id, 1,
                                                                      0), cache),  # own id
        lambda: cm.pull_blocks_async(llm_datadist.BlocksCacheKey(P, BLOCKS_MODEL), blocks,
                                     [1], []),  # no dst blocks
        lambda: cm.pull_blocks_async(key, cache, [], [1]),  # not a blocks cache
        lambda: cm.push_cache_async(key, cache),  # not remote-cache-accessible
    ):
        assert _code(call) == S.LLM_PARAM_INVALID
    # every error above has the blocking call's type and code
    assert _code(lambda: cm.pull_cache(key, cache, size=0)) == S.LLM_PARAM_INVALID
    assert _code(lambda: cm.push_cache(key, cache)) == S.LLM_PARAM_INVALID
    cm.unregister_cache(cache.cache_id)
    assert _code(lambda: cm.pull_cache_async(key, cache)) == S.LLM_KV_CACHE_NOT_EXIST
    assert llm_datadist.metrics()["total"] == {}, "an argument error issued a transfer"
    assert_zero(arr)


def test_not_linked_and_unknown_remote_cache_fail_the_handle_as_the_blocking_call(
        decoder: Decoder) -> None:
    cache, arr = decoder.local(SLOTS)
    for key in (llm_datadist.CacheKeyByIdAndIndex(P + 55, SLOTS_ID, 0),  # never linked
                llm_datadist.CacheKeyByIdAndIndex(P, 77, 0)):  # no such cache there
        want = _code(lambda key=key: decoder.cm.pull_cache(key, cache))
        assert want in (S.LLM_NOT_YET_LINK, S.LLM_KV_CACHE_NOT_EXIST)
        assert _failed(decoder.cm.pull_cache_async(key, cache)).status_code == want
    blocks, _ = decoder.local(BLOCKS, blocks=True)
    unknown_model = llm_datadist.BlocksCacheKey(P, BLOCKS_MODEL + 100)
    want = _code(lambda: decoder.cm.pull_blocks(unknown_model, blocks, [0], [0]))
    assert _failed(decoder.cm.pull_blocks_async(unknown_model, blocks, [0], [0])).status_code \
        == want == S.LLM_KV_CACHE_NOT_EXIST
    assert_zero(arr)


@pytest.mark.parametrize(("behaviour", "codes"), [
    ("stall", {S.LLM_TIMEOUT}),
    ("exit", {S.LLM_LINK_FAILED}),
])
def test_owner_failing_mid_transfer_fails_the_handle_in_time(
        behaviour: str, codes: set[object], make_decoder: Callable[..., Decoder],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A fake owner sends part of the bytes, then stalls (the transfer's own deadline:
    LLM_TIMEOUT) or exits (LLM_LINK_FAILED). ``wait`` with a short timeout first says the
    transfer is still running (TimeoutError) without ending it."""
    monkeypatch.setenv("DATADIST_TRANSPORT", "tcp")
    with Peer(fake_owner_main, FAKE_ID, behaviour, env=PROMPT_ENV) as fake:
        address = tuple(fake.recv(timeout=10))
        dec = make_decoder(sync_kv_timeout=SYNC_KV_TIMEOUT_MS)
        assert dec.link(FAKE_ID, address) == S.LLM_SUCCESS  # type: ignore[arg-type]
        cache, _ = dec.local(SLOTS)
        start = time.monotonic()
        handle = dec.cm.pull_cache_async(llm_datadist.CacheKeyByIdAndIndex(FAKE_ID, 1, 0),
                                         cache)
        assert fake.recv(timeout=10) == "partial"
        if behaviour == "stall":
            assert not handle.done() and handle.status is None
            with pytest.raises(TimeoutError):
                handle.wait(0.01)
            assert handle.exception() is None
        err = _failed(handle)
        assert err.status_code in codes, err
        assert not isinstance(err, TimeoutError)
        assert time.monotonic() - start < BOUND_S


def test_unregister_waits_for_an_issued_transfer_as_for_a_blocking_one(
        make_decoder: Callable[..., Decoder], monkeypatch: pytest.MonkeyPatch) -> None:
    """The local cache is held while the handle runs: unregister_cache returns only once the
    transfer has ended (here by its deadline), as it does under a blocking pull in another
    thread."""
    monkeypatch.setenv("DATADIST_TRANSPORT", "tcp")
    with Peer(fake_owner_main, FAKE_ID, "stall", env=PROMPT_ENV) as fake:
        address = tuple(fake.recv(timeout=10))
        dec = make_decoder(sync_kv_timeout=SYNC_KV_TIMEOUT_MS)
        assert dec.link(FAKE_ID, address) == S.LLM_SUCCESS  # type: ignore[arg-type]
        cache, _ = dec.local(SLOTS)
        handle = dec.cm.pull_cache_async(llm_datadist.CacheKeyByIdAndIndex(FAKE_ID, 1, 0),
                                         cache)
        assert fake.recv(timeout=10) == "partial"
        assert not handle.done()
        start = time.monotonic()
        dec.cm.unregister_cache(cache.cache_id)
        assert handle.done()
        # woken by the transfer's end (its deadline, 0.5 s), not by unregister's own bound
        assert time.monotonic() - start < BOUND_S
        assert _failed(handle).status_code == S.LLM_TIMEOUT


def test_wait_checks_its_timeout(decoder: Decoder) -> None:
    cache, _ = decoder.local(SLOTS)
    handle = decoder.cm.pull_cache_async(llm_datadist.CacheKeyByIdAndIndex(P, SLOTS_ID, 0),
                                         cache)
    with pytest.raises(TypeError):
        handle.wait("1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout"):
        handle.wait(-1)
    handle.wait(BOUND_S)
    handle.wait(0)  # a finished handle: returns at once, again
    assert "SUCCESS" in repr(handle)


# ================================================================================ finalize


def test_finalize_ends_every_handle_in_flight(transport: str, prompt: RunningPrompt) -> None:
    dec = Decoder(200 + 1)
    try:
        assert dec.link(P, prompt.address) == S.LLM_SUCCESS
        cache, _ = dec.local(BLOCKS, blocks=True)
        key = llm_datadist.BlocksCacheKey(P, BLOCKS_MODEL)
        handles = [dec.cm.pull_blocks_async(key, cache, list(range(64)), list(range(64)))
                   for _ in range(100)]
    finally:
        dec.dd.finalize()
    codes = set()
    for h in handles:
        try:
            h.wait(BOUND_S)
        except llm_datadist.LLMException as e:
            codes.add(e.status_code)
        else:
            codes.add(S.LLM_SUCCESS)
    # finished before finalize, failed by it (queued: ENGINE_FINALIZED; running: the link
    # it closed), never left running
    assert codes <= {S.LLM_SUCCESS, S.LLM_ENGINE_FINALIZED, S.LLM_LINK_FAILED, S.LLM_FAILED,
                     S.LLM_NOT_YET_LINK}, codes
    with pytest.raises(llm_datadist.LLMException) as err:
        dec.cm.pull_blocks_async(key, cache, [0], [0])
    # the finalized manager's code, the original's wrapper's (api/cache_manager.py)
    assert err.value.status_code == S.LLM_PARAM_INVALID and "finalized" in str(err.value)


def test_finalize_fails_handles_waiting_on_a_silent_owner(monkeypatch: pytest.MonkeyPatch) -> None:
    """Handles issued to an owner that went silent mid-transfer: finalize fails every one of
    them at once (those not started: LLM_ENGINE_FINALIZED; the running ones through their
    closed link), without waiting for their deadlines, and never leaves one running."""
    monkeypatch.setenv("DATADIST_TRANSPORT", "tcp")
    with Peer(fake_owner_main, FAKE_ID, "stall", env=PROMPT_ENV) as fake:
        address = tuple(fake.recv(timeout=10))
        dec = Decoder(200 + 2, sync_kv_timeout=60_000)  # deadlines far beyond this test
        try:
            assert dec.link(FAKE_ID, address) == S.LLM_SUCCESS  # type: ignore[arg-type]
            cache, _ = dec.local(SLOTS)
            key = llm_datadist.CacheKeyByIdAndIndex(FAKE_ID, 1, 0)
            handles = [dec.cm.pull_cache_async(key, cache) for _ in range(20)]
            assert fake.recv(timeout=10) == "partial"
            assert not any(h.done() for h in handles)
            start = time.monotonic()
        finally:
            dec.dd.finalize()
        for h in handles:
            err = _failed(h)
            assert err.status_code in (S.LLM_ENGINE_FINALIZED, S.LLM_LINK_FAILED,
                                       S.LLM_FAILED), err
        assert time.monotonic() - start < BOUND_S
