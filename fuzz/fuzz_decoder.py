"""Fuzz the wire decoder: random, truncated, corrupted and oversized frames.

Run by hand, not in CI:

    python fuzz/fuzz_decoder.py                    # atheris if installed, else hypothesis
    python fuzz/fuzz_decoder.py -atheris_runs=1000000 corpus/   # atheris flags pass through
    python fuzz/fuzz_decoder.py --hypothesis --examples 200000 --seed 1

What counts as a finding (any of these raises, and the harness reports the input):

1. ``FrameDecoder.feed`` raising anything but ``RemoteProtocolError`` (a crash, an
   IndexError, a numpy error, a MemoryError from trusting a length);
2. the same bytes fed in different chunks giving different messages, or an error in one
   split but not in another (the decoder must be split-invariant);
3. a decoded message that does not re-encode, or re-encodes to something that decodes to a
   different message (what we accept we can also say);
4. a HELLO / WELCOME whose proof ``split_token`` cannot split into (the rest, a 16-byte link
   token or none) that concatenate back to it (reverse-channel HELLOs included).

The protocol is read generically (``MsgType``, ``encode``, ``decode_payload``) and the seeds
are the protocol's golden frames (tests/vectors/frames.txt, through fuzz/seeds.py), so message
types added later are fuzzed without editing this file.
"""

from __future__ import annotations

import argparse
import os
import struct
import sys
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

try:  # pragma: no cover - depends on the machine
    import atheris  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover
    atheris = None

if atheris is not None:
    with atheris.instrument_imports():
        import numpy as np

        from datadist.core.errors import RemoteProtocolError
        from datadist.wire import protocol as p
else:
    import numpy as np

    from datadist.core.errors import RemoteProtocolError
    from datadist.wire import protocol as p

from seeds import golden_frames  # noqa: E402 - fuzz/seeds.py, beside this file


class Finding(AssertionError):
    """The decoder broke one of its promises for this input."""


# ------------------------------------------------------------------------------ the oracle


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bytes) or isinstance(b, bytes):
        return a == b
    if type(a) is not type(b):
        return False
    for name in getattr(a, "__dataclass_fields__", {}):
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, np.ndarray):
            if not isinstance(y, np.ndarray) or x.dtype != y.dtype or x.tolist() != y.tolist():
                return False
        elif x != y:
            return False
    return True


def _feed(data: bytes, cuts: list[int]) -> tuple[list[tuple[int, Any]], str | None]:
    """Feed ``data`` split at ``cuts``; returns what came out and the error, if any."""
    dec = p.FrameDecoder()
    out: list[tuple[int, Any]] = []
    prev = 0
    try:
        for c in [*sorted(set(cuts)), len(data)]:
            c = min(max(c, prev), len(data))
            out += dec.feed(data[prev:c])
            prev = c
    except RemoteProtocolError as e:
        return out, f"{type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001 - anything else is the finding
        raise Finding(f"decoder raised {type(e).__name__}: {e!r}") from e
    return out, None


def _check_reencode(msg: Any) -> None:
    if isinstance(msg, bytes):
        return
    try:
        frame = p.encode(msg)
        back = p.decode_payload(msg.TYPE, frame[p.HEADER_SIZE :])
    except Exception as e:  # noqa: BLE001
        raise Finding(f"decoded {msg!r} but cannot re-encode it: {e!r}") from e
    if isinstance(msg, p.Error) and len(msg.message.encode()) > 4096:
        return  # the encoder caps an Error's text on purpose
    if not _same(msg, back):
        raise Finding(f"{msg!r} re-encodes to {back!r}")
    if isinstance(msg, (p.Hello, p.Welcome)):
        # 4. the link token: split_token never raises, and the two parts make the proof back
        rest, token = p.split_token(msg.proof, msg.features)
        if rest + token != msg.proof or len(token) not in (0, p.LINK_TOKEN_BYTES):
            raise Finding(f"split_token({msg.proof!r}, {msg.features:#x}) = {rest!r}, {token!r}")


def check(data: bytes, cuts: list[int]) -> None:
    """The three promises, for one input and one way to split it."""
    whole, whole_err = _feed(data, [])
    split, split_err = _feed(data, cuts)
    if (whole_err is None) != (split_err is None):
        raise Finding(f"split-dependent outcome: whole={whole_err!r} split={split_err!r}")
    if whole_err is None and (len(whole) != len(split) or not all(
        a[0] == b[0] and _same(a[1], b[1]) for a, b in zip(whole, split, strict=True)
    )):
        raise Finding("split-dependent messages")
    for _, msg in split:
        _check_reencode(msg)


# ------------------------------------------------------------------------------ inputs


def _seed_frames() -> list[bytes]:
    """Frames to mutate: every golden frame of the protocol (tests/vectors/frames.txt: each
    message type and flag, and the malformed cases both codecs must refuse), plus a few
    sequences a stream carries: raw bytes after READ_DATA, a handshake then a request."""
    frames = golden_frames()
    read_data = next(f for f in frames if f[3] == p.MsgType.READ_DATA)
    hello = next(f for f in frames if f[3] == p.MsgType.HELLO)
    read = next(f for f in frames if f[3] == p.MsgType.READ)
    frames += [
        read_data[: p.HEADER_SIZE] + (8).to_bytes(8, "little") + b"\xaa" * 8,
        hello + p.encode(p.Auth(bytes(32)), 2) + read,
    ]
    return frames


def header(mtype: int, length: int, *, magic: bytes = b"DD", version: int = p.VERSION,
           request_id: int = 0) -> bytes:
    return magic + bytes([version & 0xFF, mtype & 0xFF]) + struct.pack(
        "<II", request_id & 0xFFFFFFFF, length & 0xFFFFFFFF)


def mutate(seed: bytes, op: int, where: int, value: int) -> bytes:
    """One of a few structure-aware mutations of a valid frame."""
    b = bytearray(seed)
    n = len(b)
    op %= 6
    if op == 0:  # truncate
        return bytes(b[: where % (n + 1)])
    if op == 1:  # flip one byte
        b[where % n] ^= (value & 0xFF) or 1
        return bytes(b)
    if op == 2:  # trailing garbage inside the frame: grow the declared length
        extra = (value % 16) + 1
        length = struct.unpack_from("<I", b, 8)[0] + extra
        struct.pack_into("<I", b, 8, length & 0xFFFFFFFF)
        return bytes(b) + bytes(extra)
    if op == 3:  # declared length from the fuzzer (oversized, short, zero)
        struct.pack_into("<I", b, 8, value & 0xFFFFFFFF)
        return bytes(b)
    if op == 4:  # an array count field blown up (any u32 after the fixed part)
        pos = 12 + where % max(1, n - 15)
        struct.pack_into("<I", b, min(pos, n - 4), value & 0xFFFFFFFF)
        return bytes(b)
    return bytes(b) + bytes(b)  # two frames back to back


# ------------------------------------------------------------------------------ atheris


def atheris_main(argv: list[str]) -> None:  # pragma: no cover - run by hand
    seeds = _seed_frames()

    def one_input(data: bytes) -> None:
        fdp = atheris.FuzzedDataProvider(data)
        mode = fdp.ConsumeIntInRange(0, 2)
        cuts = [fdp.ConsumeIntInRange(0, 4096) for _ in range(fdp.ConsumeIntInRange(0, 8))]
        if mode == 0:
            blob = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 4096))
        elif mode == 1:
            mtype = fdp.ConsumeIntInRange(0, 255)
            payload = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 2048))
            blob = header(mtype, len(payload), request_id=fdp.ConsumeInt(4)) + payload
        else:
            seed = seeds[fdp.ConsumeIntInRange(0, len(seeds) - 1)]
            blob = mutate(seed, fdp.ConsumeInt(1), fdp.ConsumeInt(2), fdp.ConsumeInt(4))
        check(blob, cuts)

    atheris.Setup(argv, one_input)
    atheris.Fuzz()


# ------------------------------------------------------------------------------ hypothesis


def hypothesis_main(examples: int, seed: int | None) -> None:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    seeds = _seed_frames()
    types = st.one_of(st.sampled_from([int(t) for t in p.MsgType]), st.integers(0, 255))
    raw = st.binary(max_size=512)
    typed = st.builds(
        lambda t, payload, rid: header(t, len(payload), request_id=rid) + payload,
        types, st.binary(max_size=512), st.integers(0, 2**32 - 1),
    )
    bad_header = st.builds(
        lambda magic, version, t, length: header(t, length, magic=magic, version=version),
        st.sampled_from([b"DD", b"DD", b"D\0", b"\0\0", b"dd"]), st.integers(0, 255), types,
        st.one_of(st.integers(0, 64), st.just(p.MAX_PAYLOAD), st.just(p.MAX_PAYLOAD + 1),
                  st.integers(0, 2**32 - 1)),
    )
    mutated = st.builds(
        mutate, st.sampled_from(seeds), st.integers(0, 255), st.integers(0, 2**16),
        st.integers(0, 2**32 - 1),
    )
    blobs = st.one_of(raw, typed, bad_header, mutated,
                      st.lists(mutated, min_size=2, max_size=4).map(b"".join))

    @settings(max_examples=examples, deadline=None, database=None, derandomize=seed is None,
              suppress_health_check=list(HealthCheck))
    @given(blob=blobs, cuts=st.lists(st.integers(0, 2100), max_size=8))
    def run(blob: bytes, cuts: list[int]) -> None:
        check(blob, cuts)

    if seed is not None:
        from hypothesis import seed as hseed

        run = hseed(seed)(run)
    run()
    print(f"fuzz_decoder: {examples} hypothesis examples, no finding")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=True)
    parser.add_argument("--hypothesis", action="store_true",
                        help="use hypothesis even when atheris is installed")
    parser.add_argument("--examples", type=int, default=50_000,
                        help="hypothesis examples (default 50000)")
    parser.add_argument("--seed", type=int, default=None, help="hypothesis seed")
    args, rest = parser.parse_known_args()
    if atheris is not None and not args.hypothesis:
        atheris_main([sys.argv[0], *rest])
    else:
        hypothesis_main(args.examples, args.seed)


if __name__ == "__main__":
    main()
