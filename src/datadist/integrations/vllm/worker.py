"""Worker side of the datadist connector: registers vLLM's KV cache with datadist, holds
finished requests' blocks for decoders (producer), and pulls them (consumer). No vLLM here.

Who calls what (connector.py, from vLLM's worker process):

- ``start(layout)`` once, from ``register_kv_caches``: creates this process's LLMDataDist,
  registers the KV cache as one blocks cache and the mailbox (mailbox.py), and starts the
  puller thread on a consumer. Blocks up to the link timeout at most (it links nothing).
- ``hold`` / ``poll_sent`` on a producer and ``submit`` / ``poll_recv`` on a consumer, once per
  engine step from the worker's main thread. None of them blocks: pulls run on the puller
  thread, which bounds each one by ``sync_kv_timeout_ms`` and each link by ``link_timeout_ms``.
- ``close()`` at shutdown.

Only datadist's public API is used (``import datadist as llm_datadist``), plus its documented
``listen_address`` extra to learn the port when the producer listens on port 0.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

import datadist as llm_datadist
from datadist.integrations.vllm import mailbox
from datadist.integrations.vllm.scheduler import RecvTask, SendTask
from datadist.integrations.vllm.settings import (
    KV_MODEL_ID,
    LOGGER_NAME,
    MAILBOX_MODEL_ID,
    Settings,
    WorkerAddress,
)
from datadist.transport.address import format_host_port

logger = logging.getLogger(LOGGER_NAME)

_OUTBOX_SLOTS = 2  # a consumer's local records: 0 = what it pushes, 1 = what it reads


class PullError(Exception):
    """One request's pull failed; the message says why (the request is reported failed)."""


@dataclass(frozen=True)
class KvLayout:
    """vLLM's KV cache as datadist sees it: ``len(addrs)`` tensors of ``num_blocks`` blocks
    each, every block ``block_shape`` elements of ``dtype``, contiguous; tensor ``t`` belongs
    to layer ``t // tensors_per_layer``."""

    addrs: list[int]
    num_blocks: int
    block_shape: tuple[int, ...]
    dtype: llm_datadist.DataType
    tensors_per_layer: int

    @property
    def num_layers(self) -> int:
        return len(self.addrs) // self.tensors_per_layer


@dataclass
class WorkerStats:
    """Counters a deployment (or a test) reads to see what moved over datadist."""

    requests_pulled: int = 0
    blocks_pulled: int = 0
    bytes_pulled: int = 0
    pull_failures: int = 0
    sent_notified: int = 0
    sent_expired: int = 0
    pull_seconds: list[float] = field(default_factory=list)


class DatadistWorker:
    """One vLLM worker's datadist endpoint (one per process: LLMDataDist is a singleton)."""

    def __init__(self, settings: Settings, *, producer: bool, consumer: bool, rank: int = 0,
                 on_pulled: Callable[[RecvTask], None] | None = None) -> None:
        self.settings = settings
        self.producer = producer
        self.consumer = consumer
        self.rank = rank
        self.on_pulled = on_pulled
        self.cluster_id = secrets.randbits(63) or 1
        self.stats = WorkerStats()
        self._dd: llm_datadist.LLMDataDist | None = None
        self._kv: llm_datadist.Cache | None = None
        self._outbox_cache: llm_datadist.Cache | None = None
        self._layout: KvLayout | None = None
        self._mailbox = mailbox.Mailbox(settings.mailbox_slots)
        self._outbox = mailbox.Mailbox(_OUTBOX_SLOTS)
        self._held: dict[str, tuple[int, bytes, float]] = {}
        self._links: dict[int, llm_datadist.LLMClusterInfo] = {}
        self._tasks: queue.Queue[RecvTask | None] = queue.Queue()
        self._lock = threading.Lock()
        self._done: set[str] = set()
        self._failed: set[str] = set()
        self._inflight = 0
        self._thread: threading.Thread | None = None
        self.address: WorkerAddress | None = None

    def __repr__(self) -> str:
        state = "started" if self._dd is not None else "not started"
        return (f"<DatadistWorker cluster_id={self.cluster_id} rank={self.rank} {state} "
                f"held={len(self._held)} pulled={self.stats.requests_pulled}>")

    # ------------------------------------------------------------------ setup

    def start(self, layout: KvLayout) -> None:
        """Create the LLMDataDist, register the KV cache and mailbox; start pulling."""
        if self._dd is not None:
            raise RuntimeError("DatadistWorker already started")
        cfg = llm_datadist.LLMConfig()
        cfg.device_id = 0
        cfg.local_comm_res = ""  # cache-manager mode, one-sided links
        cfg.sync_kv_timeout = self.settings.sync_kv_timeout_ms
        if self.producer:
            port = self.settings.port + self.rank if self.settings.port else 0
            cfg.listen_ip_info = format_host_port(self.settings.host, port)
        role = (llm_datadist.LLMRole.MIX if self.producer and self.consumer else
                llm_datadist.LLMRole.PROMPT if self.producer else llm_datadist.LLMRole.DECODER)
        dd = llm_datadist.LLMDataDist(role, self.cluster_id)
        dd.init(cfg.generate_options())
        self._dd = dd
        try:
            cm = dd.cache_manager
            desc = llm_datadist.CacheDesc(len(layout.addrs),
                                          [layout.num_blocks, *layout.block_shape], layout.dtype)
            self._kv = cm.register_blocks_cache(
                desc, list(layout.addrs), llm_datadist.BlocksCacheKey(self.cluster_id,
                                                                      KV_MODEL_ID))
            if self.producer:  # decoders read and write it by key
                cm.register_blocks_cache(
                    self._box_desc(self._mailbox), [self._mailbox.buf.ctypes.data],
                    llm_datadist.BlocksCacheKey(self.cluster_id, MAILBOX_MODEL_ID))
            if self.consumer:  # local only: where slot reads land and DONE records start
                self._outbox_cache = cm.register_blocks_cache(
                    self._box_desc(self._outbox), [self._outbox.buf.ctypes.data])
        except Exception:
            self.close()
            raise
        self._layout = layout
        if self.producer:
            listen = dd.listen_address
            assert listen is not None
            self.address = WorkerAddress(self.settings.host, listen[1], self.cluster_id)
        if self.consumer:
            self._thread = threading.Thread(target=self._pull_loop, daemon=True,
                                            name=f"datadist-puller-{self.rank}")
            self._thread.start()
        logger.info("datadist: worker %d started as cluster %d (%s%s), %d layers x %d blocks "
                    "of %s %s%s", self.rank, self.cluster_id,
                    "producer" if self.producer else "", "+consumer" if self.producer
                    and self.consumer else ("consumer" if self.consumer else ""),
                    layout.num_layers, layout.num_blocks, list(layout.block_shape),
                    layout.dtype.name,
                    f", serving on {self.address.host}:{self.address.port}" if self.address
                    else "")

    @staticmethod
    def _box_desc(box: mailbox.Mailbox) -> llm_datadist.CacheDesc:
        return llm_datadist.CacheDesc(1, list(box.buf.shape), llm_datadist.DataType.DT_UINT8)

    # ------------------------------------------------------------------ producer

    def hold(self, tasks: list[SendTask]) -> None:
        """Keep these finished requests' blocks for a decoder (mark their slots HELD)."""
        deadline = time.monotonic() + self.settings.abort_timeout_s
        for t in tasks:
            tag = bytes.fromhex(t.tag)
            self._mailbox.hold(t.slot, tag)
            self._held[t.request_id] = (t.slot, tag, deadline)

    def poll_sent(self) -> set[str]:
        """Requests whose blocks may be freed now: a decoder pushed DONE, or the abort
        timeout passed. Their slots are cleared first (Rule 1 of mailbox.py)."""
        now = time.monotonic()
        out: set[str] = set()
        for rid, (slot, tag, deadline) in list(self._held.items()):
            if self._mailbox.is_done(slot, tag):
                self.stats.sent_notified += 1
            elif now >= deadline:
                self.stats.sent_expired += 1
                logger.warning("datadist: request %s not pulled within %.1f s; freeing its "
                               "blocks", rid, self.settings.abort_timeout_s)
            else:
                continue
            self._mailbox.clear(slot)
            del self._held[rid]
            out.add(rid)
        return out

    # ------------------------------------------------------------------ consumer

    def submit(self, tasks: list[RecvTask]) -> None:
        """Queue pulls; their outcome shows in ``poll_recv`` of a later step."""
        with self._lock:
            self._inflight += len(tasks)
        for t in tasks:
            self._tasks.put(t)

    @property
    def active(self) -> bool:
        """Whether datadist threads of this process have work now or soon: requests held
        for decoders (whose pulls this process serves) or pulls queued or running."""
        return bool(self._held) or self._inflight > 0

    def poll_recv(self) -> tuple[set[str], set[str]]:
        """(requests finished receiving, the subset that failed) since the last call."""
        with self._lock:
            done, failed = self._done, self._failed
            self._done, self._failed = set(), set()
        return done | failed, failed

    def _pull_loop(self) -> None:
        while True:
            task = self._tasks.get()
            if task is None:
                return
            try:
                self._pull(task)
            except Exception as e:  # noqa: BLE001 - every failure becomes a failed request
                self.stats.pull_failures += 1
                logger.warning("datadist: pull of request %s (prefill request %s) failed: %s",
                               task.request_id, task.remote.request_id, e)
                with self._lock:
                    self._failed.add(task.request_id)
                    self._inflight -= 1
            else:
                with self._lock:
                    self._done.add(task.request_id)
                    self._inflight -= 1

    def _pull(self, task: RecvTask) -> None:
        assert self._dd is not None and self._kv is not None and self._layout is not None
        remote = task.remote
        if self.rank >= len(remote.workers):
            raise PullError(f"prefill instance has {len(remote.workers)} workers, "
                            f"we are rank {self.rank}")
        peer = remote.workers[self.rank]
        tag = bytes.fromhex(remote.tag)
        src = remote.blocks_for(len(task.local_block_ids))
        if not src:
            return
        try:
            self._link(peer)
            self._wait_held(peer, remote.slot, tag)
            t0 = time.perf_counter()
            self._dd.cache_manager.pull_blocks(
                llm_datadist.BlocksCacheKey(peer.cluster_id, KV_MODEL_ID), self._kv,
                src, task.local_block_ids)
            dt = time.perf_counter() - t0
            if self._read_slot(peer, remote.slot) != (tag, mailbox.HELD):
                raise PullError("the prefill instance freed the blocks during the pull")
        except llm_datadist.LLMException as e:
            self._drop_link(peer.cluster_id)
            raise PullError(f"{type(e).__name__}: {e}") from e
        nbytes = len(src) * self._layout.num_layers * self._block_bytes()
        self.stats.requests_pulled += 1
        self.stats.blocks_pulled += len(src)
        self.stats.bytes_pulled += nbytes
        self.stats.pull_seconds.append(dt)
        logger.info("datadist: pulled request %s (prefill request %s): %d blocks, %d bytes "
                    "from cluster %d (%s:%d) in %.2f ms", task.request_id, remote.request_id,
                    len(src), nbytes, peer.cluster_id, peer.host, peer.port, dt * 1e3)
        if self.on_pulled is not None:
            self.on_pulled(task)
        self._notify_done(peer, remote.slot, tag)

    def _block_bytes(self) -> int:
        assert self._layout is not None
        n = int(np.prod(self._layout.block_shape)) * self._layout.tensors_per_layer
        return n * _ITEMSIZE.get(self._layout.dtype, 1)

    def _link(self, peer: WorkerAddress) -> None:
        if peer.cluster_id in self._links:
            return
        assert self._dd is not None
        info = llm_datadist.LLMClusterInfo()
        info.remote_cluster_id = peer.cluster_id
        info.append_local_ip_info("0.0.0.0", 0)
        info.append_remote_ip_info(peer.host, peer.port)
        code, codes = self._dd.link_clusters([info], timeout=self.settings.link_timeout_ms)
        if code != llm_datadist.LLMStatusCode.LLM_SUCCESS:
            raise PullError(f"link to {peer.host}:{peer.port} (cluster {peer.cluster_id}) "
                            f"failed: {codes[0]!s}")
        self._links[peer.cluster_id] = info

    def _drop_link(self, cluster_id: int) -> None:
        info = self._links.pop(cluster_id, None)
        if info is None or self._dd is None:
            return
        try:
            self._dd.unlink_clusters([info], self.settings.link_timeout_ms, force=True)
        except Exception as e:  # noqa: BLE001 - the link is gone either way
            logger.debug("datadist: unlink of cluster %d: %s", cluster_id, e)

    def _read_slot(self, peer: WorkerAddress, slot: int) -> tuple[bytes, int]:
        assert self._dd is not None and self._outbox_cache is not None
        self._outbox.clear(1)
        self._dd.cache_manager.pull_blocks(
            llm_datadist.BlocksCacheKey(peer.cluster_id, MAILBOX_MODEL_ID), self._outbox_cache,
            [slot], [1])
        return mailbox.decode(self._outbox.buf[1])

    def _wait_held(self, peer: WorkerAddress, slot: int, tag: bytes) -> None:
        """Rule 2 of mailbox.py; waits up to ``hold_grace_s`` for the producer's next step."""
        deadline = time.monotonic() + self.settings.hold_grace_s
        while True:
            got_tag, state = self._read_slot(peer, slot)
            if got_tag == tag and state == mailbox.HELD:
                return
            if got_tag == tag or time.monotonic() >= deadline:
                raise PullError("the prefill instance no longer holds the request's blocks "
                                "(freed by its abort timeout, or already pulled)")
            time.sleep(0.01)

    def _notify_done(self, peer: WorkerAddress, slot: int, tag: bytes) -> None:
        """Rule 3: best effort; a lost DONE only delays the producer's free to its timeout."""
        assert self._dd is not None and self._outbox_cache is not None
        self._outbox.buf[0] = mailbox.encode(tag, mailbox.DONE)
        try:
            self._dd.cache_manager.push_blocks(
                llm_datadist.BlocksCacheKey(peer.cluster_id, MAILBOX_MODEL_ID),
                self._outbox_cache, [0], [slot])
        except llm_datadist.LLMException as e:
            logger.warning("datadist: could not tell cluster %d that slot %d was pulled: %s",
                           peer.cluster_id, slot, e)

    # ------------------------------------------------------------------ shutdown

    def close(self) -> None:
        """Stop the puller, unlink, finalize. Idempotent."""
        if self._thread is not None:
            self._tasks.put(None)
            self._thread.join(timeout=self.settings.sync_kv_timeout_ms / 1000 + 5)
            self._thread = None
        dd, self._dd = self._dd, None
        if dd is not None:
            for cid in list(self._links):
                self._links.pop(cid)
            try:
                dd.finalize()
            except Exception as e:  # noqa: BLE001 - shutting down
                logger.debug("datadist: finalize: %s", e)


_ITEMSIZE = {
    llm_datadist.DataType.DT_FLOAT: 4, llm_datadist.DataType.DT_FLOAT16: 2,
    llm_datadist.DataType.DT_BF16: 2, llm_datadist.DataType.DT_INT8: 1,
    llm_datadist.DataType.DT_UINT8: 1,
}
