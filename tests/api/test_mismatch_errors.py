"""A shape, dtype or size mismatch shows both sides (issue 38 item 11): the peer's refusal of
a pull into another dtype, block size or block shape gets the requester's cache as the
caller described it (shape, dtype name, bytes per block or slot); the local copies
(copy_cache, swap_blocks) name both caches. Before, the peer's text named only what it
knew (a dtype, "another block shape"), and the local copies gave byte counts alone."""

from __future__ import annotations

import pytest

import datadist as llm

from ._support import PROMPT_ID, code

F16, BF16 = llm.DataType.DT_FLOAT16, llm.DataType.DT_BF16
S = llm.LLMStatusCode


def test_pull_blocks_into_another_block_shape_shows_this_side(pair):
    p, d = pair
    p.register(2, [4, 8, 8], blocks=True, model_id=0, dtype=F16)
    mine, _ = d.register(2, [4, 4, 16], blocks=True, dtype=F16)
    with code(S.LLM_PARAM_INVALID) as e:
        d.cm.pull_blocks(llm.BlocksCacheKey(PROMPT_ID, 0), mine, [0], [1])
    text = str(e.value)
    assert "another block shape" in text  # the peer's side: the same dtype and block size
    assert "2 tensors of [4, 4, 16] DT_FLOAT16, 128 bytes per block" in text, text


def test_pull_blocks_of_another_dtype_names_both(pair):
    p, d = pair
    p.register(2, [4, 8, 8], blocks=True, model_id=0, dtype=F16)
    mine, _ = d.register(2, [4, 8, 8], blocks=True, dtype=BF16)
    with code(S.LLM_PARAM_INVALID) as e:
        d.cm.pull_blocks(llm.BlocksCacheKey(PROMPT_ID, 0), mine, [0], [1])
    text = str(e.value)
    assert "holds DT_FLOAT16" in text and "DT_BF16" in text
    assert "[4, 8, 8] DT_BF16, 128 bytes per block" in text, text


def test_pull_cache_of_another_dtype_names_both(pair):
    p, d = pair
    theirs, _ = p.register(2, [2, 64], dtype=F16)
    mine, _ = d.register(2, [2, 32], dtype=llm.DataType.DT_FLOAT)
    with code(S.LLM_PARAM_INVALID) as e:
        d.cm.pull_cache(llm.CacheKeyByIdAndIndex(PROMPT_ID, theirs.cache_id, 0), mine)
    text = str(e.value)
    assert "holds DT_FLOAT16" in text
    assert "2 tensors of [2, 32] DT_FLOAT, 128 bytes per batch slot" in text, text


def test_copy_cache_that_does_not_fit_shows_both_caches(pair):
    p, _ = pair
    big, _ = p.register(2, [2, 64], dtype=F16)
    small, _ = p.register(2, [2, 32], dtype=F16)
    with pytest.raises(llm.LLMException) as e:
        p.cm.copy_cache(small, big)
    assert e.value.status_code is S.LLM_PARAM_INVALID
    text = str(e.value)
    assert "src: 2 tensors of [2, 64] DT_FLOAT16, 128 bytes per batch slot" in text, text
    assert "dst: 2 tensors of [2, 32] DT_FLOAT16, 64 bytes per batch slot" in text, text


@pytest.mark.parametrize(("dst_tensors", "dst_shape", "starts"), [
    (2, [4, 4, 8], "src block size:128 and dst block size:64 must be equal"),
    (3, [4, 8, 8], "src num_tensors:2 and dst num_tensors:3 must be equal"),
])
def test_swap_blocks_mismatch_shows_both_caches(pair, dst_tensors, dst_shape, starts):
    p, _ = pair
    host, _ = p.register(2, [4, 8, 8], blocks=True, dtype=F16, placement=llm.Placement.HOST)
    dev, _ = p.register(dst_tensors, dst_shape, blocks=True, dtype=F16)
    with pytest.raises(llm.LLMException) as e:
        p.cm.swap_blocks(host, dev, {0: 1})
    text = str(e.value)
    assert text.startswith(starts)  # the original's words (v2/cache_manager.py)
    assert "(src: 2 tensors of [4, 8, 8] DT_FLOAT16, 128 bytes per block; dst: " \
           f"{dst_tensors} tensors of {dst_shape} DT_FLOAT16" in text, text
