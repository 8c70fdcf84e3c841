"""A hostile client against a live prompt process, over a raw TCP socket.

Frames are built with ``datadist.wire.protocol``, the way a buggy or malicious peer could.
What must hold: a connection that breaks the protocol gets an Error frame or is closed (and
nothing else); a well-formed request for bytes outside a registered cache gets an Error frame
with PARAM_INVALID and not one byte of data, and the connection stays usable; and afterwards
a well-behaved decoder still pulls the right bytes from the same prompt.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

import datadist as llm_datadist
from datadist.core.config import HostIdentity
from datadist.core.errors import Code
from datadist.testing.peers import CacheSpec, Decoder, PromptConfig, RunningPrompt, pattern
from datadist.wire import protocol as p

from ._support import PROMPT_ID, TRANSPORTS, assert_bytes_equal, local_name, units

pytestmark = pytest.mark.timeout(30)

SPEC = CacheSpec(4, (4, 8, 64))  # 4 tensors of 4096 B, slots of 1024 B
BLOCKS = CacheSpec(4, (16, 128))  # 16 blocks of 256 B
SEED, BLOCKS_SEED, MODEL = 11, 12, 3
CACHE_ID = 1
HOSTILE_ID = 666

PROMPT_CONFIG = PromptConfig(PROMPT_ID, setup=(
    ("register_cache", {"spec": SPEC, "seed": SEED, "req_ids": [41]}),
    ("register_blocks_cache", {"spec": BLOCKS, "seed": BLOCKS_SEED, "model_id": MODEL}),
))

U64_MAX = 2**64 - 1
WAIT_S = 5.0  # how long a raw client waits for the prompt's answer or close


class RawClient:
    """A socket plus the protocol's own frame decoder. Every wait is bounded."""

    def __init__(self, address: tuple[str, int] | bytes) -> None:
        if isinstance(address, bytes):  # the prompt's local channel (an abstract unix name)
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(WAIT_S)
            self.sock.connect(address)
        else:
            self.sock = socket.create_connection(address, timeout=WAIT_S)
        self.decoder = p.FrameDecoder()
        self.frames: list[tuple[int, p.Message | bytes]] = []
        self.closed = False

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def hello(self, cluster_id: int = HOSTILE_ID) -> p.Welcome:
        self.send(p.encode(p.Hello(cluster_id, 2, os.getpid(), 0, b"\0" * 16), 1))
        msg = self.next_frame()
        assert isinstance(msg, p.Welcome), msg
        assert msg.cluster_id == PROMPT_ID
        return msg

    def _fill(self, deadline: float) -> None:
        self.sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            data = self.sock.recv(1 << 16)
        except TimeoutError:
            raise AssertionError("the prompt neither answered nor closed in time") from None
        except ConnectionResetError:
            data = b""
        if not data:
            self.closed = True
            return
        self.frames.extend(self.decoder.feed(data))

    def next_frame(self) -> p.Message | bytes | None:
        """The next frame (or raw bytes), None once the prompt closed the connection."""
        deadline = time.monotonic() + WAIT_S
        while not self.frames and not self.closed:
            self._fill(deadline)
        return self.frames.pop(0)[1] if self.frames else None

    def until_closed(self) -> list[p.Message | bytes]:
        """Everything the prompt sends until it closes the connection."""
        out = []
        while (msg := self.next_frame()) is not None:
            out.append(msg)
        return out

    def call_expecting_error(self, msg: p.Message, code: int) -> p.Error:
        """Send a request that must be refused; check that exactly one Error frame comes back
        and that the connection still works (a Ping's Pong is the very next frame, so no
        data bytes were streamed in between)."""
        self.send(p.encode(msg, 7))
        err = self.next_frame()
        assert isinstance(err, p.Error), f"expected an Error frame, got {err!r}"
        assert err.code == code, f"code {err.code:#x} ({err.message}), expected {code:#x}"
        self.send(p.encode(p.Ping(0xC0FFEE), 8))
        pong = self.next_frame()
        assert pong == p.Pong(0xC0FFEE), f"expected our Pong, got {pong!r}"
        return err

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def raw(prompt: RunningPrompt) -> Iterator[Callable[[], RawClient]]:
    clients: list[RawClient] = []

    def connect() -> RawClient:
        clients.append(RawClient(prompt.address))
        return clients[-1]

    yield connect
    for c in clients:
        c.close()


@pytest.fixture(autouse=True)
def prompt_still_serves(prompt: RunningPrompt, make_decoder: Callable[..., Decoder],
                        monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """After every hostile test: the prompt is alive and a good decoder pulls the right bytes,
    on every data path."""
    yield
    assert prompt.peer.alive, "the prompt process died"
    want_slots = units(pattern(SPEC, SEED), SPEC)
    want_blocks = units(pattern(BLOCKS, BLOCKS_SEED), BLOCKS)
    for transport in TRANSPORTS:
        monkeypatch.setenv("DATADIST_TRANSPORT", transport)
        dec = make_decoder()
        assert dec.link(PROMPT_ID, prompt.address) == llm_datadist.LLMStatusCode.LLM_SUCCESS
        assert dec.path_name(PROMPT_ID) == transport
        cache, arr = dec.local(SPEC)
        dec.cm.pull_cache(llm_datadist.CacheKey(PROMPT_ID, 41), cache, 1)
        dec.cm.pull_cache(llm_datadist.CacheKeyByIdAndIndex(PROMPT_ID, CACHE_ID, 3), cache, 2)
        bcache, barr = dec.local(BLOCKS, blocks=True)
        dec.cm.pull_blocks(llm_datadist.BlocksCacheKey(PROMPT_ID, MODEL), bcache,
                           [15, 0, 7], [1, 2, 3])
        assert_bytes_equal(units(arr, SPEC)[:, 1], want_slots[:, 0])
        assert_bytes_equal(units(arr, SPEC)[:, 2], want_slots[:, 3])
        assert_bytes_equal(units(barr, BLOCKS)[:, 1:4], want_blocks[:, [15, 0, 7]])
        dec.close()


def read(key: p.KeyRef, offsets: list[int], lengths: list[int], tensors: list[int] = (0,),
         unit_bytes: int = 0, flags: p.ReadFlags = p.ReadFlags.NONE) -> p.Read:
    return p.Read(key, unit_bytes, flags, np.array(tensors, dtype=np.uint32),
                  np.array(offsets, dtype=np.uint64), np.array(lengths, dtype=np.uint64))


BY_ID = p.KeyRef(p.KeyKind.CACHE_ID, CACHE_ID, 0)


def assert_refused_and_closed(frames: list[p.Message | bytes]) -> None:
    """A protocol violation: at most Error frames, never data, then the close."""
    assert all(isinstance(f, p.Error) for f in frames), frames
    assert len(frames) <= 1, frames


# ------------------------------------------------------------------------ broken framing


def test_garbage_bytes(raw: Callable[[], RawClient]) -> None:
    c = raw()
    c.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(range(256)))
    # The prompt stops reading at the first bad header; closing with our garbage unread
    # may reset the connection before its Error frame is read, so either outcome is fine.
    assert_refused_and_closed(c.until_closed())


def test_garbage_header_gets_an_error_frame(raw: Callable[[], RawClient]) -> None:
    c = raw()
    c.send(b"\xde\xad" + bytes(range(10)))  # exactly one header's worth: read in full
    frames = c.until_closed()
    assert_refused_and_closed(frames)
    assert frames and frames[0].code == Code.SUSPECT_REMOTE_ERROR  # type: ignore[union-attr]


@pytest.mark.parametrize("after_hello", [False, True])
def test_huge_length(raw: Callable[[], RawClient], after_hello: bool) -> None:
    c = raw()
    if after_hello:
        c.hello()
    c.send(p.HEADER.pack(p.MAGIC, p.VERSION, p.MsgType.READ, 9, 0xFFFFFFFF))
    frames = c.until_closed()
    assert_refused_and_closed(frames)
    assert frames and frames[0].code == Code.SUSPECT_REMOTE_ERROR  # type: ignore[union-attr]


@pytest.mark.parametrize("after_hello", [False, True])
@pytest.mark.parametrize("cut", ["in-header", "in-payload"])
def test_truncated_frame(raw: Callable[[], RawClient], after_hello: bool, cut: str) -> None:
    c = raw()
    if after_hello:
        c.hello()
        frame = p.encode(read(BY_ID, [0], [16]), 3)
    else:
        frame = p.encode(p.Hello(HOSTILE_ID, 2, os.getpid(), 0, b"\0" * 16), 1)
    c.send(frame[:5] if cut == "in-header" else frame[:-3])
    c.sock.shutdown(socket.SHUT_WR)
    assert_refused_and_closed(c.until_closed())


def test_array_counts_larger_than_the_payload(raw: Callable[[], RawClient]) -> None:
    c = raw()
    c.hello()
    frame = bytearray(p.encode(read(BY_ID, [0], [16]), 4))
    # The span count is the last field of the fixed part: claim 10**9 spans.
    end = p.HEADER_SIZE + p.KeyRef._S.size + p.Read._S.size
    frame[end - 4:end] = struct.pack("<I", 10**9)
    c.send(bytes(frame))
    frames = c.until_closed()
    assert_refused_and_closed(frames)
    assert frames and frames[0].code == Code.SUSPECT_REMOTE_ERROR  # type: ignore[union-attr]


@pytest.mark.parametrize("first", ["ping", "read", "welcome"])
def test_request_before_hello(raw: Callable[[], RawClient], first: str) -> None:
    c = raw()
    msg = {"ping": p.Ping(1), "read": read(BY_ID, [0], [16]),
           "welcome": p.Welcome(HOSTILE_ID, 2, 1, 0, b"\0" * 16)}[first]
    c.send(p.encode(msg, 2))
    assert_refused_and_closed(c.until_closed())


def test_server_only_message_after_hello(raw: Callable[[], RawClient]) -> None:
    c = raw()
    c.hello()
    c.send(p.encode(p.ReadData(1 << 20), 5))
    assert_refused_and_closed(c.until_closed())


def test_hello_claiming_to_be_the_prompt_itself(raw: Callable[[], RawClient],
                                                prompt: RunningPrompt) -> None:
    """A link from an engine to itself is refused; the same cluster id from another process
    is a peer (vllm-ascend's V0 connector: cluster id = local rank on both sides)."""
    me = HostIdentity.current()
    c = raw()
    c.send(p.encode(p.Hello(PROMPT_ID, 2, prompt.pid, me.pid_ns, me.boot_id), 1))
    frames = c.until_closed()
    assert_refused_and_closed(frames)
    assert frames and frames[0].code == Code.LINK_FAILED  # type: ignore[union-attr]
    other = raw()
    other.send(p.encode(p.Hello(PROMPT_ID, 2, os.getpid(), me.pid_ns, me.boot_id), 1))
    assert isinstance(other.next_frame(), p.Welcome)


# --------------------------------------------------------------- well-formed, out of range

T = SPEC.tensor_bytes
OUT_OF_RANGE = {
    "offset-past-tensor": read(BY_ID, [T], [16]),
    "span-crosses-tensor-end": read(BY_ID, [T - 8], [16]),
    "length-wraps-around": read(BY_ID, [64], [U64_MAX - 32]),
    "offset-wraps-around": read(BY_ID, [U64_MAX - 7], [16]),
    "past-slot-3-end": read(p.KeyRef(p.KeyKind.CACHE_ID, CACHE_ID, 3), [1000], [100]),
    "one-bad-span-among-good": read(BY_ID, [0, 512, T], [16, 16, 1]),
    "tensor-index": read(BY_ID, [0], [16], tensors=[0, 4]),
    "tensor-index-u32-max": read(BY_ID, [0], [16], tensors=[2**32 - 1]),
    "batch-index": read(p.KeyRef(p.KeyKind.CACHE_ID, CACHE_ID, 4), [0], [16]),
    "by-req-id": read(p.KeyRef(p.KeyKind.CACHE_KEY, 41, 0, U64_MAX), [T - 512], [1024]),
    "blocks-past-end": read(p.KeyRef(p.KeyKind.BLOCKS_KEY, 0, MODEL), [BLOCKS.tensor_bytes],
                            [256], unit_bytes=256),
    "blocks-wrong-block-size": read(p.KeyRef(p.KeyKind.BLOCKS_KEY, 0, MODEL), [0], [512],
                                    unit_bytes=512),
}


@pytest.mark.parametrize("flags", [p.ReadFlags.NONE, p.ReadFlags.GRANT], ids=["data", "grant"])
@pytest.mark.parametrize("name", sorted(OUT_OF_RANGE))
def test_read_outside_registered_cache(raw: Callable[[], RawClient], name: str,
                                       flags: p.ReadFlags) -> None:
    c = raw()
    c.hello()
    msg = OUT_OF_RANGE[name]
    msg = p.Read(msg.key, msg.unit_bytes, flags, msg.tensors, msg.offsets, msg.lengths)
    c.call_expecting_error(msg, Code.PARAM_INVALID)
    # The same connection still serves a valid request, with exactly the bytes asked for.
    c.send(p.encode(read(BY_ID, [100], [28], tensors=[2]), 9))
    assert c.next_frame() == p.ReadData(28)
    assert c.next_frame() == pattern(SPEC, SEED)[2, 100:128].tobytes()


def test_small_read_naming_too_many_spans(raw: Callable[[], RawClient]) -> None:
    """5000 tensor indexes x 5000 spans is a 120 kB frame, but 25M iovecs for the owner to
    build (~0.5 GB); it must refuse instead. The span count is in range, so it is the
    product that is refused."""
    c = raw()
    c.hello()
    n = 5000
    msg = p.Read(BY_ID, 0, p.ReadFlags.NONE, np.zeros(n, np.uint32), np.zeros(n, np.uint64),
                 np.ones(n, np.uint64))
    c.call_expecting_error(msg, Code.PARAM_INVALID)


@pytest.mark.parametrize("key", [
    p.KeyRef(p.KeyKind.CACHE_ID, 99, 0),
    p.KeyRef(p.KeyKind.CACHE_KEY, 424242, 0, U64_MAX),
    p.KeyRef(p.KeyKind.BLOCKS_KEY, 0, 31337),
], ids=["cache-id", "req-id", "blocks-model"])
def test_read_of_unknown_cache(raw: Callable[[], RawClient], key: p.KeyRef) -> None:
    c = raw()
    c.hello()
    c.call_expecting_error(read(key, [0], [16]), Code.KV_CACHE_NOT_EXIST)


def test_write_outside_registered_cache_lands_nothing(raw: Callable[[], RawClient]) -> None:
    """A push to spans outside the cache is refused before any byte is accepted; the raw
    bytes a hostile client sends anyway are then read as (bad) frames, and the connection
    closes. The autouse check afterwards proves the cache is unchanged."""
    c = raw()
    c.hello()
    msg = p.Write(BY_ID, 0, 0, np.array([0], np.uint32), np.array([T - 4], np.uint64),
                  np.array([64], np.uint64))
    c.send(p.encode(msg, 3) + b"\xff" * p.HEADER_SIZE)  # the data, sent without waiting
    frames = c.until_closed()
    assert frames, "expected an Error frame"
    assert isinstance(frames[0], p.Error) and frames[0].code == Code.PARAM_INVALID, frames
    assert all(isinstance(f, p.Error) for f in frames), frames


def test_release_of_a_lease_never_granted_is_ignored(raw: Callable[[], RawClient]) -> None:
    c = raw()
    c.hello()
    c.send(p.encode(p.Release(123456, True), 4) + p.encode(p.Ping(5), 5))
    assert c.next_frame() == p.Pong(5)


def test_grant_never_released_is_dropped_with_the_connection(
        raw: Callable[[], RawClient], prompt: RunningPrompt) -> None:
    """A same-host reader that takes a grant and vanishes without Release must not pin the
    cache: unregister_cache (which waits for live leases) returns once it is gone."""
    cache_id = prompt.call("register_cache", spec=SPEC, seed=99)
    c = RawClient(local_name(prompt.pid, PROMPT_ID))  # grants: only on the local channel
    c.hello()
    c.send(p.encode(read(p.KeyRef(p.KeyKind.CACHE_ID, cache_id, 0), [0], [64],
                         flags=p.ReadFlags.GRANT), 2))
    grant = c.next_frame()
    assert isinstance(grant, p.Grant) and len(grant.bases) == 1, grant
    c.close()
    # A leaked lease would hold unregister_cache for its full 30 s wait: the call times out.
    prompt.call("unregister_cache", timeout=20, cache_id=cache_id)


def test_many_hostile_connections_at_once(raw: Callable[[], RawClient]) -> None:
    clients = [raw() for _ in range(32)]
    for i, c in enumerate(clients):
        c.send(struct.pack("<I", 0xDEADBEEF) * (i + 3))
    for c in clients:
        assert_refused_and_closed(c.until_closed())
