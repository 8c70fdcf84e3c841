"""Layer-wise asynchronous transfer: send each layer as soon as it is computed.

Who calls: the facade's ``transfer_cache_async`` (cache-manager and legacy mode). It builds
one :class:`LayerJob` per destination and starts a :class:`LayerwiseTransfer`; the thread it
starts calls the user's ``synchronize`` for each layer some job needs, in layer order, and
then hands that layer to every job that needs it. So the transfer of layer i overlaps the
computation of layer i+1: the thread blocks in ``synchronize(i+1)`` while the user computes.

Rules:

1. ``synchronize(i)`` is called at most once per layer, only for layers some live job needs.
   False aborts every job that needs layer i (PARAM_INVALID, as LLM-DataDist reports it); an
   exception from it aborts them with the task's default error. Jobs not needing the layer
   go on.
2. A job that fails to send a layer stops there with the error's code; the others go on.
3. A job reports SUCCESS once its last layer is sent; a job never started reports nothing
   (None in ``get_results``).

Also here: the span planners for one layer of such a transfer (geometry lives in core). A
layer's spans are the same for every layer, so they are computed once per destination.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from datadist.core.errors import Code, DatadistError, InvalidArgument
from datadist.core.layout import U32, U64, Geometry, Plan, block_offsets, checked_add, coalesce

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LayerJob:
    """One destination: the source layers it takes (ascending) and how to send one."""

    layers: Sequence[int]
    send: Callable[[int], None]  # sends source layer i; raises DatadistError


class LayerwiseTransfer:
    """Runs the jobs on one daemon thread. ``report(index, code)`` and ``done()`` are called
    from that thread; they must not block."""

    def __init__(
        self,
        num_layers: int,
        synchronize: Callable[[int], bool],
        jobs: Sequence[LayerJob],
        report: Callable[[int, Code], None],
        done: Callable[[], None],
        sync_error: Code = Code.TIMEOUT,
    ) -> None:
        self.num_layers = num_layers
        self._synchronize = synchronize
        self._jobs = list(jobs)
        self._report = report
        self._done = done
        self._sync_error = sync_error
        self.thread = threading.Thread(target=self._run, name="datadist-layerwise", daemon=True)

    def start(self) -> LayerwiseTransfer:
        self.thread.start()
        return self

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            self._done()

    def _loop(self) -> None:
        wanted = [set(j.layers) for j in self._jobs]
        last = [j.layers[-1] if len(j.layers) else -1 for j in self._jobs]
        alive = [bool(w) for w in wanted]
        for layer in range(self.num_layers):
            needing = [k for k, w in enumerate(wanted) if alive[k] and layer in w]
            if not needing:
                continue
            try:
                ready = bool(self._synchronize(layer))
                code = Code.PARAM_INVALID
            except Exception:  # user code: report, never kill the thread silently
                log.exception("synchronize_layer(%d) raised", layer)
                ready, code = False, self._sync_error
            if not ready:
                log.warning("layer %d was not synchronized: %d destination(s) aborted",
                            layer, len(needing))
                for k in needing:
                    alive[k] = False
                    self._report(k, code)
                continue
            for k in needing:
                try:
                    self._jobs[k].send(layer)
                except DatadistError as e:
                    log.warning("sending layer %d to destination %d failed: %s", layer, k, e)
                    alive[k] = False
                    self._report(k, e.code)
                    continue
                except Exception:  # a bug; keep the other destinations going
                    log.exception("sending layer %d to destination %d failed", layer, k)
                    alive[k] = False
                    self._report(k, Code.FAILED)
                    continue
                if layer == last[k]:
                    self._report(k, Code.SUCCESS)


# --------------------------------------------------------------------------------------------
# spans of one layer. Remote offsets are relative to what the destination key names (a batch
# slot, or a tensor base for blocks and raw addresses); local offsets are absolute in the
# source tensor.


@dataclass(frozen=True, slots=True, eq=False)
class LayerSpans:
    """One layer's spans of a layer-wise transfer: remote and local offsets and lengths,
    turned into a transfer plan per layer by :meth:`plan`."""

    remote_offsets: np.ndarray
    local_offsets: np.ndarray
    lengths: np.ndarray

    def plan(self, remote_tensors: Sequence[int], local_tensors: Sequence[int],
             remote_base: int = 0) -> Plan:
        """The plan for one layer's tensors; ``remote_base`` is added to remote offsets (a
        raw destination address; InvalidArgument when a span would pass 2**64)."""
        remote = (checked_add(self.remote_offsets, self.lengths, remote_base, "dst address")
                  if remote_base else self.remote_offsets)
        return Plan(np.asarray(remote_tensors, dtype=U32), np.asarray(local_tensors, dtype=U32),
                    remote, self.local_offsets, self.lengths)


def _spans(remote: np.ndarray, local: np.ndarray, lengths: np.ndarray) -> LayerSpans:
    r, lo, n = coalesce(remote.astype(U64), local.astype(U64), lengths.astype(U64))
    return LayerSpans(r, lo, n)


def slot_spans(src: Geometry, src_unit: int) -> LayerSpans:
    """One whole batch slot of a contiguous source into a destination slot (or address)."""
    if src.is_blocks:
        raise InvalidArgument("a blocks cache source needs src_block_indices")
    if not 0 <= src_unit < src.units:
        raise InvalidArgument(f"src_batch_index {src_unit} out of range [0, {src.units})")
    return _spans(np.zeros(1, U64), np.array([src_unit * src.unit_bytes], U64),
                  np.array([src.unit_bytes], U64))


def blocks_spans(src: Geometry, src_blocks: np.ndarray, dst_blocks: np.ndarray,
                 dst_block_bytes: int) -> LayerSpans:
    """Block ``src_blocks[i]`` into destination block ``dst_blocks[i]`` (``dst_block_bytes``
    apart at the destination; each copy is one source block)."""
    s = np.asarray(src_blocks, dtype=U64)
    d = np.asarray(dst_blocks, dtype=U64)
    if s.size == 0 or s.size != d.size:
        raise InvalidArgument(
            f"src_block_indices ({s.size}) and dst_block_indices ({d.size}) must be "
            "non-empty and of the same length"
        )
    if int(s.max()) >= src.units:
        raise InvalidArgument(f"src block {int(s.max())} out of range [0, {src.units})")
    if dst_block_bytes < src.unit_bytes:
        raise InvalidArgument(
            f"dst_block_memory_size {dst_block_bytes} is smaller than a source block "
            f"({src.unit_bytes} bytes)"
        )
    bb = np.uint64(src.unit_bytes)
    return _spans(block_offsets(d, dst_block_bytes, "dst block"), s * bb,
                  np.full(s.size, bb, dtype=U64))


def slot_to_blocks_spans(src: Geometry, src_unit: int, dst_blocks: np.ndarray,
                         dst_block_bytes: int) -> LayerSpans:
    """A contiguous slot cut into ``dst_block_bytes`` chunks: chunk k -> ``dst_blocks[k]``.
    The last chunk may be short; every chunk must start inside the slot."""
    if src.is_blocks:
        raise InvalidArgument("a blocks cache source needs src_block_indices")
    if not 0 <= src_unit < src.units:
        raise InvalidArgument(f"src_batch_index {src_unit} out of range [0, {src.units})")
    d = np.asarray(dst_blocks, dtype=U64)
    if dst_block_bytes <= 0:
        raise InvalidArgument("dst_block_memory_size must be > 0 for a transfer into blocks")
    stride = src.unit_bytes
    # In Python ints: (n - 1) * size in uint64 could wrap below the stride.
    if d.size == 0 or (d.size - 1) * dst_block_bytes >= stride:
        raise InvalidArgument(
            f"{d.size} destination blocks of {dst_block_bytes} bytes do not fit a source "
            f"slot of {stride} bytes"
        )
    starts = np.arange(d.size, dtype=U64) * np.uint64(dst_block_bytes)
    lengths = np.minimum(np.uint64(dst_block_bytes), np.uint64(stride) - starts)
    return _spans(block_offsets(d, dst_block_bytes, "dst block"),
                  starts + np.uint64(src_unit * stride), lengths)


__all__ = ["LayerJob", "LayerSpans", "LayerwiseTransfer", "blocks_spans", "slot_spans",
           "slot_to_blocks_spans"]
