"""Cache geometry: turning a transfer request into byte spans.

Theory of operation
-------------------
A cache is ``num_tensors`` equally shaped tensors. Dim 0 of the shape counts *units*: batch
slots for a contiguous cache, blocks for a blocks cache. ``unit_bytes = tensor_bytes / units``.

Every local copy and every per-layer push of ``transfer_cache_async`` becomes one
:class:`Plan` here (CacheManager's pulls and pushes are planned by the core: cpp/src/plan.h,
``NativeEngine.prepare_pull`` / ``prepare_push``):

* a list of tensor pairs ``(src_tensor, dst_tensor)`` (from the layer ranges), and
* a list of byte spans ``(src_offset, dst_offset, length)`` inside a tensor (from batch
  indexes, block lists, offsets and sizes),

and the bytes moved are the product: for every tensor pair, every span. A cache's tensors all
have the same shape, so the spans are the same in each tensor and we never materialise the
product until a transport needs absolute addresses (a broadcast add).

Rules this module keeps:

1. Transports only move spans; the core checks every local span again (CheckLocalSpans).
2. No Python loop per block: block lists are numpy arrays from the start, coalesced with
   vectorised comparisons (a run of blocks adjacent on *both* sides becomes one span).
3. Source offsets are *relative to the source unit* that the owner resolves (a batch slot, or
   offset 0 for block addressing); the owner adds its own base and checks bounds. The
   destination offsets are absolute within the local tensor, already checked here.
4. Errors are :class:`InvalidArgument` (PARAM_INVALID) with a message that names the culprit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from datadist.core.errors import InvalidArgument

U64 = np.dtype("<u8")
U32 = np.dtype("<u4")

BlockList = Sequence[int] | np.ndarray


# ---- iovec arrays: (n, 2) uint64 (base, length) rows, as ``struct iovec`` on 64-bit Linux,
# the form the local copies (core/local.py) and the core's calls take spans in.


def span_iov(
    tensor_bases: np.ndarray, offsets: np.ndarray, lengths: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Broadcast per-tensor bases with per-span offsets: tensor-major (base, length) arrays,
    the spans of a plan in every tensor (see core/layout.py)."""
    bases = (tensor_bases.astype(U64)[:, None] + offsets[None, :]).reshape(-1)
    lens = np.broadcast_to(lengths, (len(tensor_bases), len(lengths))).reshape(-1)
    return bases, lens


def iovecs(tensor_bases: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``make_iov(*span_iov(...))`` in one step: the ``(n, 2)`` uint64 iovec array of every
    span in every tensor, tensor-major, zero-length spans dropped. Filled in place by
    broadcasting: on the few-span requests of every small pull this is a third of the cost."""
    t, s = len(tensor_bases), len(offsets)
    iov = np.empty((t, s, 2), dtype=U64)
    np.add(np.asarray(tensor_bases, dtype=U64)[:, None], offsets[None, :], out=iov[:, :, 0])
    iov[:, :, 1] = lengths
    out = iov.reshape(t * s, 2)
    if s and (0 in lengths.tolist() if s <= 16 else not lengths.all()):
        out = out[out[:, 1] != 0]
    return out


def make_iov(bases: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """An ``(n, 2)`` uint64 iovec array, zero-length spans dropped."""
    iov = np.empty((len(bases), 2), dtype=U64)
    iov[:, 0] = bases
    iov[:, 1] = lengths
    if len(iov) and not iov[:, 1].all():
        iov = iov[iov[:, 1] != 0]
    return iov


@dataclass(frozen=True, slots=True)
class Geometry:
    """The shape of a cache as the transfer engine sees it: bytes, not dtypes."""

    num_tensors: int
    tensor_bytes: int
    units: int
    is_blocks: bool = False
    # (dtype + 1) << 32 | crc32(per-unit shape); 0 = unknown. See layout_tag().
    layout: int = 0

    def __post_init__(self) -> None:
        if self.num_tensors <= 0:
            raise InvalidArgument(f"num_tensors must be > 0, got {self.num_tensors}")
        if self.units <= 0:
            raise InvalidArgument(f"shape[0] must be > 0, got {self.units}")
        if self.tensor_bytes <= 0 or self.tensor_bytes % self.units:
            raise InvalidArgument(
                f"tensor of {self.tensor_bytes} bytes does not split into {self.units} units"
            )

    @property
    def unit_bytes(self) -> int:
        """Bytes of one batch slot (contiguous cache) or one block (blocks cache)."""
        return self.tensor_bytes // self.units


def layout_tag(dtype_value: int, unit_shape: Sequence[int]) -> int:
    """Describe a cache's element type and per-unit shape in 64 bits, for the owner's
    compatibility check: the dtype in the high word (plus one, so 0 means unknown) and a
    CRC-32 of the per-unit shape in the low word."""
    import zlib

    shape_crc = zlib.crc32(",".join(str(int(d)) for d in unit_shape).encode())
    return ((dtype_value + 1) & 0xFFFFFFFF) << 32 | shape_crc


def wire_layout(geometry: Geometry) -> int:
    """The layout a requester states: the whole tag for a paged cache, the dtype alone for a
    contiguous one (whose slots need not have the shape of the peer's blocks)."""
    return geometry.layout if geometry.is_blocks else geometry.layout & ~0xFFFFFFFF


@dataclass(frozen=True, slots=True, eq=False)
class Plan:
    """What one transfer moves: every span in every tensor pair. Arrays are read-only.

    For a pull the remote side is the source; for a push it is the destination.
    """

    remote_tensors: np.ndarray  # uint32 (T,)
    local_tensors: np.ndarray  # uint32 (T,)
    remote_offsets: np.ndarray  # uint64 (S,), relative to the remote unit base
    local_offsets: np.ndarray  # uint64 (S,), absolute within the local tensor
    lengths: np.ndarray  # uint64 (S,)
    whole: bool = False  # a pull of every tensor (no layer range): counts must match the source's
    # computed once (every transfer asks for them, a small one several times)
    nbytes: int = field(init=False)
    num_spans: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "nbytes", int(self.lengths.sum()) * len(self.local_tensors))
        object.__setattr__(self, "num_spans", len(self.local_tensors) * len(self.lengths))

    def local_iov(self, local_addrs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Absolute (base, length) arrays of the local spans, tensor-major."""
        return span_iov(local_addrs[self.local_tensors], self.local_offsets, self.lengths)

    def local_iovecs(self, local_addrs: np.ndarray) -> np.ndarray:
        """The local spans as an ``(n, 2)`` iovec array (:func:`iovecs`)."""
        return iovecs(local_addrs[self.local_tensors], self.local_offsets, self.lengths)


# --------------------------------------------------------------------------------------------
# tensor pairs


def every_tensor(num_tensors: int) -> tuple[np.ndarray, np.ndarray]:
    """Every tensor paired with the one of the same index (uint32): the tensor pairs of a
    local copy. A pull's pairs, layer ranges included, are the core's (PairLayers,
    cpp/src/plan.h)."""
    idx = np.arange(num_tensors, dtype=U32)
    return idx, idx


# --------------------------------------------------------------------------------------------
# spans

# Arrays up to this long are checked in Python: a numpy reduction costs ~1.5 us whatever its
# size, and a request never seen before (every new request of a server) runs a dozen.
FEW = 16


def max_int(a: np.ndarray) -> int:
    """``int(a.max())`` of a non-empty integer array."""
    return max(a.tolist()) if len(a) <= FEW else int(a.max())


def min_int(a: np.ndarray) -> int:
    """``int(a.min())`` of a non-empty integer array."""
    return min(a.tolist()) if len(a) <= FEW else int(a.min())


def coalesce(
    src: np.ndarray, dst: np.ndarray, lengths: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge neighbouring spans that are adjacent on both sides. Vectorised."""
    if len(src) <= 1:
        return src, dst, lengths
    ends_src = src[:-1] + lengths[:-1]
    ends_dst = dst[:-1] + lengths[:-1]
    breaks = (src[1:] != ends_src) | (dst[1:] != ends_dst)
    starts = np.flatnonzero(np.concatenate(([True], breaks)))
    if len(starts) == len(src):
        return src, dst, lengths
    return src[starts], dst[starts], np.add.reduceat(lengths, starts)


def _as_block_array(blocks: BlockList, name: str) -> np.ndarray:
    arr = np.asarray(blocks)
    if arr.ndim != 1:
        raise InvalidArgument(f"{name} must be a flat list of block indexes")
    if arr.size and arr.dtype.kind not in "iu":
        raise InvalidArgument(f"{name} must hold ints, got {arr.dtype}")
    if arr.size and arr.dtype.kind == "i" and min_int(arr) < 0:
        raise InvalidArgument(f"{name} holds a negative block index {int(arr.min())}")
    return arr.astype(U64, copy=False)


def block_offsets(blocks: np.ndarray, block_bytes: int, name: str) -> np.ndarray:
    """Byte offsets ``blocks * block_bytes`` (uint64), refusing any block whose whole extent
    ``[offset, offset + block_bytes)`` does not fit in 64 bits: a wrapped product would name
    another block than the one asked for. Every place that turns block indexes into offsets
    goes through here (planners here, layer-wise spans, local copies)."""
    b = np.asarray(blocks, dtype=U64)
    if block_bytes <= 0:
        raise InvalidArgument(f"{name} size must be > 0, got {block_bytes}")
    if b.size and max_int(b) > (2**64 - 1) // block_bytes - 1:
        raise InvalidArgument(
            f"{name} {max_int(b)} is out of range: its offset ({block_bytes} bytes a block) "
            "overflows 64 bits"
        )
    offsets: np.ndarray = b * np.uint64(block_bytes)
    return offsets


def _freeze(*arrays: np.ndarray) -> None:
    for a in arrays:
        a.flags.writeable = False


def plan_slot(
    dst: Geometry,
    dst_unit: int,
    tensors: tuple[np.ndarray, np.ndarray],
    size: int = -1,
    src_offset: int = 0,
    dst_offset: int = 0,
) -> Plan:
    """One slot of a contiguous cache into slot ``dst_unit`` of the local cache.

    ``size == -1`` means the rest of the local slot after ``dst_offset``. The span's source
    side is relative to the source slot (the owner checks it fits there).
    """
    stride = dst.unit_bytes
    if not 0 <= dst_unit < dst.units:
        raise InvalidArgument(f"batch_index {dst_unit} out of range [0, {dst.units})")
    if not 0 <= dst_offset < stride:
        raise InvalidArgument(f"dst offset {dst_offset} out of range [0, {stride})")
    if src_offset < 0:
        raise InvalidArgument(f"src offset {src_offset} is negative")
    if size == -1:
        size = stride - dst_offset
    if size <= 0 or size > stride - dst_offset:
        raise InvalidArgument(
            f"size {size} does not fit the destination slot of {stride} bytes "
            f"after offset {dst_offset}"
        )
    if src_offset + size > 2**64 - 1:
        raise InvalidArgument(f"src offset {src_offset} plus size {size} overflows 64 bits")
    s = np.array([src_offset], dtype=U64)
    d = np.array([dst_unit * stride + dst_offset], dtype=U64)
    n = np.array([size], dtype=U64)
    _freeze(s, d, n, *tensors)
    return Plan(tensors[0], tensors[1], s, d, n)


def plan_blocks(
    dst: Geometry,
    src_blocks: BlockList,
    dst_blocks: BlockList,
    tensors: tuple[np.ndarray, np.ndarray],
    spans: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
) -> Plan:
    """Block ``src_blocks[i]`` of the source into block ``dst_blocks[i]`` of the local cache.

    Both caches must have the same block bytes (the owner checks its side); runs of blocks
    adjacent on both sides become one span. ``spans``: what :func:`block_spans` gave for
    these blocks (they do not depend on the layers: callers keep them across layers).
    """
    so, do, ln = spans if spans is not None else block_spans(dst, src_blocks, dst_blocks)
    _freeze(*tensors)
    return Plan(tensors[0], tensors[1], so, do, ln)


def block_spans(
    dst: Geometry, src_blocks: BlockList, dst_blocks: BlockList
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The checked, coalesced (source offset, destination offset, length) spans of
    :func:`plan_blocks`, read-only."""
    s = _as_block_array(src_blocks, "src_blocks")
    d = _as_block_array(dst_blocks, "dst_blocks")
    if d.size == 0:
        raise InvalidArgument("dst_blocks must not be empty")
    if s.size != d.size:
        raise InvalidArgument(
            f"src_blocks has {s.size} entries but dst_blocks has {d.size}"
        )
    if max_int(d) >= dst.units:
        raise InvalidArgument(
            f"dst block {max_int(d)} out of range: the cache has {dst.units} blocks"
        )
    bb = np.uint64(dst.unit_bytes)
    lengths = np.empty(s.size, dtype=U64)
    lengths.fill(bb)
    so, do, ln = coalesce(block_offsets(s, dst.unit_bytes, "src block"), d * bb, lengths)
    _freeze(so, do, ln)
    return so, do, ln


def check_source_spans(
    offsets: np.ndarray, lengths: np.ndarray, limit: int
) -> None:
    """Owner side: every span ``[offset, offset+length)`` must lie inside ``[0, limit)``,
    and be at least one byte long (a span of 0 bytes moves nothing, and its only use is to
    ask whether an address lies inside registered memory).

    Overflow-safe: compared as ``offset <= limit - length`` on uint64 after checking
    ``length <= limit``.
    """
    bad = span_outside(offsets, lengths, limit)
    if bad is not None:
        if not bad[1]:
            raise InvalidArgument(f"span [{bad[0]}, +0) is empty: spans move >= 1 byte")
        raise InvalidArgument(f"span [{bad[0]}, +{bad[1]}) lies outside the {limit} bytes "
                              "registered")


def span_outside(offsets: np.ndarray, lengths: np.ndarray,
                 limit: int) -> tuple[int, int] | None:
    """The first span ``(offset, length)`` that is empty or not inside ``[0, limit)``; None
    when all are good. Overflow-safe (see :func:`check_source_spans`)."""
    if offsets.shape != lengths.shape:
        raise InvalidArgument("span arrays differ in length")
    if not len(lengths):
        return None
    if len(lengths) <= FEW:  # in Python ints: exact, no wrap-around to guard against
        for off, n in zip(offsets.tolist(), lengths.tolist(), strict=True):
            if off < 0 or n <= 0 or n > limit or off > limit - n:
                return int(off), int(n)
        return None
    lim = np.uint64(limit)
    if (bool((lengths > lim).any()) or bool((offsets > lim - lengths).any())
            or not bool(lengths.all())):
        bad = int(np.argmax((lengths > lim) | (offsets > lim - np.minimum(lengths, lim))
                            | (lengths == 0)))
        return int(offsets[bad]), int(lengths[bad])
    return None
