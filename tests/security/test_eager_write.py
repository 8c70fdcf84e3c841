"""The eager WRITE (docs/protocol.md, "Push"): a push of at most EAGER_MAX bytes in one round
trip, its bytes right behind the request, sent only to an owner whose WELCOME set
FEATURE_EAGER_WRITE.

Owners are the core's engines in this process on loopback; hostile clients speak the wire by
hand (_hand.py); an owner of an earlier revision is a fake that speaks it by hand. Each test
fails on the code before (an owner that set no bit and refused any WRITE flag as malformed, a
link that waited for a go-ahead on every push).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Any

import numpy as np
import pytest
from _hand import PROMPT, SOCK_TIMEOUT, Raw, make

import datadist as llm
from datadist.api.cache_manager import CacheManager
from datadist.core.errors import Code
from datadist.core.native import NativeEngine
from datadist.testing.fakes import FakeServer
from datadist.wire import protocol as p

pytestmark = pytest.mark.timeout(60)

MODEL = 4
BLOCK = 64 << 10  # a blocks cache of 64 blocks of 64 KiB: 4 MiB a tensor


def owner_cache(engines: list[NativeEngine]) -> tuple[NativeEngine, np.ndarray]:
    """An owner (PROMPT, listening) with one remote-accessible blocks cache under
    BlocksCacheKey(PROMPT, MODEL), zeros."""
    owner = make(engines, PROMPT)
    cm = CacheManager(owner, remote_cache_accessible=True)
    desc = llm.CacheDesc(1, [64, BLOCK], llm.DataType.DT_UINT8, llm.Placement.DEVICE)
    arr = np.zeros((1, 64 * BLOCK), np.uint8)
    cm.register_blocks_cache(desc, [int(arr[0].ctypes.data)], llm.BlocksCacheKey(PROMPT, MODEL))
    return owner, arr


def eager(model: int, offset: int, n: int) -> p.Write:
    """An eager WRITE of ``n`` bytes at ``offset`` of tensor 0 of blocks model ``model``."""
    return p.Write(p.KeyRef(p.KeyKind.BLOCKS_KEY, 0, model), 0, p.WRITE_EAGER,
                   np.array([0], np.uint32), np.array([offset], np.uint64),
                   np.array([n], np.uint64))


def linked(owner: NativeEngine, cluster_id: int) -> Raw:
    raw = Raw(owner.listen_address)
    welcome = raw.hello(cluster_id)
    assert isinstance(welcome, p.Welcome), welcome
    assert welcome.features & p.FEATURE_EAGER_WRITE, welcome.features
    return raw


def data(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def test_a_refused_eager_write_is_drained_and_the_next_request_served(
        engines: list[NativeEngine]) -> None:
    owner, arr = owner_cache(engines)
    raw = linked(owner, 100)
    try:
        # refused three ways: no such cache, a span past the tensor, a 0-byte span; 3 MiB each
        # (more than the socket holds: drained across the owner's parks)
        n = 3 << 20
        for rid, (msg, code) in enumerate([
                (eager(MODEL + 1, 0, n), Code.KV_CACHE_NOT_EXIST),
                (eager(MODEL, 64 * BLOCK - n + 1, n), Code.PARAM_INVALID),
                (eager(MODEL, 0, 0), Code.PARAM_INVALID)], start=2):
            body = data(int(msg.lengths[0]), rid)
            raw.sock.sendall(p.encode(msg, rid) + body)
            got = raw.next()
            assert got is not None and got[0] == rid, got
            assert isinstance(got[1], p.Error) and got[1].code == int(code), got
            raw.send(p.Ping(rid), 50 + rid)  # the same connection serves the next request
            assert raw.next() == (50 + rid, p.Pong(rid))
        assert not arr.any()  # nothing landed
        body = data(1 << 20, 9)
        raw.sock.sendall(p.encode(eager(MODEL, BLOCK, 1 << 20), 20) + body)
        assert raw.next() == (20, p.Ok())
        assert arr[0, BLOCK:BLOCK + (1 << 20)].tobytes() == body
    finally:
        raw.close()


def test_a_total_that_disagrees_with_the_bytes_sent_closes_the_connection(
        engines: list[NativeEngine]) -> None:
    """16 bytes more than the request's total: read as the next frame's header, a bad
    magic: ERROR (request id 0), then closed. The WRITE's own answer comes first."""
    owner, arr = owner_cache(engines)
    for model, answer in ((MODEL, p.Ok), (MODEL + 1, p.Error)):
        raw = linked(owner, 101)
        try:
            raw.sock.sendall(p.encode(eager(model, 0, 64), 2) + data(64, 1) + b"X" * 16)
            got = raw.next()
            assert got is not None and got[0] == 2 and isinstance(got[1], answer), got
            got = raw.next()
            assert got is not None and got[0] == 0 and isinstance(got[1], p.Error), got
            assert "magic" in got[1].message
            assert raw.next() is None
        finally:
            raw.close()
    assert arr[0, :64].tobytes() == data(64, 1)


def test_an_eager_write_over_the_bound_is_refused_and_closed(
        engines: list[NativeEngine]) -> None:
    """No count of bytes the owner may drain: ERROR, then closed, before any byte of it is
    read (the encoder refuses to say it: the flag is set in a plain WRITE's frame)."""
    owner, _ = owner_cache(engines)
    plain = p.Write(p.KeyRef(p.KeyKind.BLOCKS_KEY, 0, MODEL), 0, 0, np.array([0], np.uint32),
                    np.array([0], np.uint64), np.array([p.EAGER_MAX + 1], np.uint64))
    with pytest.raises(p.LocalProtocolError):
        p.encode(eager(MODEL, 0, p.EAGER_MAX + 1))
    frame = bytearray(p.encode(plain, 2))
    frame[p.HEADER_SIZE + 25 + 16] = p.WRITE_EAGER  # flags: after the key, unit_bytes, layout
    raw = linked(owner, 102)
    try:
        raw.sock.sendall(bytes(frame))
        got = raw.next()
        assert got is not None and isinstance(got[1], p.Error) and "eager" in got[1].message, got
        assert raw.next() is None
    finally:
        raw.close()


def test_a_stalled_eager_writer_holds_no_thread(engines: list[NativeEngine]) -> None:
    """Writers stalled mid-push (accepted and refused alike), more of them than the owner has
    I/O threads: parked, so an honest client's requests are served at once meanwhile (the
    owner closes them at its stalled-writer deadline, 120 s: the GoogleTest
    EagerWrite.AStalledEagerWriterIsParkedAndClosedAtItsDeadline shortens it)."""
    owner, _ = owner_cache(engines)
    stalled = []
    try:
        for i in range(10):
            raw = linked(owner, 200 + i)
            msg = eager(MODEL + (i % 2), 0, 1 << 20)
            raw.sock.sendall(p.encode(msg, 2) + data((1 << 20) - 100, i))  # 100 bytes short
            stalled.append(raw)
        honest = linked(owner, 300)
        try:
            t0 = time.monotonic()
            for rid in range(2, 12):
                honest.sock.sendall(p.encode(eager(MODEL, 2 * BLOCK, 4096), rid) + data(4096, rid))
                assert honest.next() == (rid, p.Ok())
            assert time.monotonic() - t0 < 2.0
        finally:
            honest.close()
        for raw in stalled:  # none was answered
            raw.sock.settimeout(0.2)
            with pytest.raises(TimeoutError):
                raw.sock.recv(1)
    finally:
        for raw in stalled:
            raw.close()


class OldOwner(FakeServer):
    """An owner that speaks the wire by hand: WELCOME with ``features`` (another host's: the
    link stays on TCP), then WRITEs served as the flag each carries says (the go-ahead OK only
    without WRITE_EAGER, as an owner of an earlier revision serves every WRITE), each one's
    flags and bytes recorded; PING, BYE. An owner of an earlier revision set no
    FEATURE_EAGER_WRITE and closed the connection on a flagged WRITE."""

    def __init__(self, cluster_id: int, features: int) -> None:
        self.cluster_id, self.features = cluster_id, features
        self.writes: list[tuple[int, bytes]] = []
        super().__init__(conn_timeout=SOCK_TIMEOUT)

    def _serve(self, conn: socket.socket) -> None:
        dec = p.FrameDecoder()
        pending: list[Any] = []

        def item() -> Any:
            while not pending:
                chunk = conn.recv(1 << 16)
                if not chunk:
                    raise EOFError
                pending.extend(dec.feed(chunk))
            return pending.pop(0)

        with contextlib.suppress(OSError, EOFError), conn:
            while not self._closing.is_set():
                rid, msg = item()
                if isinstance(msg, p.Hello):
                    conn.sendall(p.encode(p.Welcome(self.cluster_id, 1, 1, 0, b"\0" * 16,
                                                    self.features), rid))
                elif isinstance(msg, p.Write):
                    if not msg.flags & p.WRITE_EAGER:
                        conn.sendall(p.encode(p.Ok(), rid))  # go ahead
                    _, body = item()
                    self.writes.append((int(msg.flags), body))
                    conn.sendall(p.encode(p.Ok(), rid))
                elif isinstance(msg, p.Ping):
                    conn.sendall(p.encode(p.Pong(msg.nonce), rid))
                elif isinstance(msg, p.Bye):
                    conn.sendall(p.encode(p.Ok(), rid))
                    return
                else:
                    conn.sendall(p.encode(p.Error(int(Code.PARAM_INVALID), "not served"), rid))


@pytest.mark.parametrize("features", [0, p.FEATURE_EAGER_WRITE])
def test_the_eager_form_goes_only_to_an_owner_that_set_the_bit(
        engines: list[NativeEngine], features: int) -> None:
    """Pushes of 64 B, 64 KiB and 4 MiB (the bound) and one of 4 MiB + 64 KiB through the
    core's link: to an owner without the bit every one takes the two steps (flags 0); to one
    with it every one up to the bound is eager (the fake sends no go-ahead for those: a link
    that waited for one would time out), the larger one two steps. The bytes land either way."""
    client = make(engines, 500, listen=False)
    cm = CacheManager(client, remote_cache_accessible=True)
    desc = llm.CacheDesc(1, [80, BLOCK], llm.DataType.DT_UINT8, llm.Placement.DEVICE)
    src = np.random.default_rng(5).integers(0, 256, (1, 80 * BLOCK), dtype=np.uint8)
    cache = cm.register_blocks_cache(desc, [int(src[0].ctypes.data)])
    with OldOwner(PROMPT, features) as owner:
        client.link(PROMPT, *owner.address, 5.0)
        pushes = [[0], [1], list(range(2, 66)), list(range(2, 68))]
        for blocks in pushes:
            cm.push_blocks(llm.BlocksCacheKey(PROMPT, MODEL), cache, blocks, blocks)
        client.unlink(PROMPT, 5.0)
    bound = p.EAGER_MAX // BLOCK
    want = [p.WRITE_EAGER if features and len(b) <= bound else 0 for b in pushes]
    assert [f for f, _ in owner.writes] == want
    for blocks, (_, body) in zip(pushes, owner.writes, strict=True):
        assert body == src[0, blocks[0] * BLOCK:(blocks[-1] + 1) * BLOCK].tobytes()


class Tap:
    """A TCP relay in front of ``owner`` that records the flags of every WRITE the client
    sends through it, and (``back_write_flags``) of every WRITE the owner sends back, on a
    reverse channel (the bytes pass unchanged, both ways)."""

    def __init__(self, owner: tuple[str, int]) -> None:
        self.owner = owner
        self.write_flags: list[int] = []
        self.back_write_flags: list[int] = []
        self._server = socket.create_server(("127.0.0.1", 0))
        self._server.settimeout(0.2)
        self.address: tuple[str, int] = self._server.getsockname()[:2]
        self._closing = threading.Event()
        self._socks: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closing.set()
        self._thread.join(5)
        for s in [self._server, *self._socks]:
            with contextlib.suppress(OSError):
                s.close()

    def _accept(self) -> None:
        while not self._closing.is_set():
            try:
                client, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            owner = socket.create_connection(self.owner, timeout=SOCK_TIMEOUT)
            for s in (client, owner):
                s.settimeout(None)
                self._socks.append(s)
            threading.Thread(target=self._pipe, args=(client, owner, self.write_flags),
                             daemon=True).start()
            threading.Thread(target=self._pipe, args=(owner, client, self.back_write_flags),
                             daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, flags: list[int]) -> None:
        dec = p.FrameDecoder()
        with contextlib.suppress(OSError):
            while chunk := src.recv(1 << 16):
                dst.sendall(chunk)
                for _, msg in dec.feed(chunk):
                    if isinstance(msg, p.Write):
                        flags.append(int(msg.flags))
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)


class Sync(llm.LayerSynchronizer):
    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        return True


def test_pushes_and_layer_wise_sends_over_tcp_land_the_right_bytes(
        engines: list[NativeEngine]) -> None:
    """With eager WRITEs on (the core's owner sets the bit): push_blocks of one block, of
    the bound and above it, push_cache, and transfer_cache_async of 32 layers (by blocks key
    and by raw addresses) over TCP land exactly the sender's bytes, and the pushes up to the
    bound went eagerly (the relay saw their flags)."""
    owner = make(engines, PROMPT, transport="tcp")
    ocm = CacheManager(owner, remote_cache_accessible=True)
    sender = make(engines, 600, listen=False, transport="tcp")
    scm = CacheManager(sender, remote_cache_accessible=True)
    layers, blocks, block = 32, 8, 4096
    shape = [blocks, block]
    desc = llm.CacheDesc(2 * layers, shape, llm.DataType.DT_UINT8, llm.Placement.DEVICE)
    dst = np.zeros((2 * layers, blocks * block), np.uint8)
    src = np.random.default_rng(11).integers(0, 256, dst.shape, dtype=np.uint8)
    ocm.register_blocks_cache(desc, [int(t.ctypes.data) for t in dst],
                              llm.BlocksCacheKey(PROMPT, MODEL))
    scache = scm.register_blocks_cache(desc, [int(t.ctypes.data) for t in src])
    big = llm.CacheDesc(1, [2, 6 << 20], llm.DataType.DT_UINT8, llm.Placement.DEVICE)
    bdst = np.zeros((1, 12 << 20), np.uint8)
    bsrc = np.random.default_rng(12).integers(0, 256, bdst.shape, dtype=np.uint8)
    bcache_dst = ocm.register_cache(big, [int(bdst[0].ctypes.data)])
    bcache_src = scm.register_cache(big, [int(bsrc[0].ctypes.data)])
    tap = Tap(owner.listen_address)
    try:
        sender.link(PROMPT, *tap.address, 5.0)
        key = llm.BlocksCacheKey(PROMPT, MODEL)
        scm.push_blocks(key, scache, [3], [5])  # 64 tensors x 4 KiB: 256 KiB, eager
        np.testing.assert_array_equal(dst[:, 5 * block:6 * block], src[:, 3 * block:4 * block])
        # a 6 MiB slot: above the bound, two steps
        scm.push_cache(llm.CacheKeyByIdAndIndex(PROMPT, bcache_dst.cache_id, 1), bcache_src, 0)
        np.testing.assert_array_equal(bdst[0, 6 << 20:], bsrc[0, :6 << 20])
        dst[...] = 0
        by_key = llm.TransferWithCacheKeyConfig(key, range(0, layers), range(0, layers))
        task = scm.transfer_cache_async(scache, Sync(), [by_key], list(range(blocks)),
                                        list(range(blocks)))
        assert task.synchronize(10_000) == llm.LLMStatusCode.LLM_SUCCESS
        np.testing.assert_array_equal(dst, src)
        sender.unlink(PROMPT, 5.0)
        # by raw addresses: a sender without remote_cache_accessible (that mode's push)
        raw_sender = make(engines, 601, listen=False, transport="tcp")
        rcm = CacheManager(raw_sender)
        rcache = rcm.register_blocks_cache(desc, [int(t.ctypes.data) for t in src])
        raw_sender.link(PROMPT, *tap.address, 5.0)
        dst[...] = 0
        cfg = llm.TransferConfig(PROMPT, [int(t.ctypes.data) for t in dst])
        task = rcm.transfer_cache_async(rcache, Sync(), [cfg], list(range(blocks)),
                                        list(range(blocks)))
        assert task.synchronize(10_000) == llm.LLMStatusCode.LLM_SUCCESS
        np.testing.assert_array_equal(dst, src)
        raw_sender.unlink(PROMPT, 5.0)
    finally:
        tap.close()
    eager_writes = [f for f in tap.write_flags if f & p.WRITE_EAGER]
    # the one block, and the 2 x 32 layers (64 KiB each); the 6 MiB slot in two steps
    assert len(eager_writes) >= 1 + 2 * layers, tap.write_flags
    assert 0 in tap.write_flags, tap.write_flags


def test_the_listeners_pushes_on_a_reverse_channel_go_eagerly(
        engines: list[NativeEngine]) -> None:
    """The linker's reverse HELLO sets FEATURE_EAGER_WRITE (it serves eager WRITEs there as
    its listener would): the listener's push_blocks up to the bound, and its
    transfer_cache_async of 32 layers, reach the linker in one round trip each (the relay saw
    the flag on the WRITEs coming back), a 6 MiB push in two steps; every byte lands."""
    listener = make(engines, PROMPT, transport="tcp")
    lcm = CacheManager(listener, remote_cache_accessible=True)
    linker_id = 700
    linker = make(engines, linker_id, listen=False, transport="tcp")
    kcm = CacheManager(linker, remote_cache_accessible=True)
    layers, blocks, block = 32, 8, 4096
    desc = llm.CacheDesc(2 * layers, [blocks, block], llm.DataType.DT_UINT8,
                         llm.Placement.DEVICE)
    dst = np.zeros((2 * layers, blocks * block), np.uint8)
    src = np.random.default_rng(21).integers(0, 256, dst.shape, dtype=np.uint8)
    key = llm.BlocksCacheKey(linker_id, MODEL)
    kcm.register_blocks_cache(desc, [int(t.ctypes.data) for t in dst], key)
    lcache = lcm.register_blocks_cache(desc, [int(t.ctypes.data) for t in src])
    big = llm.CacheDesc(1, [2, 6 << 20], llm.DataType.DT_UINT8, llm.Placement.DEVICE)
    bdst = np.zeros((1, 12 << 20), np.uint8)
    bsrc = np.random.default_rng(22).integers(0, 256, bdst.shape, dtype=np.uint8)
    bcache_dst = kcm.register_cache(big, [int(bdst[0].ctypes.data)])
    bcache_src = lcm.register_cache(big, [int(bsrc[0].ctypes.data)])
    tap = Tap(listener.listen_address)
    try:
        linker.link(PROMPT, *tap.address, 5.0)
        lcm.push_blocks(key, lcache, [3], [5])  # 64 tensors x 4 KiB: eager
        np.testing.assert_array_equal(dst[:, 5 * block:6 * block], src[:, 3 * block:4 * block])
        lcm.push_cache(llm.CacheKeyByIdAndIndex(linker_id, bcache_dst.cache_id, 1),
                       bcache_src, 0)  # a 6 MiB slot: two steps
        np.testing.assert_array_equal(bdst[0, 6 << 20:], bsrc[0, :6 << 20])
        dst[...] = 0
        by_key = llm.TransferWithCacheKeyConfig(key, range(0, layers), range(0, layers))
        task = lcm.transfer_cache_async(lcache, Sync(), [by_key], list(range(blocks)),
                                        list(range(blocks)))
        assert task.synchronize(10_000) == llm.LLMStatusCode.LLM_SUCCESS
        np.testing.assert_array_equal(dst, src)
        linker.unlink(PROMPT, 5.0)
    finally:
        tap.close()
    assert not tap.write_flags, tap.write_flags  # the linker pushed nothing
    eager_writes = [f for f in tap.back_write_flags if f & p.WRITE_EAGER]
    assert len(eager_writes) >= 2, tap.back_write_flags  # the block, and the layers' requests
    assert 0 in tap.back_write_flags, tap.back_write_flags  # the 6 MiB slot
