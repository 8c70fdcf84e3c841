"""Checksummed pulls (datadist.VerifyChecksum) on the C++ core, owner and reader.

The rules (docs/protocol.md, "CHECKSUM"): the owner follows its answer with a CHECKSUM frame
(zlib's CRC-32 of the source spans); the reader checks what landed, says so (streamed:
RELEASE lease 0 with the READ's id; granted: its RELEASE's ok) and raises IntegrityError
(LLM_SUSPECT_REMOTE_ERROR) on a mismatch; a CacheKey is consumed only by a read the reader
confirmed. The core reads from the core here; its owner is also driven by raw readers that
deny or withhold their verdict, and its reader by a raw owner that lies (tests/security/
test_integrity.py::test_checksum_mismatch_raises).
"""

from __future__ import annotations

import os
import socket
import time
import zlib
from collections.abc import Iterator

import numpy as np
import pytest
from _hand import LyingOwner, local_name

from datadist.core.config import EngineConfig
from datadist.core.errors import CacheNotFound, IntegrityError
from datadist.core.keys import KeyId
from datadist.core.layout import Geometry, every_tensor, plan_slot
from datadist.core.native import NativeEngine
from datadist.memory.pool import PoolConfig
from datadist.wire import protocol as p

pytestmark = pytest.mark.timeout(60)


class Raw:
    """A hand-driven client speaking the wire (as test_owner_limits.py's)."""

    def __init__(self, where: int | bytes) -> None:
        if isinstance(where, bytes):  # the owner's local channel
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(5.0)
            self.sock.connect(where)
        else:
            self.sock = socket.create_connection(("127.0.0.1", where), timeout=5.0)
        self.dec = p.FrameDecoder()
        self.items: list = []

    def send(self, msg: p.Message, rid: int) -> None:
        self.sock.sendall(p.encode(msg, rid))

    def next(self):  # type: ignore[no-untyped-def]
        """The next frame (or raw bytes item)."""
        while not self.items:
            chunk = self.sock.recv(1 << 20)
            assert chunk, "the owner closed the connection"
            self.items.extend(self.dec.feed(chunk))
        return self.items.pop(0)

    def hello(self) -> None:
        self.send(p.Hello(77, 2, 1, 0, b"\x01" * 16, 0, b""), 1)
        assert isinstance(self.next()[1], p.Welcome)

    def close(self) -> None:
        self.sock.close()


# "tcp": TCP forced on the puller; "host": the same-host path (the core grants above 64 KiB,
# so the caches here are bigger than that).
TRANSPORTS = {"tcp": "tcp", "host": None}
TENSOR = 96 << 10  # bytes per tensor: above the core's 64 KiB streaming threshold


def _owner() -> NativeEngine:
    return NativeEngine(EngineConfig(cluster_id=1, role=1, listen=("127.0.0.1", 0),
                                     host_pool=PoolConfig(16 << 20, 16)))


def _puller(transport: str, verify: bool = True) -> NativeEngine:
    return NativeEngine(EngineConfig(cluster_id=2, role=2, transport=TRANSPORTS[transport],
                                     verify=verify))


@pytest.fixture(params=list(TRANSPORTS))
def engines(request: pytest.FixtureRequest) -> Iterator[tuple[NativeEngine, NativeEngine]]:
    owner = _owner()
    puller = _puller(request.param)
    try:
        assert owner.listen_address is not None
        host, port = owner.listen_address
        puller.link(1, host, port, 5.0)
        assert puller.get_link(1).path == ("tcp" if request.param == "tcp" else "cma")
        yield owner, puller
    finally:
        puller.close()
        owner.close()


def _keyed(owner: NativeEngine, req_id: int = 7) -> np.ndarray:
    """A pool cache of the owner bound to CacheKey(req_id), filled with a pattern."""
    entry = owner.allocate(Geometry(2, TENSOR, 1), placement=0, keys=[KeyId(req_id, 0)])
    want = np.empty((2, TENSOR), np.uint8)
    for t in range(2):
        view = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * TENSOR).from_address(
            int(entry.addrs[t])))
        view[:] = (np.arange(TENSOR) * (t + 3)) % 253
        want[t] = view
    return want


def _pull(puller: NativeEngine, req_id: int = 7, *, asynchronous: bool = False) -> np.ndarray:
    dst = np.zeros((2, TENSOR), np.uint8)
    local = puller.register(Geometry(2, TENSOR, 1),
                            [dst.ctypes.data, dst.ctypes.data + TENSOR], placement=0)
    try:
        plan = plan_slot(local.geometry, 0, every_tensor(2))
        key = p.KeyRef(p.KeyKind.CACHE_KEY, req_id, 0, 2**64 - 1)
        if asynchronous:
            handle = puller.pull_async(1, key, 0, plan, local.cache_id, 5.0)
            assert handle.wait(10.0)
            error = handle.error()
            if error is not None:
                raise error
        else:
            puller.pull(1, key, 0, plan, local.cache_id, 5.0)
        return dst
    finally:
        puller.unregister(local.cache_id)


def test_a_checked_pull_lands_and_consumes_its_key(engines) -> None:
    owner, puller = engines
    want = _keyed(owner)
    assert np.array_equal(_pull(puller), want)
    with pytest.raises(CacheNotFound):  # the confirmed read consumed the key
        _pull(puller)


@pytest.mark.parametrize("asynchronous", [False, True], ids=["pull", "pull_async"])
def test_the_core_catches_a_lying_owner(asynchronous: bool) -> None:
    """A raw owner lies about its CRC: the core's pull raises IntegrityError with the words
    and code of the rule, and its verdict (ok = 0) tells the owner; the retry gets the
    bytes, confirmed."""
    want = np.arange(2 * TENSOR, dtype=np.uint32).astype(np.uint8).reshape(2, TENSOR)
    with LyingOwner(1, [want[0], want[1]]) as liar:
        puller = _puller("tcp")
        try:
            puller.link(1, *liar.address, 5.0)
            with pytest.raises(IntegrityError, match="checksum mismatch: the owner sent crc "
                                                     "0xdeadbeef") as e:
                _pull(puller, asynchronous=asynchronous)
            assert e.value.code == 507057  # LLM_SUSPECT_REMOTE_ERROR
            assert np.array_equal(_pull(puller), want)
            end = time.monotonic() + 5  # the last verdict may still be on its way
            while len(liar.verdicts) < 2 and time.monotonic() < end:
                time.sleep(0.01)
            assert [ok for _, ok in liar.verdicts] == [False, True], liar.verdicts
        finally:
            puller.close()


def _checked_read(cli: Raw, rid: int, flags: p.ReadFlags, n: int = 16) -> list:
    """A checksummed READ of ``n`` bytes of both tensors of CacheKey(7); its answer."""
    read = p.Read(p.KeyRef(p.KeyKind.CACHE_KEY, 7, 0, 2**64 - 1), 0,
                  p.ReadFlags.CHECKSUM | flags, np.arange(2, dtype=np.uint32),
                  np.zeros(1, np.uint64), np.full(1, n, np.uint64))
    cli.send(read, rid)
    first = cli.next()
    if not isinstance(first[1], (p.ReadData, p.Grant)):
        return [first[1]]
    if isinstance(first[1], p.ReadData):
        return [first[1], cli.next()[1], cli.next()[1]]
    return [first[1], cli.next()[1]]


@pytest.mark.parametrize("how", ["stream", "grant"])
def test_the_core_consumes_a_key_only_on_a_confirmed_read(how: str) -> None:
    """A reader that finds a mismatch says so (streamed: RELEASE lease 0 with the READ's id
    and ok = 0; granted, on the local channel: its grant's RELEASE with ok = 0): the core's
    owner keeps the key, and the next confirmed pull consumes it. Before, a streamed checked
    read consumed it as soon as the bytes were sent, and the retry got
    LLM_KV_CACHE_NOT_EXIST."""
    owner = _owner()
    try:
        want = _keyed(owner)
        assert owner.listen_address is not None
        cli = Raw(owner.listen_address[1] if how == "stream"
                  else local_name(os.getpid(), 1))
        try:
            cli.send(p.Hello(77, 2, os.getpid(), 0, b"\x01" * 16, 0, b""), 1)
            assert isinstance(cli.next()[1], p.Welcome)
            got = _checked_read(cli, 4, p.ReadFlags.GRANT if how == "grant" else p.ReadFlags.NONE)
            spans = b"".join(bytes(want[t, :16]) for t in range(2))
            if how == "stream":
                assert isinstance(got[0], p.ReadData) and bytes(got[1]) == spans, got
                assert got[2] == p.Checksum(zlib.crc32(spans), 32)
                cli.send(p.Release(0, False), 4)  # the verdict: mismatch
            else:
                assert isinstance(got[0], p.Grant), got
                assert got[1] == p.Checksum(zlib.crc32(spans), 32)
                cli.send(p.Release(got[0].lease_id, False), 5)
            cli.send(p.Ping(3), 6)
            assert cli.next() == (6, p.Pong(3))
        finally:
            cli.close()
        _key_still_there_then_consumed(owner, want)
    finally:
        owner.close()


def _key_still_there_then_consumed(owner: NativeEngine, want: np.ndarray) -> None:
    """An honest puller over TCP still gets the keyed cache once, then LLM_KV_CACHE_NOT_EXIST:
    the raw readers before it consumed nothing."""
    puller = _puller("tcp")
    try:
        assert owner.listen_address is not None
        puller.link(1, *owner.listen_address, 5.0)
        assert np.array_equal(_pull(puller), want)
        with pytest.raises(CacheNotFound):
            _pull(puller)
    finally:
        puller.close()


def test_without_a_verdict_the_core_keeps_the_key() -> None:
    """A requester that asked for a checksum and never confirms it (closes instead, or sends
    another request) consumes nothing on the core's owner (test_owner_limits.py, item 8)."""
    owner = _owner()
    try:
        want = _keyed(owner)
        assert owner.listen_address is not None
        read = p.Read(p.KeyRef(p.KeyKind.CACHE_KEY, 7, 0, 2**64 - 1), 0, p.ReadFlags.CHECKSUM,
                      np.arange(2, dtype=np.uint32), np.zeros(1, np.uint64),
                      np.full(1, 16, np.uint64))
        for ending in ("close", "ping", "other_rid"):
            cli = Raw(owner.listen_address[1])
            try:
                cli.hello()
                deadline = time.monotonic() + 5
                while True:  # until the owner noticed the previous connection closed
                    cli.send(read, 4)
                    first = cli.next()[1]
                    if not isinstance(first, p.Error):
                        break
                    assert time.monotonic() < deadline, first
                    time.sleep(0.05)
                got = [first, *(cli.next()[1] for _ in range(2))]
                assert isinstance(got[0], p.ReadData) and got[0].nbytes == 32
                spans = b"".join(bytes(want[t, :16]) for t in range(2))
                assert bytes(got[1]) == spans
                assert got[2] == p.Checksum(zlib.crc32(spans), 32)
                if ending == "ping":
                    cli.send(p.Ping(1), 5)
                    assert cli.next() == (5, p.Pong(1))
                elif ending == "other_rid":  # a verdict for another request settles nothing
                    cli.send(p.Release(0, True), 9)
                    cli.send(p.Ping(2), 10)
                    assert cli.next() == (10, p.Pong(2))
            finally:
                cli.close()
        _key_still_there_then_consumed(owner, want)
    finally:
        owner.close()


def test_a_confirming_raw_reader_consumes_the_key_on_the_core() -> None:
    """The verdict itself: RELEASE lease 0 with the READ's request id and ok = 1 commits."""
    owner = _owner()
    try:
        _keyed(owner)
        assert owner.listen_address is not None
        read = p.Read(p.KeyRef(p.KeyKind.CACHE_KEY, 7, 0, 2**64 - 1), 0, p.ReadFlags.CHECKSUM,
                      np.arange(2, dtype=np.uint32), np.zeros(1, np.uint64),
                      np.full(1, 16, np.uint64))
        cli = Raw(owner.listen_address[1])
        try:
            cli.hello()
            cli.send(read, 4)
            kinds = [type(cli.next()[1]) for _ in range(3)]
            assert kinds == [p.ReadData, bytes, p.Checksum]
            cli.send(p.Release(0, True), 4)
            cli.send(read, 5)
            answer = cli.next()
            assert answer[0] == 5 and isinstance(answer[1], p.Error), answer
            assert answer[1].code == int(CacheNotFound.code)
        finally:
            cli.close()
    finally:
        owner.close()


@pytest.mark.parametrize("verify", [True, False], ids=["VerifyChecksum=1", "unset"])
def test_the_verify_checksum_option_turns_on_the_cores_check(monkeypatch, verify: bool) -> None:
    """``datadist.VerifyChecksum`` given to ``LLMDataDist.init`` (the default engine) reaches
    the core's reader: its READs ask for a CHECKSUM, and an owner lying about it is caught,
    LLM_SUSPECT_REMOTE_ERROR, nothing claimed as pulled. Unset, no CHECKSUM is asked and the
    bytes land. (Before: this test asserted only that the engine was the core's.)"""
    import datadist as llm

    monkeypatch.delenv("DATADIST_VERIFY_CHECKSUM", raising=False)
    want = np.arange(256, dtype=np.uint8)
    with LyingOwner(1, [want]) as liar:
        dd = llm.LLMDataDist(llm.LLMRole.DECODER, 2)
        options = {"llm.EnableCacheManager": "1"}
        dd.init({**options, "datadist.VerifyChecksum": "1"} if verify else options)
        try:
            dd.engine.link(1, *liar.address, 5.0)
            dst = np.zeros(256, np.uint8)
            desc = llm.CacheDesc(1, [1, 256], llm.DataType.DT_UINT8, llm.Placement.HOST)
            cache = dd.cache_manager.register_cache(desc, [dst.ctypes.data])
            key = llm.CacheKeyByIdAndIndex(1, 1, 0)
            if verify:
                with pytest.raises(llm.LLMException) as e:
                    dd.cache_manager.pull_cache(key, cache)
                assert e.value.status_code == llm.LLMStatusCode.LLM_SUSPECT_REMOTE_ERROR, e.value
                assert "checksum mismatch" in str(e.value), e.value
            else:
                dd.cache_manager.pull_cache(key, cache)
                assert np.array_equal(dst, want)
            asked = [bool(f & p.ReadFlags.CHECKSUM) for _, f in liar.reads]
            assert asked == [verify], liar.reads
        finally:
            dd.finalize()
