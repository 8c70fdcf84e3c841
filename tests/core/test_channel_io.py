"""The core's TCP stream I/O as transfers see it: a frame and the raw bytes that follow it in
one segment, thousands of scattered spans in both directions (several IOV_MAX batches), a
silent owner, and core/local.py's local copy (kept: the local-copy helpers stay in
Python).

The Python Channel these tests were written for is gone with the Python engine; the core
reads each frame exactly (no read-ahead buffer), and its socket mechanics are GoogleTests
(cpp/tests/net_test.cc: bulk receives and sends, a stalled peer's deadline, a shutdown
waking a blocked receive). Here the same properties are checked through NativeEngine over
loopback TCP, against the core's own owner or a fake one speaking the wire by hand
(datadist.testing.fakes).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from datadist.core import local as iovmod
from datadist.core.config import EngineConfig
from datadist.core.errors import Busy, Timeout
from datadist.core.layout import Geometry, every_tensor, make_iov, plan_blocks, plan_slot
from datadist.core.native import NativeEngine
from datadist.testing.fakes import EchoOwner, SilentOwner
from datadist.wire import protocol as p

pytestmark = pytest.mark.timeout(30)

OWNER, PULLER, FAKE = 1, 2, 9
OTHER_HOST = b"\x07" * 16  # a boot id that is not this host's: the fake is served over TCP


def spans(buf: np.ndarray, cuts: list[tuple[int, int]]) -> np.ndarray:
    base = buf.ctypes.data
    return make_iov(np.array([base + o for o, _ in cuts], dtype=np.uint64),
                           np.array([n for _, n in cuts], dtype=np.uint64))


@pytest.fixture
def pair() -> Iterator[tuple[NativeEngine, NativeEngine]]:
    """An owner and a puller linked over TCP (``transport="tcp"``: no same-host path)."""
    owner = NativeEngine(EngineConfig(cluster_id=OWNER, role=1, listen=("127.0.0.1", 0),
                                      remote_cache_accessible=True))
    puller = NativeEngine(EngineConfig(cluster_id=PULLER, role=2, transport="tcp"))
    try:
        assert owner.listen_address is not None
        puller.link(OWNER, *owner.listen_address, 5.0)
        assert puller.get_link(OWNER).path_name == "tcp"
        yield owner, puller
    finally:
        puller.close()
        owner.close()


def test_thousands_of_scattered_blocks_both_ways_over_tcp(pair) -> None:
    """3 x IOV_MAX + 17 blocks of 24 bytes per tensor, pulled into a permutation of the
    destination's blocks and pushed back into another: every byte lands in its own span, in
    order, whatever batches the core cuts the spans into."""
    owner, puller = pair
    count, block, tensors = 3 * iovmod.IOV_MAX + 17, 24, 2
    geo = Geometry(tensors, count * block, count, is_blocks=True)
    rng = np.random.default_rng(11)
    src = rng.integers(0, 256, (tensors, count * block), dtype=np.uint8)
    dst = np.zeros_like(src)
    owner.register(geo, [int(src[t].ctypes.data) for t in range(tensors)], placement=0,
                   blocks_model_id=0)
    local = puller.register(geo, [int(dst[t].ctypes.data) for t in range(tensors)],
                            placement=0)
    order = rng.permutation(count)
    plan = plan_blocks(local.geometry, list(range(count)), order.tolist(),
                       every_tensor(tensors))
    key = p.KeyRef(p.KeyKind.BLOCKS_KEY, 0, 0)
    puller.pull(OWNER, key, geo.unit_bytes, plan, local.cache_id, 10.0)
    got = dst.reshape(tensors, count, block)
    np.testing.assert_array_equal(got[:, order], src.reshape(tensors, count, block))
    # and back: the puller's blocks, taken in another order, pushed into the owner's (a
    # push's plan names the owner's blocks first, its own second)
    dst[...] = rng.integers(0, 256, dst.shape, dtype=np.uint8)
    back = rng.permutation(count)
    plan = plan_blocks(local.geometry, list(range(count)), back.tolist(),
                       every_tensor(tensors))
    puller.push(OWNER, key, geo.unit_bytes, plan, local.cache_id, 10.0)
    np.testing.assert_array_equal(src.reshape(tensors, count, block), got[:, back])


def test_a_frame_and_its_raw_bytes_in_one_segment_land_in_the_spans() -> None:
    """The fake owner answers each READ with its READ_DATA frame and every raw byte in one
    send: the core takes the frame, puts exactly its bytes into the destination's spans (two
    tensors, each a slot in the middle of a bigger cache), and the link goes on serving the
    next pull on the same stream."""
    with EchoOwner(FAKE, boot_id=OTHER_HOST, fill=0xA5) as fake:
        puller = NativeEngine(EngineConfig(cluster_id=PULLER, role=2, transport="tcp"))
        try:
            puller.link(FAKE, *fake.address, 5.0)
            geo = Geometry(2, 4 * 1000, 4)  # 4 slots of 1000 bytes per tensor
            dst = np.zeros((2, 4 * 1000), np.uint8)
            local = puller.register(geo, [int(dst[t].ctypes.data) for t in range(2)],
                                    placement=0)
            for slot in (2, 1):
                plan = plan_slot(local.geometry, slot, every_tensor(2))
                puller.pull(FAKE, p.KeyRef(p.KeyKind.CACHE_ID, 1, 0), 0, plan,
                            local.cache_id, 5.0)
            assert (dst[:, 1000:3000] == 0xA5).all()
            assert not dst[:, :1000].any() and not dst[:, 3000:].any()
            assert len(fake.reads) == 2
        finally:
            puller.close()


def test_a_silent_owner_ends_in_timeout_and_the_link_is_not_left_stuck() -> None:
    """A READ the owner never answers ends at its deadline (Timeout), and the next transfer
    on that link is not left waiting behind it past its own deadline."""
    with SilentOwner(FAKE) as fake:
        puller = NativeEngine(EngineConfig(cluster_id=PULLER, role=2, transport="tcp"))
        try:
            puller.link(FAKE, *fake.address, 5.0)
            geo = Geometry(1, 4096, 1)
            dst = np.zeros(4096, np.uint8)
            local = puller.register(geo, [dst.ctypes.data], placement=0)
            plan = plan_slot(local.geometry, 0, every_tensor(1))
            key = p.KeyRef(p.KeyKind.CACHE_ID, 1, 0)
            for _ in range(2):
                with pytest.raises((Timeout, Busy)):
                    puller.pull(FAKE, key, 0, plan, local.cache_id, 0.3)
            assert not dst.any()
        finally:
            puller.close()


def test_local_copy_moves_each_span_and_refuses_unequal_lists() -> None:
    src = np.arange(64, dtype=np.uint8)
    dst = np.zeros(64, dtype=np.uint8)
    iovmod.local_copy(spans(dst, [(40, 8), (0, 16)]), spans(src, [(0, 8), (20, 16)]))
    assert np.array_equal(dst[40:48], src[0:8]) and np.array_equal(dst[0:16], src[20:36])
    assert not dst[16:40].any() and not dst[48:].any()
    with pytest.raises(ValueError):
        iovmod.local_copy(spans(dst, [(0, 8)]), spans(src, [(0, 4), (4, 4)]))
    iovmod.local_copy(spans(dst, [])[:0], spans(src, [])[:0])  # nothing to do
