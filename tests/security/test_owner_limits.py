"""The owner against hostile and concurrent peers (issue 9, items 2, 5, 8, 9, 11, 13).

Each test names its item and says what happened before the fix. The owner is the C++ core's
engine in this process, listening on loopback; hostile peers are raw sockets speaking the
wire by hand.
"""

from __future__ import annotations

import socket
import threading
import time
import zlib

import numpy as np
import pytest
from _hand import nonce

from datadist.core.config import EngineConfig
from datadist.core.errors import CacheNotFound, InvalidArgument, LinkFailed
from datadist.core.keys import MAX_REQUEST_SPANS, KeyId
from datadist.core.layout import Geometry, every_tensor, plan_slot
from datadist.core.native import NativeEngine
from datadist.memory.pool import PoolConfig
from datadist.wire import protocol as p

pytestmark = pytest.mark.timeout(60)
SOCK_TIMEOUT = 5.0
# An honest pull's deadline while an attack runs: generous for a loaded 2-core machine, far
# below the seconds of GIL the old owner spent on a 16M-span request.
HONEST_DEADLINE = 2.0


class Raw:
    """A hand-driven client; every wait bounded by SOCK_TIMEOUT."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=SOCK_TIMEOUT)
        self.dec = p.FrameDecoder()
        self.items: list = []

    def send(self, msg: p.Message | bytes, rid: int = 1) -> None:
        self.sock.sendall(msg if isinstance(msg, bytes) else p.encode(msg, rid))

    def next(self):  # type: ignore[no-untyped-def]
        """The next frame (or raw bytes item); None once the server closed."""
        while not self.items:
            try:
                chunk = self.sock.recv(1 << 20)
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                return None
            self.items.extend(self.dec.feed(chunk))
        return self.items.pop(0)

    def hello(self, cluster_id: int = 77, *, secret: bool = False) -> p.Welcome:
        h = p.Hello(cluster_id, 2, 1, 0, b"\x01" * 16, p.FEATURE_AUTH if secret else 0,
                    nonce() if secret else b"")
        self.send(h, 1)
        got = self.next()
        assert got is not None and isinstance(got[1], p.Welcome), got
        return got[1]

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def owner():
    eng = NativeEngine(EngineConfig(cluster_id=1, role=1, listen=("127.0.0.1", 0),
                                    host_pool=PoolConfig(16 << 20, 16)))
    yield eng
    eng.close()


def _puller(verify: bool = False) -> NativeEngine:
    return NativeEngine(EngineConfig(cluster_id=2, role=2, transport="tcp", verify=verify))


def _link(puller: NativeEngine, owner: NativeEngine) -> None:
    host, port = owner.listen_address
    puller.link(1, host, port, 3.0)


# ------------------------------------------------------------------------------ item 2


@pytest.mark.parametrize(("repeats", "why"), [(4096, "too many spans in one request"),
                                               (1024, "named twice in one request")])
def test_item2_repeating_one_tensor_index_is_refused_at_once(owner, repeats, why) -> None:
    """The 80 KiB READ of the review: tensor 0 named 4096 times, 4096 one-byte spans, with a
    checksum. Before: 16M spans, a 16M-element Python list, GBs of RSS and 15 s of GIL.
    Now: refused (LLM_PARAM_INVALID) before any per-span work, the connection stays: over
    the span cap, and under it (1024 repeats) because it names a tensor twice."""
    data = np.arange(8192, dtype=np.uint8)
    entry = owner.register(Geometry(1, 8192, 1), [data.ctypes.data], placement=0)
    cli = Raw(owner.listen_address[1])
    try:
        cli.hello()
        msg = p.Read(p.KeyRef(p.KeyKind.CACHE_ID, entry.cache_id, 0), 0, p.ReadFlags.CHECKSUM,
                     np.zeros(repeats, np.uint32), np.arange(4096, dtype=np.uint64),
                     np.ones(4096, np.uint64))
        assert len(p.encode(msg)) < 100 << 10
        t0 = time.monotonic()
        cli.send(msg, 5)
        rid, reply = cli.next()
        assert time.monotonic() - t0 < 2.0
        assert rid == 5 and isinstance(reply, p.Error), reply
        assert reply.code == InvalidArgument.code and why in reply.message
        cli.send(p.Ping(9), 6)  # still served
        assert cli.next() == (6, p.Pong(9))
    finally:
        cli.close()


@pytest.mark.parametrize("tensors", [512, 2048])
def test_item2_span_expansion_stays_cheap_for_others(owner, tensors: int) -> None:
    """No tensor twice, but ``tensors`` x 8192 one-byte spans with a checksum: 4M spans (at
    the cap) or 16M (over it). An honest 4 KiB pull on another connection, started
    meanwhile and again until the attack is answered, must meet its deadline; the owner
    serves 4M spans without per-span Python and refuses 16M at once. Before: 16M spans were
    under the cap (2**24), and building their Python list held the GIL for seconds (the
    honest pull timed out)."""
    big = np.zeros((tensors, 8192), np.uint8)
    big[:] = np.arange(8192, dtype=np.uint8) % 251
    hostile = owner.register(Geometry(tensors, 8192, 1),
                             [big.ctypes.data + i * 8192 for i in range(tensors)], placement=0)
    small = np.arange(4096, dtype=np.uint8)
    honest = owner.register(Geometry(1, 4096, 1), [small.ctypes.data], placement=0)
    offsets = np.arange(0, 8192, 1, dtype=np.uint64)
    msg = p.Read(p.KeyRef(p.KeyKind.CACHE_ID, hostile.cache_id, 0), 0, p.ReadFlags.CHECKSUM,
                 np.arange(tensors, dtype=np.uint32), offsets, np.ones(8192, np.uint64))
    got: dict[str, object] = {}

    def attack() -> None:
        cli = Raw(owner.listen_address[1])
        cli.sock.settimeout(60)
        try:
            cli.hello()
            cli.send(msg, 3)
            items = []
            while len(items) < 3:
                item = cli.next()
                if item is None:
                    break
                items.append(item)
                if isinstance(item[1], p.Error):
                    break
            got["items"] = items
        finally:
            cli.close()

    puller = _puller()
    try:
        _link(puller, owner)
        dst = np.zeros(4096, np.uint8)
        local = puller.register(Geometry(1, 4096, 1), [dst.ctypes.data], placement=0)
        plan = plan_slot(local.geometry, 0, every_tensor(1))
        key = p.KeyRef(p.KeyKind.CACHE_ID, honest.cache_id, 0)
        t = threading.Thread(target=attack)
        t.start()
        pulls = 0
        while t.is_alive() or not pulls:  # honest pulls for as long as the attack lasts
            dst[:] = 0
            puller.pull(1, key, 0, plan, local.cache_id, HONEST_DEADLINE)
            assert np.array_equal(dst, small)
            pulls += 1
        t.join(60)
        items = got["items"]
        if tensors * 8192 > MAX_REQUEST_SPANS:
            assert isinstance(items[0][1], p.Error), items[0]
            assert items[0][1].code == InvalidArgument.code
            assert "too many spans in one request" in items[0][1].message
            return
        assert isinstance(items[0][1], p.ReadData) and items[0][1].nbytes == tensors * 8192
        assert items[1][1] == big.tobytes()
        assert items[2][1] == p.Checksum(zlib.crc32(big.tobytes()), tensors * 8192)
    finally:
        puller.close()


def test_item2_a_requester_refuses_a_plan_over_the_cap_itself() -> None:
    """Counted after the layer-range expansion, on the requesting side too: nothing is sent."""
    from datadist.core.keys import MAX_REQUEST_SPANS

    eng = _puller()
    try:
        dst = np.zeros(4 * 4096, np.uint8)
        geo = Geometry(4, 4096, 4096)
        local = eng.register(geo, [dst.ctypes.data + i * 4096 for i in range(4)],
                             placement=0)
        from datadist.core.layout import plan_blocks

        blocks = np.arange(0, 4096, 2)  # never adjacent: one span per block
        plan = plan_blocks(geo, blocks, blocks, every_tensor(4))
        assert plan.num_spans <= MAX_REQUEST_SPANS  # fine
        many = np.arange(MAX_REQUEST_SPANS // 4 + 4, dtype=np.uint64) * 2
        huge = type(plan)(plan.remote_tensors, plan.local_tensors, many, many % 8,
                          np.ones(len(many), np.uint64))
        with pytest.raises(InvalidArgument, match=r"more than \d+ spans"):
            eng.pull(1, p.KeyRef(p.KeyKind.BLOCKS_KEY), 0, huge, local.cache_id, 1.0)
    finally:
        eng.close()


# ------------------------------------------------------------------------------ item 5


@pytest.mark.parametrize("mtype", [p.MsgType.HELLO, p.MsgType.READ])
def test_item5_a_big_first_frame_is_refused_before_it_is_buffered(owner, mtype) -> None:
    """A header announcing a 1 MiB first frame. Before: the owner allocated and waited for
    the whole payload (up to 64 MiB per silent client, 30 s). Now: the connection is closed
    at once, before the payload."""
    cli = Raw(owner.listen_address[1])
    try:
        cli.send(p.HEADER.pack(p.MAGIC, p.VERSION, mtype, 1, 1 << 20) + b"\0" * 100)
        t0 = time.monotonic()
        while (item := cli.next()) is not None:
            assert isinstance(item[1], p.Error), item
        assert time.monotonic() - t0 < 2.0
    finally:
        cli.close()


def test_item5_a_big_auth_frame_is_refused_too() -> None:
    eng = NativeEngine(EngineConfig(cluster_id=1, role=1, listen=("127.0.0.1", 0), secret=b"s"))
    cli = Raw(eng.listen_address[1])
    try:
        cli.hello(secret=True)
        cli.send(p.HEADER.pack(p.MAGIC, p.VERSION, p.MsgType.AUTH, 2, 60000) + b"\0" * 10)
        t0 = time.monotonic()
        while (item := cli.next()) is not None:
            assert isinstance(item[1], p.Error), item
        assert time.monotonic() - t0 < 2.0
    finally:
        cli.close()
        eng.close()


def test_item5_connections_per_peer_address_are_capped() -> None:
    """Over the per-address cap a connection is refused with LLM_LINK_FAILED and a reason,
    the ones already served go on, and a slot freed is usable again."""
    eng = NativeEngine(EngineConfig(cluster_id=1, role=1, listen=("127.0.0.1", 0),
                                    max_connections_per_peer=3))
    hogs = [Raw(eng.listen_address[1]) for _ in range(3)]
    puller = _puller()
    try:
        for h in hogs:
            h.hello()
        with pytest.raises(LinkFailed, match="too many connections"):
            _link(puller, eng)
        over = Raw(eng.listen_address[1])  # refused on the wire too: an ERROR
        try:
            over.send(p.Hello(77, 2, 1, 0, b"\x01" * 16, 0, b""), 1)
            got = over.next()
            assert got is not None and isinstance(got[1], p.Error), got
            assert got[1].code == LinkFailed.code and "too many connections" in got[1].message
            assert over.next() is None  # and closed
        finally:
            over.close()
        hogs.pop().close()  # a link takes two connections: its control and reverse channels
        hogs.pop().close()
        deadline = time.monotonic() + 5
        while True:  # the owner notices the close within its poll interval
            try:
                _link(puller, eng)
                break
            except LinkFailed:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        puller.check_link(1, 2.0)
    finally:
        for h in hogs:
            h.close()
        puller.close()
        eng.close()


# ------------------------------------------------------------------------------ item 8


def _keyed_pool_cache(owner: NativeEngine, req_id: int = 7) -> np.ndarray:
    """A pool cache bound to CacheKey(req_id, model 0), filled with a pattern."""
    entry = owner.allocate(Geometry(2, 4096, 1), placement=0, keys=[KeyId(req_id, 0)])
    want = np.empty((2, 4096), np.uint8)
    for t in range(2):
        view = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * 4096).from_address(
            int(entry.addrs[t])))
        view[:] = (np.arange(4096) * (t + 3)) % 253
        want[t] = view
    return want


def _pull_key(puller: NativeEngine, req_id: int = 7) -> np.ndarray:
    dst = np.zeros((2, 4096), np.uint8)
    local = puller.register(Geometry(2, 4096, 1), [dst.ctypes.data, dst.ctypes.data + 4096],
                            placement=0)
    try:
        plan = plan_slot(local.geometry, 0, every_tensor(2))
        puller.pull(1, p.KeyRef(p.KeyKind.CACHE_KEY, req_id, 0, 2**64 - 1), 0, plan,
                    local.cache_id, 3.0)
        return dst
    finally:
        puller.unregister(local.cache_id)


# item 8, "a checksum mismatch over TCP does not consume the key": the reader's ok = 0
# verdict, streamed and granted, is checked against the core's owner by
# test_checksummed_pulls.py::test_the_core_consumes_a_key_only_on_a_confirmed_read.


def test_item8_without_a_verdict_the_key_stays(owner) -> None:
    """A requester that asked for a checksum and never confirms it (closes instead, or sends
    another request) consumes nothing."""
    _keyed_pool_cache(owner)
    read = p.Read(p.KeyRef(p.KeyKind.CACHE_KEY, 7, 0, 2**64 - 1), 0, p.ReadFlags.CHECKSUM,
                  np.arange(2, dtype=np.uint32), np.zeros(1, np.uint64),
                  np.full(1, 4096, np.uint64))
    for ending in ("close", "ping"):
        cli = Raw(owner.listen_address[1])
        try:
            cli.hello()
            deadline = time.monotonic() + 5
            while True:  # until the owner noticed the previous connection closed
                cli.send(read, 4)
                first = cli.next()[1]
                if not (isinstance(first, p.Error) and "another request" in first.message):
                    break
                assert time.monotonic() < deadline, first
                time.sleep(0.05)
            kinds = [type(first), *(type(cli.next()[1]) for _ in range(2))]
            assert kinds == [p.ReadData, bytes, p.Checksum]
            if ending == "ping":
                cli.send(p.Ping(1), 5)
                assert cli.next() == (5, p.Pong(1))
        finally:
            cli.close()
    puller = _puller(verify=True)
    try:
        _link(puller, owner)
        _pull_key(puller)  # still there; consumed now
        with pytest.raises(CacheNotFound):
            _pull_key(puller)
    finally:
        puller.close()


# ------------------------------------------------------------------------------ item 9


def test_item9_an_owner_without_remote_cache_access_refuses_keyed_writes() -> None:
    """Before: only the pushing side checked enable_remote_cache_accessible; a peer that
    skipped the check wrote into the owner's caches. Raw-address writes
    (transfer_cache_async's TransferConfig, that mode's push) stay allowed."""
    eng = NativeEngine(EngineConfig(cluster_id=1, role=1, listen=("127.0.0.1", 0),
                                    remote_cache_accessible=False))
    target = np.zeros(4096, np.uint8)
    entry = eng.register(Geometry(1, 4096, 1), [target.ctypes.data], placement=0)
    pusher = _puller()
    try:
        _link(pusher, eng)
        src = np.full(4096, 9, np.uint8)
        local = pusher.register(Geometry(1, 4096, 1), [src.ctypes.data], placement=0)
        plan = plan_slot(local.geometry, 0, every_tensor(1))
        with pytest.raises(InvalidArgument, match="enable_remote_cache_accessible"):
            pusher.push(1, p.KeyRef(p.KeyKind.CACHE_ID, entry.cache_id, 0), 0, plan,
                        local.cache_id, 3.0)
        assert not target.any()
        addr_plan = type(plan)(np.zeros(1, np.uint32), plan.local_tensors,
                               np.array([target.ctypes.data], np.uint64), plan.local_offsets,
                               plan.lengths)
        pusher.push(1, p.KeyRef(p.KeyKind.ADDRESS), 0, addr_plan, local.cache_id, 3.0)
        assert (target == 9).all()
    finally:
        pusher.close()
        eng.close()


def test_item9_the_facade_passes_the_option_to_the_owner() -> None:
    from datadist.api.enums import LLMRole
    from datadist.api.llm_datadist import LLMDataDist

    for value, want in (("0", False), ("1", True), (None, False)):
        dd = LLMDataDist(LLMRole.PROMPT, 1)
        opts = {"llm.EnableCacheManager": "1"}
        if value is not None:
            opts["llm.EnableRemoteCacheAccessible"] = value
        dd.init(opts)
        try:
            assert dd.engine.config.remote_cache_accessible is want
        finally:
            dd.finalize()


# ------------------------------------------------------------------------------ item 11


def test_item11_an_unauthenticated_hello_is_not_an_inbound_peer() -> None:
    """Before: the owner registered the peer when the HELLO arrived, before the proof, so
    switch_role said LLM_EXIST_LINK and comm's connected-back step could be satisfied by a
    peer without the secret. Now only a completed handshake registers it."""
    eng = NativeEngine(EngineConfig(cluster_id=1, role=1, listen=("127.0.0.1", 0),
                                    secret=b"hunter2"))
    cli = Raw(eng.listen_address[1])
    try:
        cli.hello(cluster_id=2, secret=True)
        time.sleep(0.2)
        assert eng.inbound_peers() == [] and not eng.has_links()
        cli.send(p.Auth(b"\0" * 32), 2)  # a wrong proof: still nobody
        assert isinstance(cli.next()[1], p.Error)
        assert eng.inbound_peers() == [] and not eng.has_links()
        good = NativeEngine(EngineConfig(cluster_id=2, role=2, secret=b"hunter2"))
        try:
            _link(good, eng)
            deadline = time.monotonic() + 2
            while not eng.inbound_peers():
                assert time.monotonic() < deadline
                time.sleep(0.02)
            # one entry per connection that completed its handshake (a same-host link
            # also made one over TCP before it moved to the local channel): all of them 2
            assert {pr.cluster_id for pr in eng.inbound_peers()} == {2}
        finally:
            good.close()
    finally:
        cli.close()
        eng.close()


# ------------------------------------------------------------------------------ item 13


def _read_key(cli: Raw, rid: int, req_id: int = 7) -> list:
    """A checksummed READ of 16 bytes of both tensors of CacheKey(req_id) on ``cli``: the
    answer's frames (READ_DATA, the bytes, CHECKSUM; or one ERROR)."""
    cli.send(p.Read(p.KeyRef(p.KeyKind.CACHE_KEY, req_id, 0, 2**64 - 1), 0,
                    p.ReadFlags.CHECKSUM, np.arange(2, dtype=np.uint32),
                    np.zeros(1, np.uint64), np.full(1, 16, np.uint64)), rid)
    first = cli.next()
    assert first is not None and first[0] == rid, first
    if isinstance(first[1], p.Error):
        return [first[1]]
    return [first[1], cli.next()[1], cli.next()[1]]


def test_item13_two_concurrent_readers_cannot_both_consume_one_key(owner) -> None:
    """Before: the key was checked at open and consumed at close, so two reads opened
    before either ended both succeeded. Now the first reserves it: a second reader, while
    the first's verdict is pending, is refused; the first's confirmation consumes it."""
    _keyed_pool_cache(owner)
    first, second = Raw(owner.listen_address[1]), Raw(owner.listen_address[1])
    try:
        first.hello(77)
        second.hello(78)
        assert [type(m) for m in _read_key(first, 4)] == [p.ReadData, bytes, p.Checksum]
        refused = _read_key(second, 4)  # the first's verdict is pending: still reserved
        assert isinstance(refused[0], p.Error) and refused[0].code == CacheNotFound.code
        assert "another request" in refused[0].message
        first.send(p.Release(0, True), 4)  # confirmed: consumed
        first.send(p.Ping(1), 5)
        assert first.next() == (5, p.Pong(1))
        gone = _read_key(second, 6)
        assert isinstance(gone[0], p.Error) and gone[0].code == CacheNotFound.code
        assert "another request" not in gone[0].message
    finally:
        first.close()
        second.close()


def test_item13_a_failed_reader_leaves_the_key_to_the_next_one(owner) -> None:
    """A reader whose verdict says the bytes were wrong (ok = 0) consumes nothing: the key is
    the next reader's, reserved by it until its own verdict."""
    _keyed_pool_cache(owner)
    first, second = Raw(owner.listen_address[1]), Raw(owner.listen_address[1])
    try:
        first.hello(77)
        second.hello(78)
        assert [type(m) for m in _read_key(first, 4)] == [p.ReadData, bytes, p.Checksum]
        first.send(p.Release(0, False), 4)
        first.send(p.Ping(1), 5)
        assert first.next() == (5, p.Pong(1))
        assert [type(m) for m in _read_key(second, 6)] == [p.ReadData, bytes, p.Checksum]
        refused = _read_key(first, 7)  # the second's verdict is pending
        assert isinstance(refused[0], p.Error) and "another request" in refused[0].message
        second.send(p.Release(0, True), 6)
        second.send(p.Ping(2), 8)
        assert second.next() == (8, p.Pong(2))
        gone = _read_key(first, 9)
        assert isinstance(gone[0], p.Error) and gone[0].code == CacheNotFound.code
        assert "another request" not in gone[0].message
    finally:
        first.close()
        second.close()


def test_item13_concurrent_pulls_over_tcp_consume_once(owner) -> None:
    """Eight pullers race for one req_id key: every one either gets the whole cache or
    LLM_KV_CACHE_NOT_EXIST, and exactly one gets it."""
    want = _keyed_pool_cache(owner, req_id=9)
    results: list[object] = []
    pullers = [NativeEngine(EngineConfig(cluster_id=10 + i, role=2, transport="tcp"))
               for i in range(8)]
    try:
        for pl in pullers:
            _link(pl, owner)
        barrier = threading.Barrier(len(pullers))

        def go(pl: NativeEngine) -> None:
            barrier.wait(5)
            try:
                results.append(_pull_key(pl, 9))
            except CacheNotFound as e:
                results.append(e)

        threads = [threading.Thread(target=go, args=(pl,)) for pl in pullers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        wins = [r for r in results if isinstance(r, np.ndarray)]
        assert len(results) == len(pullers) and len(wins) == 1, results
        assert np.array_equal(wins[0], want)
    finally:
        for pl in pullers:
            pl.close()
