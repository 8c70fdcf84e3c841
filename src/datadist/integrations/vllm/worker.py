"""Worker side of the datadist connector: registers vLLM's KV cache with datadist, holds
finished requests' blocks for decoders (producer), and pulls them (consumer). No vLLM here.

Who calls what (connector.py, from vLLM's worker process):

- ``start(layout)`` once, from ``register_kv_caches``: creates this process's LLMDataDist,
  registers the KV cache as one blocks cache and the mailbox (mailbox.py). A consumer with
  ``prefill_workers`` starts linking to them there, each in a thread of its own (``_Linker.
  prelink``): start-up neither waits for nor fails on them.
- ``hold`` / ``poll_sent`` on a producer and ``submit`` / ``poll_recv`` on a consumer, once per
  engine step from the worker's main thread. A consumer's pulls are issued transfers
  (``pull_blocks_async``, NIXL's post-then-check): ``poll_recv`` checks their handles and
  issues each request's next transfer (mailbox read, KV pull, mailbox read, DONE push), so no
  thread of ours waits on a transfer. Each transfer is bounded by ``sync_kv_timeout_ms``.
  Links to producers are made off the engine's step: at the first sight of a producer's
  address (``submit``), a linker thread links to it (``_Linker``, bounded by
  ``link_timeout_ms``) while the step goes on; that producer's requests wait, without blocking
  anything, until the link is up (or fail when it cannot be made). No step ever blocks.
- Layer-wise mode (``settings.mode == "layerwise"``): ``lw_producer`` / ``lw_consumer``
  (layerwise.py): the prefill announces each layer it saved, the decoder pulls it;
  ``submit_layerwise`` queues a decoder's requests, ``poll_sent`` / ``poll_recv`` report
  them with the pulls'.
- ``wait_recv`` on a step that scheduled nothing: waits, bounded, for a transfer in flight.
- ``close()`` at shutdown.

Only datadist's public API is used (``import datadist as llm_datadist``), plus its documented
``listen_address`` extra to learn the port when the producer listens on port 0, and its
``engine`` (``get_link``: a link's path; ``link(..., as_announced=True)``: a pre-link to an
address whose cluster id the decoder learns from the producer), and ``set_thread_cpus``
(``transfer_cpus``: its threads off the compute thread's one pinned core).
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

import datadist as llm_datadist
from datadist.core.address import format_host_port, parse_host_port
from datadist.integrations.vllm import mailbox
from datadist.integrations.vllm.scheduler import RecvTask, SendTask
from datadist.integrations.vllm.settings import (
    KV_MODEL_ID,
    LOGGER_NAME,
    MAILBOX_MODEL_ID,
    Settings,
    WorkerAddress,
)

if TYPE_CHECKING:
    from datadist.api.cache_manager import CacheManager
    from datadist.integrations.vllm.layerwise import (
        LayerwiseConsumer,
        LayerwiseProducer,
        LayerwiseRecvTask,
    )

logger = logging.getLogger(LOGGER_NAME)

# Requests a consumer pulls at once; more wait their turn. Each has two local records in the
# outbox: where its mailbox reads land, and the DONE it pushes.
MAX_PULLS = 64
_OUTBOX_SLOTS = 2 * MAX_PULLS
# How often an idle step's wait reads a layer-wise prefill's record (wait_recv).
LW_POLL_S = 0.001
# Link failures: a request failing with one of these drops the link (the next relinks).
_LINK_CODES = frozenset({
    llm_datadist.LLMStatusCode.LLM_LINK_FAILED, llm_datadist.LLMStatusCode.LLM_TIMEOUT,
    llm_datadist.LLMStatusCode.LLM_NOT_YET_LINK,
    llm_datadist.LLMStatusCode.LLM_SUSPECT_REMOTE_ERROR})


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


class _Step(enum.Enum):
    """Where one request's pull is (Rules 2 and 3 of mailbox.py, in order)."""

    LINK = "link to the prefill worker"
    CHECK_BEFORE = "mailbox read before the pull"
    PULL = "KV pull"
    CHECK_AFTER = "mailbox read after the pull"
    NOTIFY = "DONE push"


@dataclass
class _Pull:
    """One request being pulled: its step, the handle of its transfer in flight (None while
    it waits to retry a mailbox read), its two outbox records."""

    task: RecvTask
    peer: WorkerAddress
    tag: bytes
    src: list[int]
    record: int  # outbox record for its mailbox reads; record + 1 for its DONE
    grace: float  # Rule 2's deadline for the producer's HELD
    step: _Step = _Step.LINK
    handle: llm_datadist.TransferHandle | None = None
    retry_at: float = 0.0
    t0: float = 0.0
    seconds: float = 0.0
    failed: bool = False
    reported: bool = False  # in poll_recv's answer already


#: A pre-link refused (its producer not listening yet) is tried again this often.
_PRELINK_RETRY_S = 0.25


class _Linker:
    """Links to producers off the engine's step (no first-request stall). ``want`` starts
    linking to a producer in a thread of its own and returns at once; ``state`` says whether
    the link is up, still being made, or failed (with the reason). One thread per producer
    being linked, ended when its link is made or refused: a process linked to every producer
    it pulls from holds none.

    Who calls: the worker's main thread (``submit``, ``poll_recv``); the linker threads only
    call ``link_clusters``, which releases the GIL while it waits (bounded by
    ``link_timeout_ms``)."""

    UP = "up"
    PENDING = "pending"

    def __init__(self, dd: llm_datadist.LLMDataDist, timeout_ms: int,
                 path: str | None = None,
                 warm: Callable[[int], None] | None = None) -> None:
        self._dd = dd
        # Called (cluster id) in a pre-link's thread once its link is filed (requests that
        # waited for the pre-link go on meanwhile): the first transfers' one-time costs paid
        # there, not by them (DatadistWorker._warm).
        self._warm = warm
        self._timeout_ms = timeout_ms
        self._path = path  # the transfer path a link must have (None: any)
        self._lock = threading.Lock()
        self._links: dict[int, llm_datadist.LLMClusterInfo] = {}
        self._pending: dict[int, threading.Thread] = {}
        self._failed: dict[int, Exception] = {}
        self._closed = False
        self.seconds: dict[int, float] = {}  # how long each link took (logs, tests)
        # Pre-links (``prelink``) under way, by address: the peers whose requests wait on each.
        self._prelinking: dict[tuple[str, int], list[WorkerAddress]] = {}
        self._prelink_threads: dict[tuple[str, int], threading.Thread] = {}
        self.prelinked: dict[tuple[str, int], int] = {}  # address -> cluster id (logs, tests)

    def prelink(self, host: str, port: int) -> None:
        """Start linking to the producer listening at host:port before any request names it
        (``prefill_workers``), in a thread of its own; the link is filed under the cluster
        id the producer announces. Never blocks; a failure is logged, and the first request
        that names the producer links again (``want``)."""
        addr = (host, port)
        with self._lock:
            if self._closed or addr in self._prelinking:
                return
            t = threading.Thread(target=self._prelink, args=addr, daemon=True,
                                 name=f"datadist-prelink-{port}")
            self._prelinking[addr] = []
            self._prelink_threads[addr] = t
        t.start()

    def _prelink(self, host: str, port: int) -> None:
        t0 = time.perf_counter()
        deadline = time.monotonic() + self._timeout_ms / 1e3
        cid = 0
        err: Exception | None = None
        try:
            # A placeholder id of our own (the core serialises links made under one id); the
            # link is filed under the id the producer announces. A producer still starting
            # (nothing listens yet) is tried again until the link timeout.
            while True:
                try:
                    got = self._dd.engine.link(secrets.randbits(62) | 1, host, port,
                                               max(0.001, deadline - time.monotonic()),
                                               as_announced=True)
                    break
                except Exception:
                    if self._closed or time.monotonic() + _PRELINK_RETRY_S >= deadline:
                        raise
                    time.sleep(_PRELINK_RETRY_S)
            cid = got.cluster_id
            if self._path is not None and got.path_name != self._path:
                err = PullError(f"link to {host}:{port} uses {got.path_name}, not "
                                f"{self._path} ({got.reason})")
                with contextlib.suppress(Exception):
                    self._dd.engine.unlink(cid, self._timeout_ms / 1e3, force=True)
        except Exception as e:  # noqa: BLE001 - logged; the first request links again
            err = e
        info = llm_datadist.LLMClusterInfo()
        try:
            info.remote_cluster_id = cid
            info.append_local_ip_info("0.0.0.0", 0)
            info.append_remote_ip_info(host, port)
        except Exception as e:  # noqa: BLE001 - settings.py checked the address; never stuck
            err = err or e
        seconds = time.perf_counter() - t0
        with self._lock:
            waiters = self._prelinking.pop((host, port), [])
            self._prelink_threads.pop((host, port), None)
            for w in waiters:
                self._pending.pop(w.cluster_id, None)
            if err is None and not self._closed:
                self._links[cid] = info
                self.seconds[cid] = seconds
                self.prelinked[(host, port)] = cid
        if err is None:
            logger.info("datadist: pre-linked to cluster %d (%s:%d) in %.2f ms, before any "
                        "request", cid, host, port, seconds * 1e3)
        else:
            logger.warning("datadist: pre-link to %s:%d failed (%s); the first request from it "
                           "links again", host, port, err)
        for w in waiters:  # requests that named another id, or a failed pre-link: link now
            if w.cluster_id != cid or err is not None:
                self.want(w)
        # Warmed once the link is filed: a request that waited for the pre-link goes on at
        # once and never waits for the warm-up (a slow producer's reads included).
        if err is None and self._warm is not None and not self._closed:
            try:
                self._warm(cid)
            except Exception as e:  # noqa: BLE001 - the first request pays it instead
                logger.info("datadist: warm-up of cluster %d: %s", cid, e)

    def want(self, peer: WorkerAddress) -> None:
        """Start linking to ``peer`` unless linked or being linked (a pre-link to its
        address included: the request waits for that one). Never blocks."""
        with self._lock:
            cid = peer.cluster_id
            if self._closed or cid in self._links or cid in self._pending:
                return
            self._failed.pop(cid, None)  # a new request retries a link that failed
            waiters = self._prelinking.get((peer.host, peer.port))
            if waiters is not None:
                waiters.append(peer)
                self._pending[cid] = self._prelink_threads[(peer.host, peer.port)]
                return
            t = threading.Thread(target=self._link, args=(peer,), daemon=True,
                                 name=f"datadist-link-{cid}")
            self._pending[cid] = t
        t.start()

    def state(self, cluster_id: int) -> str | Exception | None:
        """UP, PENDING, the exception that failed the last try (until ``want`` tries
        again), or None: never asked for, or dropped."""
        with self._lock:
            if cluster_id in self._links:
                return self.UP
            if cluster_id in self._pending:
                return self.PENDING
            return self._failed.get(cluster_id)

    def _link(self, peer: WorkerAddress) -> None:
        info = llm_datadist.LLMClusterInfo()
        info.remote_cluster_id = peer.cluster_id
        info.append_local_ip_info("0.0.0.0", 0)
        info.append_remote_ip_info(peer.host, peer.port)
        t0 = time.perf_counter()
        err: Exception | None = None
        try:
            code, codes = self._dd.link_clusters([info], timeout=self._timeout_ms)
            # ALREADY_LINK: a pre-link to the same worker under another spelling of its
            # address ("localhost" / "127.0.0.1") made it first: the link is up.
            if code != llm_datadist.LLMStatusCode.LLM_SUCCESS and \
                    codes[0] != llm_datadist.LLMStatusCode.LLM_ALREADY_LINK:
                err = PullError(f"link to {peer.host}:{peer.port} (cluster "
                                f"{peer.cluster_id}) failed: {codes[0]!s}")
        except Exception as e:  # noqa: BLE001 - reported to the requests that wait on it
            err = PullError(f"link to {peer.host}:{peer.port} (cluster {peer.cluster_id}) "
                            f"failed: {e}")
        if err is None and self._path is not None:  # e.g. GPU memory: NIXL only (staging.py)
            got = self._dd.engine.get_link(peer.cluster_id)
            if got.path_name != self._path:
                err = PullError(f"link to {peer.host}:{peer.port} uses {got.path_name}, not "
                                f"{self._path} ({got.reason}); kv_buffer_device 'cuda' "
                                "needs NIXL on both instances")
                with contextlib.suppress(Exception):
                    self._dd.unlink_clusters([info], self._timeout_ms, force=True)
        seconds = time.perf_counter() - t0
        with self._lock:
            self._pending.pop(peer.cluster_id, None)
            if err is not None:
                self._failed[peer.cluster_id] = err
            elif not self._closed:
                self._links[peer.cluster_id] = info
                self.seconds[peer.cluster_id] = seconds
        if err is None:
            logger.info("datadist: linked to cluster %d (%s:%d) in %.2f ms, off the engine's "
                        "step", peer.cluster_id, peer.host, peer.port, seconds * 1e3)

    def drop(self, cluster_id: int) -> llm_datadist.LLMClusterInfo | None:
        """Forget the link (the caller unlinks it); the next ``want`` links again."""
        with self._lock:
            return self._links.pop(cluster_id, None)

    def close(self, wait_s: float) -> None:
        """No more links; waits up to ``wait_s`` for links being made."""
        with self._lock:
            self._closed = True
            threads = list({*self._pending.values(), *self._prelink_threads.values()})
            self._links.clear()
        deadline = time.monotonic() + wait_s
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))


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
        # Called (request id, event) as a pull passes its stages: "linked" (its producer's
        # link is up and its first mailbox read issued), "held" (the mailbox said HELD and
        # the KV pull is issued). The connector's trace; from the worker's thread.
        self.on_event: Callable[[str, str], None] | None = None
        self.cluster_id = secrets.randbits(63) or 1
        self.stats = WorkerStats()
        self._dd: llm_datadist.LLMDataDist | None = None
        self._kv: llm_datadist.Cache | None = None
        self._outbox_cache: llm_datadist.Cache | None = None
        self._layout: KvLayout | None = None
        self._mailbox = mailbox.Mailbox(settings.mailbox_slots)
        self._outbox = mailbox.Mailbox(_OUTBOX_SLOTS)
        self._held: dict[str, tuple[int, bytes, float]] = {}
        self._linker: _Linker | None = None
        # Pre-links' warm-up sinks (``_register_scratch``): a mailbox record, a KV block.
        self._scratch_box: mailbox.Mailbox | None = None
        self._scratch_kv: np.ndarray | None = None
        self._scratch_caches: tuple[llm_datadist.Cache, llm_datadist.Cache] | None = None
        self._waiting: list[RecvTask] = []  # submitted, not yet started (MAX_PULLS)
        self._pulls: list[_Pull] = []  # started: each with a transfer in flight or retrying
        self._free_records = list(range(0, _OUTBOX_SLOTS, 2))
        self._done: set[str] = set()
        self._failed: set[str] = set()
        self.address: WorkerAddress | None = None
        # Layer-wise mode (settings.mode == "layerwise", layerwise.py); None in pull mode.
        self.lw_producer: LayerwiseProducer | None = None
        self.lw_consumer: LayerwiseConsumer | None = None
        # GPU workers (staging.py): LLMConfig extras set before init, and the path every
        # link must have.
        self.options: dict[str, object] = {}
        self.link_path: str | None = None

    def __repr__(self) -> str:
        state = "started" if self._dd is not None else "not started"
        return (f"<DatadistWorker cluster_id={self.cluster_id} rank={self.rank} {state} "
                f"held={len(self._held)} pulled={self.stats.requests_pulled}>")

    # ------------------------------------------------------------------ setup

    def start(self, layout: KvLayout) -> None:
        """Create the LLMDataDist, register the KV cache and mailbox."""
        if self._dd is not None:
            raise RuntimeError("DatadistWorker already started")
        cfg = llm_datadist.LLMConfig()
        cfg.device_id = 0
        cfg.local_comm_res = ""  # cache-manager mode, one-sided links
        cfg.sync_kv_timeout = self.settings.sync_kv_timeout_ms
        for name, value in self.options.items():
            setattr(cfg, name, value)
        if self.producer:
            port = self.settings.port + self.rank if self.settings.port else 0
            cfg.listen_ip_info = format_host_port(self.settings.host, port)
        role = (llm_datadist.LLMRole.MIX if self.producer and self.consumer
                else llm_datadist.LLMRole.PROMPT if self.producer
                else llm_datadist.LLMRole.DECODER)
        transfer_cpus = self.settings.thread_cpus()  # before the core starts a thread
        if transfer_cpus is not None:
            llm_datadist.set_thread_cpus(transfer_cpus)
        dd = llm_datadist.LLMDataDist(role, self.cluster_id)
        options = cfg.generate_options()
        dd.init(options)
        self._dd = dd
        self._linker = _Linker(dd, self.settings.link_timeout_ms, self.link_path,
                               self._warm if self.link_path is None else None)
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
                if self.settings.prefill_workers and self.link_path is None:
                    self._register_scratch(cm, layout)
        except Exception:
            self.close()
            raise
        self._layout = layout
        if self.settings.mode == "layerwise":
            from datadist.integrations.vllm.layerwise import (
                LayerwiseConsumer,
                LayerwiseProducer,
            )

            try:
                if self.producer:
                    self.lw_producer = LayerwiseProducer(dd, layout.num_layers, self.settings,
                                                         self.cluster_id)
                if self.consumer:
                    assert self._kv is not None
                    self.lw_consumer = LayerwiseConsumer(
                        dd, self._kv, layout.tensors_per_layer, layout.num_layers,
                        self.settings, self._linker, MAX_PULLS, self._received,
                        self._push_failed)
            except Exception:
                self.close()
                raise
        if self.producer:
            listen = dd.listen_address
            assert listen is not None
            self.address = WorkerAddress(self.settings.host, listen[1], self.cluster_id)
        if self.consumer:  # prefill_workers: link now, so no first request waits for it
            for text in self.settings.prefill_workers:
                host, port = parse_host_port(text)
                self._linker.prelink(host, port + self.rank)
        logger.info("datadist: worker %d started as cluster %d (%s%s), %d layers x %d blocks "
                    "of %s %s%s; CPUs %s, its transfer threads' %s", self.rank, self.cluster_id,
                    "producer" if self.producer else "", "+consumer" if self.producer
                    and self.consumer else ("consumer" if self.consumer else ""),
                    layout.num_layers, layout.num_blocks, list(layout.block_shape),
                    layout.dtype.name,
                    f", serving on {self.address.host}:{self.address.port}" if self.address
                    else "", _cpus(), _cpus(transfer_cpus) if transfer_cpus else "the same")

    def _register_scratch(self, cm: CacheManager, layout: KvLayout) -> None:
        """Local sinks of a pre-link's warm-up reads (``_warm``): one mailbox record and one
        block of every KV tensor, so the warm-up writes nothing vLLM's blocks hold."""
        per = int(np.prod(layout.block_shape)) * _ITEMSIZE.get(layout.dtype, 1)
        self._scratch_box = mailbox.Mailbox(1)
        self._scratch_kv = np.zeros(per * len(layout.addrs), np.uint8)
        base = self._scratch_kv.ctypes.data
        self._scratch_caches = (
            cm.register_blocks_cache(self._box_desc(self._scratch_box),
                                     [self._scratch_box.buf.ctypes.data]),
            cm.register_blocks_cache(
                llm_datadist.CacheDesc(len(layout.addrs), [1, *layout.block_shape],
                                       layout.dtype),
                [base + i * per for i in range(len(layout.addrs))]))

    def _warm(self, cluster_id: int) -> None:
        """A pre-link's thread, its link just made: read one mailbox record and one KV block
        of the producer into the scratch caches (issued as the requests' are, waited for:
        each bounded by ``sync_kv_timeout_ms``, GIL released), so its first request's
        mailbox read and KV pull find the producer's caches leased (a same-host link asks
        the owner once per cache, then copies directly) and the transfer path used once.
        Reads only: the producer's state is unchanged; errors go to the caller (logged)."""
        dd, caches = self._dd, self._scratch_caches
        if dd is None or caches is None:
            return
        cm = dd.cache_manager
        wait_s = self.settings.sync_kv_timeout_ms / 1e3
        took = []
        # As the requests issue theirs (pull_blocks_async): the same path warmed, the
        # transfer workers included. The KV block is read twice: the log shows the one-time
        # part of the first.
        for key, cache in ((MAILBOX_MODEL_ID, caches[0]), (KV_MODEL_ID, caches[1]),
                           (KV_MODEL_ID, caches[1])):
            t0 = time.perf_counter()
            # wait raises (TimeoutError, LLMException): the warm-up stops at the first failure
            cm.pull_blocks_async(llm_datadist.BlocksCacheKey(cluster_id, key), cache, [0],
                                 [0]).wait(wait_s)
            took.append((time.perf_counter() - t0) * 1e3)
        logger.info("datadist: warmed the link to cluster %d: a mailbox record read in %.2f ms, "
                    "a KV block in %.2f ms (again: %.2f ms)", cluster_id, *took)

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
        timeout passed. Their slots are cleared first (Rule 1 of mailbox.py). Layer-wise:
        every push of the request ended (or failed) and vLLM finished it."""
        now = time.monotonic()
        out: set[str] = set() if self.lw_producer is None else self.lw_producer.poll()
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

    @property
    def engine(self) -> object:
        """This process's datadist engine (tests and tools read its links); None before
        ``start``."""
        return None if self._dd is None else self._dd.engine

    def submit_layerwise(self, tasks: list[LayerwiseRecvTask]) -> None:
        """Queue layer-wise receives (decode side); their outcome shows in ``poll_recv``.
        Never blocks; a task in pull mode fails in the next ``poll_recv``."""
        if self.lw_consumer is None:
            self._failed.update(t.request_id for t in tasks)
            logger.warning("datadist: layer-wise requests %s refused: this decoder runs in "
                           "mode %r", [t.request_id for t in tasks], self.settings.mode)
            return
        self.lw_consumer.submit(tasks, self.rank)

    def _received(self, task: LayerwiseRecvTask, seconds: float, cluster_id: int,
                  pulls: int) -> None:
        """A layer-wise request's every layer landed: count it and run the hook."""
        assert self._layout is not None
        n = len(task.local_block_ids)
        nbytes = n * self._layout.num_layers * self._block_bytes()
        self.stats.requests_pulled += 1
        self.stats.blocks_pulled += n
        self.stats.bytes_pulled += nbytes
        self.stats.pull_seconds.append(seconds)
        # The wall clock, so a bench can set it against the prefill's log (one host).
        logger.info("datadist: received request %s layer by layer (%s): %d blocks, %d bytes "
                    "from cluster %d in %d pulls, %.2f ms after its record was first read, "
                    "seen at %.4f", task.request_id, task.remote.request_id, n, nbytes,
                    cluster_id, pulls, seconds * 1e3, time.time())
        if self.on_pulled is not None:
            self.on_pulled(task)  # type: ignore[arg-type]

    def submit(self, tasks: list[RecvTask]) -> None:
        """Queue pulls; their outcome shows in ``poll_recv`` of a later step. Never blocks:
        the transfers are issued by ``poll_recv``; a producer not linked yet starts being
        linked now, off the step (``_Linker``)."""
        self._waiting.extend(tasks)
        if self._linker is not None:
            for t in tasks:
                if self.rank < len(t.remote.workers):
                    self._linker.want(t.remote.workers[self.rank])

    @property
    def active(self) -> bool:
        """Whether datadist has work in this process now or soon: requests held for
        decoders (whose pulls this process serves) or pulls queued or in flight."""
        return (bool(self._held) or bool(self._pulls) or bool(self._waiting)
                or (self.lw_producer is not None and self.lw_producer.active)
                or (self.lw_consumer is not None and self.lw_consumer.active))

    def poll_recv(self) -> tuple[set[str], set[str]]:
        """(requests finished receiving, the subset that failed) since the last call.

        Checks every pull's transfer in flight and issues its next one; starts queued
        requests while fewer than MAX_PULLS run. Never blocks: a request whose producer is
        still being linked waits for the link in a later step."""
        while self._waiting and self._free_records:
            self._begin(self._waiting.pop(0))
        for pull in list(self._pulls):
            # As far as its transfers have ended: a same-host mailbox read of a leased cache
            # ends in the call that issues it, so a request does not wait a step per stage.
            for _ in range(len(_Step) + 1):
                try:
                    moved = self._advance(pull)
                except Exception as e:  # noqa: BLE001 - every failure becomes a failed request
                    self._fail(pull, e)
                    break
                if not moved or pull not in self._pulls:
                    break
        done, failed = self._done, self._failed
        self._done, self._failed = set(), set()
        if self.lw_consumer is not None:
            lw_done, lw_failed = self.lw_consumer.poll()
            done |= lw_done - lw_failed
            failed |= lw_failed
        return done | failed, failed

    def wait_recv(self, seconds: float) -> bool:
        """Block up to ``seconds`` (GIL released) for one of this worker's KV transfers in
        flight to end, or, layer-wise, for a request to end while following its prefill's
        progress; True if there was one to wait for.

        Layer-wise, the prefill's record is read once per ``LW_POLL_S`` (1 ms), sleeping
        between reads, and each layer written is pulled at once; once the record says every
        layer is written, the wait is on the last pulls' handles. (The record used to be read
        every 0.3 ms: a quarter of a CPU in the decode worker for the whole prefill, on a
        host where the prefill needs that CPU: docs/vllm.md, "The layer-wise prefill's CPU".)
        Who calls: the connector's ``get_transfer_results`` on a step that scheduled
        nothing, before it asks ``poll_recv`` again."""
        deadline = time.monotonic() + seconds
        kv = [p.handle for p in self._pulls
              if p.step is _Step.PULL and p.handle is not None and not p.handle.done()]
        if kv:
            with contextlib.suppress(Exception):  # its failure is poll_recv's to report
                kv[0].wait(seconds)
            return True
        lw = self.lw_consumer
        if lw is None or not lw.active:
            return False
        while not lw.advance():  # follow the prefill's progress, pull what it wrote
            left = deadline - time.monotonic()
            if left <= 0:
                break
            h = lw.finishing()
            if h is not None:  # every layer written: wait for the last pulls themselves
                with contextlib.suppress(Exception):  # advance reports its failure
                    h.wait(left)
            else:
                time.sleep(min(left, LW_POLL_S))
        return True

    def _begin(self, task: RecvTask) -> None:
        """Start one request: once its producer is linked, read its mailbox slot (Rule 2)."""
        remote = task.remote
        record = self._free_records.pop()
        pull = _Pull(task, remote.workers[0], b"", [], record,
                     time.monotonic() + self.settings.hold_grace_s)
        self._pulls.append(pull)
        try:
            if self.rank >= len(remote.workers):
                raise PullError(f"prefill instance has {len(remote.workers)} workers, "
                                f"we are rank {self.rank}")
            pull.peer = remote.workers[self.rank]
            pull.tag = bytes.fromhex(remote.tag)
            pull.src = remote.blocks_for(len(task.local_block_ids))
            if not pull.src:
                self._finish(pull)
                return
            self._linked(pull)
        except Exception as e:  # noqa: BLE001 - every failure becomes a failed request
            self._fail(pull, e)

    def _linked(self, pull: _Pull) -> bool:
        """A request waiting for its producer's link: read its slot once the link is up
        (True); raise the link's failure. Never blocks."""
        assert self._linker is not None
        state = self._linker.state(pull.peer.cluster_id)
        if state is None:  # dropped since (a failed transfer), or never asked for
            self._linker.want(pull.peer)
            return False
        if isinstance(state, Exception):  # a new request's submit tries again
            raise state
        if state != _Linker.UP:
            return False
        pull.step = _Step.CHECK_BEFORE
        if self.on_event is not None:
            self.on_event(pull.task.request_id, "linked")
        self._read_slot(pull)
        return True

    def _advance(self, pull: _Pull) -> bool:
        """Move ``pull`` one step on if its transfer has ended (True: it moved); never
        blocks."""
        if pull.step is _Step.LINK:
            return self._linked(pull)
        if pull.handle is None:  # waiting to read the mailbox again
            if time.monotonic() < pull.retry_at:
                return False
            self._read_slot(pull)
            return True
        if not pull.handle.done():
            return False
        handle, pull.handle = pull.handle, None
        if pull.step is _Step.NOTIFY:  # Rule 3: best effort
            if handle.exception() is not None:
                logger.warning("datadist: could not tell cluster %d that slot %d was pulled: "
                               "%s", pull.peer.cluster_id, pull.task.remote.slot,
                               handle.exception())
            self._finish(pull)
            return True
        handle.wait(0)  # raises the transfer's LLMException
        if pull.step is _Step.CHECK_BEFORE:
            got_tag, state = mailbox.decode(self._outbox.buf[pull.record])
            if got_tag == pull.tag and state == mailbox.HELD:
                if self.on_event is not None:
                    self.on_event(pull.task.request_id, "held")
                self._pull_kv(pull)
            elif got_tag == pull.tag or time.monotonic() >= pull.grace:
                raise PullError("the prefill instance no longer holds the request's blocks "
                                "(freed by its abort timeout, or already pulled)")
            else:  # the producer's next step marks it: read again in 10 ms
                pull.retry_at = time.monotonic() + 0.01
        elif pull.step is _Step.PULL:
            pull.seconds = time.perf_counter() - pull.t0
            pull.step = _Step.CHECK_AFTER
            self._read_slot(pull)
        elif pull.step is _Step.CHECK_AFTER:
            if mailbox.decode(self._outbox.buf[pull.record]) != (pull.tag, mailbox.HELD):
                raise PullError("the prefill instance freed the blocks during the pull")
            self._pulled(pull)
        return True

    def _read_slot(self, pull: _Pull) -> None:
        """Issue the read of ``pull``'s mailbox slot into its outbox record."""
        assert self._dd is not None and self._outbox_cache is not None
        self._outbox.clear(pull.record)
        pull.handle = self._dd.cache_manager.pull_blocks_async(
            llm_datadist.BlocksCacheKey(pull.peer.cluster_id, MAILBOX_MODEL_ID),
            self._outbox_cache, [pull.task.remote.slot], [pull.record])

    def _pull_kv(self, pull: _Pull) -> None:
        assert self._dd is not None and self._kv is not None
        pull.step = _Step.PULL
        pull.t0 = time.perf_counter()
        pull.handle = self._dd.cache_manager.pull_blocks_async(
            llm_datadist.BlocksCacheKey(pull.peer.cluster_id, KV_MODEL_ID), self._kv,
            pull.src, pull.task.local_block_ids)

    def _pulled(self, pull: _Pull) -> None:
        """The KV has landed and both mailbox reads said HELD: count it, run the hook, report
        it (the blocks are the decoder's now), and push DONE (Rule 3, best effort: the
        request's outbox records stay taken until that push ends)."""
        assert self._layout is not None and self._dd is not None
        assert self._outbox_cache is not None
        task, peer, src = pull.task, pull.peer, pull.src
        nbytes = len(src) * self._layout.num_layers * self._block_bytes()
        self.stats.requests_pulled += 1
        self.stats.blocks_pulled += len(src)
        self.stats.bytes_pulled += nbytes
        self.stats.pull_seconds.append(pull.seconds)
        logger.info("datadist: pulled request %s (prefill request %s): %d blocks, %d bytes "
                    "from cluster %d (%s:%d) in %.2f ms", task.request_id,
                    task.remote.request_id, len(src), nbytes, peer.cluster_id, peer.host,
                    peer.port, pull.seconds * 1e3)
        if self.on_pulled is not None:
            self.on_pulled(task)
        self._done.add(task.request_id)  # not a step later, after the DONE's round trip
        pull.reported = True
        pull.step = _Step.NOTIFY
        self._outbox.buf[pull.record + 1] = mailbox.encode(pull.tag, mailbox.DONE)
        try:
            pull.handle = self._dd.cache_manager.push_blocks_async(
                llm_datadist.BlocksCacheKey(peer.cluster_id, MAILBOX_MODEL_ID),
                self._outbox_cache, [pull.record + 1], [task.remote.slot])
        except llm_datadist.LLMException as e:
            logger.warning("datadist: could not tell cluster %d that slot %d was pulled: %s",
                           peer.cluster_id, task.remote.slot, e)
            self._finish(pull)

    def _finish(self, pull: _Pull) -> None:
        """Report ``pull`` (done, or failed) unless reported, and give its records back."""
        self._pulls.remove(pull)
        self._free_records.append(pull.record)
        if not pull.reported:
            (self._failed if pull.failed else self._done).add(pull.task.request_id)

    def _fail(self, pull: _Pull, e: Exception) -> None:
        self.stats.pull_failures += 1
        logger.warning("datadist: pull of request %s (prefill request %s) failed: %s",
                       pull.task.request_id, pull.task.remote.request_id, e)
        if isinstance(e, llm_datadist.LLMException) and e.status_code in _LINK_CODES:
            self._drop_link(pull.peer.cluster_id)
        pull.failed = True
        if pull.handle is not None and not pull.handle.done():
            # Its transfer still uses our records (or the KV): they stay taken until it
            # ends (then _advance finishes it as a NOTIFY); the request is reported now.
            self._failed.add(pull.task.request_id)
            pull.reported = True
            pull.step = _Step.NOTIFY
            return
        self._finish(pull)

    def _block_bytes(self) -> int:
        assert self._layout is not None
        n = int(np.prod(self._layout.block_shape)) * self._layout.tensors_per_layer
        return n * _ITEMSIZE.get(self._layout.dtype, 1)

    def _push_failed(self, cluster_id: int, e: BaseException) -> None:
        """A layer-wise transfer from a prefill worker failed: a broken link is dropped (the
        next request to that worker links again)."""
        if isinstance(e, llm_datadist.LLMException) and e.status_code in _LINK_CODES:
            self._drop_link(cluster_id)

    def _drop_link(self, cluster_id: int) -> None:
        info = None if self._linker is None else self._linker.drop(cluster_id)
        if info is None or self._dd is None:
            return
        try:
            self._dd.unlink_clusters([info], self.settings.link_timeout_ms, force=True)
        except Exception as e:  # noqa: BLE001 - the link is gone either way
            logger.debug("datadist: unlink of cluster %d: %s", cluster_id, e)

    # ------------------------------------------------------------------ shutdown

    def close(self) -> None:
        """Finalize (which ends every transfer still in flight). Idempotent."""
        self._waiting.clear()
        self._pulls.clear()
        if self.lw_consumer is not None:
            self.lw_consumer.close()
        dd, self._dd = self._dd, None
        linker, self._linker = self._linker, None
        if linker is not None:
            linker.close(self.settings.link_timeout_ms / 1e3)
        if dd is not None:
            try:
                dd.finalize()
            except Exception as e:  # noqa: BLE001 - shutting down
                logger.debug("datadist: finalize: %s", e)


_ITEMSIZE = {
    llm_datadist.DataType.DT_FLOAT: 4, llm_datadist.DataType.DT_FLOAT16: 2,
    llm_datadist.DataType.DT_BF16: 2, llm_datadist.DataType.DT_INT8: 1,
    llm_datadist.DataType.DT_UINT8: 1,
}


def _cpus(of: list[int] | None = None) -> str:
    """The calling thread's CPU affinity (or the CPUs ``of``), compressed ("0", "0-3,8"): the
    start-up log says it, since two instances bound to the same cores (vLLM's CPU default)
    starve each other's workers (docs/vllm.md, "Two instances on one host")."""
    try:
        cpus = sorted(os.sched_getaffinity(0)) if of is None else sorted(of)
    except (AttributeError, OSError):
        return "unknown"
    runs: list[str] = []
    start = prev = cpus[0]
    for c in [*cpus[1:], -2]:
        if c != prev + 1:
            runs.append(str(start) if start == prev else f"{start}-{prev}")
            start = c
        prev = c
    return ",".join(runs)
