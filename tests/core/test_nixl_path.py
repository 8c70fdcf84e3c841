"""The NIXL data path of the core (cpp/src/nixl.h, driven by core/native.py) between two
engines in this process, and how it is chosen. The two-process suites run over it too
(TRANSPORTS in _support.py); these tests look at what only NIXL has: selection and its
errors, the owner's lazily created agent and its pump, metadata reloads when the owner's
registrations change, leases on whole caches and their revocation, prepared transfers reused,
the fallback to TCP for an owner that serves no NIXL, and a lying or silent owner (the real
owner behind a proxy that rewrites its control channel). The selection tests run everywhere;
the rest skip without the nixl-cu12 wheel.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import datadist as llm_datadist
from datadist.core import native
from datadist.core import nixl_wheel as nixl
from datadist.core.config import EngineConfig
from datadist.core.errors import (
    BrokenLink,
    CacheNotFound,
    DatadistError,
    InvalidArgument,
    LinkFailed,
    NotLinked,
    Timeout,
)
from datadist.core.layout import (
    Geometry,
    Plan,
    every_tensor,
    plan_blocks,
    plan_slot,
)
from datadist.core.native import NativeEngine
from datadist.testing import engine as hooks
from datadist.wire import protocol as p

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not native.available()[0], reason="the C++ core is not built")]
needs_nixl = pytest.mark.skipif(nixl.available() is None, reason="nixl-cu12 not installed")
S = llm_datadist.LLMStatusCode
KEY = p.KeyRef(p.KeyKind.CACHE_ID, 1, 0)
# Serving NIXL is opt-in, and on this CPU machine UCX uses tcp and shared memory, whose memory
# keys nothing checks: the engines here allow it explicitly (tests/security/test_nixl_trust.py
# shows what that allows).
NIXL_OK = {"nixl_serve": True, "nixl_whole_process": True}
READER = 2  # the reader's cluster id: the owner's metrics of what it served are filed under it


@pytest.fixture(autouse=True)
def _nixl_readers_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where NIXL is installed, in-process readers that force NIXL get the whole-process
    allowance (docs/security.md, "The NIXL path"), as e2e/conftest.py gives its decoders."""
    if nixl.available() is not None:
        monkeypatch.setenv("DATADIST_NIXL_ALLOW_WHOLE_PROCESS_ACCESS", "1")


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
        NativeEngine(EngineConfig(cluster_id=2, role=2, **NIXL_OK, transport="nixl"))


# ------------------------------------------------------------------------------ the path


def _owner(**config: Any) -> NativeEngine:
    """An owner listening on localhost, serving NIXL unless ``config`` says otherwise."""
    return NativeEngine(EngineConfig(cluster_id=1, role=1,
                                     **{"listen": ("127.0.0.1", 0), **NIXL_OK, **config}))


def _reader(**config: Any) -> NativeEngine:
    """A reader forced to NIXL (``config`` may change that)."""
    return NativeEngine(EngineConfig(cluster_id=READER, role=2,
                                     **{**NIXL_OK, "transport": "nixl", **config}))


@pytest.fixture
def core_pair() -> Iterator[tuple[NativeEngine, NativeEngine]]:
    """An owner serving NIXL, and a reader forced to NIXL, both the core."""
    owner = _owner()
    puller = _reader()
    yield owner, puller
    puller.close()
    owner.close()


def _held(owner: NativeEngine) -> int:
    """NIXL leases on whole caches readers hold on the owner now."""
    return hooks.nixl_leases(owner)


def _granted(owner: NativeEngine) -> int:
    """NIXL grants (between NIXL_GRANT and RELEASE) open on the owner now."""
    agent = hooks.nixl_agent(owner)
    return 0 if agent is None else agent[2] - _held(owner)


def _reader_leases(puller: NativeEngine, cluster_id: int = 1) -> int:
    return int(hooks.link_nixl_leases(puller, cluster_id))


def _served(op: str) -> int:
    """Requests of kind ``op`` the owner served for READER so far (the process's metrics)."""
    return int(llm_datadist.metrics()["links"].get(READER, {}).get(op, {}).get("transfers", 0))


def _wait(cond: Callable[[], Any], seconds: float = 5.0) -> bool:
    end = time.monotonic() + seconds
    while not cond() and time.monotonic() < end:
        time.sleep(0.005)
    return bool(cond())


def _link(owner: Any, puller: NativeEngine, address: tuple[str, int] | None = None) -> Any:
    host, port = address or owner.listen_address
    return puller.link(1, host, port, 5.0)


def _caches(owner: NativeEngine, puller: NativeEngine, n: int, fill: int = 7):
    src = np.full(n, fill, np.uint8)
    src[::97] = np.arange(len(src[::97]), dtype=np.uint64).astype(np.uint8)
    owner.register(Geometry(1, n, 1), [src.ctypes.data], placement=0)
    dst = np.zeros(n, np.uint8)
    entry = puller.register(Geometry(1, n, 1), [dst.ctypes.data], placement=0)
    plan = plan_slot(entry.geometry, 0, every_tensor(1))
    return src, dst, entry, plan


def _pump_idle(owner: NativeEngine) -> bool:
    return _wait(lambda: (hooks.nixl_agent(owner) or ("", 0, 0, 0))[2] == 0)


@needs_nixl
def test_an_owner_serving_nixl_runs_on_the_core() -> None:
    """Serving NIXL (datadist.NixlServe): the engine is the core, whose listener serves NIXL
    readers; it makes no agent until a reader asks."""
    config = EngineConfig(cluster_id=1, role=1, **NIXL_OK)
    eng = native.engine_for(config)
    try:
        assert isinstance(eng, NativeEngine)
        assert hooks.nixl_refusal(eng) is None and hooks.nixl_agent(eng) is None
    finally:
        eng.close()


@needs_nixl
def test_auto_never_picks_nixl() -> None:
    owner = _owner()
    puller = _reader(transport="auto")
    try:
        assert _link(owner, puller).path_name in ("cma", "shm")
        assert hooks.nixl_agent(puller) is None and hooks.nixl_agent(owner) is None
    finally:
        puller.close()
        owner.close()


@needs_nixl
def test_core_reader_pulls_under_a_lease_until_the_owner_revokes_it(core_pair) -> None:
    """The owner's agent is made when a reader first asks (at link, for its metadata). The
    connection's first pull goes by NIXL_READ (it wires the endpoint up, the owner's pump
    beating fast); the second asks for a lease on the whole cache; from then on a pull sends
    nothing on the control channel (the owner serves no request) and reuses its prepared
    transfer. The owner's pump beats slowly while the lease is held; unregister on the owner
    revokes it on the reader's reverse channel, the pump stops, and the next pull fails as
    on any path."""
    owner, puller = core_pair
    assert hooks.nixl_agent(owner) is None  # created when a reader first asks for it
    src, dst, entry, plan = _caches(owner, puller, 1 << 20)
    link = _link(owner, puller)
    assert link.path_name == "nixl" and "forced nixl" in link.reason, link.reason
    assert hooks.nixl_agent(owner) is not None
    reads, leases = _served("serve_read"), _served("serve_lease")
    puller.pull(1, KEY, 0, plan, entry.cache_id, 5.0)
    assert np.array_equal(dst, src) and _reader_leases(puller) == 0
    # the NIXL_READ: the owner counts it served when the read's grant ends, on the reader's
    # one-way Release, which may come after the pull returned (CI saw 220 against 221 once)
    assert _wait(lambda: _served("serve_read") == reads + 1), _served("serve_read") - reads
    # the owner counts the connection wired when it handles the read's one-way Release,
    # which may come after the pull returned
    assert _wait(lambda: _granted(owner) == 0)
    dst[:] = 0
    puller.pull(1, KEY, 0, plan, entry.cache_id, 5.0)  # the first under the lease
    assert np.array_equal(dst, src) and _served("serve_lease") == leases + 1
    prepared = hooks.nixl_prepared(puller)
    for _ in range(3):
        dst[:] = 0
        puller.pull(1, KEY, 0, plan, entry.cache_id, 5.0)
        assert np.array_equal(dst, src)
    assert hooks.nixl_prepared(puller) == prepared, "an identical pull prepared its transfer again"
    assert (_served("serve_read"), _served("serve_lease")) == (reads + 1, leases + 1), \
        "a pull under the lease sent a request"
    assert _reader_leases(puller) == 1 and _held(owner) == 1
    agent = hooks.nixl_agent(owner)
    assert agent is not None and agent[2] and agent[3] == 0  # the slow beat
    assert _granted(owner) == 0  # no per-pull grant left open
    owner.unregister(1)
    assert _wait(lambda: _held(owner) == 0 and _reader_leases(puller) == 0)
    assert _pump_idle(owner), "the pump still beats without any lease"
    with pytest.raises(CacheNotFound):
        puller.pull(1, KEY, 0, plan, entry.cache_id, 5.0)


@needs_nixl
def test_core_reader_checks_a_leased_read_as_the_owner_would(core_pair) -> None:
    """Under a lease the reader checks bounds against the lease's geometry before any
    descriptor is built: the owner's errors, and the link stays usable."""
    owner, puller = core_pair
    src, dst, entry, plan = _caches(owner, puller, 4096)
    _link(owner, puller)
    for _ in range(2):
        puller.pull(1, KEY, 0, plan, entry.cache_id, 5.0)
    assert _reader_leases(puller) == 1
    too_far = Plan(plan.remote_tensors, plan.local_tensors, plan.remote_offsets + np.uint64(1),
                   plan.local_offsets, plan.lengths)
    with pytest.raises(InvalidArgument, match="outside"):
        puller.pull(1, KEY, 0, too_far, entry.cache_id, 5.0)
    with pytest.raises(InvalidArgument, match="batch index"):
        puller.pull(1, p.KeyRef(p.KeyKind.CACHE_ID, 1, 1), 0, plan, entry.cache_id, 5.0)
    dst[:] = 0
    puller.pull(1, KEY, 0, plan, entry.cache_id, 5.0)
    assert np.array_equal(dst, src) and _reader_leases(puller) == 1


@needs_nixl
def test_core_reader_revoke_waits_for_a_read_in_flight(core_pair) -> None:
    """unregister on the owner revokes the lease; the reader answers only once its read
    under it is done, so the owner never takes memory back under a read: a pull whose bytes
    were landing when unregister began either fails or has every byte the cache held before,
    none of what the owner wrote there once unregister returned."""
    owner, puller = core_pair
    src, dst, entry, plan = _caches(owner, puller, 256 << 20, fill=5)
    want = src.copy()
    _link(owner, puller)
    for _ in range(2):  # the second under the lease
        puller.pull(1, KEY, 0, plan, entry.cache_id, 30.0)
    assert _reader_leases(puller) == 1
    dst[:] = 0
    ended: list[BaseException | None] = []

    def pull() -> None:
        try:
            puller.pull(1, KEY, 0, plan, entry.cache_id, 30.0)
            ended.append(None)
        except DatadistError as e:
            ended.append(e)

    t = threading.Thread(target=pull)
    t.start()
    samples = dst[::1 << 20]  # a view: bytes land there while the read runs
    assert _wait(lambda: samples.any() or not t.is_alive(), 10)
    in_flight = t.is_alive()
    owner.unregister(1)
    src[:] = 0xFF  # the owner's memory, reused the moment unregister returned
    t.join(30)
    assert not t.is_alive() and ended
    assert in_flight, "the read ended before unregister began (nothing was checked)"
    if ended[0] is None:
        assert np.array_equal(dst, want), "the read under the lease outlived unregister"
    else:
        assert isinstance(ended[0], CacheNotFound | LinkFailed | BrokenLink), ended


@needs_nixl
def test_core_reader_revoked_blocks_lease_reads_the_new_cache(core_pair) -> None:
    """A blocks model id registered again names another cache: the lease on the old one is
    revoked, and the next pull by the same BlocksCacheKey reads the new cache, then under a
    lease on it."""
    owner, puller = core_pair
    geo = Geometry(1, 8 * 4096, 8, is_blocks=True)
    old = np.full(8 * 4096, 1, np.uint8)
    owner.register(geo, [old.ctypes.data], placement=0, blocks_model_id=7)
    dst = np.zeros(8 * 4096, np.uint8)
    entry = puller.register(geo, [dst.ctypes.data], placement=0)
    plan = plan_blocks(entry.geometry, [1, 2], [3, 4], every_tensor(1))
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
    assert _held(owner) == 1 and _reader_leases(puller) == 1


@needs_nixl
def test_metadata_is_reloaded_when_the_owner_registers_after_the_link(core_pair) -> None:
    """A cache the owner registers after the reader loaded its metadata is read by NIXL:
    the owner's agent is a newer generation, which the grant names, and the reader reloads."""
    owner, puller = core_pair
    _caches(owner, puller, 4096)
    link = _link(owner, puller)
    gen = hooks.nixl_agent(owner)[1]  # type: ignore[index]
    src2 = np.arange(8192, dtype=np.uint8)
    owner.register(Geometry(1, 8192, 1), [src2.ctypes.data], placement=0)  # cache 2
    assert hooks.nixl_agent(owner)[1] > gen  # type: ignore[index]
    dst2 = np.zeros(8192, np.uint8)
    e2 = puller.register(Geometry(1, 8192, 1), [dst2.ctypes.data], placement=0)
    plan = plan_slot(e2.geometry, 0, every_tensor(1))
    puller.pull(1, p.KeyRef(p.KeyKind.CACHE_ID, 2, 0), 0, plan, e2.cache_id, 5.0)
    assert np.array_equal(dst2, src2)
    assert link.path_name == "nixl" and puller.links()[0].path_name == "nixl"


@needs_nixl
def test_unregister_deregisters_from_nixl_and_the_key_is_gone(core_pair) -> None:
    owner, puller = core_pair
    src, dst, entry, plan = _caches(owner, puller, 4096)
    _link(owner, puller)
    puller.pull(1, KEY, 0, plan, entry.cache_id, 5.0)
    gen = hooks.nixl_agent(owner)[1]  # type: ignore[index]
    owner.unregister(1)
    assert hooks.nixl_agent(owner)[1] > gen  # type: ignore[index]
    with pytest.raises(CacheNotFound):
        puller.pull(1, KEY, 0, plan, entry.cache_id, 5.0)


@needs_nixl
def test_core_reader_pushes_by_nixl_write(core_pair) -> None:
    """NIXL_WRITE into checked spans (a transfer of its own: the reader prepares one more),
    by cache id and by raw address (transfer_cache_async's key kind 4: the grant's base is
    0, the offsets absolute; the bytes land exactly there); a bad key is refused before
    anything moves, the key survives (pushes never consume) and the link stays usable."""
    owner, puller = core_pair
    n = 1 << 16
    dst = np.zeros(n, np.uint8)
    owner.register(Geometry(1, n, 1), [dst.ctypes.data], placement=0)
    src = np.random.default_rng(3).integers(0, 255, n, dtype=np.uint8)
    entry = puller.register(Geometry(1, n, 1), [src.ctypes.data], placement=0)
    plan = plan_slot(entry.geometry, 0, every_tensor(1))
    _link(owner, puller)
    prepared = hooks.nixl_prepared(puller)
    puller.push(1, KEY, 0, plan, entry.cache_id, 5.0)
    assert np.array_equal(dst, src)
    assert hooks.nixl_prepared(puller) > prepared, "the push did not go by NIXL"
    with pytest.raises(CacheNotFound):
        puller.push(1, p.KeyRef(p.KeyKind.CACHE_ID, 99, 0), 0, plan, entry.cache_id, 5.0)
    src[:] = 9
    puller.push(1, KEY, 0, plan, entry.cache_id, 5.0)
    assert (dst == 9).all()
    dst[:] = 0
    src[:] = np.random.default_rng(4).integers(0, 255, n, dtype=np.uint8)
    u32, u64 = np.uint32, np.uint64
    raw = Plan(np.array([0], u32), np.array([0], u32), np.array([dst.ctypes.data + 4096], u64),
               np.array([0], u64), np.array([256], u64))
    puller.push(1, p.KeyRef(p.KeyKind.ADDRESS), 0, raw, entry.cache_id, 5.0)
    assert np.array_equal(dst[4096:4352], src[:256])
    assert not dst[:4096].any() and not dst[4352:].any()
    # RELEASE is one-way: the owner handles it after push returns
    assert _wait(lambda: _granted(owner) == 0)


@needs_nixl
def test_core_reader_ends_a_pull_at_its_deadline_and_the_link_stays_usable(core_pair) -> None:
    """NIXL has no deadline of its own: a pull whose deadline passes mid-READ ends with
    Timeout (LLM_TIMEOUT), the owner drops its grant, and the next pull on the same link
    moves every byte."""
    owner, puller = core_pair
    src, dst, entry, plan = _caches(owner, puller, 256 << 20, fill=5)
    _link(owner, puller)
    puller.pull(1, KEY, 0, plan, entry.cache_id, 30.0)  # wire up, warm
    dst[:] = 0
    with pytest.raises(Timeout):
        puller.pull(1, KEY, 0, plan, entry.cache_id, 0.005)
    assert _wait(lambda: _granted(owner) == 0 and _held(owner) == 0, 10), \
        "the owner kept the timed-out reader's grant"
    dst[:] = 0
    puller.pull(1, KEY, 0, plan, entry.cache_id, 30.0)
    assert np.array_equal(dst, src)


@needs_nixl
def test_core_reader_checksums_over_nixl(core_pair) -> None:
    owner, _ = core_pair
    puller = NativeEngine(EngineConfig(cluster_id=3, role=2, **NIXL_OK, transport="nixl",
                                       verify=True))
    try:
        src, dst, entry, plan = _caches(owner, puller, 65536)
        host, port = owner.listen_address  # type: ignore[misc]
        assert puller.link(1, host, port, 5.0).path_name == "nixl"
        for _ in range(2):  # never under a lease: each goes by NIXL_READ with its CHECKSUM
            dst[:] = 0
            puller.pull(1, KEY, 0, plan, entry.cache_id, 5.0)
            assert np.array_equal(dst, src)
        assert _reader_leases(puller) == 0
    finally:
        puller.close()


@needs_nixl
@pytest.mark.parametrize("why", ["default", "no remote access", "unchecked transports"])
def test_an_owner_that_does_not_serve_nixl_gets_tcp_readers(why: str) -> None:
    """Serving NIXL is opt-in (nixl_serve), needs remote cache access (NIXL registrations are
    writable) and, on this host's key-unchecked UCX transports, nixl_whole_process: without
    any of them the owner makes no agent and hands out no metadata; a reader that forces nixl
    gets tcp, with the owner's reason, and pulls."""
    off = {"default": {"nixl_serve": False}, "no remote access":
           {"remote_cache_accessible": False}, "unchecked transports":
           {"nixl_whole_process": False}}[why]
    owner = _owner(**off)
    try:
        _pulls_over_tcp_saying(owner, _reader(), {
            "default": "datadist.NixlServe", "no remote access": "remote writes",
            "unchecked transports": "NixlAllowWholeProcessAccess"}[why])
        assert hooks.nixl_agent(owner) is None
    finally:
        owner.close()


def _pulls_over_tcp_saying(owner: NativeEngine, puller: NativeEngine, why: str) -> None:
    """``puller``, which forces nixl, links to ``owner`` over tcp with ``why`` in its reason,
    and a pull moves the bytes. Closes ``puller``."""
    try:
        src, dst, entry, plan = _caches(owner, puller, 4096)
        link = _link(owner, puller)
        assert link.path_name == "tcp", link.reason
        assert why in link.reason
        puller.pull(1, KEY, 0, plan, entry.cache_id, 5.0)
        assert np.array_equal(dst, src)
    finally:
        puller.close()


@needs_nixl
def test_core_reader_without_the_allowance_falls_back_to_tcp_saying_why() -> None:
    """The reader itself may not use NIXL on this host's key-unchecked transports without
    the whole-process allowance: tcp, naming it, and the pull works."""
    owner = _owner()
    try:
        _pulls_over_tcp_saying(owner, _reader(nixl_whole_process=False),
                               "NixlAllowWholeProcessAccess")
    finally:
        owner.close()


@needs_nixl
def test_core_reader_force_unlink_breaks_a_transfer_in_flight(core_pair) -> None:
    """A forced unlink during NIXL pulls fails the pull in flight, the pulling thread ends,
    and a fresh link pulls the bytes."""
    owner, puller = core_pair
    src, dst, entry, plan = _caches(owner, puller, 64 << 20, fill=1)
    _link(owner, puller)
    errors: list[BaseException] = []
    done = threading.Event()  # one pull through: the next ones run over the link

    def pull() -> None:
        try:
            for _ in range(200):
                puller.pull(1, KEY, 0, plan, entry.cache_id, 5.0)
                done.set()
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            errors.append(e)

    t = threading.Thread(target=pull)
    t.start()
    assert done.wait(10), f"no pull got through before the unlink: {errors}"
    puller.unlink(1, timeout=1.0, force=True)
    t.join(20)
    assert not t.is_alive()
    assert errors and isinstance(errors[0], BrokenLink | NotLinked | LinkFailed), errors
    _link(owner, puller)  # a fresh link works
    dst[:] = 0
    puller.pull(1, KEY, 0, plan, entry.cache_id, 5.0)
    assert np.array_equal(dst, src)


@needs_nixl
def test_a_kept_transfer_is_not_reused_across_a_local_reregistration(core_pair) -> None:
    """The reader unregisters its destination and registers it again at the same address:
    the identical read is prepared anew (the kept one was made against the old
    registration), and lands."""
    owner, puller = core_pair
    src, dst, entry, plan = _caches(owner, puller, 8192)
    _link(owner, puller)
    for _ in range(2):
        puller.pull(1, KEY, 0, plan, entry.cache_id, 5.0)
    prepared = hooks.nixl_prepared(puller)
    puller.pull(1, KEY, 0, plan, entry.cache_id, 5.0)
    assert hooks.nixl_prepared(puller) == prepared  # kept, while the registration stands
    puller.unregister(entry.cache_id)
    again = puller.register(Geometry(1, 8192, 1), [dst.ctypes.data], placement=0)
    dst[:] = 0
    puller.pull(1, KEY, 0, plan, again.cache_id, 5.0)
    assert np.array_equal(dst, src)
    assert hooks.nixl_prepared(puller) > prepared, "a transfer of the old registration was reused"


@needs_nixl
def test_reader_reconnecting_to_a_restarted_owner_finds_its_new_agent() -> None:
    """The owner restarts at the same address (its agent made on demand); the reader's link
    reconnects by itself and its first NIXL_READ meets an owner without an agent yet: the
    owner makes one, the grant names it, the reader loads it, bytes are the new owner's."""
    owner = _owner()
    puller = _reader()
    reborn = None
    try:
        src, dst, entry, plan = _caches(owner, puller, 4096, fill=1)
        _link(owner, puller)
        puller.pull(1, KEY, 0, plan, entry.cache_id, 5.0)
        first_agent = hooks.nixl_agent(owner)[0]  # type: ignore[index]
        host, port = owner.listen_address  # type: ignore[misc]
        owner.close()
        reborn = _owner(listen=(host, port))
        src2 = np.full(4096, 2, np.uint8)
        reborn.register(Geometry(1, 4096, 1), [src2.ctypes.data], placement=0)
        assert hooks.nixl_agent(reborn) is None
        for _ in range(2):  # the first pull may find the dead connection
            try:
                puller.pull(1, KEY, 0, plan, entry.cache_id, 5.0)
                break
            except (BrokenLink, LinkFailed):
                continue
        assert (dst == 2).all()
        assert hooks.nixl_agent(reborn) is not None and hooks.nixl_agent(reborn)[0] != first_agent
        assert puller.links()[0].path_name == "nixl"
    finally:
        puller.close()
        owner.close()
        if reborn is not None:
            reborn.close()


# ------------------------------------------------------------------------------ a hostile owner


class _Proxy:
    """The real owner behind a proxy on the control channel: every connection is forwarded
    both ways, the owner's WELCOME loses FEATURE_LOCAL (so the reader stays on this TCP
    connection), and every other message the owner sends goes through :attr:`rewrite` (the
    test's; it may sleep: a silent owner). NIXL's own traffic goes to the owner's agent
    directly. Threads end when either side closes; :meth:`close` closes everything."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.rewrite: Callable[[Any], Any] = lambda msg: msg
        self._server = socket.create_server(("127.0.0.1", 0))
        self._server.settimeout(0.2)
        self.address: tuple[str, int] = self._server.getsockname()[:2]
        self._socks: list[socket.socket] = [self._server]
        self._closing = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._closing.set()
        for s in self._socks:
            with contextlib.suppress(OSError):
                s.close()

    def _accept(self) -> None:
        while not self._closing.is_set():
            try:
                down, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            up = socket.create_connection(self.target, timeout=5)
            for s in (down, up):
                s.settimeout(None)
            self._socks += [down, up]
            threading.Thread(target=self._copy, args=(down, up), daemon=True).start()
            threading.Thread(target=self._rewrite, args=(up, down), daemon=True).start()

    @staticmethod
    def _copy(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def _rewrite(self, src: socket.socket, dst: socket.socket) -> None:
        """The owner's frames, whole; raw bytes after a READ_DATA passed as they come."""
        buf, raw_left = bytearray(), 0
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16):
                buf += data
                while True:
                    if raw_left:
                        n = min(raw_left, len(buf))
                        if not n:
                            break
                        dst.sendall(bytes(buf[:n]))
                        del buf[:n]
                        raw_left -= n
                        continue
                    if len(buf) < p.HEADER_SIZE:
                        break
                    head = p.decode_header(bytes(buf[:p.HEADER_SIZE]))
                    size = p.HEADER_SIZE + head.length
                    if len(buf) < size:
                        break
                    frame = bytes(buf[:size])
                    del buf[:size]
                    msg = p.decode_payload(head.type, frame[p.HEADER_SIZE:])
                    if isinstance(msg, p.Welcome):
                        msg = dataclasses.replace(msg, features=msg.features & ~p.FEATURE_LOCAL)
                        frame = p.encode(msg, head.request_id)
                    elif isinstance(msg, p.ReadData):
                        raw_left = msg.nbytes
                    else:
                        new = self.rewrite(msg)
                        if new is not msg:
                            frame = p.encode(new, head.request_id)
                    dst.sendall(frame)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)


@needs_nixl
def test_core_reader_refuses_a_lying_grant_and_a_silent_owner_in_time(core_pair) -> None:
    """A grant that does not match the request (one base too many, the others right) is a
    protocol error (the connection closed, nothing read); an owner that does not answer a
    NIXL_READ ends the pull at its deadline; neither hangs, and once the owner behaves the
    link pulls again."""
    owner, puller = core_pair
    proxy = _Proxy(owner.listen_address)  # type: ignore[arg-type]
    try:
        src, dst, entry, plan = _caches(owner, puller, 4096)
        assert _link(proxy, puller, proxy.address).path_name == "nixl"

        def lying(msg: Any) -> Any:
            if not isinstance(msg, p.NixlGrant):
                return msg
            # the right spans, and one more: readable, but not what was asked for
            return dataclasses.replace(msg, bases=np.append(msg.bases, msg.bases[:1]))

        proxy.rewrite = lying
        t0 = time.monotonic()
        with pytest.raises(DatadistError) as e:
            puller.pull(1, KEY, 0, plan, entry.cache_id, 5.0)
        # refused as a protocol error, not ended by the 5 s deadline
        assert not isinstance(e.value, Timeout), e.value
        assert time.monotonic() - t0 < 5.0 and not dst.any()

        def silent(msg: Any) -> Any:
            if isinstance(msg, p.NixlGrant):
                time.sleep(2.0)
            return msg

        proxy.rewrite = silent
        t0 = time.monotonic()
        with pytest.raises(Timeout):
            puller.pull(1, KEY, 0, plan, entry.cache_id, 0.5)
        assert time.monotonic() - t0 < 1.5
        proxy.rewrite = lambda msg: msg
        time.sleep(2.0)  # the silent answer goes to a connection the reader gave up on
        puller.pull(1, KEY, 0, plan, entry.cache_id, 5.0)
        assert np.array_equal(dst, src)
    finally:
        proxy.close()


@needs_nixl
def test_metadata_our_nixl_refuses_gets_tcp(core_pair) -> None:
    """The owner's metadata cannot be loaded here (another NIXL version, a corrupt blob):
    the link is tcp, saying why, and pulls."""
    owner, puller = core_pair
    proxy = _Proxy(owner.listen_address)  # type: ignore[arg-type]
    proxy.rewrite = lambda msg: (dataclasses.replace(msg, metadata=b"\x07" * 64)
                                 if isinstance(msg, p.NixlMd) else msg)
    try:
        src, dst, entry, plan = _caches(owner, puller, 4096)
        link = _link(proxy, puller, proxy.address)
        assert link.path_name == "tcp", link.reason
        assert "metadata" in link.reason, link.reason
        puller.pull(1, KEY, 0, plan, entry.cache_id, 5.0)
        assert np.array_equal(dst, src)
    finally:
        proxy.close()


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
    owner = _owner()
    try:
        host, port = owner.listen_address  # type: ignore[misc]
        out = _info("--peer", f"{host}:{port}", "--cluster-id", "1", "--transport", "nixl")
        assert "path=nixl (forced nixl" in out, out
        out = _info("--peer", f"{host}:{port}", "--cluster-id", "1")
        assert "path=nixl" not in out and "path=" in out, out
    finally:
        owner.close()


# ------------------------------------------------------------------------------ UCX and exit


def test_without_rdma_devices_ucx_ib_module_is_kept_out(tmp_path, monkeypatch) -> None:
    """No RDMA device (an empty or missing /sys/class/infiniband): UCX_MODULES=^ib, unless
    the user chose UCX_MODULES; with a device, nothing is changed."""
    monkeypatch.delenv("UCX_MODULES", raising=False)
    assert nixl._skip_unusable_ib(str(tmp_path / "missing"))
    assert os.environ["UCX_MODULES"] == "^ib"
    monkeypatch.setenv("UCX_MODULES", "^cuda")
    assert not nixl._skip_unusable_ib(str(tmp_path))
    assert os.environ["UCX_MODULES"] == "^cuda"
    monkeypatch.delenv("UCX_MODULES")
    (tmp_path / "mlx5_0").mkdir()
    assert not nixl._skip_unusable_ib(str(tmp_path))
    assert "UCX_MODULES" not in os.environ


EXIT_CHECK = """
import numpy as np
from datadist.core.config import EngineConfig
from datadist.core.layout import Geometry, every_tensor, plan_slot
from datadist.core.native import NativeEngine
from datadist.wire import protocol as p

ok = {"nixl_serve": True, "nixl_whole_process": True}
owner = NativeEngine(EngineConfig(cluster_id=1, role=1, listen=("127.0.0.1", 0), **ok))
reader = NativeEngine(EngineConfig(cluster_id=2, role=2, transport="nixl", **ok))
src = np.full(4096, 3, np.uint8)
owner.register(Geometry(1, 4096, 1), [src.ctypes.data], placement=0)
dst = np.zeros(4096, np.uint8)
entry = reader.register(Geometry(1, 4096, 1), [dst.ctypes.data], placement=0)
plan = plan_slot(entry.geometry, 0, every_tensor(1))
print(reader.link(1, *owner.listen_address, 5.0).reason)
reader.pull(1, p.KeyRef(p.KeyKind.CACHE_ID, 1, 0), 0, plan, entry.cache_id, 5.0)
assert (dst == 3).all()
reader.close()
owner.close()
"""


@needs_nixl
def test_a_process_with_a_nixl_agent_exits_cleanly() -> None:
    """With the RDMA user libraries installed and no RDMA device (CI installs libibverbs1),
    UCX's ib module crashed every process that had made an agent, at exit (SIGSEGV after its
    last line: pytest, `datadist info`, the benchmark). Two agents (the core's owner and
    reader), a transfer's worth of use, then a plain exit: status 0."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "UCX_MODULES"}
    proc = subprocess.run([sys.executable, "-c", EXIT_CHECK], capture_output=True, text=True,
                          timeout=60, env=env)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert "UCX" in proc.stdout
