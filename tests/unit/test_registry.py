"""Unit tests of core.registry: key binding, key consumption, lifetimes, leases, owner checks.

The registry never touches memory, so entries carry made-up tensor addresses; a ``free``
callback records when the memory would go back to its pool.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from datadist.core.errors import CacheNotFound, Code, InvalidArgument, Timeout
from datadist.core.layout import Geometry
from datadist.core.registry import UINT64_MAX, KeyId, Lease, Registry, key_id
from datadist.wire.protocol import KeyKind, KeyRef

ADDRS = [0x10000, 0x20000, 0x30000, 0x40000]
GEO = Geometry(num_tensors=4, tensor_bytes=4 * 256, units=4)  # 4 slots of 256 bytes
BLOCKS = Geometry(num_tensors=2, tensor_bytes=8 * 64, units=8, is_blocks=True)
ALL = np.arange(4, dtype=np.uint32)


def u64(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.uint64)


def by_key(req: int, model: int = 0, prefix: int = UINT64_MAX) -> KeyRef:
    return KeyRef(KeyKind.CACHE_KEY, req, model, prefix)


def by_prefix(prefix: int, model: int = 0) -> KeyRef:
    return KeyRef(KeyKind.CACHE_KEY, UINT64_MAX, model, prefix)


def by_id(cache_id: int, index: int = 0) -> KeyRef:
    return KeyRef(KeyKind.CACHE_ID, cache_id, index, 0)


def by_model(model: int) -> KeyRef:
    return KeyRef(KeyKind.BLOCKS_KEY, 0, model, 0)


def read(reg: Registry, key: KeyRef, tensors: np.ndarray = ALL, offset: int = 0,
         length: int = 256, unit_bytes: int = 0) -> Lease:
    return reg.open(key, unit_bytes, np.asarray(tensors, np.uint32), u64(offset), u64(length))


def pull(reg: Registry, key: KeyRef, tensors: np.ndarray = ALL, ok: bool = True) -> None:
    """Open and close a read, as a successful (or failed) transfer does."""
    reg.close(read(reg, key, tensors), ok)


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


def test_key_i_binds_slot_i_and_padding_skips_a_slot() -> None:
    reg = Registry()
    e = pool_cache(reg, [K(10), None, K(12)])
    assert e.keys == {K(10), K(12)}
    lease = read(reg, by_key(10))
    assert lease.bases.tolist() == ADDRS  # slot 0
    reg.close(lease, False)
    lease = read(reg, by_key(12))
    assert lease.bases.tolist() == [a + 2 * 256 for a in ADDRS]
    assert lease.binding is not None and lease.binding.slot == 2
    reg.close(lease, False)
    with pytest.raises(CacheNotFound):
        read(reg, by_key(11))


def test_keys_are_per_model_id_and_cluster_id_is_not_part_of_them() -> None:
    reg = Registry()
    a = pool_cache(reg, [K(1, model=0)])
    b = pool_cache(reg, [K(1, model=1)])
    for key, entry in ((by_key(1, 0), a), (by_key(1, 1), b)):
        lease = read(reg, key)
        assert lease.entry is entry
        reg.close(lease, False)


def test_prefix_keys_live_apart_from_req_ids() -> None:
    reg = Registry()
    a = pool_cache(reg, [K(3)])
    b = pool_cache(reg, [P(3)])
    assert read(reg, by_prefix(3)).entry is b
    assert read(reg, by_key(3)).entry is a


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
    assert reg.entries() == [first]
    with pytest.raises(CacheNotFound):
        read(reg, by_key(7))  # all or nothing: K(7) was not bound either
    assert read(reg, by_key(1)).entry is first


def test_address_count_must_match_num_tensors() -> None:
    with pytest.raises(InvalidArgument, match="addresses"):
        Registry().add(GEO, ADDRS[:3], owned=False)


# ------------------------------------------------------------------------------ blocks keys


def test_blocks_cache_key_is_last_writer_wins() -> None:
    reg = Registry()
    old = user_cache(reg, geo=BLOCKS, blocks_model_id=7)
    new = user_cache(reg, geo=BLOCKS, blocks_model_id=7)
    other = user_cache(reg, geo=BLOCKS, blocks_model_id=8)
    for model, entry in ((7, new), (8, other)):
        lease = read(reg, by_model(model), ALL[:2], length=64)
        assert lease.entry is entry
        reg.close(lease, True)
    # Forgetting the older cache must not unbind the newer one's key.
    reg.unregister(old.cache_id)
    assert read(reg, by_model(7), ALL[:2], length=64).entry is new


def test_forgetting_the_current_blocks_cache_unbinds_its_model_id() -> None:
    reg = Registry()
    e = user_cache(reg, geo=BLOCKS, blocks_model_id=3)
    reg.unregister(e.cache_id)
    with pytest.raises(CacheNotFound, match="model_id=3"):
        read(reg, by_model(3), ALL[:2], length=64)


def test_blocks_key_offsets_are_absolute_within_the_tensor() -> None:
    reg = Registry()
    user_cache(reg, geo=BLOCKS, blocks_model_id=0)
    lease = read(reg, by_model(0), ALL[:2], offset=7 * 64, length=64, unit_bytes=64)
    assert lease.bases.tolist() == ADDRS[:2]
    assert lease.iov()[0].tolist() == [ADDRS[0] + 448, ADDRS[1] + 448]
    reg.close(lease, True)


def test_blocks_key_refuses_a_block_size_mismatch_and_unit_bytes_zero_means_any() -> None:
    reg = Registry()
    user_cache(reg, geo=BLOCKS, blocks_model_id=0)
    with pytest.raises(InvalidArgument, match="block size mismatch"):
        read(reg, by_model(0), ALL[:2], length=32, unit_bytes=32)
    reg.close(read(reg, by_model(0), ALL[:2], length=32, unit_bytes=0), True)


def test_blocks_key_span_past_the_tensor_is_refused() -> None:
    reg = Registry()
    user_cache(reg, geo=BLOCKS, blocks_model_id=0)
    with pytest.raises(InvalidArgument, match="src block 8 out of range: cache 1 has 8 blocks"):
        read(reg, by_model(0), ALL[:2], offset=8 * 64, length=64, unit_bytes=64)


# ------------------------------------------------------------------------------ consumption


def test_req_id_key_of_a_pool_cache_is_consumed_by_one_successful_read() -> None:
    reg = Registry()
    pool_cache(reg, [K(1), K(2)])
    pull(reg, by_key(1))
    with pytest.raises(CacheNotFound):
        read(reg, by_key(1))
    pull(reg, by_key(2))  # the other slot's key is untouched until read


def test_layer_wise_reads_add_up_before_the_key_is_consumed() -> None:
    reg = Registry()
    pool_cache(reg, [K(1)])
    pull(reg, by_key(1), ALL[[0, 1]])
    pull(reg, by_key(1), ALL[[0, 1]])  # again the same layer: still not all tensors
    pull(reg, by_key(1), ALL[[3]])
    pull(reg, by_key(1), ALL[[2]])  # the last missing tensor
    with pytest.raises(CacheNotFound):
        read(reg, by_key(1))


def test_failed_reads_and_writes_do_not_consume() -> None:
    reg = Registry()
    pool_cache(reg, [K(1)])
    pull(reg, by_key(1), ok=False)
    reg.close(read(reg, by_key(1)), True, consume=False)  # a write through the key
    pull(reg, by_key(1))  # still there, consumed now
    with pytest.raises(CacheNotFound):
        read(reg, by_key(1))


def test_prefix_keys_are_never_consumed() -> None:
    reg = Registry()
    pool_cache(reg, [P(1)])
    for _ in range(3):
        pull(reg, by_prefix(1))


def test_keys_on_registered_memory_are_never_consumed() -> None:
    reg = Registry()
    user_cache(reg, [K(1)])
    for _ in range(3):
        pull(reg, by_key(1))
    reg.remove_key(K(1))  # and remove_cache_key is a no-op for them
    pull(reg, by_key(1))


def test_reads_by_cache_id_do_not_consume_keys() -> None:
    reg = Registry()
    e = pool_cache(reg, [K(1)])
    pull(reg, by_id(e.cache_id, 0))
    pull(reg, by_key(1))


def test_key_removed_and_rebound_elsewhere_during_a_read_is_not_consumed() -> None:
    reg = Registry()
    pool_cache(reg, [K(1)])
    lease = read(reg, by_key(1))
    reg.remove_key(K(1))
    newer = pool_cache(reg, [K(1)])
    reg.close(lease, True)  # the old read finishing must not eat the new binding
    assert read(reg, by_key(1)).entry is newer


# ------------------------------------------------------------------------------ lifetimes


def test_deallocate_defers_the_free_while_keys_hold_the_cache() -> None:
    reg = Registry()
    frees = Frees()
    e = pool_cache(reg, [K(1), K(2)], frees)
    reg.deallocate(e.cache_id)
    assert frees.calls == 0
    with pytest.raises(CacheNotFound):
        reg.get(e.cache_id)
    with pytest.raises(CacheNotFound):
        read(reg, by_id(e.cache_id))
    pull(reg, by_key(1))  # keys still work; this consumes K(1)
    assert frees.calls == 0
    reg.remove_key(K(2))
    assert frees.calls == 1
    reg.remove_key(K(2))  # unknown now: no-op, no second free
    reg.deallocate(e.cache_id)
    assert frees.calls == 1


def test_consuming_the_last_key_of_a_deallocated_cache_frees_it() -> None:
    reg = Registry()
    frees = Frees()
    e = pool_cache(reg, [K(1)], frees)
    reg.deallocate(e.cache_id)
    pull(reg, by_key(1))
    assert frees.calls == 1


def test_a_lease_defers_the_free_until_the_transfer_ends() -> None:
    reg = Registry()
    frees = Frees()
    e = pool_cache(reg, [K(1)], frees)
    lease = read(reg, by_key(1))
    reg.deallocate(e.cache_id)
    reg.remove_key(K(1))
    assert frees.calls == 0  # a peer is still reading this memory
    reg.close(lease, True)
    assert frees.calls == 1


def test_hold_defers_the_free_of_a_local_destination() -> None:
    reg = Registry()
    frees = Frees()
    e = pool_cache(reg, [], frees)
    held = reg.hold(e.cache_id)
    reg.deallocate(e.cache_id)
    assert frees.calls == 0
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
    e = pool_cache(reg, [], frees, geo=BLOCKS, blocks_model_id=4)
    reg.deallocate(e.cache_id, drop_keys=True)
    assert frees.calls == 1
    with pytest.raises(CacheNotFound):
        read(reg, by_model(4), ALL[:2], length=64)


def test_deallocate_unknown_or_registered_is_a_no_op() -> None:
    reg = Registry()
    e = user_cache(reg, [K(1)])
    reg.deallocate(99)
    reg.deallocate(e.cache_id)
    assert reg.get(e.cache_id) is e
    pull(reg, by_key(1))


def test_remove_key_unknown_is_a_no_op() -> None:
    reg = Registry()
    reg.remove_key(K(5))
    e = pool_cache(reg, [K(1)])
    reg.remove_key(K(2))
    assert e.keys == {K(1)}


# ------------------------------------------------------------------------------ unregister


@pytest.mark.timeout(20)
def test_unregister_waits_for_live_leases() -> None:
    reg = Registry()
    frees = Frees()
    e = reg.add(GEO, ADDRS, owned=False, keys=[K(1)], free=frees)
    lease = read(reg, by_id(e.cache_id))
    done = threading.Event()

    def forget() -> None:
        reg.unregister(e.cache_id, wait=15.0)
        done.set()

    t = threading.Thread(target=forget)
    t.start()
    try:
        assert not done.wait(0.2)  # still waiting: a peer is reading
        # New requests are refused at once while it waits.
        with pytest.raises(CacheNotFound):
            read(reg, by_id(e.cache_id))
        with pytest.raises(CacheNotFound):
            read(reg, by_key(1))
        assert frees.calls == 0
    finally:
        reg.close(lease, True)
        t.join(10)
    assert done.is_set()
    assert frees.calls == 1


def test_unregister_times_out_when_a_lease_stays() -> None:
    reg = Registry()
    e = user_cache(reg)
    lease = read(reg, by_id(e.cache_id))
    with pytest.raises(Timeout, match="still being transferred"):
        reg.unregister(e.cache_id, wait=0.05)
    reg.close(lease, True)


def test_unregister_unknown_is_a_no_op() -> None:
    Registry().unregister(12)


def test_clear_returns_every_entry_and_forgets_them() -> None:
    reg = Registry()
    a, b = user_cache(reg, [K(1)]), pool_cache(reg, [K(2)])
    assert set(map(id, reg.clear())) == {id(a), id(b)}
    assert reg.entries() == []
    with pytest.raises(CacheNotFound):
        read(reg, by_key(1))


# ------------------------------------------------------------------------------ open() checks


def test_open_by_cache_id_and_batch_index() -> None:
    reg = Registry()
    e = user_cache(reg)
    lease = reg.open(by_id(e.cache_id, 3), 0, u64(1, 2).astype(np.uint32), u64(16), u64(240))
    assert lease.bases.tolist() == [ADDRS[1] + 768, ADDRS[2] + 768]
    assert lease.nbytes == 480
    assert e.leases == 1
    reg.close(lease, True)
    assert e.leases == 0


def test_a_slot_read_may_run_into_the_following_slots_but_not_past_the_tensor() -> None:
    reg = Registry()
    e = user_cache(reg)
    reg.close(read(reg, by_id(e.cache_id, 1), length=3 * 256), True)
    with pytest.raises(InvalidArgument, match="outside"):
        read(reg, by_id(e.cache_id, 1), length=3 * 256 + 1)
    with pytest.raises(InvalidArgument, match="outside"):
        read(reg, by_id(e.cache_id, 3), offset=200, length=57)


@pytest.mark.parametrize(
    ("tensors", "offset", "length", "match"),
    [
        ([4], 0, 8, "tensor 4 out of range"),
        ([0, 2**32 - 1], 0, 8, "out of range"),
        ([0], 2**64 - 8, 16, "outside"),
        ([0], 0, 2**64 - 1, "outside"),
    ],
)
def test_open_refuses_what_does_not_fit(
    tensors: list[int], offset: int, length: int, match: str
) -> None:
    reg = Registry()
    e = user_cache(reg)
    with pytest.raises(InvalidArgument, match=match):
        read(reg, by_id(e.cache_id), np.array(tensors, np.uint32), offset, length)
    assert e.leases == 0  # a refused request holds nothing


@pytest.mark.parametrize("index", [4, 2**32, 2**64 - 1])
def test_open_refuses_a_batch_index_out_of_range(index: int) -> None:
    reg = Registry()
    e = user_cache(reg)
    with pytest.raises(InvalidArgument, match="batch index"):
        read(reg, by_id(e.cache_id, index))
    assert e.leases == 0


def test_open_unknown_names() -> None:
    reg = Registry()
    user_cache(reg, [K(1)], geo=GEO)
    for key in (by_id(2), by_key(2), by_key(1, model=1), by_prefix(1), by_model(0),
                by_key(UINT64_MAX)):
        with pytest.raises(CacheNotFound) as info:
            read(reg, key)
        assert info.value.code == Code.KV_CACHE_NOT_EXIST


def test_open_refuses_a_cache_that_is_not_remote_accessible() -> None:
    reg = Registry()
    e = user_cache(reg, [K(1)], remote_accessible=False)
    for key in (by_id(e.cache_id), by_key(1)):
        with pytest.raises(InvalidArgument, match="not remote accessible"):
            read(reg, key)
    assert e.leases == 0


def test_open_with_no_tensors_or_spans() -> None:
    reg = Registry()
    e = user_cache(reg)
    lease = reg.open(by_id(e.cache_id), 0, np.zeros(0, np.uint32), u64(), u64())
    assert lease.nbytes == 0
    reg.close(lease, True)


# ------------------------------------------------------------------------------ newer owner checks


def test_open_refuses_requests_naming_too_many_spans() -> None:
    from datadist.core.registry import MAX_REQUEST_SPANS

    reg = Registry()
    e = user_cache(reg)
    tensors = np.zeros(4096, np.uint32)
    spans = MAX_REQUEST_SPANS // 4096 + 1
    with pytest.raises(InvalidArgument, match="spans one request may name"):
        reg.open(by_id(e.cache_id), 0, tensors, np.zeros(spans, np.uint64),
                 np.zeros(spans, np.uint64))
    assert e.leases == 0


def test_open_checks_the_requesters_layout_tag() -> None:
    from datadist.core.layout import layout_tag

    reg = Registry()
    f16, f32 = layout_tag(1, (64,)), layout_tag(0, (64,))
    geo = Geometry(num_tensors=2, tensor_bytes=8 * 64, units=8, is_blocks=True, layout=f16)
    e = reg.add(geo, ADDRS[:2], owned=False, blocks_model_id=0)
    reg.close(reg.open(by_model(0), 64, ALL[:2], u64(0), u64(64), layout=f16), True)
    reg.close(reg.open(by_model(0), 64, ALL[:2], u64(0), u64(64), layout=0), True)
    with pytest.raises(InvalidArgument, match="holds DT_FLOAT16, the requester's cache DT_FLOAT:"):
        reg.open(by_model(0), 64, ALL[:2], u64(0), u64(64), layout=f32)
    with pytest.raises(InvalidArgument, match="block shape"):
        reg.open(by_model(0), 64, ALL[:2], u64(0), u64(64), layout=layout_tag(1, (32, 2)))
    assert e.leases == 0


class TestOpenAddresses:
    """Writes by raw address (transfer_cache_async's TransferConfig): every span must lie in
    one tensor of one remote-accessible cache."""

    def addr_ref(self) -> KeyRef:
        return KeyRef(KeyKind.ADDRESS, 0, 0, 0)

    def write(self, reg: Registry, offsets: list[int], lengths: list[int],
              tensors: list[int] = [0]) -> Lease:  # noqa: B006
        return reg.open(self.addr_ref(), 0, np.array(tensors, np.uint32), u64(*offsets),
                        u64(*lengths))

    def test_spans_inside_one_tensor(self) -> None:
        reg = Registry()
        e = user_cache(reg)
        lease = self.write(reg, [ADDRS[1] + 8, ADDRS[1] + 1000], [16, 24])
        assert lease.entry is e and e.leases == 1
        assert lease.iov()[0].tolist() == [ADDRS[1] + 8, ADDRS[1] + 1000]
        reg.close(lease, True, consume=False)
        assert e.leases == 0

    def test_span_leaving_the_tensor_is_refused(self) -> None:
        reg = Registry()
        e = user_cache(reg)
        with pytest.raises(InvalidArgument, match="do not lie inside"):
            self.write(reg, [ADDRS[0] + 1000], [25])  # 1024-byte tensor
        # one span in tensor 0, another in tensor 1: not one tensor
        with pytest.raises(InvalidArgument, match="do not lie inside"):
            self.write(reg, [ADDRS[0], ADDRS[1]], [8, 8])
        # the wrap-around trick: a length that brings the end back below the start
        with pytest.raises(InvalidArgument, match="do not lie inside"):
            self.write(reg, [ADDRS[0] + 8], [2**64 - 8])
        assert e.leases == 0

    def test_unknown_and_private_memory_get_one_answer(self) -> None:
        """Issue 21 item 2: "nothing here" and "memory here, refused" are one code and one
        message, so a peer cannot find where our (private) memory lies by probing."""
        reg = Registry()
        e = user_cache(reg, remote_accessible=False)
        answers = set()
        for offsets in ([0x5000], [ADDRS[0]], [ADDRS[0] + 1000]):
            with pytest.raises(InvalidArgument) as got:
                self.write(reg, offsets, [8])
            answers.add((type(got.value), got.value.code, str(got.value)))
        assert len(answers) == 1
        assert e.leases == 0

    def test_zero_length_spans_are_refused_inside_and_outside(self) -> None:
        """Issue 21 item 2: a 0-byte span passed every bounds check and was the probe of the
        address oracle; now it is refused, with the same answer wherever it points."""
        reg = Registry()
        e = user_cache(reg)
        answers = set()
        for offsets in ([ADDRS[0]], [0x5000], [ADDRS[1] + 10]):
            with pytest.raises(InvalidArgument) as got:
                self.write(reg, offsets, [0])
            answers.add(str(got.value))
        assert len(answers) == 1 and e.leases == 0
        with pytest.raises(InvalidArgument, match="empty"):  # by cache id too
            reg.open(KeyRef(KeyKind.CACHE_ID, e.cache_id, 0, 0), 0, np.array([0], np.uint32),
                     u64(0), u64(0))
        assert e.leases == 0

    @pytest.mark.parametrize(
        ("tensors", "offsets", "lengths"),
        [([1], [ADDRS[0]], [8]), ([0, 0], [ADDRS[0]], [8]), ([0], [], [])],
    )
    def test_malformed(self, tensors: list[int], offsets: list[int], lengths: list[int]) -> None:
        reg = Registry()
        user_cache(reg)
        with pytest.raises(InvalidArgument):
            self.write(reg, offsets, lengths, tensors)


def test_unregister_that_outwaits_its_bound_keeps_the_cache_registered() -> None:
    """If a lease outlives unregister's wait, the cache stays registered (its memory is still
    in use, the caller must not free it), and no new transfer may start meanwhile."""
    reg = Registry()
    mem = np.zeros(64, np.uint8)
    entry = reg.add(Geometry(1, 64, 1), [mem.ctypes.data], owned=False)
    one = np.array([0], np.uint32)
    lease = reg.open(KeyRef(KeyKind.CACHE_ID, entry.cache_id, 0), 0, one,
                     np.array([0], np.uint64), np.array([64], np.uint64))
    with pytest.raises(Timeout):
        reg.unregister(entry.cache_id, wait=0.05)
    assert reg.get(entry.cache_id) is entry and not entry.closing
    reg.close(lease, True)
    reg.unregister(entry.cache_id, wait=0.05)
    with pytest.raises(CacheNotFound):
        reg.get(entry.cache_id)


# ------------------------------------------------------------------------------ issue 9


def test_clear_returns_every_live_entry_however_it_is_held() -> None:
    """finalize waits for what clear returns: an entry held only by a key, or only by a
    lease, counts as much as one held by its id; released ones do not."""
    reg = Registry()
    by_id_only = pool_cache(reg, [])
    key_held = pool_cache(reg, [K(1)])
    reg.deallocate(key_held.cache_id)
    lease_held = pool_cache(reg, [K(2)])
    lease = read(reg, by_key(2))
    reg.deallocate(lease_held.cache_id)
    reg.remove_key(K(2))
    gone = pool_cache(reg, [])
    reg.deallocate(gone.cache_id)
    assert set(map(id, reg.clear())) == {id(by_id_only), id(key_held), id(lease_held)}
    reg.close(lease, True)


def test_a_tensor_named_twice_is_refused_for_reads_and_writes() -> None:
    reg = Registry()
    e = user_cache(reg)
    for write in (False, True):
        with pytest.raises(InvalidArgument, match="more than once"):
            reg.open(by_id(e.cache_id), 0, np.array([1, 2, 1], np.uint32), u64(0), u64(8),
                     read=not write)
    assert e.leases == 0


def test_unlease_frees_the_memory_and_settle_decides_the_key() -> None:
    reg = Registry()
    frees = Frees()
    e = pool_cache(reg, [K(1)], frees)
    reg.deallocate(e.cache_id)
    lease = read(reg, by_key(1))
    reg.unlease(lease)
    assert e.leases == 0 and frees.calls == 0  # the key still holds the cache
    reg.settle(lease, False)
    lease = read(reg, by_key(1))  # not consumed: readable again
    reg.unlease(lease)
    reg.settle(lease, True)
    assert frees.calls == 1  # consumed, and with it the cache


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
