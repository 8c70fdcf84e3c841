"""The TCP Channel's I/O: read-ahead buffer, frames with raw bytes, deadlines on blocking sockets.

A Channel reads frames through a small buffer, so raw bytes that follow a frame may already
sit in it when ``recv_iov`` runs; they must land in the right spans, and whatever follows them
must still parse. Sockets are blocking with timeouts kept inside each deadline, so a silent
peer must still end in Timeout. Each test uses a real loopback TCP pair.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from datadist.core.errors import BrokenLink, Timeout
from datadist.transport import iov as iovmod
from datadist.transport.channel import RECV_BUFFER, Channel
from datadist.transport.channel import tune as _tune
from datadist.wire import protocol as p

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def pair() -> Iterator[tuple[Channel, Channel]]:
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(1)
    client = socket.create_connection(ls.getsockname(), timeout=5)
    server, _ = ls.accept()
    ls.close()
    for s in (client, server):
        _tune(s)
    a, b = Channel(client, "client"), Channel(server, "server")
    yield a, b
    a.close()
    b.close()


def soon(seconds: float = 5.0) -> float:
    return time.monotonic() + seconds


def spans(buf: np.ndarray, cuts: list[tuple[int, int]]) -> np.ndarray:
    """An iovec array of (offset, length) pieces of ``buf``."""
    base = buf.ctypes.data
    return iovmod.make_iov(np.array([base + o for o, _ in cuts], dtype=np.uint64),
                           np.array([n for _, n in cuts], dtype=np.uint64))


def test_frame_then_raw_bytes_then_frame_in_one_segment(pair: tuple[Channel, Channel]) -> None:
    """ReadData, its bytes and a following Pong arrive together: the bytes land in three
    spans (the read-ahead covers some whole spans and part of one) and the Pong still parses."""
    a, b = pair
    src = np.arange(5000, dtype=np.uint8)
    dst = np.zeros(8000, dtype=np.uint8)
    cuts = [(0, 7), (100, 1993), (4000, 3000)]
    b.send_iov(spans(src, [(0, 5000)]), soon(), head=p.ReadData(5000), request_id=9)
    b.send(p.Pong(77), soon(), 10)
    rid, msg = a.recv(soon())
    assert (rid, msg) == (9, p.ReadData(5000))
    a.recv_iov(spans(dst, cuts), soon())
    assert dst[:7].tolist() == src[:7].tolist()
    assert np.array_equal(dst[100:2093], src[7:2000])
    assert np.array_equal(dst[4000:7000], src[2000:5000])
    assert not dst[7:100].any() and not dst[2093:4000].any() and not dst[7000:].any()
    assert a.recv(soon()) == (10, p.Pong(77))


def test_single_span_partly_read_ahead(pair: tuple[Channel, Channel]) -> None:
    """A span longer than the read-ahead: its head comes from the buffer, its tail from the
    socket, with the sender still writing after the receiver started."""
    a, b = pair
    n = 3 * RECV_BUFFER + 123
    src = np.random.default_rng(1).integers(0, 256, n, dtype=np.uint8)
    dst = np.zeros(n, dtype=np.uint8)
    b.send(p.ReadData(n), soon(), 1)
    b.send_iov(spans(src, [(0, 1000)]), soon())
    got = a.recv(soon())
    assert got == (1, p.ReadData(n))
    t = threading.Thread(target=b.send_iov, args=(spans(src, [(1000, n - 1000)]), soon()))
    t.start()
    a.recv_iov(spans(dst, [(0, n)]), soon())
    t.join()
    assert np.array_equal(dst, src)


def test_read_ahead_ending_inside_a_later_span(pair: tuple[Channel, Channel]) -> None:
    """The buffered bytes cover the first span and part of the second; the second's tail
    and the third span come from the socket afterwards."""
    a, b = pair
    src = np.random.default_rng(6).integers(0, 256, 3000, dtype=np.uint8)
    dst = np.zeros(6000, dtype=np.uint8)
    b.send_iov(spans(src, [(0, 1500)]), soon(), head=p.ReadData(3000), request_id=4)
    time.sleep(0.05)  # let the frame and the first 1500 bytes arrive as one read
    assert a.recv(soon()) == (4, p.ReadData(3000))
    assert a._rend - a._rpos == 1500
    b.send_iov(spans(src, [(1500, 1500)]), soon())
    a.recv_iov(spans(dst, [(0, 1000), (2000, 1000), (4000, 1000)]), soon())
    assert np.array_equal(dst[:1000], src[:1000])
    assert np.array_equal(dst[2000:3000], src[1000:2000])
    assert np.array_equal(dst[4000:5000], src[2000:3000])
    assert not dst[1000:2000].any() and not dst[3000:4000].any() and not dst[5000:].any()


def test_many_tiny_spans(pair: tuple[Channel, Channel]) -> None:
    a, b = pair
    count, width = 3000, 5
    src = np.random.default_rng(2).integers(0, 256, count * width, dtype=np.uint8)
    dst = np.zeros(count * 2 * width, dtype=np.uint8)
    b.send_iov(spans(src, [(0, len(src))]), soon(), head=p.ReadData(len(src)), request_id=3)
    assert a.recv(soon()) == (3, p.ReadData(len(src)))
    a.recv_iov(spans(dst, [(2 * width * i, width) for i in range(count)]), soon())
    assert np.array_equal(dst.reshape(count, 2 * width)[:, :width].reshape(-1), src)
    assert not dst.reshape(count, 2 * width)[:, width:].any()


def test_frame_bigger_than_the_buffer(pair: tuple[Channel, Channel]) -> None:
    """A Read naming 20000 spans is a 320 KB payload: read past the buffer, intact."""
    a, b = pair
    n = 20000
    offsets = np.arange(n, dtype=np.uint64) * np.uint64(4096)
    lengths = np.full(n, 512, dtype=np.uint64)
    msg = p.Read(p.KeyRef(p.KeyKind.BLOCKS_KEY, 0, 7, 0), 4096, p.ReadFlags.NONE,
                 np.array([0, 1], dtype=np.uint32), offsets, lengths)
    assert len(p.encode(msg)) > 4 * RECV_BUFFER
    t = threading.Thread(target=a.send, args=(msg, soon(), 5))
    t.start()
    rid, got = b.recv(soon())
    t.join()
    assert rid == 5 and isinstance(got, p.Read)
    assert np.array_equal(got.offsets, offsets) and np.array_equal(got.lengths, lengths)
    assert got.tensors.tolist() == [0, 1] and got.key == msg.key


def test_bulk_transfer_in_both_directions(pair: tuple[Channel, Channel]) -> None:
    """Megabytes through blocking writev / recvmsg(MSG_WAITALL), over 2000 spans (two
    IOV_MAX batches on Linux)."""
    a, b = pair
    count, width = 2000, 4096
    src = np.random.default_rng(3).integers(0, 256, count * width, dtype=np.uint8)
    order = np.random.default_rng(4).permutation(count)
    dst = np.zeros_like(src)
    send_spans = spans(src, [(i * width, width) for i in range(count)])
    recv_spans = spans(dst, [(int(j) * width, width) for j in order])
    t = threading.Thread(target=b.send_iov, args=(send_spans, soon()))
    t.start()
    a.recv_iov(recv_spans, soon())
    t.join()
    assert np.array_equal(dst.reshape(count, width)[order], src.reshape(count, width))
    back = np.zeros_like(src)
    t = threading.Thread(target=a.send_iov, args=(spans(dst, [(0, len(dst))]), soon()))
    t.start()
    b.recv_iov(spans(back, [(0, len(back))]), soon())
    t.join()
    assert np.array_equal(back, dst)


def test_silent_peer_times_out_and_closes(pair: tuple[Channel, Channel]) -> None:
    a, _ = pair
    with pytest.raises(Timeout):
        a.recv(time.monotonic() + 0.2)
    assert a.closed
    with pytest.raises(BrokenLink):
        a.recv(soon())


def test_silent_peer_times_out_mid_raw_bytes(pair: tuple[Channel, Channel]) -> None:
    a, b = pair
    dst = np.zeros(1 << 20, dtype=np.uint8)
    b.send(p.ReadData(len(dst)), soon(), 1)
    b.send_raw(np.ones(1000, dtype=np.uint8), soon())
    a.recv(soon())
    with pytest.raises(Timeout):
        a.recv_iov(spans(dst, [(0, len(dst))]), time.monotonic() + 0.3)
    assert a.closed
    assert dst[:1000].tolist() == [1] * 1000


def test_short_timeout_left_armed_does_not_cut_a_later_wait(
        pair: tuple[Channel, Channel]) -> None:
    """A call with little time left arms a short socket timeout; a later call with a long
    deadline must wait through it (re-arming) until the peer answers."""
    a, b = pair
    a._arm(time.monotonic() + 0.01)
    timer = threading.Timer(0.3, b.send, args=(p.Ping(5), soon(), 2))
    timer.start()
    assert a.recv(soon()) == (2, p.Ping(5))
    timer.join()


def test_peer_closing_mid_transfer_is_broken_link(pair: tuple[Channel, Channel]) -> None:
    a, b = pair
    dst = np.zeros(100_000, dtype=np.uint8)
    b.send(p.ReadData(len(dst)), soon(), 1)
    b.send_raw(np.ones(5000, dtype=np.uint8), soon())
    a.recv(soon())
    b.close()
    with pytest.raises(BrokenLink):
        a.recv_iov(spans(dst, [(0, len(dst))]), soon())
    assert a.closed


def test_peer_gone_sees_read_ahead(pair: tuple[Channel, Channel]) -> None:
    """Bytes already buffered count as 'something to read' on an idle channel."""
    a, b = pair
    assert not a.peer_gone()
    b.send(p.Pong(1), soon(), 1)
    b.send(p.Pong(2), soon(), 2)
    time.sleep(0.05)
    assert a.recv(soon()) == (1, p.Pong(1))  # the second frame now sits in the buffer
    assert a.peer_gone()
    assert a.recv(soon()) == (2, p.Pong(2))


def test_nonblocking_sockets_still_work_without_arm() -> None:
    """sock_readv / sock_writev without an arm callback poll a non-blocking socket."""
    x, y = socket.socketpair()
    try:
        for s in (x, y):
            s.setblocking(False)
        n = 4 << 20  # more than the socket buffers: the writer must wait for the reader
        src = np.random.default_rng(5).integers(0, 256, n, dtype=np.uint8)
        dst = np.zeros(n, dtype=np.uint8)
        t = threading.Thread(target=iovmod.sock_writev,
                             args=(x.fileno(), spans(src, [(0, n)]), soon()))
        t.start()
        iovmod.sock_readv(y.fileno(), spans(dst, [(0, n // 2), (n // 2, n - n // 2)]), soon())
        t.join()
        assert np.array_equal(dst, src)
        with pytest.raises(Timeout):
            iovmod.sock_readv(y.fileno(), spans(dst, [(0, 10)]), time.monotonic() + 0.1)
    finally:
        x.close()
        y.close()


@pytest.mark.parametrize("chunk", [100, 4096])
def test_send_batches_cover_the_stream_in_order(monkeypatch: pytest.MonkeyPatch,
                                                chunk: int) -> None:
    """Sends are cut into calls of about SEND_CHUNK bytes: big spans split, small ones
    grouped, every byte once and in order, no call above IOV_MAX spans or 2 x SEND_CHUNK."""
    monkeypatch.setattr(iovmod, "SEND_CHUNK", chunk)
    rng = np.random.default_rng(7)
    lengths = rng.integers(1, 3 * chunk, 2500).astype(np.uint64)
    bases = np.cumsum(lengths + np.uint64(13)) - lengths  # gaps between spans
    iov = iovmod.make_iov(bases, lengths)
    cut, bounds = iovmod._send_batches(iov)
    bounds = list(bounds)
    assert bounds[0] == 0 and bounds[-1] == len(cut) and bounds == sorted(set(bounds))
    for a, b in zip(bounds, bounds[1:], strict=False):
        assert b - a <= iovmod.IOV_MAX
        assert int(cut[a:b, 1].sum()) <= 2 * chunk
    assert int(cut[:, 1].max()) <= chunk
    # the cut spans, read in order, name exactly the original bytes
    expect = np.concatenate([np.arange(b, b + n, dtype=np.uint64)
                             for b, n in iov.tolist()])
    got = np.concatenate([np.arange(b, b + n, dtype=np.uint64) for b, n in cut.tolist()])
    assert np.array_equal(got, expect)


def test_many_small_spans_in_several_batches_with_partial_calls() -> None:
    """Thousands of 4 KiB-ish spans (several IOV_MAX batches) over non-blocking sockets whose
    buffers fill mid-batch: every partial call resumes at the right byte, the bytes land in
    the scattered spans in order, and the caller's iovec arrays are left as they were."""
    x, y = socket.socketpair()
    try:
        for s in (x, y):
            s.setblocking(False)
        rng = np.random.default_rng(11)
        count = 3 * iovmod.IOV_MAX + 17
        lengths = rng.integers(1, 4097, count)
        total = int(lengths.sum())
        gaps = 7
        src = rng.integers(0, 256, total + gaps * count, dtype=np.uint8)
        dst = np.zeros_like(src)
        offs = np.cumsum(lengths + gaps) - lengths - gaps
        cuts = list(zip(offs.tolist(), lengths.tolist(), strict=True))
        order = rng.permutation(count)  # the destination spans scattered in another order
        dcuts = [cuts[i] for i in order]
        send_iov, recv_iov = spans(src, cuts), spans(dst, dcuts)
        before = (send_iov.copy(), recv_iov.copy())
        t = threading.Thread(target=iovmod.sock_writev, args=(x.fileno(), send_iov, soon()))
        t.start()
        iovmod.sock_readv(y.fileno(), recv_iov, soon())
        t.join()
        stream = np.concatenate([src[o : o + n] for o, n in cuts])
        landed = np.concatenate([dst[o : o + n] for o, n in dcuts])
        assert np.array_equal(landed, stream)
        assert np.array_equal(send_iov, before[0]) and np.array_equal(recv_iov, before[1])
    finally:
        x.close()
        y.close()


def test_read_ahead_ending_inside_one_of_many_spans(pair: tuple[Channel, Channel]) -> None:
    """A frame and the start of its raw bytes arrive together; the read-ahead ends inside
    span k of thousands: spans before k are filled from the buffer, the rest of span k and
    the spans after it from the socket."""
    a, b = pair
    block, count = 1000, 3000  # the read-ahead (up to RECV_BUFFER) ends mid-span
    src = np.random.default_rng(3).integers(0, 256, block * count, dtype=np.uint8)
    dst = np.zeros(2 * block * count, dtype=np.uint8)
    dcuts = [(2 * i * block, block) for i in range(count)]  # gaps between destination spans
    b.send_iov(spans(src, [(0, block * count)]), soon(), head=p.ReadData(block * count),
               request_id=4)
    rid, msg = a.recv(soon())
    assert (rid, msg) == (4, p.ReadData(block * count))
    assert a._rend - a._rpos > block  # some raw bytes were read ahead
    a.recv_iov(spans(dst, dcuts), soon())
    got = dst.reshape(count, 2 * block)[:, :block].reshape(-1)
    assert np.array_equal(got, src) and not dst.reshape(count, 2 * block)[:, block:].any()


def test_local_copy_moves_each_span_and_refuses_unequal_lists() -> None:
    src = np.arange(64, dtype=np.uint8)
    dst = np.zeros(64, dtype=np.uint8)
    iovmod.local_copy(spans(dst, [(40, 8), (0, 16)]), spans(src, [(0, 8), (20, 16)]))
    assert np.array_equal(dst[40:48], src[0:8]) and np.array_equal(dst[0:16], src[20:36])
    assert not dst[16:40].any() and not dst[48:].any()
    with pytest.raises(ValueError):
        iovmod.local_copy(spans(dst, [(0, 8)]), spans(src, [(0, 4), (4, 4)]))
    iovmod.local_copy(spans(dst, [])[:0], spans(src, [])[:0])  # nothing to do
