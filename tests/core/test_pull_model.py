"""Property: a pull moves exactly the bytes a plain-numpy model of the same request moves.

Two engines (the C++ core, core/native.py) live in this process: an owner (cluster 1,
listening on 127.0.0.1:0) and a puller (cluster 2) linked to it, once with the TCP data path
forced and once with cross-memory attach. For random geometries, dtypes, batch indexes,
offsets, block lists and layer ranges we ask the core for the pull exactly as
api/cache_manager.py does (``NativeEngine.prepare_pull``: the core plans it), run it, and
compare every destination byte with the model's.

The model (``expected``) is written from the spec (reference §9 and DESIGN §5) with Python
lists and numpy slices; it shares no code with the core's planner or the registry. It also predicts
which requests must be refused (PARAM_INVALID), and then no destination byte may change.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from datadist.core import layout
from datadist.core.config import HOST, EngineConfig
from datadist.core.errors import InvalidArgument
from datadist.core.keys import UINT64_MAX, KeyId
from datadist.core.native import PULL_BLOCKS, PULL_SLOT, PULL_SLOT_TO_BLOCKS
from datadist.core.native import NativeEngine as Engine
from datadist.wire.protocol import KeyKind, KeyRef

pytestmark = pytest.mark.timeout(120)

OWNER, PULLER = 1, 2
PULL_TIMEOUT = 20.0  # generous: a loaded CI machine must not turn a slow pull into a failure
DTYPES = ["u1", "<i2", "<f2", "<f4", "<i8", "<c16"]
_req_ids = itertools.count(1000)
_model_ids = itertools.count(1)


@dataclass
class Peers:
    owner: Engine
    puller: Engine
    path: str


@pytest.fixture(scope="module", params=["tcp", "cma"])
def peers(request: pytest.FixtureRequest) -> Iterator[Peers]:
    owner = Engine(EngineConfig(cluster_id=OWNER, role=1, listen=("127.0.0.1", 0)))
    puller = Engine(EngineConfig(cluster_id=PULLER, role=2, transport=request.param))
    try:
        assert owner.listen_address is not None
        host, port = owner.listen_address
        link = puller.link(OWNER, host, port, 10.0)
        assert link.path_name == request.param
        yield Peers(owner, puller, request.param)
        # No silent fallback: every pull above really used the forced path.
        assert puller.get_link(OWNER).path_name == request.param
    finally:
        puller.close()
        owner.close()


# ------------------------------------------------------------------------------ requests


@dataclass
class Request:
    """One pull, as a user of CacheManager / KvCacheManager would ask for it."""

    kind: str  # "slot" (pull_cache), "blocks" (pull_blocks), "c2b" (contiguous -> blocks)
    dtype: str
    inner: tuple[int, ...]  # the destination's per-unit shape
    src_inner: tuple[int, ...]  # the source's (differs only to test the refusal)
    src_units: int
    dst_units: int
    src_tensors: int
    dst_tensors: int
    n: int  # tensor_num_per_layer
    src_range: tuple[int, int] | None
    dst_range: tuple[int, int] | None
    by_key: bool  # contiguous source named by CacheKey (True) or by cache id and index
    src_index: int  # source batch slot (CacheKeyByIdAndIndex), or the key's slot
    dst_index: int
    size: int
    src_offset: int
    dst_offset: int
    src_blocks: list[int]
    dst_blocks: list[int]
    seed: int


def _unit_bytes(dtype: str, inner: tuple[int, ...]) -> int:
    return int(np.dtype(dtype).itemsize * np.prod(inner, dtype=np.int64))


FAULTS = {
    "slot": ["dst_index", "src_index", "size", "src_offset", "unit_size"],
    "blocks": ["dst_block", "src_block", "unit_size"],
    "c2b": ["dst_block", "src_index", "c2b_past_the_end", "unit_size"],
}
RANGE_FAULTS = ["src_tensors", "dst_range", "widths", "multiple"]


@st.composite
def requests(draw: st.DrawFn) -> Request:
    """A valid request, or (a quarter of the time) one with a single fault injected. The
    generator only biases the mix; whether a request is valid is the model's call."""
    kind = draw(st.sampled_from(["slot", "blocks", "c2b"]))
    dtype = draw(st.sampled_from(DTYPES))
    inner = tuple(draw(st.lists(st.integers(1, 6), max_size=2)))
    stride = _unit_bytes(dtype, inner)
    faults = FAULTS[kind] + RANGE_FAULTS
    # Hypothesis favours small draws, so a plain coin would inject far too many faults.
    fault = draw(st.sampled_from([*[None] * (2 * len(faults)), *faults]))

    # layers: tensor_num_per_layer, and ranges that fit both sides
    n = draw(st.integers(1, 3))
    dst_layers = draw(st.integers(1, 3))
    mode = draw(st.sampled_from(["none", "src", "dst", "both"]))
    src_range = dst_range = None
    width = dst_layers
    if mode in ("dst", "both"):
        d0 = draw(st.integers(0, dst_layers - 1))
        d1 = draw(st.integers(d0 + 1, dst_layers))
        dst_range, width = (d0, d1), d1 - d0
    needed = width if mode != "none" else dst_layers  # source layers the request reads
    if mode in ("src", "both"):
        s0 = draw(st.integers(0, 3))
        src_range = (s0, s0 + width)
        needed = s0 + width
    src_layers = needed + draw(st.integers(0, 1))

    # units, indexes, blocks
    by_key = draw(st.booleans())
    dst_units = draw(st.integers(1, 24 if kind != "slot" else 5))
    count = draw(st.integers(1, min(dst_units, 12)))
    dst_blocks = draw(st.lists(st.integers(0, dst_units - 1), min_size=count,
                               max_size=count, unique=True))
    if kind == "slot":
        src_units = draw(st.integers(1, 5))
        src_index = draw(st.integers(0, src_units - 1))
    elif kind == "c2b":
        src_index = draw(st.integers(0, 3))
        src_units = src_index + count + draw(st.integers(0, 2))
    else:
        src_units = draw(st.integers(1, 24))
        src_index = 0
    src_blocks = draw(st.lists(st.integers(0, src_units - 1), min_size=count, max_size=count))
    if draw(st.booleans()):  # runs adjacent on both sides, so that spans coalesce
        start = draw(st.integers(0, max(0, src_units - count)))
        src_blocks = [min(b, src_units - 1) for b in range(start, start + count)]
        dst_blocks = sorted(dst_blocks)
    dst_index = draw(st.integers(0, dst_units - 1))
    size, src_offset, dst_offset = -1, 0, 0
    if kind == "slot" and draw(st.booleans()):  # KvCacheManager's offsets and size
        dst_offset = draw(st.integers(0, stride - 1))
        size = draw(st.sampled_from([-1, draw(st.integers(1, stride - dst_offset))]))
        length = stride - dst_offset if size == -1 else size
        src_offset = draw(st.integers(0, (src_units - src_index) * stride - length))

    # at most one fault
    src_inner = inner
    dst_tensors, src_tensors = dst_layers * n, src_layers * n
    if fault == "dst_index":
        dst_index = dst_units
    elif fault == "src_index" and not by_key:
        src_index = src_units
    elif fault == "size":
        size = stride - dst_offset + 1
    elif fault == "src_offset":
        src_offset = src_units * stride
    elif fault == "unit_size":
        src_inner = (*inner, 2)
    elif fault == "dst_block":
        dst_blocks[-1] = dst_units
    elif fault == "src_block":
        src_blocks[0] = src_units
    elif fault == "c2b_past_the_end":
        src_units = src_index + count - 1 if src_index + count > 1 else 1
        src_index = min(src_index, src_units - 1)
    elif fault == "src_tensors":
        src_tensors = needed * n - 1
    elif fault == "dst_range" and dst_range is not None:
        dst_range = (dst_range[0], dst_layers + 1)
    elif fault == "widths" and mode != "none":
        src_range = (src_range or (0, width))[0], (src_range or (0, width))[1] + 1
    elif fault == "multiple" and n > 1:
        dst_tensors += 1
    if src_tensors < 1:
        src_tensors = 1
    return Request(kind, dtype, inner, src_inner, src_units, dst_units, src_tensors,
                   dst_tensors, n, src_range, dst_range, by_key, src_index, dst_index, size,
                   src_offset, dst_offset, src_blocks, dst_blocks,
                   draw(st.integers(0, 2**32 - 1)))


# ------------------------------------------------------------------------------ the model


class Refused(Exception):
    """The model's verdict: this request is PARAM_INVALID."""


def tensor_pairs(r: Request) -> list[tuple[int, int]]:
    """(source tensor, destination tensor) pairs; spec §9 'Layer range -> tensor indices'."""
    if r.src_range is None and r.dst_range is None:
        # every tensor: the source must have as many (CANN's GetSendTask; ReadFlags.WHOLE)
        if r.src_tensors != r.dst_tensors:
            raise Refused("a pull without layer ranges needs the same tensor count")
        pairs = [(i, i) for i in range(r.dst_tensors)]
    else:
        if r.dst_tensors % r.n:
            raise Refused("dst num_tensors is not a multiple of tensor_num_per_layer")
        dst_layers = r.dst_tensors // r.n
        d0, d1 = r.dst_range if r.dst_range else (0, dst_layers)
        if d1 > dst_layers:
            raise Refused("dst layers out of range")
        s0, s1 = r.src_range if r.src_range else (0, d1 - d0)
        if s1 - s0 != d1 - d0:
            raise Refused("src and dst layer counts differ")
        pairs = list(zip(range(s0 * r.n, s1 * r.n), range(d0 * r.n, d1 * r.n), strict=True))
    if any(s >= r.src_tensors for s, _ in pairs):
        raise Refused("source tensor out of range")
    return pairs


def byte_moves(r: Request) -> list[tuple[int, int, int]]:
    """(source byte, destination byte, length) within one tensor, for every tensor pair."""
    stride = _unit_bytes(r.dtype, r.inner)
    src_stride = _unit_bytes(r.dtype, r.src_inner)
    src_tensor_bytes = src_stride * r.src_units
    if r.kind == "slot":
        if not 0 <= r.dst_index < r.dst_units:
            raise Refused("batch_index out of range")
        size = stride - r.dst_offset if r.size == -1 else r.size
        if not 0 < size <= stride - r.dst_offset:
            raise Refused("size does not fit")
        if r.src_index >= r.src_units:
            raise Refused("source batch index out of range")
        start = r.src_index * src_stride + r.src_offset
        if start + size > src_tensor_bytes:
            raise Refused("source span past the tensor")
        return [(start, r.dst_index * stride + r.dst_offset, size)]
    if any(d >= r.dst_units for d in r.dst_blocks):
        raise Refused("dst block out of range")
    if r.kind == "blocks":
        if src_stride != stride:
            raise Refused("block size mismatch")
        if any(s >= r.src_units for s in r.src_blocks):
            raise Refused("src block out of range")
        pairs = zip(r.src_blocks, r.dst_blocks, strict=True)
        return [(s * stride, d * stride, stride) for s, d in pairs]
    # contiguous source slot split into destination-block-sized chunks
    if r.src_index >= r.src_units:
        raise Refused("source batch index out of range")
    base = r.src_index * src_stride
    if base + len(r.dst_blocks) * stride > src_tensor_bytes:
        raise Refused("chunks run past the source tensor")
    return [(base + i * stride, d * stride, stride) for i, d in enumerate(r.dst_blocks)]


def expected(r: Request, src: list[np.ndarray], dst: list[np.ndarray]) -> tuple[
        list[np.ndarray], list[np.ndarray], int]:
    """The destination tensors' bytes after the pull, a written-bytes mask per tensor, and
    the byte count. Raises Refused for a request that must be refused."""
    pairs = tensor_pairs(r)
    moves = byte_moves(r)
    out = [d.view(np.uint8).reshape(-1).copy() for d in dst]
    mask = [np.zeros(o.size, dtype=bool) for o in out]
    for s, d in pairs:
        sb = src[s].view(np.uint8).reshape(-1)
        for so, do, length in moves:
            out[d][do : do + length] = sb[so : so + length]
            mask[d][do : do + length] = True
    return out, mask, len(pairs) * sum(length for _, _, length in moves)


# ------------------------------------------------------------------------------ the real pull


def make_tensors(rng: np.random.Generator, count: int, units: int, inner: tuple[int, ...],
                 dtype: str, low: int, high: int) -> list[np.ndarray]:
    """Separate C-contiguous arrays (one allocation each), bytes drawn from [low, high)."""
    out = []
    for _ in range(count):
        arr = np.empty((units, *inner), dtype=dtype)
        arr.view(np.uint8).reshape(-1)[:] = rng.integers(low, high, arr.nbytes, dtype=np.uint8)
        out.append(arr)
    return out


def pull_like_cache_manager(peers: Peers, r: Request, key: KeyRef, cache_id: int) -> int:
    """The core's pull as CacheManager.pull_cache / pull_blocks ask for it (the core plans
    it: NativeEngine.prepare_pull), run; returns the bytes it moved."""
    kinds = {"slot": PULL_SLOT, "blocks": PULL_BLOCKS, "c2b": PULL_SLOT_TO_BLOCKS}
    blocks = {} if r.kind == "slot" else {
        "dst_blocks": np.asarray(r.dst_blocks, dtype=np.uint64),
        "src_blocks": np.asarray(r.src_blocks if r.kind == "blocks" else [], dtype=np.uint64)}
    call = peers.puller.prepare_pull(
        OWNER, key, cache_id, kinds[r.kind], batch_index=r.dst_index, size=r.size,
        src_offset=r.src_offset, dst_offset=r.dst_offset, src_layers=r.src_range,
        dst_layers=r.dst_range, tensor_num_per_layer=r.n, **blocks)
    peers.puller.run(call, PULL_TIMEOUT)
    return int(call.bytes)


def run_pull(peers: Peers, r: Request) -> str | None:
    """Pull ``r`` for real and check it against the model; returns why the model refused
    it, or None when bytes moved."""
    rng = np.random.default_rng(r.seed)
    # Source bytes < 128, destination bytes >= 128: any byte the pull writes differs from
    # what was there, so a missed or extra byte cannot hide behind an equal value.
    src = make_tensors(rng, r.src_tensors, r.src_units, r.src_inner, r.dtype, 0, 128)
    dst = make_tensors(rng, r.dst_tensors, r.dst_units, r.inner, r.dtype, 128, 256)
    src_before = [a.copy() for a in src]
    dst_before = [a.view(np.uint8).reshape(-1).copy() for a in dst]
    try:
        want, written, nbytes = expected(r, src, dst)
        refused = None
    except Refused as e:
        refused = str(e)

    src_blocky = r.kind == "blocks"
    src_geo = layout.Geometry(r.src_tensors, src[0].nbytes, r.src_units, src_blocky)
    model_id = next(_model_ids)
    req_id = next(_req_ids)
    keys: list[KeyId | None] = []
    if r.by_key and not src_blocky:  # bind the key to the source slot, padding before it
        keys = [None] * r.src_index + [KeyId(req_id, model_id, False)]
    src_entry = peers.owner.register(
        src_geo, [a.ctypes.data for a in src], placement=HOST, keys=keys,
        blocks_model_id=model_id if src_blocky else None,
    )
    dst_geo = layout.Geometry(r.dst_tensors, dst[0].nbytes, r.dst_units, r.kind != "slot")
    dst_entry = peers.puller.register(dst_geo, [a.ctypes.data for a in dst], placement=HOST)
    if src_blocky:
        key = KeyRef(KeyKind.BLOCKS_KEY, 0, model_id, 0)
    elif r.by_key:
        key = KeyRef(KeyKind.CACHE_KEY, req_id, model_id, UINT64_MAX)
    else:
        key = KeyRef(KeyKind.CACHE_ID, src_entry.cache_id, r.src_index, 0)
    try:
        try:
            moved = pull_like_cache_manager(peers, r, key, dst_entry.cache_id)
        except InvalidArgument as e:
            assert refused is not None, f"refused a valid request: {e}"
        else:
            assert refused is None, f"accepted a request the model refuses: {refused}"
            assert moved == nbytes
    finally:
        peers.puller.unregister(dst_entry.cache_id)
        peers.owner.unregister(src_entry.cache_id)

    for a, b in zip(src, src_before, strict=True):
        assert a.tobytes() == b.tobytes(), "the source changed"
    got = [a.view(np.uint8).reshape(-1) for a in dst]
    if refused is not None:
        for i, (g, b) in enumerate(zip(got, dst_before, strict=True)):
            assert np.array_equal(g, b), f"a refused pull changed destination tensor {i}"
        return refused
    for i, (g, w, m, b) in enumerate(zip(got, want, written, dst_before, strict=True)):
        assert np.array_equal(g[~m], b[~m]), f"bytes outside the request changed in tensor {i}"
        assert np.array_equal(g, w), f"destination tensor {i} differs from the model"
    return None


@settings(max_examples=50, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(r=requests())
def test_pull_moves_what_the_model_moves(peers: Peers, r: Request) -> None:
    refused = run_pull(peers, r)
    event(f"{r.kind}: {refused or 'moved'}")  # the mix shows in --hypothesis-show-statistics


# ------------------------------------------------------------------------------ fixed cases


REFUSED_IDS = {"c2b-past-the-end", "block-size-mismatch", "too-few-source-tensors"}


def fixed(**kw) -> Request:  # type: ignore[no-untyped-def]
    base = dict(kind="blocks", dtype="<f2", inner=(4,), src_inner=(4,), src_units=8,
                dst_units=8, src_tensors=4, dst_tensors=4, n=2, src_range=None,
                dst_range=None, by_key=False, src_index=0, dst_index=0, size=-1,
                src_offset=0, dst_offset=0, src_blocks=[0], dst_blocks=[0], seed=7)
    base.update(kw)
    return Request(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "r",
    [
        fixed(kind="slot", src_units=4, dst_units=4, src_index=3, dst_index=1),
        fixed(kind="slot", by_key=True, src_index=2, dst_index=0, dst_offset=3, size=4,
              src_offset=1),
        fixed(kind="slot", src_range=(1, 2), dst_range=(0, 1)),
        fixed(src_blocks=[5, 5, 1, 2, 3], dst_blocks=[0, 7, 2, 3, 4]),
        fixed(src_blocks=[0, 1], dst_blocks=[6, 7], src_range=(1, 2), dst_range=(1, 2)),
        fixed(kind="c2b", src_index=1, dst_blocks=[7, 0, 1, 2]),
        fixed(kind="c2b", src_index=5, dst_blocks=[7, 0, 1, 2]),  # 4 chunks from slot 5 of 8
        fixed(src_inner=(5,)),  # block size mismatch: refused by the owner
        fixed(src_tensors=2, dst_tensors=4),  # the source has too few tensors
    ],
    ids=["slot", "slot-key-offsets", "slot-layers", "blocks-dups", "blocks-layers", "c2b",
         "c2b-past-the-end", "block-size-mismatch", "too-few-source-tensors"],
)
def test_fixed_requests(peers: Peers, r: Request, request: pytest.FixtureRequest) -> None:
    refused = run_pull(peers, r)
    should_refuse = request.node.callspec.id.split("-", 1)[1] in REFUSED_IDS
    assert (refused is not None) == should_refuse, refused


def test_many_scattered_blocks_cross_iov_max_batches(peers: Peers) -> None:
    """Thousands of uncoalesced spans: more iovecs than one readv/process_vm_readv takes."""
    rng = np.random.default_rng(3)
    dst_blocks = rng.permutation(3000).tolist()
    src_blocks = rng.integers(0, 4000, 3000).tolist()
    r = fixed(dtype="<i8", inner=(), src_inner=(), src_units=4000, dst_units=3000,
              src_tensors=2, dst_tensors=2, src_blocks=src_blocks, dst_blocks=dst_blocks)
    assert run_pull(peers, r) is None
