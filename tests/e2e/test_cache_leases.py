"""Whole-cache leases between two real processes (same host; docs/protocol.md, "Cache
leases"): a reader pulling a cache named by id or BlocksCacheKey asks its owner once, then
copies by itself; every owner-side change of what the key names (unregister, deallocate, a
model id bound anew) revokes the lease first, so a pull never returns bytes the key no longer
names. Every byte checked.
"""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest

import datadist as llm_datadist
from datadist.testing.peers import CacheSpec, Decoder, PromptConfig, RunningPrompt, pattern

from ._support import PROMPT_ID, assert_bytes_equal, units

pytestmark = pytest.mark.timeout(60)

P = PROMPT_ID
S = llm_datadist.LLMStatusCode
BLOCKS = CacheSpec(2, (64, 4, 64))  # 64 blocks of 512 B per tensor
SLOTS = CacheSpec(4, (4, 8, 64))  # contiguous, 1024 B slots
PROMPT_CONFIG = PromptConfig(PROMPT_ID, host_pool_bytes=16 << 20)
PROMPT_SERVES_NIXL = False  # cma and shm only; its owner refuses remote writes
_models = itertools.count(100)
_seeds = itertools.count(50)
MAX_LEASES = 64  # whole-cache leases a reader keeps per connection (cpp/src/link.h kMaxLeases)


@pytest.fixture(params=["cma", "shm"])
def transport(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("DATADIST_TRANSPORT", request.param)
    return str(request.param)


def served(decoder: Decoder, op: str) -> int:
    """How many requests of kind ``op`` the prompt has served (its metrics, over the link)."""
    stats = decoder.dd.engine.peer_stats(P, 5.0)
    return int(stats["total"].get(op, {}).get("transfers", 0))


def pull_blocks(decoder: Decoder, model: int, src: list[int], dst: list[int]) -> np.ndarray:
    cache, arr = decoder.local(BLOCKS, blocks=True)
    decoder.cm.pull_blocks(llm_datadist.BlocksCacheKey(P, model), cache, src, dst)
    return units(arr, BLOCKS)


def want_blocks(seed: int) -> np.ndarray:
    return units(pattern(BLOCKS, seed), BLOCKS)


def test_repeated_pulls_ask_the_owner_once(decoder: Decoder, prompt: RunningPrompt) -> None:
    model, seed = next(_models), next(_seeds)
    prompt.call("register_blocks_cache", spec=BLOCKS, seed=seed, model_id=model)
    reads, leases = served(decoder, "serve_read"), served(decoder, "serve_lease")
    cache, arr = decoder.local(BLOCKS, blocks=True)
    key = llm_datadist.BlocksCacheKey(P, model)
    for i in range(40):
        decoder.cm.pull_blocks(key, cache, [i % 64, (i * 7) % 64], [(i * 3) % 64, 63 - i % 32])
        got = units(arr, BLOCKS)
        assert_bytes_equal(got[:, (i * 3) % 64], want_blocks(seed)[:, i % 64])
        assert_bytes_equal(got[:, 63 - i % 32], want_blocks(seed)[:, (i * 7) % 64])
    assert served(decoder, "serve_lease") == leases + 1
    assert served(decoder, "serve_read") == reads  # no read asked the owner


def test_unregister_revokes_the_lease(decoder: Decoder, prompt: RunningPrompt) -> None:
    model, seed, seed2 = next(_models), next(_seeds), next(_seeds)
    cid = prompt.call("register_blocks_cache", spec=BLOCKS, seed=seed, model_id=model)
    assert_bytes_equal(pull_blocks(decoder, model, [3], [4])[:, 4], want_blocks(seed)[:, 3])
    prompt.call("unregister_cache", cache_id=cid)
    with pytest.raises(llm_datadist.LLMException) as e:
        pull_blocks(decoder, model, [3], [4])
    assert e.value.status_code == S.LLM_KV_CACHE_NOT_EXIST
    prompt.call("register_blocks_cache", spec=BLOCKS, seed=seed2, model_id=model)
    assert_bytes_equal(pull_blocks(decoder, model, [3], [4])[:, 4], want_blocks(seed2)[:, 3])


def test_a_model_id_bound_anew_is_read_anew(decoder: Decoder, prompt: RunningPrompt) -> None:
    model, seed, seed2 = next(_models), next(_seeds), next(_seeds)
    prompt.call("register_blocks_cache", spec=BLOCKS, seed=seed, model_id=model)
    assert_bytes_equal(pull_blocks(decoder, model, [9], [1])[:, 1], want_blocks(seed)[:, 9])
    prompt.call("register_blocks_cache", spec=BLOCKS, seed=seed2, model_id=model)  # last wins
    assert_bytes_equal(pull_blocks(decoder, model, [9], [1])[:, 1], want_blocks(seed2)[:, 9])


def test_pool_memory_handed_back_is_not_read(decoder: Decoder, prompt: RunningPrompt) -> None:
    model, seed, seed2 = next(_models), next(_seeds), next(_seeds)
    cid = prompt.call("allocate_blocks_cache", spec=BLOCKS, seed=seed, model_id=model)
    assert_bytes_equal(pull_blocks(decoder, model, [0, 63], [2, 5])[:, [2, 5]],
                       want_blocks(seed)[:, [0, 63]])
    prompt.call("deallocate_blocks_cache", cache_id=cid)
    with pytest.raises(llm_datadist.LLMException) as e:
        pull_blocks(decoder, model, [0], [2])
    assert e.value.status_code == S.LLM_KV_CACHE_NOT_EXIST
    # the pool hands the same memory out again, with other bytes in it
    prompt.call("allocate_blocks_cache", spec=BLOCKS, seed=seed2, model_id=model)
    assert_bytes_equal(pull_blocks(decoder, model, [0, 63], [2, 5])[:, [2, 5]],
                       want_blocks(seed2)[:, [0, 63]])


def test_a_lease_by_cache_id_checks_what_the_owner_would(decoder: Decoder,
                                                         prompt: RunningPrompt) -> None:
    seed = next(_seeds)
    cid = prompt.call("register_cache", spec=SLOTS, seed=seed)
    cache, arr = decoder.local(SLOTS)
    key = llm_datadist.CacheKeyByIdAndIndex
    decoder.cm.pull_cache(key(P, cid, 2), cache, 1)
    decoder.cm.pull_cache(key(P, cid, 3), cache, batch_index=0, size=300)
    got, want = units(arr, SLOTS), units(pattern(SLOTS, seed), SLOTS)
    assert_bytes_equal(got[:, 1], want[:, 2])
    assert_bytes_equal(got[:, 0, :300], want[:, 3, :300])
    assert not got[:, 0, 300:].any() and not got[:, 2:].any()
    before = arr.copy()
    with pytest.raises(llm_datadist.LLMException) as e:  # the owner has 4 slots
        decoder.cm.pull_cache(key(P, cid, 4), cache, 2)
    assert e.value.status_code == S.LLM_PARAM_INVALID
    other = CacheSpec(4, (4, 8, 64), data_type="DT_INT16")  # same bytes, another type
    cache2, arr2 = decoder.local(other)
    with pytest.raises(llm_datadist.LLMException) as e:
        decoder.cm.pull_cache(key(P, cid, 0), cache2, 0)
    assert e.value.status_code == S.LLM_PARAM_INVALID
    assert np.array_equal(arr, before) and not arr2.any()  # nothing written by refusals


def test_a_killed_owner_is_an_error_not_stale_bytes(make_decoder, transport: str) -> None:
    from datadist.testing.peers import start_prompt

    from ._support import PROMPT_ENV

    owner = start_prompt(PromptConfig(P + 7), env=PROMPT_ENV)
    model, seed = next(_models), next(_seeds)
    try:
        owner.call("register_blocks_cache", spec=BLOCKS, seed=seed, model_id=model)
        dec = make_decoder(sync_kv_timeout=1500)
        assert dec.link(owner.cluster_id, owner.address) == S.LLM_SUCCESS
        cache, arr = dec.local(BLOCKS, blocks=True)
        key = llm_datadist.BlocksCacheKey(owner.cluster_id, model)
        dec.cm.pull_blocks(key, cache, [1], [1])
        assert_bytes_equal(units(arr, BLOCKS)[:, 1], want_blocks(seed)[:, 1])
        owner.peer.kill()
        arr[:] = 0
        with pytest.raises(llm_datadist.LLMException) as e:
            dec.cm.pull_blocks(key, cache, [2], [2])
        assert e.value.status_code in (S.LLM_LINK_FAILED, S.LLM_TIMEOUT)
        assert not arr.any()
    finally:
        owner.close()


def test_pushes_write_under_a_lease_and_stop_with_the_cache(make_decoder, transport: str) -> None:
    """push_blocks into a remote-cache-accessible owner on the same host: one lease, then
    process_vm_writev into checked spans; unregistered, the cache is not written any more."""
    from datadist.testing.peers import start_prompt

    from ._support import PROMPT_ENV

    owner = start_prompt(PromptConfig(P + 8, remote_cache_accessible=True), env=PROMPT_ENV)
    model, seed = next(_models), next(_seeds)
    try:
        cid = owner.call("register_blocks_cache", spec=BLOCKS, seed=seed, model_id=model)
        dec = make_decoder(remote_cache_accessible=True)
        assert dec.link(owner.cluster_id, owner.address) == S.LLM_SUCCESS
        src, data = dec.local(BLOCKS, blocks=True)
        data[:] = np.random.default_rng(9).integers(0, 256, data.shape, dtype=np.uint8)
        key = llm_datadist.BlocksCacheKey(owner.cluster_id, model)
        writes = int(dec.dd.engine.peer_stats(owner.cluster_id, 5.0)["total"]
                     .get("serve_write", {}).get("transfers", 0))
        for i in range(8):
            dec.cm.push_blocks(key, src, [i], [60 - i])
        back, got = dec.local(BLOCKS, blocks=True)
        dec.cm.pull_blocks(key, back, list(range(64)), list(range(64)))
        want = want_blocks(seed).copy()
        want[:, [60 - i for i in range(8)]] = units(data, BLOCKS)[:, list(range(8))]
        assert_bytes_equal(units(got, BLOCKS), want)
        stats = dec.dd.engine.peer_stats(owner.cluster_id, 5.0)["total"]
        assert int(stats.get("serve_write", {}).get("transfers", 0)) == writes  # none asked
        owner.call("unregister_cache", cache_id=cid)
        with pytest.raises(llm_datadist.LLMException) as e:
            dec.cm.push_blocks(key, src, [0], [0])
        assert e.value.status_code == S.LLM_KV_CACHE_NOT_EXIST
    finally:
        owner.close()


def test_an_owner_not_remote_accessible_refuses_write_leases(decoder: Decoder,
                                                             prompt: RunningPrompt) -> None:
    model = next(_models)
    prompt.call("register_blocks_cache", spec=BLOCKS, seed=next(_seeds), model_id=model)
    decoder.cm._enable_remote_cache_accessible = True  # the pusher's own switch, not the owner's
    src, _ = decoder.local(BLOCKS, blocks=True)
    with pytest.raises(llm_datadist.LLMException) as e:
        decoder.cm.push_blocks(llm_datadist.BlocksCacheKey(P, model), src, [0], [0])
    assert e.value.status_code == S.LLM_PARAM_INVALID


def test_a_lease_of_a_cache_the_key_no_longer_names_is_not_checked_against(
        decoder: Decoder, prompt: RunningPrompt) -> None:
    """Model id bound anew to a bigger cache: a block only the new cache has is read from it
    (the stale lease's geometry must not refuse it)."""
    big = CacheSpec(2, (128, 4, 64))
    model, seed, seed2 = next(_models), next(_seeds), next(_seeds)
    prompt.call("register_blocks_cache", spec=BLOCKS, seed=seed, model_id=model)
    assert_bytes_equal(pull_blocks(decoder, model, [3], [4])[:, 4], want_blocks(seed)[:, 3])
    prompt.call("register_blocks_cache", spec=big, seed=seed2, model_id=model)
    cache, arr = decoder.local(BLOCKS, blocks=True)
    decoder.cm.pull_blocks(llm_datadist.BlocksCacheKey(P, model), cache, [100], [7])
    assert_bytes_equal(units(arr, BLOCKS)[:, 7], units(pattern(big, seed2), big)[:, 100])


def test_a_reader_keeps_a_bounded_number_of_leases(decoder: Decoder,
                                                   prompt: RunningPrompt) -> None:
    """One cache per request, each pulled by id once: the reader drops the lease of a cache
    that went (at its next lease) and, beyond MAX_LEASES, its oldest ones. Each lease holds a
    descriptor (its fence), so the process's descriptors show how many it keeps."""
    cache, arr = decoder.local(SLOTS)

    def pull_one(i: int) -> int:
        seed = next(_seeds)
        cid = int(prompt.call("register_cache", spec=SLOTS, seed=seed))
        decoder.cm.pull_cache(llm_datadist.CacheKeyByIdAndIndex(P, cid, i % 4), cache, 0)
        assert_bytes_equal(units(arr, SLOTS)[:, 0], units(pattern(SLOTS, seed), SLOTS)[:, i % 4])
        return cid

    fds0 = len(os.listdir("/proc/self/fd"))
    for i in range(MAX_LEASES // 2):  # each freed before the next: no lease outlives its cache
        prompt.call("unregister_cache", cache_id=pull_one(i))
    grown = len(os.listdir("/proc/self/fd")) - fds0
    assert grown <= 8, f"{grown} descriptors kept for caches that went"
    kept = [pull_one(i) for i in range(2 * MAX_LEASES)]  # all kept: the oldest leases go
    grown = len(os.listdir("/proc/self/fd")) - fds0
    assert grown <= MAX_LEASES + 8, f"{grown} descriptors kept for {MAX_LEASES} leases at most"
    for cid in kept:
        prompt.call("unregister_cache", cache_id=cid)
