"""Unit and property tests of core.layout (pushes and local copies): geometry, plans, owner
bounds checks. A pull's layer ranges and spans are the core's (tests/core/test_core_planner.py,
cpp/tests/plan_test.cc).

The expected spans are written out by hand or computed with plain Python loops, never with
the vectorised code under test.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from datadist.core.errors import Code, InvalidArgument
from datadist.core.layout import (
    Geometry,
    Plan,
    check_source_spans,
    every_tensor,
    plan_blocks,
    plan_slot,
    span_iov,
)

U64_MAX = 2**64 - 1


def all_tensors(n: int) -> tuple[np.ndarray, np.ndarray]:
    return every_tensor(n)


def spans(plan: Plan) -> list[tuple[int, int, int]]:
    return list(
        zip(plan.remote_offsets.tolist(), plan.local_offsets.tolist(), plan.lengths.tolist(),
            strict=True)
    )


# ------------------------------------------------------------------------------ Geometry


class TestGeometry:
    def test_unit_bytes_is_tensor_bytes_over_dim0(self) -> None:
        g = Geometry(num_tensors=4, tensor_bytes=4 * 16 * 2, units=4)
        assert g.unit_bytes == 32
        assert not g.is_blocks

    @pytest.mark.parametrize("num_tensors", [0, -1])
    def test_num_tensors_must_be_positive(self, num_tensors: int) -> None:
        with pytest.raises(InvalidArgument, match="num_tensors"):
            Geometry(num_tensors, 64, 4)

    @pytest.mark.parametrize("units", [0, -2])
    def test_units_must_be_positive(self, units: int) -> None:
        with pytest.raises(InvalidArgument, match="shape\\[0\\]"):
            Geometry(1, 64, units)

    @pytest.mark.parametrize("tensor_bytes", [0, -8, 63])
    def test_tensor_bytes_must_split_into_units(self, tensor_bytes: int) -> None:
        with pytest.raises(InvalidArgument, match="does not split"):
            Geometry(1, tensor_bytes, 4)

    def test_error_is_param_invalid_and_a_value_error(self) -> None:
        with pytest.raises(ValueError) as info:
            Geometry(1, 10, 3)
        assert info.value.code == Code.PARAM_INVALID

    def test_frozen(self) -> None:
        g = Geometry(1, 8, 2)
        with pytest.raises(AttributeError):
            g.units = 4  # type: ignore[misc]


# ------------------------------------------------------------------------------ plan_slot


class TestPlanSlot:
    g = Geometry(num_tensors=2, tensor_bytes=4 * 64, units=4)  # stride 64

    def test_whole_slot(self) -> None:
        plan = plan_slot(self.g, 2, all_tensors(2))
        assert spans(plan) == [(0, 128, 64)]
        assert plan.nbytes == 128
        assert plan.num_spans == 2
        assert plan.remote_tensors.tolist() == plan.local_tensors.tolist() == [0, 1]

    def test_size_minus_one_is_the_rest_of_the_slot_after_dst_offset(self) -> None:
        plan = plan_slot(self.g, 1, all_tensors(2), size=-1, src_offset=5, dst_offset=16)
        assert spans(plan) == [(5, 64 + 16, 48)]

    def test_explicit_size_and_offsets(self) -> None:
        plan = plan_slot(self.g, 3, all_tensors(2), size=8, src_offset=100, dst_offset=56)
        assert spans(plan) == [(100, 3 * 64 + 56, 8)]

    @pytest.mark.parametrize("unit", [-1, 4, 100])
    def test_batch_index_out_of_range(self, unit: int) -> None:
        with pytest.raises(InvalidArgument, match="batch_index"):
            plan_slot(self.g, unit, all_tensors(2))

    @pytest.mark.parametrize("dst_offset", [-1, 64])
    def test_dst_offset_out_of_range(self, dst_offset: int) -> None:
        with pytest.raises(InvalidArgument, match="dst offset"):
            plan_slot(self.g, 0, all_tensors(2), dst_offset=dst_offset)

    def test_negative_src_offset(self) -> None:
        with pytest.raises(InvalidArgument, match="src offset"):
            plan_slot(self.g, 0, all_tensors(2), src_offset=-1)

    def test_src_offset_beyond_uint64_is_param_invalid(self) -> None:
        with pytest.raises(InvalidArgument, match="src offset"):
            plan_slot(self.g, 0, all_tensors(2), size=8, src_offset=U64_MAX - 3)

    @pytest.mark.parametrize(("size", "dst_offset"), [(0, 0), (-2, 0), (65, 0), (60, 8)])
    def test_size_must_fit_after_dst_offset(self, size: int, dst_offset: int) -> None:
        with pytest.raises(InvalidArgument, match="size"):
            plan_slot(self.g, 0, all_tensors(2), size=size, dst_offset=dst_offset)

    def test_arrays_are_read_only(self) -> None:
        plan = plan_slot(self.g, 0, all_tensors(2))
        for arr in (plan.remote_offsets, plan.local_offsets, plan.lengths, plan.local_tensors):
            with pytest.raises(ValueError):
                arr[0] = 1

    def test_layer_range_tensors_are_carried(self) -> None:
        g = Geometry(num_tensors=4, tensor_bytes=64, units=2)
        plan = plan_slot(g, 0, (np.array([4, 5], np.uint32), np.array([2, 3], np.uint32)))
        assert plan.remote_tensors.tolist() == [4, 5]
        assert plan.local_tensors.tolist() == [2, 3]
        assert plan.nbytes == 2 * 32


# ------------------------------------------------------------------------------ plan_blocks


def reference_block_spans(
    src: list[int], dst: list[int], bb: int
) -> list[tuple[int, int, int]]:
    """Loop-based coalescing: extend the current run while both sides stay adjacent."""
    out: list[list[int]] = []
    for s, d in zip(src, dst, strict=True):
        if out and out[-1][0] + out[-1][2] == s * bb and out[-1][1] + out[-1][2] == d * bb:
            out[-1][2] += bb
        else:
            out.append([s * bb, d * bb, bb])
    return [tuple(x) for x in out]  # type: ignore[misc]


class TestPlanBlocks:
    g = Geometry(num_tensors=2, tensor_bytes=16 * 32, units=16, is_blocks=True)  # 32 B blocks

    def test_runs_adjacent_on_both_sides_coalesce(self) -> None:
        plan = plan_blocks(self.g, [4, 5, 6, 9], [0, 1, 2, 3], all_tensors(2))
        assert spans(plan) == [(4 * 32, 0, 96), (9 * 32, 96, 32)]
        assert plan.nbytes == 2 * 128

    def test_adjacent_on_one_side_only_does_not_coalesce(self) -> None:
        # source adjacent, destination not
        plan = plan_blocks(self.g, [1, 2], [0, 5], all_tensors(2))
        assert spans(plan) == [(32, 0, 32), (64, 160, 32)]
        # destination adjacent, source not
        plan = plan_blocks(self.g, [7, 3], [2, 3], all_tensors(2))
        assert spans(plan) == [(224, 64, 32), (96, 96, 32)]

    def test_descending_runs_do_not_coalesce(self) -> None:
        plan = plan_blocks(self.g, [3, 2], [3, 2], all_tensors(2))
        assert len(plan.lengths) == 2

    def test_duplicate_source_blocks_are_allowed(self) -> None:
        plan = plan_blocks(self.g, [5, 5, 5], [0, 1, 2], all_tensors(2))
        assert spans(plan) == [(160, 0, 32), (160, 32, 32), (160, 64, 32)]

    def test_single_block(self) -> None:
        plan = plan_blocks(self.g, [15], [15], all_tensors(2))
        assert spans(plan) == [(480, 480, 32)]

    def test_numpy_block_lists(self) -> None:
        plan = plan_blocks(
            self.g, np.array([0, 1], dtype=np.int64), np.array([2, 3], np.uint32), all_tensors(2)
        )
        assert spans(plan) == [(0, 64, 64)]

    def test_errors(self) -> None:
        t = all_tensors(2)
        with pytest.raises(InvalidArgument, match="must not be empty"):
            plan_blocks(self.g, [], [], t)
        with pytest.raises(InvalidArgument, match="entries"):
            plan_blocks(self.g, [1, 2], [1], t)
        with pytest.raises(InvalidArgument, match="out of range"):
            plan_blocks(self.g, [0], [16], t)
        with pytest.raises(InvalidArgument, match="negative"):
            plan_blocks(self.g, [-1], [0], t)
        with pytest.raises(InvalidArgument, match="negative"):
            plan_blocks(self.g, [0], [-3], t)
        with pytest.raises(InvalidArgument, match="ints"):
            plan_blocks(self.g, [0.5], [0], t)
        with pytest.raises(InvalidArgument, match="ints"):
            plan_blocks(self.g, [True], [0], t)
        with pytest.raises(InvalidArgument, match="flat"):
            plan_blocks(self.g, [[0, 1]], [[0, 1]], t)
        with pytest.raises(InvalidArgument):
            plan_blocks(self.g, [2**70], [0], t)  # not even a uint64

    def test_source_block_whose_offset_overflows_uint64_is_refused(self) -> None:
        # 2**59 blocks of 32 bytes is 2**64: wrapping to offset 0 would read block 0.
        with pytest.raises(InvalidArgument, match="src block"):
            plan_blocks(self.g, [2**59], [0], all_tensors(2))
        with pytest.raises(InvalidArgument, match="src block"):
            plan_blocks(self.g, np.array([2**63 + 1], np.uint64), [0], all_tensors(2))
        # Large but representable indices go through: the owner refuses them by its size.
        plan = plan_blocks(self.g, [2**58 - 1], [0], all_tensors(2))
        assert spans(plan) == [((2**58 - 1) * 32, 0, 32)]

    @settings(max_examples=200)
    @given(
        pairs=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 15)), min_size=1,
                       max_size=16),
    )
    def test_property_coalescing_matches_a_loop(self, pairs: list[tuple[int, int]]) -> None:
        src = [s for s, _ in pairs]
        dst = [d for _, d in pairs]
        plan = plan_blocks(self.g, src, dst, all_tensors(2))
        assert spans(plan) == reference_block_spans(src, dst, 32)
        assert plan.nbytes == 2 * 32 * len(pairs)
        # no two neighbouring spans could still merge
        got = spans(plan)
        for (s0, d0, n0), (s1, d1, _) in zip(got, got[1:], strict=False):
            assert not (s0 + n0 == s1 and d0 + n0 == d1)


# ------------------------------------------------------------------------------ iov


def test_local_iov_is_tensor_major() -> None:
    g = Geometry(num_tensors=3, tensor_bytes=4 * 8, units=4, is_blocks=True)
    plan = plan_blocks(g, [0, 2], [1, 3], every_tensor(3))
    addrs = np.array([1000, 2000, 3000], dtype=np.uint64)
    bases, lens = plan.local_iov(addrs)
    assert bases.tolist() == [1008, 1024, 2008, 2024, 3008, 3024]
    assert lens.tolist() == [8] * 6


def test_span_iov_broadcasts() -> None:
    bases, lens = span_iov(
        np.array([10, 20], np.uint64), np.array([0, 5], np.uint64), np.array([1, 2], np.uint64)
    )
    assert bases.tolist() == [10, 15, 20, 25]
    assert lens.tolist() == [1, 2, 1, 2]


# ------------------------------------------------------------------------------ owner bounds


def u64(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.uint64)


class TestCheckSourceSpans:
    def test_inside_and_up_to_the_end(self) -> None:
        check_source_spans(u64(0, 10, 90), u64(100, 5, 10), 100)

    def test_empty(self) -> None:
        check_source_spans(u64(), u64(), 0)

    @pytest.mark.parametrize("good", [0, 1, 30])  # Python ints, then numpy
    def test_zero_length_spans_are_refused_anywhere(self, good: int) -> None:
        """Issue 21 item 2: a 0-byte span moves nothing and only asks whether an address is
        registered; it used to pass inside (and at the end of) every tensor."""
        for offset in (0, 50, 100, 101):
            with pytest.raises(InvalidArgument, match="empty"):
                check_source_spans(u64(*[0] * good, offset), u64(*[4] * good, 0), 100)

    @pytest.mark.parametrize(
        ("offset", "length"),
        [(91, 10), (0, 101), (100, 1), (U64_MAX, 1), (U64_MAX - 7, 16), (8, U64_MAX),
         (2**63, 2**63), (U64_MAX, U64_MAX)],
    )
    @pytest.mark.parametrize("good", [1, 30])  # a few spans are checked in Python, more in numpy
    def test_outside_including_uint64_wraparound(self, offset: int, length: int,
                                                 good: int) -> None:
        # (U64_MAX - 7) + 16 wraps to 8: a naive end check would pass it.
        with pytest.raises(InvalidArgument, match="outside") as info:
            check_source_spans(u64(*[0] * good, offset), u64(*[4] * good, length), 100)
        assert f"[{offset}, +{length})" in str(info.value)  # names the culprit, not span 0

    def test_shape_mismatch(self) -> None:
        with pytest.raises(InvalidArgument, match="differ"):
            check_source_spans(u64(0, 1), u64(1), 100)

    @settings(max_examples=300)
    @given(
        spans_=st.lists(
            st.tuples(st.integers(0, U64_MAX), st.integers(0, U64_MAX)), min_size=1,
            max_size=40,  # both sides of layout.FEW: Python ints, then numpy
        ),
        limit=st.integers(0, 2**40),
    )
    def test_property_agrees_with_python_ints(
        self, spans_: list[tuple[int, int]], limit: int
    ) -> None:
        offsets = u64(*(o for o, _ in spans_))
        lengths = u64(*(n for _, n in spans_))
        inside = all(n >= 1 and o + n <= limit for o, n in spans_)
        if inside:
            check_source_spans(offsets, lengths, limit)
        else:
            with pytest.raises(InvalidArgument):
                check_source_spans(offsets, lengths, limit)


# ------------------------------------------------------------------------------ layout tags


class TestLayoutTags:
    def test_tag_holds_the_dtype_and_the_unit_shape(self) -> None:
        from datadist.core.layout import layout_tag

        a = layout_tag(1, (16, 128))
        assert a >> 32 == 2  # dtype code plus one: 0 stays "unknown"
        assert a != layout_tag(1, (128, 16))
        assert a != layout_tag(0, (16, 128))
        assert a == layout_tag(1, [16, 128])
        assert layout_tag(0, ()) != 0
