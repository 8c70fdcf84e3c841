"""What a NIXL peer can do to the process it links to (issue 26; docs/security.md, "The NIXL
path"). The attacker is stock NIXL driven by hand (datadist.testing.nixl_peer): it gets an
owner's metadata over the control channel, as a reader does, then posts its own READs and
WRITEs, with the metadata as sent or with a region's length rewritten. Owners and readers
are the C++ core's engines; a hostile owner's requests and answers to a reader come from a
man in the middle (``_hand.Mitm``) between the reader and a real owner.

What holds:

1. serving NIXL is opt-in (``nixl_serve``), and on UCX transports whose memory keys the
   hardware does not check (this host: tcp and shared memory) needs ``nixl_whole_process``
   as well; without them no metadata leaves the owner. With both, a peer does reach the
   whole process: the test says so, as the docs do;
2. an owner that refuses remote writes (``remote_cache_accessible`` off) serves no NIXL: a
   NIXL registration is writable by whoever holds the metadata;
3. a reader's reverse channel answers no NIXL request (only the owner's NixlRevoke), and a
   client's connection takes no NixlRevoke;
4. caches registered with ``remote_accessible=False`` are never registered with NIXL;
5. the serve setting is checked on every NIXL request, not only before the agent exists;
6. a reader keeps revokes of lease ids it does not know only while a lease request of its
   own is in flight, and boundedly.

Skipped without NIXL (nixl-cu12), except the pure checks (transports).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import subprocess
import sys
import textwrap
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from _hand import Mitm

import datadist as llm_datadist
from datadist.core import nixl_wheel as nixl
from datadist.core.config import EngineConfig
from datadist.core.errors import DatadistError, InvalidArgument, NotSupported
from datadist.core.layout import Geometry, every_tensor, plan_slot
from datadist.core.native import NativeEngine
from datadist.core.nixl_wheel import unchecked_transports
from datadist.testing import engine as hooks
from datadist.wire import protocol as p

pytestmark = pytest.mark.timeout(60)
needs_nixl = pytest.mark.skipif(nixl.available() is None, reason="nixl-cu12 not installed")
OWNER, READER = 1, 2
N = 4096  # bytes of a cache; the owner's secret lies right after it, unregistered
SECRET = 0x5A
SERVE = {"nixl_serve": True, "nixl_whole_process": True}


class Raw:
    """A hand-driven client of an owner's control channel."""

    def __init__(self, where: tuple[str, int]) -> None:
        self.sock = socket.create_connection(where, timeout=10.0)
        self.dec = p.FrameDecoder()
        self.pending: list[Any] = []
        self.rid = 0
        w = self.call(p.Hello(READER + 40, 2, os.getpid(), 0, b"\7" * 16))
        assert isinstance(w, p.Welcome), w

    def call(self, msg: p.Message) -> p.Message:
        self.rid += 1
        self.sock.sendall(p.encode(msg, self.rid))
        while not self.pending:
            chunk = self.sock.recv(65536)
            assert chunk, "the owner closed the connection"
            self.pending += self.dec.feed(chunk)
        return self.pending.pop(0)[1]  # type: ignore[no-any-return]

    def close(self) -> None:
        self.sock.close()


def _owner(**kw: Any) -> NativeEngine:
    return NativeEngine(EngineConfig(cluster_id=OWNER, role=1, listen=("127.0.0.1", 0), **kw))


def _reader(**kw: Any) -> NativeEngine:
    return NativeEngine(EngineConfig(cluster_id=READER, role=2, transport="nixl",
                                     nixl_whole_process=True, **kw))


def _made(owner: NativeEngine) -> bool:
    """Has the owner made its NIXL agent (a reader asked, and it serves)?"""
    return hooks.nixl_agent(owner) is not None


def _reconfigure(owner: NativeEngine, **kw: Any) -> None:
    """The owner's NIXL options changed under it, as a running owner asks them anew."""
    cfg = dataclasses.replace(owner.config, **kw)
    owner.config = cfg
    hooks.set_nixl_options(owner, serve=cfg.nixl_serve, whole_process=cfg.nixl_whole_process)
    owner._core.set_remote_writes(cfg.remote_cache_accessible)


@pytest.fixture
def memory() -> Iterator[np.ndarray]:
    """2N bytes: the first N a cache (zeros), the last N the owner's secret (never
    registered anywhere)."""
    buf = np.zeros(2 * N, np.uint8)
    buf[N:] = SECRET
    yield buf


@pytest.fixture
def thief() -> Iterator[Any]:
    from datadist.testing.nixl_peer import NixlThief

    t = NixlThief()
    yield t
    t.close()


def _metadata(owner: NativeEngine) -> p.Message:
    raw = Raw(owner.listen_address)  # type: ignore[arg-type]
    try:
        return raw.call(p.NixlMdRequest())
    finally:
        raw.close()


def _progress(owner: NativeEngine) -> Any:
    """The owner's pump beats only while a lease is open: the thief drives it instead (as
    another reader's lease would)."""
    return lambda: hooks.nixl_progress(owner)


def _steal(owner: NativeEngine, thief: Any, memory: np.ndarray) -> bytes | p.Message:
    """Item 1's attack: the owner's metadata with the cache's region stretched over the
    secret, a NIXL READ of the secret. The bytes read, or the owner's refusal."""
    md = _metadata(owner)
    if not isinstance(md, p.NixlMd):
        return md
    from datadist.testing.nixl_peer import forge_region_length

    addr = memory.ctypes.data
    name = thief.load(forge_region_length(md.metadata, addr, N, 2 * N))
    got: bytes = thief.read(name, addr + N, N, progress=_progress(owner))
    return got


def _refused(got: Any, why: str) -> None:
    assert isinstance(got, p.Error), f"the owner handed out {type(got).__name__}"
    assert got.code == int(NotSupported.code), got
    assert why in got.message, got.message


# ------------------------------------------------------------------------------ item 1


@needs_nixl
def test_a_default_owner_hands_no_nixl_peer_anything(memory, thief) -> None:
    """NIXL merely installed is no consent: a default owner (no option) answers
    NixlMdRequest with NOT_SUPPORTED and makes no agent. Before, it served its metadata
    and a peer that stretched a region read the unregistered secret next to it."""
    owner = _owner()
    try:
        owner.register(Geometry(1, N, 1), [memory.ctypes.data], placement=0)
        _refused(_steal(owner, thief, memory), "datadist.NixlServe")
        assert not _made(owner)
    finally:
        owner.close()


@needs_nixl
def test_unchecked_transports_need_the_whole_process_allowance(
        memory, thief, monkeypatch: pytest.MonkeyPatch) -> None:
    """Told to serve NIXL, an owner whose UCX may use tcp or shared memory (UCX_TLS unset,
    no RDMA device: this host) still refuses, naming the option that would allow it."""
    monkeypatch.delenv("UCX_TLS", raising=False)
    owner = _owner(nixl_serve=True)
    try:
        owner.register(Geometry(1, N, 1), [memory.ctypes.data], placement=0)
        _refused(_steal(owner, thief, memory), "datadist.NixlAllowWholeProcessAccess")
        assert not _made(owner)
    finally:
        owner.close()


@needs_nixl
def test_with_the_allowance_a_nixl_peer_reaches_the_whole_process(
        memory, thief) -> None:
    """What the allowance allows, as docs/security.md says: on key-unchecked transports a
    NIXL peer reads and writes outside every registered region."""
    owner = _owner(**SERVE)
    try:
        owner.register(Geometry(1, N, 1), [memory.ctypes.data], placement=0)
        got = _steal(owner, thief, memory)
        assert got == bytes([SECRET]) * N
    finally:
        owner.close()


@pytest.mark.parametrize(("tls", "devices", "checked"), [
    (None, True, False),  # unset: UCX picks tcp and shared memory too
    ("rc_mlx5,ud_mlx5", True, True),
    ("RC,\\ud_verbs", True, True),  # case and UCX's strict-name prefix
    ("dc_x,cuda_copy", True, True),
    ("rc_mlx5", False, False),  # no RDMA device: nothing would check a key
    ("rc,tcp", True, False),
    ("rc,sm", True, False),
    ("rc,self", True, False),
    ("cma", True, False),
    ("posix,sysv", True, False),
    ("cuda_ipc,rc", True, False),
    ("^tcp", True, False),  # an exclusion list leaves every other transport in
    ("all", True, False),
    ("srd", True, False),  # unknown to us: unchecked
])
def test_which_transports_count_as_key_checked(tmp_path, tls: str | None, devices: bool,
                                               checked: bool) -> None:
    env = {} if tls is None else {"UCX_TLS": tls}
    if devices:
        (tmp_path / "mlx5_0").mkdir()
    why = unchecked_transports(env, str(tmp_path))
    assert (why is None) == checked, why


_KEY_CHECKED = textwrap.dedent("""
    import dataclasses
    from datadist.core.config import EngineConfig
    from datadist.core.native import NativeEngine
    from datadist.testing import engine as hooks
    owner = NativeEngine(EngineConfig(cluster_id=1, role=1, listen=("127.0.0.1", 0),
                                      nixl_serve=True))

    def ask(**kw):
        cfg = dataclasses.replace(owner.config, **kw)
        hooks.set_nixl_options(owner, serve=cfg.nixl_serve, whole_process=cfg.nixl_whole_process)
        owner._core.set_remote_writes(cfg.remote_cache_accessible)
        print(repr(hooks.nixl_refusal(owner)))

    ask()
    ask(nixl_whole_process=True)
    ask(nixl_serve=False, nixl_whole_process=True)
    ask(nixl_whole_process=True, remote_cache_accessible=False)
    owner.close()
""")


@needs_nixl
def test_key_checked_transports_still_need_the_allowance_and_consent() -> None:
    """On RDMA verbs only (UCX_TLS, a device present) the NIC checks keys, but UCX's software
    RMA emulation (ucp/rma/rma_sw.c: ucp_put_handler copies to whatever address the message
    names) answers a modified UCX on every transport with active messages: nixl_serve alone
    is refused, naming that; with the allowance it serves; without nixl_serve or remote cache
    access it still refuses. The core's owner runs in a child process in a mount namespace
    of its own, where /sys/class/infiniband lists a device (a tmpfs; UCX's ib module off)."""
    if os.geteuid() != 0 or subprocess.run(["unshare", "-m", "true"],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs a mount namespace of its own (root, unshare)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path),
           "UCX_TLS": "rc_mlx5,ud_mlx5", "UCX_MODULES": "^ib"}
    script = ("mount -t tmpfs none /sys/class && mkdir -p /sys/class/infiniband/mlx5_0 && "
              'exec "$0" -c "$1"')
    r = subprocess.run(["unshare", "-m", "sh", "-c", script, sys.executable, _KEY_CHECKED],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, (r.stdout, r.stderr[-2000:])
    serve_alone, allowed, not_served, no_writes = r.stdout.splitlines()[-4:]
    assert "rma_sw.c" in serve_alone and "NixlAllowWholeProcessAccess" in serve_alone
    assert "no RDMA device" not in serve_alone, serve_alone
    assert allowed == "None"
    assert "NixlServe" in not_served
    assert "enable_remote_cache_accessible" in no_writes


@needs_nixl
def test_a_reader_links_by_nixl_over_unchecked_transports_only_when_allowed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader's UCX serves the owner's UCX too: where its transports check no key, a
    reader forced to nixl without the allowance links by TCP and says why."""
    monkeypatch.delenv("UCX_TLS", raising=False)
    owner = _owner(**SERVE)
    reader = NativeEngine(EngineConfig(cluster_id=READER, role=2, transport="nixl"))
    try:
        link = reader.link(OWNER, *owner.listen_address, 5.0)  # type: ignore[misc]
        assert link.path_name == "tcp"
        assert "NixlAllowWholeProcessAccess" in link.reason, link.reason
        assert not _made(owner)  # it never asked for the owner's metadata
    finally:
        reader.close()
        owner.close()


# ------------------------------------------------------------------------------ item 2


@needs_nixl
def test_an_owner_refusing_writes_hands_out_no_writable_registration(
        memory, thief) -> None:
    """NIXL registrations cannot be made read-only, so an owner with remote cache access
    off serves no NIXL at all: a peer that would post its own NIXL WRITE with the metadata
    exactly as sent gets none, and the cache is unchanged. Before, the write landed."""
    owner = _owner(**SERVE, remote_cache_accessible=False)
    try:
        owner.register(Geometry(1, N, 1), [memory.ctypes.data], placement=0)
        md = _metadata(owner)
        if isinstance(md, p.NixlMd):  # before: the attack, with the metadata as sent
            name = thief.load(md.metadata)
            thief.write(name, memory.ctypes.data, b"\x11" * N, progress=_progress(owner))
        assert not memory[:N].any(), "a NIXL peer wrote into an owner that refuses writes"
        _refused(md, "enable_remote_cache_accessible")
    finally:
        owner.close()


# ------------------------------------------------------------------------------ item 3


@needs_nixl
@pytest.mark.parametrize("reader_serves", [False, True])
def test_a_readers_reverse_channel_answers_no_nixl_request(reader_serves: bool) -> None:
    """The owner's end of a NIXL reader's link is the reader's reverse channel: on it the
    reader answers NixlMdRequest, NixlRead, NixlWrite and NixlLease with NOT_SUPPORTED,
    even when it serves NIXL on its own listener (before: its metadata, destination caches
    and pools included). The requests come from a hostile owner in the middle; the link
    stays usable both ways."""
    owner = _owner(**SERVE)
    reader = _reader(nixl_serve=reader_serves)
    try:
        with Mitm(owner.listen_address) as mitm:  # type: ignore[arg-type]
            dst = np.zeros(N, np.uint8)
            entry = reader.register(Geometry(1, N, 1), [dst.ctypes.data], placement=0)
            src = np.full(N, 3, np.uint8)
            owner.register(Geometry(1, N, 1), [src.ctypes.data], placement=0)
            link = reader.link(OWNER, *mitm.address, 5.0)
            assert link.path_name == "nixl", link.reason
            one, zero = np.ones(1, np.uint64), np.zeros(1, np.uint64)
            key = p.KeyRef(p.KeyKind.CACHE_ID, entry.cache_id, 0, 0)
            for msg in (p.NixlMdRequest(),
                        p.NixlRead(key, 0, p.ReadFlags.NONE, np.zeros(1, np.uint32), zero, one),
                        p.NixlWrite(key, 0, 0, np.zeros(1, np.uint32), zero, one),
                        p.NixlLease(key, 0)):
                _refused(mitm.inject(msg), "reverse channel")
            assert not dst.any()
            plan = plan_slot(entry.geometry, 0, every_tensor(1))
            reader.pull(OWNER, p.KeyRef(p.KeyKind.CACHE_ID, 1, 0), 0, plan, entry.cache_id,
                        5.0)
            assert (dst == 3).all()
            owner.check_link(READER, 5.0)  # a PING over the reverse channel
    finally:
        reader.close()
        owner.close()


@needs_nixl
def test_a_client_connection_takes_no_nixl_revoke() -> None:
    """NixlRevoke is the owner's to send, on a reverse channel; from a client it is
    refused (it would make the owner's engine revoke its own reads from that cluster)."""
    owner = _owner(**SERVE)
    raw = Raw(owner.listen_address)  # type: ignore[arg-type]
    try:
        _refused(raw.call(p.NixlRevoke(1)), "client")
        assert isinstance(raw.call(p.Ping(3)), p.Pong)
    finally:
        raw.close()
        owner.close()


# ------------------------------------------------------------------------------ item 4


@needs_nixl
def test_private_caches_are_never_registered_with_nixl(memory, thief) -> None:
    """A cache registered with remote_accessible=False is not in the NIXL registrations:
    an unmodified NIXL READ of it is refused by the peer's own NIXL, while one of a public
    cache works (the thief works). Before, the private cache's bytes came back."""
    owner = _owner(**SERVE)
    try:
        public = np.full(N, 9, np.uint8)
        owner.register(Geometry(1, N, 1), [public.ctypes.data], placement=0)
        memory[:N] = SECRET
        owner.register(Geometry(1, N, 1), [memory.ctypes.data], placement=0,
                       remote_accessible=False)
        md = _metadata(owner)
        assert isinstance(md, p.NixlMd), md
        name = thief.load(md.metadata)
        got = thief.read(name, public.ctypes.data, N, progress=_progress(owner))
        assert got == bytes([9]) * N
        with pytest.raises(Exception) as e:  # noqa: B017 - NIXL raises its own types
            thief.read(name, memory.ctypes.data, N, progress=_progress(owner))
        # Refused by the thief's NIXL when it builds the transfer (the private region is not
        # in the metadata: a NIXL status code), not after posting it (RuntimeError: the READ
        # went out and failed) nor by a wait that ran out (TimeoutError).
        assert not isinstance(e.value, (AssertionError, TimeoutError, RuntimeError)), e.value
        assert type(e.value).__module__.startswith("nixl"), (type(e.value), e.value)
        assert "NIXL_ERR_" in str(e.value), e.value
    finally:
        owner.close()


@needs_nixl
def test_a_reader_pulls_into_a_private_destination_and_hands_it_to_no_one() -> None:
    """A reader that serves no NIXL registers its private destination (NIXL reads into
    registered memory only) and pulls into it; its agent then refuses to produce metadata
    at all, even if serving were turned on later."""
    owner = _owner(**SERVE)
    reader = _reader(listen=("127.0.0.1", 0))
    try:
        src = np.full(N, 4, np.uint8)
        owner.register(Geometry(1, N, 1), [src.ctypes.data], placement=0)
        dst = np.zeros(N, np.uint8)
        entry = reader.register(Geometry(1, N, 1), [dst.ctypes.data], placement=0,
                                remote_accessible=False)
        link = reader.link(OWNER, *owner.listen_address, 5.0)  # type: ignore[misc]
        assert link.path_name == "nixl", link.reason
        plan = plan_slot(entry.geometry, 0, every_tensor(1))
        reader.pull(OWNER, p.KeyRef(p.KeyKind.CACHE_ID, 1, 0), 0, plan, entry.cache_id, 5.0)
        assert (dst == 4).all()
        _reconfigure(reader, nixl_serve=True)
        _refused(_metadata(reader), "private memory")
    finally:
        reader.close()
        owner.close()


# ------------------------------------------------------------------------------ item 5


@needs_nixl
def test_nixl_serve_off_holds_for_a_process_whose_agent_exists(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """DATADIST_NIXL_SERVE=0 on a process that reads by NIXL (its agent made at init) and
    also listens: it hands its metadata to no one. Before, the setting was looked at only
    while no agent existed."""
    monkeypatch.setenv("DATADIST_NIXL_SERVE", "0")
    monkeypatch.setenv("DATADIST_NIXL_ALLOW_WHOLE_PROCESS_ACCESS", "1")
    dd = llm_datadist.LLMDataDist(llm_datadist.LLMRole.PROMPT, 77)
    cfg = llm_datadist.LLMConfig()
    cfg.local_comm_res = ""
    cfg.listen_ip_info = "127.0.0.1:0"
    cfg.transport = "nixl"
    dd.init(cfg.generate_options())
    try:
        engine = dd.engine  # type: ignore[attr-defined]
        assert _made(engine)  # the reader's agent, made at init
        _refused(_metadata(engine), "NixlServe")
    finally:
        dd.finalize()


@needs_nixl
def test_the_serve_setting_is_checked_on_every_nixl_request(memory) -> None:
    """Every NIXL request asks anew: with serving turned off after the agent exists (and a
    reader was served), NixlMdRequest, NixlRead, NixlWrite and NixlLease are all refused."""
    owner = _owner(**SERVE)
    try:
        entry = owner.register(Geometry(1, N, 1), [memory.ctypes.data], placement=0)
        assert isinstance(_metadata(owner), p.NixlMd) and _made(owner)
        _reconfigure(owner, nixl_serve=False)
        raw = Raw(owner.listen_address)  # type: ignore[arg-type]
        key = p.KeyRef(p.KeyKind.CACHE_ID, entry.cache_id, 0, 0)
        one, zero = np.ones(1, np.uint64), np.zeros(1, np.uint64)
        try:
            for msg in (p.NixlMdRequest(),
                        p.NixlRead(key, 0, p.ReadFlags.NONE, np.zeros(1, np.uint32), zero,
                                   one),
                        p.NixlWrite(key, 0, 0, np.zeros(1, np.uint32), zero, one),
                        p.NixlLease(key, 0)):
                _refused(raw.call(msg), "NixlServe")
        finally:
            raw.close()
    finally:
        owner.close()


def test_nixl_options_are_on_or_off() -> None:
    cfg = llm_datadist.LLMConfig()
    cfg.nixl_serve = True
    cfg.nixl_allow_whole_process_access = True
    opts = cfg.generate_options()
    assert opts["datadist.NixlServe"] == "1"
    assert opts["datadist.NixlAllowWholeProcessAccess"] == "1"
    dd = llm_datadist.LLMDataDist(llm_datadist.LLMRole.DECODER, 78)
    bad = llm_datadist.LLMConfig()
    bad.local_comm_res = ""
    options = bad.generate_options()
    options["datadist.NixlServe"] = "yes"
    with pytest.raises(llm_datadist.LLMException) as e:
        dd.init(options)
    assert e.value.status_code == llm_datadist.LLMStatusCode.LLM_PARAM_INVALID
    dd.finalize()


# ------------------------------------------------------------------------------ item 6
# A hostile owner's revokes reach the reader on its reverse channel; a man in the middle
# (``Mitm``) plays that owner, in front of a real one.


@contextlib.contextmanager
def _mitm_link() -> Iterator[Any]:
    """A core reader linked by NIXL to a core owner (cache 1: N bytes of a pattern) through a
    man in the middle; ``pull()`` pulls the cache into ``dst``."""
    owner = _owner(**SERVE)
    reader = _reader()
    try:
        with Mitm(owner.listen_address) as mitm:  # type: ignore[arg-type]
            src = np.arange(N, dtype=np.uint64).astype(np.uint8)
            owner.register(Geometry(1, N, 1), [src.ctypes.data], placement=0)
            dst = np.zeros(N, np.uint8)
            entry = reader.register(Geometry(1, N, 1), [dst.ctypes.data], placement=0)
            link = reader.link(OWNER, *mitm.address, 5.0)
            assert link.path_name == "nixl", link.reason
            plan = plan_slot(entry.geometry, 0, every_tensor(1))

            def pull(timeout: float = 5.0) -> None:
                dst[:] = 0
                reader.pull(OWNER, p.KeyRef(p.KeyKind.CACHE_ID, 1, 0), 0, plan,
                            entry.cache_id, timeout)

            yield types.SimpleNamespace(owner=owner, reader=reader, mitm=mitm, src=src,
                                        dst=dst, pull=pull)
    finally:
        reader.close()
        owner.close()


def _leases(reader: NativeEngine) -> int:
    """The NIXL leases the reader's link to OWNER holds now (the core's reader asks for a
    lease from its second pull of a cache on: the first is granted)."""
    return int(hooks.link_nixl_leases(reader, OWNER))


@needs_nixl
def test_revokes_of_unknown_leases_are_not_kept() -> None:
    """A hostile owner revoking ids we never asked for, the next ones it will grant
    included, while no lease request of ours is in flight: each is answered and none is
    kept, so the lease then granted (id 1) is held and used (before: 20,000 of 20,000 kept,
    and a lease granted later under one of those ids dropped)."""
    with _mitm_link() as t:
        for lease_id in [*range(1, 50), *range(100_000, 102_000)]:
            assert isinstance(t.mitm.inject(p.NixlRevoke(lease_id)), p.Ok)
        for _ in range(2):  # granted, then under a lease
            t.pull()
            assert np.array_equal(t.dst, t.src)
        assert _leases(t.reader) == 1 and hooks.nixl_leases(t.owner) == 1
        t.pull()  # under the same lease: the owner grants no other
        assert np.array_equal(t.dst, t.src) and hooks.nixl_leases(t.owner) == 1


@needs_nixl
def test_a_revoke_in_advance_does_not_drop_a_lease_the_owner_holds() -> None:
    """Id 1 revoked before we asked for any lease, then granted: the lease is ours and
    used (before: dropped, while the owner kept it pinned)."""
    with _mitm_link() as t:
        assert isinstance(t.mitm.inject(p.NixlRevoke(1)), p.Ok)
        for _ in range(2):  # granted, then under a lease
            t.pull()
            assert np.array_equal(t.dst, t.src)
        assert _leases(t.reader) == 1 and hooks.nixl_leases(t.owner) == 1


@needs_nixl
def test_a_revoke_racing_its_lease_still_wins() -> None:
    """The one race early revokes are kept for: the revoke of our lease arrives before its
    NIXL_LEASED (the man in the middle holds the answer back, revokes it, floods revokes of
    other ids, then lets it through). The lease is not used nor kept, and the pull still
    lands."""
    raced: list[int] = []
    with _mitm_link() as t:
        def race(msg: Any) -> Any:
            if isinstance(msg, p.NixlLeased) and not raced:
                raced.append(msg.lease_id)
                assert isinstance(t.mitm.inject(p.NixlRevoke(msg.lease_id)), p.Ok)
                for i in range(10_000, 12_000):
                    assert isinstance(t.mitm.inject(p.NixlRevoke(i)), p.Ok)
            return msg

        t.mitm.rewrite = race
        for _ in range(2):  # granted, then it asks for a lease: raced
            t.pull()
            assert np.array_equal(t.dst, t.src)
        assert raced
        assert _leases(t.reader) == 0  # the revoked lease was not kept


# ------------------------------------------------------------------- the control path, attacked
# Messages 16-20 and 30-32 from a peer that lies (issue 21's "Also").


@needs_nixl
def test_no_metadata_before_the_shared_secret_is_proven() -> None:
    """A peer that skips AUTH and asks for the metadata gets none: the connection ends."""
    owner = _owner(**SERVE, secret=b"hunter2")
    sock = socket.create_connection(owner.listen_address, timeout=10.0)  # type: ignore[arg-type]
    try:
        dec = p.FrameDecoder()
        sock.sendall(p.encode(p.Hello(READER + 41, 2, os.getpid(), 0, b"\7" * 16), 1))
        sock.sendall(p.encode(p.NixlMdRequest(), 2))
        got: list[Any] = []
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            got += [m for _rid, m in dec.feed(chunk)]
        assert got and isinstance(got[0], p.Welcome)
        assert not any(isinstance(m, p.NixlMd) for m in got), got
        assert not _made(owner)
    finally:
        sock.close()
        owner.close()


@needs_nixl
def test_a_lying_lease_cannot_widen_a_read() -> None:
    """A NIXL_LEASED whose geometry is smaller than the pull: the reader checks the pull
    against it as the owner would and refuses it before any NIXL transfer."""
    with _mitm_link() as t:
        t.mitm.rewrite = lambda m: dataclasses.replace(m, tensor_bytes=64, unit_bytes=64,
                                                       units=1) \
            if isinstance(m, p.NixlLeased) else m
        t.pull()  # granted (no lease yet)
        assert np.array_equal(t.dst, t.src)
        with pytest.raises(InvalidArgument):  # under the lying lease
            t.pull()
        assert not t.dst.any()


@needs_nixl
@pytest.mark.parametrize("answer", ["three bases", "ok"])
def test_a_lying_grant_is_refused_and_the_connection_closed(answer: str) -> None:
    """A NIXL_GRANT with another number of bases than tensors asked for (or another message
    altogether) ends the exchange with a protocol error and closes the connection; nothing
    is read; the next pull reconnects. (The man in the middle refuses the reader's lease
    requests, so that it reads by grants.)"""
    def no_lease(m: Any) -> Any:
        if isinstance(m, p.NixlLeased):
            return p.Error(int(NotSupported.code), "no lease (the man in the middle)")
        return m

    def lying(m: Any) -> Any:
        if isinstance(m, p.NixlGrant):
            return (dataclasses.replace(m, bases=np.zeros(3, np.uint64))
                    if answer == "three bases" else p.Ok())
        return no_lease(m)

    with _mitm_link() as t:
        t.mitm.rewrite = lying
        hellos = t.owner.hello_count(READER)
        with pytest.raises(DatadistError):
            t.pull()
        assert not t.dst.any()
        t.mitm.rewrite = no_lease
        t.pull()
        assert np.array_equal(t.dst, t.src)
        assert t.owner.hello_count(READER) > hellos  # the lying channel was closed


@needs_nixl
def test_revokes_under_load_leave_the_reader_pulling() -> None:
    """A hostile owner floods a NIXL reader's reverse channel with revokes of ids it never
    granted, and of the real leases, while the reader pulls: every pull returns the right
    bytes (a revoked lease is given back and asked for anew), and the reader holds at most
    one lease after."""
    import threading

    with _mitm_link() as t:
        stop = threading.Event()
        sent = [0]

        def flood() -> None:
            i = 0
            while not stop.is_set() and i < 3000:
                i += 1
                lease_id = i // 7 if i % 7 == 0 else 1_000_000 + i  # the real leases, too
                t.mitm.inject(p.NixlRevoke(lease_id))
                sent[0] += 1

        th = threading.Thread(target=flood, daemon=True)
        th.start()
        try:
            for _ in range(50):
                t.pull()
                assert np.array_equal(t.dst, t.src)
        finally:
            stop.set()
            th.join(30)
        assert sent[0] > 0
        assert _leases(t.reader) <= 1


@needs_nixl
def test_info_says_whether_this_process_would_serve_nixl_and_over_what() -> None:
    """``datadist info`` reports NIXL serving (off unless asked) and, on this host (UCX_TLS
    unset), that NIXL's memory keys are unchecked and what that means."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items()
           if k not in ("UCX_TLS", "DATADIST_NIXL_SERVE",
                        "DATADIST_NIXL_ALLOW_WHOLE_PROCESS_ACCESS")}
    out = subprocess.run([sys.executable, "-m", "datadist.cli", "info"], capture_output=True,
                         text=True, timeout=60, env=env, check=True).stdout
    assert "nixl serving: off" in out, out
    line = next(x for x in out.splitlines() if x.startswith("nixl transports:"))
    assert "UNCHECKED" in line and "whole process" in line, line
    assert "NixlAllowWholeProcessAccess" in line, line
