"""The cache keys' constructors: the positional form a serving loop calls per request takes a
fast path (api/types.py); it must make the same key, and refuse the same input with the same
error, as the general form."""

from __future__ import annotations

import pytest

from datadist import BlocksCacheKey, CacheKey, CacheKeyByIdAndIndex, LLMException

U64 = 2**64 - 1


def fields(key: object) -> tuple[object, ...]:
    names = ("cluster_id", "req_id", "model_id", "prefix_id", "cache_id", "batch_index")
    return tuple(getattr(key, n, None) for n in names) + (repr(key),)


@pytest.mark.parametrize("args", [(1, 0), (0, 7), (U64, U64), (2**40, 3)])
def test_positional_keys_equal_keyword_keys(args):
    c, m = args
    assert fields(BlocksCacheKey(c, m)) == fields(BlocksCacheKey(cluster_id=c, model_id=m))
    assert fields(CacheKey(c, m)) == fields(CacheKey(cluster_id=c, req_id=m))
    assert CacheKey(c, m).prefix_id == U64 and CacheKey(c, m).model_id == 0
    k = CacheKeyByIdAndIndex(c, m % 2**63, 0)
    assert (k.cluster_id, k.cache_id, k.batch_index) == (c, m % 2**63, 0)


@pytest.mark.parametrize("bad, error", [((-1, 0), ValueError), ((0, U64 + 1), ValueError),
                                        ((1.0, 0), TypeError), (("1", 0), TypeError)])
def test_positional_keys_refuse_what_the_checks_refuse(bad, error):
    with pytest.raises(error):
        CacheKey(*bad)
    with pytest.raises(error):
        CacheKeyByIdAndIndex(*bad)


def test_blocks_key_types_and_bools():
    with pytest.raises(TypeError):
        BlocksCacheKey(1.0, 0)
    with pytest.raises(TypeError):
        BlocksCacheKey(1, "0")
    # a bool is an int, as in the original's isinstance checks
    assert BlocksCacheKey(True, 0).cluster_id is True
    with pytest.raises(LLMException):
        BlocksCacheKey(1, 0, 2)  # over the parameter limit
