"""Layer-wise mode of the datadist connector: the decoder pulls each layer as the prefill
saves it.

Theory of operation. The router sends a request to both instances at once, with the same
random ``tag`` (docs/vllm.md, "Layer-wise mode"): the decode instance's copy also names the
prefill instance's workers (which every layer-wise prefill answer carries). The decoder
allocates blocks for the prompt's tokens at once, as for a pull, and the request waits in
WAITING_FOR_REMOTE_KVS; then

1. the prefill worker, at the request's first step, takes a free record of its *directory*
   (a small registered cache, ``SLOTS`` records of ``HEADER`` bytes, local memory) and
   writes there the tag, the prompt's length in blocks, and its *progress*: ``full`` (the
   prompt blocks whose every layer was written in earlier steps), ``hi`` (the blocks
   complete once this step has run) and ``layers`` (the layers this step wrote so far), with
   a hash of the record; its block ids go into the same slot of a second cache (``ids``).
   Each ``save_kv_layer`` only raises ``layers`` (a few microseconds, no transfer: the
   prefill's CPU stays on its forward pass); ``wait_for_save`` after the step that computed
   the prompt's last token marks the record COMPLETE;
2. the decode worker links to the prefill worker (off the step, ``_Linker``), reads the
   whole directory until it finds its tag, then reads its record again and again (a few
   dozen bytes by cross-memory attach on one host: the prefill's CPU does nothing for it),
   and pulls each layer's blocks as soon as the record says they are written
   (``pull_blocks_async`` with a layer range, run by the decoder's own threads, overlapping
   the prefill's compute). When the prefill's last layer is written only that layer is left
   to move. Blocks split across the chunks of a chunked prefill are pulled once complete;
3. once every layer is in and a read of the record issued after the last pull ended still
   says (tag, COMPLETE), the decoder reports the request received and pushes ``(tag, DONE)``
   into the prefill's *ack* record (a third cache, ``SLOTS`` records); the prefill frees the
   blocks when it has seen DONE and vLLM finished the request, clearing the record first.

A record is written by the prefill only, with numpy (not atomically): the decoder takes it
only when its hash matches (a torn read is read again).

Faults. A read of the record that fails (the prefill is gone) or finds another tag, or
REFUSED, fails the request at once (vLLM's ``kv_load_failure_policy`` applies). After
``layerwise_timeout_s`` the decoder issues no more pulls, waits for those in flight (each
bounded by ``sync_kv_timeout_ms``; only the decoder's own threads write its blocks), pushes
ABANDONED into the ack record (best effort) and reports the request failed: vLLM then reuses
its blocks. A prefill whose request vLLM ended abnormally, or before its first step, marks
the record REFUSED. A prefill frees blocks no decoder acknowledged ``abort_timeout_s`` after
vLLM finished the request (a dead decoder), clearing the record first, so a decoder whose
last read comes after that fails instead of using blocks that may have been reused (Rule 2
of mailbox.py, per request rather than per pull).

Who calls: connector.py, from vLLM's worker thread (``step`` from ``start_load_kv`` or the
first ``save_kv_layer``, ``save_layer`` from ``save_kv_layer``, ``wait_for_save``, ``poll``
from ``get_finished``; ``advance`` from the worker's ``wait_recv``). Nothing here takes a
lock, starts a thread or blocks: every transfer is issued and its handle checked later.
"""

from __future__ import annotations

import enum
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import datadist as llm_datadist
from datadist.integrations.vllm import mailbox
from datadist.integrations.vllm.settings import (
    KV_MODEL_ID,
    LOGGER_NAME,
    LW_ACK_MODEL_ID,
    LW_DIR_MODEL_ID,
    LW_IDS_MODEL_ID,
    PARAMS_KEY,
    Settings,
    WorkerAddress,
)

logger = logging.getLogger(LOGGER_NAME)

SLOTS = 256  # directory records per prefill worker (layer-wise requests at once)
MAX_BLOCKS = 2048  # blocks one request can name (longer prompts fall back to recompute)
HEADER = 64  # one directory record
IDS_BYTES = 4 * MAX_BLOCKS
FREE, OPEN, COMPLETE, REFUSED = 0, 1, 2, 4  # a directory record's state
ABANDONED = 3  # an ack record's state besides mailbox.DONE
_HASHED = 56  # bytes of a record the hash covers; the hash is the last 8


@dataclass(frozen=True)
class Progress:
    """One directory record: how far the prefill has written a request's KV. Blocks
    ``[0, full)`` have every layer written; ``[full, hi)`` have layers ``[0, layers)``."""

    tag: bytes
    state: int
    blocks: int  # the prompt's blocks
    ids: int  # how many of its block ids the ids record holds
    full: int
    hi: int
    layers: int

    def avail(self, layer: int) -> int:
        """Prompt blocks whose ``layer`` is written."""
        return self.hi if layer < self.layers else self.full


def _digest(raw: bytes) -> bytes:
    return hashlib.blake2b(raw, digest_size=8).digest()


def write_progress(rec: np.ndarray, p: Progress) -> None:
    """Fill one directory record: ``tag[16] state[1] pad[3] blocks ids full hi layers u32
    pad[20] hash[8]`` (the hash covers the first 56 bytes)."""
    buf = np.zeros(HEADER, np.uint8)
    buf[:16] = np.frombuffer(p.tag, np.uint8)
    buf[16] = p.state
    buf[20:40] = np.frombuffer(np.asarray([p.blocks, p.ids, p.full, p.hi, p.layers],
                                          np.uint32).tobytes(), np.uint8)
    buf[_HASHED:] = np.frombuffer(_digest(buf[:_HASHED].tobytes()), np.uint8)
    rec[:] = buf


def read_progress(rec: np.ndarray) -> Progress | None:
    """The record's progress, or None for a torn read (hash mismatch) or a free record."""
    raw = rec.tobytes()
    if raw[16] == FREE or _digest(raw[:_HASHED]) != raw[_HASHED:HEADER]:
        return None
    f = np.frombuffer(raw[20:40], np.uint32).tolist()
    return Progress(raw[:16], raw[16], *f)


# ====================================================================== what the scheduler sends


@dataclass(frozen=True)
class LayerwiseRemote:
    """A layer-wise decode request's ``kv_transfer_params["datadist"]``: the router's tag
    and the prefill instance's workers."""

    tag: str
    workers: list[WorkerAddress]
    block_size: int

    @property
    def request_id(self) -> str:  # what logs and the tests' hook name the request by
        return f"tag:{self.tag}"

    @classmethod
    def parse(cls, params: dict[str, Any]) -> LayerwiseRemote:
        dd = params.get(PARAMS_KEY)
        if not isinstance(dd, dict):
            raise ValueError(f"kv_transfer_params has no {PARAMS_KEY!r} entry")
        try:
            workers = [WorkerAddress(str(h), int(p), int(c)) for h, p, c in dd["workers"]]
            r = cls(str(dd["tag"]), workers, int(dd["block_size"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"bad layer-wise datadist kv_transfer_params: {e!r}") from None
        if not r.workers:
            raise ValueError("kv_transfer_params name no prefill worker")
        if len(bytes.fromhex(r.tag)) != mailbox.TAG_BYTES:
            raise ValueError(f"tag must be {mailbox.TAG_BYTES} bytes of hex")
        return r


def is_layerwise(params: dict[str, Any] | None) -> bool:
    """Whether a request's ``kv_transfer_params`` ask for the layer-wise mode."""
    dd = (params or {}).get(PARAMS_KEY)
    return isinstance(dd, dict) and dd.get("mode") == "layerwise"


@dataclass
class LayerwiseRecvTask:
    """Decode side: receive the prompt's last ``len(local_block_ids)`` blocks."""

    request_id: str
    local_block_ids: list[int]
    remote: LayerwiseRemote


@dataclass
class LayerwiseStep:
    """Prefill side, one request in one step: its blocks so far and what the step computes."""

    request_id: str
    tag: str
    block_ids: list[int]
    computed_before: int
    scheduled: int
    prompt_len: int
    block_size: int



# ====================================================================== prefill side


@dataclass
class _Send:
    rid: str
    tag: bytes
    prompt_len: int
    block_size: int
    block_ids: list[int] = field(default_factory=list)
    slot: int = -1
    full: int = 0  # blocks every layer of which was written in earlier steps
    hi: int = 0  # blocks complete once this step has run
    layers: int = 0  # layers this step has written so far
    state: int = OPEN
    acked: bool = False
    released: bool = False
    report: bool = True  # a request vLLM delayed the free of (else: only a refused tag)
    deadline: float = float("inf")
    t_first: float = 0.0  # wall clock of its first step (logs, the bench)
    t_complete: float = 0.0  # wall clock of its last layer's save

    @property
    def num_blocks(self) -> int:
        return -(-self.prompt_len // self.block_size)


class LayerwiseProducer:
    """A prefill worker's side of the layer-wise mode: it announces how far each request's
    KV is written and holds the blocks until its decoder pulled them. Registers the
    directory, the block ids and the ack records (decoders read the first two and push
    into the third, by key). Moves no KV itself."""

    def __init__(self, dd: llm_datadist.LLMDataDist, num_layers: int, settings: Settings,
                 cluster_id: int) -> None:
        self._num_layers = num_layers
        self.settings = settings
        self.directory = np.zeros((SLOTS, HEADER), np.uint8)
        self.ids = np.zeros((SLOTS, IDS_BYTES), np.uint8)
        self.acks = mailbox.Mailbox(SLOTS)
        cm = dd.cache_manager
        for arr, model_id in ((self.directory, LW_DIR_MODEL_ID), (self.ids, LW_IDS_MODEL_ID),
                              (self.acks.buf, LW_ACK_MODEL_ID)):
            cm.register_blocks_cache(
                llm_datadist.CacheDesc(1, list(arr.shape), llm_datadist.DataType.DT_UINT8),
                [arr.ctypes.data], llm_datadist.BlocksCacheKey(cluster_id, model_id))
        self._free_slots = list(range(SLOTS - 1, -1, -1))
        self._sends: dict[str, _Send] = {}
        self._step: list[_Send] = []
        self.served = 0  # requests whose decoder acknowledged every layer (tests, logs)
        self.abandoned = 0  # requests whose decoder gave up

    @property
    def active(self) -> bool:
        return bool(self._sends)

    def step(self, entries: list[LayerwiseStep]) -> None:
        """This step's layer-wise requests (``start_load_kv`` or the first
        ``save_kv_layer``): announce what the step will write. Never blocks."""
        self._step = []
        for e in entries:
            s = self._sends.get(e.request_id)
            if s is None:
                s = self._sends[e.request_id] = _Send(e.request_id, bytes.fromhex(e.tag),
                                                      e.prompt_len, e.block_size,
                                                      t_first=time.time())
                if s.num_blocks > MAX_BLOCKS:
                    self._refuse(s, f"{s.num_blocks} blocks; a layer-wise request names at "
                                    f"most {MAX_BLOCKS}")
                elif not self._free_slots:
                    s.state = REFUSED  # no record to say so: its decoder times out
                    logger.warning("datadist: layer-wise request %s: all %d directory "
                                   "records taken; its decoder will recompute", s.rid, SLOTS)
                else:
                    s.slot = self._free_slots.pop()
            if s.state != OPEN:
                continue
            ids = list(e.block_ids)
            if ids[:len(s.block_ids)] != s.block_ids:  # preempted and resumed: new blocks
                self._refuse(s, "its blocks changed (preempted)")
                continue
            if len(ids) > len(s.block_ids):
                n = min(len(ids), MAX_BLOCKS)
                self.ids[s.slot, :4 * n] = np.frombuffer(
                    np.asarray(ids[:n], np.uint32).tobytes(), np.uint8)
                s.block_ids = ids
            computed = min(e.computed_before + e.scheduled, s.prompt_len)
            s.full = min(e.computed_before // s.block_size, s.num_blocks)
            s.hi = s.num_blocks if computed >= s.prompt_len else computed // s.block_size
            s.layers = 0
            self._publish(s)
            self._step.append(s)

    def save_layer(self, layer: int) -> None:
        """vLLM wrote ``layer`` of this step (``save_kv_layer``): say so. Never blocks."""
        for s in self._step:
            if s.state == OPEN and layer + 1 > s.layers:
                s.layers = layer + 1
                self._publish(s)

    def wait_for_save(self) -> None:
        """End of a step's forward: every layer of the step is written (also when the step
        was handed over after the forward, without ``save_layer`` calls). After the step
        that computed the prompt's last token the record says COMPLETE. Never blocks."""
        for s in self._step:
            if s.state != OPEN:
                continue
            s.layers = self._num_layers
            if s.hi >= s.num_blocks:
                s.full = s.hi = s.num_blocks
                s.state = COMPLETE
                s.t_complete = time.time()
                logger.info("datadist: layer-wise request %s (tag %s): every layer of %d "
                            "blocks written at %.4f, %.1f ms after its first step",
                            s.rid, s.tag.hex(), s.num_blocks, s.t_complete,
                            (s.t_complete - s.t_first) * 1e3)
            else:
                s.full = s.hi
            self._publish(s)
        self._step = []

    def release(self, request_id: str, ok: bool) -> None:
        """vLLM finished the request (``request_finished`` delayed its free): its blocks are
        reported sent once its decoder acknowledged, or ``abort_timeout_s`` from now."""
        s = self._sends.get(request_id)
        if s is None:
            self._sends[request_id] = s = _Send(request_id, b"", 0, 1, state=REFUSED)
        s.released = True
        s.deadline = time.monotonic() + self.settings.abort_timeout_s
        if s.state == OPEN:
            self._refuse(s, "the prefill request ended before its prompt was computed"
                         if ok else "the prefill request did not finish normally")

    def refuse(self, tag: str) -> None:
        """vLLM ended a layer-wise request before its first step: its record says REFUSED
        for ``abort_timeout_s``, so its decoder fails it at its next read instead of waiting
        out ``layerwise_timeout_s``."""
        s = _Send(f"refused:{tag}", bytes.fromhex(tag), 0, 1, released=True, report=False,
                  deadline=time.monotonic() + self.settings.abort_timeout_s)
        if self._free_slots:
            s.slot = self._free_slots.pop()
        self._sends[s.rid] = s
        self._refuse(s, None)

    def poll(self) -> set[str]:
        """Requests whose blocks may be freed (``get_finished``): acknowledged by their
        decoder, or ``abort_timeout_s`` after vLLM finished them. Never blocks."""
        now = time.monotonic()
        out: set[str] = set()
        for s in list(self._sends.values()):
            acked = s.slot >= 0 and bool(s.tag) and self._acked(s)
            if not s.released:
                continue
            if not acked and now < s.deadline:
                continue
            if not acked and s.report and s.state != REFUSED:
                logger.warning("datadist: layer-wise request %s (tag %s): no decoder "
                               "acknowledged it within %.1f s; freeing its blocks", s.rid,
                               s.tag.hex(), self.settings.abort_timeout_s)
            self._forget(s)
            if s.report:
                out.add(s.rid)
        return out

    # ------------------------------------------------------------------ internals

    def _acked(self, s: _Send) -> bool:
        """Whether the decoder acknowledged ``s`` (DONE, or ABANDONED: then the record says
        REFUSED, so nothing reads on). Local memory; counted once."""
        tag, state = mailbox.decode(self.acks.buf[s.slot])
        if tag != s.tag or state not in (mailbox.DONE, ABANDONED):
            return False
        if not s.acked:
            s.acked = True
            if state == mailbox.DONE and s.state == COMPLETE:
                self.served += s.report
            elif state == ABANDONED:
                self.abandoned += 1
                if s.state != REFUSED:
                    self._refuse(s, None)
        return True

    def _publish(self, s: _Send) -> None:
        if s.slot < 0:
            return
        write_progress(self.directory[s.slot], Progress(
            s.tag, s.state, s.num_blocks, min(len(s.block_ids), MAX_BLOCKS),
            s.full, s.hi, s.layers))

    def _refuse(self, s: _Send, why: str | None) -> None:
        if why is not None and s.tag:
            logger.warning("datadist: layer-wise request %s (tag %s): %s", s.rid,
                           s.tag.hex(), why)
        s.state = REFUSED
        self._publish(s)

    def _forget(self, s: _Send) -> None:
        """Clear the records (the directory's first: Rule 1 of mailbox.py), then the slot
        may be reused."""
        del self._sends[s.rid]
        if s.slot >= 0:
            self.directory[s.slot] = 0
            self.acks.clear(s.slot)
            self._free_slots.append(s.slot)


# ====================================================================== decode side


class _R(enum.Enum):
    LINK = "link to the prefill worker"
    FIND = "directory read"
    TRACK = "layers"
    ABANDON = "abandon"


@dataclass
class _Recv:
    task: LayerwiseRecvTask
    peer: WorkerAddress
    tag: bytes
    record: int  # our local records: directory scan rows, ids row, ack row
    deadline: float
    step: _R = _R.LINK
    read: llm_datadist.TransferHandle | None = None  # directory or ids read in flight
    ids_wanted: int = 0  # the read in flight is of this many block ids
    pulls: list[llm_datadist.TransferHandle] = field(default_factory=list)
    landing: dict[int, tuple[range, list[int]]] = field(default_factory=dict)  # per pull
    slot: int = -1
    ids: list[int] = field(default_factory=list)
    pulled: list[int] = field(default_factory=list)  # per layer: prompt blocks pulled
    clean: bool = False  # the read in flight was issued with no pull in flight
    outcome: str | None = None  # ABANDON: why it failed
    npulls: int = 0
    t0: float = 0.0
    complete: bool = False  # the last read said COMPLETE: only the last pulls are left


class LayerwiseConsumer:
    """A decode worker's side of the layer-wise mode: for each request it follows the
    prefill's record and pulls each layer's blocks as soon as they are written. Registers
    only local caches (where reads land, where its acks start)."""

    def __init__(self, dd: llm_datadist.LLMDataDist, kv: llm_datadist.Cache,
                 tensors_per_layer: int, num_layers: int, settings: Settings, linker: Any,
                 slots: int, on_done: Callable[[LayerwiseRecvTask, float, int, int], None],
                 on_error: Callable[[int, BaseException], None]) -> None:
        self._dd, self._kv, self._tpl = dd, kv, tensors_per_layer
        self._num_layers = num_layers
        self.settings, self._linker = settings, linker
        self._on_done, self._on_error = on_done, on_error
        self._dir = np.zeros((slots * SLOTS, HEADER), np.uint8)
        self._ids = np.zeros((slots, IDS_BYTES), np.uint8)
        self._acks = mailbox.Mailbox(slots)
        cm = dd.cache_manager
        self._dir_cache, self._ids_cache, self._ack_cache = (
            cm.register_blocks_cache(
                llm_datadist.CacheDesc(1, list(a.shape), llm_datadist.DataType.DT_UINT8),
                [a.ctypes.data])
            for a in (self._dir, self._ids, self._acks.buf))
        self._free = list(range(slots))
        self._waiting: list[LayerwiseRecvTask] = []
        self._recvs: list[_Recv] = []
        self._draining: list[tuple[int, list[llm_datadist.TransferHandle]]] = []
        self._done: set[str] = set()
        self._failed: set[str] = set()
        self._rank = 0
        # Called as each pull lands (request id, its layers, the local blocks it wrote):
        # staging.py copies them to the GPU. From ``advance``, the worker's thread.
        self.on_layers: Callable[[str, range, list[int]], None] | None = None

    @property
    def active(self) -> bool:
        return bool(self._waiting) or bool(self._recvs)

    def submit(self, tasks: list[LayerwiseRecvTask], rank: int) -> None:
        self._waiting.extend(tasks)
        self._rank = rank
        for t in tasks:
            if rank < len(t.remote.workers):
                self._linker.want(t.remote.workers[rank])

    def poll(self) -> tuple[set[str], set[str]]:
        """(received, failed) since the last call. Never blocks."""
        self.advance()
        done, failed = self._done, self._failed
        self._done, self._failed = set(), set()
        return done | failed, failed

    def advance(self) -> bool:
        """Check every transfer in flight and issue the next ones (reads, pulls of newly
        written layers); True when a request ended since the last ``poll``. Never blocks.
        Who calls: ``poll``, and the worker's ``wait_recv`` in a loop on an idle step."""
        for item in [d for d in self._draining if all(h.done() for h in d[1])]:
            self._draining.remove(item)
            self._free.append(item[0])
        while self._waiting and self._free:
            t = self._waiting.pop(0)
            r = _Recv(t, t.remote.workers[0], b"", self._free.pop(),
                      time.monotonic() + self.settings.layerwise_timeout_s)
            self._recvs.append(r)
            try:
                if self._rank >= len(t.remote.workers):
                    raise ValueError(f"prefill instance has {len(t.remote.workers)} "
                                     f"workers, we are rank {self._rank}")
                if len(t.local_block_ids) > MAX_BLOCKS:
                    raise ValueError(f"{len(t.local_block_ids)} blocks; a layer-wise "
                                     f"request names at most {MAX_BLOCKS}")
                r.peer = t.remote.workers[self._rank]
                r.tag = bytes.fromhex(t.remote.tag)
            except Exception as e:  # noqa: BLE001
                self._end(r, ABANDONED, f"{e}")
        for r in list(self._recvs):
            for _ in range(8):
                try:
                    moved = self._advance(r)
                except Exception as e:  # noqa: BLE001 - every failure fails the request
                    if isinstance(e, llm_datadist.LLMException):
                        self._on_error(r.peer.cluster_id, e)
                    if r in self._recvs and r.step is not _R.ABANDON:
                        self._stop(r, f"{r.step.value}: {e}")
                    moved = True
                if not moved or r not in self._recvs:
                    break
        return bool(self._done or self._failed)

    def _advance(self, r: _Recv) -> bool:
        now = time.monotonic()
        if r.step is _R.LINK:
            state = self._linker.state(r.peer.cluster_id)
            if state is None:
                self._linker.want(r.peer)
                return False
            if isinstance(state, Exception):
                raise state
            if state != "up":
                if now >= r.deadline:
                    raise TimeoutError("no link in time")
                return False
            r.step = _R.FIND
            r.t0 = time.perf_counter()
            self._read_record(r)
            return True
        if r.step is _R.ABANDON:
            return self._wait_pulls(r)
        # FIND / TRACK: collect ended pulls; a failed one fails the request
        for h in [h for h in r.pulls if h.done()]:
            r.pulls.remove(h)
            landed = r.landing.pop(id(h), None)
            if h.exception() is not None:
                raise h.exception()  # type: ignore[misc]
            if landed is not None and self.on_layers is not None:
                self.on_layers(r.task.request_id, *landed)
        if now >= r.deadline:
            self._stop(r, f"no KV within layerwise_timeout_s "
                          f"({self.settings.layerwise_timeout_s:.1f} s)")
            return True
        if r.read is None:
            self._read_record(r)
            return True
        if not r.read.done():
            return False
        handle, r.read = r.read, None
        exc = handle.exception()
        if exc is not None:
            raise exc
        base = r.record * SLOTS
        if r.ids_wanted:  # the block ids landed: read the record again
            n, r.ids_wanted = r.ids_wanted, 0
            r.ids = np.frombuffer(self._ids[r.record, :4 * n].tobytes(), np.uint32).tolist()
            self._read_record(r)
            return True
        if r.step is _R.FIND:
            tags = self._dir[base:base + SLOTS, :16]
            for slot in np.flatnonzero((tags == np.frombuffer(r.tag, np.uint8)).all(axis=1)):
                if read_progress(self._dir[base + int(slot)]) is not None:
                    r.slot, r.step = int(slot), _R.TRACK
                    self._dir[base] = self._dir[base + r.slot]  # where its reads land
                    break
            else:
                self._read_record(r)  # not there yet: the prefill has not scheduled it
                return False
        p = read_progress(self._dir[base])
        if p is None and self._dir[base, 16] != FREE:  # torn: read again
            self._read_record(r)
            return False
        if p is None or p.tag != r.tag:
            raise RuntimeError("the prefill worker no longer has the request (freed by "
                               "its abort timeout)")
        if p.state == REFUSED:
            raise RuntimeError("the prefill worker refused the request (ended, "
                               "abandoned, or no room)")
        r.complete = p.state == COMPLETE
        n = len(r.task.local_block_ids)
        if not 0 < n <= p.blocks:
            raise RuntimeError(f"the decoder has {n} blocks for the prompt's {p.blocks}")
        first = p.blocks - n
        if not r.pulled:
            r.pulled = [first] * self._num_layers
        if p.state == COMPLETE and r.clean and not r.pulls and min(r.pulled) >= p.blocks:
            self._end(r, mailbox.DONE, None)  # a read issued after the last pull ended
            return True
        need = max(min(p.avail(layer), p.blocks) for layer in range(self._num_layers))
        if need > len(r.ids) and p.ids > len(r.ids):
            r.ids_wanted = p.ids
            r.read = self._dd.cache_manager.pull_blocks_async(
                self._key(r, LW_IDS_MODEL_ID), self._ids_cache, [r.slot], [r.record])
            return True
        self._pull_new(r, p, first)
        r.clean = not r.pulls
        self._read_record(r)
        return False

    def finishing(self) -> llm_datadist.TransferHandle | None:
        """A transfer in flight of a request whose prefill has written every layer (its
        last pulls, or the read that ends it), else None: what an idle step's wait waits
        on rather than reading the record again. Never blocks. Who calls: the worker's
        ``wait_recv``."""
        for r in self._recvs:
            if r.complete and r.step is _R.TRACK:
                for h in (*r.pulls, r.read):
                    if h is not None and not h.done():
                        return h
        return None

    def _pull_new(self, r: _Recv, p: Progress, first: int) -> None:
        """Issue the pulls of every layer's blocks written since the last: consecutive
        layers with the same blocks go in one pull."""
        def avail(layer: int) -> int:
            return min(p.avail(layer), p.blocks, len(r.ids))

        layer, last = 0, self._num_layers
        while layer < last:
            a, b = r.pulled[layer], avail(layer)
            if b <= a:
                layer += 1
                continue
            end = layer + 1
            while end < last and r.pulled[end] == a and avail(end) == b:
                end += 1
            layers = range(layer, end)
            local = r.task.local_block_ids[a - first:b - first]
            r.pulls.append(self._dd.cache_manager.pull_blocks_async(
                self._key(r, KV_MODEL_ID), self._kv, r.ids[a:b], local,
                tensor_num_per_layer=self._tpl, src_layer_range=layers,
                dst_layer_range=layers))
            r.landing[id(r.pulls[-1])] = (layers, local)
            r.npulls += 1
            for i in layers:
                r.pulled[i] = b
            layer = end

    def _read_record(self, r: _Recv) -> None:
        """Issue the read of the prefill's directory (the whole of it until the tag is
        found, then the request's record) into our rows."""
        base = r.record * SLOTS
        if r.step is _R.FIND:
            src, dst = list(range(SLOTS)), list(range(base, base + SLOTS))
        else:
            src, dst = [r.slot], [base]
        r.read = self._dd.cache_manager.pull_blocks_async(
            self._key(r, LW_DIR_MODEL_ID), self._dir_cache, src, dst)

    def _key(self, r: _Recv, model_id: int) -> llm_datadist.BlocksCacheKey:
        return llm_datadist.BlocksCacheKey(r.peer.cluster_id, model_id)

    def _stop(self, r: _Recv, why: str) -> None:
        """Fail ``r``: no more pulls; once those in flight ended (each within its deadline:
        only they write its blocks) it is reported failed and its prefill told."""
        r.outcome = why
        r.step = _R.ABANDON
        if not any(not h.done() for h in r.pulls):
            self._end(r, ABANDONED, why)

    def _wait_pulls(self, r: _Recv) -> bool:
        r.pulls = [h for h in r.pulls if not h.done()]
        if r.pulls:
            return False
        self._end(r, ABANDONED, r.outcome)
        return True

    def _end(self, r: _Recv, state: int, why: str | None) -> None:
        """Report ``r`` (received when ``why`` is None) and push ``state`` into its
        prefill's ack record (best effort). Its local records are reused once no transfer
        of ours uses them."""
        busy = [h for h in (r.read, *r.pulls) if h is not None and not h.done()]
        if r.slot >= 0:
            self._acks.buf[r.record] = mailbox.encode(r.tag, state)
            try:
                busy.append(self._dd.cache_manager.push_blocks_async(
                    self._key(r, LW_ACK_MODEL_ID), self._ack_cache, [r.record], [r.slot]))
            except Exception as e:  # noqa: BLE001 - best effort: the prefill times out
                logger.debug("datadist: ack of layer-wise request %s: %s",
                             r.task.request_id, e)
        if why is None:
            self._on_done(r.task, time.perf_counter() - r.t0, r.peer.cluster_id, r.npulls)
            self._done.add(r.task.request_id)
        else:
            logger.warning("datadist: layer-wise request %s (tag %s) failed: %s",
                           r.task.request_id, r.task.remote.tag, why)
            self._failed.add(r.task.request_id)
        if r in self._recvs:
            self._recvs.remove(r)
        if busy:
            self._draining.append((r.record, busy))
        else:
            self._free.append(r.record)

    def close(self) -> None:
        self._waiting.clear()
        self._recvs.clear()
