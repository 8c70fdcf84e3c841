"""Layer-wise mode of the datadist connector: the prefill pushes each layer as vLLM saves it.

Theory of operation. The router sends a request to both instances at once, with the same
random ``tag`` (docs/vllm.md, "Layer-wise mode"): the decode instance's copy also names the
prefill instance's workers (which every layer-wise prefill answer carries). The decoder
allocates blocks for the prompt's tokens at once, as for a pull, and the request waits in
WAITING_FOR_REMOTE_KVS; then

1. the decode worker links to the prefill worker (off the step, ``_Linker``), reads the
   ``WINDOW`` slots of the prefill's *inbox* that the tag hashes to, and pushes its *plan*
   into the first free one: tag, state PLAN, its cluster id, its landing record, and the
   local block ids of the prompt's last ``n`` blocks (those a local prefix hit lacks);
2. the prefill worker looks for its requests' tags in its inbox (local memory) at each step.
   Once it has the plan, each ``save_kv_layer`` of a step that computed some of the prompt
   pushes that layer's blocks (``push_blocks_async`` with a layer range; over the decoder's
   link, whose reverse channel carries the prefill's pushes); ``wait_for_save`` waits for the
   step's pushes (only the last layer's is usually left) and, after the step that computed
   the prompt's last token, pushes ``(tag, DONE)`` into the decoder's landing record. A plan
   that arrives after the prompt was computed gets every layer in one push, then the DONE;
3. the decode worker sees DONE in its landing record (local memory) in ``poll_recv`` and
   reports the request received; the prefill reports it sent once the DONE push ended and
   vLLM finished the request, then clears the inbox slot.

Faults. A decode worker reads its inbox slot every ``HEARTBEAT_S`` while it waits: a read
that fails (the prefill is gone) or finds another tag or REFUSED fails the request at once
(vLLM's ``kv_load_failure_policy`` applies). After ``layerwise_timeout_s`` it writes
ABANDONED into its slot; the prefill checks the slot (local memory) before every push, so no
push starts after that write lands, and each push in flight ends within its deadline
(``sync_kv_timeout_ms``): the decoder reports the request failed (vLLM then frees or reuses
its blocks) only that long after the write landed. If the write fails the prefill is
unreachable, and so are its pushes: the request fails at once. A prefill whose pushes fail
(the decoder is gone) marks the slot REFUSED and frees the blocks when vLLM finishes the
request; one whose plan never comes frees them ``abort_timeout_s`` after the request ended.
Inbox records whose tag no request here claims are cleared after ``abort_timeout_s``.

Who calls: connector.py, from vLLM's worker thread (``step`` from ``start_load_kv``,
``save_layer`` from ``save_kv_layer``, ``wait_for_save``, ``poll`` from ``get_finished``);
nothing here takes a lock or starts a thread. Only ``wait_for_save`` blocks, for this step's
pushes, each bounded by ``sync_kv_timeout_ms``.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import datadist as llm_datadist
from datadist.integrations.vllm import mailbox
from datadist.integrations.vllm.settings import (
    INBOX_MODEL_ID,
    KV_MODEL_ID,
    LANDING_MODEL_ID,
    LOGGER_NAME,
    PARAMS_KEY,
    Settings,
    WorkerAddress,
)

logger = logging.getLogger(LOGGER_NAME)

SLOTS = 256  # inbox records per prefill worker (plans of requests being pushed)
WINDOW = 4  # slots a tag may use: a decoder takes the first free one
MAX_BLOCKS = 2048  # blocks one plan can name (longer prompts fall back to recompute)
HEADER = 128
HOST_BYTES = 64  # the decoder's listen host, utf-8, zero-padded (an IPv6 literal fits)
RECORD = HEADER + 4 * MAX_BLOCKS
FREE, PLAN, ABANDONED, REFUSED = 0, 1, 3, 4
HEARTBEAT_S = 0.5


def window(tag: bytes) -> list[int]:
    """The inbox slots ``tag``'s plan may take (the tag is random: its bytes are the hash)."""
    h = int.from_bytes(tag[:4], "little") % SLOTS
    return [(h + j) % SLOTS for j in range(WINDOW)]


def write_plan(rec: np.ndarray, tag: bytes, state: int, decoder: WorkerAddress,
               landing: int, dst: list[int]) -> None:
    """Fill one inbox record: ``tag[16] state[1] pad[7] cluster_id u64 landing u32 n u32
    port u32 pad[20] host[64]``, then ``n`` u32 block ids."""
    if len(dst) > MAX_BLOCKS:
        raise ValueError(f"{len(dst)} blocks; a layer-wise plan names at most {MAX_BLOCKS}")
    host = decoder.host.encode()
    if len(host) > HOST_BYTES:
        raise ValueError(f"host {decoder.host!r} is longer than {HOST_BYTES} bytes")
    rec[:HEADER] = 0
    rec[:16] = np.frombuffer(tag, np.uint8)
    rec[16] = state
    rec[24:32] = np.frombuffer(np.uint64(decoder.cluster_id).tobytes(), np.uint8)
    rec[32:36] = np.frombuffer(np.uint32(landing).tobytes(), np.uint8)
    rec[36:40] = np.frombuffer(np.uint32(len(dst)).tobytes(), np.uint8)
    rec[40:44] = np.frombuffer(np.uint32(decoder.port).tobytes(), np.uint8)
    rec[HEADER - HOST_BYTES:HEADER - HOST_BYTES + len(host)] = np.frombuffer(host, np.uint8)
    rec[HEADER:HEADER + 4 * len(dst)] = np.frombuffer(np.asarray(dst, np.uint32).tobytes(),
                                                      np.uint8)


@dataclass(frozen=True)
class Plan:
    """A decoder's plan: where it listens (the prefill links to it and pushes by
    cross-memory attach on one host), its landing record, its blocks."""

    decoder: WorkerAddress
    landing: int
    dst: list[int]

    @property
    def cluster_id(self) -> int:
        return self.decoder.cluster_id


def read_plan(rec: np.ndarray) -> tuple[bytes, int, Plan]:
    """(tag, state, plan) of one inbox record."""
    cid = int(rec[24:32].view(np.uint64)[0])
    landing = int(rec[32:36].view(np.uint32)[0])
    n = min(int(rec[36:40].view(np.uint32)[0]), MAX_BLOCKS)
    port = int(rec[40:44].view(np.uint32)[0])
    host = bytes(rec[HEADER - HOST_BYTES:HEADER]).rstrip(b"\0").decode(errors="replace")
    dst = rec[HEADER:HEADER + 4 * n].view(np.uint32).tolist()
    return bytes(rec[:16]), int(rec[16]), Plan(WorkerAddress(host, port, cid), landing, dst)


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


class _S(enum.Enum):
    OPEN = "pushing"
    COMPLETING = "DONE push in flight"
    DONE = "done"
    FAILED = "failed"


@dataclass
class _Send:
    rid: str
    tag: bytes
    prompt_len: int
    block_size: int
    block_ids: list[int] = field(default_factory=list)
    computed: int = 0
    slot: int = -1
    plan: Plan | None = None
    pushed_upto: int = 0  # prompt block index from which blocks still go (re)pushed
    lo: int = 0
    hi: int = 0
    handles: list[llm_datadist.TransferHandle] = field(default_factory=list)
    record: int = -1  # complete-outbox record of its DONE
    state: _S = _S.OPEN
    released: bool = False
    deadline: float = float("inf")
    t_plan: float = 0.0
    t_last_push: float = 0.0  # wall clock (time.time()) of its last KV push's issue
    t_done: float = 0.0  # wall clock of its DONE push's issue
    pushes: int = 0
    report: bool = True  # a request vLLM delayed the free of (else: only a refused plan)
    layers: int = 0  # layers pushed in this step

    @property
    def num_blocks(self) -> int:
        return -(-self.prompt_len // self.block_size)

    @property
    def first(self) -> int:
        assert self.plan is not None
        return self.num_blocks - len(self.plan.dst)


class LayerwiseProducer:
    """A prefill worker's layer-wise pushes. Registers its inbox (by key, decoders push their
    plans into it) and a local outbox of DONE records."""

    def __init__(self, dd: llm_datadist.LLMDataDist, kv: llm_datadist.Cache,
                 tensors_per_layer: int, num_layers: int, settings: Settings,
                 cluster_id: int, linker: Any,
                 on_error: Callable[[int, BaseException], None]) -> None:
        self._dd, self._kv, self._tpl = dd, kv, tensors_per_layer
        self._linker = linker  # worker.py's _Linker: links to decoders off the step
        self._on_error = on_error  # a push failed: the worker drops a broken link
        self._num_layers = num_layers
        self.settings = settings
        self.inbox = np.zeros((SLOTS, RECORD), np.uint8)
        self._out = mailbox.Mailbox(SLOTS)
        cm = dd.cache_manager
        cm.register_blocks_cache(
            llm_datadist.CacheDesc(1, [SLOTS, RECORD], llm_datadist.DataType.DT_UINT8),
            [self.inbox.ctypes.data], llm_datadist.BlocksCacheKey(cluster_id, INBOX_MODEL_ID))
        self._out_cache = cm.register_blocks_cache(
            llm_datadist.CacheDesc(1, [SLOTS, mailbox.RECORD_BYTES],
                                   llm_datadist.DataType.DT_UINT8),
            [self._out.buf.ctypes.data])
        self._free_records = list(range(SLOTS))
        self._sends: dict[str, _Send] = {}
        self._step: list[_Send] = []
        self._pending: list[_Send] = []  # in this step, without a plan or link so far
        self._strangers: dict[int, tuple[bytes, float]] = {}
        self._next_sweep = 0.0
        self.pushed = 0  # requests whose every layer reached a decoder (tests, logs)

    @property
    def active(self) -> bool:
        return bool(self._sends)

    def step(self, entries: list[LayerwiseStep]) -> None:
        """This step's layer-wise requests (``start_load_kv``). Never blocks."""
        self._step, self._pending = [], []
        for e in entries:
            s = self._sends.get(e.request_id)
            if s is None:
                s = self._sends[e.request_id] = _Send(e.request_id, bytes.fromhex(e.tag),
                                                      e.prompt_len, e.block_size)
            if s.state is not _S.OPEN:
                continue
            s.block_ids = list(e.block_ids)
            s.computed = min(e.computed_before + e.scheduled, s.prompt_len)
            s.layers = 0
            if s.plan is None:
                self._find_plan(s)
            if s.state is not _S.OPEN:
                continue
            if s.plan is not None and self._ready(s):
                self._range(s)
                if s.hi > s.lo:
                    self._step.append(s)
            else:
                self._pending.append(s)

    def _range(self, s: _Send) -> None:
        """This step's blocks of ``s``: from the first not pushed to the last computed."""
        s.lo = max(s.pushed_upto, s.first)
        s.hi = min(-(-s.computed // s.block_size), s.num_blocks)

    def _ready(self, s: _Send) -> bool:
        """Whether ``s``'s decoder is linked (its link is asked for when the plan comes);
        a link that failed fails the request. Never blocks."""
        assert s.plan is not None
        state = self._linker.state(s.plan.cluster_id)
        if state is None:
            self._linker.want(s.plan.decoder)
            return False
        if isinstance(state, Exception):
            self._fail(s, f"{state}")
            return False
        return bool(state == "up")

    def save_layer(self, layer: int) -> None:
        """Push ``layer`` of this step's blocks of every planned request (``save_kv_layer``,
        right after vLLM wrote the layer). Never blocks: the pushes are issued."""
        for s in self._step:
            if s.state is not _S.OPEN:
                continue
            if not self._planned(s):
                continue
            assert s.plan is not None
            self._push(s, s.lo, s.hi, layer)
            s.layers += 1
        for s in list(self._pending):  # a plan (or link) that came during the forward
            if s.state is not _S.OPEN:
                self._pending.remove(s)
                continue
            if s.plan is None:
                self._find_plan(s)
            if s.state is not _S.OPEN or s.plan is None or not self._ready(s):
                continue
            self._pending.remove(s)
            self._range(s)
            if s.hi > s.lo and self._planned(s):
                self._push(s, s.lo, s.hi, range(layer + 1))  # the layers saved so far
                s.layers = layer + 1
                self._step.append(s)

    def wait_for_save(self) -> None:
        """End of a step's forward. After the step that computed a prompt's last token, the
        DONE goes out as soon as its pushes ended: now if they have, else from ``poll``
        (the engine is not held up by a push backlog). After an earlier chunk, blocks until
        the step's pushes ended (each bounded by its deadline): the next chunk writes into
        the last, partly computed block, which goes again then. A request whose plan came
        after some of the step's layers were saved gets the step's blocks of every layer
        in one push now."""
        for s in self._step:
            last = s.computed >= s.prompt_len
            if s.state is _S.OPEN and s.layers < self._num_layers:
                self._push(s, s.lo, s.hi, None)
            self._settle(s, block=not last)
            if s.handles and s.state is _S.OPEN and not last:
                self._fail(s, "a push still runs past its deadline")
            if s.state is not _S.OPEN:
                continue
            s.pushed_upto = s.num_blocks if last else s.computed // s.block_size
            if last and not s.handles:
                self._complete(s)
        self._step, self._pending = [], []

    def _push(self, s: _Send, lo: int, hi: int, layer: int | range | None) -> None:
        """Issue the push of the prompt's blocks [lo, hi): one layer, a range of layers, or
        all (None)."""
        assert s.plan is not None
        off = s.first
        if isinstance(layer, int):
            layer = range(layer, layer + 1)
        layers: dict[str, Any] = {} if layer is None else {
            "src_layer_range": layer, "dst_layer_range": layer}
        try:
            s.handles.append(self._dd.cache_manager.push_blocks_async(
                llm_datadist.BlocksCacheKey(s.plan.cluster_id, KV_MODEL_ID), self._kv,
                s.block_ids[lo:hi], s.plan.dst[lo - off:hi - off],
                tensor_num_per_layer=self._tpl, **layers))
            s.pushes += 1
        except Exception as e:  # noqa: BLE001 - the request fails, the engine goes on
            self._fail(s, f"push of layers {layer or 'all'} failed: {e}")
            self._on_error(s.plan.cluster_id, e)
        s.t_last_push = time.time()

    def release(self, request_id: str, ok: bool) -> None:
        """vLLM finished the request (``request_finished`` delayed its free): its blocks are
        reported sent once no push reads them."""
        s = self._sends.get(request_id)
        if s is None:
            self._sends[request_id] = s = _Send(request_id, b"", 0, 1, state=_S.FAILED)
        s.released = True
        s.deadline = time.monotonic() + self.settings.abort_timeout_s
        if not ok and s.state is _S.OPEN:
            self._fail(s, "the prefill request did not finish normally")

    def refuse(self, tag: str) -> None:
        """vLLM ended a layer-wise request before its first step: its decoder's plan (now
        or when it comes, for ``abort_timeout_s``) is marked REFUSED, so the decoder fails
        it at its next heartbeat instead of waiting out ``layerwise_timeout_s``."""
        s = _Send(f"refused:{tag}", bytes.fromhex(tag), 0, 1, state=_S.FAILED,
                  released=True, report=False,
                  deadline=time.monotonic() + self.settings.abort_timeout_s)
        self._sends[s.rid] = s

    def poll(self) -> set[str]:
        """Requests whose blocks may be freed (``get_finished``); late plans get their
        pushes here. Never blocks."""
        now = time.monotonic()
        out: set[str] = set()
        for s in list(self._sends.values()):
            if not s.report:
                if s.slot < 0:
                    for slot in window(s.tag):
                        if bytes(self.inbox[slot, :16]) == s.tag:
                            s.slot = slot
                            self.inbox[slot, 16] = REFUSED
                if now >= s.deadline:
                    self._forget(s)
                continue
            if s.state is _S.OPEN and s.tag and s not in self._step:
                if s.plan is None:
                    self._find_plan(s)
                if s.state is _S.OPEN and s.plan is not None and s.handles:
                    self._settle(s, block=False)
                if (s.state is _S.OPEN and s.plan is not None and not s.handles
                        and s.computed >= s.prompt_len):
                    if s.pushed_upto < s.num_blocks:
                        if self._ready(s):  # a plan or link that came after the prefill
                            self._push_all(s)
                    else:
                        self._complete(s)
            if s.state is _S.COMPLETING:
                self._settle(s, block=False)
            if not s.released:
                continue
            if s.state in (_S.OPEN, _S.COMPLETING) and now >= s.deadline:
                self._fail(s, f"not pushed within {self.settings.abort_timeout_s:.1f} s "
                              "of the request's end")
            if s.state in (_S.DONE, _S.FAILED) and all(h.done() for h in s.handles):
                self._forget(s)
                out.add(s.rid)
        if now >= self._next_sweep:
            self._next_sweep = now + 1.0
            self._sweep(now)
        return out

    # ------------------------------------------------------------------ internals

    def _find_plan(self, s: _Send) -> None:
        for slot in window(s.tag):
            tag, state, plan = read_plan(self.inbox[slot])
            if tag != s.tag or state == FREE:
                continue
            if state != PLAN:  # the decoder gave up before we looked
                s.slot = slot
                self._fail(s, "the decoder gave up on the request (layerwise_timeout_s)")
                return
            s.slot, s.t_plan = slot, time.perf_counter()
            self._strangers.pop(slot, None)
            if not 0 < len(plan.dst) <= s.num_blocks:
                self._fail(s, f"the decoder's plan names {len(plan.dst)} blocks, the prompt "
                              f"has {s.num_blocks}")
                return
            s.plan = plan
            s.pushed_upto = s.first
            self._linker.want(plan.decoder)  # off the step; retries a link that failed
            return

    def _planned(self, s: _Send) -> bool:
        """Whether the decoder still waits (its slot says PLAN): checked before each push."""
        tag, state, _ = read_plan(self.inbox[s.slot])
        if tag == s.tag and state == PLAN:
            return True
        self._fail(s, "the decoder gave up on the request (layerwise_timeout_s)")
        return False

    def _push_all(self, s: _Send) -> None:
        """A late plan: every layer of the prompt's blocks in one push."""
        if self._planned(s):
            self._push(s, max(s.pushed_upto, s.first), s.num_blocks, None)
            s.pushed_upto = s.num_blocks

    def _settle(self, s: _Send, *, block: bool) -> None:
        """Collect ended pushes (all of them when ``block``); a failed one fails ``s``."""
        left = []
        for h in s.handles:
            if block and not h.done():
                with contextlib.suppress(Exception):  # its failure is read below
                    h.wait(self.settings.sync_kv_timeout_ms / 1e3 + 1.0)
            if not h.done():
                left.append(h)
                continue
            exc = h.exception()
            if exc is not None and s.state in (_S.OPEN, _S.COMPLETING):
                self._fail(s, f"a push failed: {exc}")
                if s.plan is not None:
                    self._on_error(s.plan.cluster_id, exc)
        s.handles = left
        if s.state is _S.COMPLETING and not left:
            s.state = _S.DONE
            self.pushed += 1
            assert s.plan is not None
            # Wall clocks, so a bench can set them against the decoder's log (one host).
            logger.info("datadist: pushed request %s (tag %s) layer by layer to cluster %d: "
                        "%d blocks x %d layers in %d pushes; the last push issued at %.4f, "
                        "its DONE at %.4f (%.2f ms later)", s.rid, s.tag.hex(), s.plan.cluster_id,
                        len(s.plan.dst), self._num_layers, s.pushes, s.t_last_push, s.t_done,
                        (s.t_done - s.t_last_push) * 1e3)

    def _complete(self, s: _Send) -> None:
        assert s.plan is not None
        if not self._free_records:
            self._fail(s, "no record left for its DONE")
            return
        s.record = self._free_records.pop()
        s.t_done = time.time()
        self._out.buf[s.record] = mailbox.encode(s.tag, mailbox.DONE)
        try:
            s.handles.append(self._dd.cache_manager.push_blocks_async(
                llm_datadist.BlocksCacheKey(s.plan.cluster_id, LANDING_MODEL_ID),
                self._out_cache, [s.record], [s.plan.landing]))
            s.state = _S.COMPLETING
        except Exception as e:  # noqa: BLE001
            self._fail(s, f"DONE push failed: {e}")
            self._on_error(s.plan.cluster_id, e)

    def _fail(self, s: _Send, why: str) -> None:
        if s.state is _S.FAILED:
            return
        s.state = _S.FAILED
        if s.tag:
            logger.warning("datadist: layer-wise request %s (tag %s): %s", s.rid,
                           s.tag.hex(), why)
        if s.slot >= 0:
            tag, state, _ = read_plan(self.inbox[s.slot])
            if tag == s.tag:
                self.inbox[s.slot, 16] = REFUSED  # a decoder's next heartbeat fails it

    def _forget(self, s: _Send) -> None:
        del self._sends[s.rid]
        if s.record >= 0:
            self._free_records.append(s.record)
        if s.slot >= 0 and bytes(self.inbox[s.slot, :16]) == s.tag:
            self.inbox[s.slot, :HEADER] = 0

    def _sweep(self, now: float) -> None:
        """Clear plans no request here claims after ``abort_timeout_s`` (their prefill
        request never came, or ended before the plan)."""
        mine = {s.slot for s in self._sends.values() if s.slot >= 0}
        tags = {s.tag for s in self._sends.values()}
        for slot in np.flatnonzero(self.inbox[:, 16]).tolist():
            if slot in mine:
                continue
            tag = bytes(self.inbox[slot, :16])
            if tag in tags:  # its request has not looked yet
                continue
            seen = self._strangers.get(slot)
            if seen is None or seen[0] != tag:
                self._strangers[slot] = (tag, now)
            elif now - seen[1] >= self.settings.abort_timeout_s:
                self.inbox[slot, :HEADER] = 0
                del self._strangers[slot]


# ====================================================================== decode side


class _R(enum.Enum):
    LINK = "link to the prefill worker"
    READ = "inbox read"
    ANNOUNCE = "plan push"
    WAIT = "layers"
    ABANDON = "abandon"


@dataclass
class _Recv:
    task: LayerwiseRecvTask
    peer: WorkerAddress
    tag: bytes
    record: int
    deadline: float
    step: _R = _R.LINK
    handle: llm_datadist.TransferHandle | None = None
    slot: int = -1
    next_beat: float = 0.0
    grace_until: float = float("inf")
    t0: float = 0.0
    beat: bool = False  # the handle in flight is a heartbeat read


class LayerwiseConsumer:
    """A decode worker's layer-wise receives. Registers its landing records (by key: the
    prefill pushes DONE into them) and a local buffer for plans and inbox reads."""

    def __init__(self, dd: llm_datadist.LLMDataDist, settings: Settings,
                 address: WorkerAddress, linker: Any, slots: int, block_bytes: int,
                 on_done: Callable[[LayerwiseRecvTask, float, int], None]) -> None:
        self._dd, self.settings, self._linker = dd, settings, linker
        self._address = address  # where we listen: the prefill links here to push
        self._cluster_id = address.cluster_id
        self._block_bytes = block_bytes
        self._on_done = on_done
        self.landing = mailbox.Mailbox(slots)
        self._buf = np.zeros((slots * (1 + WINDOW), RECORD), np.uint8)
        cm = dd.cache_manager
        cm.register_blocks_cache(
            llm_datadist.CacheDesc(1, [slots, mailbox.RECORD_BYTES],
                                   llm_datadist.DataType.DT_UINT8),
            [self.landing.buf.ctypes.data],
            llm_datadist.BlocksCacheKey(address.cluster_id, LANDING_MODEL_ID))
        self._buf_cache = cm.register_blocks_cache(
            llm_datadist.CacheDesc(1, list(self._buf.shape), llm_datadist.DataType.DT_UINT8),
            [self._buf.ctypes.data])
        self._free = list(range(slots))
        self._waiting: list[LayerwiseRecvTask] = []
        self._recvs: list[_Recv] = []
        self._draining: list[tuple[int, llm_datadist.TransferHandle]] = []
        self._rank = 0

    @property
    def active(self) -> bool:
        return bool(self._waiting) or bool(self._recvs)

    @property
    def waiting_for_layers(self) -> bool:
        """Whether a request waits for its prefill's DONE (its plan announced)."""
        return any(r.step is _R.WAIT for r in self._recvs)

    def landed(self) -> bool:
        """Whether a waiting request's DONE is in (local memory; never blocks)."""
        return any(r.step is _R.WAIT and self.landing.is_done(r.record, r.tag)
                   for r in self._recvs)

    def submit(self, tasks: list[LayerwiseRecvTask], rank: int) -> None:
        self._waiting.extend(tasks)
        self._rank = rank
        for t in tasks:
            if rank < len(t.remote.workers):
                self._linker.want(t.remote.workers[rank])

    def poll(self) -> tuple[set[str], set[str]]:
        """(received, failed) since the last call. Never blocks."""
        done: set[str] = set()
        failed: set[str] = set()
        for record, h in list(self._draining):
            if h.done():
                self._draining.remove((record, h))
                self.landing.clear(record)
                self._free.append(record)
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
                    raise ValueError(f"{len(t.local_block_ids)} blocks; a layer-wise plan "
                                     f"names at most {MAX_BLOCKS}")
                r.peer = t.remote.workers[self._rank]
                r.tag = bytes.fromhex(t.remote.tag)
                self.landing.clear(r.record)
            except Exception as e:  # noqa: BLE001
                self._end(r, failed, f"{e}")
        for r in list(self._recvs):
            for _ in range(len(_R) + 1):
                try:
                    moved = self._advance(r, done, failed)
                except Exception as e:  # noqa: BLE001 - every failure fails the request
                    self._end(r, failed, f"{r.step.value}: {e}")
                    break
                if not moved or r not in self._recvs:
                    break
        return done | failed, failed

    def _advance(self, r: _Recv, done: set[str], failed: set[str]) -> bool:
        now = time.monotonic()
        if r.step in (_R.WAIT, _R.ABANDON) and self.landing.is_done(r.record, r.tag):
            if r.handle is not None and not r.handle.done():
                return False  # our read or write still uses the buffer: end after it
            seconds = time.perf_counter() - r.t0
            self._on_done(r.task, seconds, r.peer.cluster_id)
            self._end(r, done, None)
            return True
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
            r.step = _R.READ
            base = r.record * (1 + WINDOW)
            r.handle = self._dd.cache_manager.pull_blocks_async(
                self._key(r, INBOX_MODEL_ID), self._buf_cache, window(r.tag),
                list(range(base + 1, base + 1 + WINDOW)))
            return True
        if r.handle is not None:
            if not r.handle.done():
                return False
            handle, r.handle = r.handle, None
            exc = handle.exception()
            if r.step is _R.ABANDON:
                if exc is not None:  # unreachable: so are its pushes
                    raise exc
                r.grace_until = now + self.settings.sync_kv_timeout_ms / 1e3 + 1.0
                return True
            if exc is not None:
                raise exc
            base = r.record * (1 + WINDOW)
            if r.step is _R.READ:
                slots = window(r.tag)
                for j in range(WINDOW):
                    if self._buf[base + 1 + j, 16] == FREE:
                        r.slot = slots[j]
                        break
                else:
                    raise RuntimeError("the prefill worker's inbox has no free slot for it")
                write_plan(self._buf[base], r.tag, PLAN, self._address, r.record,
                           r.task.local_block_ids)
                r.step = _R.ANNOUNCE
                r.t0 = time.perf_counter()
                r.handle = self._dd.cache_manager.push_blocks_async(
                    self._key(r, INBOX_MODEL_ID), self._buf_cache, [base], [r.slot])
                return True
            if r.step is _R.ANNOUNCE:
                r.step = _R.WAIT
                r.next_beat = now + HEARTBEAT_S
                return True
            if r.step is _R.WAIT and r.beat:  # heartbeat read landed in base + 1
                r.beat = False
                tag, state, _ = read_plan(self._buf[base + 1])
                if tag != r.tag or state != PLAN:
                    if self.landing.is_done(r.record, r.tag):
                        return True
                    why = "refused it" if tag == r.tag and state == REFUSED else \
                        "no longer has its plan"
                    raise RuntimeError(f"the prefill worker {why}")
                return True
            return True
        if r.step is _R.WAIT:
            if now >= r.deadline:
                base = r.record * (1 + WINDOW)
                self._buf[base, 16] = ABANDONED
                r.step = _R.ABANDON
                logger.warning("datadist: layer-wise request %s: no KV within %.1f s; "
                               "abandoning it", r.task.request_id,
                               self.settings.layerwise_timeout_s)
                r.handle = self._dd.cache_manager.push_blocks_async(
                    self._key(r, INBOX_MODEL_ID), self._buf_cache, [base], [r.slot])
                return True
            if now >= r.next_beat:
                r.next_beat = now + HEARTBEAT_S
                r.beat = True
                base = r.record * (1 + WINDOW)
                r.handle = self._dd.cache_manager.pull_blocks_async(
                    self._key(r, INBOX_MODEL_ID), self._buf_cache, [r.slot], [base + 1])
                return True
            return False
        if r.step is _R.ABANDON and now >= r.grace_until:
            raise TimeoutError(f"no KV within layerwise_timeout_s "
                               f"({self.settings.layerwise_timeout_s:.1f} s)")
        return False

    def _key(self, r: _Recv, model_id: int) -> llm_datadist.BlocksCacheKey:
        return llm_datadist.BlocksCacheKey(r.peer.cluster_id, model_id)

    def _end(self, r: _Recv, into: set[str], why: str | None) -> None:
        if why is not None:
            logger.warning("datadist: layer-wise request %s (tag %s) failed: %s",
                           r.task.request_id, r.task.remote.tag, why)
        into.add(r.task.request_id)
        if r in self._recvs:
            self._recvs.remove(r)
        if r.handle is not None and not r.handle.done():
            # a read or write of ours still uses the record: back to the pool when it ends
            self._draining.append((r.record, r.handle))
            return
        self.landing.clear(r.record)
        self._free.append(r.record)

    def close(self) -> None:
        self._waiting.clear()
        self._recvs.clear()
