"""The owner's own lifecycle under stress (issue 9, items 3 and 4): finalize while a peer
still reads memory held only by a key; an accept loop that cannot start threads, and
connection floods over the cap. In-process engines on loopback; every wait bounded."""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import socket
import threading
import time

import numpy as np
import pytest
from fault_harness import local_name

import datadist.core.native as native_mod
from datadist.core.config import EngineConfig
from datadist.core.errors import BrokenLink, LinkFailed
from datadist.core.keys import KeyId
from datadist.core.layout import Geometry, every_tensor, make_iov, plan_slot
from datadist.core.local import vm_copy
from datadist.core.native import NativeEngine as Engine
from datadist.memory.pool import PoolConfig
from datadist.wire import protocol as p

pytestmark = pytest.mark.timeout(60)


def _readable(addr: int, n: int) -> bytes:
    """Read our own memory with process_vm_readv: an unmapped range is an error (EFAULT),
    not a crash of the test process."""
    out = np.zeros(n, np.uint8)
    vm_copy(os.getpid(), make_iov(np.array([out.ctypes.data], np.uint64),
                                  np.array([n], np.uint64)),
            make_iov(np.array([addr], np.uint64), np.array([n], np.uint64)))
    return out.tobytes()


class _CopyInFlight:
    """A same-host reader's copy of a leased cache, in flight: the reader's shared flock on
    the owner's fence file (docs/protocol.md, "Cache leases"), taken through
    /proc/<owner pid>/fd/<fence_fd> as a reader process does. While it is held the owner
    cannot drain the fence, so the cache's memory must stay."""

    def __init__(self, lease: p.CacheLease) -> None:
        self.fd = os.open(f"/proc/{os.getpid()}/fd/{lease.fence_fd}", os.O_RDONLY | os.O_CLOEXEC)
        assert os.fstat(self.fd).st_ino == lease.fence_ino
        fcntl.flock(self.fd, fcntl.LOCK_SH | fcntl.LOCK_NB)

    def end(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def _owner_with_keyed_cache() -> tuple[Engine, int, _CopyInFlight]:
    """An owner whose only cache is deallocated and still held by its CacheKey, with a
    peer's copy of it in flight (a lease on the whole cache taken on the local channel before
    the deallocation, as a same-host puller takes it, and a copy under its fence)."""
    eng = Engine(EngineConfig(cluster_id=1, role=1, listen=("127.0.0.1", 0),
                              host_pool=PoolConfig(1 << 20, 16)))
    entry = eng.allocate(Geometry(1, 4096, 1), placement=0, keys=[KeyId(3, 0)])
    addr = int(entry.addrs[0])
    np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * 4096).from_address(addr))[:] = 7
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5.0)
    try:
        sock.connect(local_name(os.getpid(), 1))
        dec = p.FrameDecoder()
        got: list = []
        for rid, msg in ((1, p.Hello(2, 2, os.getpid(), 0, b"\0" * 16)),
                         (2, p.LeaseRequest(p.KeyRef(p.KeyKind.CACHE_ID, entry.cache_id, 0)))):
            sock.sendall(p.encode(msg, rid))
            while len(got) < rid:
                chunk = sock.recv(65536)
                assert chunk, "the owner closed the local channel"
                got += dec.feed(chunk)
    finally:
        sock.close()
    lease = got[1][1]
    assert isinstance(lease, p.CacheLease) and int(lease.addrs[0]) == addr, lease
    copy = _CopyInFlight(lease)
    eng.deallocate(entry.cache_id)  # only the key (and the copy) holds the cache now
    return eng, addr, copy


def test_item3_finalize_never_unmaps_memory_a_reader_still_uses(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: finalize waited only for caches still held by their id; a deallocated cache
    held by its key was unmapped under the transfer (SIGSEGV in the owner). Now every live
    cache is waited for (CLOSE_WAIT), and memory still read after the bound stays mapped.
    On the core: Engine::Close returns the caches still leased (Registry::Clear), and the
    engine leaves their pools mapped; before, it unmapped them under the copy."""
    monkeypatch.setattr(native_mod, "CLOSE_WAIT", 0.3)
    eng, addr, copy = _owner_with_keyed_cache()
    try:
        t0 = time.monotonic()
        eng.close()
        assert time.monotonic() - t0 >= 0.25  # it waited for the reader
        assert _readable(addr, 4096) == b"\x07" * 4096  # and left the memory mapped
    finally:
        copy.end()


def test_item3_finalize_waits_for_the_reader_then_unmaps(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native_mod, "CLOSE_WAIT", 10.0)
    eng, addr, copy = _owner_with_keyed_cache()
    done = threading.Timer(0.4, copy.end)
    done.start()
    t0 = time.monotonic()
    eng.close()
    waited = time.monotonic() - t0
    done.join()
    assert 0.3 <= waited < 9.0, waited
    with pytest.raises(BrokenLink):  # the reader is gone: now the pool is unmapped
        _readable(addr, 4096)


# ------------------------------------------------------------------------------ item 4


def _link_is_refused_as_too_many(host: str, port: int) -> None:
    """A new peer's link to the owner at ``host:port`` fails, LLM_LINK_FAILED, over its
    connection caps."""
    puller = Engine(EngineConfig(cluster_id=2, role=2))
    try:
        with pytest.raises(LinkFailed, match="too many connections"):
            puller.link(1, host, port, 3.0)
    finally:
        puller.close()


def _pull_works(owner: Engine, cluster_id: int = 2) -> None:
    src = np.arange(4096, dtype=np.uint8)
    entry = owner.register(Geometry(1, 4096, 1), [src.ctypes.data], placement=0)
    puller = Engine(EngineConfig(cluster_id=cluster_id, role=2, transport="tcp"))
    try:
        host, port = owner.listen_address
        puller.link(1, host, port, 3.0)
        dst = np.zeros(4096, np.uint8)
        local = puller.register(Geometry(1, 4096, 1), [dst.ctypes.data], placement=0)
        plan = plan_slot(local.geometry, 0, every_tensor(1))
        puller.pull(1, p.KeyRef(p.KeyKind.CACHE_ID, entry.cache_id, 0), 0, plan,
                    local.cache_id, 3.0)
        assert np.array_equal(dst, src)
    finally:
        puller.close()
        owner.unregister(entry.cache_id)


def test_item4_the_accept_loop_survives_accepts_that_fail() -> None:
    """Before (issue 9 item 4): one failure to take a connection on (the Python engine could
    not start its thread: a pids limit) killed the accept loop for good; the port still
    accepted but nobody answered HELLO. The core serves connections on its I/O pool, so what
    can fail at accept is accept itself: with the process out of descriptors (EMFILE) three
    connections wait, the loop keeps polling, and once descriptors are free again they are
    taken and an honest peer links and pulls."""
    import resource

    owner = Engine(EngineConfig(cluster_id=1, role=1, listen=("127.0.0.1", 0)))
    host, port = owner.listen_address
    waiting = [socket.socket() for _ in range(3)]  # made now, connected when out of descriptors
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    filler: list[int] = []
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(map(int, os.listdir("/proc/self/fd")))
                                                    + 16, hard))
        with contextlib.suppress(OSError):
            while True:  # every descriptor number left: the owner's accept4 fails EMFILE
                filler.append(os.open("/dev/null", os.O_RDONLY))
        for s in waiting:
            s.settimeout(5)
            s.connect((host, port))
            s.sendall(p.encode(p.Hello(9, 2, 1, 0, b"\x01" * 16), 1))
        # the owner polls them and cannot take them on: no answer yet
        unanswered = not select.select(waiting, [], [], 0.5)[0]
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        assert filler and unanswered, "the owner was never out of descriptors"
        for s in waiting:  # taken now: their HELLOs get WELCOMEs
            assert s.recv(4)[:2] == b"DD", "a connection that waited through EMFILE was not served"
        _pull_works(owner)
    finally:
        for s in waiting:
            s.close()
        owner.close()


def test_item4_connections_over_the_cap_are_refused_cleanly() -> None:
    """A flood of 40 silent connections against a cap of 8: the excess is refused (closed,
    or answered LLM_LINK_FAILED 'too many connections' if it says HELLO), the owner keeps
    running, and once the flood ends an honest peer links and pulls."""
    owner = Engine(EngineConfig(cluster_id=1, role=1, listen=("127.0.0.1", 0),
                                max_connections=8))
    host, port = owner.listen_address
    flood = []
    try:
        for _ in range(40):
            flood.append(socket.create_connection((host, port), timeout=5))
        _link_is_refused_as_too_many(host, port)
        # the excess is closed by the owner (a silent refused connection within seconds)
        deadline = time.monotonic() + 10
        closed: set[int] = set()
        while len(closed) < 32 and time.monotonic() < deadline:
            for i, s in enumerate(flood):
                if i in closed:
                    continue
                s.setblocking(False)
                try:
                    if s.recv(1 << 16) == b"":
                        closed.add(i)
                except BlockingIOError:
                    pass
                except OSError:
                    closed.add(i)
            time.sleep(0.05)
        assert len(closed) >= 32, f"{len(closed)} of the 32 connections over the cap closed"
    finally:
        for s in flood:
            s.close()
    try:
        deadline = time.monotonic() + 15
        while True:  # the served hogs are dropped when their HELLO does not come (EOF now)
            try:
                _pull_works(owner, 3)
                break
            except LinkFailed:
                assert time.monotonic() < deadline
                time.sleep(0.2)
    finally:
        owner.close()


def test_item4_the_caps_are_options_of_the_facade() -> None:
    import datadist
    from datadist.api.status import LLMException

    cfg = datadist.LLMConfig()
    cfg.max_connections = 5
    cfg.max_connections_per_peer = 2
    opts = cfg.generate_options()
    assert opts["datadist.MaxConnections"] == "5"
    assert opts["datadist.MaxConnectionsPerPeer"] == "2"
    dd = datadist.LLMDataDist(datadist.LLMRole.PROMPT, 1)
    dd.init({**opts, "llm.EnableCacheManager": "1", "llm.listenIpInfo": "127.0.0.1:0"})
    try:
        assert (dd.engine.config.max_connections,
                dd.engine.config.max_connections_per_peer) == (5, 2)
        # and the core enforces them: two silent connections from this address fill its
        # share, a third peer from it is refused (all C++: cpp/tests/transfer_test.cc
        # Hostile.ConnectionCapsPerPeer)
        host, port = dd.engine.listen_address
        hogs = [socket.create_connection((host, port), timeout=5) for _ in range(2)]
        try:
            _link_is_refused_as_too_many(host, port)
        finally:
            for s in hogs:
                s.close()
    finally:
        dd.finalize()
    with pytest.raises(LLMException):
        cfg.max_connections = 0
    bad = datadist.LLMDataDist(datadist.LLMRole.PROMPT, 1)
    with pytest.raises(LLMException):
        bad.init({"llm.EnableCacheManager": "1", "datadist.MaxConnections": "lots"})
