"""What a NIXL peer can do to the process it links to (issue 26; docs/security.md, "The NIXL
path"). The attacker is stock NIXL driven by hand (datadist.testing.nixl_peer): it gets an
owner's metadata over the control channel, as a reader does, then posts its own READs and
WRITEs, with the metadata as sent or with a region's length rewritten.

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

Skipped without NIXL (nixl-cu12), except the pure checks (transports, revokes).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import datadist as llm_datadist
from datadist.core import native
from datadist.core.config import EngineConfig
from datadist.core.engine import Engine
from datadist.core.errors import NotSupported
from datadist.core.layout import Geometry, layer_tensor_indices, plan_slot
from datadist.transport import nixl
from datadist.transport.nixl import MAX_EARLY_REVOKES, NixlPath, unchecked_transports
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


OWNERS = ["python", pytest.param("native", marks=pytest.mark.skipif(
    not native.available()[0], reason="the C++ core is not built"))]


@pytest.fixture(params=OWNERS)
def kind(request: pytest.FixtureRequest) -> str:
    """The owner's engine: the Python engine, then the C++ core (core/native.py)."""
    return request.param  # type: ignore[no-any-return]


def _owner(kind: str = "python", **kw: Any) -> Any:
    cfg = EngineConfig(cluster_id=OWNER, role=1, listen=("127.0.0.1", 0), **kw)
    return Engine(cfg) if kind == "python" else native.NativeEngine(cfg)


def _is_native(owner: Any) -> bool:
    return bool(getattr(owner, "native", False))


def _made(owner: Any) -> bool:
    """Has the owner made its NIXL agent (a reader asked, and it serves)?"""
    return (owner.nixl_agent if _is_native(owner) else owner.nixl) is not None


def _reconfigure(owner: Any, **kw: Any) -> None:
    """The owner's NIXL options changed under it, as a running owner asks them anew."""
    if not _is_native(owner):
        owner.config = dataclasses.replace(owner.config, **kw)
        return
    cfg = dataclasses.replace(owner.config, **kw)
    owner.config = cfg
    owner._core.set_nixl_options(cfg.nixl_serve, cfg.nixl_whole_process)
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


def _metadata(owner: Engine) -> p.Message:
    raw = Raw(owner.listen_address)  # type: ignore[arg-type]
    try:
        return raw.call(p.NixlMdRequest())
    finally:
        raw.close()


def _progress(owner: Any) -> Any:
    """The owner's pump beats only while a lease is open: the thief drives it instead (as
    another reader's lease would)."""
    if _is_native(owner):
        return lambda: owner._core.nixl_progress()
    return lambda: owner.nixl.agent.get_new_notifs() if owner.nixl is not None else None


def _steal(owner: Engine, thief: Any, memory: np.ndarray) -> bytes | p.Message:
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
def test_a_default_owner_hands_no_nixl_peer_anything(memory, thief, kind: str) -> None:
    """NIXL merely installed is no consent: a default owner (no option) answers
    NixlMdRequest with NOT_SUPPORTED and makes no agent. Before, it served its metadata
    and a peer that stretched a region read the unregistered secret next to it."""
    owner = _owner(kind)
    try:
        owner.register(Geometry(1, N, 1), [memory.ctypes.data], placement=0)
        _refused(_steal(owner, thief, memory), "datadist.NixlServe")
        assert not _made(owner)
    finally:
        owner.close()


@needs_nixl
def test_unchecked_transports_need_the_whole_process_allowance(
        memory, thief, monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """Told to serve NIXL, an owner whose UCX may use tcp or shared memory (UCX_TLS unset,
    no RDMA device: this host) still refuses, naming the option that would allow it."""
    monkeypatch.delenv("UCX_TLS", raising=False)
    owner = _owner(kind, nixl_serve=True)
    try:
        owner.register(Geometry(1, N, 1), [memory.ctypes.data], placement=0)
        _refused(_steal(owner, thief, memory), "datadist.NixlAllowWholeProcessAccess")
        assert not _made(owner)
    finally:
        owner.close()


@needs_nixl
def test_with_the_allowance_a_nixl_peer_reaches_the_whole_process(
        memory, thief, kind: str) -> None:
    """What the allowance allows, as docs/security.md says: on key-unchecked transports a
    NIXL peer reads and writes outside every registered region."""
    owner = _owner(kind, **SERVE)
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


def test_key_checked_transports_still_need_the_allowance_and_consent(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On RDMA verbs only (UCX_TLS, a device present) the NIC checks keys, but UCX's software
    RMA emulation (ucp/rma/rma_sw.c: ucp_put_handler copies to whatever address the message
    names) answers a modified UCX on every transport with active messages: nixl_serve alone
    is refused, naming that; with the allowance it serves; without nixl_serve or remote cache
    access it still refuses."""
    (tmp_path / "mlx5_0").mkdir()
    monkeypatch.setattr(nixl, "RDMA_DEVICES", str(tmp_path))
    monkeypatch.setenv("UCX_TLS", "rc_mlx5,ud_mlx5")
    assert unchecked_transports() is None
    owner = _owner(nixl_serve=True)
    try:
        refusal = str(owner.nixl_refusal())
        assert "rma_sw.c" in refusal and "NixlAllowWholeProcessAccess" in refusal, refusal
        owner.config = dataclasses.replace(owner.config, nixl_whole_process=True)
        assert owner.nixl_refusal() is None
        owner.config = dataclasses.replace(owner.config, nixl_serve=False)
        assert "NixlServe" in str(owner.nixl_refusal())
        owner.config = dataclasses.replace(owner.config, nixl_serve=True,
                                           remote_cache_accessible=False)
        assert "enable_remote_cache_accessible" in str(owner.nixl_refusal())
    finally:
        owner.close()


@needs_nixl
def test_a_reader_links_by_nixl_over_unchecked_transports_only_when_allowed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader's UCX serves the owner's UCX too: where its transports check no key, a
    reader forced to nixl without the allowance links by TCP and says why."""
    monkeypatch.delenv("UCX_TLS", raising=False)
    owner = _owner(**SERVE)
    reader = Engine(EngineConfig(cluster_id=READER, role=2, transport="nixl"))
    try:
        link = reader.link(OWNER, *owner.listen_address, 5.0)  # type: ignore[misc]
        assert link.path_name == "tcp"
        assert "NixlAllowWholeProcessAccess" in link.reason, link.reason
        assert owner.nixl is None  # it never asked for the owner's metadata
    finally:
        reader.close()
        owner.close()


# ------------------------------------------------------------------------------ item 2


@needs_nixl
def test_an_owner_refusing_writes_hands_out_no_writable_registration(
        memory, thief, kind: str) -> None:
    """NIXL registrations cannot be made read-only, so an owner with remote cache access
    off serves no NIXL at all: a peer that would post its own NIXL WRITE with the metadata
    exactly as sent gets none, and the cache is unchanged. Before, the write landed."""
    owner = _owner(kind, **SERVE, remote_cache_accessible=False)
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
def test_a_readers_reverse_channel_answers_no_nixl_request(reader_serves: bool,
                                                           kind: str) -> None:
    """The owner's end of a NIXL reader's link is the reader's reverse channel: on it the
    reader answers NixlMdRequest, NixlRead, NixlWrite and NixlLease with NOT_SUPPORTED,
    even when it serves NIXL on its own listener (before: its metadata, destination caches
    and pools included). The link stays usable both ways. The reader is each engine."""
    owner = _owner(**SERVE)
    cfg = EngineConfig(cluster_id=READER, role=2, transport="nixl", nixl_serve=reader_serves,
                       nixl_whole_process=True)
    reader = Engine(cfg) if kind == "python" else native.NativeEngine(cfg)
    try:
        dst = np.zeros(N, np.uint8)
        entry = reader.register(Geometry(1, N, 1), [dst.ctypes.data], placement=0)
        src = np.full(N, 3, np.uint8)
        owner.register(Geometry(1, N, 1), [src.ctypes.data], placement=0)
        link = reader.link(OWNER, *owner.listen_address, 5.0)  # type: ignore[misc]
        assert link.path_name == "nixl", link.reason
        rev = owner.get_link(READER)  # the reader's reverse channel
        one, zero = np.ones(1, np.uint64), np.zeros(1, np.uint64)
        key = p.KeyRef(p.KeyKind.CACHE_ID, entry.cache_id, 0, 0)
        for msg in (p.NixlMdRequest(),
                    p.NixlRead(key, 0, p.ReadFlags.NONE, np.zeros(1, np.uint32), zero, one),
                    p.NixlWrite(key, 0, 0, np.zeros(1, np.uint32), zero, one),
                    p.NixlLease(key, 0)):
            deadline = time.monotonic() + 5.0
            with pytest.raises(NotSupported, match="reverse channel"):
                rev.run(deadline, lambda _path, chan, m=msg, d=deadline: chan.call(m, d))
        plan = plan_slot(entry.geometry, 0, layer_tensor_indices(1, None, None, 2))
        reader.pull(OWNER, p.KeyRef(p.KeyKind.CACHE_ID, 1, 0), 0, plan, entry.cache_id, 5.0)
        assert (dst == 3).all()
    finally:
        reader.close()
        owner.close()


@needs_nixl
def test_a_client_connection_takes_no_nixl_revoke(kind: str) -> None:
    """NixlRevoke is the owner's to send, on a reverse channel; from a client it is
    refused (it would make the owner's engine revoke its own reads from that cluster)."""
    owner = _owner(kind, **SERVE)
    raw = Raw(owner.listen_address)  # type: ignore[arg-type]
    try:
        _refused(raw.call(p.NixlRevoke(1)), "client")
        assert isinstance(raw.call(p.Ping(3)), p.Pong)
    finally:
        raw.close()
        owner.close()


# ------------------------------------------------------------------------------ item 4


@needs_nixl
def test_private_caches_are_never_registered_with_nixl(memory, thief, kind: str) -> None:
    """A cache registered with remote_accessible=False is not in the NIXL registrations:
    an unmodified NIXL READ of it is refused by the peer's own NIXL, while one of a public
    cache works (the thief works). Before, the private cache's bytes came back."""
    owner = _owner(kind, **SERVE)
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
        assert "NIXL_ERR" in str(e.value) or "not" in str(e.value).lower(), e.value
        assert not isinstance(e.value, (AssertionError, TimeoutError))
        if not _is_native(owner):
            assert owner.nixl.kind_of(memory.ctypes.data, N) is None
    finally:
        owner.close()


@needs_nixl
def test_a_reader_pulls_into_a_private_destination_and_hands_it_to_no_one(kind: str) -> None:
    """A reader that serves no NIXL registers its private destination (NIXL reads into
    registered memory only) and pulls into it; its agent then refuses to produce metadata
    at all, even if serving were turned on later. The reader is each engine in turn."""
    owner = _owner(**SERVE)
    cfg = EngineConfig(cluster_id=READER, role=2, transport="nixl", listen=("127.0.0.1", 0),
                       nixl_whole_process=True)
    reader = Engine(cfg) if kind == "python" else native.NativeEngine(cfg)
    try:
        src = np.full(N, 4, np.uint8)
        owner.register(Geometry(1, N, 1), [src.ctypes.data], placement=0)
        dst = np.zeros(N, np.uint8)
        entry = reader.register(Geometry(1, N, 1), [dst.ctypes.data], placement=0,
                                remote_accessible=False)
        link = reader.link(OWNER, *owner.listen_address, 5.0)  # type: ignore[misc]
        assert link.path_name == "nixl", link.reason
        plan = plan_slot(entry.geometry, 0, layer_tensor_indices(1, None, None, 2))
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
        assert _made(engine)  # the reader's agent, made at init (either engine)
        _refused(_metadata(engine), "NixlServe")
    finally:
        dd.finalize()


@needs_nixl
def test_the_serve_setting_is_checked_on_every_nixl_request(memory, kind: str) -> None:
    """Every NIXL request asks anew: with serving turned off after the agent exists (and a
    reader was served), NixlMdRequest, NixlRead, NixlWrite and NixlLease are all refused."""
    owner = _owner(kind, **SERVE)
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


class _Agent:
    no_leases: set[str] = set()


class _Chan:
    """A control channel whose NixlLease answer is ``answer``; ``during`` runs while the
    request is in flight (revokes arriving before the answer)."""

    def __init__(self, answer: p.Message, during: Any = None) -> None:
        self.answer, self.during = answer, during

    def call(self, msg: p.Message, deadline: float) -> p.Message:
        assert isinstance(msg, p.NixlLease)
        if self.during is not None:
            self.during()
        return self.answer

    def close(self) -> None:
        pass


def _path() -> NixlPath:
    path = NixlPath(_Agent())  # type: ignore[arg-type]
    path.remote, path.generation, path._wired = "owner", 5, True
    return path


def _leased(lease_id: int) -> p.NixlLeased:
    return p.NixlLeased(lease_id, b"owner", 5, p.MEM_DRAM, 0, False, N, N, 1, 0,
                        np.array([0x10000], np.uint64))


READ = p.Read(p.KeyRef(p.KeyKind.CACHE_ID, 1, 0), 0, p.ReadFlags.NONE,
              np.zeros(1, np.uint32), np.zeros(1, np.uint64), np.full(1, 16, np.uint64))


def test_revokes_of_unknown_leases_are_not_kept() -> None:
    """A hostile owner revoking ids we never asked for grows nothing (before: 20,000 of
    20,000 kept)."""
    path = _path()
    assert all(path.revoke(i, 0.0) for i in range(20_000))
    assert len(path._revoked_early) == 0


def test_a_revoke_in_advance_does_not_drop_a_lease_the_owner_holds() -> None:
    """Id 7 revoked before we asked for any lease, then granted: the lease is ours and
    used (before: dropped, while the owner kept it pinned)."""
    path = _path()
    path.revoke(7, 0.0)
    lease = path._lease(_Chan(_leased(7)), READ, 1e12)
    assert lease is not None and path._lease_ids.get(7) is lease


def test_a_revoke_racing_its_lease_still_wins_and_is_bounded() -> None:
    """The one race the memory is for: the revoke of our lease arrives before its
    NixlLeased. It still ends the lease; a flood meanwhile keeps at most
    MAX_EARLY_REVOKES ids, and none once the answer came."""
    path = _path()

    def flood() -> None:
        path.revoke(7, 0.0)
        for i in range(10_000, 30_000):
            path.revoke(i, 0.0)
        assert len(path._revoked_early) <= MAX_EARLY_REVOKES

    assert path._lease(_Chan(_leased(7), flood), READ, 1e12) is None
    assert 7 not in path._lease_ids and len(path._revoked_early) == 0


# ------------------------------------------------------------------- the control path, attacked
# Messages 16-20 and 30-32 from a peer that lies (issue 21's "Also").


@needs_nixl
def test_no_metadata_before_the_shared_secret_is_proven(kind: str) -> None:
    """A peer that skips AUTH and asks for the metadata gets none: the connection ends."""
    owner = _owner(kind, **SERVE, secret=b"hunter2")
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


def test_a_lying_lease_cannot_widen_a_read() -> None:
    """A NixlLeased whose geometry is smaller than the pull: the reader checks the pull
    against it as the owner would and refuses it before any NIXL transfer."""
    from datadist.core.errors import InvalidArgument

    path = _path()
    small = p.NixlLeased(7, b"owner", 5, p.MEM_DRAM, 0, False, 64, 64, 1, 0,
                         np.array([0x10000], np.uint64))
    lease = path._lease(_Chan(small), READ, 1e12)
    assert lease is not None
    wide = p.Read(p.KeyRef(p.KeyKind.CACHE_ID, 1, 0), 0, p.ReadFlags.NONE,
                  np.zeros(1, np.uint32), np.full(1, 4096, np.uint64), np.full(1, 16, np.uint64))
    with pytest.raises(InvalidArgument):
        path._read_leased(_Chan(small), lease, wide, np.zeros((1, 2), np.uint64), 1e12)


def test_a_lying_grant_is_refused_and_the_connection_closed() -> None:
    """A NixlGrant with another number of bases than tensors asked for (or another message
    altogether) ends the exchange with a protocol error; nothing is read."""
    from datadist.core.errors import RemoteProtocolError

    class Chan(_Chan):
        closed = False

        def call(self, msg: p.Message, deadline: float) -> p.Message:
            return self.answer

        def close(self) -> None:
            self.closed = True

    for answer in (p.NixlGrant(1, b"owner", 5, p.MEM_DRAM, 0, np.zeros(3, np.uint64)),
                   p.Ok()):
        chan = Chan(answer)
        with pytest.raises(RemoteProtocolError):
            _path()._read_granted(chan, READ, np.zeros((1, 2), np.uint64), 1e12)
        assert chan.closed


@needs_nixl
def test_revokes_under_load_leave_the_reader_bounded_and_pulling() -> None:
    """A hostile owner floods a NIXL reader's reverse channel with revokes of ids it never
    granted, and of the real lease, while the reader pulls: every pull returns the right
    bytes (a revoked lease is given back and asked for anew), and the reader keeps no
    memory of the flood."""
    import threading

    owner = _owner(**SERVE)
    reader = Engine(EngineConfig(cluster_id=READER, role=2, transport="nixl",
                                 nixl_whole_process=True))
    stop = threading.Event()
    try:
        src = np.arange(N, dtype=np.uint64).astype(np.uint8)
        owner.register(Geometry(1, N, 1), [src.ctypes.data], placement=0)
        dst = np.zeros(N, np.uint8)
        entry = reader.register(Geometry(1, N, 1), [dst.ctypes.data], placement=0)
        link = reader.link(OWNER, *owner.listen_address, 5.0)  # type: ignore[misc]
        assert link.path_name == "nixl", link.reason
        rev = owner.get_link(READER)
        sent = [0]

        def flood() -> None:
            i = 0
            while not stop.is_set() and i < 3000:
                i += 1
                deadline = time.monotonic() + 5.0
                lease_id = 1 if i % 7 == 0 else 1_000_000 + i  # the real first lease, too
                msg = p.NixlRevoke(lease_id)
                rev.run(deadline, lambda _p, chan, m=msg, d=deadline: chan.call(m, d))
                sent[0] += 1

        t = threading.Thread(target=flood, daemon=True)
        t.start()
        plan = plan_slot(entry.geometry, 0, layer_tensor_indices(1, None, None, 2))
        for _ in range(50):
            dst[:] = 0
            reader.pull(OWNER, p.KeyRef(p.KeyKind.CACHE_ID, 1, 0), 0, plan, entry.cache_id,
                        5.0)
            assert np.array_equal(dst, src)
        stop.set()
        t.join(30)
        assert sent[0] > 0
        assert len(link.path._revoked_early) <= MAX_EARLY_REVOKES
    finally:
        stop.set()
        reader.close()
        owner.close()


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
