"""``DatadistConnector``: vLLM's KVConnectorBase_V1 over datadist (imports vLLM).

A thin adapter: vLLM instantiates it once as SCHEDULER (bookkeeping in scheduler.py) and once
per worker as WORKER (datadist I/O in worker.py). It follows NixlConnector's request flow and
parameter names, so routers written for NIXL work unchanged (see docs/vllm.md).

The decode side loads asynchronously (``get_num_new_matched_tokens`` returns ``load_async``):
the request waits in WAITING_FOR_REMOTE_KVS until ``get_finished`` reports its pull, so no
forward pass ever waits for a layer and ``wait_for_layer_load`` has nothing to do. A step's
holds (prefill) and pulls (decode) start when vLLM binds the step's metadata, before its
forward (vLLM 0.32 calls ``start_load_kv`` after it). In the
layer-wise mode (``kv_connector_extra_config["mode"] = "layerwise"``, layerwise.py) the
prefill side's ``save_kv_layer`` records that the layer is written (no transfer) and the
decode side pulls it, overlapping the prefill's forward. Failures are reported as
``failed_recving``, and vLLM applies ``kv_load_failure_policy`` (recompute or fail).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from datadist.integrations.vllm import staging
from datadist.integrations.vllm.layout import kv_layout
from datadist.integrations.vllm.scheduler import RecvTask, SchedulerSide, StepMeta
from datadist.integrations.vllm.settings import LOGGER_NAME, ROLES, Settings, WorkerAddress
from datadist.integrations.vllm.worker import DatadistWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(LOGGER_NAME)


def _trace(request_id: str, event: str) -> None:
    """One timestamped step of a request's way through the connector (``trace`` in
    ``kv_connector_extra_config``): wall clocks, so the two engines' lines (and a bench's
    own clock) compare on one host. examples/vllm/bench_pd.py reads them."""
    logger.info("datadist trace: %s %s at %.5f", request_id, event, time.time())


@dataclass
class DatadistConnectorMetadata(KVConnectorMetadata):
    """One step's pulls and holds, scheduler -> workers."""

    step: StepMeta


@dataclass
class DatadistHandshakeMetadata(KVConnectorHandshakeMetadata):
    """A producer worker's datadist listen address, worker -> its own scheduler."""

    host: str
    port: int
    cluster_id: int




def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # noqa: BLE001 - no model-parallel group: a single worker
        return 0


class DatadistConnector(KVConnectorBase_V1):
    """vLLM V1 KV connector that moves the KV cache with datadist (``pull_blocks``)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = self._kv_transfer_config
        kind = ROLES.get(str(ktc.kv_role))
        if kind is None:
            raise ValueError(f"DatadistConnector: unknown kv_role {ktc.kv_role!r}")
        self.settings = Settings.from_extra_config(ktc.kv_connector_extra_config)
        # Timestamps of each request's steps in the log (bench_pd.py's breakdown of the time
        # from the pull's end to the first token); off by default.
        self._trace = bool((ktc.kv_connector_extra_config or {}).get("trace", False))
        producer, consumer = kind in ("producer", "both"), kind in ("consumer", "both")
        self._sched: SchedulerSide | None = None
        self._worker: DatadistWorker | None = None
        self._kv_tensors: list[torch.Tensor] = []
        # A CUDA vLLM's KV cache: staged through host buffers, or read by NIXL (staging.py).
        self._staging: staging.Staging | None = None
        self._block_size = int(vllm_config.cache_config.block_size)
        self._layer_index: dict[str, int] = {}
        # The step whose layer-wise requests the producer has (prefill worker).
        self._lw_meta: DatadistConnectorMetadata | None = None
        # The step whose holds and pulls were started (worker), and what a poll at that
        # start found finished (requests, failed ones): get_finished reports them.
        self._started: DatadistConnectorMetadata | None = None
        self._early: tuple[set[str], set[str]] = (set(), set())
        if role == KVConnectorRole.SCHEDULER:
            self._sched = SchedulerSide(
                self.settings, engine_id=str(ktc.engine_id),
                block_size=vllm_config.cache_config.block_size,
                producer=producer, consumer=consumer)
        else:
            self._worker = DatadistWorker(self.settings, producer=producer, consumer=consumer,
                                          rank=_tp_rank(), on_pulled=self._pulled)
            if self._trace:  # a pull's stages: linked, held (the mailbox said so)
                self._worker.on_event = _trace

    # ================================================================== scheduler side

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._sched is not None
        return self._sched.matched_tokens(len(request.prompt_token_ids or ()),
                                          num_computed_tokens, request.kv_transfer_params)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        assert self._sched is not None
        local = blocks.get_unhashed_block_ids() if num_external_tokens > 0 else []
        self._sched.after_alloc(request.request_id, request.kv_transfer_params, local,
                                num_external_tokens, len(request.prompt_token_ids or ()))
        if self._trace and num_external_tokens > 0:
            _trace(request.request_id, "allocated")

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._sched is not None
        if self.settings.mode == "layerwise" and self._sched.producer:
            cached = scheduler_output.scheduled_cached_reqs
            resumed: set[str] = getattr(cached, "resumed_req_ids", set())
            self._sched.scheduled(
                ((r.req_id, list(r.block_ids[0]), r.num_computed_tokens)
                 for r in scheduler_output.scheduled_new_reqs),
                ((rid, None if b is None else list(b[0]), c, rid in resumed)
                 for rid, b, c in zip(cached.req_ids, cached.new_block_ids,
                                      cached.num_computed_tokens, strict=False)),
                scheduler_output.num_scheduled_tokens)
        meta = self._sched.build_meta()
        meta.idle = scheduler_output.total_num_scheduled_tokens == 0
        if self._trace:  # a loaded request's (or a local one's) first computing step
            for r in scheduler_output.scheduled_new_reqs:
                if scheduler_output.num_scheduled_tokens.get(r.req_id, 0) > 0:
                    _trace(r.req_id, f"scheduled ({r.num_computed_tokens} computed)")
        return DatadistConnectorMetadata(meta)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        assert self._sched is not None
        ok = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED,
                                RequestStatus.FINISHED_STOPPED)
        return self._sched.finished(request.request_id, request.kv_transfer_params,
                                    finished_ok=ok, block_ids=list(block_ids),
                                    num_computed_tokens=request.num_computed_tokens)

    def update_connector_output(self, connector_output: Any) -> None:
        assert self._sched is not None
        self._sched.sent(connector_output.finished_sending or ())
        if self._trace:
            for rid in connector_output.finished_recving or ():
                _trace(rid, "learned")

    def set_xfer_handshake_metadata(
            self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        assert self._sched is not None
        workers = [WorkerAddress(m.host, m.port, m.cluster_id)
                   for _, m in sorted(metadata.items())
                   if isinstance(m, DatadistHandshakeMetadata)]
        self._sched.set_workers(workers)

    # ================================================================== worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        registered, st = self._setup_staging(kv_caches)
        layout, self._kv_tensors = kv_layout(registered, device_ok=st is not None)
        self._layer_index = {name: i for i, name in enumerate(kv_caches)}
        if st is not None:
            self._worker.options.update(staging.llm_options(st.mode, self._worker.producer))
            self._worker.link_path = "nixl" if st.mode == "cuda" else None
        self._worker.start(layout)
        if st is not None:
            st.bind(self._worker)
        self._staging = st

    def _setup_staging(self, kv_caches: dict[str, torch.Tensor],
                       ) -> tuple[dict[str, torch.Tensor], staging.Staging | None]:
        """The tensors to register and their staging (staging.setup); a hook for tests,
        which stage a CPU vLLM's cache through a stand-in engine."""
        return staging.setup(kv_caches, self.settings, self._block_size)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        if self._worker is None or self._worker.address is None:
            return None
        a = self._worker.address
        return DatadistHandshakeMetadata(a.host, a.port, a.cluster_id)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """vLLM binds a step's metadata before the step's forward; the step's holds and pulls
        start here. vLLM 0.32 calls ``start_load_kv`` only *after* the forward when no load
        is synchronous (``KVConnectorModelRunnerMixin._get_kv_connector_output``): started
        there, a producer busy with another request's long prefill marked a finished
        request HELD seconds late (past the decoder's ``hold_grace_s``: the pull failed and
        the decoder recomputed), and a decoder's pulls waited for the other requests'
        forward. Never blocks (``hold`` writes local memory; pulls are issued, not waited)."""
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata,
                                                   DatadistConnectorMetadata):
            self._start_step(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, DatadistConnectorMetadata)
        if self._staging is not None:  # after the forward: where this step wrote KV
            self._staging.begin_step(forward_context)
        self._start_step(meta)  # done at bind already, unless a caller skipped it

    def _start_step(self, meta: DatadistConnectorMetadata) -> None:
        """Once per step: hold the finished requests (mailbox HELD), queue the pulls and
        issue their first transfers, hand the layer-wise requests over. What the decoder's
        poll finds finished here is reported by this step's ``get_finished``."""
        assert self._worker is not None
        if meta is self._started:
            return
        self._started = meta
        step = meta.step
        if step.send:
            if self._staging is not None:  # once their blocks are in host memory
                self._staging.hold(step.send)
            else:
                self._worker.hold(step.send)
        if step.recv:
            self._worker.submit(step.recv)
        if step.lw_recv:
            self._worker.submit_layerwise(step.lw_recv)
        if (step.recv or step.lw_recv) and self._worker.consumer:
            done, failed = self._worker.poll_recv()  # issues the mailbox reads and pulls
            self._early[0].update(done)
            self._early[1].update(failed)
        self._begin_layerwise_step(meta)

    def _begin_layerwise_step(self, meta: DatadistConnectorMetadata) -> None:
        """Hand a step's layer-wise prefill requests to the producer (which announces what
        the step writes), once per step: at the
        first ``save_kv_layer`` (vLLM 0.32 calls ``start_load_kv`` after the forward when no
        load is synchronous), else at ``start_load_kv``."""
        lw = None if self._worker is None else self._worker.lw_producer
        if lw is None or meta is self._lw_meta:
            return
        self._lw_meta = meta
        for rid, ok in meta.step.lw_release:
            lw.release(rid, ok)
            if self._staging is not None:
                self._staging.lw_released(rid)
        for tag in meta.step.lw_refuse:
            lw.refuse(tag)
        lw.step(meta.step.lw_steps if self._staging is None
                else self._staging.lw_step(meta.step.lw_steps))

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Loads are asynchronous in both modes: the request waits, no layer does. A GPU
        # worker's copies to the device are fenced before the request is reported.
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        # Layer-wise prefill: say this layer of the step's requests is written (a record in
        # local memory; the decoder pulls it). A GPU worker says so once the layer is
        # copied to host memory (or, read by NIXL, computed): staging.py.
        if self._worker is None:
            return
        if self._staging is not None:
            self._staging.begin_step(attn_metadata)
        if self._worker.lw_producer is None:
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, DatadistConnectorMetadata)
        self._begin_layerwise_step(meta)
        if meta.step.lw_steps:
            layer = self._layer_index[layer_name]
            if self._staging is not None:
                layer = self._staging.save_layer(layer)
            if layer >= 0:
                self._worker.lw_producer.save_layer(layer)

    def wait_for_save(self) -> None:
        lw = None if self._worker is None else self._worker.lw_producer
        if self._staging is not None:  # the step's copies to host memory (staging.py)
            last = self._staging.wait_for_save()
            if lw is not None and last >= 0:
                lw.save_layer(last)
        if lw is not None:
            lw.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None,
                                                                 set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._worker is not None
        sent = self._worker.poll_sent() if self._worker.producer else set()
        recv, failed = self._worker.poll_recv() if self._worker.consumer else (set(), set())
        if self._early[0] or self._early[1]:
            recv, failed = recv | self._early[0] | self._early[1], failed | self._early[1]
            self._early = (set(), set())
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        # Nothing else runs in this engine: rather than end the step and learn of the
        # transfer's end one empty step (a 1 ms sleep and two process hops) later, wait here
        # for it, a bounded time (docs/vllm.md, "Speed").
        if (not recv and self._worker.consumer and self.settings.idle_wait_ms > 0
                and isinstance(meta, DatadistConnectorMetadata) and meta.step.idle
                and self._worker.wait_recv(self.settings.idle_wait_ms / 1e3)):
            recv, failed = self._worker.poll_recv()
        if recv and self._staging is not None:  # the next forward runs after their copies
            self._staging.fence()
        if self._trace:
            for rid in recv:
                _trace(rid, "reported")
        return KVConnectorTransferResults(finished_sending=sent, finished_recving=recv,
                                          failed_recving=failed)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()

    def _pulled(self, task: Any) -> None:
        """A request's KV has landed (pull mode: a RecvTask; layer-wise: every layer): the
        subclass hook, then a GPU worker's copies to the device (fenced in
        ``get_transfer_results``)."""
        self._on_pulled(task)
        if self._staging is not None:
            self._staging.received(list(task.local_block_ids),
                                   every_layer=isinstance(task, RecvTask))

    def _on_pulled(self, task: RecvTask) -> None:
        """Called from the worker's thread (``get_finished``, or the step's start at
        ``bind_connector_metadata``) after a request's blocks arrived in
        ``task.local_block_ids``, before vLLM is told. A hook for subclasses (the tests
        corrupt the KV here); traces the pull's end."""
        if self._trace:
            _trace(task.request_id, "pulled")

    @property
    def worker(self) -> DatadistWorker | None:
        """The worker-side datadist endpoint (None in the scheduler's instance)."""
        return self._worker
