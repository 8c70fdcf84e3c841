"""The same-host trust model (issue 9, items 1, 6, 7, 12).

"Same host" is decided by the kernel (a unix-socket local channel and SO_PEERCRED), never by
what a peer says; a puller only ever reads the memory of the pid the kernel verified; grants
(addresses, leases) go only to verified peers, capped and expiring; a same-host owner cannot
crash a puller through its shared-memory grants; PR_SET_PTRACER_ANY is set only for
cross-memory attach, and undone.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from datadist.core import engine as engine_mod
from datadist.core.config import EngineConfig
from datadist.core.engine import Engine
from datadist.core.errors import Code, DatadistError, OutOfMemory
from datadist.core.layout import Geometry, layer_tensor_indices, plan_slot
from datadist.memory import shared
from datadist.memory.pool import HostPool, PoolConfig, memfd_map, unmap
from datadist.testing.fakes import EchoOwner
from datadist.transport import iov, tcp
from datadist.transport.local import local_name
from datadist.transport.paths import CmaPath, ShmUnavailable
from datadist.wire import protocol as p

pytestmark = pytest.mark.timeout(60)

N = 4096
OWNER, PULLER = 1, 2
GEO = Geometry(1, N, 1)
KEY = p.KeyRef(p.KeyKind.CACHE_ID, 1, 0)


def _puller(transport: str | None = None, **kw: object) -> Engine:
    return Engine(EngineConfig(cluster_id=PULLER, role=2, transport=transport, **kw))  # type: ignore[arg-type]


def _pull(puller: Engine, dst: np.ndarray, cluster_id: int = OWNER) -> None:
    entry = puller.register(GEO, [dst.ctypes.data], placement=0)
    try:
        plan = plan_slot(GEO, 0, layer_tensor_indices(1, None, None, 2))
        puller.pull(cluster_id, KEY, 0, plan, entry.cache_id, 2.0)
    finally:
        puller.unregister(entry.cache_id)


@pytest.fixture
def owner():
    eng = Engine(EngineConfig(cluster_id=OWNER, role=1, listen=("127.0.0.1", 0)))
    data = np.arange(N, dtype=np.uint8)
    eng.register(GEO, [data.ctypes.data], placement=0)
    yield eng, data
    eng.close()


# ---------------------------------------------------------------------------- item 1


@pytest.mark.parametrize("transport", [None, "cma", "shm"])
def test_a_peer_echoing_our_identity_reads_us_nothing(transport: str | None) -> None:
    """A fake owner (reachable over TCP only) says our boot id, pid namespace and pid and
    offers the local channel, then grants our own secret's address. The pull must go over
    TCP: no GRANT asked, no byte of our memory copied."""
    secret = np.full(N, 0xC3, dtype=np.uint8)
    with EchoOwner(OWNER, grant_addr=secret.ctypes.data) as fake:
        puller = _puller(transport)
        try:
            link = puller.link(OWNER, *fake.address, 2.0)
            assert link.path_name == "tcp", link
            dst = np.zeros(N, dtype=np.uint8)
            _pull(puller, dst)
        finally:
            puller.close()
        assert fake.reads and not any(f & p.ReadFlags.GRANT for f in fake.reads), fake.reads
        assert not (dst == 0xC3).any() and (dst == 0x5A).all()


_SQUATTER = textwrap.dedent("""
    import sys
    from datadist.testing.fakes import EchoOwner
    name = bytes.fromhex(sys.argv[1])
    with EchoOwner(int(sys.argv[2]), grant_addr=int(sys.argv[3]), local_name=name) as fake:
        print(fake.address[1], flush=True)
        sys.stdin.read()
""")


def test_a_local_squatter_is_read_by_its_own_pid_only() -> None:
    """A local process that serves the local channel name a fake WELCOME points at is
    verified by the kernel as *itself*: the puller reads that process, never its own memory
    at the address the fake names."""
    secret = np.full(N, 0xC3, dtype=np.uint8)
    name = local_name(os.getpid(), OWNER)  # what our echoed WELCOME makes the puller try
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(
        [sys.executable, "-c", _SQUATTER, name.hex(), str(OWNER), str(secret.ctypes.data)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        puller = _puller()
        try:
            link = puller.link(OWNER, "127.0.0.1", port, 5.0)
            assert isinstance(link.path, CmaPath) and link.path.pid == proc.pid, link
            dst = np.zeros(N, dtype=np.uint8)
            with contextlib.suppress(DatadistError):  # not mapped in the squatter: fails
                _pull(puller, dst)
            assert not (dst == 0xC3).all()
        finally:
            puller.close()
    finally:
        proc.kill()
        proc.wait(10)


@pytest.mark.parametrize("moved_to", ["another-boot-id", "echoes-our-identity"])
def test_reconnect_chooses_the_path_anew(owner, moved_to: str) -> None:
    """A genuine same-host owner is replaced, behind the same address, by one on another
    host (or one that only claims ours): the next pull reconnects over TCP and reads the new
    owner's bytes, without a GRANT."""
    eng, data = owner
    host, port = eng.listen_address
    puller = _puller()
    try:
        link = puller.link(OWNER, host, port, 2.0)
        assert isinstance(link.path, CmaPath) and link.path.pid == os.getpid()
        dst = np.zeros(N, dtype=np.uint8)
        _pull(puller, dst)
        assert np.array_equal(dst, data)
        eng.close()
        secret = np.full(N, 0xC3, dtype=np.uint8)
        boot = b"\x07" * 16 if moved_to == "another-boot-id" else None
        with EchoOwner(OWNER, port=port, boot_id=boot, grant_addr=secret.ctypes.data) as fake:
            _pull(puller, dst)
            assert link.path_name == "tcp", link
            assert (dst == 0x5A).all()
            assert fake.reads and not any(f & p.ReadFlags.GRANT for f in fake.reads)
    finally:
        puller.close()


def test_genuine_same_host_link_uses_the_verified_pid(owner) -> None:
    eng, data = owner
    puller = _puller()
    try:
        link = puller.link(OWNER, *eng.listen_address, 2.0)
        assert isinstance(link.path, CmaPath) and link.path.pid == os.getpid()
        assert link.chan.local_cred is not None
        dst = np.zeros(N, dtype=np.uint8)
        _pull(puller, dst)
        assert np.array_equal(dst, data)
    finally:
        puller.close()


# ---------------------------------------------------------------------------- item 6


class Raw:
    """A hand-driven client on TCP or on the owner's local channel."""

    def __init__(self, where: tuple[str, int] | bytes) -> None:
        if isinstance(where, bytes):
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(5.0)
            self.sock.connect(where)
        else:
            self.sock = socket.create_connection(where, timeout=5.0)
        self.dec = p.FrameDecoder()
        self.pending: list = []
        self.rid = 0

    def call(self, msg: p.Message) -> p.Message:
        self.rid += 1
        self.sock.sendall(p.encode(msg, self.rid))
        while not self.pending:
            chunk = self.sock.recv(65536)
            assert chunk, "the owner closed the connection"
            self.pending += self.dec.feed(chunk)
        return self.pending.pop(0)[1]

    def hello(self) -> p.Welcome:
        w = self.call(p.Hello(PULLER, 2, os.getpid(), 0, b"\0" * 16))
        assert isinstance(w, p.Welcome)
        return w

    def grant(self, key: p.KeyRef = KEY, n: int = 64) -> p.Message:
        return self.call(p.Read(key, 0, p.ReadFlags.GRANT, np.array([0], np.uint32),
                                np.array([0], np.uint64), np.array([n], np.uint64)))

    def close(self) -> None:
        self.sock.close()


def test_grants_only_on_the_local_channel(owner) -> None:
    """Over TCP a GRANT read is refused and no address leaks; on the local channel it is
    served. WELCOME says where the local channel is."""
    eng, data = owner
    c = Raw(eng.listen_address)
    try:
        assert c.hello().features & p.FEATURE_LOCAL
        got = c.grant()
        assert isinstance(got, p.Error) and got.code == Code.PARAM_INVALID, got
        assert hex(data.ctypes.data) not in got.message and str(data.ctypes.data) not in got.message
        assert isinstance(c.call(p.Ping(3)), p.Pong)  # the connection stays usable
    finally:
        c.close()
    c = Raw(local_name(os.getpid(), OWNER))
    try:
        c.hello()
        got = c.grant()
        assert isinstance(got, p.Grant) and int(got.bases[0]) == data.ctypes.data
    finally:
        c.close()


def test_cache_leases_only_on_the_local_channel(owner) -> None:
    """A whole-cache lease (addresses of every tensor, a fence file) is refused over TCP with
    no address in the refusal, the connection usable; on the local channel it is served, and
    its fence is a sealed memfd of the owner's that the reader can open."""
    eng, data = owner
    key = p.KeyRef(p.KeyKind.CACHE_ID, 1, 0)
    c = Raw(eng.listen_address)
    try:
        assert c.hello().features & p.FEATURE_LEASE
        got = c.call(p.LeaseRequest(key))
        assert isinstance(got, p.Error) and got.code == Code.PARAM_INVALID, got
        assert str(data.ctypes.data) not in got.message
        assert isinstance(c.call(p.Ping(4)), p.Pong)
    finally:
        c.close()
    c = Raw(local_name(os.getpid(), OWNER))
    try:
        c.hello()
        got = c.call(p.LeaseRequest(key))
        assert isinstance(got, p.CacheLease) and int(got.addrs[0]) == data.ctypes.data
        from datadist.transport.fence import FenceView

        view = FenceView(os.getpid(), got.fence_fd, got.fence_ino)
        try:
            assert view.enter()
            view.leave()
        finally:
            view.close()
        # a CacheKey is never leased: its consumption stays with the owner (a protocol error)
        # (built by hand: the encoder refuses to say it)
        body = struct.pack("<BQQQI", p.KeyKind.CACHE_KEY, 1, 0, 0, 0)
        bad = p.HEADER.pack(p.MAGIC, p.VERSION, p.MsgType.LEASE_REQUEST, 9, len(body)) + body
        c.sock.sendall(bad)
        _, reply = p.FrameDecoder().feed(c.sock.recv(4096))[0]
        assert isinstance(reply, p.Error) and "by id or BlocksCacheKey" in reply.message
    finally:
        c.close()


@pytest.fixture
def pool_owner():
    eng = Engine(EngineConfig(cluster_id=OWNER, role=1, listen=("127.0.0.1", 0),
                              host_pool=PoolConfig(1 << 20, 16)))
    clients: list[Raw] = []
    entry = eng.allocate(Geometry(1, 1 << 20, 1), placement=engine_mod.HOST)

    def client() -> Raw:
        clients.append(Raw(local_name(os.getpid(), OWNER)))
        clients[-1].hello()
        return clients[-1]

    yield eng, p.KeyRef(p.KeyKind.CACHE_ID, entry.cache_id, 0), client
    for c in clients:
        c.close()
    eng.close()


def _wait_allocatable(eng: Engine, within: float) -> float:
    """Seconds until the whole pool can be allocated again (fails after ``within``)."""
    t0 = time.monotonic()
    while True:
        try:
            eng.allocate(Geometry(1, 1 << 20, 1), placement=engine_mod.HOST)
            return time.monotonic() - t0
        except OutOfMemory:
            assert time.monotonic() - t0 < within, "the pool stayed exhausted"
            time.sleep(0.05)


def test_grants_are_capped_per_connection_and_per_peer(pool_owner) -> None:
    eng, key, client = pool_owner
    conns = engine_mod.MAX_GRANTS_PER_PEER // tcp.MAX_GRANTS_PER_CONNECTION
    first = client()
    for c in [first] + [client() for _ in range(conns - 1)]:
        for _ in range(tcp.MAX_GRANTS_PER_CONNECTION):
            assert isinstance(c.grant(key), p.Grant)
    over = first.grant(key)  # this connection is full
    assert isinstance(over, p.Error) and over.code == Code.LINK_BUSY, over
    over = client().grant(key)  # a new connection of the same process: the peer is full
    assert isinstance(over, p.Error) and over.code == Code.LINK_BUSY, over
    assert eng._grants == {os.getpid(): engine_mod.MAX_GRANTS_PER_PEER}


def test_a_deallocated_cache_is_reclaimed_from_silent_grants(
        pool_owner, monkeypatch: pytest.MonkeyPatch) -> None:
    """A verified peer takes grants and never releases them, nor disconnects: once the
    cache is deallocated its memory is back in the pool within RECLAIM_GRACE (+ a sweep),
    long before GRANT_TTL."""
    monkeypatch.setattr(tcp, "RECLAIM_GRACE", 1.0)
    eng, key, client = pool_owner
    c = client()
    for _ in range(tcp.MAX_GRANTS_PER_CONNECTION):
        assert isinstance(c.grant(key), p.Grant)
    eng.deallocate(key.a)
    with pytest.raises(OutOfMemory):  # still leased: not back yet
        eng.allocate(Geometry(1, 1 << 20, 1), placement=engine_mod.HOST)
    assert _wait_allocatable(eng, 8.0) < tcp.GRANT_TTL
    assert not eng._grants
    assert isinstance(c.call(p.Ping(1)), p.Pong)  # the peer is still served


def test_grants_expire_after_their_ttl(pool_owner, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tcp, "GRANT_TTL", 1.0)
    eng, key, client = pool_owner
    c = client()
    assert isinstance(c.grant(key), p.Grant)
    assert eng._grants
    deadline = time.monotonic() + 8.0
    while eng._grants:
        assert time.monotonic() < deadline, "the grant never expired"
        time.sleep(0.05)
    eng.deallocate(key.a)  # nothing holds it now: back at once
    assert _wait_allocatable(eng, 0.5) < 0.5


# ---------------------------------------------------------------------------- item 7

_SAME_FD_NEW_INODE = textwrap.dedent("""
    import os, socket, threading, time
    import numpy as np
    from datadist.core.errors import RemoteProtocolError
    from datadist.memory.pool import memfd_map
    from datadist.transport.paths import CmaPath
    from datadist.transport.channel import Channel
    from datadist.wire import protocol as p

    SIZE = 1 << 16
    fd_a, addr_a = memfd_map("a", SIZE)
    (np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * SIZE).from_address(addr_a)))[:] = 1
    FD = fd_a
    ino = lambda fd: os.fstat(fd).st_ino
    grants = []
    a, b = socket.socketpair()

    def owner():
        dec, pending = p.FrameDecoder(), []
        for g in iter(lambda: grants.pop(0) if grants else None, None):
            while True:
                while not pending:
                    pending += dec.feed(a.recv(65536))
                rid, msg = pending.pop(0)
                if isinstance(msg, p.Read):
                    a.sendall(p.encode(g, rid))
                    break

    chan = Channel(b, "pair")
    path = CmaPath(os.getpid())
    dst = np.zeros(2 * SIZE, dtype=np.uint8)

    def read(n_tensors, grant):
        grants.append(grant)
        t = threading.Thread(target=owner, daemon=True)
        t.start()
        local = np.array([[dst.ctypes.data, n_tensors * SIZE]], dtype=np.uint64)
        msg = p.Read(p.KeyRef(p.KeyKind.CACHE_ID, 1, 0), 0, p.ReadFlags.NONE,
                     np.arange(n_tensors, dtype=np.uint32), np.array([0], np.uint64),
                     np.array([SIZE], np.uint64))
        try:
            path.read(chan, msg, local, time.monotonic() + 5)
        finally:
            t.join(5)

    read(1, p.ShmGrant(1, np.array([FD], "<i4"), np.array([ino(FD)], "<u8"),
                       np.array([0], "<u8")))
    assert (dst[:SIZE] == 1).all() and path.last == "shm"
    old = ino(FD)
    fd_b, addr_b = memfd_map("b", 4 * SIZE)  # a new, bigger file now behind the same fd number
    os.dup2(fd_b, FD)
    new = ino(FD)
    try:
        read(2, p.ShmGrant(2, np.array([FD, FD], "<i4"), np.array([old, new], "<u8"),
                           np.array([0, 0], "<u8")))
    except RemoteProtocolError as e:
        print("refused:", e)
    else:
        print("copied")
""")


def test_shm_grant_naming_one_fd_with_two_inodes_is_refused() -> None:
    """An owner names fd X with the inode we mapped, then fd X with a new inode, in one
    grant. The old code unmapped the first mapping while resolving the second and copied
    from it: SIGSEGV. Every mapping must be resolved before any is unmapped: refused."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([sys.executable, "-c", _SAME_FD_NEW_INODE], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert "refused: shm grant names fd" in r.stdout, r.stdout


def test_pools_and_shared_arrays_are_sealed_against_shrinking() -> None:
    pool = HostPool(1 << 20, 16)
    try:
        with pytest.raises(PermissionError):
            os.ftruncate(pool.fd, 4096)
    finally:
        pool.close()
    arr = shared.shared_empty(4096, np.uint8)
    arena = shared.ARENAS.find(arr.ctypes.data, 4096)
    assert arena is not None
    with pytest.raises(PermissionError):
        os.ftruncate(arena.fd, 0)


def test_unsealed_memfd_is_not_mapped() -> None:
    """A memfd its owner could shrink under our copy (SIGBUS) is not mapped: the reader
    falls back to cross-memory attach (ShmUnavailable), and maps nothing."""
    fd = os.memfd_create("unsealed", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, 1 << 16)
        path = CmaPath(os.getpid())
        with pytest.raises(ShmUnavailable, match="not sealed"):
            path._map(fd, os.fstat(fd).st_ino)
        sealed, addr = memfd_map("sealed", 1 << 16)
        try:
            got, size = path._map(sealed, os.fstat(sealed).st_ino)
            assert size == 1 << 16
            unmap(got, size)
        finally:
            unmap(addr, 1 << 16)
            os.close(sealed)
    finally:
        os.close(fd)


def test_shm_grant_naming_a_fifo_does_not_hang() -> None:
    r, w = os.pipe()
    try:
        path = CmaPath(os.getpid())
        t0 = time.monotonic()
        with pytest.raises(DatadistError):
            path._map(r, os.fstat(r).st_ino)
        assert time.monotonic() - t0 < 2
    finally:
        os.close(r)
        os.close(w)


# ---------------------------------------------------------------------------- item 12


@pytest.fixture
def ptracer(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A fresh process-wide Ptracer under a simulated Yama scope 1; returns the prctl
    values set, in order."""
    calls: list[int] = []
    monkeypatch.setattr(iov, "_yama_scope", lambda: "1")
    monkeypatch.setattr(iov, "_prctl_ptracer", lambda v: calls.append(v) or 0)
    monkeypatch.setattr(engine_mod, "PTRACER", iov.Ptracer())
    return calls


def _owner(**kw: object) -> tuple[Engine, np.ndarray]:
    eng = Engine(EngineConfig(cluster_id=OWNER, role=1, listen=("127.0.0.1", 0), **kw))  # type: ignore[arg-type]
    data = shared.shared_empty(N, np.uint8)
    data[:] = np.arange(N, dtype=np.uint8)
    eng.register(GEO, [data.ctypes.data], placement=0)
    return eng, data


@pytest.mark.parametrize(("owner_kw", "transport", "want"), [
    ({}, "cma", [iov.PR_SET_PTRACER_ANY, 0]),  # cross-memory attach: set, undone at close
    ({}, "shm", []),  # shared memory needs no ptrace permission
    ({}, "tcp", []),
    ({"allow_ptrace": False}, "cma", []),  # the opt-out
    ({"transport": "tcp"}, "cma", []),  # an owner forced to tcp serves no local channel
])
def test_ptracer_only_for_cross_memory_attach(ptracer: list[int], owner_kw: dict,
                                              transport: str, want: list[int],
                                              caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="datadist.core.engine")
    eng, data = _owner(**owner_kw)
    try:
        assert ptracer == []  # listening alone sets nothing
        puller = _puller(transport)
        try:
            link = puller.link(OWNER, *eng.listen_address, 2.0)
            if "transport" in owner_kw:
                assert link.path_name == "tcp"
            dst = np.zeros(N, dtype=np.uint8)
            _pull(puller, dst)
            _pull(puller, dst)
            assert np.array_equal(dst, data)
        finally:
            puller.close()
    finally:
        eng.close()
    assert ptracer == want
    said = [r.getMessage() for r in caplog.records if "same-host readers" in r.getMessage()]
    if want:  # set and undone, both logged
        assert any("PR_SET_PTRACER_ANY set" in m for m in said), said
        assert any("PR_SET_PTRACER_ANY undone" in m for m in said), said
    else:
        assert not said, said


def test_refused_cross_memory_attach_keeps_shared_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the kernel refuses cross-memory attach (an owner that did not let us ptrace
    it), caches in shareable memory are still read through it (no ptrace permission needed),
    even with many spans; the others are streamed over the same channel."""
    from datadist.transport import paths

    def refused(*_: object, **__: object) -> None:
        raise iov.CmaRefused("Operation not permitted (simulated)")

    monkeypatch.setattr(paths, "vm_copy", refused)
    monkeypatch.setattr(iov.VmCopy, "run", refused)  # a leased copy, prepared
    eng = Engine(EngineConfig(cluster_id=OWNER, role=1, listen=("127.0.0.1", 0),
                              host_pool=PoolConfig(2 << 20, 12)))
    puller = _puller()
    try:
        many = Geometry(300, 64, 1)  # 300 spans: above SHM_MAX_SPANS, cma would be asked
        pooled = eng.allocate(many, placement=engine_mod.HOST)
        want = np.random.default_rng(5).integers(0, 255, (300, 64), dtype=np.uint8)
        for t, addr in enumerate(pooled.addrs.tolist()):
            np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * 64).from_address(addr))[:] = \
                want[t]
        plain = np.arange(N, dtype=np.uint8)
        plain_entry = eng.register(GEO, [plain.ctypes.data], placement=0)
        link = puller.link(OWNER, *eng.listen_address, 2.0)
        path = link.path
        assert isinstance(path, CmaPath)
        dst = np.zeros((300, 64), dtype=np.uint8)
        entry = puller.register(many, [int(a) for a in dst.ctypes.data + 64 * np.arange(300)],
                                placement=0)
        plan = plan_slot(many, 0, layer_tensor_indices(300, None, None, 2))
        puller.pull(OWNER, p.KeyRef(p.KeyKind.CACHE_ID, pooled.cache_id, 0), 0, plan,
                    entry.cache_id, 2.0)
        assert np.array_equal(dst, want) and path.last == "shm" and link.path is path
        dst1 = np.zeros(N, dtype=np.uint8)
        entry1 = puller.register(GEO, [dst1.ctypes.data], placement=0)
        puller.pull(OWNER, p.KeyRef(p.KeyKind.CACHE_ID, plain_entry.cache_id, 0), 0,
                    plan_slot(GEO, 0, layer_tensor_indices(1, None, None, 2)),
                    entry1.cache_id, 2.0)
        assert np.array_equal(dst1, plain) and path.last == "stream" and link.path is path
    finally:
        puller.close()
        eng.close()
