"""Scheduler-side bookkeeping of the datadist connector, without vLLM.

The vLLM adapter (connector.py) calls these methods from vLLM's scheduler thread, with plain
values taken from vLLM's objects; nothing here blocks or does I/O.

Request flow (NixlConnector's conventions, so routers written for it work unchanged):

- Prefill (producer): the request carries ``kv_transfer_params={"do_remote_decode": True}``.
  When it finishes normally, ``request_finished`` keeps its blocks (delay free), gives it a
  mailbox slot and tag, and returns the parameters the decode request needs
  (``do_remote_prefill=True``, ``remote_block_ids``, ``remote_host``/``remote_port``, and
  datadist's own fields under ``"datadist"``). The worker frees the blocks when the decoder
  says it pulled them, or after ``abort_timeout_s``; ``sent`` then returns the slot.
- Decode (consumer): the request carries those parameters. ``matched_tokens`` says the prompt's
  KV arrives asynchronously, ``after_alloc`` records the local blocks to pull into, and the next
  ``build_meta`` hands the pull to the worker.
"""

from __future__ import annotations

import logging
import secrets
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from datadist.integrations.vllm.layerwise import (
    LayerwiseRecvTask,
    LayerwiseRemote,
    LayerwiseStep,
    is_layerwise,
)
from datadist.integrations.vllm.settings import (
    LOGGER_NAME,
    PARAMS_KEY,
    RemoteRequest,
    Settings,
    WorkerAddress,
)

logger = logging.getLogger(LOGGER_NAME)


@dataclass
class RecvTask:
    """Pull ``remote``'s blocks into ``local_block_ids`` (decode side)."""

    request_id: str
    local_block_ids: list[int]
    remote: RemoteRequest


@dataclass
class SendTask:
    """Hold a finished request's blocks until mailbox ``slot`` says DONE (prefill side)."""

    request_id: str
    slot: int
    tag: str


@dataclass
class StepMeta:
    """What one engine step hands from the scheduler side to the workers. Layer-wise mode
    (layerwise.py): ``lw_recv`` on a decoder; ``lw_steps`` (this step's layer-wise prefill
    requests) and ``lw_release`` (requests vLLM finished: id, finished normally) on a
    prefill instance."""

    recv: list[RecvTask] = field(default_factory=list)
    send: list[SendTask] = field(default_factory=list)
    lw_recv: list[LayerwiseRecvTask] = field(default_factory=list)
    lw_steps: list[LayerwiseStep] = field(default_factory=list)
    lw_release: list[tuple[str, bool]] = field(default_factory=list)
    lw_refuse: list[str] = field(default_factory=list)
    idle: bool = False  # the step scheduled no tokens (the workers may wait for transfers)


@dataclass
class _LwPrefill:
    """A layer-wise request on the prefill side: its tag, prompt, and blocks so far."""

    tag: str
    prompt_len: int
    block_ids: list[int] = field(default_factory=list)
    scheduled: bool = False


class SchedulerSide:
    """Per-engine scheduler state. One instance, used from vLLM's scheduler thread only."""

    def __init__(self, settings: Settings, *, engine_id: str, block_size: int,
                 producer: bool, consumer: bool) -> None:
        self.settings = settings
        self.engine_id = engine_id
        self.block_size = block_size
        self.producer = producer
        self.consumer = consumer
        self.workers: list[WorkerAddress] = []
        self._free_slots: deque[int] = deque(range(settings.mailbox_slots))
        self._slot_of: dict[str, int] = {}
        self._pending = StepMeta()
        self._lw: dict[str, _LwPrefill] = {}

    def set_workers(self, workers: list[WorkerAddress]) -> None:
        """The producer workers' listen addresses, one per tensor-parallel rank in order."""
        self.workers = list(workers)

    # ------------------------------------------------------------------ decode side

    def matched_tokens(self, prompt_len: int, num_computed: int,
                       params: dict[str, Any] | None) -> tuple[int, bool]:
        """``get_num_new_matched_tokens``: (tokens the prefill instance holds beyond
        ``num_computed``, whether they load asynchronously). Side-effect free."""
        if not self.consumer or not params or not params.get("do_remote_prefill"):
            return 0, False
        if is_layerwise(params):
            try:
                lw = LayerwiseRemote.parse(params)
            except ValueError as e:
                logger.warning("datadist: ignoring kv_transfer_params (%s); recomputing", e)
                return 0, False
            if self.settings.mode != "layerwise" or lw.block_size != self.block_size:
                logger.warning("datadist: a layer-wise request (block size %d) on a decoder "
                               "in mode %r, block size %d; recomputing", lw.block_size,
                               self.settings.mode, self.block_size)
                return 0, False
            count = prompt_len - num_computed
            return (count, True) if count > 0 else (0, False)
        try:
            remote = RemoteRequest.parse(params)
        except ValueError as e:
            logger.warning("datadist: ignoring kv_transfer_params (%s); recomputing", e)
            return 0, False
        if remote.block_size != self.block_size:
            logger.warning("datadist: prefill block size %d != ours %d; recomputing",
                           remote.block_size, self.block_size)
            return 0, False
        available = min(remote.num_tokens or prompt_len, prompt_len)
        count = available - num_computed
        return (count, True) if count > 0 else (0, False)

    def after_alloc(self, request_id: str, params: dict[str, Any] | None,
                    local_block_ids: list[int], num_external_tokens: int,
                    prompt_len: int = 0) -> None:
        """``update_state_after_alloc``: queue the pull into the newly allocated blocks; a
        layer-wise prefill request is tracked from here (its steps go to the workers)."""
        if (params and params.get("do_remote_decode") and self.producer
                and self.settings.mode == "layerwise" and is_layerwise(params)
                and params[PARAMS_KEY].get("tag") and request_id not in self._lw):
            self._lw[request_id] = _LwPrefill(str(params[PARAMS_KEY]["tag"]), prompt_len)
            return
        if not params or not params.get("do_remote_prefill"):
            return
        # Once per request: a second call (after the load) must not pull again.
        params["do_remote_prefill"] = False
        if num_external_tokens <= 0:
            return
        if is_layerwise(params):
            self._pending.lw_recv.append(LayerwiseRecvTask(
                request_id, list(local_block_ids), LayerwiseRemote.parse(params)))
            return
        remote = RemoteRequest.parse(params)
        self._pending.recv.append(RecvTask(request_id, list(local_block_ids), remote))

    # ------------------------------------------------------------------ prefill side

    def finished(self, request_id: str, params: dict[str, Any] | None, *, finished_ok: bool,
                 block_ids: list[int],
                 num_computed_tokens: int) -> tuple[bool, dict[str, Any] | None]:
        """``request_finished``: (keep the blocks for a decoder?, parameters for it)."""
        if not params or not params.get("do_remote_decode") or not self.producer:
            return False, None
        if self.settings.mode == "layerwise" and is_layerwise(params):
            return self._finished_layerwise(request_id, finished_ok)
        if not finished_ok or not block_ids:
            return False, None  # aborted or nothing computed: nobody will pull
        if not self.workers:
            logger.warning("datadist: no producer worker address known; request %s will "
                           "be recomputed by the decoder", request_id)
            return False, None
        if not self._free_slots:
            logger.warning("datadist: all %d mailbox slots are held; request %s will be "
                           "recomputed by the decoder", self.settings.mailbox_slots, request_id)
            return False, None
        slot = self._free_slots.popleft()
        tag = secrets.token_hex(16)
        self._slot_of[request_id] = slot
        self._pending.send.append(SendTask(request_id, slot, tag))
        first = self.workers[0]
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": list(block_ids),
            "remote_engine_id": self.engine_id,
            "remote_request_id": request_id,
            "remote_host": first.host,
            "remote_port": first.port,
            "remote_num_tokens": num_computed_tokens,
            "tp_size": len(self.workers),
            PARAMS_KEY: {
                "workers": [[w.host, w.port, w.cluster_id] for w in self.workers],
                "block_size": self.block_size,
                "slot": slot,
                "tag": tag,
            },
        }

    def _finished_layerwise(self, request_id: str,
                            finished_ok: bool) -> tuple[bool, dict[str, Any] | None]:
        """A layer-wise prefill request ended: keep its blocks until its decoder pulled them.
        Every answer names this instance's workers (a router learns them from any layer-wise
        answer, e.g. one without a tag)."""
        lw = self._lw.pop(request_id, None)
        out = {PARAMS_KEY: {"mode": "layerwise", "block_size": self.block_size,
                            "workers": [[w.host, w.port, w.cluster_id]
                                        for w in self.workers]}}
        if lw is None:
            return False, out
        if not lw.scheduled:  # ended before its first step: refuse the decoder
            self._pending.lw_refuse.append(lw.tag)
            return False, out
        self._pending.lw_release.append((request_id, finished_ok))
        return True, out

    def scheduled(self, new: Iterable[tuple[str, list[int], int]],
                  cached: Iterable[tuple[str, list[int] | None, int, bool]],
                  num_scheduled: dict[str, int]) -> None:
        """This step's requests (``build_connector_meta``): (id, blocks, computed tokens) of
        new ones, (id, blocks added, computed tokens, resumed: the blocks are all of them)
        of the others. Queues the layer-wise prefill requests' steps."""
        if not self._lw:
            return
        for rid, blocks, computed, is_new in [*((r, b, c, True) for r, b, c in new),
                                              *((r, b, c, res) for r, b, c, res in cached)]:
            lw = self._lw.get(rid)
            if lw is None:
                continue
            if is_new:
                lw.block_ids = list(blocks or [])
            elif blocks:
                lw.block_ids.extend(blocks)
            n = num_scheduled.get(rid, 0)
            if n <= 0 or computed >= lw.prompt_len:
                continue
            lw.scheduled = True
            self._pending.lw_steps.append(LayerwiseStep(
                rid, lw.tag, list(lw.block_ids), computed, n, lw.prompt_len,
                self.block_size))

    def sent(self, request_ids: Iterable[str]) -> None:
        """Workers freed these requests' blocks (``finished_sending``): reuse their slots."""
        for rid in request_ids:
            slot = self._slot_of.pop(rid, None)
            if slot is not None:
                self._free_slots.append(slot)

    @property
    def held(self) -> int:
        """Requests whose blocks a producer worker still holds."""
        return len(self._slot_of)

    # ------------------------------------------------------------------ each step

    def build_meta(self) -> StepMeta:
        """``build_connector_meta``: the work queued since the last step (then forgotten)."""
        meta, self._pending = self._pending, StepMeta()
        return meta
