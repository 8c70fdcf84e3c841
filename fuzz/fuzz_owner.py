"""Fuzz a live owner: frame sequences before authentication, and requests with duplicated and
expanded spans after it.

Run by hand, not in CI (the tests/faults fuzzers run a fixed set in CI):

    python fuzz/fuzz_owner.py                      # 2000 hypothesis examples
    python fuzz/fuzz_owner.py --examples 50000 --seed 3

The owner is an in-process Engine with a shared secret, listening on loopback; the fuzzer is
a raw socket. What counts as a finding (raised, with the input):

1. before a valid AUTH (frames of its own and every golden frame of tests/vectors/frames.txt):
   any answer but WELCOME or ERROR, a peer registered as inbound
   (``Engine.inbound_peers``), or the connection left open once the fuzzer stopped sending;
2. after it: a request with duplicated or expanded spans (one tensor index repeated, many
   one-byte spans, a checksum asked for) answered by anything but ERROR or the exact bytes,
   or answered later than ANSWER_BOUND seconds (its cost must be bounded by its size);
3. the owner crashing, or not serving an honest pull afterwards.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import sys
import time
import zlib

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import numpy as np  # noqa: E402
from seeds import golden_frames  # noqa: E402 - fuzz/seeds.py, beside this file

from datadist.core import auth  # noqa: E402
from datadist.core.engine import Engine, EngineConfig  # noqa: E402
from datadist.core.layout import Geometry  # noqa: E402
from datadist.wire import protocol as p  # noqa: E402

SECRET = b"fuzz-owner"
TENSORS, TENSOR_BYTES = 4, 4096
ANSWER_BOUND = 2.0  # seconds any one request may take to be answered
SOCK_TIMEOUT = 5.0


class Finding(AssertionError):
    pass


class Client:
    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=SOCK_TIMEOUT)
        self.dec = p.FrameDecoder()
        self.items: list = []

    def send(self, data: bytes) -> None:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self.sock.sendall(data)

    def next(self):  # type: ignore[no-untyped-def]
        while not self.items:
            try:
                chunk = self.sock.recv(1 << 20)
            except ConnectionResetError:
                chunk = b""
            except TimeoutError:
                raise Finding(f"no answer within {SOCK_TIMEOUT} s") from None
            if not chunk:
                return None
            self.items.extend(self.dec.feed(chunk))
        return self.items.pop(0)

    def close(self) -> None:
        self.sock.close()


def authenticate(cli: Client, owner_id: int) -> None:
    nonce = auth.nonce()
    cli.send(p.encode(p.Hello(owner_id + 1, 2, 1, 0, b"\x01" * 16, p.FEATURE_AUTH, nonce), 1))
    _, welcome = cli.next()
    server_nonce, _ = auth.split_server_proof(welcome.proof)
    proof = auth.client_proof(SECRET, nonce, server_nonce, owner_id, owner_id + 1)
    cli.send(p.encode(p.Auth(proof), 2))
    if cli.next() != (2, p.Ok()):
        raise Finding("a valid proof was refused")


def before_auth(owner: Engine, hello: int, frames: list[bytes]) -> None:
    cli = Client(owner.listen_address[1])
    me = "{}:{}".format(*cli.sock.getsockname()[:2])
    try:
        if hello:
            flags, nonce = (p.FEATURE_AUTH, auth.nonce()) if hello == 2 else (0, b"")
            cli.send(p.encode(p.Hello(9, 2, 1, 0, b"\x01" * 16, flags, nonce), 1))
            got = cli.next()
            if got is None or not isinstance(got[1], (p.Welcome, p.Error)):
                raise Finding(f"answered {got!r} to a Hello")
            if any(peer.address == me for peer in owner.inbound_peers()):
                raise Finding(f"registered {me} on its Hello, before any proof")
        cli.send(b"".join(frames))
        cli.sock.shutdown(socket.SHUT_WR)
        while (item := cli.next()) is not None:
            if not isinstance(item[1], (p.Welcome, p.Error)):
                raise Finding(f"answered {item!r} before authentication")
        if any(peer.address == me for peer in owner.inbound_peers()):
            raise Finding(f"registered {me} without a valid proof")
    finally:
        cli.close()


def expanded(owner: Engine, cache_id: int, data: np.ndarray, cases: list) -> None:
    cli = Client(owner.listen_address[1])
    try:
        authenticate(cli, owner.config.cluster_id)
        for rid, (tensors, offsets, lengths) in enumerate(cases, start=10):
            msg = p.Read(p.KeyRef(p.KeyKind.CACHE_ID, cache_id, 0), 0, p.ReadFlags.CHECKSUM,
                         np.asarray(tensors, np.uint32), np.asarray(offsets, np.uint64),
                         np.asarray(lengths, np.uint64))
            t0 = time.monotonic()
            cli.send(p.encode(msg, rid))
            got = cli.next()
            if got is None or got[0] != rid:
                raise Finding(f"no answer to {msg!r}: {got!r}")
            if isinstance(got[1], p.Error):
                pass
            elif isinstance(got[1], p.ReadData):
                want = b"".join(data[t, o:o + n].tobytes() for t in tensors
                                for o, n in zip(offsets, lengths, strict=True))
                raw = cli.next()[1] if want else b""
                if raw != want:
                    raise Finding(f"wrong bytes for {msg!r}")
                if cli.next()[1] != p.Checksum(zlib.crc32(want), len(want)):
                    raise Finding(f"wrong checksum for {msg!r}")
                cli.send(p.encode(p.Release(0, True), rid))
            else:
                raise Finding(f"answered {got!r} to {msg!r}")
            if time.monotonic() - t0 > ANSWER_BOUND:
                raise Finding(f"{len(tensors)} x {len(offsets)} spans took "
                              f"{time.monotonic() - t0:.1f} s")
    finally:
        cli.close()


def main() -> None:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()

    owner = Engine(EngineConfig(cluster_id=1, role=1, listen=("127.0.0.1", 0), secret=SECRET))
    data = (np.arange(TENSORS * TENSOR_BYTES, dtype=np.uint32) % 251).astype(np.uint8)
    data = data.reshape(TENSORS, TENSOR_BYTES)
    entry = owner.register(Geometry(TENSORS, TENSOR_BYTES, 1),
                           [data.ctypes.data + t * TENSOR_BYTES for t in range(TENSORS)],
                           placement=0)
    read = p.encode(p.Read(p.KeyRef(p.KeyKind.CACHE_ID, entry.cache_id, 0), 0,
                           p.ReadFlags.NONE, np.arange(2, dtype=np.uint32),
                           np.zeros(1, np.uint64), np.full(1, 64, np.uint64)), 3)
    frames = st.one_of(
        st.just(read), st.just(p.encode(p.Ping(1), 4)), st.just(p.encode(p.Bye(), 5)),
        st.binary(min_size=32, max_size=32).map(lambda b: p.encode(p.Auth(b), 6)),
        st.integers(0, 2**32 - 1).map(  # a header announcing any length, then little
            lambda n: p.HEADER.pack(p.MAGIC, p.VERSION, p.MsgType.HELLO, 7, n) + b"\0" * 8),
        st.binary(max_size=64),
        st.sampled_from(golden_frames()),  # every type, flag and malformed case (tests/vectors)
    )
    span = st.tuples(st.integers(0, TENSOR_BYTES - 1), st.integers(1, 64)).map(
        lambda on: (on[0], min(on[1], TENSOR_BYTES - on[0])))
    case = st.builds(  # one tensor index repeated, spans of one byte or more
        lambda t, reps, spans, ones: (
            [t] * reps, [o for o, _ in spans], [1 if ones else n for _, n in spans]),
        st.integers(0, TENSORS - 1), st.integers(1, 4096),
        st.lists(span, min_size=1, max_size=512), st.booleans())
    distinct = st.builds(  # distinct tensors, up to 4096 spans each
        lambda ts, spans: (ts, [o for o, _ in spans], [n for _, n in spans]),
        st.lists(st.integers(0, TENSORS - 1), min_size=1, max_size=TENSORS, unique=True),
        st.lists(span, min_size=1, max_size=4096))

    @settings(max_examples=args.examples, deadline=None, database=None,
              derandomize=args.seed is None, suppress_health_check=list(HealthCheck))
    @given(hello=st.integers(0, 2), pre=st.lists(frames, max_size=6),
           cases=st.lists(st.one_of(case, distinct), min_size=1, max_size=3))
    def run(hello: int, pre: list[bytes], cases: list) -> None:
        before_auth(owner, hello, pre)
        expanded(owner, entry.cache_id, data, cases)

    if args.seed is not None:
        from hypothesis import seed as hseed

        run = hseed(args.seed)(run)
    try:
        run()
    finally:
        owner.close()
    print(f"fuzz_owner: {args.examples} examples, no finding")


if __name__ == "__main__":
    main()
