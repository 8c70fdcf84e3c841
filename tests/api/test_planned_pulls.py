"""Planned pulls (api/planned.py, the native engine's prepared calls): a pull repeated with the
same arguments is checked and planned once, and nothing about the repeat may differ from a
first call: every argument error, an unregistered or replaced cache, a finalized session,
an unlinked peer still answer exactly as the full path does. On the core.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import datadist as llm
from datadist.api import cache_manager as cm_module
from datadist.api import planned
from datadist.api.cache_manager import CacheManager
from datadist.core import native
from datadist.core.config import EngineConfig

from ._support import DECODER_ID, PROMPT_ID, Side, code, units

pytestmark = pytest.mark.timeout(60)

S = llm.LLMStatusCode


@pytest.fixture
def sides() -> Iterator[tuple[Side, Side]]:
    """A PROMPT and a DECODER on the core, the DECODER linked to the PROMPT."""
    made: list[Any] = []

    def make(cluster_id: int, role: int) -> Side:
        cfg = EngineConfig(cluster_id=cluster_id, role=role, listen=("127.0.0.1", 0),
                           sync_timeout=5.0)
        engine = native.NativeEngine(cfg)
        made.append(engine)
        return Side(engine, CacheManager(engine))

    try:
        p, d = make(PROMPT_ID, 1), make(DECODER_ID, 2)
        assert p.engine.listen_address is not None
        d.engine.link(PROMPT_ID, *p.engine.listen_address, 5.0)
        yield p, d
    finally:
        for engine in made:
            engine.close()


def _counting(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """Count the calls cache_manager makes to its function ``name``."""
    calls = [0]
    real: Callable[..., Any] = getattr(cm_module, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(cm_module, name, counted)
    return calls


def test_a_repeated_pull_blocks_is_checked_and_planned_once(sides, monkeypatch):
    p, d = sides
    _, a = p.register(2, [8, 64], blocks=True, model_id=3, seed=1)
    dst, b = d.register(2, [8, 64], blocks=True)
    lists = _counting(monkeypatch, "int_list")
    key = llm.BlocksCacheKey(PROMPT_ID, 3)
    d.cm.pull_blocks(key, dst, [1, 2], [5, 6])
    assert lists[0] == 2  # the first call checks both lists
    b[...] = 0
    # the same arguments again, in new objects (a server makes them per request)
    d.cm.pull_blocks(llm.BlocksCacheKey(PROMPT_ID, 3), dst, [1, 2], [5, 6])
    assert lists[0] == 2
    np.testing.assert_array_equal(units(b, 8)[:, 5:7], units(a, 8)[:, 1:3])
    d.cm.pull_blocks(key, dst, [1, 3], [5, 6])  # other blocks: checked, and the right bytes
    assert lists[0] == 4
    np.testing.assert_array_equal(units(b, 8)[:, 6], units(a, 8)[:, 3])


def test_a_repeated_pull_cache_is_checked_and_planned_once(sides, monkeypatch):
    p, d = sides
    _, a = p.register(2, [4, 64], seed=2)
    dst, b = d.register(2, [4, 64])
    ints = _counting(monkeypatch, "check_int")
    key = llm.CacheKeyByIdAndIndex(PROMPT_ID, 1, 2)
    d.cm.pull_cache(key, dst, 1)
    first = ints[0]
    assert first > 0
    b[...] = 0
    d.cm.pull_cache(llm.CacheKeyByIdAndIndex(PROMPT_ID, 1, 2), dst, 1)
    assert ints[0] == first
    np.testing.assert_array_equal(units(b, 4)[:, 1], units(a, 4)[:, 2])


def test_a_repeated_layer_pull_and_its_issued_form_reuse_the_plan(sides, monkeypatch):
    p, d = sides
    _, a = p.register(4, [8, 64], blocks=True, model_id=4, seed=3)
    dst, b = d.register(4, [8, 64], blocks=True)
    key = llm.BlocksCacheKey(PROMPT_ID, 4)
    r = range(1, 2)
    d.cm.pull_blocks(key, dst, [0], [7], src_layer_range=r, dst_layer_range=r)
    lists = _counting(monkeypatch, "int_list")
    b[...] = 0
    d.cm.pull_blocks_async(key, dst, [0], [7], src_layer_range=range(1, 2),
                           dst_layer_range=range(1, 2)).wait(10)
    d.cm.pull_blocks(key, dst, [0], [7], src_layer_range=r, dst_layer_range=r)
    assert lists[0] == 0
    np.testing.assert_array_equal(units(b, 8)[2:4, 7], units(a, 8)[2:4, 0])
    assert not units(b, 8)[:2].any() and not units(b, 8)[:, :7].any()


def _first_error(fn: Callable[[], Any]) -> tuple[type, str, Any]:
    with pytest.raises(Exception) as info:  # noqa: PT011 - whatever it is, compared below
        fn()
    e = info.value
    return type(e), str(e), getattr(e, "status_code", None)


@pytest.mark.parametrize("bad", [
    dict(batch_index=True), dict(batch_index=1.0), dict(size=True), dict(size=2.5),
    dict(size=0), dict(batch_index=-1), dict(src_layer_range=range(0, 1, 2)),
    dict(src_layer_range=range(0, 1), dst_layer_range=range(0, 1, 3)),
    dict(tensor_num_per_layer=True), dict(src_layer_range=(0, 1)),
])
def test_a_planned_pull_cache_never_hides_an_argument_error(sides, bad):
    """Values equal to a planned call's (True == 1, range(0, 1, 2) == range(0, 1)) are not
    the same arguments: each takes the full path, refused or taken exactly as a first call
    would (a bool is an int there, as in the original's check_isinstance / check_int32)."""
    p, d = sides
    p.register(2, [4, 64], seed=2)
    dst, _ = d.register(2, [4, 64])
    key = llm.CacheKeyByIdAndIndex(PROMPT_ID, 1, 1)
    good: dict[str, Any] = dict(batch_index=1, size=-1)
    if "tensor_num_per_layer" in bad or "layer_range" in str(bad):
        good.update(src_layer_range=range(0, 1), dst_layer_range=range(0, 1),
                    tensor_num_per_layer=1)
    d.cm.pull_cache(key, dst, **good)
    d.cm.pull_cache(key, dst, **good)  # planned now
    fresh = Side(d.engine, CacheManager(d.engine))  # nothing planned: the full path
    dst2, _ = fresh.register(2, [4, 64])
    assert (_outcome(lambda: d.cm.pull_cache(key, dst, **{**good, **bad}))
            == _outcome(lambda: fresh.cm.pull_cache(key, dst2, **{**good, **bad})))


def _outcome(fn: Callable[[], Any]) -> tuple[type, str, Any] | None:
    """None when ``fn`` returns, else its error as :func:`_first_error` gives it."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - whatever it is, compared by the caller
        return type(e), str(e), getattr(e, "status_code", None)
    return None


@pytest.mark.parametrize("blocks", [[1.0], [True], [-1], [2**64], np.array([1], np.int64)])
def test_a_planned_pull_blocks_never_hides_an_argument_error(sides, blocks):
    p, d = sides
    p.register(1, [4, 64], blocks=True, model_id=5, seed=4)
    dst, b = d.register(1, [4, 64], blocks=True)
    key = llm.BlocksCacheKey(PROMPT_ID, 5)
    d.cm.pull_blocks(key, dst, [1], [1])
    d.cm.pull_blocks(key, dst, [1], [1])  # planned now
    other = Side(d.engine, CacheManager(d.engine))
    dst2, _ = other.register(1, [4, 64], blocks=True)
    try:
        expected: Any = _first_error(lambda: other.cm.pull_blocks(key, dst2, blocks, [1]))
    except pytest.fail.Exception:
        expected = None  # accepted by the full path: accepted after a plan too
    if expected is None:
        d.cm.pull_blocks(key, dst, blocks, [1])
    else:
        assert _first_error(lambda: d.cm.pull_blocks(key, dst, blocks, [1])) == expected


def test_an_unregistered_cache_is_refused_after_its_pulls_were_planned(sides):
    p, d = sides
    p.register(1, [4, 64], blocks=True, model_id=6, seed=5)
    dst, _ = d.register(1, [4, 64], blocks=True)
    key = llm.BlocksCacheKey(PROMPT_ID, 6)
    d.cm.pull_blocks(key, dst, [0], [0])
    d.cm.unregister_cache(dst.cache_id)
    with code(S.LLM_KV_CACHE_NOT_EXIST) as info:
        d.cm.pull_blocks(key, dst, [0], [0])
    assert f"cache {dst.cache_id} does not exist" in str(info.value)
    with code(S.LLM_KV_CACHE_NOT_EXIST):
        d.cm.pull_blocks_async(key, dst, [0], [0])
    # a new registration of the same memory is a new cache: its pulls land in it
    dst2, b2 = d.register(1, [4, 64], blocks=True)
    d.cm.pull_blocks(key, dst2, [0], [0])
    assert units(b2, 4)[:, 0].any()


def test_a_finalized_session_and_an_unlinked_peer_answer_a_planned_pull(sides):
    p, d = sides
    p.register(2, [4, 64], seed=6)
    dst, _ = d.register(2, [4, 64])
    key = llm.CacheKeyByIdAndIndex(PROMPT_ID, 1, 0)
    d.cm.pull_cache(key, dst, 0)
    d.engine.unlink(PROMPT_ID, 5.0)
    with code(S.LLM_NOT_YET_LINK):
        d.cm.pull_cache(key, dst, 0)
    assert p.engine.listen_address is not None
    d.engine.link(PROMPT_ID, *p.engine.listen_address, 5.0)
    d.cm.pull_cache(key, dst, 0)  # the link is looked up per transfer: the new one
    d.cm._invalidate()
    with code(S.LLM_PARAM_INVALID):  # the original's wrapper's code once its engine is gone
        d.cm.pull_cache(key, dst, 0)


def test_native_repeated_pull_prepares_the_core_call_once(sides):
    p, d = sides
    p.register(1, [4, 64], blocks=True, model_id=7, seed=7)
    dst, b = d.register(1, [4, 64], blocks=True)
    made = [0]
    core = d.engine._core

    class Counting:
        def __getattr__(self, name: str) -> Any:
            return getattr(core, name)

        def prepare_pull(self, *args: Any) -> Any:
            made[0] += 1
            return core.prepare_pull(*args)

    d.engine._core = Counting()
    try:
        key = llm.BlocksCacheKey(PROMPT_ID, 7)
        for _ in range(3):
            d.cm.pull_blocks(key, dst, [2], [3])
        d.cm.pull_blocks_async(key, dst, [2], [3]).wait(10)
        assert made[0] == 1
        d.cm.pull_blocks(key, dst, [1], [3])
        assert made[0] == 2
    finally:
        d.engine._core = core
    assert units(b, 4)[:, 3].any()


def test_planned_keys_tell_apart_what_compares_equal():
    class Sub(llm.BlocksCacheKey):
        pass

    cache = object()
    base = planned.blocks_key(llm.BlocksCacheKey(1, 2), cache, [1], [2], {})
    assert base is not None
    assert base == planned.blocks_key(llm.BlocksCacheKey(1, 2), cache, (1,), [2], {})
    assert planned.blocks_key(Sub(1, 2), cache, [1], [2], {}) is None
    assert planned.blocks_key(llm.BlocksCacheKey(1, 2), cache, [1.0], [2], {}) is None
    assert planned.blocks_key(llm.BlocksCacheKey(1, 2), cache, np.array([1]), [2], {}) is None
    assert planned.blocks_key(llm.BlocksCacheKey(1, 2), object(), [1], [2], {}) != base
    r = planned.blocks_key(llm.BlocksCacheKey(1, 2), cache, [1], [2],
                           {"src_layer_range": range(0, 1)})
    assert r != planned.blocks_key(llm.BlocksCacheKey(1, 2), cache, [1], [2],
                                   {"src_layer_range": range(0, 1, 2)})
    assert planned.blocks_key(llm.BlocksCacheKey(1, 2), cache, [1], [2], {"other": 1}) is None
    assert planned.slot_key(llm.CacheKeyByIdAndIndex(1, 2, 0), cache, True, -1, {}) is None
    assert planned.slot_key(llm.CacheKeyByIdAndIndex(1, 2, 0), cache, 1, -1,
                            {"tensor_num_per_layer": True}) is None
    assert (planned.slot_key(llm.CacheKey(1, 5), cache, 0, -1, {})
            != planned.slot_key(llm.CacheKeyByIdAndIndex(1, 5, 0), cache, 0, -1, {}))


def test_native_small_issued_pull_under_a_lease_ends_in_the_issuing_call(sides):
    """A small issued pull the link's whole-cache lease covers is a local copy: the core runs
    it in the issuing call (no worker hand-over), so its handle has ended when the call
    returns, with the bytes there; one the lease does not cover still goes to a worker and
    fails its handle, not the call."""
    p, d = sides
    _, a = p.register(1, [4, 64], blocks=True, model_id=8, seed=8)
    dst, b = d.register(1, [4, 64], blocks=True)
    key = llm.BlocksCacheKey(PROMPT_ID, 8)
    d.cm.pull_blocks(key, dst, [1], [2])  # the first pull takes the lease
    if d.engine.get_link(PROMPT_ID).path != "cma":
        pytest.skip("no cross-memory attach here: no leases")
    for i in range(4):
        b[...] = 0
        handle = d.cm.pull_blocks_async(key, dst, [i], [3])
        assert handle.done()  # ended before the call returned: no worker took it
        handle.wait(0)
        assert handle.status == S.LLM_SUCCESS
        np.testing.assert_array_equal(units(b, 4)[:, 3], units(a, 4)[:, i])
    bad = d.cm.pull_blocks_async(key, dst, [9], [3])  # outside the owner's cache
    with code(S.LLM_PARAM_INVALID):
        bad.wait(10)


def test_a_per_layer_key_is_flat_and_tells_apart_what_it_must():
    """A per-layer pull (both layer ranges, nothing else) is keyed by six ints (issue 37: the
    facade's lookup of a layer pull cost 4.4 us of its 6.5); every range field counts, the
    two ranges are not interchangeable, and no other keyword form can equal it."""
    cache = object()
    k = llm.BlocksCacheKey(1, 2)

    def key(**kw):
        return planned.blocks_key(k, cache, [1, 2], [3, 4], kw)

    got = key(src_layer_range=range(2, 3), dst_layer_range=range(4, 5))
    assert got is not None and got[-1] == (2, 3, 1, 4, 5, 1)
    assert got == key(dst_layer_range=range(4, 5), src_layer_range=range(2, 3))
    assert got != key(src_layer_range=range(4, 5), dst_layer_range=range(2, 3))
    assert got != key(src_layer_range=range(2, 3, 2), dst_layer_range=range(4, 5))
    assert got != key(src_layer_range=range(2, 3), dst_layer_range=range(4, 6))
    assert key(src_layer_range=range(2, 3)) != got
    assert key(src_layer_range=range(2, 3), tensor_num_per_layer=2) is not None
    assert key(src_layer_range=range(2, 3), dst_layer_range=[4]) is None
    # one block list passed as both sides: converted once, the same key as two equal lists
    blocks = [5, 6]
    assert (planned.blocks_key(k, cache, blocks, blocks, {})
            == planned.blocks_key(k, cache, [5, 6], [5, 6], {}))
    assert planned.blocks_key(k, cache, [5.0], [5.0], {}) is None


class _Req:
    def __init__(self, spans: int) -> None:
        self.call = type("Call", (), {"spans": spans})()


def test_the_planned_map_keeps_what_is_used_and_its_bounds():
    """The map's second chance (one lookup a hit, no reordering): an entry found since the
    last eviction pass outlives older unused ones, as in a least-recently-used map; at most
    ``size`` entries and ``max_weight`` spans are kept, the newest always."""
    m = planned.PlannedMap(3, lambda r: int(r.call.spans), max_weight=100)
    for k in "abc":
        m.put(k, _Req(1))
    assert m.find("a") is not None  # used: passed over once
    m.put("d", _Req(1))
    assert m.find("a") is not None and m.find("b") is None  # b, the oldest unused, went
    assert len(m) == 3 and m.find("c") is not None and m.find("d") is not None
    # now c, d, a from the oldest, all used since: each gets its second chance, and the
    # oldest in the map's order goes (c; an LRU map would drop a, found before c and d: the
    # second chance only approximates it, for entries all used between two evictions)
    m.put("e", _Req(1))
    assert len(m) == 3 and m.find("c") is None
    assert all(m.find(k) is not None for k in "dae")
    m.put("big", _Req(500))  # over the weight: everything else goes, the newest stays
    assert len(m) == 1 and m.find("big") is not None and m.total == 500
    m.put("big", _Req(2))  # replaced: its weight too
    assert m.total == 2
    m.clear()
    assert len(m) == 0 and m.total == 0
