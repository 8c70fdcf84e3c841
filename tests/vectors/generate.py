"""The protocol's golden frames: one declarative source, written to tests/vectors/frames.txt.

Who runs this: a person, after changing the protocol (docs/protocol.md):

    python tests/vectors/generate.py            # rewrite frames.txt
    python tests/vectors/generate.py --check    # exit 1 if frames.txt is not what this makes

tests/protocol/test_wire_vectors.py fails while frames.txt differs from what this file makes, and
tests it against the Python codec (src/datadist/wire/protocol.py); cpp/tests/
wire_vectors_test.cc reads the same file at test time and tests the C++ codec (cpp/src/wire.cc)
against it; tests/protocol/test_wire_differential.py compares the two codecs on mutations of its
frames; fuzz/ starts from them (fuzz/seeds.py).

The bytes are built here from ``SCHEMA``, the payload table of docs/protocol.md written as
data, with ``struct`` and nothing from either codec, so that a codec that drifts from the
document fails its test. A new message, field or flag is one entry in ``SCHEMA`` and a few
lines in ``VALID`` / ``MALFORMED``, then one run of this script.

The file, one vector per line, three fields separated by a tab:

    name <TAB> frame as lower-case hex <TAB> expectation

The expectation of a frame a decoder must accept is its *summary*:
``TYPE rid=<request id> field=value ...`` with the payload's fields in wire order, except the
counts that arrays, blobs and raw byte runs carry (their lengths say them). Values: integers
in decimal (signed for i32 / i64), byte strings (bytes16, blob, u8[n]) in lower-case hex
(empty: nothing after '='), arrays as ``[1,2,3]``, a key as its fields kind, a, b, c. A
summary's fields are compared as a set of name=value pairs, so a codec need not print them in
order. The expectation of a frame a decoder must refuse is ``refuse header <why>`` (the
12-byte header alone is refused: bad magic, version or type, a length over 64 MiB; nothing
after it may be read) or ``refuse payload <why>`` (the header is accepted and announces
exactly the payload that follows; the payload is refused). Both codecs refuse with their
protocol-error kind (RemoteProtocolError in Python, an Error with code
kSuspectRemoteError in C++), and the connection is closed. Every frame is at least a header.
"""

from __future__ import annotations

import argparse
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
FRAMES = HERE / "frames.txt"

MAX_PAYLOAD = 64 << 20
U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1

# ------------------------------------------------------------------------------ the schema

# Field types. "u32[n]": n little-endian u32 whose count is the earlier field n; "u8[n]": n raw
# bytes (a byte string); "blob": u16 length, then that many bytes; "bytes16": 16 raw bytes. A
# field that some array, byte run or blob counts is a *count*: it takes its array's length
# unless a vector overrides it, and summaries leave it out.
_SCALARS = {"u8": "<B", "u16": "<H", "u32": "<I", "u64": "<Q", "i32": "<i", "i64": "<q"}
_ARRAYS = {"u32": "<u4", "u64": "<u8", "i32": "<i4"}

KEY = [("kind", "u8"), ("a", "u64"), ("b", "u64"), ("c", "u64")]
REQUEST = [*KEY, ("unit_bytes", "u64"), ("layout", "u64"), ("flags", "u32"),
           ("n_tensors", "u32"), ("n_spans", "u32"), ("tensors", "u32[n_tensors]"),
           ("offsets", "u64[n_spans]"), ("lengths", "u64[n_spans]")]
HELLO = [("cluster_id", "u64"), ("role", "u8"), ("pid", "u32"), ("pid_ns", "u64"),
         ("boot_id", "bytes16"), ("features", "u32"), ("proof", "blob")]

# name -> (type number, payload fields in wire order): docs/protocol.md, "Messages".
SCHEMA: dict[str, tuple[int, list[tuple[str, str]]]] = {
    "HELLO": (1, HELLO),
    "WELCOME": (2, HELLO),
    "ERROR": (3, [("code", "i64"), ("message", "blob")]),
    "READ": (4, REQUEST),
    "READ_DATA": (5, [("nbytes", "u64")]),
    "GRANT": (6, [("lease_id", "u64"), ("n", "u32"), ("bases", "u64[n]")]),
    "RELEASE": (7, [("lease_id", "u64"), ("ok", "u8")]),
    "PING": (8, [("nonce", "u64")]),
    "PONG": (9, [("nonce", "u64")]),
    "BYE": (10, []),
    "WRITE": (11, REQUEST),
    "OK": (12, []),
    "SHM_GRANT": (13, [("lease_id", "u64"), ("n", "u32"), ("fds", "i32[n]"), ("inos", "u64[n]"),
                       ("offsets", "u64[n]")]),
    "AUTH": (14, [("proof", "blob")]),
    "CHECKSUM": (15, [("crc", "u32"), ("nbytes", "u64")]),
    "NIXL_MD_REQUEST": (16, []),
    "NIXL_MD": (17, [("generation", "u64"), ("md_len", "u32"), ("agent", "blob"),
                     ("metadata", "u8[md_len]")]),
    "NIXL_READ": (18, REQUEST),
    "NIXL_GRANT": (19, [("lease_id", "u64"), ("generation", "u64"), ("mem", "u8"),
                        ("device", "u32"), ("n", "u32"), ("agent", "blob"), ("bases", "u64[n]")]),
    "NIXL_WRITE": (20, REQUEST),
    "STATS_REQUEST": (21, []),
    "STATS": (22, [("n", "u32"), ("json", "u8[n]")]),
    "LEASE_REQUEST": (23, [*KEY, ("flags", "u32")]),
    "CACHE_LEASE": (24, [("cache_id", "u64"), ("tensor_bytes", "u64"), ("units", "u64"),
                         ("is_blocks", "u8"), ("layout", "u64"), ("fence_fd", "i32"),
                         ("fence_ino", "u64"), ("n", "u32"), ("m", "u32"), ("addrs", "u64[n]"),
                         ("shm_fds", "i32[m]"), ("shm_inos", "u64[m]"),
                         ("shm_offsets", "u64[m]")]),
    "NIXL_LEASE": (30, [*KEY, ("unit_bytes", "u64")]),
    "NIXL_LEASED": (31, [("lease_id", "u64"), ("generation", "u64"), ("mem", "u8"),
                         ("device", "u32"), ("blocks", "u8"), ("tensor_bytes", "u64"),
                         ("unit_bytes", "u64"), ("units", "u64"), ("layout", "u64"), ("n", "u32"),
                         ("agent", "blob"), ("addrs", "u64[n]")]),
    "NIXL_REVOKE": (32, [("lease_id", "u64")]),
}
TYPE_NAMES = {number: name for name, (number, _) in SCHEMA.items()}


def _counted(spec: str) -> tuple[str, str] | None:
    """``"u64[n]"`` -> ``("u64", "n")``; None for a field that is not an array or byte run."""
    if not spec.endswith("]"):
        return None
    elem, count = spec[:-1].split("[")
    return elem, count


def _counts(fields: list[tuple[str, str]]) -> dict[str, list[str]]:
    """count field -> the fields it counts."""
    out: dict[str, list[str]] = {}
    for name, spec in fields:
        arr = _counted(spec)
        if arr:
            out.setdefault(arr[1], []).append(name)
    return out


def payload(mtype: str, values: dict[str, Any]) -> bytes:
    """The payload of ``mtype`` with these field values, as docs/protocol.md lays it out.

    A count takes the length of what it counts unless ``values`` names it (a malformed
    vector's lie); a blob's length likewise unless ``values`` has ``"<name>#len"``."""
    fields = SCHEMA[mtype][1]
    counts = _counts(fields)
    out = bytearray()
    for name, spec in fields:
        if name in counts and name not in values:
            lengths = {len(values[f]) for f in counts[name]}
            if len(lengths) != 1:
                raise ValueError(f"{mtype}: {counts[name]} differ in length")
            out += struct.pack(_SCALARS[spec], lengths.pop())
            continue
        value = values[name]
        arr = _counted(spec)
        if spec in _SCALARS:
            out += struct.pack(_SCALARS[spec], value)
        elif spec == "bytes16":
            if len(value) != 16:
                raise ValueError(f"{mtype}.{name} must be 16 bytes")
            out += value
        elif spec == "blob":
            out += struct.pack("<H", values.get(name + "#len", len(value))) + value
        elif arr and arr[0] == "u8":
            out += value
        elif arr:
            out += b"".join(struct.pack(_SCALARS[arr[0]], v) for v in value)
        else:
            raise ValueError(f"{mtype}.{name}: unknown field type {spec}")
    return bytes(out)


def header(mtype: int, length: int, rid: int, *, magic: bytes = b"DD", version: int = 1) -> bytes:
    """The 12-byte header: magic, version, type, request id, payload length."""
    return magic + bytes([version, mtype]) + struct.pack("<II", rid, length)


def _value(spec: str, value: Any) -> str:
    if spec in ("bytes16", "blob") or spec.startswith("u8["):
        return bytes(value).hex()
    if _counted(spec):
        return "[" + ",".join(str(int(v)) for v in value) + "]"
    return str(int(value))


def summary(mtype: str, rid: int, values: dict[str, Any]) -> str:
    """What a decoder must find in a frame: ``TYPE rid=N field=value ...`` (module doc)."""
    fields = SCHEMA[mtype][1]
    counts = _counts(fields)
    parts = [mtype, f"rid={rid}"]
    parts += [f"{name}={_value(spec, values[name])}" for name, spec in fields
              if name not in counts]
    return " ".join(parts)


# ------------------------------------------------------------------------------ the vectors

BOOT = bytes(range(16))
NONCE = bytes(range(0xA0, 0xB0))
TOKEN = bytes(range(0xC0, 0xD0))  # a link token: features bit 4 (16), FEATURE_TOKEN, ends proof


def key(kind: int, a: int = 0, b: int = 0, c: int = 0) -> dict[str, int]:
    return {"kind": kind, "a": a, "b": b, "c": c}


def request(k: dict[str, int], *, flags: int = 0, unit_bytes: int = 0, layout: int = 0,
            tensors: tuple[int, ...] = (0,), offsets: tuple[int, ...] = (0,),
            lengths: tuple[int, ...] = (64,)) -> dict[str, Any]:
    return {**k, "unit_bytes": unit_bytes, "layout": layout, "flags": flags,
            "tensors": list(tensors), "offsets": list(offsets), "lengths": list(lengths)}


def hello(**over: Any) -> dict[str, Any]:
    return {"cluster_id": 7, "role": 1, "pid": 4242, "pid_ns": 4026531836, "boot_id": BOOT,
            "features": 0, "proof": b"", **over}


LAYOUT = (5 << 32) | 0x1234ABCD  # (dtype + 1) << 32 | crc32 of the unit shape

# (name, type, request id, field values): frames every decoder of this version accepts.
VALID: list[tuple[str, str, int, dict[str, Any]]] = [
    ("hello.plain", "HELLO", 1, hello()),
    ("hello.auth", "HELLO", 1, hello(features=1, proof=NONCE)),
    ("hello.reverse", "HELLO", 1, hello(features=4)),
    ("hello.reverse_auth", "HELLO", 1, hello(features=5, proof=NONCE)),
    ("hello.reverse_token", "HELLO", 1, hello(features=4 | 16, proof=TOKEN)),
    ("hello.reverse_auth_token", "HELLO", 1, hello(features=1 | 4 | 16, proof=NONCE + TOKEN)),
    # a reverse channel whose client serves WRITE with flag EAGER on it (docs/protocol.md, Push)
    ("hello.reverse_token_eager", "HELLO", 1, hello(features=4 | 16 | 32, proof=TOKEN)),
    ("hello.unknown_features_ignored", "HELLO", 1, hello(features=0xFFFFFFC0)),
    ("hello.extremes", "HELLO", U32_MAX,
     hello(cluster_id=U64_MAX, role=3, pid=U32_MAX, pid_ns=U64_MAX, boot_id=b"\xff" * 16)),
    ("hello.zeros", "HELLO", 0, hello(cluster_id=0, role=0, pid=0, pid_ns=0, boot_id=bytes(16))),
    ("welcome.plain", "WELCOME", 1, hello(cluster_id=8, role=2)),
    ("welcome.auth", "WELCOME", 1, hello(features=1, proof=NONCE + bytes(range(32)))),
    ("welcome.local", "WELCOME", 1, hello(features=2)),
    ("welcome.reverse", "WELCOME", 1, hello(features=4)),
    ("welcome.lease", "WELCOME", 1, hello(features=8)),
    ("welcome.eager_write", "WELCOME", 1, hello(features=32)),
    ("welcome.token", "WELCOME", 1, hello(features=2 | 4 | 8 | 16, proof=TOKEN)),
    ("welcome.auth_token", "WELCOME", 1,
     hello(features=1 | 4 | 16, proof=NONCE + bytes(range(32)) + TOKEN)),
    ("welcome.all_features", "WELCOME", 1, hello(features=63, proof=NONCE + bytes(32) + TOKEN)),
    ("error.param_invalid", "ERROR", 3, {"code": 0x5010B005, "message": b"span outside"}),
    ("error.llm_failed", "ERROR", 3, {"code": 0xFFFFFFFF, "message": b"failed"}),
    ("error.unknown_minus_one", "ERROR", 0, {"code": -1, "message": "caf\u00e9 \u2713".encode()}),
    ("error.empty_message", "ERROR", 0, {"code": 0, "message": b""}),
    ("read.cache_key", "READ", 2, request(key(1, 5, 6, 7), tensors=(0, 1), offsets=(0, 64),
                                          lengths=(64, 32))),
    ("read.cache_key_no_prefix", "READ", 2, request(key(1, 5, 6, U64_MAX))),
    ("read.cache_id", "READ", 2, request(key(2, 1, 3), layout=LAYOUT)),
    ("read.blocks_key", "READ", 2, request(key(3, 0, 9), unit_bytes=4096, tensors=(0, 5),
                                           offsets=(0, 8192, 4096), lengths=(4096,) * 3)),
    ("read.empty", "READ", 2, request(key(2, 1), tensors=(), offsets=(), lengths=())),
    ("read.extremes", "READ", U32_MAX,
     request(key(3, U64_MAX, U64_MAX, U64_MAX), unit_bytes=U64_MAX, layout=U64_MAX,
             tensors=(U32_MAX,), offsets=(U64_MAX,), lengths=(U64_MAX,))),
    ("read.flag_grant", "READ", 2, request(key(2, 1), flags=1)),
    ("read.flag_shm", "READ", 2, request(key(2, 1), flags=2)),
    ("read.flag_grant_shm", "READ", 2, request(key(2, 1), flags=3)),
    ("read.flag_checksum", "READ", 2, request(key(2, 1), flags=4)),
    # what a checksummed same-host pull sends (the C++ core's grants; Python adds SHM)
    ("read.flags_grant_checksum", "READ", 2, request(key(2, 1), flags=5)),
    ("read.flags_grant_shm_checksum", "READ", 2, request(key(2, 1), flags=7)),
    ("read.flags_checksum_whole", "READ", 2, request(key(2, 1), flags=12)),
    ("read.flag_whole", "READ", 2, request(key(2, 1), flags=8)),
    ("read.flags_all", "READ", 2, request(key(2, 1), flags=15)),
    ("read_data.zero", "READ_DATA", 2, {"nbytes": 0}),
    ("read_data.max", "READ_DATA", 2, {"nbytes": U64_MAX}),
    ("grant.three", "GRANT", 2, {"lease_id": 99, "bases": [4096, 8192, U64_MAX]}),
    ("grant.none", "GRANT", 2, {"lease_id": 0, "bases": []}),
    ("release.ok", "RELEASE", 4, {"lease_id": 12, "ok": 1}),
    ("release.failed", "RELEASE", 4, {"lease_id": U64_MAX, "ok": 0}),
    ("release.checksum_verdict", "RELEASE", 2, {"lease_id": 0, "ok": 1}),
    ("ping", "PING", 5, {"nonce": 0x0123456789ABCDEF}),
    ("pong", "PONG", 5, {"nonce": U64_MAX}),
    ("bye", "BYE", 6, {}),
    ("write.cache_key", "WRITE", 7, request(key(1, 5, 6, U64_MAX))),
    ("write.cache_id", "WRITE", 7, request(key(2, 3, 1), tensors=(2, 3), offsets=(8,),
                                           lengths=(16,), layout=LAYOUT)),
    ("write.blocks_key", "WRITE", 7, request(key(3, 0, 9), unit_bytes=4096)),
    ("write.address", "WRITE", 7, request(key(4), offsets=(1 << 40,), lengths=(64,))),
    # flag EAGER (16): the bytes follow at once; at most EAGER_MAX (4 MiB) of them
    ("write.eager", "WRITE", 7, request(key(2, 3, 1), flags=16, tensors=(2, 3), offsets=(8,),
                                        lengths=(16,), layout=LAYOUT)),
    ("write.eager_address", "WRITE", 7, request(key(4), flags=16, offsets=(1 << 40,))),
    ("write.eager_at_bound", "WRITE", 7, request(key(3, 0, 9), flags=16, unit_bytes=4096,
                                                 tensors=(0, 1), offsets=(0, 8192),
                                                 lengths=(1 << 20, 1 << 20))),
    ("write.eager_no_tensors", "WRITE", 7, request(key(2, 1), flags=16, tensors=(),
                                                   lengths=(U64_MAX,))),
    ("ok", "OK", 7, {}),
    ("shm_grant.two", "SHM_GRANT", 2, {"lease_id": 3, "fds": [5, -1], "inos": [1, U64_MAX],
                                       "offsets": [0, 4096]}),
    ("shm_grant.none", "SHM_GRANT", 2, {"lease_id": 3, "fds": [], "inos": [], "offsets": []}),
    ("auth.hmac", "AUTH", 2, {"proof": bytes(range(32))}),
    ("auth.empty", "AUTH", 2, {"proof": b""}),
    ("checksum", "CHECKSUM", 2, {"crc": 0xCBF43926, "nbytes": 9}),
    ("checksum.max", "CHECKSUM", 2, {"crc": U32_MAX, "nbytes": U64_MAX}),
    ("nixl_md_request", "NIXL_MD_REQUEST", 8, {}),
    ("nixl_md", "NIXL_MD", 8, {"generation": 3, "agent": b"datadist-7-42",
                               "metadata": b"\x00md\xff" * 5}),
    ("nixl_md.empty", "NIXL_MD", 8, {"generation": 0, "agent": b"", "metadata": b""}),
    ("nixl_read.cache_key", "NIXL_READ", 9, request(key(1, 5, 6, 7), tensors=(0, 3),
                                                    offsets=(0, 64), lengths=(64, 32))),
    ("nixl_read.cache_id", "NIXL_READ", 9, request(key(2, 1, 0))),
    ("nixl_read.blocks_key", "NIXL_READ", 9, request(key(3, 0, 9), unit_bytes=1024,
                                                     layout=U64_MAX)),
    ("nixl_read.flag_checksum", "NIXL_READ", 9, request(key(2, 1), flags=4)),
    ("nixl_read.flag_whole", "NIXL_READ", 9, request(key(2, 1), flags=8)),
    ("nixl_read.flags_checksum_whole", "NIXL_READ", 9, request(key(2, 1), flags=12)),
    ("nixl_grant.vram", "NIXL_GRANT", 9, {"lease_id": 5, "generation": 3, "mem": 1,
                                          "device": U32_MAX, "agent": b"agent",
                                          "bases": [4096, U64_MAX]}),
    ("nixl_grant.dram_empty", "NIXL_GRANT", 9, {"lease_id": U64_MAX, "generation": 0, "mem": 0,
                                                "device": 0, "agent": b"", "bases": []}),
    ("nixl_write.cache_key", "NIXL_WRITE", 10, request(key(1, 5, 6, 7))),
    ("nixl_write.cache_id", "NIXL_WRITE", 10, request(key(2, 1, 2))),
    ("nixl_write.blocks_key", "NIXL_WRITE", 10, request(key(3, 0, 9), unit_bytes=4096)),
    ("nixl_write.address", "NIXL_WRITE", 10, request(key(4), offsets=(1 << 40,))),
    ("stats_request", "STATS_REQUEST", 11, {}),
    ("stats", "STATS", 11, {"json": b'{"cluster_id":7,"role":"PROMPT","total":{},"links":{}}'}),
    ("stats.empty", "STATS", 11, {"json": b""}),
    ("lease_request.cache_id", "LEASE_REQUEST", 12, {**key(2, U64_MAX, 3), "flags": 0}),
    ("lease_request.blocks_key_shm", "LEASE_REQUEST", 12, {**key(3, 0, 7), "flags": 2}),
    ("lease_request.write", "LEASE_REQUEST", 12, {**key(2, 4), "flags": 0x100}),
    ("lease_request.write_shm", "LEASE_REQUEST", 12, {**key(3, 0, 7), "flags": 0x102}),
    ("cache_lease.cma", "CACHE_LEASE", 12,
     {"cache_id": U64_MAX, "tensor_bytes": 1, "units": 1, "is_blocks": 0, "layout": 0,
      "fence_fd": -1, "fence_ino": 0, "addrs": [4096], "shm_fds": [], "shm_inos": [],
      "shm_offsets": []}),
    ("cache_lease.shm_blocks", "CACHE_LEASE", 12,
     {"cache_id": 1, "tensor_bytes": 4096 * 8, "units": 8, "is_blocks": 1, "layout": LAYOUT,
      "fence_fd": 5, "fence_ino": U64_MAX, "addrs": [1 << 40, U64_MAX], "shm_fds": [5, 6],
      "shm_inos": [1, 2], "shm_offsets": [0, 4096]}),
    ("nixl_lease.cache_id", "NIXL_LEASE", 13, {**key(2, 9), "unit_bytes": 0}),
    ("nixl_lease.blocks_key", "NIXL_LEASE", 13, {**key(3, 0, U64_MAX), "unit_bytes": 32768}),
    ("nixl_leased.blocks_vram", "NIXL_LEASED", 13,
     {"lease_id": 7, "generation": 2, "mem": 1, "device": 3, "blocks": 1,
      "tensor_bytes": 1 << 40, "unit_bytes": 4096, "units": U32_MAX, "layout": U64_MAX,
      "agent": b"agent", "addrs": [4096, U64_MAX]}),
    ("nixl_leased.slots_dram", "NIXL_LEASED", 13,
     {"lease_id": U64_MAX, "generation": 0, "mem": 0, "device": 0, "blocks": 0,
      "tensor_bytes": 8, "unit_bytes": 8, "units": 1, "layout": 0, "agent": b"",
      "addrs": [1]}),
    ("nixl_revoke", "NIXL_REVOKE", 0, {"lease_id": U64_MAX}),
]

_BY_NAME = {name: (mtype, rid, values) for name, mtype, rid, values in VALID}


def _frame(mtype: str, rid: int, values: dict[str, Any]) -> bytes:
    body = payload(mtype, values)
    return header(SCHEMA[mtype][0], len(body), rid) + body


def _bad(base: str, **over: Any) -> bytes:
    """Valid vector ``base`` with some fields (or counts, or ``"<blob>#len"``) replaced."""
    mtype, rid, values = _BY_NAME[base]
    return _frame(mtype, rid, {**values, **over})


def _cut(base: str, keep: int | None = None) -> bytes:
    """Valid vector ``base``'s payload cut to ``keep`` bytes (default: one byte short), with
    the header announcing exactly what is left."""
    mtype, rid, values = _BY_NAME[base]
    body = payload(mtype, values)
    body = body[: len(body) - 1 if keep is None else keep]
    return header(SCHEMA[mtype][0], len(body), rid) + body


def _extra(base: str, extra: bytes = b"\0") -> bytes:
    """Valid vector ``base`` with bytes after its fields, counted in the header's length."""
    mtype, rid, values = _BY_NAME[base]
    body = payload(mtype, values) + extra
    return header(SCHEMA[mtype][0], len(body), rid) + body


_OK = _frame("OK", 7, {})

# (name, stage, why, frame): frames every decoder of this version refuses.
MALFORMED: list[tuple[str, str, str, bytes]] = [
    ("header.bad_magic", "header", "magic", b"XD" + _OK[2:]),
    ("header.lowercase_magic", "header", "magic", b"dd" + _OK[2:]),
    ("header.version_0", "header", "version", header(12, 0, 7, version=0)),
    ("header.version_2", "header", "version", header(12, 0, 7, version=2)),
    ("header.version_255", "header", "version", header(1, 0, 1, version=255)),
    ("header.type_0", "header", "unknown type", header(0, 0, 1)),
    ("header.type_25_reserved", "header", "unknown type", header(25, 0, 1)),
    ("header.type_29_reserved", "header", "unknown type", header(29, 0, 1)),
    ("header.type_33", "header", "unknown type", header(33, 0, 1)),
    ("header.type_255", "header", "unknown type", header(255, 0, 1)),
    ("header.oversized", "header", "length over 64 MiB", header(5, MAX_PAYLOAD + 1, 1)),
    ("header.oversized_max", "header", "length over 64 MiB", header(4, U32_MAX, 1)),
    ("hello.truncated_boot_id", "payload", "truncated", _cut("hello.plain", 8 + 1 + 4 + 8 + 7)),
    ("hello.truncated_proof", "payload", "truncated", _cut("hello.auth")),
    ("hello.no_proof_length", "payload", "truncated", _cut("hello.plain", 8 + 1 + 4 + 8 + 16 + 4)),
    ("hello.proof_length_beyond", "payload", "blob length",
     _bad("hello.auth", **{"proof#len": 0xFFFF})),
    ("hello.trailing", "payload", "trailing bytes", _extra("hello.plain")),
    ("welcome.truncated", "payload", "truncated", _cut("welcome.auth")),
    ("welcome.trailing", "payload", "trailing bytes", _extra("welcome.plain", b"\0\0")),
    ("error.truncated_code", "payload", "truncated", _cut("error.param_invalid", 7)),
    ("error.message_length_beyond", "payload", "blob length",
     _bad("error.param_invalid", **{"message#len": 13})),
    ("error.trailing", "payload", "trailing bytes", _extra("error.empty_message")),
    ("read.empty_payload", "payload", "truncated", _cut("read.cache_id", 0)),
    ("read.truncated_fixed", "payload", "truncated", _cut("read.cache_id", 25 + 8 + 8 + 4 + 3)),
    ("read.truncated_lengths", "payload", "truncated", _cut("read.cache_key")),
    ("read.trailing", "payload", "trailing bytes", _extra("read.cache_id")),
    ("read.n_tensors_beyond", "payload", "array count", _bad("read.cache_id", n_tensors=U32_MAX)),
    ("read.n_tensors_one_more", "payload", "array count", _bad("read.cache_key", n_tensors=3)),
    ("read.n_spans_beyond", "payload", "array count", _bad("read.cache_id", n_spans=0x7FFFFFFF)),
    ("read.n_spans_fewer", "payload", "trailing bytes", _bad("read.cache_key", n_spans=1)),
    ("read.key_kind_0", "payload", "key kind", _bad("read.cache_id", kind=0)),
    ("read.key_kind_5", "payload", "key kind", _bad("read.cache_id", kind=5)),
    ("read.key_kind_address", "payload", "raw addresses are for WRITE only",
     _bad("read.cache_id", kind=4)),
    ("read.flag_16", "payload", "unknown flags", _bad("read.cache_id", flags=16)),
    ("read.flag_high", "payload", "unknown flags", _bad("read.cache_id", flags=0x80000000)),
    ("read_data.truncated", "payload", "truncated", _cut("read_data.zero")),
    ("read_data.trailing", "payload", "trailing bytes", _extra("read_data.zero")),
    ("grant.truncated", "payload", "truncated", _cut("grant.three")),
    ("grant.count_beyond", "payload", "array count", _bad("grant.three", n=U32_MAX)),
    ("grant.trailing", "payload", "trailing bytes", _extra("grant.none")),
    ("release.ok_2", "payload", "bad ok", _bad("release.ok", ok=2)),
    ("release.truncated", "payload", "truncated", _cut("release.ok")),
    ("release.trailing", "payload", "trailing bytes", _extra("release.ok")),
    ("ping.truncated", "payload", "truncated", _cut("ping")),
    ("ping.trailing", "payload", "trailing bytes", _extra("ping")),
    ("pong.empty", "payload", "truncated", _cut("pong", 0)),
    ("pong.trailing", "payload", "trailing bytes", _extra("pong")),
    ("bye.trailing", "payload", "trailing bytes", _extra("bye")),
    ("ok.trailing", "payload", "trailing bytes", _extra("ok", b"\0\0\0\0")),
    ("write.flag_1", "payload", "unknown flags", _bad("write.cache_id", flags=1)),
    ("write.flag_checksum", "payload", "unknown flags", _bad("write.cache_id", flags=4)),
    ("write.flag_32", "payload", "unknown flags", _bad("write.cache_id", flags=32)),
    ("write.flags_eager_grant", "payload", "unknown flags", _bad("write.eager", flags=17)),
    ("write.eager_over_bound", "payload", "eager WRITE over 4 MiB",
     _bad("write.eager_at_bound", lengths=[1 << 20, (1 << 20) + 1])),
    ("write.eager_one_span_over_bound", "payload", "eager WRITE over 4 MiB",
     _bad("write.eager_address", lengths=[(4 << 20) + 1])),
    ("write.eager_total_wraps", "payload", "eager WRITE over 4 MiB",
     _bad("write.eager", lengths=[1 << 63])),
    ("write.eager_sum_wraps", "payload", "eager WRITE over 4 MiB",
     _bad("write.eager_at_bound", lengths=[U64_MAX, 2])),
    ("write.key_kind_5", "payload", "key kind", _bad("write.cache_id", kind=5)),
    ("write.truncated", "payload", "truncated", _cut("write.address")),
    ("write.trailing", "payload", "trailing bytes", _extra("write.address")),
    ("shm_grant.truncated", "payload", "truncated", _cut("shm_grant.two")),
    ("shm_grant.count_beyond", "payload", "array count", _bad("shm_grant.two", n=3)),
    ("shm_grant.trailing", "payload", "trailing bytes", _extra("shm_grant.none")),
    ("auth.truncated", "payload", "truncated", _cut("auth.hmac")),
    ("auth.no_length", "payload", "truncated", _cut("auth.hmac", 1)),
    ("auth.trailing", "payload", "trailing bytes", _extra("auth.hmac")),
    ("checksum.truncated", "payload", "truncated", _cut("checksum")),
    ("checksum.trailing", "payload", "trailing bytes", _extra("checksum")),
    ("nixl_md_request.trailing", "payload", "trailing bytes", _extra("nixl_md_request")),
    ("nixl_md.metadata_truncated", "payload", "truncated", _cut("nixl_md")),
    ("nixl_md.md_len_beyond", "payload", "array count", _bad("nixl_md", md_len=U32_MAX)),
    ("nixl_md.agent_length_beyond", "payload", "blob length",
     _bad("nixl_md.empty", **{"agent#len": 1})),
    ("nixl_md.trailing", "payload", "trailing bytes", _extra("nixl_md")),
    ("nixl_read.key_kind_address", "payload", "raw addresses are for WRITE only",
     _bad("nixl_read.cache_id", kind=4)),
    ("nixl_read.flag_grant", "payload", "unknown flags", _bad("nixl_read.cache_id", flags=1)),
    ("nixl_read.flag_shm", "payload", "unknown flags", _bad("nixl_read.cache_id", flags=2)),
    ("nixl_read.flag_16", "payload", "unknown flags", _bad("nixl_read.cache_id", flags=16)),
    ("nixl_read.truncated", "payload", "truncated", _cut("nixl_read.cache_key")),
    ("nixl_read.trailing", "payload", "trailing bytes", _extra("nixl_read.cache_id")),
    ("nixl_grant.mem_2", "payload", "memory kind", _bad("nixl_grant.vram", mem=2)),
    ("nixl_grant.count_beyond", "payload", "array count", _bad("nixl_grant.vram", n=U32_MAX)),
    ("nixl_grant.agent_length_beyond", "payload", "blob length",
     _bad("nixl_grant.vram", **{"agent#len": 0x100})),
    ("nixl_grant.truncated", "payload", "truncated", _cut("nixl_grant.vram")),
    ("nixl_grant.trailing", "payload", "trailing bytes", _extra("nixl_grant.dram_empty")),
    ("nixl_write.flag_checksum", "payload", "unknown flags", _bad("nixl_write.cache_id", flags=4)),
    ("nixl_write.flag_eager", "payload", "unknown flags", _bad("nixl_write.cache_id", flags=16)),
    ("nixl_write.key_kind_0", "payload", "key kind", _bad("nixl_write.cache_id", kind=0)),
    ("nixl_write.truncated", "payload", "truncated", _cut("nixl_write.address")),
    ("nixl_write.trailing", "payload", "trailing bytes", _extra("nixl_write.cache_id")),
    ("stats_request.trailing", "payload", "trailing bytes", _extra("stats_request")),
    ("stats.truncated", "payload", "truncated", _cut("stats")),
    ("stats.count_beyond", "payload", "array count", _bad("stats.empty", n=1)),
    ("stats.trailing", "payload", "trailing bytes", _extra("stats")),
    ("lease_request.key_kind_cache_key", "payload", "key kind",
     _bad("lease_request.cache_id", kind=1)),
    ("lease_request.key_kind_address", "payload", "key kind",
     _bad("lease_request.cache_id", kind=4)),
    ("lease_request.flag_grant", "payload", "unknown flags",
     _bad("lease_request.cache_id", flags=1)),
    ("lease_request.flag_checksum", "payload", "unknown flags",
     _bad("lease_request.cache_id", flags=4)),
    ("lease_request.truncated", "payload", "truncated", _cut("lease_request.cache_id")),
    ("lease_request.trailing", "payload", "trailing bytes", _extra("lease_request.cache_id")),
    ("cache_lease.is_blocks_2", "payload", "bad field", _bad("cache_lease.cma", is_blocks=2)),
    ("cache_lease.m_not_n", "payload", "bad field",
     _bad("cache_lease.shm_blocks", m=1, shm_fds=[5], shm_inos=[1], shm_offsets=[0])),
    ("cache_lease.no_tensors", "payload", "bad field",
     _bad("cache_lease.cma", addrs=[])),
    ("cache_lease.units_0", "payload", "bad field", _bad("cache_lease.cma", units=0)),
    ("cache_lease.tensor_bytes_0", "payload", "bad field",
     _bad("cache_lease.cma", tensor_bytes=0)),
    ("cache_lease.tensor_bytes_not_units", "payload", "bad field",
     _bad("cache_lease.shm_blocks", tensor_bytes=4096 * 8 + 1)),
    ("cache_lease.count_beyond", "payload", "array count", _bad("cache_lease.cma", n=U32_MAX)),
    ("cache_lease.truncated", "payload", "truncated", _cut("cache_lease.shm_blocks")),
    ("cache_lease.trailing", "payload", "trailing bytes", _extra("cache_lease.cma")),
    ("nixl_lease.key_kind_cache_key", "payload", "key kind",
     _bad("nixl_lease.cache_id", kind=1)),
    ("nixl_lease.key_kind_address", "payload", "key kind",
     _bad("nixl_lease.cache_id", kind=4)),
    ("nixl_lease.truncated", "payload", "truncated", _cut("nixl_lease.cache_id")),
    ("nixl_lease.trailing", "payload", "trailing bytes", _extra("nixl_lease.cache_id")),
    ("nixl_leased.mem_2", "payload", "memory kind", _bad("nixl_leased.slots_dram", mem=2)),
    ("nixl_leased.blocks_2", "payload", "bad field", _bad("nixl_leased.slots_dram", blocks=2)),
    ("nixl_leased.count_beyond", "payload", "array count",
     _bad("nixl_leased.slots_dram", n=2)),
    ("nixl_leased.truncated", "payload", "truncated", _cut("nixl_leased.blocks_vram")),
    ("nixl_leased.trailing", "payload", "trailing bytes", _extra("nixl_leased.slots_dram")),
    ("nixl_revoke.truncated", "payload", "truncated", _cut("nixl_revoke")),
    ("nixl_revoke.trailing", "payload", "trailing bytes", _extra("nixl_revoke")),
]


# ------------------------------------------------------------------------------ the file


@dataclass(frozen=True)
class Vector:
    """One line of frames.txt: a frame and what a decoder must make of it."""

    name: str
    frame: bytes
    expect: str  # a summary, or "refuse header ..." / "refuse payload ..."

    @property
    def refused(self) -> str | None:
        """"header" or "payload" for a frame that must be refused, else None."""
        words = self.expect.split(" ", 2)
        return words[1] if words[0] == "refuse" else None

    @property
    def type(self) -> int:
        return self.frame[3]


def vectors() -> list[Vector]:
    """Every vector, valid ones first, in the order of VALID and MALFORMED."""
    out = [Vector(name, _frame(mtype, rid, values), summary(mtype, rid, values))
           for name, mtype, rid, values in VALID]
    out += [Vector(name, frame, f"refuse {stage} {why}") for name, stage, why, frame in MALFORMED]
    names = [v.name for v in out]
    if len(set(names)) != len(names):
        raise ValueError("two vectors share a name")
    return out


PREAMBLE = """\
# datadist protocol version 1: golden frames (docs/protocol.md). Made by
# tests/vectors/generate.py from its declarative list; do not edit: change the generator and
# run `python tests/vectors/generate.py`. One vector per line, tab-separated:
#   name, frame as hex, then the decoded summary ("TYPE rid=N field=value ...") or
#   "refuse header <why>" / "refuse payload <why>". The generator's docstring says more.
"""


def render(vs: list[Vector]) -> str:
    return PREAMBLE + "".join(f"{v.name}\t{v.frame.hex()}\t{v.expect}\n" for v in vs)


def load(path: Path = FRAMES) -> list[Vector]:
    """Parse frames.txt (who calls: the Python tests and fuzz/fuzz_decoder.py)."""
    out = []
    for line in path.read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        name, hexed, expect = line.split("\t")
        out.append(Vector(name, bytes.fromhex(hexed), expect))
    return out


def parse_summary(expect: str) -> tuple[str, dict[str, str]]:
    """``"TYPE rid=1 a=2"`` -> ``("TYPE", {"rid": "1", "a": "2"})``."""
    words = expect.split(" ")
    fields = dict(w.split("=", 1) for w in words[1:])
    if len(fields) != len(words) - 1:
        raise ValueError(f"a field appears twice in {expect!r}")
    return words[0], fields


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if frames.txt differs from what this script makes")
    args = parser.parse_args(argv)
    text = render(vectors())
    if args.check:
        current = FRAMES.read_text() if FRAMES.exists() else ""
        if current != text:
            print(f"{FRAMES} is stale: run python {Path(__file__).relative_to(HERE.parents[1])}",
                  file=sys.stderr)
            return 1
        return 0
    FRAMES.write_text(text)
    print(f"wrote {len(text.splitlines()) - PREAMBLE.count(chr(10))} vectors to {FRAMES}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
