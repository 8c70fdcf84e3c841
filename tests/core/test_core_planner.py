"""The core plans the Python face's pulls (Session::PreparePull, cpp/src/plan.h PlanPull):
what ``NativeEngine.prepare_pull`` makes of a request, read back from the prepared call (the
request's tensors, offsets, lengths, flags and unit bytes; the local spans), against a
plain-Python model of llm_datadist's rules; and its refusals, with the Python API's texts.

No link is needed: a pull is planned and checked against the local cache only (the owner
checks its side when it runs). The GoogleTests (cpp/tests/plan_test.cc) test the planner's
functions; these test what reaches the wire through the binding.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from datadist.core.config import HOST, EngineConfig
from datadist.core.errors import CacheNotFound, InvalidArgument
from datadist.core.keys import KeyKind, KeyRef, ReadFlags
from datadist.core.layout import Geometry
from datadist.core.native import PULL_BLOCKS, PULL_SLOT, PULL_SLOT_TO_BLOCKS
from datadist.core.native import NativeEngine as Engine

OWNER = 7
KEY = KeyRef(KeyKind.CACHE_ID, 3, 1, 0)


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    e = Engine(EngineConfig(cluster_id=8, role=2))
    try:
        yield e
    finally:
        e.close()


class Local:
    """A registered local cache of ``tensors`` tensors of ``units`` units of ``unit`` bytes."""

    def __init__(self, engine: Engine, tensors: int, units: int, unit: int,
                 blocks: bool) -> None:
        self.arrays = [np.zeros(units * unit, np.uint8) for _ in range(tensors)]
        self.bases = [int(a.ctypes.data) for a in self.arrays]
        self.entry = engine.register(Geometry(tensors, units * unit, units, blocks),
                                     self.bases, placement=HOST)
        self.engine = engine

    def pull(self, kind: int, **kw: object):  # noqa: ANN201 - the stub's Call
        return self.engine.prepare_pull(OWNER, KEY, self.entry.cache_id, kind, **kw)

    def spans(self, call) -> list[tuple[int, int, int, int]]:  # noqa: ANN001
        """(local tensor, offset in it, length) of each local span, in the request's order."""
        out = []
        for addr, length in call.local_iov.tolist():
            t = max((b, i) for i, b in enumerate(self.bases) if b <= addr)[1]  # nearest below
            out.append((t, addr - self.bases[t], length))
        return out

    def close(self) -> None:
        self.engine.unregister(self.entry.cache_id)


@pytest.fixture
def blocks(engine: Engine) -> Iterator[Local]:
    local = Local(engine, 4, 8, 16, True)  # 2 layers of 2 tensors, 8 blocks of 16 bytes
    yield local
    local.close()


@pytest.fixture
def slots(engine: Engine) -> Iterator[Local]:
    local = Local(engine, 4, 3, 64, False)
    yield local
    local.close()


def reference_block_spans(src: list[int], dst: list[int], bb: int) -> list[tuple[int, int, int]]:
    """Block i -> block i, merged while both sides stay adjacent: a plain loop."""
    out: list[list[int]] = []
    for s, d in zip(src, dst, strict=True):
        if out and out[-1][0] + out[-1][2] == s * bb and out[-1][1] + out[-1][2] == d * bb:
            out[-1][2] += bb
        else:
            out.append([s * bb, d * bb, bb])
    return [(a, b, c) for a, b, c in out]


def test_whole_slot_pull(slots: Local) -> None:
    call = slots.pull(PULL_SLOT, batch_index=2)
    assert call.remote_tensors.tolist() == [0, 1, 2, 3]
    assert call.remote_offsets.tolist() == [0]
    assert call.lengths.tolist() == [64]
    assert call.flags & int(ReadFlags.WHOLE)  # no layer range: the owner wants as many tensors
    assert call.unit_bytes == 0
    assert slots.spans(call) == [(t, 128, 64) for t in range(4)]
    assert call.bytes == 256


def test_slot_with_offsets_size_and_layers(slots: Local) -> None:
    call = slots.pull(PULL_SLOT, batch_index=1, size=8, src_offset=5, dst_offset=40,
                      src_layers=(3, 4), dst_layers=(1, 2), tensor_num_per_layer=2)
    assert call.remote_tensors.tolist() == [6, 7]
    assert call.remote_offsets.tolist() == [5]
    assert not call.flags & int(ReadFlags.WHOLE)
    assert slots.spans(call) == [(2, 104, 8), (3, 104, 8)]


def test_blocks_pull_states_the_block_size(blocks: Local) -> None:
    call = blocks.pull(PULL_BLOCKS, src_blocks=np.array([4, 5, 9], np.uint64),
                       dst_blocks=np.array([0, 1, 7], np.uint64), dst_layers=(1, 2))
    assert call.unit_bytes == 16
    assert call.remote_tensors.tolist() == [0, 1]
    assert call.remote_offsets.tolist() == [64, 144]
    assert call.lengths.tolist() == [32, 16]
    assert blocks.spans(call) == [(2, 0, 32), (2, 112, 16), (3, 0, 32), (3, 112, 16)]


@settings(max_examples=40, deadline=None)
@given(pairs=st.lists(st.tuples(st.integers(0, 50), st.integers(0, 7)), min_size=1, max_size=8))
def test_block_spans_match_a_loop(engine: Engine, pairs: list[tuple[int, int]]) -> None:
    local = Local(engine, 1, 8, 16, True)
    try:
        src, dst = [p[0] for p in pairs], [p[1] for p in pairs]
        call = local.pull(PULL_BLOCKS, src_blocks=np.array(src, np.uint64),
                          dst_blocks=np.array(dst, np.uint64))
        got = list(zip(call.remote_offsets.tolist(), [s[1] for s in local.spans(call)],
                       call.lengths.tolist(), strict=True))
        assert got == reference_block_spans(src, dst, 16)
    finally:
        local.close()


@settings(max_examples=30, deadline=None)
@given(dst=st.lists(st.integers(0, 7), min_size=1, max_size=8, unique=True))
def test_slot_into_blocks_matches_a_loop(engine: Engine, dst: list[int]) -> None:
    local = Local(engine, 1, 8, 16, True)
    try:
        call = local.pull(PULL_SLOT_TO_BLOCKS, dst_blocks=np.array(dst, np.uint64))
        got = list(zip(call.remote_offsets.tolist(), [s[1] for s in local.spans(call)],
                       call.lengths.tolist(), strict=True))
        assert got == reference_block_spans(list(range(len(dst))), dst, 16)
        assert call.unit_bytes == 0  # a slot read: the owner's slot, split here
    finally:
        local.close()


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 3), layers=st.integers(1, 4), data=st.data())
def test_layer_pairs_match_llm_datadist(engine: Engine, n: int, layers: int, data) -> None:  # noqa: ANN001
    """llm_datadist's layer_range_to_tensor_indices: a missing range is the other's width
    from layer 0 (dst) or covers the destination (src)."""
    local = Local(engine, layers * n, 2, 8, False)
    try:
        d0 = data.draw(st.integers(0, layers - 1))
        d1 = data.draw(st.integers(d0 + 1, layers))
        s0 = data.draw(st.integers(0, 10))
        which = data.draw(st.sampled_from(["both", "dst"]))
        src = (s0, s0 + d1 - d0) if which == "both" else None
        call = local.pull(PULL_SLOT, src_layers=src, dst_layers=(d0, d1),
                          tensor_num_per_layer=n)
        first = s0 if src else 0
        assert call.remote_tensors.tolist() == list(range(first * n, (first + d1 - d0) * n))
        assert sorted({s[0] for s in local.spans(call)}) == list(range(d0 * n, d1 * n))
    finally:
        local.close()


@pytest.mark.parametrize(("kw", "text"), [
    ({"batch_index": 3}, "batch_index 3 out of range [0, 3)"),
    ({"size": 65}, "size 65 does not fit the destination slot of 64 bytes after offset 0"),
    ({"dst_offset": 64}, "dst offset 64 out of range [0, 64)"),
    ({"src_layers": (0, 1)}, "src_layer_range (0, 1) covers 2 tensors but the destination has 4"),
    ({"dst_layers": (1, 3)}, "dst_layer_range (1, 3) exceeds the destination's 2 layers"),
    ({"src_layers": (0, 1), "dst_layers": (0, 2)},
     "src_layer_range (0, 1) and dst_layer_range (0, 2) differ in length"),
    ({"dst_layers": (0, 1), "tensor_num_per_layer": 3},
     "destination num_tensors 4 is not a multiple of tensor_num_per_layer 3"),
])
def test_slot_refusals(slots: Local, kw: dict[str, object], text: str) -> None:
    with pytest.raises(InvalidArgument) as got:
        slots.pull(PULL_SLOT, **kw)
    assert str(got.value) == text


@pytest.mark.parametrize(("src", "dst", "text"), [
    ([], [], "dst_blocks must not be empty"),
    ([1], [1, 2], "src_blocks has 1 entries but dst_blocks has 2"),
    ([1, 2], [9, 3], "dst block 9 out of range: the cache has 8 blocks"),
    ([2**60], [0], f"src block {2**60} is out of range: its offset (16 bytes a block) "
                   "overflows 64 bits"),
])
def test_block_refusals(blocks: Local, src: list[int], dst: list[int], text: str) -> None:
    with pytest.raises(InvalidArgument) as got:
        blocks.pull(PULL_BLOCKS, src_blocks=np.array(src, np.uint64),
                    dst_blocks=np.array(dst, np.uint64))
    assert str(got.value) == text


def test_unknown_cache_is_cache_not_found(engine: Engine) -> None:
    with pytest.raises(CacheNotFound, match="does not exist"):
        engine.prepare_pull(OWNER, KEY, 10**9, PULL_SLOT)


def test_a_layer_range_past_64_bits_is_a_refusal_not_a_type_error(slots: Local) -> None:
    """The legacy API checks only 0 <= start < stop: a stop past 2**64 reaches the core as a
    range past every tensor index (InvalidArgument), as the Python planner refused it."""
    with pytest.raises(InvalidArgument, match="covers more than 2\\*\\*64 tensors"):
        slots.pull(PULL_SLOT, src_layers=(0, 2**70))
    with pytest.raises(InvalidArgument, match="exceeds the destination's 2 layers"):
        slots.pull(PULL_SLOT, src_layers=(2**65, 2**65 + 1), dst_layers=(0, 2**66))


def test_a_push_is_planned_by_the_core_too(blocks: Local, slots: Local) -> None:
    """push_blocks / push_cache: the face's tensor pairs, the core's spans (the destination's
    blocks are the remote side), the local block size stated; a slot push states none."""
    call = blocks.engine.prepare_push(OWNER, KEY, blocks.entry.cache_id, blocks=True,
                                      remote_first=0, local_first=2, count=2,
                                      src_blocks=np.array([1, 2, 7], np.uint64),
                                      dst_blocks=np.array([4, 5, 0], np.uint64))
    assert call.write
    assert call.unit_bytes == 16
    assert call.remote_tensors.tolist() == [0, 1]
    assert call.remote_offsets.tolist() == [64, 0]
    assert blocks.spans(call) == [(2, 16, 32), (2, 112, 16), (3, 16, 32), (3, 112, 16)]
    call = slots.engine.prepare_push(OWNER, KEY, slots.entry.cache_id, blocks=False,
                                     remote_first=0, local_first=0, count=4, batch_index=2)
    assert call.unit_bytes == 0 and not call.flags
    assert slots.spans(call) == [(t, 128, 64) for t in range(4)]
    with pytest.raises(InvalidArgument, match="batch_index 3 out of range"):
        slots.engine.prepare_push(OWNER, KEY, slots.entry.cache_id, blocks=False,
                                  remote_first=0, local_first=0, count=4, batch_index=3)
