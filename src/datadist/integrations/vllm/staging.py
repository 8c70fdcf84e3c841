"""The connector on a CUDA vLLM: the KV cache staged through host buffers, or read in GPU memory
by NIXL (``kv_buffer_device`` in ``kv_connector_extra_config``; docs/vllm.md, "GPU workers").

**kv_buffer_device = "cpu"** (the default; NixlConnector's ``kv_buffer_device="cpu"``): each
worker keeps a *host mirror* of its KV cache, one host tensor (pinned where torch can pin) of
each device tensor's shape, and registers the mirror with datadist; every transfer reads and
writes the mirror, never GPU memory, so every datadist transport works.

- Prefill (producer), pull mode: what each step wrote is copied device -> host after the
  forward: ``begin_step`` reads the step's slot mappings into host memory asynchronously (on the
  compute stream, queued before the forward, so reading them never waits for it);
  ``wait_for_save`` turns them into block ids and queues the copy of those blocks, every layer,
  on a staging stream that first waits for the compute stream (the forward's KV writes).
  ``hold`` marks a finished request's blocks HELD (worker.py) only once every copy queued so
  far has ended: a decoder never reads a block the GPU has not copied out yet.
- Prefill, layer-wise mode: ``save_layer`` queues the copy of the layer's blocks of this
  step's layer-wise requests (the staging stream waits for the compute stream first) and
  announces (layerwise.py) the highest layer whose copy, and every earlier one, has ended
  (``query``, no wait); ``wait_for_save`` waits for the rest, then announces the step done. A
  request's first step copies its blocks from the first (a prefix-cache hit's blocks too).
- Decode (consumer): a pull lands in the mirror; ``layers_landed`` (layer-wise: each layer
  group as its pull ends) and ``received`` (pull mode: every layer at once) queue the host ->
  device copies of the request's blocks on the staging stream; before the request is reported
  to vLLM, ``fence`` makes the compute stream wait for those copies (a CUDA event, no host
  wait): the next forward that reads the blocks runs after them. Failed requests are fenced
  too (their blocks are reused at once).

**kv_buffer_device = "cuda"**: NIXL reads GPU memory directly (docs/transports.md, "VRAM"): the
device tensors are registered, the link must be NIXL (``link_path``; a link that fell back to
TCP fails its requests, which vLLM then recomputes), and nothing is copied. The layer-wise
producer still announces a layer only once the compute stream has passed its save (an event
per layer): vLLM's ``save_kv_layer`` runs when the layer's kernels are queued, not run.

A CPU vLLM (the KV cache in host memory) uses no staging: datadist reads vLLM's tensors.

The copies go through a ``CopyEngine`` (``CudaEngine`` on a GPU; the tests use a stand-in whose
copies are queued and run late, with real bytes). Who calls: the connector's worker side
(connector.py) from vLLM's worker thread, at the hooks named above; nothing here starts a
thread. ``hold`` and ``wait_for_save`` may wait, polling an event, bounded by
``sync_kv_timeout_ms``; every other call queues work and returns.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol, cast

import numpy as np
import torch

from datadist.integrations.vllm.settings import LOGGER_NAME, Settings

if TYPE_CHECKING:
    from datadist.integrations.vllm.layerwise import LayerwiseStep
    from datadist.integrations.vllm.scheduler import SendTask
    from datadist.integrations.vllm.worker import DatadistWorker

logger = logging.getLogger(LOGGER_NAME)


class Marker(Protocol):
    """A point in a stream (a CUDA event): ``query`` is True once the work queued before it
    has run. Never blocks."""

    def query(self) -> bool: ...


class CopyEngine(Protocol):
    """The device operations staging needs. *compute* is the stream vLLM runs the model on
    (the caller's current stream); *staging* is the engine's own stream."""

    def host_like(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor of ``t``'s shape, strides and dtype (pinned where possible)."""
        ...

    def after_compute(self) -> None:
        """Staging work queued from now on runs after the compute work queued so far."""
        ...

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queue ``dst.copy_(src)`` on the staging stream; returns at once."""
        ...

    def record(self) -> Marker:
        """A marker after the staging work queued so far."""
        ...

    def record_compute(self) -> Marker:
        """A marker after the compute work queued so far."""
        ...

    def compute_waits(self, marker: Marker) -> None:
        """Compute work queued from now on runs after ``marker`` (no host wait)."""
        ...

    def read(self, t: torch.Tensor) -> tuple[torch.Tensor, Marker]:
        """Queue a copy of ``t`` (a small device tensor) into host memory on the compute
        stream: the host tensor holds it once the marker says so."""
        ...


class CudaEngine:
    """``CopyEngine`` on a CUDA device: a staging stream of its own, CUDA events as markers.
    The compute stream is the caller's current stream at each call (vLLM's)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self._pin = True

    def _compute(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def host_like(self, t: torch.Tensor) -> torch.Tensor:
        if self._pin:
            try:
                return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype,
                                           device="cpu", pin_memory=True)
            except RuntimeError as e:  # e.g. the locked-memory limit
                self._pin = False
                logger.warning("datadist: cannot pin the KV host buffers (%s); using pageable "
                               "memory (host <-> device copies are then synchronous)", e)
        return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="cpu")

    def after_compute(self) -> None:
        self.stream.wait_stream(self._compute())

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)

    def record(self) -> Marker:
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return cast(Marker, ev)

    def record_compute(self) -> Marker:
        ev = torch.cuda.Event()
        ev.record(self._compute())
        return cast(Marker, ev)

    def compute_waits(self, marker: Marker) -> None:
        self._compute().wait_event(marker)

    def read(self, t: torch.Tensor) -> tuple[torch.Tensor, Marker]:
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self._pin)
        host.copy_(t, non_blocking=True)
        return host, self.record_compute()


def split_layer(t: torch.Tensor) -> list[torch.Tensor]:
    """One layer's KV tensor as datadist's tensors (layout.py's rule: ``[2, num_blocks, ...]``
    is K and V)."""
    return [t[0], t[1]] if t.dim() == 5 and t.shape[0] == 2 else [t]


def runs(ids: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted distinct block ids as ``[start, stop)`` runs: one copy per run and tensor."""
    out: list[tuple[int, int]] = []
    for b in sorted(set(ids)):
        if out and out[-1][1] == b:
            out[-1] = (out[-1][0], b + 1)
        else:
            out.append((b, b + 1))
    return out


def slot_mappings(context: Any) -> list[torch.Tensor]:
    """The distinct ``slot_mapping`` tensors of vLLM's forward context (vLLM 0.32: its
    ``slot_mapping``, a dict by layer, else its ``attn_metadata``) or of one layer's
    attention metadata (dicts by layer and lists of them are searched): where the step writes
    KV, one slot per token (``block * block_size + offset``; -1 for padding)."""
    found: dict[int, torch.Tensor] = {}

    def visit(md: Any) -> None:
        if md is None:
            return
        if isinstance(md, dict):
            for v in md.values():
                visit(v)
        elif isinstance(md, (list, tuple)):
            for v in md:
                visit(v)
        elif isinstance(md, torch.Tensor):
            found.setdefault(id(md), md)
        else:
            sm = getattr(md, "slot_mapping", None)
            if sm is None or (isinstance(sm, (dict, list)) and not sm):
                sm = getattr(md, "attn_metadata", None)  # a forward context of old
            visit(sm)

    visit(context)
    return list(found.values())


class Staging:
    """One worker's staging (``mode`` "cpu": a host mirror) or VRAM bookkeeping (``mode``
    "cuda"). ``bind`` it to the started DatadistWorker; then the connector calls the methods
    below at vLLM's hooks instead of the worker's own (see the module's docstring)."""

    def __init__(self, dev_tensors: Sequence[torch.Tensor],
                 host_tensors: Sequence[torch.Tensor], tensors_per_layer: int,
                 block_size: int, engine: CopyEngine, mode: str, timeout_s: float) -> None:
        if mode not in ("cpu", "cuda"):
            raise ValueError(f"staging mode must be 'cpu' or 'cuda', got {mode!r}")
        if mode == "cpu" and [t.shape for t in host_tensors] != [t.shape for t in dev_tensors]:
            raise ValueError("the host buffers differ from the device tensors in shape")
        self.mode = mode
        self.engine = engine
        self.block_size = block_size
        self.timeout_s = timeout_s
        self._tpl = tensors_per_layer
        self.dev = list(dev_tensors)
        self.host = list(host_tensors) if mode == "cpu" else []
        self._worker: DatadistWorker | None = None
        self._producer = False
        self._reads: list[tuple[torch.Tensor, Marker]] = []  # this step's slot mappings
        self._lw_blocks: list[int] = []  # this step's layer-wise blocks, to copy per layer
        self._lw_started: set[str] = set()  # layer-wise requests whose first step was seen
        self._layer_marks: list[tuple[int, Marker]] = []  # (layer, its copy/compute marker)
        self._lw_saved: set[int] = set()  # layers of this step given to save_layer
        self._announced = -1
        self._last_copy: Marker | None = None  # the last device -> host copy queued
        self._dirty = False  # host -> device copies queued since the last fence
        self.stats = {"d2h_blocks": 0, "h2d_blocks": 0, "fences": 0}

    @property
    def num_layers(self) -> int:
        return len(self.dev) // self._tpl

    def bind(self, worker: DatadistWorker) -> None:
        """The worker whose transfers this stages (started on ``host`` or ``dev``)."""
        self._worker = worker
        self._producer = worker.producer
        if worker.lw_consumer is not None and self.mode == "cpu":
            worker.lw_consumer.on_layers = self.layers_landed

    # ------------------------------------------------------------------ copies

    def _layers(self, layers: Iterable[int]) -> Iterable[int]:
        for layer in layers:
            yield from range(layer * self._tpl, (layer + 1) * self._tpl)

    def _copy(self, ids: Iterable[int], layers: Iterable[int], to_host: bool) -> int:
        spans = runs(ids)
        for t in self._layers(layers):
            d, h = self.dev[t], self.host[t]
            for a, b in spans:
                if to_host:
                    self.engine.copy(h[a:b], d[a:b])
                else:
                    self.engine.copy(d[a:b], h[a:b])
        return sum(b - a for a, b in spans)

    def _wait(self, marker: Marker, what: str) -> None:
        """Poll ``marker`` (GIL released between polls) until it passes, bounded."""
        deadline = time.monotonic() + self.timeout_s
        while not marker.query():
            if time.monotonic() >= deadline:
                raise TimeoutError(f"datadist: {what} did not end within "
                                   f"{self.timeout_s * 1e3:.0f} ms (sync_kv_timeout_ms): is "
                                   "the GPU stuck?")
            time.sleep(0.00005)

    # ------------------------------------------------------------------ producer

    def begin_step(self, context: Any) -> None:
        """The step's first ``save_kv_layer`` (its attention metadata), else ``start_load_kv``
        (the forward context; vLLM 0.32 calls it after the forward): read where this step
        writes KV, without waiting. Once per step; a step without metadata writes nothing.
        Producers only: a decoder's own writes are never read by another instance."""
        if self.mode != "cpu" or not self._producer or self._reads:
            return
        self._reads = [self.engine.read(sm) for sm in slot_mappings(context)]

    def lw_step(self, entries: list[LayerwiseStep]) -> list[LayerwiseStep]:
        """A step's layer-wise prefill requests, before the producer announces them: note
        the blocks each writes this step (copied per layer); a request's first step covers
        its blocks from the first (a prefix-cache hit was computed by another request, and
        the producer must announce those blocks only once copied). Returns the entries to
        hand to ``LayerwiseProducer.step``."""
        self._layer_marks = []
        self._lw_saved = set()
        self._announced = -1
        self._lw_blocks = []
        out = []
        for e in entries:
            first = e.request_id not in self._lw_started
            self._lw_started.add(e.request_id)
            if first and e.computed_before > 0 and self.mode == "cpu":
                e = replace(e, computed_before=0, scheduled=e.computed_before + e.scheduled)
            end = min(e.computed_before + e.scheduled, e.prompt_len)
            lo, hi = e.computed_before // e.block_size, -(-end // e.block_size)
            self._lw_blocks.extend(e.block_ids[lo:hi])
            out.append(e)
        return out

    def lw_released(self, request_id: str) -> None:
        """vLLM finished a layer-wise prefill request (forget it)."""
        self._lw_started.discard(request_id)

    def save_layer(self, layer: int) -> int:
        """``save_kv_layer``: the layer's kernels are queued. Queue its copy (cpu) or mark
        the compute stream (cuda); returns the highest layer that may be announced now (every
        layer up to it copied or computed; -1: none yet). Never waits."""
        if not self._lw_blocks:
            return self._announced
        self._lw_saved.add(layer)
        if self.mode == "cpu":
            self.engine.after_compute()
            self.stats["d2h_blocks"] += self._copy(self._lw_blocks, [layer], True)
            mark = self.engine.record()
            self._last_copy = mark
        else:
            mark = self.engine.record_compute()
        self._layer_marks.append((layer, mark))
        return self._ready_layers()

    def _ready_layers(self) -> int:
        while self._layer_marks and self._layer_marks[0][1].query():
            self._announced = max(self._announced, self._layer_marks.pop(0)[0])
        return self._announced

    def wait_for_save(self) -> int:
        """``wait_for_save`` (the forward is queued): copy the layer-wise blocks of layers
        that had no ``save_layer`` (vLLM calls none inside a full CUDA graph), wait for the
        layer copies still running (bounded), queue the copy of every other block the step
        wrote, every layer, and return the highest layer saved: the last one (-1 when the
        step had no layer-wise request)."""
        lw = self._lw_blocks
        missing = [i for i in range(self.num_layers) if i not in self._lw_saved] if lw else []
        if missing:
            if self.mode == "cpu":
                self.engine.after_compute()
                self.stats["d2h_blocks"] += self._copy(lw, missing, True)
                self._last_copy = self.engine.record()
                self._layer_marks.append((max(missing), self._last_copy))
            else:
                self._layer_marks.append((max(missing), self.engine.record_compute()))
        for layer, mark in self._layer_marks:
            self._wait(mark, f"the copy of layer {layer} to host memory")
            self._announced = max(self._announced, layer)
        self._layer_marks = []
        if self.mode == "cpu" and self._reads:
            ids: set[int] = set()
            for host, mark in self._reads:
                self._wait(mark, "the read of the step's slot mapping")
                sm = host.numpy()
                ids.update(np.unique(sm[sm >= 0] // self.block_size).tolist())
            ids.difference_update(self._lw_blocks)  # copied layer by layer already
            if ids:
                self.engine.after_compute()
                self.stats["d2h_blocks"] += self._copy(ids, range(self.num_layers), True)
                self._last_copy = self.engine.record()
        self._reads = []
        self._lw_blocks = []
        self._lw_saved = set()
        return self.num_layers - 1 if lw else -1

    def hold(self, tasks: list[SendTask]) -> None:
        """``start_load_kv`` of the step after these requests finished: once every copy to
        host memory queued so far has ended (bounded wait; usually over), hold their blocks
        for decoders (the worker marks them HELD)."""
        assert self._worker is not None
        if self._last_copy is not None:
            self._wait(self._last_copy, "the copy of the KV cache to host memory")
            self._last_copy = None
        self._worker.hold(tasks)

    # ------------------------------------------------------------------ consumer

    def layers_landed(self, request_id: str, layers: range, local_ids: list[int]) -> None:
        """A layer-wise pull ended: its layers of ``local_ids`` are in the mirror; queue their
        copy to the device (layerwise.py calls this, from the worker's thread)."""
        self.stats["h2d_blocks"] += self._copy(local_ids, layers, False)
        self._dirty = True

    def received(self, local_ids: list[int], every_layer: bool) -> None:
        """A request's KV is in the mirror (``every_layer``: a pull, whose layers were not
        copied yet; else a layer-wise request, whose were): queue what is left to copy."""
        if self.mode == "cpu" and every_layer:
            self.stats["h2d_blocks"] += self._copy(local_ids, range(self.num_layers), False)
            self._dirty = True

    def fence(self) -> None:
        """Before requests are reported received or failed: the compute stream waits for the
        copies to the device queued so far (no host wait)."""
        if self._dirty:
            self.engine.compute_waits(self.engine.record())
            self._dirty = False
            self.stats["fences"] += 1


def kv_buffer_mode(settings: Settings, device_type: str) -> str | None:
    """How a worker whose KV cache lies on ``device_type`` moves it: None (host memory,
    datadist reads vLLM's tensors), "cpu" (staged through host buffers) or "cuda" (NIXL
    reads GPU memory). Raises ValueError for a combination that cannot work."""
    if device_type == "cpu":
        return None
    if device_type != "cuda":
        raise ValueError(f"the KV cache is on {device_type}: the datadist connector moves "
                         "host memory, or CUDA memory (kv_buffer_device)")
    return settings.kv_buffer_device


def llm_options(mode: str | None, producer: bool) -> dict[str, object]:
    """LLMConfig extras a worker needs: NIXL, serving and allowed to read the process's
    registered memory, for the VRAM path; nothing otherwise."""
    if mode != "cuda":
        return {}
    out: dict[str, object] = {"transport": "nixl", "nixl_allow_whole_process_access": True}
    if producer:
        out["nixl_serve"] = True
    return out


def setup(kv_caches: dict[str, torch.Tensor], settings: Settings, block_size: int,
          engine_factory: Callable[[torch.device], CopyEngine] = CudaEngine,
          device_type: str | None = None) -> tuple[dict[str, torch.Tensor], Staging | None]:
    """What ``register_kv_caches`` registers with datadist and the staging that keeps it in
    step with vLLM's tensors: vLLM's own tensors and None on a CPU vLLM; host mirrors (of
    the same names and shapes) and a "cpu" Staging with kv_buffer_device "cpu"; the device
    tensors and a "cuda" Staging with "cuda". ``device_type`` overrides the tensors' own
    (tests stage CPU tensors through a stand-in engine as if they were on a GPU)."""
    first = next(iter(kv_caches.values()))
    mode = kv_buffer_mode(settings, device_type or first.device.type)
    if mode is None:
        return kv_caches, None
    if any(t.device != first.device for t in kv_caches.values()):
        raise ValueError("the KV cache spans several devices; one worker, one device")
    parts = [p for t in kv_caches.values() for p in split_layer(t)]
    per_layer = len(parts) // len(kv_caches)
    engine = engine_factory(first.device)
    timeout_s = settings.sync_kv_timeout_ms / 1e3
    if mode == "cuda":
        logger.info("datadist: KV cache on %s registered as is, moved by NIXL "
                    "(kv_buffer_device 'cuda')", first.device)
        return kv_caches, Staging(parts, [], per_layer, block_size, engine, mode, timeout_s)
    # The mirror: one host tensor per vLLM tensor, so layout.py sees the same shapes.
    mirror = {name: engine.host_like(t) for name, t in kv_caches.items()}
    host = [p for t in mirror.values() for p in split_layer(t)]
    staging = Staging(parts, host, per_layer, block_size, engine, mode, timeout_s)
    logger.info("datadist: KV cache on %s staged through %.1f MiB of host memory (%s)",
                first.device, sum(t.numel() * t.element_size() for t in mirror.values()) / 2**20,
                "pinned" if host[0].is_pinned() else "pageable")
    return mirror, staging
