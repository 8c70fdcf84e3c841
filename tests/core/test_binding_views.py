"""The binding reads the caller's block lists in place (cpp/python/module.cc ``BlockIds``):
``prepare_pull``, ``prepare_push`` and ``prepare_layer_pushes`` take a view of a C-contiguous,
aligned, native-order numpy array of 64-bit integers (uint64, or int64 as users' arrays
usually are) and convert anything else once (a list, another dtype, a strided view). Every
form plans the same spans and is refused with the same text.

Whether a list was converted is read from tracemalloc: numpy reports the arrays it allocates
there, so a conversion of 100k block ids shows as an 800 KB peak, and a view as none.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from datadist.core.config import HOST, EngineConfig
from datadist.core.errors import InvalidArgument
from datadist.core.keys import KeyKind, KeyRef
from datadist.core.layout import Geometry
from datadist.core.native import LAYER_BLOCKS, PULL_BLOCKS, PULL_SLOT_TO_BLOCKS, NativeEngine

N = 100_000
KEY = KeyRef(KeyKind.BLOCKS_KEY, 0, 1, 0)


@pytest.fixture(scope="module")
def engine() -> Iterator[tuple[NativeEngine, int]]:
    e = NativeEngine(EngineConfig(cluster_id=8, role=2))
    arrays = [np.zeros(N * 64, np.uint8) for _ in range(2)]
    entry = e.register(Geometry(2, N * 64, N, True), [int(a.ctypes.data) for a in arrays],
                       placement=HOST)
    try:
        yield e, entry.cache_id
    finally:
        e.close()
        del arrays


def _peak(fn: Callable[[], Any]) -> int:
    """The bytes Python and numpy allocated at most while ``fn`` ran, above what was live."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        fn()
        return tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()


def _forms(values: np.ndarray) -> dict[str, Any]:
    """The same block ids as each form a caller may pass."""
    wide = np.empty(2 * len(values), np.int64)
    wide[::2] = values
    return {
        "uint64": values.astype(np.uint64),
        "int64": values.astype(np.int64),
        "list": values.tolist(),
        "int32": values.astype(np.int32),
        "strided int64": wide[::2],
        "big-endian": values.astype(">u8"),
    }


def test_64_bit_arrays_are_read_in_place_and_other_forms_converted_once(engine):
    """A 100k-block pull from int64 or uint64 arrays allocates nothing in Python or numpy
    (main's binding converted int64 arrays to uint64: 1.6 MB); a list, an int32 array, a
    strided or big-endian one are converted, each list once."""
    e, cache = engine
    rng = np.random.default_rng(3)
    src, dst = rng.permutation(N), rng.permutation(N)
    blocks_bytes = N * 8
    for name in ("uint64", "int64", "list", "int32", "strided int64", "big-endian"):
        s, d = _forms(src)[name], _forms(dst)[name]

        def pull(s: Any = s, d: Any = d) -> None:
            e.prepare_pull(1, KEY, cache, PULL_BLOCKS, src_blocks=s, dst_blocks=d)

        pull()  # warm: anything allocated once per process is not this call's
        peak = _peak(pull)
        if name in ("uint64", "int64"):
            assert peak < blocks_bytes // 8, (name, peak)
        else:
            assert 2 * blocks_bytes <= peak < 4 * blocks_bytes, (name, peak)


def test_every_form_plans_the_same_spans(engine):
    e, cache = engine
    src, dst = np.array([7, 8, 9, 2, 40]), np.array([0, 1, 2, 9, 3])
    want = None
    for name, s in _forms(src).items():
        d = _forms(dst)[name]
        call = e.prepare_pull(1, KEY, cache, PULL_BLOCKS, src_blocks=s, dst_blocks=d)
        got = (call.local_iov.tolist(), int(call.spans), int(call.bytes))
        assert want is None or got == want, name
        want = got
        # a slot split into blocks reads the destination list the same way: chunks 0-2 into
        # blocks 0-2 one run, chunk 3 into block 9 and chunk 4 into block 3 their own
        split = e.prepare_pull(1, KeyRef(KeyKind.CACHE_ID, 3, 0, 0), cache,
                               PULL_SLOT_TO_BLOCKS, dst_blocks=d)
        assert [n for _, n in split.local_iov.tolist()] == [192, 64, 64] * 2, name
    assert want is not None and want[1:] == (6, 2 * (192 + 64 + 64))  # 3 runs x 2 tensors


@pytest.mark.parametrize("name", ["uint64", "int64", "list", "int32", "strided int64"])
def test_refusals_read_the_same_from_every_form(engine, name):
    e, cache = engine
    forms = lambda v: _forms(np.array(v))[name]  # noqa: E731
    cases = [
        (forms([1]), forms([1, 2]), "src_blocks has 1 entries but dst_blocks has 2"),
        (forms([0]), forms([N]), f"dst block {N} out of range: the cache has {N} blocks"),
    ]
    if name != "int32":  # past 2**58 blocks of 64 bytes: no int32 holds it
        cases.append((forms([2**62]), forms([0]),
                      "src block 4611686018427387904 is out of range: its offset (64 bytes a "
                      "block) overflows 64 bits"))
    for s, d, why in cases:
        with pytest.raises(InvalidArgument) as err:
            e.prepare_pull(1, KEY, cache, PULL_BLOCKS, src_blocks=s, dst_blocks=d)
        assert str(err.value) == why, (name, str(err.value))
    with pytest.raises(InvalidArgument, match="src block 18446744073709551615 is out of range"):
        e.prepare_pull(1, KEY, cache, PULL_BLOCKS, src_blocks=np.array([-1], np.int64),
                       dst_blocks=np.array([0], np.int64))  # as numpy's cast to uint64 reads it
    with pytest.raises(InvalidArgument, match="dst block .* out of range"):
        e.prepare_push(1, KEY, cache, blocks=True, remote_first=0, local_first=0, count=2,
                       src_blocks=forms([N + 5]), dst_blocks=forms([0]))
    if name == "list":  # NativeEngine.prepare_layer_pushes takes arrays (its memo's key)
        return
    with pytest.raises(InvalidArgument, match=f"src block {N} out of range"):
        e.prepare_layer_pushes(1, KEY, 64, cache, kind=LAYER_BLOCKS, src_blocks=forms([N]),
                               dst_blocks=forms([0]), src_first=0, dst_first=0, layers=1,
                               tensors_per_layer=2)


def test_pushes_and_layer_pushes_read_views_too(engine):
    """prepare_push and prepare_layer_pushes plan the same from an int64 view as from the
    uint64 arrays main's binding took, and allocate nothing for either."""
    e, cache = engine
    rng = np.random.default_rng(5)
    src, dst = rng.permutation(N), rng.permutation(N)
    for s, d in ((src.astype(np.uint64), dst.astype(np.uint64)),
                 (src.astype(np.int64), dst.astype(np.int64))):

        def push(s: Any = s, d: Any = d) -> Any:
            return e.prepare_push(1, KEY, cache, blocks=True, remote_first=0, local_first=0,
                                  count=2, src_blocks=s, dst_blocks=d)

        def layers(s: Any = s, d: Any = d) -> Any:
            return e.prepare_layer_pushes(1, KEY, 64, cache, kind=LAYER_BLOCKS, src_blocks=s,
                                          dst_blocks=d, src_first=0, dst_first=0, layers=1,
                                          tensors_per_layer=2)

        assert int(push().spans) == 2 * N
        assert [int(c.spans) for c in layers()] == [2 * N]
        assert _peak(push) < N
        assert _peak(layers) < N
