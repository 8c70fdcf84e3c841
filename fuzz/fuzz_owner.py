"""Fuzz a live owner: frame sequences before authentication, and requests with duplicated and
expanded spans after it.

Run by hand, not in CI (the tests/faults fuzzers run a fixed set in CI):

    python fuzz/fuzz_owner.py                      # 2000 hypothesis examples
    python fuzz/fuzz_owner.py --examples 50000 --seed 3

The owner is an in-process engine (the core, ``NativeEngine``) with a shared secret,
listening on loopback; the fuzzer is a raw socket. What counts as a finding (raised, with
the input):

1. before a valid AUTH (frames of its own and every golden frame of tests/vectors/frames.txt):
   any answer but WELCOME or ERROR, a peer registered as inbound
   (``NativeEngine.inbound_peers``: any cluster id but the linked decoder's), or the
   connection left open once the fuzzer stopped sending;
2. after it: a request with duplicated or expanded spans (one tensor index repeated, many
   one-byte spans, a checksum asked for) answered by anything but ERROR or the exact bytes,
   or answered later than ANSWER_BOUND seconds (its cost must be bounded by its size);
3. the owner crashing, or not serving an honest pull afterwards;
4. reverse-channel HELLOs (any cluster id, feature bits, proof and token, with or without the
   secret, or the token of the fuzzer's own control channel under the decoder's id): one
   adopted without the link token of a live control channel of its cluster id, the linked
   decoder's reverse channel displaced, or the owner's push to that decoder no longer
   landing there (issue 21 item 1);
5. WRITEs by raw address (any address near or inside a private or a public cache, any
   length, 0 included): anything but the one refusal (LLM_PARAM_INVALID, one message)
   unless the span lies inside one tensor of a remote-accessible cache, or a byte of the private
   cache changed (issue 21 item 2: no address oracle).
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

from datadist.core.config import EngineConfig  # noqa: E402
from datadist.core.layout import Geometry, layer_tensor_indices, plan_blocks  # noqa: E402
from datadist.core.native import NativeEngine  # noqa: E402
from datadist.wire import auth  # noqa: E402
from datadist.wire import protocol as p  # noqa: E402

SECRET = b"fuzz-owner"
DECODER_ID = 2
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


def authenticate(cli: Client, owner_id: int, cluster_id: int | None = None,
                 features: int = 0, token: bytes = b"") -> p.Message | None:
    """HELLO (with ``features`` and ``token`` after the nonce), WELCOME, AUTH: the answer to
    AUTH when ``features`` are given (a reverse channel), else checked to be OK."""
    nonce = auth.nonce()
    me = owner_id + 1 if cluster_id is None else cluster_id
    cli.send(p.encode(p.Hello(me, 2, 1, 0, b"\x01" * 16, p.FEATURE_AUTH | features,
                              nonce + token), 1))
    got = cli.next()
    if got is None or not isinstance(got[1], p.Welcome):
        if features:
            return got[1] if got is not None else None
        raise Finding(f"a valid Hello was refused: {got!r}")
    welcome = got[1]
    server_nonce, _ = auth.split_server_proof(p.split_token(welcome.proof, welcome.features)[0])
    proof = auth.client_proof(SECRET, nonce, server_nonce, owner_id, me)
    cli.send(p.encode(p.Auth(proof), 2))
    if features:
        got = cli.next()
        return got[1] if got is not None else None
    if cli.next() != (2, p.Ok()):
        raise Finding("a valid proof was refused")
    return None
    proof = auth.client_proof(SECRET, nonce, server_nonce, owner_id, owner_id + 1)
    cli.send(p.encode(p.Auth(proof), 2))
    if cli.next() != (2, p.Ok()):
        raise Finding("a valid proof was refused")


def before_auth(owner: NativeEngine, hello: int, frames: list[bytes]) -> None:
    cli = Client(owner.listen_address[1])
    try:
        if hello:
            flags, nonce = (p.FEATURE_AUTH, auth.nonce()) if hello == 2 else (0, b"")
            cli.send(p.encode(p.Hello(9, 2, 1, 0, b"\x01" * 16, flags, nonce), 1))
            got = cli.next()
            if got is None or not isinstance(got[1], (p.Welcome, p.Error)):
                raise Finding(f"answered {got!r} to a Hello")
            if strangers(owner):
                raise Finding(f"registered {strangers(owner)} on its Hello, before any proof")
        cli.send(b"".join(frames))
        with contextlib.suppress(OSError):  # the owner may have closed it already: fine
            cli.sock.shutdown(socket.SHUT_WR)
        while (item := cli.next()) is not None:
            if not isinstance(item[1], (p.Welcome, p.Error)):
                raise Finding(f"answered {item!r} before authentication")
        if strangers(owner):
            raise Finding(f"registered {strangers(owner)} without a valid proof")
    finally:
        cli.close()


def expanded(owner: NativeEngine, cache_id: int, data: np.ndarray, cases: list) -> None:
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


OWN = b"own"  # a token strategy: the one the owner issued the fuzzer's own control channel


def own_control(owner: NativeEngine, cluster_id: int) -> tuple[Client, bytes]:
    """A control channel of the fuzzer's own under ``cluster_id`` (with the secret: the id
    is only a claim), and the link token the owner issued it."""
    cli = Client(owner.listen_address[1])
    nonce = auth.nonce()
    cli.send(p.encode(p.Hello(cluster_id, 2, 1, 0, b"\x01" * 16, p.FEATURE_AUTH, nonce), 1))
    got = cli.next()
    if got is None or not isinstance(got[1], p.Welcome):
        raise Finding(f"a valid Hello was refused: {got!r}")
    welcome = got[1]
    rest, token = p.split_token(welcome.proof, welcome.features)
    server_nonce, _ = auth.split_server_proof(rest)
    cli.send(p.encode(p.Auth(auth.client_proof(SECRET, nonce, server_nonce,
                                               owner.config.cluster_id, cluster_id)), 2))
    if cli.next() != (2, p.Ok()):
        raise Finding("a valid proof was refused")
    return cli, token


def reverse_hellos(owner: NativeEngine, decoder: NativeEngine, dst: np.ndarray, src_cache: int,
                   hellos: list[tuple[int, int, bytes, bool]]) -> None:
    """Finding 4: strangers' reverse HELLOs (cluster id, extra feature bits, token, with the
    secret or not) never take a reverse channel over nor add one; the push still lands."""
    real = owner.get_link(DECODER_ID)
    before = set(owner.reverse_ids())
    for cluster_id, extra, token, with_secret in hellos:
        control = None
        if token == OWN:  # a second control channel under the linked decoder's id
            cluster_id, with_secret = DECODER_ID, True
            control, token = own_control(owner, DECODER_ID)
        cli = Client(owner.listen_address[1])
        try:
            features = p.FEATURE_REVERSE | extra
            if with_secret:
                got = authenticate(cli, owner.config.cluster_id, cluster_id, features, token)
            else:
                cli.send(p.encode(p.Hello(cluster_id, 2, 1, 0, b"\x01" * 16,
                                          features & ~p.FEATURE_AUTH, token), 1))
                item = cli.next()
                got = item[1] if item is not None else None
            if got is not None and not isinstance(got, (p.Error, p.Welcome)):
                raise Finding(f"answered {got!r} to a reverse Hello")
            if isinstance(got, p.Error) and got.code != int(p_code_link_failed()):
                raise Finding(f"refused a reverse Hello with {got!r}")
        finally:
            cli.close()
            if control is not None:
                control.close()
        if owner.get_link(DECODER_ID) != real or set(owner.reverse_ids()) != before:
            raise Finding(f"a stranger's reverse Hello (cluster {cluster_id}, features "
                          f"{features:#x}, token {token.hex()}) was adopted")
    dst[...] = 0
    plan = plan_blocks(Geometry(1, TENSOR_BYTES, 64, True), [1], [2],
                       layer_tensor_indices(1, None, None, 1))
    owner.push(DECODER_ID, p.KeyRef(p.KeyKind.CACHE_ID, decoder_cache_id(decoder), 0), 0,
               plan, src_cache, 5.0)
    if not dst[0, 64:128].any():  # remote block 1 <- our block 2
        raise Finding("the owner's push no longer reaches the linked decoder")


def strangers(owner: NativeEngine) -> set[int]:
    """Cluster ids with a live control channel to the owner other than the linked decoder's:
    only a valid proof may make one."""
    return {link.cluster_id for link in owner.inbound_peers()} - {DECODER_ID}


def p_code_link_failed() -> int:
    from datadist.core.errors import Code

    return int(Code.LINK_FAILED)


def decoder_cache_id(decoder: NativeEngine) -> int:
    return decoder.cache_ids()[0]


def address_writes(owner: NativeEngine, private: np.ndarray, public: np.ndarray,
                   spans: list[tuple[int, int, int]]) -> None:
    """Finding 5: a write by address is one refusal wherever it points, unless it lies inside
    one tensor of the public cache; the private cache never changes."""
    from datadist.core.errors import Code

    bases = {0: 0x1000, 1: int(private.ctypes.data), 2: int(public.ctypes.data)}
    cli = Client(owner.listen_address[1])
    refusals = set()
    try:
        authenticate(cli, owner.config.cluster_id)
        for rid, (where, delta, n) in enumerate(spans, start=10):
            addr = (bases[where] + delta) % 2**64
            msg = p.Write(p.KeyRef(p.KeyKind.ADDRESS), 0, 0, np.zeros(1, np.uint32),
                          np.array([addr], np.uint64), np.array([n], np.uint64))
            cli.send(p.encode(msg, rid))
            got = cli.next()
            if got is None or got[0] != rid:
                raise Finding(f"no answer to a write at {addr:#x} +{n}: {got!r}")
            inside = n >= 1 and any(  # wholly inside a tensor of a remote-accessible cache
                int(b) <= addr and addr + n <= int(b) + e.geometry.tensor_bytes
                for e in map(owner.cache, owner.cache_ids()) if e.remote_accessible
                for b in e.addrs)
            if isinstance(got[1], p.Ok):
                if not inside:
                    raise Finding(f"accepted a write at {addr:#x} +{n} outside every "
                                  "remote-accessible tensor")
                cli.send(b"\0" * n)
                if cli.next() != (rid, p.Ok()):
                    raise Finding("a write's bytes were not confirmed")
            elif isinstance(got[1], p.Error):
                if inside:
                    raise Finding(f"refused a write at {addr:#x} +{n} inside a public tensor")
                refusals.add((got[1].code, got[1].message))
            else:
                raise Finding(f"answered {got!r} to a write by address")
        if len(refusals) > 1 or any(c != int(Code.PARAM_INVALID) for c, _ in refusals):
            raise Finding(f"address writes are answered in {len(refusals)} ways: {refusals}")
        if private.any():
            raise Finding("a write by address changed the private cache")
    finally:
        cli.close()


def main() -> None:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()

    owner = NativeEngine(EngineConfig(cluster_id=1, role=1, listen=("127.0.0.1", 0), secret=SECRET))
    # a decoder linked to the owner (its reverse channel is the owner's end), and two caches
    # of the owner's own for address writes: one private, one public
    decoder = NativeEngine(EngineConfig(cluster_id=DECODER_ID, role=2, secret=SECRET))
    dst = np.zeros((1, TENSOR_BYTES), np.uint8)
    decoder.register(Geometry(1, TENSOR_BYTES, 64), [dst.ctypes.data], placement=0)
    decoder.link(1, *owner.listen_address, 5.0)
    private = np.zeros(TENSOR_BYTES, np.uint8)
    public = np.zeros(TENSOR_BYTES, np.uint8)
    owner.register(Geometry(1, TENSOR_BYTES, 1), [private.ctypes.data], placement=0,
                   remote_accessible=False)
    owner.register(Geometry(1, TENSOR_BYTES, 1), [public.ctypes.data], placement=0)
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

    token = st.one_of(st.just(b""), st.binary(min_size=16, max_size=16), st.binary(max_size=40),
                      st.just(OWN))
    reverse_hello = st.tuples(
        st.sampled_from([DECODER_ID, DECODER_ID + 1, 1, 0, 2**64 - 1]),
        st.sampled_from([0, p.FEATURE_TOKEN, p.FEATURE_TOKEN | p.FEATURE_LOCAL, 0xFFFFFFF0]),
        token, st.booleans())
    address_span = st.tuples(
        st.integers(0, 2),
        st.one_of(st.integers(-64, TENSOR_BYTES + 64), st.integers(-2**63, 2**63)),
        st.one_of(st.integers(0, 64), st.sampled_from([TENSOR_BYTES, 2**64 - 1])))

    @settings(max_examples=args.examples, deadline=None, database=None,
              derandomize=args.seed is None, suppress_health_check=list(HealthCheck))
    @given(hello=st.integers(0, 2), pre=st.lists(frames, max_size=6),
           cases=st.lists(st.one_of(case, distinct), min_size=1, max_size=3),
           hellos=st.lists(reverse_hello, max_size=3),
           writes=st.lists(address_span, max_size=8))
    def run(hello: int, pre: list[bytes], cases: list,
            hellos: list[tuple[int, int, bytes, bool]],
            writes: list[tuple[int, int, int]]) -> None:
        before_auth(owner, hello, pre)
        expanded(owner, entry.cache_id, data, cases)
        reverse_hellos(owner, decoder, dst, entry.cache_id, hellos)
        address_writes(owner, private, public, writes)

    if args.seed is not None:
        from hypothesis import seed as hseed

        run = hseed(args.seed)(run)
    try:
        run()
    finally:
        decoder.close()
        owner.close()
    print(f"fuzz_owner: {args.examples} examples, no finding")


if __name__ == "__main__":
    main()
