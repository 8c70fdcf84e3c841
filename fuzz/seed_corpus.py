"""Seeds for the C++ libFuzzer targets (cpp/fuzz/, run by .ci/fuzz.sh), from the protocol's
golden frames (tests/vectors/frames.txt, read as text: no import of datadist or numpy).

    python3 fuzz/seed_corpus.py wire  DIR   # every golden frame, one file each
    python3 fuzz/seed_corpus.py owner DIR   # a mode byte, a HELLO, then each golden frame

The owner target's input is one connection's bytes after a mode byte (cpp/fuzz/fuzz_owner.cc:
bit 0 the local channel, bits 1-2 the number of writes, bit 3 the owner with a secret); the
seeds vary it. Besides the golden
frames, a few streams aimed at what the harness's owner holds: checksummed reads and grants
of cache 3 (whose tensor 1 has a hole), a WRITE with its data, PING, STATS_REQUEST and a lease
request. Called by .ci/fuzz.sh before each run; the kept corpus fuzz/corpus/<target>/ holds
what fuzzing found beyond these.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from pathlib import Path

FRAMES = Path(__file__).resolve().parents[1] / "tests" / "vectors" / "frames.txt"
HEADER = struct.Struct("<2sBBII")  # magic, version, type, request id, payload length
READ, WRITE, PING, STATS_REQUEST, LEASE_REQUEST, RELEASE = 4, 11, 8, 21, 23, 7
FLAG_GRANT, FLAG_SHM, FLAG_CHECKSUM = 1, 2, 4
KIND_CACHE_ID = 2


def golden() -> list[tuple[str, bytes]]:
    out = []
    for line in FRAMES.read_text().splitlines():
        if line and not line.startswith("#"):
            name, hexed, _ = line.split("\t")
            out.append((name, bytes.fromhex(hexed)))
    return out


def frame(mtype: int, payload: bytes, rid: int) -> bytes:
    return HEADER.pack(b"DD", 1, mtype, rid, len(payload)) + payload


def hello() -> bytes:
    # cluster 77, role 2, pid 1 (not the owner's), pid_ns 0, boot id 0, no features, no proof
    return frame(1, struct.pack("<QBIQ16sI", 77, 2, 1, 0, bytes(16), 0) + struct.pack("<H", 0), 1)


def request(mtype: int, cache: int, flags: int, tensors: list[int], spans: list[tuple[int, int]],
            rid: int, slot: int = 0) -> bytes:
    """A READ or WRITE by cache id: spans within slot `slot` of each tensor."""
    head = struct.pack("<BQQQ", KIND_CACHE_ID, cache, slot, 0)
    body = struct.pack("<QQIII", 0, 0, flags, len(tensors), len(spans))
    body += b"".join(struct.pack("<I", t) for t in tensors)
    body += b"".join(struct.pack("<Q", o) for o, _ in spans)
    body += b"".join(struct.pack("<Q", n) for _, n in spans)
    return frame(mtype, head + body, rid)


def aimed() -> list[tuple[str, bytes]]:
    page = 4096  # cache 3: slots of a page; tensor 1's slot 1 is the hole
    hole = [(0, page)]
    grant_check = FLAG_GRANT | FLAG_CHECKSUM
    return [
        ("read_checksum_hole_tcp", b"\x00" + hello()
         + request(READ, 3, FLAG_CHECKSUM, [1], hole, 2, 1)),
        ("grant_checksum_hole_local", b"\x01" + hello()
         + request(READ, 3, grant_check, [1], hole, 2, 1)),
        ("grant_checksum_ok_local", b"\x03" + hello()
         + request(READ, 3, grant_check, [0], [(0, page)], 2)
         + frame(RELEASE, struct.pack("<QB", 1, 1), 3)),
        ("read_checksum_verdict_tcp", b"\x04" + hello()
         + request(READ, 1, FLAG_CHECKSUM, [0, 1], [(0, 64)], 2)
         + frame(RELEASE, struct.pack("<QB", 0, 1), 2)),
        ("write_data_tcp", b"\x06" + hello()
         + request(WRITE, 1, 0, [0], [(8, 16)], 2) + bytes(range(16))),
        ("ping_stats_local", b"\x01" + hello()
         + frame(PING, struct.pack("<Q", 5), 2) + frame(STATS_REQUEST, b"", 3)),
        ("lease_local", b"\x01" + hello()
         + frame(LEASE_REQUEST, struct.pack("<BQQQI", KIND_CACHE_ID, 1, 0, 0, 0), 2)),
    ]


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[1] not in ("wire", "owner"):
        print(__doc__, file=sys.stderr)
        return 2
    target, out = argv[1], Path(argv[2])
    out.mkdir(parents=True, exist_ok=True)
    seeds = golden()
    if target == "owner":
        start = hello()
        # modes 0-7: the owner without a secret, every channel and split; every fourth frame
        # also to the one with a secret (mode bit 3: its pre-auth stage)
        seeds = ([(name, bytes([i % 8]) + start + f) for i, (name, f) in enumerate(seeds)]
                 + [(f"{name}-secret", bytes([8 | i % 8]) + start + f)
                    for i, (name, f) in enumerate(seeds) if i % 4 == 0]
                 + aimed())
    for name, data in seeds:
        # named by content, as libFuzzer names its corpus: rerunning adds nothing twice
        (out / f"seed-{name}-{hashlib.sha1(data).hexdigest()[:12]}").write_bytes(data)
    print(f"{len(seeds)} {target} seeds in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
