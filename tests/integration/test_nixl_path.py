"""The NIXL data path (transport/nixl.py) between two engines in this process, and how it is
chosen. The owner of the path tests (``pair``) is each engine in turn: the Python engine and
the C++ core (core/native.py, cpp/src/nixl.h); their reader is the Python engine; the
``core_reader`` tests read with the core from either owner. The two-process suites run over
it too (TRANSPORTS in _support.py); these tests look at what only NIXL has: selection and its
errors, the owner's lazily created agent, metadata reloads when the owner's registrations
change, handle reuse, the pump that runs only during transfers, the fallback to TCP for an
owner without NIXL. The selection tests run everywhere; the rest skip without the nixl-cu12
wheel.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

import datadist as llm_datadist
from datadist.core import native
from datadist.core.config import EngineConfig
from datadist.core.engine import Engine
from datadist.core.errors import (
    BrokenLink,
    CacheNotFound,
    InvalidArgument,
    LinkFailed,
    NotLinked,
    Timeout,
)
from datadist.core.layout import (
    Geometry,
    Plan,
    layer_tensor_indices,
    plan_blocks,
    plan_slot,
)
from datadist.transport import nixl
from datadist.wire import protocol as p

pytestmark = pytest.mark.timeout(60)
needs_nixl = pytest.mark.skipif(nixl.available() is None, reason="nixl-cu12 not installed")
S = llm_datadist.LLMStatusCode
KEY = p.KeyRef(p.KeyKind.CACHE_ID, 1, 0)
# Serving NIXL is opt-in, and on this CPU machine UCX uses tcp and shared memory, whose memory
# keys nothing checks: the engines here allow it explicitly (tests/security/test_nixl_trust.py
# shows what that allows).
NIXL_OK = {"nixl_serve": True, "nixl_whole_process": True}


# ------------------------------------------------------------------------------ selection


def test_config_accepts_nixl_and_still_refuses_unknown_paths() -> None:
    cfg = llm_datadist.LLMConfig()
    cfg.transport = "nixl"
    assert cfg.generate_options()["datadist.Transport"] == "nixl"
    with pytest.raises(llm_datadist.LLMException) as e:
        cfg.transport = "rdma"
    assert e.value.status_code == S.LLM_PARAM_INVALID


@pytest.mark.parametrize("how", ["option", "env"])
def test_nixl_without_nixl_installed_is_param_invalid_at_init(
        monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """Choosing the NIXL path where NIXL cannot be imported fails init, with what to install
    (the option may be set where the config is written, on another machine)."""
    monkeypatch.setattr(nixl, "MODULES", ("datadist_no_such_nixl_module",))
    if how == "env":
        monkeypatch.setenv("DATADIST_TRANSPORT", "nixl")
    dd = llm_datadist.LLMDataDist(llm_datadist.LLMRole.DECODER, 5)
    cfg = llm_datadist.LLMConfig()
    cfg.local_comm_res = ""
    options = cfg.generate_options()
    if how == "option":
        options["datadist.Transport"] = "nixl"
    with pytest.raises(llm_datadist.LLMException) as e:
        dd.init(options)
    assert e.value.status_code == S.LLM_PARAM_INVALID
    assert "datadist[nixl]" in str(e.value)
    dd.finalize()


def test_engine_without_nixl_refuses_nixl_transport(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nixl, "MODULES", ("datadist_no_such_nixl_module",))
    with pytest.raises(InvalidArgument, match="nixl"):
        Engine(EngineConfig(cluster_id=2, role=2, **NIXL_OK, transport="nixl"))


# ------------------------------------------------------------------------------ the path


OWNERS = ["python", pytest.param("native", marks=pytest.mark.skipif(
    not native.available()[0], reason="the C++ core is not built"))]


def _owner(kind: str, **config) -> Any:
    """An owner of ``kind`` ("python": core/engine.py; "native": the C++ core) listening on
    localhost, serving NIXL unless ``config`` says otherwise."""
    cfg = EngineConfig(cluster_id=1, role=1, listen=("127.0.0.1", 0), **{**NIXL_OK, **config})
    return Engine(cfg) if kind == "python" else native.NativeEngine(cfg)


@pytest.fixture(params=OWNERS)
def pair(request: pytest.FixtureRequest):
    owner = _owner(request.param)
    puller = Engine(EngineConfig(cluster_id=2, role=2, **NIXL_OK, transport="nixl"))
    yield owner, puller
    puller.close()
    owner.close()


def _is_native(owner: Any) -> bool:
    return bool(getattr(owner, "native", False))


def _agent(owner: Any) -> tuple[str, int, int, int] | None:
    """(name, generation, leases keeping its pump beating, of them on connections without a
    completed read) of an owner's NIXL agent, either engine; None before a reader asked."""
    if _is_native(owner):
        return owner.nixl_agent  # type: ignore[no-any-return]
    a = owner.nixl
    return None if a is None else (a.name, a.generation, a._pump_users, a._pump_fresh)


def _held(owner: Any) -> int:
    """NIXL leases on whole caches readers hold on the owner now."""
    return int(owner.nixl_leases) if _is_native(owner) else len(owner._nixl_held)


def _granted(owner: Any) -> int:
    """NIXL grants (between NIXL_GRANT and RELEASE) open on the owner now."""
    if not _is_native(owner):
        return len(owner._nixl_leases)
    agent = _agent(owner)
    return 0 if agent is None else agent[2] - _held(owner)


def _wait(cond, seconds: float = 5.0) -> bool:
    end = time.monotonic() + seconds
    while not cond() and time.monotonic() < end:
        time.sleep(0.005)
    return bool(cond())


def _link(owner: Engine, puller: Engine):
    host, port = owner.listen_address
    return puller.link(1, host, port, 5.0)


def _caches(owner: Engine, puller: Engine, n: int, fill: int = 7):
    src = np.full(n, fill, np.uint8)
    src[::97] = np.arange(len(src[::97]), dtype=np.uint64).astype(np.uint8)
    owner.register(Geometry(1, n, 1), [src.ctypes.data], placement=0)
    dst = np.zeros(n, np.uint8)
    entry = puller.register(Geometry(1, n, 1), [dst.ctypes.data], placement=0)
    plan = plan_slot(entry.geometry, 0, layer_tensor_indices(1, None, None, 2))
    return src, dst, entry, plan


@needs_nixl
def test_an_owner_serving_nixl_runs_on_the_core(monkeypatch: pytest.MonkeyPatch) -> None:
    """Serving NIXL (datadist.NixlServe) no longer keeps an engine on Python: auto picks the
    core, whose listener serves NIXL readers (the path tests below, owner "native")."""
    if not native.available()[0]:
        pytest.skip("the C++ core is not built here")
    monkeypatch.delenv("DATADIST_ENGINE", raising=False)
    config = EngineConfig(cluster_id=1, role=1, **NIXL_OK)
    assert native.refusal(config) is None
    eng, why = native.engine_for(config, {})
    try:
        assert eng.native, why
        assert eng.nixl_refusal() is None and eng.nixl_agent is None
    finally:
        eng.close()


def test_nixl_stays_on_the_python_engine_where_there_is_a_gpu(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The core's NIXL registers host memory only: on a host with a GPU, where a cache may
    be CUDA memory, NIXL configurations stay on the Python engine (which registers it as
    VRAM); other configurations and GPU-less hosts are the core's."""
    served = EngineConfig(cluster_id=1, role=1, **NIXL_OK)
    forced = EngineConfig(cluster_id=1, role=2, transport="nixl")
    plain = EngineConfig(cluster_id=1, role=2)
    monkeypatch.setattr(nixl, "cuda_devices", lambda: 1)
    for config in (served, forced):
        why = native.refusal(config)
        assert why is not None and "GPU" in why, why
    assert native.refusal(plain) is None
    monkeypatch.setattr(nixl, "cuda_devices", lambda: 0)
    assert native.refusal(served) is None and native.refusal(forced) is None


@needs_nixl
def test_auto_never_picks_nixl() -> None:
    owner = Engine(EngineConfig(cluster_id=1, role=1, **NIXL_OK, listen=("127.0.0.1", 0)))
    puller = Engine(EngineConfig(cluster_id=2, role=2, **NIXL_OK))
    try:
        assert _link(owner, puller).path_name in ("cma", "shm")
        assert puller.nixl is None and owner.nixl is None
    finally:
        puller.close()
        owner.close()


class _Calls:
    """Counts the requests a link's control channel sends."""

    def __init__(self, chan) -> None:
        self.n, self._call = 0, chan.call
        chan.call = self

    def __call__(self, msg, deadline):
        self.n += 1
        return self._call(msg, deadline)


def _pump_idle(owner: Any) -> bool:
    return _wait(lambda: (_agent(owner) or ("", 0, 0, 0))[2] == 0)


@needs_nixl
def test_pull_over_nixl_reads_under_a_lease_and_reuses_its_handle(pair) -> None:
    """The connection's first pull goes by request (it wires the endpoint up, the owner's
    pump beating fast); the second asks for a lease on the whole cache; from then on a pull
    sends nothing on the control channel and reposts its handle. The owner's pump beats
    slowly while the lease is held, and stops once it is revoked (unregister)."""
    owner, puller = pair
    assert _agent(owner) is None  # created when a reader first asks for it
    src, dst, entry, plan = _caches(owner, puller, 1 << 20)
    link = _link(owner, puller)
    assert link.path_name == "nixl" and "forced nixl" in link.reason
    agent = _agent(owner)
    assert agent is not None and agent[0].encode() in repr(link.path).encode()
    calls = _Calls(link.chan)
    puller.pull(1, KEY, 0, plan, entry.cache_id, 5.0)
    assert np.array_equal(dst, src) and calls.n == 1  # NixlRead
    # the owner counts the connection wired when it handles the read's one-way Release,
    # which may come after the pull returned
    assert _wait(lambda: _granted(owner) == 0)
    if not _is_native(owner):
        assert _wait(lambda: bool(owner._nixl_wired)) and len(owner._nixl_wired) == 1
    assert not link.path._leases
    dst[:] = 0
    puller.pull(1, KEY, 0, plan, entry.cache_id, 5.0)
    assert np.array_equal(dst, src) and calls.n == 2  # NixlLease
    assert len(link.path._leases) == 1 and _held(owner) == 1
    handle = next(iter(link.path._handles.values()))
    for _ in range(3):
        dst[:] = 0
        puller.pull(1, KEY, 0, plan, entry.cache_id, 5.0)
        assert np.array_equal(dst, src)
    assert calls.n == 2, "a pull under the lease sent a request"
    assert next(iter(link.path._handles.values())) is handle, "the handle was not reused"
    agent = _agent(owner)
    assert agent is not None and agent[2] and agent[3] == 0  # the slow beat
    assert _granted(owner) == 0  # no per-pull lease left open
    owner.unregister(1)
    assert _held(owner) == 0 and not link.path._leases
    assert _pump_idle(owner), "the pump still beats without any lease"


@needs_nixl
def test_a_lease_read_is_checked_as_the_owner_checks_a_request(pair) -> None:
    """Under a lease the reader checks bounds against the lease's geometry before any
    descriptor is built: the same errors as the owner's, and the link stays usable."""
    owner, puller = pair
    src, dst, entry, plan = _caches(owner, puller, 4096)
    link = _link(owner, puller)
    for _ in range(2):
        puller.pull(1, KEY, 0, plan, entry.cache_id, 5.0)
    assert link.path._leases
    too_far = Plan(plan.remote_tensors, plan.local_tensors, plan.remote_offsets + np.uint64(1),
                   plan.local_offsets, plan.lengths)
    with pytest.raises(InvalidArgument, match="outside"):
        puller.pull(1, KEY, 0, too_far, entry.cache_id, 5.0)
    with pytest.raises(InvalidArgument, match="batch index"):
        puller.pull(1, p.KeyRef(p.KeyKind.CACHE_ID, 1, 1), 0, plan, entry.cache_id, 5.0)
    dst[:] = 0
    puller.pull(1, KEY, 0, plan, entry.cache_id, 5.0)
    assert np.array_equal(dst, src) and link.path._leases


@needs_nixl
def test_revoke_waits_for_a_read_in_flight(pair) -> None:
    """unregister on the owner revokes the lease; the reader answers only once its read
    under it is done, so the owner never takes memory back under a read."""
    owner, puller = pair
    src, dst, entry, plan = _caches(owner, puller, 4096)
    link = _link(owner, puller)
    for _ in range(2):
        puller.pull(1, KEY, 0, plan, entry.cache_id, 5.0)
    (lease,) = link.path._leases.values()
    with link.path._cv:
        lease.reading += 1  # a read under it in flight
    done = threading.Event()
    t = threading.Thread(target=lambda: (owner.unregister(1), done.set()), daemon=True)
    t.start()
    assert not done.wait(0.5), "unregister returned under a read in flight"
    assert lease.revoked  # no new read starts under it
    with link.path._cv:
        lease.reading -= 1
        link.path._cv.notify_all()
    assert done.wait(5), "unregister did not return once the read was done"
    with pytest.raises(CacheNotFound):
        puller.pull(1, KEY, 0, plan, entry.cache_id, 5.0)


@needs_nixl
def test_a_reader_that_does_not_give_the_lease_back_loses_its_connection(
        pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader that does not answer the revoke in time (stopped, stuck) has its control
    connection shut down; its next pull reconnects and reads by request."""
    from datadist.core import engine as engine_mod

    owner, puller = pair
    monkeypatch.setattr(engine_mod, "NIXL_REVOKE_WAIT", 0.5)
    if _is_native(owner):
        owner._core.set_nixl_revoke_wait(0.5)
    src, dst, entry, plan = _caches(owner, puller, 4096)
    src2 = np.full(4096, 3, np.uint8)
    owner.register(Geometry(1, 4096, 1), [src2.ctypes.data], placement=0)  # cache 2
    link = _link(owner, puller)
    for _ in range(2):
        puller.pull(1, KEY, 0, plan, entry.cache_id, 5.0)
    (lease,) = link.path._leases.values()
    with link.path._cv:
        lease.reading += 1  # stuck
    t0 = time.monotonic()
    owner.unregister(1)
    assert time.monotonic() - t0 < 3 and _held(owner) == 0
    with link.path._cv:
        lease.reading -= 1
    end = time.monotonic() + 5
    while not link.chan.peer_gone() and time.monotonic() < end:
        time.sleep(0.01)
    assert link.chan.peer_gone(), "the owner kept the connection of a reader it gave up on"
    puller.pull(1, p.KeyRef(p.KeyKind.CACHE_ID, 2, 0), 0, plan, entry.cache_id, 5.0)
    assert np.array_equal(dst, src2)


@needs_nixl
def test_a_blocks_model_id_registered_again_revokes_the_lease(pair) -> None:
    """A blocks model id registered again names another cache: the lease on the old one is
    revoked, and the next pull by the same BlocksCacheKey reads the new cache."""
    owner, puller = pair
    geo = Geometry(1, 8 * 4096, 8, is_blocks=True)
    old = np.full(8 * 4096, 1, np.uint8)
    owner.register(geo, [old.ctypes.data], placement=0, blocks_model_id=7)
    dst = np.zeros(8 * 4096, np.uint8)
    entry = puller.register(geo, [dst.ctypes.data], placement=0)
    plan = plan_blocks(entry.geometry, [1, 2], [3, 4], layer_tensor_indices(1, None, None, 1))
    key = p.KeyRef(p.KeyKind.BLOCKS_KEY, 0, 7, 0)
    link = _link(owner, puller)
    for _ in range(2):
        puller.pull(1, key, 4096, plan, entry.cache_id, 5.0)
    assert link.path._leases and _held(owner)
    new = np.full(8 * 4096, 2, np.uint8)
    owner.register(geo, [new.ctypes.data], placement=0, blocks_model_id=7)
    # the Python owner revokes before register returns, the core on its revoking thread
    assert _wait(lambda: _held(owner) == 0 and not link.path._leases)
    puller.pull(1, key, 4096, plan, entry.cache_id, 5.0)
    assert (dst[3 * 4096:5 * 4096] == 2).all() and (dst[:3 * 4096] == 0).all()
    dst[:] = 0
    puller.pull(1, key, 4096, plan, entry.cache_id, 5.0)  # under a lease on the new one
    assert _held(owner) == 1 and (dst[3 * 4096:5 * 4096] == 2).all()
    if not _is_native(owner):
        (held,) = owner._nixl_held.values()
        assert held.lease.entry.addrs[0] == new.ctypes.data


@needs_nixl
def test_metadata_is_reloaded_when_the_owner_registers_after_the_link(pair) -> None:
    owner, puller = pair
    _caches(owner, puller, 4096)
    link = _link(owner, puller)
    gen = link.path.generation
    # A second cache (id 2) registered after the reader loaded the owner's metadata.
    src2 = np.arange(8192, dtype=np.uint8)
    owner.register(Geometry(1, 8192, 1), [src2.ctypes.data], placement=0)
    dst2 = np.zeros(8192, np.uint8)
    e2 = puller.register(Geometry(1, 8192, 1), [dst2.ctypes.data], placement=0)
    plan = plan_slot(e2.geometry, 0, layer_tensor_indices(1, None, None, 2))
    puller.pull(1, p.KeyRef(p.KeyKind.CACHE_ID, 2, 0), 0, plan, e2.cache_id, 5.0)
    assert np.array_equal(dst2, src2)
    assert link.path.generation > gen


@needs_nixl
def test_unregister_deregisters_from_nixl_and_the_key_is_gone(pair) -> None:
    owner, puller = pair
    src, dst, entry, plan = _caches(owner, puller, 4096)
    _link(owner, puller)
    puller.pull(1, KEY, 0, plan, entry.cache_id, 5.0)
    gen = _agent(owner)[1]  # type: ignore[index]
    if not _is_native(owner):
        assert owner.nixl.kind_of(src.ctypes.data, 4096) == (p.MEM_DRAM, 0)
    owner.unregister(1)
    if not _is_native(owner):
        assert owner.nixl.kind_of(src.ctypes.data, 4096) is None
    assert _agent(owner)[1] > gen  # type: ignore[index]
    with pytest.raises(CacheNotFound):
        puller.pull(1, KEY, 0, plan, entry.cache_id, 5.0)


@needs_nixl
def test_push_over_nixl_is_one_write_into_checked_spans(pair) -> None:
    """A push on the NIXL path: the owner checks and leases the destination (NixlWrite),
    the bytes land by NIXL WRITE, the key survives (pushes never consume), a bad key is
    refused before anything moves and the link stays usable."""
    owner, puller = pair
    n = 1 << 16
    dst = np.zeros(n, np.uint8)
    owner.register(Geometry(1, n, 1), [dst.ctypes.data], placement=0)
    src = np.random.default_rng(3).integers(0, 255, n, dtype=np.uint8)
    entry = puller.register(Geometry(1, n, 1), [src.ctypes.data], placement=0)
    plan = plan_slot(entry.geometry, 0, layer_tensor_indices(1, None, None, 2))
    link = _link(owner, puller)
    puller.push(1, KEY, 0, plan, entry.cache_id, 5.0)
    assert np.array_equal(dst, src)
    assert any(k[0] == "WRITE" for k in link.path._handles), "the push did not go by NIXL"
    with pytest.raises(CacheNotFound):
        puller.push(1, p.KeyRef(p.KeyKind.CACHE_ID, 99, 0), 0, plan, entry.cache_id, 5.0)
    src[:] = 9
    puller.push(1, KEY, 0, plan, entry.cache_id, 5.0)
    assert (dst == 9).all()
    # RELEASE is one-way: the owner handles it after push returns
    assert _wait(lambda: _granted(owner) == 0)


@needs_nixl
def test_push_by_raw_addresses_over_nixl(pair) -> None:
    """transfer_cache_async's raw-address pushes (key kind 4): the grant's base is 0, the
    offsets being absolute; the bytes land exactly at the addresses, nowhere else."""
    owner, puller = pair
    n = 8192
    dst = np.zeros(n, np.uint8)
    owner.register(Geometry(1, n, 1), [dst.ctypes.data], placement=0)
    src = np.arange(256, dtype=np.uint8)
    entry = puller.register(Geometry(1, 256, 1), [src.ctypes.data], placement=0)
    _link(owner, puller)
    u32, u64 = np.uint32, np.uint64
    plan = Plan(np.array([0], u32), np.array([0], u32), np.array([dst.ctypes.data + 4096], u64),
                np.array([0], u64), np.array([256], u64))
    puller.push(1, p.KeyRef(p.KeyKind.ADDRESS), 0, plan, entry.cache_id, 5.0)
    assert np.array_equal(dst[4096:4352], src)
    assert not dst[:4096].any() and not dst[4352:].any()


@needs_nixl
def test_deadline_covers_the_nixl_transfer_and_the_link_stays_usable(pair) -> None:
    """NIXL has no deadline of its own: a pull whose deadline passes mid-READ ends with
    Timeout (LLM_TIMEOUT), the owner drops its lease, and the next pull on the same link
    moves every byte."""
    owner, puller = pair
    src, dst, entry, plan = _caches(owner, puller, 256 << 20, fill=5)
    _link(owner, puller)
    puller.pull(1, KEY, 0, plan, entry.cache_id, 30.0)  # wire up, warm
    dst[:] = 0
    with pytest.raises(Timeout):
        puller.pull(1, KEY, 0, plan, entry.cache_id, 0.005)
    assert _wait(lambda: _granted(owner) == 0, 10), "the owner kept the timed-out reader's lease"
    dst[:] = 0
    puller.pull(1, KEY, 0, plan, entry.cache_id, 30.0)
    assert np.array_equal(dst, src)


@needs_nixl
def test_a_stuck_nixl_transfer_ends_at_the_deadline(pair, monkeypatch: pytest.MonkeyPatch
                                                     ) -> None:
    """NIXL reports the READ in progress for ever (a fabric that went silent): the pull ends
    with Timeout at its deadline, the handle is released, the lease dropped, and once NIXL
    behaves the same link pulls again."""
    owner, puller = pair
    src, dst, entry, plan = _caches(owner, puller, 1 << 20)
    link = _link(owner, puller)
    agent = puller.nixl.agent
    released: list[object] = []
    real_release = puller.nixl.release
    monkeypatch.setattr(agent, "transfer", lambda h, notif_msg=b"": "PROC")
    monkeypatch.setattr(agent, "check_xfer_state", lambda h: "PROC")
    monkeypatch.setattr(puller.nixl, "release", lambda h: (released.append(h), real_release(h)))
    t0 = time.monotonic()
    with pytest.raises(Timeout):
        puller.pull(1, KEY, 0, plan, entry.cache_id, 0.3)
    assert 0.3 <= time.monotonic() - t0 < 3.0
    assert released, "the stuck handle was not released"
    monkeypatch.undo()
    assert _wait(lambda: _granted(owner) == 0)
    puller.pull(1, KEY, 0, plan, entry.cache_id, 5.0)
    assert np.array_equal(dst, src) and link.path_name == "nixl"


@needs_nixl
def test_checksum_over_nixl(pair) -> None:
    owner, _ = pair
    puller = Engine(EngineConfig(cluster_id=3, role=2, **NIXL_OK, transport="nixl", verify=True))
    try:
        src, dst, entry, plan = _caches(owner, puller, 65536)
        _link(owner, puller)
        puller.pull(1, KEY, 0, plan, entry.cache_id, 5.0)
        assert np.array_equal(dst, src)
    finally:
        puller.close()


@needs_nixl
def test_owner_without_nixl_gets_tcp(pair, monkeypatch: pytest.MonkeyPatch) -> None:
    owner, puller = pair
    if _is_native(owner):
        pytest.skip("the core loads NIXL once per process: tests/cpp covers an owner without it")

    def no_nixl():
        raise InvalidArgument("transport 'nixl' needs NIXL: pip install 'datadist[nixl]'")

    monkeypatch.setattr(owner, "ensure_nixl", no_nixl)
    src, dst, entry, plan = _caches(owner, puller, 4096)
    link = _link(owner, puller)
    assert link.path_name == "tcp" and "no NIXL agent" in link.reason
    puller.pull(1, KEY, 0, plan, entry.cache_id, 5.0)
    assert np.array_equal(dst, src)


@needs_nixl
def test_metadata_our_nixl_refuses_gets_tcp(pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """The owner's metadata cannot be loaded here (another NIXL version): tcp, and why."""
    owner, puller = pair

    def refuse(md):
        raise LinkFailed("NIXL refused the peer's metadata: version mismatch")

    monkeypatch.setattr(puller.nixl, "add_remote", refuse)
    src, dst, entry, plan = _caches(owner, puller, 4096)
    link = _link(owner, puller)
    assert link.path_name == "tcp" and "version mismatch" in link.reason
    puller.pull(1, KEY, 0, plan, entry.cache_id, 5.0)
    assert np.array_equal(dst, src)


@needs_nixl
@pytest.mark.parametrize("why", ["default", "no remote access", "unchecked transports"])
def test_an_owner_that_does_not_serve_nixl_gets_tcp_readers(pair, why: str) -> None:
    """Serving NIXL is opt-in (nixl_serve), needs remote cache access (NIXL registrations are
    writable) and, on this host's key-unchecked UCX transports, nixl_whole_process: without
    any of them the owner makes no agent and hands out no metadata; a reader that forces nixl
    gets tcp, with the owner's reason, and pulls."""
    served, puller = pair
    off = {"default": {"nixl_serve": False}, "no remote access":
           {"remote_cache_accessible": False}, "unchecked transports":
           {"nixl_whole_process": False}}[why]
    owner = _owner("native" if _is_native(served) else "python", **off)
    try:
        src, dst, entry, plan = _caches(owner, puller, 4096)
        link = _link(owner, puller)
        assert link.path_name == "tcp", link.reason
        assert {"default": "datadist.NixlServe", "no remote access": "remote writes",
                "unchecked transports": "NixlAllowWholeProcessAccess"}[why] in link.reason
        assert _agent(owner) is None
        puller.pull(1, KEY, 0, plan, entry.cache_id, 5.0)
        assert np.array_equal(dst, src)
    finally:
        owner.close()


def _force_unlink_breaks_a_transfer_in_flight(owner: Any, puller: Any, rounds: int,
                                               errors_ok: tuple[type, ...]) -> None:
    """A forced unlink during NIXL pulls fails the pull in flight with one of ``errors_ok``,
    the pulling thread ends, and a fresh link pulls the bytes."""
    src, dst, entry, plan = _caches(owner, puller, 64 << 20, fill=1)
    _link(owner, puller)
    errors: list[BaseException] = []
    started = threading.Event()

    def pull() -> None:
        started.set()
        try:
            for _ in range(rounds):
                puller.pull(1, KEY, 0, plan, entry.cache_id, 5.0)
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            errors.append(e)

    t = threading.Thread(target=pull)
    t.start()
    started.wait()
    time.sleep(0.05)
    puller.unlink(1, timeout=1.0, force=True)
    t.join(20)
    assert not t.is_alive()
    assert errors and isinstance(errors[0], errors_ok), errors
    _link(owner, puller)  # a fresh link works
    dst[:] = 0
    puller.pull(1, KEY, 0, plan, entry.cache_id, 5.0)
    assert np.array_equal(dst, src)


@needs_nixl
def test_force_unlink_breaks_a_nixl_transfer_in_flight(pair) -> None:
    _force_unlink_breaks_a_transfer_in_flight(*pair, rounds=50, errors_ok=(BrokenLink, NotLinked))


# ------------------------------------------------------------------------------ datadist info


def _info(*args: str) -> str:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "datadist.cli", "info", *args],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_info_says_whether_nixl_is_there_and_its_backends() -> None:
    out = _info()
    line = next(x for x in out.splitlines() if x.startswith("nixl:"))
    if nixl.available() is None:
        assert "not installed" in line and "datadist[nixl]" in line
    else:
        assert "UCX available" in line, line
    assert "NIXL INFO" not in out  # NIXL's own chatter stays off our stdout


@needs_nixl
def test_info_tells_the_path_of_a_link(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DATADIST_NIXL_ALLOW_WHOLE_PROCESS_ACCESS", "1")  # the probing reader
    owner = Engine(EngineConfig(cluster_id=1, role=1, **NIXL_OK, listen=("127.0.0.1", 0)))
    try:
        host, port = owner.listen_address
        out = _info("--peer", f"{host}:{port}", "--cluster-id", "1", "--transport", "nixl")
        assert "path=nixl (forced nixl" in out, out
        out = _info("--peer", f"{host}:{port}", "--cluster-id", "1")
        assert "path=nixl" not in out and "path=" in out, out
    finally:
        owner.close()


@needs_nixl
def test_a_kept_handle_is_not_reused_across_a_local_reregistration(pair) -> None:
    """The reader unregisters its destination and registers it again at the same address:
    the identical read gets a new handle (the old one was made against the old
    registration)."""
    owner, puller = pair
    src, dst, entry, plan = _caches(owner, puller, 8192)
    link = _link(owner, puller)
    puller.pull(1, KEY, 0, plan, entry.cache_id, 5.0)
    first = next(iter(link.path._handles.values()))
    puller.unregister(entry.cache_id)
    again = puller.register(Geometry(1, 8192, 1), [dst.ctypes.data], placement=0)
    dst[:] = 0
    puller.pull(1, KEY, 0, plan, again.cache_id, 5.0)
    assert np.array_equal(dst, src)
    assert list(link.path._handles.values())[-1] is not first


# ------------------------------------------------------------------------------ memory kinds


def test_memory_kind_asks_cuda_only_for_device_placement(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """VRAM is chosen from what CUDA says about a device-placed cache's address (there is no
    GPU here: CUDA is stood in for); host placement never asks."""
    asked: list[int] = []

    def fake_cuda(addr: int) -> int | None:
        asked.append(addr)
        return 3 if addr == 0x7000 else None

    monkeypatch.setattr(nixl, "_cuda_device", fake_cuda)
    assert nixl.memory_kind(0x7000, True) == (p.MEM_VRAM, 3)
    assert nixl.memory_kind(0x8000, True) == (p.MEM_DRAM, 0)
    assert nixl.memory_kind(0x7000, False) == (p.MEM_DRAM, 0)
    assert asked == [0x7000, 0x8000]


def test_host_memory_is_not_cuda_memory() -> None:
    buf = np.zeros(64, np.uint8)
    assert nixl._cuda_device(buf.ctypes.data) is None  # no CUDA runtime, or host memory


@needs_nixl
def test_reader_reconnecting_to_a_restarted_owner_finds_its_new_agent() -> None:
    """The owner restarts at the same address (auto transport: its agent is made on demand);
    the reader's link reconnects by itself and its first NIXL_READ meets an owner without an
    agent yet: the owner makes one, the grant names it, the reader loads it, bytes are the new
    owner's."""
    owner = Engine(EngineConfig(cluster_id=1, role=1, **NIXL_OK, listen=("127.0.0.1", 0)))
    puller = Engine(EngineConfig(cluster_id=2, role=2, **NIXL_OK, transport="nixl"))
    reborn = None
    try:
        src, dst, entry, plan = _caches(owner, puller, 4096, fill=1)
        link = _link(owner, puller)
        puller.pull(1, KEY, 0, plan, entry.cache_id, 5.0)
        first_agent = link.path.remote
        host, port = owner.listen_address
        owner.close()
        reborn = Engine(EngineConfig(cluster_id=1, role=1, **NIXL_OK, listen=(host, port)))
        src2 = np.full(4096, 2, np.uint8)
        reborn.register(Geometry(1, 4096, 1), [src2.ctypes.data], placement=0)
        assert reborn.nixl is None
        for _ in range(2):  # the first pull may find the dead connection
            try:
                puller.pull(1, KEY, 0, plan, entry.cache_id, 5.0)
                break
            except BrokenLink:
                continue
        assert (dst == 2).all()
        assert link.path.remote != first_agent and reborn.nixl is not None
    finally:
        puller.close()
        owner.close()
        if reborn is not None:
            reborn.close()


def test_without_rdma_devices_ucx_ib_module_is_kept_out(tmp_path, monkeypatch) -> None:
    """No RDMA device (an empty or missing /sys/class/infiniband): UCX_MODULES=^ib, unless
    the user chose UCX_MODULES; with a device, nothing is changed."""
    monkeypatch.delenv("UCX_MODULES", raising=False)
    assert nixl._skip_unusable_ib(str(tmp_path / "missing"))
    assert nixl.os.environ["UCX_MODULES"] == "^ib"
    monkeypatch.setenv("UCX_MODULES", "^cuda")
    assert not nixl._skip_unusable_ib(str(tmp_path))
    assert nixl.os.environ["UCX_MODULES"] == "^cuda"
    monkeypatch.delenv("UCX_MODULES")
    (tmp_path / "mlx5_0").mkdir()
    assert not nixl._skip_unusable_ib(str(tmp_path))
    assert "UCX_MODULES" not in nixl.os.environ


@needs_nixl
def test_a_process_with_a_nixl_agent_exits_cleanly() -> None:
    """With the RDMA user libraries installed and no RDMA device (CI installs libibverbs1),
    UCX's ib module crashed every process that had made an agent, at exit (SIGSEGV after its
    last line: pytest, `datadist info`, the benchmark). The agent, a transfer's worth of use,
    then a plain exit: status 0."""
    import subprocess
    import sys

    code = ("from datadist.transport.nixl import NixlAgent\n"
            "a = NixlAgent(5)\n"
            "print(a.backends)\n"
            "a.close()\n")
    env = {k: v for k, v in nixl.os.environ.items() if k != "UCX_MODULES"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env=env)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert "UCX" in proc.stdout


# ------------------------------------------------------------------------------ the core as reader

@pytest.fixture(params=OWNERS)
def core_pair(request: pytest.FixtureRequest):
    """An owner of either engine, and a reader on the C++ core forced to NIXL."""
    if not native.available()[0]:
        pytest.skip("the C++ core is not built here")
    owner = _owner(request.param)
    puller = native.NativeEngine(EngineConfig(cluster_id=2, role=2, **NIXL_OK, transport="nixl"))
    yield owner, puller
    puller.close()
    owner.close()


def _reader_leases(puller: Any) -> int:
    return int(puller._core.link_nixl_leases(1))


@needs_nixl
def test_core_reader_pulls_under_a_lease_until_the_owner_revokes_it(core_pair) -> None:
    """The core forced to NIXL: the first pull goes by NIXL_READ, the next ones under a
    lease on the whole cache; unregister on the owner revokes it on the core's reverse
    channel (answered once no read is under it), and the next pull fails as on any path.
    Before: forced nixl kept the configuration on the Python engine."""
    owner, puller = core_pair
    assert native.refusal(puller.config) is None
    src, dst, entry, plan = _caches(owner, puller, 1 << 20)
    link = _link(owner, puller)
    assert link.path_name == "nixl" and "forced nixl" in link.reason, link.reason
    puller.pull(1, KEY, 0, plan, entry.cache_id, 5.0)
    assert np.array_equal(dst, src) and _reader_leases(puller) == 0
    dst[:] = 0
    puller.pull(1, KEY, 0, plan, entry.cache_id, 5.0)  # the first under the lease
    prepared = puller.nixl_prepared
    for _ in range(3):
        dst[:] = 0
        puller.pull(1, KEY, 0, plan, entry.cache_id, 5.0)
        assert np.array_equal(dst, src)
    assert puller.nixl_prepared == prepared, "an identical pull prepared its transfer again"
    assert _reader_leases(puller) == 1 and _held(owner) == 1
    owner.unregister(1)
    assert _wait(lambda: _held(owner) == 0 and _reader_leases(puller) == 0)
    with pytest.raises(CacheNotFound):
        puller.pull(1, KEY, 0, plan, entry.cache_id, 5.0)


@needs_nixl
def test_core_reader_checks_a_leased_read_as_the_owner_would(core_pair) -> None:
    owner, puller = core_pair
    src, dst, entry, plan = _caches(owner, puller, 4096)
    _link(owner, puller)
    for _ in range(2):
        puller.pull(1, KEY, 0, plan, entry.cache_id, 5.0)
    assert _reader_leases(puller) == 1
    too_far = Plan(plan.remote_tensors, plan.local_tensors, plan.remote_offsets + np.uint64(1),
                   plan.local_offsets, plan.lengths)
    with pytest.raises(InvalidArgument):
        puller.pull(1, KEY, 0, too_far, entry.cache_id, 5.0)
    with pytest.raises(InvalidArgument):
        puller.pull(1, p.KeyRef(p.KeyKind.CACHE_ID, 1, 1), 0, plan, entry.cache_id, 5.0)
    dst[:] = 0
    puller.pull(1, KEY, 0, plan, entry.cache_id, 5.0)
    assert np.array_equal(dst, src) and _reader_leases(puller) == 1


@needs_nixl
def test_core_reader_pushes_by_nixl_write(core_pair) -> None:
    """NIXL_WRITE into checked spans, by cache id and by raw address; a bad key is refused
    before anything moves and the link stays usable."""
    owner, puller = core_pair
    n = 1 << 16
    dst = np.zeros(n, np.uint8)
    owner.register(Geometry(1, n, 1), [dst.ctypes.data], placement=0)
    src = np.random.default_rng(3).integers(0, 255, n, dtype=np.uint8)
    entry = puller.register(Geometry(1, n, 1), [src.ctypes.data], placement=0)
    plan = plan_slot(entry.geometry, 0, layer_tensor_indices(1, None, None, 2))
    _link(owner, puller)
    puller.push(1, KEY, 0, plan, entry.cache_id, 5.0)
    assert np.array_equal(dst, src)
    with pytest.raises(CacheNotFound):
        puller.push(1, p.KeyRef(p.KeyKind.CACHE_ID, 99, 0), 0, plan, entry.cache_id, 5.0)
    dst[:] = 0
    u32, u64 = np.uint32, np.uint64
    raw = Plan(np.array([0], u32), np.array([0], u32), np.array([dst.ctypes.data + 4096], u64),
               np.array([0], u64), np.array([256], u64))
    puller.push(1, p.KeyRef(p.KeyKind.ADDRESS), 0, raw, entry.cache_id, 5.0)
    assert np.array_equal(dst[4096:4352], src[:256])
    assert not dst[:4096].any() and not dst[4352:].any()
    assert _wait(lambda: _granted(owner) == 0)


@needs_nixl
def test_core_reader_ends_a_pull_at_its_deadline_and_the_link_stays_usable(core_pair) -> None:
    owner, puller = core_pair
    src, dst, entry, plan = _caches(owner, puller, 256 << 20, fill=5)
    _link(owner, puller)
    puller.pull(1, KEY, 0, plan, entry.cache_id, 30.0)  # wire up, warm
    dst[:] = 0
    with pytest.raises(Timeout):
        puller.pull(1, KEY, 0, plan, entry.cache_id, 0.005)
    assert _wait(lambda: _granted(owner) == 0 and _held(owner) == 0, 10)
    dst[:] = 0
    puller.pull(1, KEY, 0, plan, entry.cache_id, 30.0)
    assert np.array_equal(dst, src)


@needs_nixl
def test_core_reader_checksums_over_nixl(core_pair) -> None:
    owner, _ = core_pair
    puller = native.NativeEngine(EngineConfig(cluster_id=3, role=2, **NIXL_OK, transport="nixl",
                                              verify=True))
    try:
        src, dst, entry, plan = _caches(owner, puller, 65536)
        host, port = owner.listen_address
        assert puller.link(1, host, port, 5.0).path_name == "nixl"
        for _ in range(2):  # never under a lease: each goes by NIXL_READ with its CHECKSUM
            dst[:] = 0
            puller.pull(1, KEY, 0, plan, entry.cache_id, 5.0)
            assert np.array_equal(dst, src)
        assert int(puller._core.link_nixl_leases(1)) == 0
    finally:
        puller.close()


@needs_nixl
def test_core_reader_revoked_blocks_lease_reads_the_new_cache(core_pair) -> None:
    owner, puller = core_pair
    geo = Geometry(1, 8 * 4096, 8, is_blocks=True)
    old = np.full(8 * 4096, 1, np.uint8)
    owner.register(geo, [old.ctypes.data], placement=0, blocks_model_id=7)
    dst = np.zeros(8 * 4096, np.uint8)
    entry = puller.register(geo, [dst.ctypes.data], placement=0)
    plan = plan_blocks(entry.geometry, [1, 2], [3, 4], layer_tensor_indices(1, None, None, 1))
    key = p.KeyRef(p.KeyKind.BLOCKS_KEY, 0, 7, 0)
    _link(owner, puller)
    for _ in range(2):
        puller.pull(1, key, 4096, plan, entry.cache_id, 5.0)
    assert _reader_leases(puller) == 1
    new = np.full(8 * 4096, 2, np.uint8)
    owner.register(geo, [new.ctypes.data], placement=0, blocks_model_id=7)
    assert _wait(lambda: _held(owner) == 0 and _reader_leases(puller) == 0)
    for _ in range(2):
        dst[:] = 0
        puller.pull(1, key, 4096, plan, entry.cache_id, 5.0)
        assert (dst[3 * 4096:5 * 4096] == 2).all() and (dst[:3 * 4096] == 0).all()


@needs_nixl
@pytest.mark.parametrize("why", ["owner serves none", "no allowance here"])
def test_core_reader_falls_back_to_tcp_saying_why(why: str) -> None:
    if not native.available()[0]:
        pytest.skip("the C++ core is not built here")
    owner = _owner("python", nixl_serve=why != "owner serves none")
    puller = native.NativeEngine(EngineConfig(
        cluster_id=2, role=2, transport="nixl", nixl_serve=True,
        nixl_whole_process=why != "no allowance here"))
    try:
        src, dst, entry, plan = _caches(owner, puller, 4096)
        link = _link(owner, puller)
        assert link.path_name == "tcp", link.reason
        assert {"owner serves none": "no NIXL agent",
                "no allowance here": "NixlAllowWholeProcessAccess"}[why] in link.reason
        puller.pull(1, KEY, 0, plan, entry.cache_id, 5.0)
        assert np.array_equal(dst, src)
    finally:
        puller.close()
        owner.close()


@needs_nixl
def test_core_reader_force_unlink_breaks_a_transfer_in_flight(core_pair) -> None:
    _force_unlink_breaks_a_transfer_in_flight(*core_pair, rounds=200,
                                              errors_ok=(BrokenLink, NotLinked, LinkFailed))


@needs_nixl
def test_core_reader_refuses_a_lying_grant_and_a_silent_owner_in_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A grant that does not match the request is a protocol error (the connection closed,
    nothing read); an owner that does not answer a NIXL_READ ends the pull at its deadline;
    neither hangs, and once the owner behaves the link pulls again."""
    import dataclasses

    from datadist.core.errors import DatadistError

    if not native.available()[0]:
        pytest.skip("the C++ core is not built here")
    owner = _owner("python")
    puller = native.NativeEngine(EngineConfig(cluster_id=2, role=2, **NIXL_OK, transport="nixl"))
    try:
        src, dst, entry, plan = _caches(owner, puller, 4096)
        _link(owner, puller)
        real = owner.open_nixl

        def lying(peer, msg, lease_id):
            lease, grant = real(peer, msg, lease_id)
            more = np.zeros(len(grant.bases) + 1, np.uint64)
            return lease, dataclasses.replace(grant, bases=more)

        monkeypatch.setattr(owner, "open_nixl", lying)
        t0 = time.monotonic()
        with pytest.raises(DatadistError):
            puller.pull(1, KEY, 0, plan, entry.cache_id, 5.0)
        assert time.monotonic() - t0 < 5.0 and not dst.any()

        def silent(peer, msg, lease_id):
            time.sleep(2.0)
            return real(peer, msg, lease_id)

        monkeypatch.setattr(owner, "open_nixl", silent)
        t0 = time.monotonic()
        with pytest.raises(Timeout):
            puller.pull(1, KEY, 0, plan, entry.cache_id, 0.5)
        assert time.monotonic() - t0 < 1.5
        monkeypatch.undo()
        time.sleep(2.0)  # the silent answer goes to a connection the reader gave up on
        puller.pull(1, KEY, 0, plan, entry.cache_id, 5.0)
        assert np.array_equal(dst, src)
    finally:
        puller.close()
        owner.close()
