"""Unit and property tests of the sans-IO wire protocol (datadist.wire.protocol).

Round trips of every message, the incremental FrameDecoder under any chunking, and the
decoder's one promise about hostile input: it either decodes or raises RemoteProtocolError.
Malformed frames are built by hand with struct, independently of the encoder.
"""

from __future__ import annotations

import contextlib
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from datadist.core.errors import Code, LocalProtocolError, RemoteProtocolError
from datadist.wire import protocol as p

U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1


def frame(mtype: int, payload: bytes, *, magic: bytes = b"DD", version: int = 1,
          request_id: int = 0, length: int | None = None) -> bytes:
    """A frame built by hand: the header layout of the spec, not the module's Struct."""
    n = len(payload) if length is None else length
    return magic + bytes([version, mtype]) + struct.pack("<II", request_id, n) + payload


def u32(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.uint32)


def u64(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.uint64)


BOOT = bytes(range(16))

EXAMPLES: list[p.Message] = [
    p.Hello(7, 1, 4242, 4026531836, BOOT, features=3, proof=b"secret"),
    p.Hello(0, 0, 0, 0, b"\0" * 16),
    p.Welcome(U64_MAX, 2, U32_MAX, U64_MAX, BOOT, features=U32_MAX, proof=b"x" * 65535),
    p.Error(int(Code.PARAM_INVALID), "span outside the cache"),
    p.Error(-1, "unknown ✓ unicode"),
    p.Read(p.KeyRef(p.KeyKind.CACHE_KEY, 5, 6, U64_MAX), 0, p.ReadFlags.NONE,
           u32(0, 1), u64(0, 64), u64(64, 32)),
    p.Read(p.KeyRef(p.KeyKind.BLOCKS_KEY, 0, 9, 0), 4096, p.ReadFlags.GRANT,
           u32(U32_MAX), u64(U64_MAX), u64(U64_MAX)),
    p.Read(p.KeyRef(p.KeyKind.CACHE_ID, 1, 0, 0), 0, p.ReadFlags.NONE, u32(), u64(), u64()),
    p.Write(p.KeyRef(p.KeyKind.CACHE_ID, 3, 1, 0), 0, 0, u32(2, 3), u64(8), u64(16)),
    p.ReadData(0),
    p.ReadData(U64_MAX),
    p.Grant(99, u64(4096, 8192, U64_MAX)),
    p.Grant(0, u64()),
    p.Release(12, True),
    p.Release(U64_MAX, False),
    p.Ping(1),
    p.Pong(U64_MAX),
    p.Bye(),
    p.Ok(),
]
if hasattr(p, "ShmGrant"):  # the same-host shared-memory answer, where the protocol has it
    EXAMPLES.append(p.ShmGrant(3, np.array([5, -1], "<i4"), u64(1, U64_MAX), u64(0, 4096)))
EXAMPLES += [p.Auth(b"\x01" * 32), p.Checksum(0xFFFFFFFF, U64_MAX)]
EXAMPLES += [p.StatsRequest(), p.Stats(b'{"total":{}}'), p.Stats(b"")]  # a peer's metrics
EXAMPLES += [  # whole-cache leases on the local channel
    p.LeaseRequest(p.KeyRef(p.KeyKind.CACHE_ID, U64_MAX, 3)),
    p.LeaseRequest(p.KeyRef(p.KeyKind.BLOCKS_KEY, 0, 7), int(p.ReadFlags.SHM)),
    p.CacheLease(1, 4096 * 8, 8, True, U64_MAX, 5, U64_MAX, u64(1 << 40, U64_MAX),
                 np.array([5, 6], "<i4"), u64(1, 2), u64(0, 4096)),
    p.CacheLease(U64_MAX, 1, 1, False, 0, -1, 0, u64(4096), np.empty(0, "<i4"), u64(), u64()),
]
EXAMPLES += [  # the NIXL data path's messages
    p.NixlMdRequest(),
    p.NixlMd(b"datadist-7-42-abcd", U64_MAX, b"\x00md" * 300),
    p.NixlMd(b"", 0, b""),
    p.NixlRead(p.KeyRef(p.KeyKind.CACHE_KEY, 5, 6, 7), 1024, p.ReadFlags.CHECKSUM,
               u32(0, 3), u64(0, 64), u64(64, 32), layout=U64_MAX),
    p.NixlGrant(5, b"agent", 3, p.MEM_VRAM, U32_MAX, u64(4096, U64_MAX)),
    p.NixlGrant(U64_MAX, b"", 0, p.MEM_DRAM, 0, u64()),
    p.NixlWrite(p.KeyRef(p.KeyKind.ADDRESS, 0, 0, 0), 0, 0, u32(0), u64(1 << 40), u64(64)),
    p.NixlLease(p.KeyRef(p.KeyKind.BLOCKS_KEY, 0, U64_MAX, 0), 32768),
    p.NixlLease(p.KeyRef(p.KeyKind.CACHE_ID, 9, 0, 0), 0),
    p.NixlLeased(7, b"agent", 2, p.MEM_VRAM, 3, True, 1 << 40, 4096, U32_MAX, U64_MAX,
                 u64(4096, U64_MAX)),
    p.NixlLeased(U64_MAX, b"", 0, p.MEM_DRAM, 0, False, 8, 8, 1, 0, u64(1)),
    p.NixlRevoke(U64_MAX),
]


def same(a: p.Message, b: p.Message) -> bool:
    """Message equality, arrays compared by value and dtype."""
    if type(a) is not type(b):
        return False
    for name in a.__dataclass_fields__:  # type: ignore[union-attr]
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, np.ndarray):
            if not isinstance(y, np.ndarray) or y.dtype != x.dtype or x.tolist() != y.tolist():
                return False
        elif x != y or type(x) is not type(y):
            return False
    return True


def test_every_message_type_has_an_example() -> None:
    assert {m.TYPE for m in EXAMPLES} == set(p.MsgType)


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: p.Message) -> None:
    data = p.encode(msg, request_id=77)
    head = p.decode_header(data[: p.HEADER_SIZE])
    assert head == p.FrameHeader(msg.TYPE, 77, len(data) - p.HEADER_SIZE)
    back = p.decode_payload(head.type, data[p.HEADER_SIZE :])
    assert same(back, msg), (back, msg)


def test_header_layout_matches_the_spec() -> None:
    data = p.encode(p.Ping(0x0102030405060708), request_id=0xAABBCCDD)
    assert data[:2] == b"DD"
    assert data[2] == p.VERSION == 1
    assert data[3] == p.MsgType.PING
    assert struct.unpack("<II", data[4:12]) == (0xAABBCCDD, 8)
    assert data[12:] == struct.pack("<Q", 0x0102030405060708)


def test_request_id_is_masked_to_u32() -> None:
    data = p.encode(p.Ok(), request_id=2**32 + 5)
    assert p.decode_header(data[:12]).request_id == 5


def test_read_arrays_are_fixed_little_endian_dtypes() -> None:
    msg = p.Read(p.KeyRef(p.KeyKind.CACHE_ID, 1, 0), 0, p.ReadFlags.NONE,
                 [0, 1], [1, 2], [3, 4])  # type: ignore[arg-type]
    back = p.decode_payload(p.MsgType.READ, p.encode_payload(msg))
    assert isinstance(back, p.Read)
    assert back.tensors.dtype == np.dtype("<u4")
    assert back.offsets.dtype == back.lengths.dtype == np.dtype("<u8")
    assert back.lengths.tolist() == [3, 4]


def test_error_message_is_capped() -> None:
    back = p.decode_payload(p.MsgType.ERROR, p.encode_payload(p.Error(1, "x" * 10000)))
    assert isinstance(back, p.Error) and back.message == "x" * 4096


class TestEncoderRefusesIllegalMessages:
    def test_boot_id_must_be_16_bytes(self) -> None:
        with pytest.raises(LocalProtocolError):
            p.encode(p.Hello(1, 1, 1, 1, b"short"))

    def test_offsets_and_lengths_must_pair(self) -> None:
        with pytest.raises(LocalProtocolError):
            p.encode(p.Read(p.KeyRef(p.KeyKind.CACHE_ID), 0, p.ReadFlags.NONE,
                            u32(0), u64(0, 1), u64(1)))

    def test_byte_field_limit(self) -> None:
        with pytest.raises(LocalProtocolError):
            p.encode(p.Hello(1, 1, 1, 1, BOOT, proof=b"x" * 65536))

    def test_payload_limit(self) -> None:
        big = np.zeros(p.MAX_PAYLOAD // 8, dtype=np.uint64)
        with pytest.raises(LocalProtocolError, match="exceeds"):
            p.encode(p.Grant(1, big))

    def test_not_a_message(self) -> None:
        with pytest.raises(LocalProtocolError):
            p.encode_payload("hello")  # type: ignore[arg-type]

    # What the decoder refuses from a peer, the encoder refuses to say (one rule per message
    # for both; the C++ codec likewise, cpp/tests/wire_test.cc).
    @pytest.mark.parametrize("msg", [
        p.Read(p.KeyRef(p.KeyKind.ADDRESS), 0, p.ReadFlags.NONE, u32(0), u64(0), u64(8)),
        p.Read(p.KeyRef(p.KeyKind.CACHE_ID, 1), 0, 16, u32(0), u64(0), u64(8)),  # type: ignore[arg-type]
        p.Write(p.KeyRef(p.KeyKind.CACHE_ID, 1), 0, 4, u32(0), u64(0), u64(8)),
        p.NixlRead(p.KeyRef(p.KeyKind.CACHE_ID, 1), 0, p.ReadFlags.GRANT, u32(0), u64(0), u64(8)),
        p.NixlWrite(p.KeyRef(p.KeyKind.CACHE_ID, 1), 0, 4, u32(0), u64(0), u64(8)),
        p.LeaseRequest(p.KeyRef(p.KeyKind.CACHE_KEY, 1)),
        p.LeaseRequest(p.KeyRef(p.KeyKind.CACHE_ID, 1), int(p.ReadFlags.GRANT)),
        p.CacheLease(1, 8, 0, False, 0, 3, 4, u64(1), np.empty(0, "<i4"), u64(), u64()),
        p.NixlGrant(1, b"", 0, 2, 0, u64()),
        p.NixlLeased(1, b"", 0, 2, 0, False, 8, 8, 1, 0, u64(1)),
    ], ids=lambda m: type(m).__name__)
    def test_what_the_decoder_refuses(self, msg: p.Message) -> None:
        with pytest.raises(LocalProtocolError):
            p.encode(msg)

    def test_release_ok_is_one_byte_zero_or_one(self) -> None:
        data = p.encode(p.Release(1, 2))  # type: ignore[arg-type]
        assert data[-1] == 1
        assert p.decode_payload(p.MsgType.RELEASE, data[12:]) == p.Release(1, True)

    def test_local_protocol_error_is_not_a_remote_one(self) -> None:
        assert not issubclass(LocalProtocolError, RemoteProtocolError)


# ------------------------------------------------------------------------------ FrameDecoder


def stream_of(msgs: list[p.Message]) -> tuple[bytes, list[tuple[int, object]]]:
    """Encode messages with their raw trailers; return the bytes and what must come out."""
    data = bytearray()
    want: list[tuple[int, object]] = []
    for i, msg in enumerate(msgs):
        data += p.encode(msg, request_id=i + 1)
        want.append((i + 1, msg))
        raw = b""
        if isinstance(msg, p.ReadData):
            raw = bytes((j * 7 + i) & 0xFF for j in range(msg.nbytes))
        elif isinstance(msg, p.Write):
            raw = bytes(range(int(msg.lengths.sum()) * len(msg.tensors)))
        if raw:
            data += raw
            want.append((0, raw))
    return bytes(data), want


def check_output(got: list[tuple[int, object]], want: list[tuple[int, object]]) -> None:
    assert len(got) == len(want)
    for (rid, m), (wrid, wm) in zip(got, want, strict=True):
        assert rid == wrid
        if isinstance(wm, bytes):
            assert m == wm
        else:
            assert same(m, wm)  # type: ignore[arg-type]


STREAM_MSGS: list[p.Message] = [
    p.Hello(1, 2, 3, 4, BOOT),
    p.ReadData(5),
    p.Ping(9),
    p.Write(p.KeyRef(p.KeyKind.CACHE_ID, 1, 0), 0, 0, u32(0, 1), u64(0, 8), u64(3, 1)),
    p.ReadData(0),
    p.Grant(4, u64(1, 2)),
    p.Bye(),
]


def test_decoder_whole_stream_at_once() -> None:
    data, want = stream_of(STREAM_MSGS)
    check_output(p.FrameDecoder().feed(data), want)


def test_decoder_byte_by_byte() -> None:
    data, want = stream_of(STREAM_MSGS)
    dec = p.FrameDecoder()
    got: list[tuple[int, object]] = []
    for i in range(len(data)):
        out = dec.feed(data[i : i + 1])
        got += out
    check_output(got, want)


def test_decoder_needs_more_returns_nothing() -> None:
    dec = p.FrameDecoder()
    data = p.encode(p.Ping(1))
    assert dec.feed(data[:11]) == []
    assert dec.feed(data[11:-1]) == []
    assert [m for _, m in dec.feed(data[-1:])] == [p.Ping(1)]


message_strategy = st.sampled_from(EXAMPLES[:2] + EXAMPLES[3:9] + EXAMPLES[11:] + [
    p.ReadData(3), p.ReadData(17)])


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(msgs=st.lists(message_strategy, min_size=1, max_size=8), data=st.data())
def test_property_decoder_any_chunking(msgs: list[p.Message], data) -> None:
    stream, want = stream_of(msgs)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=20)))
    dec = p.FrameDecoder()
    got: list[tuple[int, object]] = []
    prev = 0
    for c in [*cuts, len(stream)]:
        got += dec.feed(stream[prev:c])
        prev = c
    check_output(got, want)


# ------------------------------------------------------------------------------ malformed input


def test_nixl_read_refuses_grant_flags_and_raw_addresses() -> None:
    """A NixlRead may only ask for a checksum (and say it names every tensor, WHOLE); it
    never names raw addresses."""
    good = p.NixlRead(p.KeyRef(p.KeyKind.CACHE_ID, 1, 0, 0), 0, p.ReadFlags.NONE,
                      u32(0), u64(0), u64(8))
    payload = bytearray(p.encode_payload(good))
    flags_at = p.KeyRef._S.size + 16  # after the key, unit_bytes and layout
    for flag in (p.ReadFlags.GRANT, p.ReadFlags.SHM, 16):
        bad = bytearray(payload)
        bad[flags_at] = int(flag)
        with pytest.raises(RemoteProtocolError, match="NIXL read flags"):
            p.decode_payload(p.MsgType.NIXL_READ, bytes(bad))
    bad = bytearray(payload)
    bad[0] = p.KeyKind.ADDRESS
    with pytest.raises(RemoteProtocolError, match="WRITE only"):
        p.decode_payload(p.MsgType.NIXL_READ, bytes(bad))


def test_nixl_write_refuses_flags() -> None:
    good = p.NixlWrite(p.KeyRef(p.KeyKind.CACHE_ID, 1, 0, 0), 0, 0, u32(0), u64(0), u64(8))
    payload = bytearray(p.encode_payload(good))
    payload[p.KeyRef._S.size + 16] = 1
    with pytest.raises(RemoteProtocolError, match="write flags"):
        p.decode_payload(p.MsgType.NIXL_WRITE, bytes(payload))


def test_nixl_grant_unknown_memory_kind_and_truncated_metadata() -> None:
    data = bytearray(p.encode_payload(p.NixlGrant(1, b"a", 1, p.MEM_DRAM, 0, u64(1))))
    data[16] = 2  # mem
    with pytest.raises(RemoteProtocolError, match="memory kind"):
        p.decode_payload(p.MsgType.NIXL_GRANT, bytes(data))
    md = p.encode_payload(p.NixlMd(b"a", 1, b"metadata"))
    with pytest.raises(RemoteProtocolError, match="truncated"):
        p.decode_payload(p.MsgType.NIXL_MD, md[:-1])
    with pytest.raises(RemoteProtocolError, match="trailing"):
        p.decode_payload(p.MsgType.NIXL_MD_REQUEST, b"x")


def test_nixl_lease_names_a_cache_id_or_a_blocks_key_only() -> None:
    with pytest.raises(LocalProtocolError, match="cache id or a blocks key"):
        p.encode_payload(p.NixlLease(p.KeyRef(p.KeyKind.CACHE_KEY, 1, 2, 3), 0))
    bad = struct.pack("<BQQQ", p.KeyKind.CACHE_KEY, 1, 2, 3) + struct.pack("<Q", 0)
    with pytest.raises(RemoteProtocolError, match="key kind"):
        p.decode_payload(p.MsgType.NIXL_LEASE, bad)
    data = bytearray(p.encode_payload(
        p.NixlLeased(1, b"a", 1, p.MEM_DRAM, 0, True, 8, 8, 1, 0, u64(1))))
    data[21] = 2  # blocks
    with pytest.raises(RemoteProtocolError, match="bad NIXL lease"):
        p.decode_payload(p.MsgType.NIXL_LEASED, bytes(data))


def read_payload(*, kind: int = 2, ntensors: int = 1, nspans: int = 1, flags: int = 0,
                 tensors: bytes | None = None, tail: bytes = b"") -> bytes:
    head = struct.pack("<BQQQ", kind, 1, 0, 0)
    head += struct.pack("<QQIII", 0, 0, flags, ntensors, nspans)
    # the arrays for one tensor and one span (offset 0, length 8), whatever the counts say
    arrays = (tensors if tensors is not None else struct.pack("<I", 0)) + struct.pack(
        "<QQ", 0, 8
    )
    return head + arrays + tail


MALFORMED: dict[str, bytes] = {
    "bad magic": frame(p.MsgType.PING, struct.pack("<Q", 1), magic=b"XD"),
    "bad version": frame(p.MsgType.PING, struct.pack("<Q", 1), version=2),
    "version zero": frame(p.MsgType.PING, struct.pack("<Q", 1), version=0),
    "unknown type": frame(200, b""),
    "type zero": frame(0, b""),
    "oversized length": frame(p.MsgType.GRANT, b"", length=p.MAX_PAYLOAD + 1),
    "u32 max length": frame(p.MsgType.OK, b"", length=U32_MAX),
    "truncated ping": frame(p.MsgType.PING, b"\1\2\3"),
    "trailing bytes ping": frame(p.MsgType.PING, struct.pack("<Q", 1) + b"\0"),
    "trailing bytes ok": frame(p.MsgType.OK, b"\0"),
    "trailing bytes bye": frame(p.MsgType.BYE, b"junk"),
    "truncated hello": frame(p.MsgType.HELLO, b"\0" * 20),
    "hello proof longer than payload": frame(
        p.MsgType.HELLO, struct.pack("<QBIQ16sI", 1, 1, 1, 1, BOOT, 0) + struct.pack("<H", 9)
        + b"abc"),
    "error message longer than payload": frame(
        p.MsgType.ERROR, struct.pack("<q", 1) + struct.pack("<H", 100) + b"short"),
    "read tensor count larger than payload": frame(p.MsgType.READ,
                                                   read_payload(ntensors=U32_MAX)),
    "read span count larger than payload": frame(p.MsgType.READ, read_payload(nspans=1000)),
    "read trailing bytes": frame(p.MsgType.READ, read_payload(tail=b"\0")),
    "read unknown key kind": frame(p.MsgType.READ, read_payload(kind=max(p.KeyKind) + 1)),
    "read key kind zero": frame(p.MsgType.READ, read_payload(kind=0)),
    "read bad flags": frame(p.MsgType.READ, read_payload(flags=0x80)),
    "read bad flags with grant": frame(p.MsgType.READ, read_payload(flags=0x11)),
    "write bad flags": frame(p.MsgType.WRITE, read_payload(flags=0x4)),
    "write unknown key kind": frame(p.MsgType.WRITE, read_payload(kind=255)),
    "grant count larger than payload": frame(p.MsgType.GRANT, struct.pack("<QI", 1, 3)
                                             + b"\0" * 16),
    "grant trailing bytes": frame(p.MsgType.GRANT, struct.pack("<QI", 1, 0) + b"\0"),
    "release bad flag": frame(p.MsgType.RELEASE, struct.pack("<QB", 1, 2)),
    "truncated read data": frame(p.MsgType.READ_DATA, b"\0" * 7),
}


@pytest.mark.parametrize("data", list(MALFORMED.values()), ids=list(MALFORMED))
def test_malformed_frames_raise_remote_protocol_error(data: bytes) -> None:
    with pytest.raises(RemoteProtocolError) as info:
        p.FrameDecoder().feed(data)
    assert info.value.code == Code.SUSPECT_REMOTE_ERROR


def test_well_formed_read_payload_helper_decodes() -> None:
    # The malformed cases above differ from this one in a single field.
    [(_, msg)] = p.FrameDecoder().feed(frame(p.MsgType.READ, read_payload(flags=1)))
    assert isinstance(msg, p.Read) and msg.flags == p.ReadFlags.GRANT
    assert msg.lengths.tolist() == [8]


def test_header_is_checked_before_the_payload_arrives() -> None:
    # An oversized or garbled header is refused at once, without waiting for its payload.
    dec = p.FrameDecoder()
    with pytest.raises(RemoteProtocolError, match="exceeds"):
        dec.feed(frame(p.MsgType.GRANT, b"", length=p.MAX_PAYLOAD + 1)[:12])


def test_decode_header_wrong_size() -> None:
    with pytest.raises(RemoteProtocolError):
        p.decode_header(b"DD\1\1")


def test_remote_protocol_error_after_good_frames() -> None:
    dec = p.FrameDecoder()
    good = p.encode(p.Ping(5))
    assert len(dec.feed(good)) == 1
    with pytest.raises(RemoteProtocolError):
        dec.feed(good[:2] + b"\x09" + good[3:])


@settings(max_examples=500)
@given(data=st.binary(max_size=200))
def test_property_random_bytes_decode_or_raise_remote_protocol_error(data: bytes) -> None:
    with contextlib.suppress(RemoteProtocolError):  # the only error allowed
        p.FrameDecoder().feed(data)


@settings(max_examples=500)
@given(
    mtype=st.sampled_from(list(p.MsgType)),
    payload=st.binary(max_size=120),
    request_id=st.integers(0, U32_MAX),
)
def test_property_random_payloads_of_valid_headers(
    mtype: p.MsgType, payload: bytes, request_id: int
) -> None:
    """Random payloads behind a valid header: any outcome but a foreign exception."""
    try:
        out = p.FrameDecoder().feed(frame(mtype, payload, request_id=request_id))
    except RemoteProtocolError:
        return
    if out:
        rid, msg = out[0]
        assert rid == request_id
        assert mtype == msg.TYPE  # type: ignore[union-attr]
        # What decodes re-encodes to the very same bytes: the encoding is canonical (but an
        # Error's text is decoded leniently, so invalid UTF-8 does not survive).
        if not isinstance(msg, p.Error):
            assert p.encode_payload(msg) == payload  # type: ignore[arg-type]


@settings(max_examples=300)
@given(msg=st.sampled_from(EXAMPLES), cut=st.integers(0, 10_000), flip=st.integers(0, 255))
def test_property_mutated_valid_frames(msg: p.Message, cut: int, flip: int) -> None:
    """Truncate or corrupt one byte of a valid frame: decodes, waits or raises the one error."""
    data = bytearray(p.encode(msg))
    if cut % 2:
        del data[cut % len(data) :]
    else:
        data[cut % len(data)] ^= flip or 1
    with contextlib.suppress(RemoteProtocolError):  # the only error allowed
        p.FrameDecoder().feed(bytes(data))


def test_a_lease_names_a_cache_by_id_or_blocks_key_only() -> None:
    payload = struct.pack("<BQQQI", p.KeyKind.CACHE_KEY, 1, 2, 3, 0)
    with pytest.raises(RemoteProtocolError, match="by id or BlocksCacheKey"):
        p.decode_payload(p.MsgType.LEASE_REQUEST, payload)
    with pytest.raises(LocalProtocolError, match="by id or BlocksCacheKey"):  # nor sends one
        p.encode_payload(p.LeaseRequest(p.KeyRef(p.KeyKind.CACHE_KEY, 1, 2, 3)))


@pytest.mark.parametrize("fields", [
    dict(units=0), dict(tensor_bytes=4097, units=2), dict(addrs=np.empty(0, "<u8")),
    dict(tensor_bytes=0),  # a lying owner: was PARAM_INVALID (the caller's fault) at every pull
])
def test_a_malformed_cache_lease_is_refused(fields: dict[str, object]) -> None:
    base: dict[str, object] = dict(cache_id=1, tensor_bytes=4096, units=2, is_blocks=True,
                                   layout=0, fence_fd=3, fence_ino=9, addrs=u64(4096),
                                   shm_fds=np.empty(0, "<i4"), shm_inos=u64(), shm_offsets=u64())
    f = {**base, **fields}
    addrs = f["addrs"]
    assert isinstance(addrs, np.ndarray)
    payload = struct.pack("<QQQBQiQII", f["cache_id"], f["tensor_bytes"], f["units"],
                          f["is_blocks"], f["layout"], f["fence_fd"], f["fence_ino"],
                          len(addrs), 0) + addrs.astype("<u8").tobytes()
    with pytest.raises(RemoteProtocolError, match="malformed CacheLease"):
        p.decode_payload(p.MsgType.CACHE_LEASE, payload)
    with pytest.raises(LocalProtocolError, match="malformed CacheLease"):  # nor sends one
        p.encode_payload(p.CacheLease(**f))  # type: ignore[arg-type]
