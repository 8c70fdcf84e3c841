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


def _a_call(d: Side) -> Any:
    """A prepared call of ``d``'s (what the map keeps; any will do for the keys' tests)."""
    dst, _ = d.register(1, [4, 64], blocks=True)
    return d.cm._check_pull_blocks(llm.BlocksCacheKey(PROMPT_ID, 9), dst, [0], [0], {}).call


def test_planned_keys_tell_apart_what_compares_equal(sides):
    """The native map's key (cpp/python/planned.h): what compares equal but is not the same
    argument (a bool, a float, a subclass, a range with another step, another Cache) has no
    key or another one, so a plan is never reused for it."""
    p, d = sides
    p.register(1, [4, 64], blocks=True, model_id=9)
    call = _a_call(d)

    class Sub(llm.BlocksCacheKey):
        pass

    cache = object()
    m = planned.new_map(d.engine)
    assert m.put_blocks(llm.BlocksCacheKey(1, 2), cache, [1], [2], {}, call)
    assert m.find_blocks(llm.BlocksCacheKey(1, 2), cache, [1], [2], {}) is call
    assert m.find_blocks(llm.BlocksCacheKey(1, 2), cache, (1,), [2], {}) is call
    for blocks in ([1.0], [True], np.array([1]), [np.uint64(1)], [-1], [2**64]):
        assert not m.put_blocks(llm.BlocksCacheKey(1, 2), cache, blocks, [2], {}, call)
        assert m.find_blocks(llm.BlocksCacheKey(1, 2), cache, blocks, [2], {}) is None
    assert not m.put_blocks(Sub(1, 2), cache, [1], [2], {}, call)
    assert m.find_blocks(Sub(1, 2), cache, [1], [2], {}) is None
    assert m.find_blocks(llm.BlocksCacheKey(True, 2), cache, [1], [2], {}) is None
    assert m.find_blocks(llm.BlocksCacheKey(1, 2), object(), [1], [2], {}) is None
    assert m.find_blocks(llm.BlocksCacheKey(1, 3), cache, [1], [2], {}) is None
    assert m.find_blocks(llm.BlocksCacheKey(1, 2), cache, [1], [2, 3], {}) is None
    assert m.put_blocks(llm.BlocksCacheKey(1, 2), cache, [1], [2],
                        {"src_layer_range": range(0, 1)}, call)
    assert m.find_blocks(llm.BlocksCacheKey(1, 2), cache, [1], [2],
                         {"src_layer_range": range(0, 1, 2)}) is None
    assert not m.put_blocks(llm.BlocksCacheKey(1, 2), cache, [1], [2], {"other": 1}, call)
    assert not m.put_slot(llm.CacheKeyByIdAndIndex(1, 2, 0), cache, True, -1, {}, call)
    assert not m.put_slot(llm.CacheKeyByIdAndIndex(1, 2, 0), cache, 1, -1,
                          {"tensor_num_per_layer": True}, call)
    assert m.put_slot(llm.CacheKey(1, 5), cache, 0, -1, {}, call)
    assert m.find_slot(llm.CacheKeyByIdAndIndex(1, 5, 0), cache, 0, -1, {}) is None
    assert m.find_slot(llm.CacheKey(1, 5), cache, 0, -1, {}) is call
    assert m.find_blocks(llm.BlocksCacheKey(1, 5), cache, [0], [-1], {}) is None
    assert m.run_blocks(llm.BlocksCacheKey(1, 2), cache, [1.0], [2], {}, 5.0) is False
    with pytest.raises(TypeError, match="6 positional arguments"):
        m.run_blocks(llm.BlocksCacheKey(1, 2), cache, [1], [2], {})  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        m.run_slot(llm.CacheKey(1, 5), cache, 0, -1, {}, "5")  # type: ignore[arg-type]
    m.close()  # the engine closed: nothing is found or kept from then on
    assert m.find_slot(llm.CacheKey(1, 5), cache, 0, -1, {}) is None
    assert not m.put_slot(llm.CacheKey(1, 5), cache, 0, -1, {}, call) and len(m) == 0


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


def test_a_layer_key_tells_apart_what_it_must(sides):
    """The layer keywords are keyed by name, whatever their order; every range field counts,
    the two ranges are not interchangeable, and no other keyword form can equal them."""
    p, d = sides
    p.register(1, [4, 64], blocks=True, model_id=9)
    call = _a_call(d)
    cache = object()
    k = llm.BlocksCacheKey(1, 2)
    m = planned.new_map(d.engine)

    def find(**kw):
        return m.find_blocks(k, cache, [1, 2], [3, 4], kw)

    assert m.put_blocks(k, cache, [1, 2], [3, 4],
                        {"src_layer_range": range(2, 3), "dst_layer_range": range(4, 5)}, call)
    assert find(src_layer_range=range(2, 3), dst_layer_range=range(4, 5)) is call
    assert find(dst_layer_range=range(4, 5), src_layer_range=range(2, 3)) is call
    assert find(src_layer_range=range(4, 5), dst_layer_range=range(2, 3)) is None
    assert find(src_layer_range=range(2, 3, 2), dst_layer_range=range(4, 5)) is None
    assert find(src_layer_range=range(2, 3), dst_layer_range=range(4, 6)) is None
    assert find(src_layer_range=range(2, 3)) is None
    assert find(src_layer_range=range(2, 3), dst_layer_range=range(4, 5),
                tensor_num_per_layer=2) is None
    assert find(src_layer_range=range(2, 3), dst_layer_range=None) is None
    assert find(src_layer_range=range(2, 3), dst_layer_range=[4]) is None
    assert m.put_blocks(k, cache, [1, 2], [3, 4], {"src_layer_range": None}, call)
    assert find(src_layer_range=None) is call and find() is None
    # one block list passed as both sides: the same key as two equal lists
    blocks = [5, 6]
    assert m.put_blocks(k, cache, blocks, blocks, {}, call)
    assert m.find_blocks(k, cache, [5, 6], [5, 6], {}) is call
    assert m.find_blocks(k, cache, [5, 6], [5], {}) is None
    assert not m.put_blocks(k, cache, [5.0], [5.0], {}, call)


def test_the_planned_map_keeps_what_is_used_and_its_bounds(sides):
    """The map's second chance (one lookup a hit, no reordering): an entry found since the
    last eviction pass outlives older unused ones, as in a least-recently-used map; at most
    ``size`` entries and ``max_weight`` spans are kept, the newest always."""
    p, d = sides
    p.register(2, [8, 64], blocks=True, model_id=9)
    dst, _ = d.register(2, [8, 64], blocks=True)
    key = llm.BlocksCacheKey(PROMPT_ID, 9)
    small = d.cm._check_pull_blocks(key, dst, [0], [0], {}).call
    big = d.cm._check_pull_blocks(key, dst, [0, 2, 4], [0, 2, 4], {}).call
    assert big.spans > small.spans
    m = planned.new_map(d.engine, size=3, max_weight=big.spans - 1 + 2 * small.spans)
    cache = object()

    def put(name: int, call: Any = small) -> None:
        assert m.put_blocks(key, cache, [name], [name], {}, call)

    def found(name: int) -> bool:
        return m.find_blocks(key, cache, [name], [name], {}) is not None

    for k in (1, 2, 3):
        put(k)
    assert found(1)  # used: passed over once
    put(4)
    assert found(1) and not found(2)  # 2, the oldest unused, went
    assert len(m) == 3 and found(3) and found(4)
    # now 3, 4, 1 from the oldest, all used since: each gets its second chance, and the
    # oldest in the map's order goes (3; an LRU map would drop 1, found before 3 and 4: the
    # second chance only approximates it, for entries all used between two evictions)
    put(5)
    assert len(m) == 3 and not found(3)
    assert all(found(k) for k in (4, 1, 5))
    put(6, big)  # over the weight: the oldest go until it fits, the newest stays
    assert found(6) and m.total <= big.spans - 1 + 2 * small.spans
    assert len(m) == 2 and m.total == big.spans + small.spans
    put(6)  # replaced: its weight too
    assert m.total == 2 * small.spans
    m.clear()
    assert len(m) == 0 and m.total == 0


def test_a_cache_registered_again_with_another_geometry_never_reuses_a_plan(sides):
    """A planned pull into a cache that was unregistered is refused (the core: the cache is
    gone), and a new registration of the same memory with another geometry is planned anew:
    the same block ids land where its own block size puts them."""
    p, d = sides
    _, a = p.register(1, [4, 64], blocks=True, model_id=10, seed=10)
    _, a2 = p.register(1, [2, 128], blocks=True, model_id=11, seed=11)
    dst, b = d.register(1, [4, 64], blocks=True)
    key = llm.BlocksCacheKey(PROMPT_ID, 10)
    d.cm.pull_blocks(key, dst, [1], [1])
    d.cm.pull_blocks(key, dst, [1], [1])  # planned now
    np.testing.assert_array_equal(units(b, 4)[:, 1], units(a, 4)[:, 1])
    d.cm.unregister_cache(dst.cache_id)
    b[...] = 0
    desc = llm.CacheDesc(1, [2, 128], llm.DataType.DT_UINT8, llm.Placement.DEVICE)
    again = d.cm.register_blocks_cache(desc, [int(b[0].ctypes.data)], None)
    with code(S.LLM_KV_CACHE_NOT_EXIST):
        d.cm.pull_blocks(key, dst, [1], [1])  # the old handle: its plan is never run
    assert not b.any()
    key2 = llm.BlocksCacheKey(PROMPT_ID, 11)
    for _ in range(2):  # planned, then the plan's hit
        b[...] = 0
        d.cm.pull_blocks(key2, again, [1], [1])
        np.testing.assert_array_equal(units(b, 2)[:, 1], units(a2, 2)[:, 1])
        assert not units(b, 2)[:, 0].any()


def test_a_planned_pull_blocks_after_unlink_finalize_and_close(sides):
    """A planned pull_blocks answers exactly as a first call: not linked after an unlink,
    the new link after a link, LLM_PARAM_INVALID once its manager is finalized, and the
    engine's refusal once the engine is closed (its map closed with it)."""
    p, d = sides
    p.register(1, [4, 64], blocks=True, model_id=12, seed=12)
    dst, _ = d.register(1, [4, 64], blocks=True)
    key = llm.BlocksCacheKey(PROMPT_ID, 12)
    d.cm.pull_blocks(key, dst, [0], [0])
    d.engine.unlink(PROMPT_ID, 5.0)
    with code(S.LLM_NOT_YET_LINK):
        d.cm.pull_blocks(key, dst, [0], [0])
    assert p.engine.listen_address is not None
    d.engine.link(PROMPT_ID, *p.engine.listen_address, 5.0)
    d.cm.pull_blocks(key, dst, [0], [0])
    other = CacheManager(d.engine)  # another manager of the same engine, its own plans
    dst2 = other.register_blocks_cache(
        llm.CacheDesc(1, [4, 64], llm.DataType.DT_UINT8, llm.Placement.DEVICE),
        [int(d.arrays[0][0].ctypes.data)], None)
    other.pull_blocks(key, dst2, [0], [0])
    d.cm._invalidate()
    with code(S.LLM_PARAM_INVALID) as info:
        d.cm.pull_blocks(key, dst, [0], [0])
    assert "finalized" in str(info.value)
    with code(S.LLM_PARAM_INVALID):
        d.cm.pull_blocks_async(key, dst, [0], [0])
    d.engine.close()
    closed = _first_error(lambda: other.pull_blocks(key, dst2, [0], [0]))
    fresh = CacheManager(d.engine)  # nothing planned: the full path's answer
    assert _first_error(lambda: fresh.pull_blocks(key, dst2, [0], [0]))[0] is closed[0]
    assert closed[0] is llm.LLMException
