"""Issued pulls pipelined on one link (``Session::Submit``, ``Link::ReadPipelined``): layer-wise
``pull_blocks_async`` calls issued in a row over TCP have their READs in flight together, while
each handle keeps its own outcome and deadline.

The puller links through a relay (Python threads, in this process) that reads the wire as it
forwards it and counts the READs the owner has been sent and not yet answered when an answer
begins: 1 at most while a link's pulls go one round trip after another (the code before),
several once they are pipelined. The relay can also cut the connection after some answers (a
peer that dies mid-batch) or stop forwarding answers (a stalled peer).

* the pulls land their bytes, with several READs in flight;
* an ERROR for one pull (a key the owner does not have) fails that handle only;
* a peer that dies mid-batch fails the rest with LINK_FAILED, and no handle hangs;
* a stalled peer: every handle ends by its own deadline with TIMEOUT;
* a blocking pull on the same link goes between two windows of a long queue of issued pulls,
  not after the whole queue.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import datadist as llm
from datadist.api.cache_manager import CacheManager
from datadist.core.config import EngineConfig
from datadist.core.errors import Code
from datadist.core.native import NativeEngine
from datadist.wire import protocol as p

pytestmark = pytest.mark.timeout(60)

OWNER_ID, PULLER_ID, MODEL = 9401, 9402, 4
LAYERS, BLOCKS, BLOCK = 12, 4, 16 << 10  # a layer: K and V, 4 blocks of 16 KiB each


class Relay:
    """A TCP relay to ``target`` that parses what it forwards: ``max_waiting`` is the most
    READs forwarded to the owner and not yet answered (READ_DATA and its bytes, or ERROR,
    passed back) at any one time. ``die_after``: once that many answers went through, the
    owner's side ends the connection and the listener closes (a reconnect is refused).
    ``stall_after``: after that many answers nothing more is forwarded to the puller (the
    chunk that ends an answer may carry the next one's start). ``answer_delay``: seconds held
    after forwarding a chunk that ends an answer (a slow owner)."""

    def __init__(self, target: tuple[str, int], die_after: int = -1,
                 stall_after: int = -1, answer_delay: float = 0.0) -> None:
        self.target, self.die_after, self.stall_after = target, die_after, stall_after
        self.answer_delay = answer_delay
        self.max_waiting = self.waiting = self.answered = self.reads = 0
        self._lock = threading.Lock()
        self._lsock = socket.create_server(("127.0.0.1", 0))
        self.address: tuple[str, int] = self._lsock.getsockname()[:2]
        self._socks: list[socket.socket] = []
        self._closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                a, _ = self._lsock.accept()
            except OSError:
                return
            b = socket.create_connection(self.target)
            self._socks += [a, b]
            threading.Thread(target=self._up, args=(a, b), daemon=True).start()
            threading.Thread(target=self._down, args=(b, a), daemon=True).start()

    def _up(self, src: socket.socket, dst: socket.socket) -> None:
        dec = p.FrameDecoder()
        with contextlib.suppress(OSError):
            while chunk := src.recv(1 << 16):
                for _, msg in dec.feed(chunk):
                    if isinstance(msg, p.Read):
                        with self._lock:
                            self.reads += 1
                            self.waiting += 1
                            self.max_waiting = max(self.max_waiting, self.waiting)
                dst.sendall(chunk)
        self._shut(src, dst)

    def _down(self, src: socket.socket, dst: socket.socket) -> None:
        dec = p.FrameDecoder()
        with contextlib.suppress(OSError):
            while chunk := src.recv(1 << 16):
                while self.stall_after >= 0 and self.answered >= self.stall_after \
                        and not self._closed.is_set():
                    time.sleep(0.01)
                ends = 0
                for _, msg in dec.feed(chunk):
                    if isinstance(msg, (bytes, p.Error)):  # an answer ended
                        ends += 1
                        with self._lock:
                            self.waiting -= 1
                            self.answered += 1
                dst.sendall(chunk)
                if ends and self.answer_delay:
                    time.sleep(self.answer_delay)
                if self.die_after >= 0 and self.answered >= self.die_after:
                    # The owner's end goes: the puller reads what was sent, then the end of
                    # the stream (closing its socket with READs unread would reset it, and
                    # the answers not read yet would be lost with it); no reconnect.
                    self._lsock.close()
                    src.close()
                    dst.shutdown(socket.SHUT_WR)
                    return
        self._shut(src, dst)

    @staticmethod
    def _shut(*socks: socket.socket) -> None:
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._lsock.close()
        for s in self._socks:
            self._shut(s)
            with contextlib.suppress(OSError):
                s.close()


class LayerPair:
    """An owner with a blocks cache of LAYERS layers (random bytes) and a TCP puller with a
    zeroed one of the same shape, linked through a :class:`Relay`."""

    def __init__(self, timeout: float = 5.0, **relay: Any) -> None:
        self.owner = NativeEngine(EngineConfig(cluster_id=OWNER_ID, role=1,
                                               listen=("127.0.0.1", 0), sync_timeout=5.0))
        self.puller = NativeEngine(EngineConfig(cluster_id=PULLER_ID, role=2,
                                                sync_timeout=timeout, transport="tcp"))
        desc = llm.CacheDesc(2 * LAYERS, [BLOCKS, BLOCK], llm.DataType.DT_UINT8,
                             llm.Placement.HOST)
        self.src = np.random.default_rng(7).integers(0, 256, (2 * LAYERS, BLOCKS * BLOCK),
                                                     dtype=np.uint8)
        self.dst = np.zeros_like(self.src)
        CacheManager(self.owner).register_blocks_cache(
            desc, [int(self.src[t].ctypes.data) for t in range(2 * LAYERS)],
            llm.BlocksCacheKey(OWNER_ID, MODEL))
        self.cm = CacheManager(self.puller)
        self.cache = self.cm.register_blocks_cache(
            desc, [int(self.dst[t].ctypes.data) for t in range(2 * LAYERS)],
            llm.BlocksCacheKey(PULLER_ID, MODEL))
        self.relay = Relay(self.owner.listen_address, **relay)
        self.puller.link(OWNER_ID, *self.relay.address, 5.0)

    def issue(self, bad: int = -1) -> list[Any]:
        """Every layer's pull_blocks_async, issued in a row (layer ``bad`` by a key the owner
        does not have)."""
        blocks = list(range(BLOCKS))
        return [self.cm.pull_blocks_async(
            llm.BlocksCacheKey(OWNER_ID, MODEL + 1 if i == bad else MODEL), self.cache, blocks,
            blocks, src_layer_range=range(i, i + 1), dst_layer_range=range(i, i + 1))
            for i in range(LAYERS)]

    def landed(self, layer: int) -> bool:
        return np.array_equal(self.dst[2 * layer:2 * layer + 2], self.src[2 * layer:2 * layer + 2])

    def close(self) -> None:
        self.puller.close()
        self.owner.close()
        self.relay.close()


@pytest.fixture
def make_pair() -> Iterator[Any]:
    made: list[LayerPair] = []

    def make(**kw: Any) -> LayerPair:
        made.append(LayerPair(**kw))
        return made[-1]

    yield make
    for pr in made:
        pr.close()


def outcome(h: Any, timeout: float = 10.0) -> Code | None:
    """The handle's status code once it ended (None: success); fails if it does not end."""
    try:
        h.wait(timeout)
    except TimeoutError:
        pytest.fail("a handle never ended")
    except Exception:  # noqa: BLE001 - its code is what the test asserts
        return Code(int(h.status))
    return None


def test_issued_layer_pulls_are_in_flight_together(make_pair) -> None:
    pr = make_pair()
    handles = pr.issue()
    assert [outcome(h) for h in handles] == [None] * LAYERS
    assert all(pr.landed(i) for i in range(LAYERS))
    assert pr.relay.reads == LAYERS
    assert pr.relay.max_waiting >= 2, "the link's pulls went one round trip after another"


def test_an_error_in_the_middle_fails_only_that_handle(make_pair) -> None:
    pr = make_pair()
    handles = pr.issue(bad=5)
    got = [outcome(h) for h in handles]
    assert got[5] == Code.KV_CACHE_NOT_EXIST
    assert got[:5] + got[6:] == [None] * (LAYERS - 1)
    assert all(pr.landed(i) for i in range(LAYERS) if i != 5)
    assert not pr.dst[10:12].any()
    assert pr.relay.max_waiting >= 2, "the link's pulls went one round trip after another"


def test_a_peer_that_dies_mid_batch_fails_the_rest_and_none_hangs(make_pair) -> None:
    pr = make_pair(die_after=3)
    t0 = time.monotonic()
    handles = pr.issue()
    got = [outcome(h) for h in handles]
    assert time.monotonic() - t0 < 4.0
    assert got[:3] == [None] * 3
    assert all(pr.landed(i) for i in range(3))
    assert got[3:] == [Code.LINK_FAILED] * (LAYERS - 3)
    assert pr.relay.max_waiting >= 2, "the link's pulls went one round trip after another"


def test_a_stalled_peer_times_every_handle_out_by_its_own_deadline(make_pair) -> None:
    pr = make_pair(timeout=1.0, stall_after=1)
    t0 = time.monotonic()
    handles = pr.issue()
    got = [outcome(h) for h in handles]
    took = time.monotonic() - t0
    assert got[0] is None and pr.landed(0)
    assert got[1:] == [Code.TIMEOUT] * (LAYERS - 1)
    assert took < 2.5, f"the handles ended {took:.2f} s after they were issued (deadline 1 s)"
    assert pr.relay.max_waiting >= 2, "the link's pulls went one round trip after another"


def test_a_blocking_pull_goes_between_the_windows_of_issued_pulls(make_pair) -> None:
    # 240 issued pulls queued on one link behind a slow owner (4 ms an answer: about a second
    # in all); a blocking pull made once they flow waits for the window in flight (at most
    # 16 READs), not for the whole queue, and every pull still lands.
    pr = make_pair(answer_delay=0.004)
    handles = [h for _ in range(20) for h in pr.issue()]
    t0 = time.monotonic()
    while pr.relay.answered < 2:
        assert time.monotonic() - t0 < 5.0, "the issued pulls never started"
        time.sleep(0.001)
    blocks = list(range(BLOCKS))
    pr.dst[0:2] = 0
    pr.cm.pull_blocks(llm.BlocksCacheKey(OWNER_ID, MODEL), pr.cache, blocks, blocks,
                      src_layer_range=range(0, 1), dst_layer_range=range(0, 1))
    answered = pr.relay.answered
    assert pr.landed(0)
    assert answered < len(handles) // 2, (
        f"the blocking pull waited for {answered - 1} of {len(handles)} issued pulls")
    assert [outcome(h) for h in handles] == [None] * len(handles)
    assert all(pr.landed(i) for i in range(LAYERS))
