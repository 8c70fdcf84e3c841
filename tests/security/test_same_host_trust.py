"""The same-host trust model (issue 9, items 1, 6, 7, 12).

"Same host" is decided by the kernel (a unix-socket local channel and SO_PEERCRED), never by
what a peer says; a puller only ever reads the memory of the pid the kernel verified; grants
(addresses, leases) go only to verified peers, capped and expiring; a same-host owner cannot
crash a puller through its shared-memory grants (test_native_shm_trust.py); a refused
cross-memory attach keeps shared memory. Owners and pullers are the C++ core's engines; fake
owners are raw sockets (datadist.testing.fakes.EchoOwner), hostile readers raw clients.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import mmap
import os
import shutil
import socket
import stat
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from _hand import DENY_CMA, local_name

from datadist.core.config import HOST, EngineConfig
from datadist.core.errors import Code, DatadistError, OutOfMemory
from datadist.core.layout import Geometry, every_tensor, plan_slot
from datadist.core.native import NativeEngine
from datadist.memory import shared
from datadist.memory.pool import PoolConfig
from datadist.testing.engine import host_pool_fd
from datadist.testing.fakes import EchoOwner
from datadist.wire import protocol as p

pytestmark = pytest.mark.timeout(60)

N = 4096
OWNER, PULLER = 1, 2
GEO = Geometry(1, N, 1)
KEY = p.KeyRef(p.KeyKind.CACHE_ID, 1, 0)
# the core's owner's grant limits (cpp/src/server.cc): unreleased grants per connection and
# per peer process, a grant's life, and its life once the owner wants the memory back
MAX_GRANTS_PER_CONNECTION, MAX_GRANTS_PER_PEER = 4, 16
GRANT_TTL, RECLAIM_GRACE = 30.0, 5.0


def _verified(link: object, pid: int) -> bool:
    """``link`` (a NativeLink) reads the process the kernel verified as ``pid``."""
    return (getattr(link, "path_name", None) == "cma"
            and f"verified by the kernel (pid {pid}," in getattr(link, "reason", ""))


def _puller(transport: str | None = None, **kw: object) -> NativeEngine:
    return NativeEngine(EngineConfig(cluster_id=PULLER, role=2, transport=transport, **kw))  # type: ignore[arg-type]


def _pull(puller: NativeEngine, dst: np.ndarray, cluster_id: int = OWNER) -> None:
    entry = puller.register(GEO, [dst.ctypes.data], placement=0)
    try:
        plan = plan_slot(GEO, 0, every_tensor(1))
        puller.pull(cluster_id, KEY, 0, plan, entry.cache_id, 2.0)
    finally:
        puller.unregister(entry.cache_id)


@pytest.fixture
def owner():
    eng = NativeEngine(EngineConfig(cluster_id=OWNER, role=1, listen=("127.0.0.1", 0)))
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
            assert _verified(link, proc.pid), link
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
        assert _verified(link, os.getpid()), link
        dst = np.zeros(N, dtype=np.uint8)
        _pull(puller, dst)
        assert np.array_equal(dst, data)
        eng.close()
        secret = np.full(N, 0xC3, dtype=np.uint8)
        boot = b"\x07" * 16 if moved_to == "another-boot-id" else None
        with EchoOwner(OWNER, port=port, boot_id=boot, grant_addr=secret.ctypes.data) as fake:
            _pull(puller, dst)
            assert puller.get_link(OWNER).path_name == "tcp", puller.get_link(OWNER)
            assert (dst == 0x5A).all()
            assert fake.reads and not any(f & p.ReadFlags.GRANT for f in fake.reads)
    finally:
        puller.close()


def test_genuine_same_host_link_uses_the_verified_pid(owner) -> None:
    eng, data = owner
    puller = _puller()
    try:
        link = puller.link(OWNER, *eng.listen_address, 2.0)
        assert _verified(link, os.getpid()), link
        dst = np.zeros(N, dtype=np.uint8)
        _pull(puller, dst)
        assert np.array_equal(dst, data)
        assert puller.last_moved(OWNER) == "cma"  # read from the verified pid's memory
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
        assert _fence_admits_a_copy(os.getpid(), got.fence_fd, got.fence_ino)
        # a CacheKey is never leased: its consumption stays with the owner (a protocol error)
        # (built by hand: the encoder refuses to say it)
        body = struct.pack("<BQQQI", p.KeyKind.CACHE_KEY, 1, 0, 0, 0)
        bad = p.HEADER.pack(p.MAGIC, p.VERSION, p.MsgType.LEASE_REQUEST, 9, len(body)) + body
        c.sock.sendall(bad)
        _, reply = p.FrameDecoder().feed(c.sock.recv(4096))[0]
        assert isinstance(reply, p.Error) and "by id or BlocksCacheKey" in reply.message
    finally:
        c.close()


def _fence_admits_a_copy(pid: int, fd: int, ino: int) -> bool:
    """A reader's check of a lease's fence file, as docs/protocol.md ("Cache leases") says
    it: /proc/<pid>/fd/<fd> opened anew, a regular file with inode ``ino`` of at least a page,
    sealed against shrinking; a copy may run when a shared flock is taken without blocking
    and the first byte is 0."""
    f = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        st = os.fstat(f)
        assert st.st_ino == ino and stat.S_ISREG(st.st_mode) and st.st_size >= mmap.PAGESIZE
        assert fcntl.fcntl(f, getattr(fcntl, "F_GET_SEALS", 1034)) & 0x2  # F_SEAL_SHRINK
        with mmap.mmap(f, mmap.PAGESIZE, prot=mmap.PROT_READ) as m:
            try:
                fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            try:
                return m[0] == 0
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
    finally:
        os.close(f)


@pytest.fixture
def pool_owner():
    eng = NativeEngine(EngineConfig(cluster_id=OWNER, role=1, listen=("127.0.0.1", 0),
                              host_pool=PoolConfig(1 << 20, 16)))
    clients: list[Raw] = []
    entry = eng.allocate(Geometry(1, 1 << 20, 1), placement=HOST)

    def client() -> Raw:
        clients.append(Raw(local_name(os.getpid(), OWNER)))
        clients[-1].hello()
        return clients[-1]

    yield eng, p.KeyRef(p.KeyKind.CACHE_ID, entry.cache_id, 0), client
    for c in clients:
        c.close()
    eng.close()


def _wait_allocatable(eng: NativeEngine, within: float) -> float:
    """Seconds until the whole pool can be allocated again (fails after ``within``)."""
    t0 = time.monotonic()
    while True:
        try:
            eng.allocate(Geometry(1, 1 << 20, 1), placement=HOST)
            return time.monotonic() - t0
        except OutOfMemory:
            assert time.monotonic() - t0 < within, "the pool stayed exhausted"
            time.sleep(0.05)


def test_grants_are_capped_per_connection_and_per_peer(pool_owner) -> None:
    eng, key, client = pool_owner
    conns = MAX_GRANTS_PER_PEER // MAX_GRANTS_PER_CONNECTION
    first = client()
    for c in [first] + [client() for _ in range(conns - 1)]:
        for _ in range(MAX_GRANTS_PER_CONNECTION):
            assert isinstance(c.grant(key), p.Grant)
    over = first.grant(key)  # this connection is full
    assert isinstance(over, p.Error) and over.code == Code.LINK_BUSY, over
    last = client()
    over = last.grant(key)  # a new connection of the same process: the peer is full
    assert isinstance(over, p.Error) and over.code == Code.LINK_BUSY, over
    assert isinstance(last.call(p.Ping(2)), p.Pong)  # refused, still served


def test_a_deallocated_cache_is_reclaimed_from_silent_grants(pool_owner) -> None:
    """A verified peer takes grants and never releases them, nor disconnects: once the
    cache is deallocated its memory is back in the pool within RECLAIM_GRACE (+ a sweep),
    long before GRANT_TTL."""
    eng, key, client = pool_owner
    c = client()
    for _ in range(MAX_GRANTS_PER_CONNECTION):
        assert isinstance(c.grant(key), p.Grant)
    eng.deallocate(key.a)
    with pytest.raises(OutOfMemory):  # still leased: not back yet
        eng.allocate(Geometry(1, 1 << 20, 1), placement=HOST)
    assert _wait_allocatable(eng, GRANT_TTL - 5) < GRANT_TTL
    assert isinstance(c.call(p.Ping(1)), p.Pong)  # the peer is still served


@pytest.mark.timeout(120)
def test_grants_expire_after_their_ttl(pool_owner) -> None:
    """A grant nobody releases and nobody wants back ends after GRANT_TTL (30 s in the core):
    a deallocation after that gets the memory back at once, not after RECLAIM_GRACE."""
    eng, key, client = pool_owner
    c = client()
    assert isinstance(c.grant(key), p.Grant)
    time.sleep(GRANT_TTL + 1)
    assert isinstance(c.call(p.Ping(1)), p.Pong)  # the connection is served meanwhile
    eng.deallocate(key.a)  # nothing holds it now: back at once
    assert _wait_allocatable(eng, RECLAIM_GRACE - 1) < RECLAIM_GRACE - 1


# ---------------------------------------------------------------------------- item 7

# What a lying same-host owner's SHM_GRANTs can do to the core's reader (one fd named with
# two inodes, an unsealed memfd, a FIFO, spans past a mapping) is checked in
# test_native_shm_trust.py, and in cpp/tests/shm_test.cc (ShmMap, ShmMaps, ShmSpans).


def test_pools_and_shared_arrays_are_sealed_against_shrinking() -> None:
    from datadist.core.config import EngineConfig
    from datadist.core.native import NativeEngine

    eng = NativeEngine(EngineConfig(cluster_id=64, role=0, host_pool=PoolConfig(1 << 20, 16)))
    try:  # the core's pool memfd
        fd = host_pool_fd()
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 4096)
    finally:
        eng.close()
    arr = shared.shared_empty(4096, np.uint8)
    arena = shared.ARENAS.find(arr.ctypes.data, 4096)
    assert arena is not None
    with pytest.raises(PermissionError):
        os.ftruncate(arena.fd, 0)


# ---------------------------------------------------------------------------- item 12


_PTRACER = textwrap.dedent("""
    import json, sys
    import numpy as np
    from datadist.core.config import EngineConfig
    from datadist.core.layout import Geometry, every_tensor, plan_slot
    from datadist.core.native import NativeEngine
    from datadist.memory import shared
    from datadist.wire import protocol as p

    owner_kw, transport = json.loads(sys.argv[1]), sys.argv[2] or None
    N = 128 << 10  # above the 64 KiB under which same-host pulls stream
    GEO = Geometry(1, N, 1)
    eng = NativeEngine(EngineConfig(cluster_id=1, role=1, listen=("127.0.0.1", 0), **owner_kw))
    data = shared.shared_empty(N, np.uint8)  # shareable: shm can read it without ptrace
    data[:] = np.arange(N) % 251
    eng.register(GEO, [data.ctypes.data], placement=0)
    print("listening", flush=True)
    puller = NativeEngine(EngineConfig(cluster_id=2, role=2, transport=transport))
    puller.link(1, *eng.listen_address, 2.0)
    dst = np.zeros(N, np.uint8)
    entry = puller.register(GEO, [dst.ctypes.data], placement=0)
    plan = plan_slot(GEO, 0, every_tensor(1))
    for _ in range(2):
        puller.pull(1, p.KeyRef(p.KeyKind.CACHE_ID, 1, 0), 0, plan, entry.cache_id, 2.0)
        assert np.array_equal(dst, data)
    print("pulled", puller.get_link(1).path_name, flush=True)
    puller.close()
    eng.close()
    print("closed", flush=True)
""")


def _can_simulate_yama() -> bool:
    return (os.geteuid() == 0 and shutil.which("strace") is not None
            and shutil.which("unshare") is not None
            and subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode == 0)


@pytest.mark.skipif(not _can_simulate_yama(), reason="needs root, unshare and strace")
@pytest.mark.parametrize(("owner_kw", "transport", "want"), [
    ({}, "cma", ["PR_SET_PTRACER_ANY", "0"]),  # cross-memory attach: set, undone at close
    ({}, "shm", []),  # shared memory needs no ptrace permission
    ({}, "tcp", []),
    ({"allow_ptrace": False}, "cma", []),  # the opt-out
    ({"transport": "tcp"}, "cma", []),  # an owner forced to tcp serves no local channel
])
def test_ptracer_only_for_cross_memory_attach(owner_kw: dict, transport: str,
                                              want: list[str], tmp_path) -> None:
    """Under Yama ptrace_scope 1 the core's owner lets same-host readers ptrace it
    (PR_SET_PTRACER_ANY) only once one reads it by cross-memory attach, and undoes it when
    it stops; never for shared memory, TCP, with allow_ptrace off, or without a local
    channel. The owner runs in a child in a mount namespace of its own whose
    /proc/sys/kernel says ptrace_scope 1 (a tmpfs), under strace, which records its prctl
    calls and answers them 0 (no Yama on the real kernel here)."""
    boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    log = tmp_path / "strace.txt"
    setup = ("mount -t tmpfs none /proc/sys/kernel && "
             "mkdir -p /proc/sys/kernel/yama /proc/sys/kernel/random && "
             "echo 1 > /proc/sys/kernel/yama/ptrace_scope && "
             f"echo {boot_id} > /proc/sys/kernel/random/boot_id && "
             f'exec strace -f -qq -e trace=prctl,write -e inject=prctl:retval=0 -o {log} '
             '"$0" -c "$1" "$2" "$3"')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run(["unshare", "-m", "sh", "-c", setup, sys.executable, _PTRACER,
                        json.dumps(owner_kw), transport], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, (r.stdout, r.stderr[-2000:])
    assert r.stdout.split() == ["listening", "pulled",
                                "tcp" if "transport" in owner_kw else transport, "closed"]
    calls: list[str] = []
    for line in log.read_text().splitlines():
        if 'write(1, "listening"' in line or 'write(1, "closed"' in line:
            calls.append(line.split('"')[1])
        elif "PR_SET_PTRACER," in line:
            calls.append(line.split("PR_SET_PTRACER, ")[1].split(")")[0])
    assert calls == ["listening", *want, "closed"], calls  # listening alone sets nothing


_REFUSED_ATTACH = DENY_CMA + textwrap.dedent("""
    import numpy as np
    from datadist.core.config import HOST, EngineConfig
    from datadist.core.layout import Geometry, every_tensor, plan_slot
    from datadist.core.native import NativeEngine
    from datadist.memory.pool import PoolConfig
    from datadist.wire import protocol as p

    N = 128 << 10  # above the 64 KiB under which same-host pulls stream anyway
    GEO = Geometry(1, N, 1)
    eng = NativeEngine(EngineConfig(cluster_id=1, role=1, listen=("127.0.0.1", 0),
                                    host_pool=PoolConfig(4 << 20, 12)))
    puller = NativeEngine(EngineConfig(cluster_id=2, role=2))
    # 300 spans of 512 bytes: too many, too short for shared memory to pay, were cross-memory
    # attach allowed
    many = Geometry(300, 512, 1)
    pooled = eng.allocate(many, placement=HOST)
    want = np.random.default_rng(5).integers(0, 255, (300, 512), dtype=np.uint8)
    for t, addr in enumerate(pooled.addrs.tolist()):
        np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * 512).from_address(addr))[:] = \\
            want[t]
    plain = (np.arange(N) % 251).astype(np.uint8)
    plain_entry = eng.register(GEO, [plain.ctypes.data], placement=0)
    puller.link(1, *eng.listen_address, 2.0)
    link = puller.get_link(1)
    assert link.path_name == "cma", link
    dst = np.zeros((300, 512), dtype=np.uint8)
    entry = puller.register(many, [int(a) for a in dst.ctypes.data + 512 * np.arange(300)],
                            placement=0)
    plan = plan_slot(many, 0, every_tensor(300))
    puller.pull(1, p.KeyRef(p.KeyKind.CACHE_ID, pooled.cache_id, 0), 0, plan,
                entry.cache_id, 2.0)
    assert np.array_equal(dst, want)
    print("pooled:", puller.last_moved(1), puller.get_link(1) == link)
    dst1 = np.zeros(N, dtype=np.uint8)
    entry1 = puller.register(GEO, [dst1.ctypes.data], placement=0)
    puller.pull(1, p.KeyRef(p.KeyKind.CACHE_ID, plain_entry.cache_id, 0), 0,
                plan_slot(GEO, 0, every_tensor(1)), entry1.cache_id, 2.0)
    assert np.array_equal(dst1, plain)
    print("plain:", puller.last_moved(1), puller.get_link(1) == link)
    print("reason:", puller.get_link(1).reason)
    puller.close()
    eng.close()
""")


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the seccomp filter is x86-64's")
def test_refused_cross_memory_attach_keeps_shared_memory() -> None:
    """Where the kernel refuses cross-memory attach (here a seccomp filter in a child
    process makes process_vm_readv answer EPERM, as for an owner that did not let us ptrace
    it), caches in shareable memory are still read through it (no ptrace permission needed),
    even with many spans; the others are streamed over the same channel (the same link)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([sys.executable, "-c", _REFUSED_ATTACH], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-2000:])
    lines = r.stdout.splitlines()
    assert lines[:2] == ["pooled: shm True", "plain: stream True"], lines
    assert "refused by the kernel" in lines[2], lines
