"""The engine's caches in the core's registry, the only one (cpp/src/registry.h): what
NativeEngine's cache calls (register, allocate, deallocate, unregister, remove_key, held,
cache) do, with no Python copy of ids, keys or holds; and the requester's own request-size
check (core/keys.py).

What peers may ask of a cache (resolving keys, span checks, leases, consumption, address
writes, fences) and the order of the registry's hooks are tested in cpp/tests/registry_test.cc;
a key consumed by a peer's read, through the API, in tests/api.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from datadist.core import native
from datadist.core.config import DEVICE, HOST, EngineConfig
from datadist.core.errors import CacheNotFound, Code, InvalidArgument, Timeout
from datadist.core.keys import (
    UINT64_MAX,
    KeyId,
    KeyKind,
    KeyRef,
    key_id,
)
from datadist.core.layout import Geometry, every_tensor, plan_slot
from datadist.memory.pool import PoolConfig

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not native.available()[0], reason="the native core is not built"),
]

GEO = Geometry(num_tensors=4, tensor_bytes=4 * 256, units=4)  # 4 slots of 256 bytes
BLOCKS = Geometry(num_tensors=2, tensor_bytes=8 * 64, units=8, is_blocks=True)


def K(req: int, model: int = 0) -> KeyId:
    return KeyId(req, model, False)


def P(prefix: int, model: int = 0) -> KeyId:
    return KeyId(prefix, model, True)


@pytest.fixture
def eng() -> Iterator[native.NativeEngine]:
    engine = native.NativeEngine(EngineConfig(cluster_id=1, role=1,
                                              host_pool=PoolConfig(1 << 20, 16)))
    try:
        yield engine
    finally:
        engine.close()


@pytest.fixture
def user_mem() -> np.ndarray:
    return np.zeros((4, 1024), np.uint8)  # room for GEO's 4 tensors of 1 KiB


def addrs_of(mem: np.ndarray, geo: Geometry = GEO) -> list[int]:
    return [int(mem[i].ctypes.data) for i in range(geo.num_tensors)]


def used(eng: native.NativeEngine) -> int:
    got = eng.pool_used(HOST)
    assert got is not None
    return got


# ------------------------------------------------------------------------------ ids and keys


def test_key_id_of_cache_key_fields() -> None:
    assert key_id(5, UINT64_MAX, 1) == KeyId(5, 1, False)
    assert key_id(UINT64_MAX, 9, 1) == KeyId(9, 1, True)
    assert key_id(UINT64_MAX, UINT64_MAX, 1) is None  # the padding key


def test_the_core_numbers_caches_from_one_and_describes_them(
        eng: native.NativeEngine, user_mem: np.ndarray) -> None:
    a = eng.register(GEO, addrs_of(user_mem), placement=DEVICE, remote_accessible=False)
    b = eng.allocate(BLOCKS, placement=HOST)
    assert (a.cache_id, b.cache_id) == (1, 2)
    assert eng.cache_ids() == [1, 2]
    assert eng.filed(1) and eng.filed(2) and not eng.filed(3)
    got = eng.cache(1)
    assert (got.geometry, got.addrs.tolist(), got.owned, got.placement,
            got.remote_accessible) == (GEO, addrs_of(user_mem), False, DEVICE, False)
    got = eng.cache(2)
    assert (got.geometry, got.addrs.tolist(), got.owned, got.placement) == \
        (BLOCKS, b.addrs.tolist(), True, HOST)
    assert not got.addrs.flags.writeable  # a snapshot, not something to edit
    with pytest.raises(CacheNotFound):
        eng.cache(3)


def test_padding_keys_bind_nothing_and_keys_are_per_model_and_kind(
        eng: native.NativeEngine) -> None:
    eng.allocate(GEO, placement=HOST, keys=[None, K(1), None, P(1)])
    assert eng.key_bound(K(1)) and eng.key_bound(P(1))
    assert not eng.key_bound(K(1, model=2)) and not eng.key_bound(P(2))
    eng.allocate(GEO, placement=HOST, keys=[K(1, model=2), P(2)])  # other model, other kind
    assert eng.key_bound(K(1, model=2))


@pytest.mark.parametrize(
    "keys, match",
    [
        ([K(i) for i in range(5)], "out of range"),  # more keys than slots
        ([K(1), K(1)], "duplicate"),
        ([K(1), None, K(1)], "duplicate"),
    ],
)
def test_bad_key_lists_are_refused_before_pool_memory_is_taken(
        eng: native.NativeEngine, keys: list[KeyId | None], match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        eng.allocate(GEO, placement=HOST, keys=keys)
    assert used(eng) == 0
    assert eng.cache_ids() == []


def test_a_key_already_bound_is_refused_and_nothing_is_filed(
        eng: native.NativeEngine, user_mem: np.ndarray) -> None:
    eng.allocate(GEO, placement=HOST, keys=[K(1)])
    before = used(eng)
    with pytest.raises(InvalidArgument, match="already bound"):
        eng.allocate(GEO, placement=HOST, keys=[K(2), K(1)])
    with pytest.raises(InvalidArgument, match="already bound"):
        eng.register(GEO, addrs_of(user_mem), placement=HOST, keys=[K(3), K(1)])
    assert used(eng) == before  # the refused allocation's memory went back
    assert not eng.key_bound(K(2)) and not eng.key_bound(K(3))
    assert eng.cache_ids() == [1]


def test_address_count_must_match_num_tensors(eng: native.NativeEngine,
                                              user_mem: np.ndarray) -> None:
    with pytest.raises(InvalidArgument, match="addresses"):
        eng.register(GEO, addrs_of(user_mem)[:3], placement=HOST)
    with pytest.raises(InvalidArgument, match="non-zero"):
        eng.register(GEO, [0, *addrs_of(user_mem)[1:]], placement=HOST)


# ------------------------------------------------------------------------------ pool memory


def test_deallocate_defers_the_free_while_keys_hold_the_cache(eng: native.NativeEngine) -> None:
    entry = eng.allocate(GEO, placement=HOST, keys=[K(1), K(2)])
    held = used(eng)
    assert held > 0
    eng.deallocate(entry.cache_id)
    with pytest.raises(CacheNotFound):
        eng.cache(entry.cache_id)  # the id is gone at once
    assert not eng.filed(entry.cache_id)
    assert used(eng) == held  # the keys still serve the cache
    eng.remove_key(K(1))
    assert used(eng) == held
    eng.remove_key(K(2))
    assert used(eng) == 0  # the last key let go: the core released it


def test_a_hold_defers_the_free_of_a_deallocated_cache(eng: native.NativeEngine) -> None:
    entry = eng.allocate(GEO, placement=HOST)
    with eng.held(entry.cache_id) as got:
        assert got.addrs.tolist() == entry.addrs.tolist()
        assert eng.leases(entry.cache_id) == 1
        eng.deallocate(entry.cache_id)
        assert used(eng) > 0  # a local transfer still holds it
    eng.remove_key(K(99))  # any later call frees what the core released
    assert used(eng) == 0


def test_deallocate_of_a_blocks_cache_drops_its_keys_and_model(eng: native.NativeEngine) -> None:
    entry = eng.allocate(BLOCKS, placement=HOST, keys=[K(1)], blocks_model_id=7)
    eng.deallocate(entry.cache_id, blocks=True)
    assert not eng.key_bound(K(1))
    assert used(eng) == 0


def test_deallocate_or_remove_key_of_registered_memory_is_a_no_op(
        eng: native.NativeEngine, user_mem: np.ndarray) -> None:
    entry = eng.register(GEO, addrs_of(user_mem), placement=HOST, keys=[K(1)])
    eng.deallocate(entry.cache_id)
    eng.remove_key(K(1))
    eng.remove_key(K(5))  # unknown
    eng.deallocate(42)  # unknown
    assert eng.cache(entry.cache_id).cache_id == entry.cache_id
    assert eng.key_bound(K(1))


def test_a_key_a_peer_consumed_releases_the_deallocated_cache(eng: native.NativeEngine) -> None:
    """The core consumes a req_id key when a peer's read of it succeeds, and with it the last
    hold on a deallocated pool cache: the core gives the memory back at its next release
    (any allocate, deallocate or remove_key), with no Python copy of the keys to keep in step."""
    eng.start_listening("127.0.0.1", 0)
    entry = eng.allocate(GEO, placement=HOST, keys=[K(7)])
    eng.deallocate(entry.cache_id)
    held = used(eng)
    assert held > 0 and eng.key_bound(K(7))
    puller = native.NativeEngine(EngineConfig(cluster_id=2, role=2, transport="tcp"))
    dst = np.zeros((4, 1024), np.uint8)
    try:
        assert eng.listen_address is not None
        puller.link(1, "127.0.0.1", eng.listen_address[1], 5.0)
        local = puller.register(GEO, [int(dst[i].ctypes.data) for i in range(4)],
                                placement=HOST)
        # one slot of 256 bytes per tensor: the puller's cache is GEO too, slot 0
        plan = plan_slot(local.geometry, 0, every_tensor(4))
        puller.pull(1, KeyRef(KeyKind.CACHE_KEY, 7, 0, UINT64_MAX), 0, plan, local.cache_id, 5.0)
    finally:
        puller.close()
    assert not eng.key_bound(K(7))  # consumed by the read
    eng.remove_key(K(99))  # any later call frees what the core released
    assert used(eng) == 0


# ------------------------------------------------------------------------------ unregister


def test_unregister_waits_for_holds_and_refuses_new_ones_meanwhile(
        eng: native.NativeEngine, user_mem: np.ndarray) -> None:
    """A local transfer's hold keeps unregister waiting (in the core, without the GIL: this
    thread runs meanwhile); no new hold is given while it waits; the hold's end lets it
    finish."""
    entry = eng.register(GEO, addrs_of(user_mem), placement=HOST, keys=[K(1)])
    done = threading.Event()
    errors: list[BaseException] = []

    def unregister() -> None:
        try:
            eng.unregister(entry.cache_id)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
        done.set()

    with eng.held(entry.cache_id):
        t = threading.Thread(target=unregister)
        t.start()
        deadline = time.monotonic() + 10
        refused = False
        while not refused and time.monotonic() < deadline:  # until the core marks it closing
            try:
                with eng.held(entry.cache_id):
                    pass
            except CacheNotFound:
                refused = True
        assert refused
        assert not eng.filed(entry.cache_id)  # being unregistered: no plan is reused for it
        assert not done.is_set()
    assert done.wait(10)
    t.join()
    assert errors == []
    with pytest.raises(CacheNotFound):
        eng.cache(entry.cache_id)
    assert not eng.key_bound(K(1))


def test_unregister_that_outwaits_its_bound_keeps_the_cache_registered(
        eng: native.NativeEngine, user_mem: np.ndarray,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "UNREGISTER_WAIT", 0.2)
    entry = eng.register(GEO, addrs_of(user_mem), placement=HOST)
    with eng.held(entry.cache_id):
        with pytest.raises(Timeout) as err:
            eng.unregister(entry.cache_id)
        assert err.value.code == Code.TIMEOUT
    assert eng.cache(entry.cache_id).cache_id == entry.cache_id  # still registered
    eng.unregister(entry.cache_id)
    eng.unregister(entry.cache_id)  # unknown now: a no-op
    assert eng.cache_ids() == []


def test_close_frees_the_pool_once_nothing_holds_a_cache() -> None:
    eng = native.NativeEngine(EngineConfig(cluster_id=1, role=1,
                                           host_pool=PoolConfig(1 << 20, 16)))
    eng.allocate(GEO, placement=HOST, keys=[K(1)])
    assert used(eng) > 0
    eng.close()
    assert eng.pool_used(HOST) is None
    names = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the directory's own descriptor, closed since
            names.append(os.readlink(f"/proc/self/fd/{fd}"))
    assert not any(n.startswith("/memfd:datadist-host-pool ") for n in names)  # closed
    with pytest.raises(CacheNotFound):
        eng.cache(1)

