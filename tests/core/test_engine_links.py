"""The core's link lifecycle (NativeEngine): unlink against a transfer in flight, force,
relink. A transfer in flight is a pull from a silent owner (datadist.testing.fakes), which
holds the link until its deadline."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import numpy as np
import pytest

from datadist.core.config import EngineConfig
from datadist.core.errors import BrokenLink, Busy, LinkFailed, NotLinked
from datadist.core.layout import Geometry, every_tensor, plan_slot
from datadist.core.native import NativeEngine
from datadist.testing.fakes import SilentOwner
from datadist.wire import protocol as p

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def pair():
    owner = NativeEngine(EngineConfig(cluster_id=1, role=1, listen=("127.0.0.1", 0)))
    puller = NativeEngine(EngineConfig(cluster_id=2, role=2, transport="tcp"))
    yield owner, puller
    puller.close()
    owner.close()


def _link(owner: NativeEngine, puller: NativeEngine):
    host, port = owner.listen_address
    return puller.link(1, host, port, 2.0)


SILENT = 9


class _Tap:
    """A connection of the silent owner that notes each request it reads."""

    def __init__(self, conn: socket.socket, seen: threading.Event) -> None:
        self._conn, self._seen, self._decoder = conn, seen, p.FrameDecoder()

    def recv(self, n: int) -> bytes:
        data = self._conn.recv(n)
        for _, msg in self._decoder.feed(data):
            if not isinstance(msg, (p.Hello, p.Ping)):
                self._seen.set()
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


class _WatchedSilentOwner(SilentOwner):
    """A SilentOwner whose ``request_seen`` is set once a request (not HELLO, not PING) came:
    from then on the pull is in flight at the owner, not still on its way."""

    def __init__(self, cluster_id: int) -> None:
        self.request_seen = threading.Event()
        super().__init__(cluster_id)

    def _serve(self, conn: socket.socket) -> None:
        super()._serve(_Tap(conn, self.request_seen))  # type: ignore[arg-type]
# A transfer its link broke under: the core says LinkFailed (the Python engine said BrokenLink;
# both LLM_LINK_FAILED), or the next one found no link (NotLinked).
BROKEN = (BrokenLink, LinkFailed, NotLinked)


def _in_flight(puller: NativeEngine, owner: _WatchedSilentOwner, seconds: float
               ) -> tuple[threading.Thread, list[BaseException], np.ndarray]:
    """Links ``puller`` to the silent ``owner`` and starts a pull from it (in flight until
    ``seconds`` pass or the link breaks); returns its thread, its errors and its buffer."""
    puller.link(SILENT, *owner.address, 2.0)
    dst = np.zeros(4096, np.uint8)
    entry = puller.register(Geometry(1, 4096, 1), [dst.ctypes.data], placement=0)
    plan = plan_slot(entry.geometry, 0, every_tensor(1))
    errors: list[BaseException] = []
    started = threading.Event()

    def pull() -> None:
        started.set()
        try:
            puller.pull(SILENT, p.KeyRef(p.KeyKind.CACHE_ID, 1, 0), 0, plan, entry.cache_id,
                        seconds)
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            errors.append(e)

    t = threading.Thread(target=pull)
    t.start()
    assert started.wait(5)
    # the request is out: the pull waits for the owner
    assert owner.request_seen.wait(5), "the pull's request never reached the owner"
    return t, errors, dst


def test_unlink_waits_for_the_transfer_then_reports_busy(pair) -> None:
    _, puller = pair
    with _WatchedSilentOwner(SILENT) as owner:
        t, errors, dst = _in_flight(puller, owner, 10.0)
        with pytest.raises(Busy):
            puller.unlink(SILENT, timeout=0.1)
        assert puller.get_link(SILENT).cluster_id == SILENT  # still up
        assert t.is_alive()  # and the transfer still in flight
        puller.unlink(SILENT, timeout=1.0, force=True)
        t.join(10)
        assert not t.is_alive()
    assert errors and isinstance(errors[0], BROKEN), errors
    with pytest.raises(NotLinked):
        puller.get_link(SILENT)
    assert not dst.any()


def _eventually(cond, seconds: float = 2.0) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return False


def test_force_unlink_breaks_a_transfer_in_flight(pair) -> None:
    owner, puller = pair
    n = 64 << 20
    src = np.ones(n, np.uint8)
    owner.register(Geometry(1, n, 1), [src.ctypes.data], placement=0)
    dst = np.zeros(n, np.uint8)
    entry = puller.register(Geometry(1, n, 1), [dst.ctypes.data], placement=0)
    _link(owner, puller)
    plan = plan_slot(entry.geometry, 0, every_tensor(1))
    errors: list[BaseException] = []
    started = threading.Event()

    def pull() -> None:
        started.set()
        try:
            for _ in range(50):
                puller.pull(1, p.KeyRef(p.KeyKind.CACHE_ID, 1, 0), 0, plan, entry.cache_id, 5.0)
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            errors.append(e)

    t = threading.Thread(target=pull)
    t.start()
    started.wait()
    puller.unlink(1, timeout=1.0, force=True)
    t.join(10)
    assert not t.is_alive()
    # Either the pulls in flight broke, or the next one found no link: never a hang.
    assert errors and isinstance(errors[0], BROKEN), errors
    _link(owner, puller)  # and a fresh link works
    dst[:] = 0
    puller.pull(1, p.KeyRef(p.KeyKind.CACHE_ID, 1, 0), 0, plan, entry.cache_id, 5.0)
    assert dst.all()


def test_unlink_unknown_cluster(pair) -> None:
    _, puller = pair
    with pytest.raises(NotLinked):
        puller.unlink(7, timeout=0.1)


def test_a_pull_waiting_behind_another_transfer_is_link_busy(pair) -> None:
    _, puller = pair
    with _WatchedSilentOwner(SILENT) as owner:
        t, _, _ = _in_flight(puller, owner, 10.0)  # holds the link past our deadline
        dst = np.zeros(4096, np.uint8)
        entry = puller.register(Geometry(1, 4096, 1), [dst.ctypes.data], placement=0)
        plan = plan_slot(entry.geometry, 0, every_tensor(1))
        with pytest.raises(Busy):
            puller.pull(SILENT, p.KeyRef(p.KeyKind.CACHE_ID, 1, 0), 0, plan, entry.cache_id,
                        0.2)
        assert t.is_alive()
        puller.unlink(SILENT, timeout=1.0, force=True)
        t.join(10)
    assert not dst.any()


def test_a_plan_beyond_the_registered_cache_is_refused_locally(pair) -> None:
    """Whatever plan the caller builds (say from a CacheDesc changed after registering), the
    engine never writes past the cache as registered."""
    owner, puller = pair
    src = np.ones(4 * 16, np.uint8)
    owner.register(Geometry(1, 4 * 16, 4), [src.ctypes.data], placement=0)
    buf = np.zeros(64, np.uint8)  # the registered 16 bytes, then guard bytes
    entry = puller.register(Geometry(1, 16, 1), [buf.ctypes.data], placement=0)
    _link(owner, puller)
    bigger = Geometry(1, 64, 4)  # what a changed desc would claim
    plan = plan_slot(bigger, 3, every_tensor(1))
    from datadist.core.errors import InvalidArgument

    with pytest.raises(InvalidArgument):
        puller.pull(1, p.KeyRef(p.KeyKind.CACHE_ID, 1, 0), 0, plan, entry.cache_id, 2.0)
    assert not buf.any()
