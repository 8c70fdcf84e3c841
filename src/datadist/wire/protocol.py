"""The datadist peer protocol, sans-IO: message types, framing, encoding and decoding.

Theory of operation
-------------------
Peers talk over a byte stream (TCP). Every frame is a 12-byte header followed by a payload:

    magic "DD" | version u8 | type u8 | request_id u32 | payload_length u32     (little endian)

A few message types announce *raw bytes* that follow their frame (``ReadData``, ``Write``):
the I/O layer moves those straight between the socket and registered memory, never through
this module. Everything here is pure: bytes in, messages out, and the reverse. No sockets, no
clocks, no threads. Docs: docs/protocol.md.

Rules:

1. The decoder trusts nothing. Lengths are checked against the payload before any slice is
   taken, array counts against what remains, and the whole frame against ``MAX_PAYLOAD``.
   Any violation raises :class:`RemoteProtocolError`; the caller closes that connection.
2. A message's encoding is fixed by its type; there are no optional trailing fields. A new
   field means a new protocol version, negotiated in ``Hello``/``Welcome``.
3. Messages are frozen dataclasses. Arrays are numpy arrays of a fixed little-endian dtype,
   decoded without a copy where the payload allows it (``np.frombuffer``).
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from datadist.core.errors import LocalProtocolError, RemoteProtocolError

# How a request names a cache, and a READ's flags: the engine and the facade need them too, so
# they live in core/keys.py; the codec below encodes and decodes them as they are.
from datadist.core.keys import KeyKind as KeyKind  # re-exported: the codec's names
from datadist.core.keys import KeyRef as KeyRef
from datadist.core.keys import ReadFlags as ReadFlags

MAGIC = b"DD"
VERSION = 1
HEADER = struct.Struct("<2sBBII")
HEADER_SIZE = HEADER.size
MAX_PAYLOAD = 64 << 20

U32 = np.dtype("<u4")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
U64 = np.dtype("<u8")
I32 = np.dtype("<i4")


class MsgType(enum.IntEnum):
    """Frame types (the header's type byte); docs/protocol.md lists each one's payload."""

    HELLO = 1
    WELCOME = 2
    ERROR = 3
    READ = 4
    READ_DATA = 5
    GRANT = 6
    RELEASE = 7
    PING = 8
    PONG = 9
    BYE = 10
    WRITE = 11
    OK = 12
    SHM_GRANT = 13
    AUTH = 14
    CHECKSUM = 15
    # The NIXL data path (docs/protocol.md, "NIXL"): additive, after the handshake.
    NIXL_MD_REQUEST = 16
    NIXL_MD = 17
    NIXL_READ = 18
    NIXL_GRANT = 19
    NIXL_WRITE = 20
    STATS_REQUEST = 21
    STATS = 22
    # Whole-cache leases on the local channel (docs/protocol.md, "Cache leases").
    LEASE_REQUEST = 23
    CACHE_LEASE = 24
    # 25 to 29: reserved. NIXL read leases on whole caches (docs/protocol.md, "NIXL leases").
    NIXL_LEASE = 30
    NIXL_LEASED = 31
    NIXL_REVOKE = 32


FEATURE_AUTH = 1  # Hello: the client has a secret; Welcome: the server requires one
# Welcome only: the server also speaks this protocol on the abstract unix socket
# "\0datadist-v1.<pid>.<cluster_id>" (its own pid and cluster id, in decimal); same-host
# reads (GRANT) are served only there (cpp/src/local.cc, docs/protocol.md).
FEATURE_LOCAL = 2


def local_name(pid: int, cluster_id: int) -> bytes:
    """The abstract unix socket name an owner (``pid`` in its own pid namespace,
    ``cluster_id``) serves its local channel on (FEATURE_LOCAL): what same-host clients,
    hostile test peers among them, connect to."""
    return b"\0" + f"datadist-v1.{pid}.{cluster_id}".encode()


# Welcome: the server takes reverse channels. Hello: this connection is the reverse channel of
# the client's link: after the handshake the server sends requests and the client answers.
FEATURE_REVERSE = 4
# Welcome: on the local channel, the server grants whole-cache leases (LEASE_REQUEST): a
# verified same-host reader then reads a cache named by id or BlocksCacheKey without asking
# for every read, fenced by the lease's fence file (docs/protocol.md, "Cache leases").
FEATURE_LEASE = 8
# The link token (docs/protocol.md, "Reverse channels"). Welcome, answering a Hello without
# FEATURE_REVERSE: ``proof`` ends with LINK_TOKEN_BYTES random bytes the server issued to
# this control channel. Hello with FEATURE_REVERSE: ``proof`` ends with the token of the
# client's live control channel; the server adopts the reverse channel only for the cluster
# whose control channel holds that token. Nothing else of the encoding changes.
FEATURE_TOKEN = 16
LINK_TOKEN_BYTES = 16
LEASE_WRITE = 0x100  # LeaseRequest flag: a lease to write (push into) the cache
# Welcome: the server serves eager WRITEs (WRITE_EAGER): a push in one round trip.
FEATURE_EAGER_WRITE = 32
# Write flag, sent only to a server that set FEATURE_EAGER_WRITE: the spans' raw bytes follow
# the Write at once (no go-ahead), and one answer, Ok or Error, comes once the server took them
# all (docs/protocol.md, "Push"). An eager Write naming more than EAGER_MAX bytes is malformed.
WRITE_EAGER = 0x10
EAGER_MAX = 4 << 20


def split_token(proof: bytes, features: int) -> tuple[bytes, bytes]:
    """(the rest of ``proof``, its link token) for a Hello / Welcome with ``features``:
    the token is ``proof``'s last LINK_TOKEN_BYTES when FEATURE_TOKEN is set (b"" when not,
    or when ``proof`` is too short to hold one). Pure."""
    if not features & FEATURE_TOKEN or len(proof) < LINK_TOKEN_BYTES:
        return proof, b""
    return proof[:-LINK_TOKEN_BYTES], proof[-LINK_TOKEN_BYTES:]


@dataclass(frozen=True, slots=True)
class Hello:
    """First frame of a connection, client to server."""

    cluster_id: int
    role: int
    pid: int
    pid_ns: int
    boot_id: bytes  # 16 bytes
    features: int = 0
    proof: bytes = b""

    TYPE: ClassVar[MsgType] = MsgType.HELLO
    _S: ClassVar[struct.Struct] = struct.Struct("<QBIQ16sI")


@dataclass(frozen=True, slots=True)
class Welcome:
    """The server's answer to Hello: who it is, and where."""

    cluster_id: int
    role: int
    pid: int
    pid_ns: int
    boot_id: bytes
    features: int = 0
    proof: bytes = b""

    TYPE: ClassVar[MsgType] = MsgType.WELCOME
    _S: ClassVar[struct.Struct] = Hello._S


@dataclass(frozen=True, slots=True)
class Error:
    """ERROR: a refusal, with a status code and a message."""

    code: int
    message: str

    TYPE: ClassVar[MsgType] = MsgType.ERROR
    _S: ClassVar[struct.Struct] = struct.Struct("<q")


@dataclass(frozen=True, slots=True, eq=False)
class Read:
    """Ask the owner for spans of one of its caches.

    ``unit_bytes`` is the source unit size the requester assumed (its own block size for
    block addressing); the owner refuses the request when its own differs. 0 means "any".
    ``layout`` describes the requester's cache: ``(dtype + 1) << 32 | crc32 of the per-unit
    shape``; the owner refuses a different dtype, and for block addressing a different block
    shape. 0 means unknown (no check).
    Spans: for every tensor in ``tensors``, for every ``(offset, length)``.
    """

    key: KeyRef
    unit_bytes: int
    flags: ReadFlags
    tensors: np.ndarray  # uint32
    offsets: np.ndarray  # uint64
    lengths: np.ndarray  # uint64
    layout: int = 0

    TYPE: ClassVar[MsgType] = MsgType.READ
    _S: ClassVar[struct.Struct] = struct.Struct("<QQIII")


@dataclass(frozen=True, slots=True, eq=False)
class Write:
    """Push: like Read, but ``nbytes`` raw bytes follow, to land in the owner's spans: after
    the owner's go-ahead Ok, or with ``flags`` WRITE_EAGER right behind the Write."""

    key: KeyRef
    unit_bytes: int
    flags: int
    tensors: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray
    layout: int = 0

    TYPE: ClassVar[MsgType] = MsgType.WRITE
    _S: ClassVar[struct.Struct] = Read._S


@dataclass(frozen=True, slots=True)
class ReadData:
    """The owner accepted a Read: exactly ``nbytes`` raw bytes follow this frame."""

    nbytes: int

    TYPE: ClassVar[MsgType] = MsgType.READ_DATA
    _S: ClassVar[struct.Struct] = struct.Struct("<Q")


@dataclass(frozen=True, slots=True, eq=False)
class Grant:
    """Same-host answer to a Read: read these tensor bases yourself, then Release."""

    lease_id: int
    bases: np.ndarray  # uint64, absolute base of each requested tensor's source unit

    TYPE: ClassVar[MsgType] = MsgType.GRANT
    _S: ClassVar[struct.Struct] = struct.Struct("<QI")


@dataclass(frozen=True, slots=True, eq=False)
class ShmGrant:
    """Same-host answer when the cache lives in shareable memory (a memfd): map
    ``/proc/<owner pid>/fd/<fds[i]>`` (checking its inode is ``inos[i]``) and copy from
    ``offsets[i]`` within it, then Release. One entry per requested tensor."""

    lease_id: int
    fds: np.ndarray  # int32
    inos: np.ndarray  # uint64
    offsets: np.ndarray  # uint64

    TYPE: ClassVar[MsgType] = MsgType.SHM_GRANT
    _S: ClassVar[struct.Struct] = struct.Struct("<QI")


@dataclass(frozen=True, slots=True)
class Release:
    """RELEASE: the reader is done with a grant (``ok``: the read succeeded)."""

    lease_id: int
    ok: bool

    TYPE: ClassVar[MsgType] = MsgType.RELEASE
    _S: ClassVar[struct.Struct] = struct.Struct("<QB")


@dataclass(frozen=True, slots=True)
class Auth:
    """The client's answer to the server's challenge (see core/auth.py)."""

    proof: bytes

    TYPE: ClassVar[MsgType] = MsgType.AUTH


@dataclass(frozen=True, slots=True)
class Checksum:
    """CRC-32 (zlib) of the source spans of a read, in order, as the owner saw them."""

    crc: int
    nbytes: int

    TYPE: ClassVar[MsgType] = MsgType.CHECKSUM
    _S: ClassVar[struct.Struct] = struct.Struct("<IQ")


@dataclass(frozen=True, slots=True)
class StatsRequest:
    """Ask the peer for its transfer metrics (answer: Stats)."""

    TYPE: ClassVar[MsgType] = MsgType.STATS_REQUEST


@dataclass(frozen=True, slots=True)
class Stats:
    """The peer's transfer metrics, as UTF-8 JSON (``datadist.metrics()``'s shape, with the
    cluster ids of ``links`` as strings, plus ``cluster_id`` and ``role``)."""

    json: bytes

    TYPE: ClassVar[MsgType] = MsgType.STATS
    _S: ClassVar[struct.Struct] = struct.Struct("<I")


@dataclass(frozen=True, slots=True)
class NixlMdRequest:
    """Ask the owner for its NIXL agent's metadata (answer: NixlMd, or Error when the owner
    has no NIXL agent)."""

    TYPE: ClassVar[MsgType] = MsgType.NIXL_MD_REQUEST


@dataclass(frozen=True, slots=True)
class NixlMd:
    """The owner's NIXL agent: its name, the generation of its registrations (bumped on every
    register and deregister) and its metadata (``nixl_agent.get_agent_metadata()``)."""

    agent: bytes
    generation: int
    metadata: bytes

    TYPE: ClassVar[MsgType] = MsgType.NIXL_MD
    _S: ClassVar[struct.Struct] = struct.Struct("<QI")


@dataclass(frozen=True, slots=True, eq=False)
class NixlRead:
    """A Read to be moved by NIXL: the same fields and checks as Read; flags may only be
    CHECKSUM. The owner answers NixlGrant (then Checksum with that flag) or Error."""

    key: KeyRef
    unit_bytes: int
    flags: ReadFlags
    tensors: np.ndarray  # uint32
    offsets: np.ndarray  # uint64
    lengths: np.ndarray  # uint64
    layout: int = 0

    TYPE: ClassVar[MsgType] = MsgType.NIXL_READ
    _S: ClassVar[struct.Struct] = Read._S


@dataclass(frozen=True, slots=True, eq=False)
class NixlWrite:
    """A Write to be moved by NIXL: WRITE's fields and checks, flags 0, and no raw bytes
    follow. The owner answers NixlGrant (the destination's bases) or Error; the writer WRITEs
    through NIXL, then sends Release (ok = every byte landed)."""

    key: KeyRef
    unit_bytes: int
    flags: int
    tensors: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray
    layout: int = 0

    TYPE: ClassVar[MsgType] = MsgType.NIXL_WRITE
    _S: ClassVar[struct.Struct] = Read._S


MEM_DRAM, MEM_VRAM = 0, 1  # NixlGrant.mem: NIXL's DRAM_SEG and VRAM_SEG


@dataclass(frozen=True, slots=True, eq=False)
class NixlGrant:
    """The owner accepted a NixlRead: the reader READs the spans at ``bases`` (one per
    requested tensor, as in Grant) from agent ``agent`` through NIXL, then sends Release.
    ``generation``: reload the owner's metadata (NixlMdRequest) when it is newer than the one
    loaded. ``mem``/``device``: the memory kind and device id of the source."""

    lease_id: int
    agent: bytes
    generation: int
    mem: int
    device: int
    bases: np.ndarray  # uint64

    TYPE: ClassVar[MsgType] = MsgType.NIXL_GRANT
    _S: ClassVar[struct.Struct] = struct.Struct("<QQBII")


@dataclass(frozen=True, slots=True)
class LeaseRequest:
    """Ask for a lease on a whole cache, named by id (CACHE_ID, ``b`` ignored) or by
    BlocksCacheKey (BLOCKS_KEY). Local channel only; the owner answers CacheLease or Error.
    ``flags``: ReadFlags.SHM if the reader can map shareable memory (else it reads with
    cross-memory attach, and the owner lets it); LEASE_WRITE for a lease to write the cache
    (pushes: cross-memory attach only)."""

    key: KeyRef
    flags: int = 0

    TYPE: ClassVar[MsgType] = MsgType.LEASE_REQUEST


@dataclass(frozen=True, slots=True, eq=False)
class CacheLease:
    """A lease on a whole cache: its geometry and the base address of every tensor, so
    that the reader plans and checks its reads itself and copies without asking. Valid while
    the *fence file* (``/proc/<owner pid>/fd/<fence_fd>``, inode ``fence_ino``, a sealed
    memfd) says so: its first byte must be 0 before a copy; a reader holds a shared flock on
    it around every write and every read from a mapping of the memfds, and checks the byte
    again after a read by cross-memory attach (not done if it is set); the owner sets that
    byte (revokes, with a full fence) and takes the exclusive lock (waits for locked copies in
    flight) before the memory may go. ``shm_*``: where each tensor lies
    in shareable memory (as in ShmGrant), or empty."""

    cache_id: int
    tensor_bytes: int
    units: int
    is_blocks: bool
    layout: int
    fence_fd: int
    fence_ino: int
    addrs: np.ndarray  # uint64, one per tensor
    shm_fds: np.ndarray  # int32, one per tensor or none
    shm_inos: np.ndarray  # uint64
    shm_offsets: np.ndarray  # uint64

    TYPE: ClassVar[MsgType] = MsgType.CACHE_LEASE
    _S: ClassVar[struct.Struct] = struct.Struct("<QQQBQiQII")


@dataclass(frozen=True, slots=True)
class NixlLease:
    """Ask for a read lease on a whole cache (key kinds CACHE_ID, whose batch index is
    ignored, and BLOCKS_KEY), for reads moved by NIXL without a request each. The owner
    answers NixlLeased or Error. Sent only on a link whose reverse channel is up: the owner
    revokes the lease there (NixlRevoke)."""

    key: KeyRef
    unit_bytes: int  # BLOCKS_KEY: the block size the reader assumes (0: any)

    TYPE: ClassVar[MsgType] = MsgType.NIXL_LEASE
    _S: ClassVar[struct.Struct] = struct.Struct("<Q")


@dataclass(frozen=True, slots=True, eq=False)
class NixlLeased:
    """A read lease on a whole cache: its geometry (the reader checks every read against it as
    the owner checks a NixlRead), the address of each tensor, the memory kind, and the agent
    and generation as in NixlGrant. Valid until the owner revokes it or the connection ends."""

    lease_id: int
    agent: bytes
    generation: int
    mem: int
    device: int
    blocks: bool  # a blocks cache (BLOCKS_KEY: offsets absolute in a tensor)
    tensor_bytes: int
    unit_bytes: int
    units: int
    layout: int
    addrs: np.ndarray  # uint64 per tensor

    TYPE: ClassVar[MsgType] = MsgType.NIXL_LEASED
    _S: ClassVar[struct.Struct] = struct.Struct("<QQBIBQQQQI")


@dataclass(frozen=True, slots=True)
class NixlRevoke:
    """Owner to reader, on the reader's reverse channel: stop reading under ``lease_id``. The
    reader answers Ok once no read under it is in flight and none will start."""

    lease_id: int

    TYPE: ClassVar[MsgType] = MsgType.NIXL_REVOKE
    _S: ClassVar[struct.Struct] = struct.Struct("<Q")


@dataclass(frozen=True, slots=True)
class Ping:
    """PING: a liveness probe; the server answers PONG with the same nonce."""

    nonce: int

    TYPE: ClassVar[MsgType] = MsgType.PING
    _S: ClassVar[struct.Struct] = struct.Struct("<Q")


@dataclass(frozen=True, slots=True)
class Pong:
    """PONG: the answer to PING, with its nonce."""

    nonce: int

    TYPE: ClassVar[MsgType] = MsgType.PONG
    _S: ClassVar[struct.Struct] = Ping._S


@dataclass(frozen=True, slots=True)
class Bye:
    """The client is unlinking; the server drops the link's state."""

    TYPE: ClassVar[MsgType] = MsgType.BYE


@dataclass(frozen=True, slots=True)
class Ok:
    """OK: an empty acknowledgement (of BYE, or of a good AUTH)."""

    TYPE: ClassVar[MsgType] = MsgType.OK


Message = (
    Hello | Welcome | Error | Read | Write | ReadData | Grant | ShmGrant | Release | Ping | Pong
    | Bye | Ok | Auth | Checksum | NixlMdRequest | NixlMd | NixlRead | NixlGrant | NixlWrite
    | StatsRequest | Stats | LeaseRequest | CacheLease | NixlLease | NixlLeased | NixlRevoke
)


@dataclass(frozen=True, slots=True)
class FrameHeader:
    """A decoded frame header: message type, request id and payload length."""

    type: MsgType
    request_id: int
    length: int


# --------------------------------------------------------------------------------------------
# what each message may carry (shared by the encoder and the decoder)


# Enum members by value, looked up per frame (calling an enum class costs ~1 us).
_MSG_TYPES = {int(t): t for t in MsgType}
_KEY_KINDS = {int(k): k for k in KeyKind}
_CHECKSUM = int(ReadFlags.CHECKSUM)
_KNOWN_READ_FLAGS = int(ReadFlags.GRANT | ReadFlags.SHM | ReadFlags.CHECKSUM | ReadFlags.WHOLE)
_READ_FLAGS = {i: ReadFlags(i) for i in range(_KNOWN_READ_FLAGS + 1)}
_LEASE_KINDS = (KeyKind.CACHE_ID, KeyKind.BLOCKS_KEY)


# What a message may not carry, written once for the encoder (which raises LocalProtocolError:
# we were about to say it) and the decoder (RemoteProtocolError: the peer said it). Each returns
# why, or None.


def _request_fault(mtype: int, kind: int, flags: int) -> str | None:
    """READ, WRITE, NIXL_READ and NIXL_WRITE: the key kinds and flags each may carry."""
    if kind not in _KEY_KINDS:
        return f"unknown key kind {kind}"
    if mtype in (MsgType.READ, MsgType.NIXL_READ):
        if kind == KeyKind.ADDRESS:
            return "raw addresses (key kind 4) are for WRITE only"
        if mtype == MsgType.NIXL_READ:
            if flags & ~(_CHECKSUM | int(ReadFlags.WHOLE)):
                return f"unknown NIXL read flags {flags:#x}"
        elif flags & ~_KNOWN_READ_FLAGS:
            return f"unknown read flags {flags:#x}"
    elif flags & ~(WRITE_EAGER if mtype == MsgType.WRITE else 0):  # NIXL_WRITE: none
        return f"unknown write flags {flags:#x}"
    return None


def _eager_fault(mtype: int, flags: int, tensors: np.ndarray, lengths: np.ndarray) -> str | None:
    """An eager WRITE names at most EAGER_MAX bytes (sum(lengths) * n_tensors)."""
    if mtype != MsgType.WRITE or not flags & WRITE_EAGER or not len(tensors):
        return None
    lengths = np.asarray(lengths, U64)
    # no sum can wrap: a frame holds at most 8M lengths, each at most EAGER_MAX here
    if (lengths > EAGER_MAX).any() or int(lengths.sum()) * len(tensors) > EAGER_MAX:
        return f"an eager WRITE of more than {EAGER_MAX} bytes"
    return None


def _lease_request_fault(kind: int, flags: int) -> str | None:
    if kind not in _LEASE_KINDS:
        return f"a lease names a cache by id or BlocksCacheKey, not key kind {kind}"
    if flags & ~int(ReadFlags.SHM | LEASE_WRITE):
        return f"unknown lease flags {flags:#x}"
    return None


def _nixl_lease_fault(kind: int) -> str | None:
    if kind not in _LEASE_KINDS:
        return f"a NIXL lease names a cache id or a blocks key, not key kind {kind}"
    return None


def _cache_lease_fault(tensor_bytes: int, units: int, blocks: int, n: int, m: int) -> str | None:
    if blocks > 1 or m not in (0, n) or not n or not units or not tensor_bytes or \
            tensor_bytes % units:
        return "malformed CacheLease"
    return None


def _nixl_mem_fault(mem: int) -> str | None:
    return None if mem in (MEM_DRAM, MEM_VRAM) else f"unknown NIXL memory kind {mem}"


def _refuse(why: str | None) -> None:
    """The encoder's end of the rules above."""
    if why is not None:
        raise LocalProtocolError(why)


# --------------------------------------------------------------------------------------------
# encoding


def _bytes_field(data: bytes) -> bytes:
    if len(data) > 0xFFFF:
        raise LocalProtocolError("byte field longer than 65535")
    return _U16.pack(len(data)) + data


def _array(arr: np.ndarray, dtype: np.dtype) -> bytes:
    return np.ascontiguousarray(arr, dtype=dtype).tobytes()


def _key(k: KeyRef) -> bytes:
    return KeyRef._S.pack(k.kind, k.a, k.b, k.c)


# One encoder per message class: the message's payload, in docs/protocol.md's field order.
# Each refuses (LocalProtocolError) what the decoder would refuse from a peer.


def _enc_hello(msg: Hello | Welcome) -> bytes:
    if len(msg.boot_id) != 16:
        raise LocalProtocolError("boot_id must be 16 bytes")
    head = msg._S.pack(msg.cluster_id, msg.role, msg.pid, msg.pid_ns, msg.boot_id, msg.features)
    return head + _bytes_field(msg.proof)


def _enc_error(msg: Error) -> bytes:
    return msg._S.pack(msg.code) + _bytes_field(msg.message.encode()[:4096])


def _enc_request(msg: Read | Write | NixlRead | NixlWrite) -> bytes:
    _refuse(_request_fault(msg.TYPE, msg.key.kind, int(msg.flags)))
    if len(msg.offsets) != len(msg.lengths):
        raise LocalProtocolError("offsets and lengths differ in length")
    _refuse(_eager_fault(msg.TYPE, int(msg.flags), msg.tensors, msg.lengths))
    return b"".join((
        _key(msg.key),
        msg._S.pack(msg.unit_bytes, msg.layout, int(msg.flags), len(msg.tensors),
                    len(msg.offsets)),
        _array(msg.tensors, U32),
        _array(msg.offsets, U64),
        _array(msg.lengths, U64),
    ))


def _enc_grant(msg: Grant) -> bytes:
    return msg._S.pack(msg.lease_id, len(msg.bases)) + _array(msg.bases, U64)


def _enc_shm_grant(msg: ShmGrant) -> bytes:
    n = len(msg.fds)
    if len(msg.inos) != n or len(msg.offsets) != n:
        raise LocalProtocolError("ShmGrant arrays differ in length")
    return b"".join((msg._S.pack(msg.lease_id, n), _array(msg.fds, I32),
                     _array(msg.inos, U64), _array(msg.offsets, U64)))


def _enc_nixl_md(msg: NixlMd) -> bytes:
    if len(msg.metadata) > MAX_PAYLOAD // 2:
        raise LocalProtocolError("NIXL metadata too large")
    return msg._S.pack(msg.generation, len(msg.metadata)) + _bytes_field(msg.agent) + msg.metadata


def _enc_nixl_grant(msg: NixlGrant) -> bytes:
    _refuse(_nixl_mem_fault(msg.mem))
    return (msg._S.pack(msg.lease_id, msg.generation, msg.mem, msg.device, len(msg.bases))
            + _bytes_field(msg.agent) + _array(msg.bases, U64))


def _enc_nixl_lease(msg: NixlLease) -> bytes:
    _refuse(_nixl_lease_fault(msg.key.kind))
    return _key(msg.key) + msg._S.pack(msg.unit_bytes)


def _enc_nixl_leased(msg: NixlLeased) -> bytes:
    _refuse(_nixl_mem_fault(msg.mem))
    return (msg._S.pack(msg.lease_id, msg.generation, msg.mem, msg.device, int(msg.blocks),
                        msg.tensor_bytes, msg.unit_bytes, msg.units, msg.layout, len(msg.addrs))
            + _bytes_field(msg.agent) + _array(msg.addrs, U64))


def _enc_lease_request(msg: LeaseRequest) -> bytes:
    _refuse(_lease_request_fault(msg.key.kind, msg.flags))
    return _key(msg.key) + _U32.pack(msg.flags)


def _enc_cache_lease(msg: CacheLease) -> bytes:
    n, m = len(msg.addrs), len(msg.shm_fds)
    if m not in (0, n) or len(msg.shm_inos) != m or len(msg.shm_offsets) != m:
        raise LocalProtocolError("CacheLease arrays differ in length")
    _refuse(_cache_lease_fault(msg.tensor_bytes, msg.units, int(msg.is_blocks), n, m))
    return b"".join((
        msg._S.pack(msg.cache_id, msg.tensor_bytes, msg.units, int(msg.is_blocks), msg.layout,
                    msg.fence_fd, msg.fence_ino, n, m),
        _array(msg.addrs, U64), _array(msg.shm_fds, I32), _array(msg.shm_inos, U64),
        _array(msg.shm_offsets, U64)))


def _enc_empty(msg: Bye | Ok | NixlMdRequest | StatsRequest) -> bytes:
    return b""


_ENCODERS: dict[type, Callable[[Any], bytes]] = {
    Hello: _enc_hello,
    Welcome: _enc_hello,
    Error: _enc_error,
    Read: _enc_request,
    Write: _enc_request,
    NixlRead: _enc_request,
    NixlWrite: _enc_request,
    ReadData: lambda msg: msg._S.pack(msg.nbytes),
    Grant: _enc_grant,
    ShmGrant: _enc_shm_grant,
    Release: lambda msg: msg._S.pack(msg.lease_id, 1 if msg.ok else 0),
    Ping: lambda msg: msg._S.pack(msg.nonce),
    Pong: lambda msg: msg._S.pack(msg.nonce),
    Auth: lambda msg: _bytes_field(msg.proof),
    Checksum: lambda msg: msg._S.pack(msg.crc, msg.nbytes),
    NixlMd: _enc_nixl_md,
    NixlGrant: _enc_nixl_grant,
    NixlLease: _enc_nixl_lease,
    NixlLeased: _enc_nixl_leased,
    NixlRevoke: lambda msg: msg._S.pack(msg.lease_id),
    Stats: lambda msg: msg._S.pack(len(msg.json)) + msg.json,
    LeaseRequest: _enc_lease_request,
    CacheLease: _enc_cache_lease,
    Bye: _enc_empty,
    Ok: _enc_empty,
    NixlMdRequest: _enc_empty,
    StatsRequest: _enc_empty,
}


def encode_payload(msg: Message) -> bytes:
    """The payload of ``msg`` (no header). Raises LocalProtocolError for a message that this
    protocol cannot say (wrong sizes, fields the receiver would refuse)."""
    encoder = _ENCODERS.get(type(msg))
    if encoder is None:
        raise LocalProtocolError(f"cannot encode {type(msg).__name__}")
    return encoder(msg)


def encode(msg: Message, request_id: int = 0) -> bytes:
    """One whole frame: header and payload."""
    payload = encode_payload(msg)
    if len(payload) > MAX_PAYLOAD:
        raise LocalProtocolError(f"payload of {len(payload)} bytes exceeds {MAX_PAYLOAD}")
    return HEADER.pack(MAGIC, VERSION, msg.TYPE, request_id & 0xFFFFFFFF, len(payload)) + payload


# --------------------------------------------------------------------------------------------
# decoding




def decode_header(data: bytes | memoryview) -> FrameHeader:
    """Parse and check a 12-byte header. Raises RemoteProtocolError on anything odd."""
    if len(data) != HEADER_SIZE:
        raise RemoteProtocolError(f"header must be {HEADER_SIZE} bytes, got {len(data)}")
    magic, version, mtype, request_id, length = HEADER.unpack(data)
    if magic != MAGIC:
        raise RemoteProtocolError(f"bad magic {bytes(magic)!r}")
    if version != VERSION:
        raise RemoteProtocolError(f"unsupported protocol version {version}")
    t = _MSG_TYPES.get(mtype)
    if t is None:
        raise RemoteProtocolError(f"unknown message type {mtype}")
    if length > MAX_PAYLOAD:
        raise RemoteProtocolError(f"frame of {length} bytes exceeds {MAX_PAYLOAD}")
    return FrameHeader(t, request_id, length)


class _Reader:
    """Bounds-checked cursor over one payload."""

    __slots__ = ("buf", "pos")

    def __init__(self, buf: bytes | bytearray | memoryview) -> None:
        self.buf = memoryview(buf)
        self.pos = 0

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise RemoteProtocolError("payload truncated")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, s: struct.Struct) -> tuple[Any, ...]:
        return s.unpack(self.take(s.size))

    def bytes_field(self) -> bytes:
        (n,) = self.unpack(_U16)
        return bytes(self.take(n))

    def array(self, count: int, dtype: np.dtype) -> np.ndarray:
        return np.frombuffer(self.take(count * dtype.itemsize), dtype=dtype)

    def done(self) -> None:
        if self.pos != len(self.buf):
            raise RemoteProtocolError(f"{len(self.buf) - self.pos} trailing bytes in payload")


def _dec_key(r: _Reader) -> tuple[int, int, int, int]:
    kind, a, b, c = r.unpack(KeyRef._S)
    return kind, a, b, c


def _reject(why: str | None) -> None:
    """The decoder's end of the rules above."""
    if why is not None:
        raise RemoteProtocolError(why)


def _dec_hello(r: _Reader, mtype: MsgType) -> Message:
    cid, role, pid, pid_ns, boot_id, features = r.unpack(Hello._S)
    proof = r.bytes_field()
    cls = Hello if mtype == MsgType.HELLO else Welcome
    return cls(cid, role, pid, pid_ns, bytes(boot_id), features, proof)


def _dec_error(r: _Reader, mtype: MsgType) -> Message:
    (code,) = r.unpack(Error._S)
    return Error(code, r.bytes_field().decode("utf-8", "replace"))


def _dec_request(r: _Reader, mtype: MsgType) -> Message:
    kind, a, b, c = _dec_key(r)
    if kind not in _KEY_KINDS:  # before trusting the counts that follow
        raise RemoteProtocolError(f"unknown key kind {kind}")
    key = KeyRef(_KEY_KINDS[kind], a, b, c)
    unit_bytes, layout, flags, ntensors, nspans = r.unpack(Read._S)
    tensors = r.array(ntensors, U32)
    offsets = r.array(nspans, U64)
    lengths = r.array(nspans, U64)
    _reject(_request_fault(mtype, kind, flags))
    _reject(_eager_fault(mtype, flags, tensors, lengths))
    if mtype == MsgType.READ:
        return Read(key, unit_bytes, _READ_FLAGS[flags], tensors, offsets, lengths, layout)
    if mtype == MsgType.NIXL_READ:
        return NixlRead(key, unit_bytes, _READ_FLAGS[flags], tensors, offsets, lengths, layout)
    cls = Write if mtype == MsgType.WRITE else NixlWrite
    return cls(key, unit_bytes, flags, tensors, offsets, lengths, layout)


def _dec_grant(r: _Reader, mtype: MsgType) -> Message:
    lease, count = r.unpack(Grant._S)
    return Grant(lease, r.array(count, U64))


def _dec_shm_grant(r: _Reader, mtype: MsgType) -> Message:
    lease, count = r.unpack(ShmGrant._S)
    return ShmGrant(lease, r.array(count, I32), r.array(count, U64), r.array(count, U64))


def _dec_release(r: _Reader, mtype: MsgType) -> Message:
    lease, ok = r.unpack(Release._S)
    if ok > 1:
        raise RemoteProtocolError(f"bad release flag {ok}")
    return Release(lease, bool(ok))


def _dec_stats(r: _Reader, mtype: MsgType) -> Message:
    (n,) = r.unpack(Stats._S)
    return Stats(bytes(r.take(n)))


def _dec_lease_request(r: _Reader, mtype: MsgType) -> Message:
    kind, a, b, c = _dec_key(r)
    _reject(_lease_request_fault(kind, 0))
    (flags,) = r.unpack(_U32)
    _reject(_lease_request_fault(kind, flags))
    return LeaseRequest(KeyRef(_KEY_KINDS[kind], a, b, c), flags)


def _dec_cache_lease(r: _Reader, mtype: MsgType) -> Message:
    cache_id, tbytes, units, blocks, layout, ffd, fino, n, m = r.unpack(CacheLease._S)
    _reject(_cache_lease_fault(tbytes, units, blocks, n, m))
    return CacheLease(cache_id, tbytes, units, bool(blocks), layout, ffd, fino,
                      r.array(n, U64), r.array(m, I32), r.array(m, U64), r.array(m, U64))


def _dec_nixl_md(r: _Reader, mtype: MsgType) -> Message:
    gen, n = r.unpack(NixlMd._S)
    agent = r.bytes_field()
    return NixlMd(agent, gen, bytes(r.take(n)))


def _dec_nixl_grant(r: _Reader, mtype: MsgType) -> Message:
    lease, gen, mem, device, count = r.unpack(NixlGrant._S)
    _reject(_nixl_mem_fault(mem))
    agent = r.bytes_field()
    return NixlGrant(lease, agent, gen, mem, device, r.array(count, U64))


def _dec_nixl_lease(r: _Reader, mtype: MsgType) -> Message:
    kind, a, b, c = _dec_key(r)
    _reject(_nixl_lease_fault(kind))
    (unit_bytes,) = r.unpack(NixlLease._S)
    return NixlLease(KeyRef(_KEY_KINDS[kind], a, b, c), unit_bytes)


def _dec_nixl_leased(r: _Reader, mtype: MsgType) -> Message:
    lease, gen, mem, device, blocks, tb, ub, units, layout, count = r.unpack(NixlLeased._S)
    _reject(_nixl_mem_fault(mem))
    if blocks > 1:
        raise RemoteProtocolError(f"bad NIXL lease (blocks {blocks})")
    agent = r.bytes_field()
    return NixlLeased(lease, agent, gen, mem, device, bool(blocks), tb, ub, units, layout,
                      r.array(count, U64))


# One decoder per message type; each reads its fields through the bounds-checked reader.
_DECODERS: dict[MsgType, Callable[[_Reader, MsgType], Message]] = {
    MsgType.HELLO: _dec_hello,
    MsgType.WELCOME: _dec_hello,
    MsgType.ERROR: _dec_error,
    MsgType.READ: _dec_request,
    MsgType.READ_DATA: lambda r, t: ReadData(*r.unpack(ReadData._S)),
    MsgType.GRANT: _dec_grant,
    MsgType.RELEASE: _dec_release,
    MsgType.PING: lambda r, t: Ping(*r.unpack(Ping._S)),
    MsgType.PONG: lambda r, t: Pong(*r.unpack(Pong._S)),
    MsgType.BYE: lambda r, t: Bye(),
    MsgType.WRITE: _dec_request,
    MsgType.OK: lambda r, t: Ok(),
    MsgType.SHM_GRANT: _dec_shm_grant,
    MsgType.AUTH: lambda r, t: Auth(r.bytes_field()),
    MsgType.CHECKSUM: lambda r, t: Checksum(*r.unpack(Checksum._S)),
    MsgType.NIXL_MD_REQUEST: lambda r, t: NixlMdRequest(),
    MsgType.NIXL_MD: _dec_nixl_md,
    MsgType.NIXL_READ: _dec_request,
    MsgType.NIXL_GRANT: _dec_nixl_grant,
    MsgType.NIXL_WRITE: _dec_request,
    MsgType.STATS_REQUEST: lambda r, t: StatsRequest(),
    MsgType.STATS: _dec_stats,
    MsgType.LEASE_REQUEST: _dec_lease_request,
    MsgType.CACHE_LEASE: _dec_cache_lease,
    MsgType.NIXL_LEASE: _dec_nixl_lease,
    MsgType.NIXL_LEASED: _dec_nixl_leased,
    MsgType.NIXL_REVOKE: lambda r, t: NixlRevoke(*r.unpack(NixlRevoke._S)),
}


def decode_payload(mtype: MsgType, payload: bytes | bytearray | memoryview) -> Message:
    """Decode one payload of a known type. Raises RemoteProtocolError when malformed."""
    decoder = _DECODERS.get(mtype)
    if decoder is None:  # pragma: no cover - decode_header only admits known types
        raise RemoteProtocolError(f"unknown message type {mtype}")
    r = _Reader(payload)
    msg = decoder(r, mtype)
    r.done()
    return msg


@dataclass
class FrameDecoder:
    """Incremental decoder: feed any chunks, get whole (request_id, message) pairs back.

    For frames followed by raw bytes (ReadData, Write) it also returns those bytes, as a
    ``bytes`` object after the message; the real transports read raw data straight into
    memory instead and use :func:`decode_header` / :func:`decode_payload` directly. This class
    serves tests and fuzzing, and any peer that prefers to buffer.
    """

    _buf: bytearray = field(default_factory=bytearray)
    _raw_left: int = 0

    def feed(self, data: bytes) -> list[tuple[int, Message | bytes]]:
        self._buf += data
        out: list[tuple[int, Message | bytes]] = []
        while True:
            if self._raw_left:
                if len(self._buf) < self._raw_left:
                    return out
                out.append((0, bytes(self._buf[: self._raw_left])))
                del self._buf[: self._raw_left]
                self._raw_left = 0
            if len(self._buf) < HEADER_SIZE:
                return out
            head = decode_header(bytes(self._buf[:HEADER_SIZE]))
            if len(self._buf) < HEADER_SIZE + head.length:
                return out
            payload = bytes(self._buf[HEADER_SIZE : HEADER_SIZE + head.length])
            del self._buf[: HEADER_SIZE + head.length]
            msg = decode_payload(head.type, payload)
            out.append((head.request_id, msg))
            if isinstance(msg, ReadData):
                self._raw_left = msg.nbytes
            elif isinstance(msg, Write):
                self._raw_left = int(msg.lengths.sum()) * len(msg.tensors)
