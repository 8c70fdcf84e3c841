"""A call refused by the mode names the mode and what to use instead (issue 38 items 2, 6),
after the original's own text (tests/compat check those texts' starts):

- ``pull_cache(CacheKey)`` where ``local_comm_res`` turned remote cache access on (the
  README's configuration): a TypeError, as in llm_datadist, that says why and what to use;
  with ``enable_remote_cache_accessible = False`` beside it the CacheKey is accepted;
- a push without remote cache access says which setting allows it;
- ``allocate_cache`` without a pool for the placement names the setting that gives one.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import datadist as llm

S = llm.LLMStatusCode


@pytest.fixture
def start() -> Iterator[Any]:
    made: list[Any] = []

    def make(**settings: Any) -> Any:
        cfg = llm.LLMConfig()
        cfg.device_id = 0
        for name, value in settings.items():
            setattr(cfg, name, value)
        d = llm.LLMDataDist(llm.LLMRole.DECODER, 2)
        d.init(cfg.generate_options())
        made.append(d)
        return d

    yield make
    for d in made:
        d.finalize()


def _cache(d: Any) -> tuple[Any, np.ndarray]:
    kv = np.zeros((2, 4, 16), np.float16)
    desc = llm.CacheDesc(2, [4, 16], llm.DataType.DT_FLOAT16)
    return d.cache_manager.register_cache(desc, [kv[0].ctypes.data, kv[1].ctypes.data]), kv


def test_pull_cache_by_cache_key_with_local_comm_res_says_why_and_what_instead(start):
    d = start(local_comm_res="")
    cache, _kv = _cache(d)
    for pull in (d.cache_manager.pull_cache, d.cache_manager.pull_cache_async):
        with pytest.raises(TypeError) as e:
            pull(llm.CacheKey(1, req_id=7), cache)
        text = str(e.value)
        # the original's words first (v2/cache_manager.py pull_cache), then datadist's
        assert text.startswith("cache_key only support ['CacheKeyByIdAndIndex'], but got ")
        # before: "... but got <class 'datadist.api.types.CacheKey'>." and nothing more
        for words in ("enable_remote_cache_accessible", "local_comm_res",
                      "CacheKeyByIdAndIndex(cluster_id, cache_id, batch_index)",
                      "enable_remote_cache_accessible = False", "docs/modes.md"):
            assert words in text, (words, text)


def test_local_comm_res_with_remote_access_off_takes_a_cache_key(start):
    d = start(local_comm_res="", enable_remote_cache_accessible=False)
    cache, _kv = _cache(d)
    with pytest.raises(llm.LLMException) as e:  # past the key check: nobody is linked
        d.cache_manager.pull_cache(llm.CacheKey(1, req_id=7), cache)
    assert e.value.status_code is S.LLM_NOT_YET_LINK


def test_push_without_remote_access_names_the_setting(start):
    d = start(enable_cache_manager=True)
    cache, _kv = _cache(d)
    with pytest.raises(llm.LLMException) as e:
        d.cache_manager.push_cache(llm.CacheKeyByIdAndIndex(1, 1, 0), cache)
    assert e.value.status_code is S.LLM_PARAM_INVALID
    assert str(e.value).startswith("push_cache is only supported while "
                                   "enable_remote_cache_accessible is True")
    assert "LLMConfig.enable_remote_cache_accessible = True" in str(e.value)


def test_allocate_without_a_pool_names_the_setting(start):
    d = start(enable_cache_manager=True, mem_pool_cfg='{"memory_size": 16777216}')
    desc = llm.CacheDesc(2, [4, 16], llm.DataType.DT_FLOAT16, llm.Placement.HOST)
    for allocate in (d.cache_manager.allocate_cache, d.cache_manager.allocate_blocks_cache):
        with pytest.raises(llm.LLMException) as e:
            allocate(desc)
        text = str(e.value)
        assert e.value.status_code is S.LLM_PARAM_INVALID
        assert text.startswith("you should config memory pool firstly and then set "
                               "placement that matches it.")
        # before: the original's sentence only, naming no setting
        assert "LLMConfig.host_mem_pool_cfg (option llm.HostMemPoolConfig)" in text, text
        assert "a pool for Placement.DEVICE only" in text, text


def test_allocate_with_no_pool_at_all_says_so(start):
    d = start(enable_cache_manager=True)
    desc = llm.CacheDesc(2, [4, 16], llm.DataType.DT_FLOAT16, llm.Placement.DEVICE)
    with pytest.raises(llm.LLMException) as e:
        d.cache_manager.allocate_cache(desc)
    assert "LLMConfig.mem_pool_cfg (option llm.MemPoolConfig)" in str(e.value)
    assert "this LLMDataDist has no pool" in str(e.value)
