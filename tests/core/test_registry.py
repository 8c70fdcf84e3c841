"""Unit tests of core.registry: the engine's local bookkeeping (ids, key binding, lifetimes,
holds) and the requester's own request-size check.

The registry never touches memory, so entries carry made-up tensor addresses; a ``free``
callback records when the entry is released. What peers may ask of a cache (resolving keys,
span checks, leases, consumption, address writes, fences) is the core's registry's, tested in
cpp/tests/registry_test.cc.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from datadist.core.errors import CacheNotFound, Code, InvalidArgument, Timeout
from datadist.core.layout import Geometry
from datadist.core.registry import (
    MAX_REQUEST_SPANS,
    UINT64_MAX,
    KeyId,
    Registry,
    check_request_size,
    key_id,
)

ADDRS = [0x10000, 0x20000, 0x30000, 0x40000]
GEO = Geometry(num_tensors=4, tensor_bytes=4 * 256, units=4)  # 4 slots of 256 bytes
BLOCKS = Geometry(num_tensors=2, tensor_bytes=8 * 64, units=8, is_blocks=True)


class Frees:
    """A free callback that counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1


def pool_cache(reg: Registry, keys: list[KeyId | None], frees: Frees | None = None,
               geo: Geometry = GEO, **kw):  # type: ignore[no-untyped-def]
    return reg.add(geo, ADDRS[: geo.num_tensors], owned=True, keys=keys, free=frees, **kw)


def user_cache(reg: Registry, keys: list[KeyId | None] = (), geo: Geometry = GEO,  # type: ignore[assignment]
               **kw):  # type: ignore[no-untyped-def]
    return reg.add(geo, ADDRS[: geo.num_tensors], owned=False, keys=keys, **kw)


def K(req: int, model: int = 0) -> KeyId:
    return KeyId(req, model, False)


def P(prefix: int, model: int = 0) -> KeyId:
    return KeyId(prefix, model, True)


# ------------------------------------------------------------------------------ ids and keys


def test_key_id_of_cache_key_fields() -> None:
    assert key_id(5, UINT64_MAX, 1) == KeyId(5, 1, False)
    assert key_id(UINT64_MAX, 9, 1) == KeyId(9, 1, True)
    assert key_id(UINT64_MAX, UINT64_MAX, 1) is None  # the padding key


def test_cache_ids_count_from_one() -> None:
    reg = Registry()
    ids = [user_cache(reg).cache_id for _ in range(3)]
    assert ids == [1, 2, 3]
    assert reg.get(2).cache_id == 2
    with pytest.raises(CacheNotFound):
        reg.get(4)
    assert Registry().add(GEO, ADDRS, owned=False).cache_id == 1  # per registry


def test_padding_keys_bind_nothing() -> None:
    reg = Registry()
    e = pool_cache(reg, [K(10), None, K(12)])
    assert e.keys == {K(10), K(12)}
    pool_cache(reg, [K(11)])  # K(11) was not bound by the padding


def test_keys_are_per_model_id_and_prefix_keys_live_apart() -> None:
    reg = Registry()
    a = pool_cache(reg, [K(1, model=0), K(3)])
    b = pool_cache(reg, [K(1, model=1), P(3)])  # neither is bound already
    assert a.keys == {K(1, 0), K(3)} and b.keys == {K(1, 1), P(3)}


@pytest.mark.parametrize(
    ("keys", "match"),
    [
        ([K(1), K(1)], "duplicate"),
        ([K(1), None, K(1)], "duplicate"),
        ([K(1), K(2), K(3), K(4), K(5)], "batch of 4"),
        ([None] * 5, "batch of 4"),
    ],
)
def test_bad_key_lists(keys: list[KeyId | None], match: str) -> None:
    reg = Registry()
    with pytest.raises(InvalidArgument, match=match) as info:
        pool_cache(reg, keys)
    assert info.value.code == Code.PARAM_INVALID
    assert reg.entries() == []


def test_a_key_already_bound_is_refused_and_nothing_is_bound() -> None:
    reg = Registry()
    first = pool_cache(reg, [K(1)])
    with pytest.raises(InvalidArgument, match="already bound"):
        pool_cache(reg, [K(7), K(1)])
    with pytest.raises(InvalidArgument, match="already bound"):
        reg.check_keys([K(1)], 4)  # what allocate checks before it takes memory
    assert reg.entries() == [first]
    assert pool_cache(reg, [K(7)]).keys == {K(7)}  # all or nothing: K(7) was not bound


def test_address_count_must_match_num_tensors() -> None:
    with pytest.raises(InvalidArgument, match="addresses"):
        Registry().add(GEO, ADDRS[:3], owned=False)


# ------------------------------------------------------------------------------ lifetimes


def test_deallocate_defers_the_free_while_keys_hold_the_cache() -> None:
    """A key the core reports consumed (NativeEngine._sync) or remove_cache_key unbinds it;
    the last one releases a deallocated cache."""
    reg = Registry()
    frees = Frees()
    e = pool_cache(reg, [K(1), K(2)], frees)
    reg.deallocate(e.cache_id)
    assert frees.calls == 0
    with pytest.raises(CacheNotFound):
        reg.get(e.cache_id)
    with pytest.raises(CacheNotFound):
        reg.hold(e.cache_id)
    reg.remove_key(K(1))
    assert frees.calls == 0
    reg.remove_key(K(2))
    assert frees.calls == 1
    reg.remove_key(K(2))  # unknown now: no-op, no second free
    reg.deallocate(e.cache_id)
    assert frees.calls == 1
    pool_cache(reg, [K(1), K(2)])  # the keys are free to bind again


def test_a_hold_defers_the_free_of_a_deallocated_cache() -> None:
    reg = Registry()
    frees = Frees()
    e = pool_cache(reg, [K(1)], frees)
    held = reg.hold(e.cache_id)
    reg.deallocate(e.cache_id)
    reg.remove_key(K(1))
    assert frees.calls == 0  # a local transfer still uses this memory
    reg.unhold(held)
    assert frees.calls == 1
    with pytest.raises(CacheNotFound):
        reg.hold(e.cache_id)


def test_deallocate_without_keys_frees_at_once() -> None:
    reg = Registry()
    frees = Frees()
    e = pool_cache(reg, [None, None], frees)
    reg.deallocate(e.cache_id)
    assert frees.calls == 1


def test_deallocate_of_a_blocks_cache_drops_its_keys() -> None:
    reg = Registry()
    frees = Frees()
    e = pool_cache(reg, [K(1)], frees, geo=BLOCKS, blocks_model_id=4)
    reg.deallocate(e.cache_id, drop_keys=True)
    assert frees.calls == 1 and e.keys == set()
    pool_cache(reg, [K(1)])  # unbound


def test_deallocate_unknown_or_registered_is_a_no_op_and_so_is_removing_its_keys() -> None:
    reg = Registry()
    e = user_cache(reg, [K(1)])
    reg.deallocate(99)
    reg.deallocate(e.cache_id)
    assert reg.get(e.cache_id) is e
    reg.remove_key(K(1))  # keys on registered memory stay (remove_cache_key is a no-op)
    assert e.keys == {K(1)}


def test_remove_key_unknown_is_a_no_op() -> None:
    reg = Registry()
    reg.remove_key(K(5))
    e = pool_cache(reg, [K(1)])
    reg.remove_key(K(2))
    assert e.keys == {K(1)}


# ------------------------------------------------------------------------------ unregister


@pytest.mark.timeout(20)
def test_unregister_waits_for_holds_and_refuses_new_ones_meanwhile() -> None:
    reg = Registry()
    frees = Frees()
    e = reg.add(GEO, ADDRS, owned=False, keys=[K(1)], free=frees)
    held = reg.hold(e.cache_id)
    done = threading.Event()

    def forget() -> None:
        reg.unregister(e.cache_id, wait=15.0)
        done.set()

    t = threading.Thread(target=forget)
    t.start()
    try:
        assert not done.wait(0.2)  # still waiting: a local transfer holds it
        with pytest.raises(CacheNotFound):
            reg.hold(e.cache_id)  # no new hold while it waits
        assert frees.calls == 0
    finally:
        reg.unhold(held)
        t.join(10)
    assert done.is_set()
    assert frees.calls == 1
    assert e.keys == set()
    user_cache(reg, [K(1)])  # its key went with it


def test_unregister_that_outwaits_its_bound_keeps_the_cache_registered() -> None:
    """If a hold outlives unregister's wait, the cache stays registered (its memory is still
    in use, the caller must not free it), and it takes holds again."""
    reg = Registry()
    entry = user_cache(reg)
    held = reg.hold(entry.cache_id)
    with pytest.raises(Timeout, match="still being transferred"):
        reg.unregister(entry.cache_id, wait=0.05)
    assert reg.get(entry.cache_id) is entry and not entry.closing
    reg.unhold(reg.hold(entry.cache_id))
    reg.unhold(held)
    reg.unregister(entry.cache_id, wait=0.05)
    with pytest.raises(CacheNotFound):
        reg.get(entry.cache_id)


def test_unregister_unknown_is_a_no_op() -> None:
    Registry().unregister(12)


def test_unregister_waits_for_a_hold_and_wakes_at_its_end() -> None:
    """A local pull's hold keeps unregister waiting; its unhold wakes it at once (unhold
    notifies a closing entry's waiter only, so a pull nobody waits on pays nothing)."""
    reg = Registry()
    e = reg.add(GEO, ADDRS, owned=False)
    held = reg.hold(e.cache_id)
    reg.unhold(reg.hold(e.cache_id))  # nobody waits: nothing to wake
    done = threading.Event()
    t = threading.Thread(target=lambda: (reg.unregister(e.cache_id, wait=25.0), done.set()))
    t.start()
    try:
        assert not done.wait(0.2)
    finally:
        t0 = time.monotonic()
        reg.unhold(held)
        assert done.wait(10)
        t.join(10)
    assert time.monotonic() - t0 < 5
    with pytest.raises(CacheNotFound):
        reg.hold(e.cache_id)


# ------------------------------------------------------------------------------ clear


def test_clear_returns_every_entry_and_forgets_them() -> None:
    reg = Registry()
    a, b = user_cache(reg, [K(1)]), pool_cache(reg, [K(2)])
    assert set(map(id, reg.clear())) == {id(a), id(b)}
    assert reg.entries() == []
    with pytest.raises(CacheNotFound):
        reg.hold(a.cache_id)
    pool_cache(reg, [K(1), K(2)])  # no key is bound any more


def test_clear_returns_every_live_entry_however_it_is_held() -> None:
    """finalize waits for what clear returns: an entry held only by a key, or only by a
    hold, counts as much as one held by its id; released ones do not."""
    reg = Registry()
    by_id_only = pool_cache(reg, [])
    key_held = pool_cache(reg, [K(1)])
    reg.deallocate(key_held.cache_id)
    hold_held = pool_cache(reg, [K(2)])
    held = reg.hold(hold_held.cache_id)
    reg.deallocate(hold_held.cache_id)
    reg.remove_key(K(2))
    gone = pool_cache(reg, [])
    reg.deallocate(gone.cache_id)
    entries = reg.clear()
    assert set(map(id, entries)) == {id(by_id_only), id(key_held), id(hold_held)}
    assert reg.wait_unleased(entries, 0.01) == 1
    threading.Timer(0.1, reg.unhold, (held,)).start()
    assert reg.wait_unleased(entries, 5.0) == 0


# ------------------------------------------------------------------------------ request size


def test_a_requester_checks_its_own_request_size() -> None:
    """What the core's owner refuses (Native.OpenRefusesRequestsNamingTooManySpans, ...
    WhatDoesNotFitAndHoldsNothing), the requester refuses before it asks."""
    check_request_size(np.arange(4, dtype=np.uint32), np.zeros(8, np.uint64))
    spans = MAX_REQUEST_SPANS // 4096 + 1
    with pytest.raises(InvalidArgument, match="spans one request may name"):
        check_request_size(np.arange(4096, dtype=np.uint32), np.zeros(spans, np.uint64))
    for n in (3, 300):  # the set and the np.unique ways
        tensors = np.arange(n, dtype=np.uint32)
        tensors[-1] = 1
        with pytest.raises(InvalidArgument, match="more than once"):
            check_request_size(tensors, np.zeros(1, np.uint64))
