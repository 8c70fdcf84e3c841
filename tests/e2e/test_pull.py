"""Pulls between two real processes, every byte checked, on every data path.

The prompt (a spawned child, ``import datadist as llm_datadist`` like any client) registers
its caches at start-up so that they get cache ids 1, 2, ... as old clients expect; the
decoder (this process) links with ``link_clusters`` to the address the prompt reports and
pulls with the public API. Cache contents are seeded random bytes; the decoder recomputes them
and compares with numpy, including the bytes that must *not* have been written.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import datadist as llm_datadist
from datadist.testing.peers import CacheSpec, Decoder, PromptConfig, RunningPrompt, pattern

from ._support import PROMPT_ID, assert_bytes_equal, assert_zero, units

pytestmark = pytest.mark.timeout(30)

P = PROMPT_ID
S = llm_datadist.LLMStatusCode

# Prompt caches (fp16). Contiguous: dim 0 is the batch. Blocks: dim 0 is the block count.
LEGACY = CacheSpec(4, (4, 8, 64))  # 4 tensors = 2 layers of K,V; slot 1024 B
KEYED = CacheSpec(4, (4, 8, 64))  # same geometry, slots bound to req_ids
LAYERED = CacheSpec(8, (2, 16, 32))  # 8 tensors = 4 layers; slot 1024 B
BLOCKS = CacheSpec(4, (4096, 2, 64))  # 4096 blocks of 256 B per tensor
SEED = {"legacy": 1, "keyed": 2, "layered": 3, "blocks": 4}
BLOCKS_MODEL = 7

PROMPT_CONFIG = PromptConfig(
    PROMPT_ID,
    host_pool_bytes=16 << 20,
    setup=(
        ("register_cache", {"spec": LEGACY, "seed": SEED["legacy"]}),
        ("register_cache", {"spec": KEYED, "seed": SEED["keyed"], "req_ids": [11, 12, None, 13]}),
        ("register_cache", {"spec": LAYERED, "seed": SEED["layered"], "req_ids": [21, 22]}),
        ("register_blocks_cache", {"spec": BLOCKS, "seed": SEED["blocks"],
                                   "model_id": BLOCKS_MODEL}),
    ),
)
LEGACY_ID = 1  # hard-coded, as clients of the old API do
LAYERED_ID = 3

_fresh_ids = itertools.count(1000)


def remote(spec: CacheSpec, seed: int) -> np.ndarray:
    """What the prompt holds, as (tensor, unit, byte)."""
    return units(pattern(spec, seed), spec)


def test_setup_caches_get_ids_counting_from_one(prompt: RunningPrompt) -> None:
    assert prompt.setup == [1, 2, 3, 4]


def test_pull_cache_by_req_id(decoder: Decoder, transport: str) -> None:
    cache, arr = decoder.local(KEYED)
    decoder.cm.pull_cache(llm_datadist.CacheKey(prompt_cluster_id=P, req_id=12), cache,
                          batch_index=3)
    decoder.cm.pull_cache(llm_datadist.CacheKey(P, 13), cache, 0)

    got, want = units(arr, KEYED), remote(KEYED, SEED["keyed"])
    assert_bytes_equal(got[:, 3], want[:, 1])
    assert_bytes_equal(got[:, 0], want[:, 3])
    assert_zero(got[:, 1:3])
    assert llm_datadist.LLMDataDist.llm_engine_instance is decoder.dd
    assert decoder.dd.engine.links()[0].path_name == transport


def test_pull_cache_by_cache_id_with_batch_index_and_size(decoder: Decoder) -> None:
    cache, arr = decoder.local(LEGACY)
    key = llm_datadist.CacheKeyByIdAndIndex
    decoder.cm.pull_cache(key(P, LEGACY_ID, 2), cache, 0)
    decoder.cm.pull_cache(key(P, LEGACY_ID, 0), cache, batch_index=3)
    decoder.cm.pull_cache(key(P, LEGACY_ID, 3), cache, batch_index=1, size=300)

    got, want = units(arr, LEGACY), remote(LEGACY, SEED["legacy"])
    assert_bytes_equal(got[:, 0], want[:, 2])
    assert_bytes_equal(got[:, 3], want[:, 0])
    assert_bytes_equal(got[:, 1, :300], want[:, 3, :300])
    assert_zero(got[:, 1, 300:], "bytes past size")
    assert_zero(got[:, 2])


def test_pull_cache_with_layer_ranges(decoder: Decoder) -> None:
    want = remote(LAYERED, SEED["layered"])

    # src range only: it must cover the whole (2-layer) destination.
    small_spec = CacheSpec(4, LAYERED.shape)
    small, small_arr = decoder.local(small_spec)
    decoder.cm.pull_cache(llm_datadist.CacheKey(P, 22), small, 0, src_layer_range=range(1, 3))
    assert_bytes_equal(units(small_arr, small_spec)[:, 0], want[2:6, 1])

    # both ranges, by cache id, into slot 1 of a same-shaped cache.
    full, full_arr = decoder.local(LAYERED)
    decoder.cm.pull_cache(llm_datadist.CacheKeyByIdAndIndex(P, LAYERED_ID, 0), full, 1,
                          src_layer_range=range(2, 4), dst_layer_range=range(0, 2),
                          tensor_num_per_layer=2)
    # one tensor per layer: remote tensor 7 into local tensor 5.
    decoder.cm.pull_cache(llm_datadist.CacheKeyByIdAndIndex(P, LAYERED_ID, 1), full, 0,
                          src_layer_range=range(7, 8), dst_layer_range=range(5, 6),
                          tensor_num_per_layer=1)
    got = units(full_arr, LAYERED)
    assert_bytes_equal(got[0:4, 1], want[4:8, 0])
    assert_zero(got[4:8, 1])
    assert_bytes_equal(got[5, 0], want[7, 1])
    assert_zero(np.delete(got[:, 0], 5, axis=0))


@pytest.mark.parametrize("ranges", [False, True], ids=["all-layers", "layer-ranges"])
def test_pull_blocks_random_block_lists(decoder: Decoder, ranges: bool) -> None:
    rng = np.random.default_rng(99 + ranges)
    src = rng.choice(BLOCKS.units, size=3000, replace=False)
    dst = rng.choice(BLOCKS.units, size=3000, replace=False)
    cache, arr = decoder.local(BLOCKS, blocks=True)
    key = llm_datadist.BlocksCacheKey(P, BLOCKS_MODEL)
    if ranges:
        # tensor_num_per_layer=1: remote layers 1..2 land in local layers 2..3
        decoder.cm.pull_blocks(key, cache, src.tolist(), dst.tolist(),
                               src_layer_range=range(1, 3), dst_layer_range=range(2, 4),
                               tensor_num_per_layer=1)
        pairs, untouched_tensors = [(1, 2), (2, 3)], [0, 1]
    else:
        decoder.cm.pull_blocks(key, cache, src.tolist(), dst.tolist(), tensor_num_per_layer=1)
        pairs, untouched_tensors = [(t, t) for t in range(4)], []

    got, want = units(arr, BLOCKS), remote(BLOCKS, SEED["blocks"])
    for s, d in pairs:
        assert_bytes_equal(got[d][dst], want[s][src])
    unwritten = np.ones(BLOCKS.units, dtype=bool)
    unwritten[dst] = False
    assert_zero(got[:, unwritten], "blocks outside dst_blocks")
    assert_zero(got[untouched_tensors], "tensors outside dst_layer_range")


def test_pull_blocks_from_contiguous_cache(decoder: Decoder) -> None:
    # Local blocks of 256 B: one remote 1024 B slot is four blocks.
    spec = CacheSpec(4, (64, 128))
    cache, arr = decoder.local(spec, blocks=True)
    decoder.cm.pull_blocks(llm_datadist.CacheKey(P, 12), cache, (), [9, 3, 30, 4])
    decoder.cm.pull_blocks(llm_datadist.CacheKeyByIdAndIndex(P, LEGACY_ID, 2), cache,
                           dst_blocks=[40, 41, 42, 43])
    decoder.cm.pull_blocks(llm_datadist.CacheKey(P, 13), cache, (), [50, 51, 52, 53],
                           src_layer_range=range(1, 2), dst_layer_range=range(0, 1))

    got = units(arr, spec)
    keyed, legacy = remote(KEYED, SEED["keyed"]), remote(LEGACY, SEED["legacy"])

    def chunks(slot: np.ndarray) -> np.ndarray:  # (tensors, 1024) -> (tensors, 4, 256)
        return slot.reshape(slot.shape[0], 4, spec.unit_bytes)

    assert_bytes_equal(got[:, [9, 3, 30, 4]], chunks(keyed[:, 1]))
    assert_bytes_equal(got[:, 40:44], chunks(legacy[:, 2]))
    assert_bytes_equal(got[0:2, 50:54], chunks(keyed[2:4, 3]))
    assert_zero(got[2:4, 50:54])
    written = [9, 3, 30, 4, 40, 41, 42, 43, 50, 51, 52, 53]
    assert_zero(np.delete(got, written, axis=1), "blocks outside dst_blocks")


def test_pull_blocks_from_pool_blocks_cache(decoder: Decoder, prompt: RunningPrompt) -> None:
    """Pool memory is what the shm path maps; a few spans go by mapping, many by the
    fallback. After deallocate_blocks_cache the model id names nothing."""
    spec = CacheSpec(4, (256, 2, 64))
    model, seed = next(_fresh_ids), next(_fresh_ids)
    cache_id = prompt.call("allocate_blocks_cache", spec=spec, seed=seed, model_id=model)
    key = llm_datadist.BlocksCacheKey(P, model)
    cache, arr = decoder.local(spec, blocks=True)
    rng = np.random.default_rng(seed)
    many_src = rng.choice(spec.units, size=200, replace=False)
    many_dst = rng.choice(np.arange(8, spec.units), size=200, replace=False)

    decoder.cm.pull_blocks(key, cache, [5, 6, 7, 100], [0, 1, 2, 3])
    decoder.cm.pull_blocks(key, cache, many_src.tolist(), many_dst.tolist())
    prompt.call("deallocate_blocks_cache", cache_id=cache_id)
    with pytest.raises(llm_datadist.LLMException) as err:
        decoder.cm.pull_blocks(key, cache, [0], [4])
    assert err.value.status_code == S.LLM_KV_CACHE_NOT_EXIST

    got, want = units(arr, spec), remote(spec, seed)
    assert_bytes_equal(got[:, 0:4], want[:, [5, 6, 7, 100]])
    assert_bytes_equal(got[:, many_dst], want[:, many_src])
    written = np.concatenate(([0, 1, 2, 3], many_dst))
    assert_zero(np.delete(got, written, axis=1), "blocks outside dst_blocks")


def test_pool_req_id_key_is_consumed_by_one_pull(decoder: Decoder,
                                                 prompt: RunningPrompt) -> None:
    req, seed = next(_fresh_ids), next(_fresh_ids)
    cache_id = prompt.call("allocate_cache", spec=KEYED, seed=seed, req_ids=[None, req])
    cache, arr = decoder.local(KEYED)
    key = llm_datadist.CacheKey(P, req)

    decoder.cm.pull_cache(key, cache, 0)
    with pytest.raises(llm_datadist.LLMException) as err:
        decoder.cm.pull_cache(key, cache, 2)
    assert err.value.status_code == S.LLM_KV_CACHE_NOT_EXIST
    prompt.call("remove_cache_key", req_id=req)  # already consumed: a no-op, no error
    prompt.call("deallocate_cache", cache_id=cache_id)
    with pytest.raises(llm_datadist.LLMException) as err:
        decoder.cm.pull_cache(key, cache, 3)
    assert err.value.status_code == S.LLM_KV_CACHE_NOT_EXIST

    got = units(arr, KEYED)
    assert_bytes_equal(got[:, 0], remote(KEYED, seed)[:, 1])
    assert_zero(got[:, 1:], "bytes of failed pulls")


def test_pool_key_is_consumed_once_every_layer_was_pulled(decoder: Decoder,
                                                          prompt: RunningPrompt) -> None:
    req, seed = next(_fresh_ids), next(_fresh_ids)
    cache_id = prompt.call("allocate_cache", spec=LAYERED, seed=seed, req_ids=[req])
    half = CacheSpec(4, LAYERED.shape)
    first, first_arr = decoder.local(half)
    second, second_arr = decoder.local(half)
    key = llm_datadist.CacheKey(P, req)

    decoder.cm.pull_cache(key, first, 0, src_layer_range=range(0, 2))
    decoder.cm.pull_cache(key, second, 0, src_layer_range=range(2, 4))  # key still bound
    with pytest.raises(llm_datadist.LLMException) as err:
        decoder.cm.pull_cache(key, first, 1, src_layer_range=range(0, 2))
    assert err.value.status_code == S.LLM_KV_CACHE_NOT_EXIST
    prompt.call("deallocate_cache", cache_id=cache_id)

    want = remote(LAYERED, seed)
    assert_bytes_equal(units(first_arr, half)[:, 0], want[0:4, 0])
    assert_bytes_equal(units(second_arr, half)[:, 0], want[4:8, 0])
    assert_zero(units(first_arr, half)[:, 1])


def test_registered_memory_key_is_not_consumed(decoder: Decoder,
                                               prompt: RunningPrompt) -> None:
    cache, arr = decoder.local(KEYED)
    key = llm_datadist.CacheKey(P, 11)
    decoder.cm.pull_cache(key, cache, 0)
    decoder.cm.pull_cache(key, cache, 1)
    prompt.call("remove_cache_key", req_id=11)  # no effect on registered memory
    decoder.cm.pull_cache(key, cache, 2)

    got, want = units(arr, KEYED), remote(KEYED, SEED["keyed"])
    for slot in range(3):
        assert_bytes_equal(got[:, slot], want[:, 0])
    assert_zero(got[:, 3])


def test_unknown_key_and_unknown_cache_id(decoder: Decoder) -> None:
    cache, arr = decoder.local(KEYED)
    for key in (llm_datadist.CacheKey(P, 999_999), llm_datadist.CacheKeyByIdAndIndex(P, 77, 0)):
        with pytest.raises(llm_datadist.LLMException) as err:
            decoder.cm.pull_cache(key, cache, 0)
        assert err.value.status_code == S.LLM_KV_CACHE_NOT_EXIST
    # a batch index the remote cache does not have
    with pytest.raises(llm_datadist.LLMException) as err:
        decoder.cm.pull_cache(llm_datadist.CacheKeyByIdAndIndex(P, LEGACY_ID, 4), cache, 0)
    assert err.value.status_code == S.LLM_PARAM_INVALID
    assert_zero(arr)
    # the link is still good afterwards
    decoder.cm.pull_cache(llm_datadist.CacheKeyByIdAndIndex(P, LEGACY_ID, 1), cache, 0)
    assert_bytes_equal(units(arr, KEYED)[:, 0], remote(LEGACY, SEED["legacy"])[:, 1])


def test_pull_without_ranges_needs_as_many_tensors_as_the_source(decoder: Decoder) -> None:
    """A pull without layer ranges moves every tensor, and CANN refuses it when the source
    has another tensor count (GetSendTask: "src addr count ... not match received
    dst_addr_count"): LLM_PARAM_INVALID, nothing written, the link still good; with layer
    ranges the same two caches pull fine."""
    want = remote(LAYERED, SEED["layered"])  # 8 tensors
    small_spec = CacheSpec(4, LAYERED.shape)
    small, arr = decoder.local(small_spec)
    for key in (llm_datadist.CacheKey(P, 21), llm_datadist.CacheKeyByIdAndIndex(P, LAYERED_ID, 0)):
        with pytest.raises(llm_datadist.LLMException) as err:
            decoder.cm.pull_cache(key, small, 0)
        assert err.value.status_code == S.LLM_PARAM_INVALID
    assert_zero(arr)
    decoder.cm.pull_cache(llm_datadist.CacheKeyByIdAndIndex(P, LAYERED_ID, 0), small, 0,
                          src_layer_range=range(2, 4), dst_layer_range=range(0, 2))
    assert_bytes_equal(units(arr, small_spec)[:, 0], want[4:8, 0])
    # blocks too: a 2-tensor paged cache cannot take every tensor of the 4-tensor one
    paged_spec = CacheSpec(2, BLOCKS.shape)
    paged, paged_arr = decoder.local(paged_spec, blocks=True)
    with pytest.raises(llm_datadist.LLMException) as err:
        decoder.cm.pull_blocks(llm_datadist.BlocksCacheKey(P, BLOCKS_MODEL), paged, [1], [1])
    assert err.value.status_code == S.LLM_PARAM_INVALID
    assert_zero(paged_arr)
