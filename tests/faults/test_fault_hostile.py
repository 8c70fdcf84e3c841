"""Hostile input at a live PROMPT server (a separate process), from a raw socket client.

Two property-based fuzzers (hypothesis):

* ``test_hostile_reads``: after a valid Hello, sequences of Read / Write / Release / Ping
  requests with random key kinds, cache ids, batch indexes, block sizes, flags, tensor
  indexes, offsets and lengths. An independent model of the owner's rules (``judge``) says
  for each request whether it must be served or refused; the server must agree exactly, a
  served Read must carry exactly the registered bytes it names, and a Grant must point at
  exactly those bytes (checked by reading them from the server with process_vm_readv).
* ``test_hostile_frames``: random, truncated, oversized, retyped and bit-flipped frames,
  with or without a Hello first. Whatever the server answers must be well-formed, it must
  close the connection once we stop sending, and no reply may carry a byte from outside the
  registered memory.

Outside-memory check: every registered tensor sits between guard bytes of 0xEE, and no
registered byte (nor any byte the fuzzer sends, which a fuzzed Write could land) is 0xEE. So
no 0xEE byte may ever come back in a ReadData or be readable in a granted span. Afterwards the
guards are still intact (no write escaped either), the server still serves a well-behaved
decoder correctly, and no lease is left behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import struct
import time
import zlib
from dataclasses import dataclass

import numpy as np
import pytest
from fault_harness import (
    MAX_GRANTS_PER_CONNECTION,
    Hang,
    Peer,
    Peers,
    RawClient,
    link,
    local_name,
    measured,
)
from fault_peer import GUARD_BYTE, pattern
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from datadist.core.errors import Code
from datadist.core.layout import make_iov
from datadist.core.local import vm_copy
from datadist.wire import protocol as p

MAX = 2**64 - 1
U32MAX = 2**32 - 1
BLK = {"num_tensors": 3, "blocks": 8, "block_bytes": 1024}  # blocks cache, model_id 0
KV = {"num_tensors": 2, "blocks": 4, "block_bytes": 2048}  # contiguous, 4 keyed slots
REQ_BASE = 1000  # slot i of KV is CacheKey(req_id=1000 + i, model_id=0)
EXAMPLES = 300
MAX_SPANS = 1 << 22  # spans (tensors x spans) one request may name, after the expansion


@dataclass
class CacheInfo:
    cache_id: int
    addrs: list[int]
    num_tensors: int
    tensor_bytes: int
    units: int
    unit_bytes: int
    seed: int
    data: list[np.ndarray]  # the pattern each tensor holds


@dataclass
class Server:
    peer: Peer
    pid: int
    port: int
    cluster_id: int
    blk: CacheInfo
    kv: CacheInfo

    def tensor_ranges(self) -> list[tuple[int, int]]:
        return [(a, a + c.tensor_bytes) for c in (self.blk, self.kv) for a in c.addrs]


def _start_server(peers: Peers) -> Server:
    prompt = peers.prompt()  # not forced to tcp: grants are served on its local channel
    pid = prompt.pid
    infos = []
    for name, geo, seed, keys in (("blk", BLK, 11, 0), ("kv", KV, 12, 4)):
        r = prompt.call("register", name=name, seed=seed, guard=4096, keys=keys, **geo)
        tb = geo["blocks"] * geo["block_bytes"]
        infos.append(CacheInfo(r["cache_id"], r["addrs"], geo["num_tensors"], tb,
                               geo["blocks"], geo["block_bytes"], seed,
                               [pattern(seed, t, 0, tb) for t in range(geo["num_tensors"])]))
    assert prompt.port is not None and prompt.cluster_id is not None
    return Server(prompt, pid, prompt.port, prompt.cluster_id, *infos)


# ------------------------------------------------------------------------------ raw client


# ------------------------------------------------------------------------------ the model


@dataclass(frozen=True)
class Req:
    kind: int
    a: int
    b: int
    c: int
    unit_bytes: int
    flags: int
    tensors: tuple[int, ...]
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    layout: int = 0

    def message(self, write: bool = False) -> p.Read | p.Write:
        key = p.KeyRef(self.kind, self.a, self.b, self.c)  # type: ignore[arg-type]
        arrays = (np.array(self.tensors, dtype=np.uint32),
                  np.array(self.offsets, dtype=np.uint64),
                  np.array(self.lengths, dtype=np.uint64))
        if write:
            return p.Write(key, self.unit_bytes, self.flags, *arrays, self.layout)
        return p.Read(key, self.unit_bytes, self.flags, *arrays,  # type: ignore[arg-type]
                      self.layout)

    def frame(self, rid: int, write: bool = False) -> bytes:
        """The encoded frame, including what a well-behaved encoder refuses to produce
        (unknown key kinds or flags, a Read by raw addresses): the frame is encoded with a
        legal kind and no flags, then patched (the key kind is the payload's first byte, the
        flags u32 follow the key, unit_bytes and layout: docs/protocol.md)."""
        legal_kind = self.kind if self.kind in (1, 2, 3) or (write and self.kind == 4) else 3
        legal = dataclasses.replace(self, kind=legal_kind, flags=0).message(write)
        data = bytearray(p.encode(legal, rid))
        data[p.HEADER_SIZE] = self.kind
        struct.pack_into("<I", data, p.HEADER_SIZE + 25 + 8 + 8, self.flags)
        return bytes(data)


@dataclass(frozen=True)
class Verdict:
    outcome: str  # "fatal" (Error, then the server hangs up), "error", "data" or "grant"
    bases: tuple[int, ...] = ()  # absolute base of each requested tensor's spans


GRANT, CHECKSUM = 1, 4
KNOWN_READ_FLAGS = 1 | 2 | 4  # GRANT, SHM, CHECKSUM
UINT8_DTYPE_WORD = 5  # the high word of a DT_UINT8 layout tag (dtype value 4, plus one)


def judge(srv: Server, r: Req, write: bool = False) -> Verdict:
    """The owner's rules, written down independently of datadist's registry.

    Layout tags: the generator only sends 0 (no check) or tags whose dtype word is not
    DT_UINT8's, which every owner check must refuse; raw-address requests skip that check.
    """
    if r.kind not in (1, 2, 3, 4) or r.flags & ~(0 if write else KNOWN_READ_FLAGS):
        return Verdict("fatal")
    ok = "grant" if r.flags & GRANT and not write else "data"
    if r.kind == 4 and not write:  # raw addresses are for writes (transfer_cache_async) only
        return Verdict("fatal")
    if 0 in r.lengths:  # a 0-byte span moves nothing: refused, whatever else it names
        return Verdict("error")
    if r.kind == 4:  # raw addresses: one pseudo tensor 0, spans inside one registered tensor
        if r.tensors != (0,) or not r.offsets:
            return Verdict("error")
        first = min(r.offsets)
        hit = [(lo, hi) for lo, hi in srv.tensor_ranges() if lo <= first < hi]
        if not hit:
            return Verdict("error")
        lo, hi = hit[0]
        for off, n in zip(r.offsets, r.lengths, strict=True):
            if n > hi - lo or off - lo > hi - lo - n:
                return Verdict("error")
        return Verdict(ok, (0,))
    cache: CacheInfo | None = None
    slot = -1
    if r.kind == 1:  # CacheKey: req_id a (or prefix_id c), model_id b
        if r.a != MAX and r.b == 0 and REQ_BASE <= r.a < REQ_BASE + srv.kv.units:
            cache, slot = srv.kv, r.a - REQ_BASE
        # prefix ids are never bound here; the padding key (both MAX) names nothing
    elif r.kind == 2:  # cache id a, batch index b
        for c in (srv.blk, srv.kv):
            if r.a == c.cache_id:
                cache, slot = c, r.b
    else:  # blocks cache by model_id b
        if r.b == 0:
            cache = srv.blk
    if cache is None or r.layout:
        return Verdict("error")
    if any(t >= cache.num_tensors for t in r.tensors):
        return Verdict("error")
    if len(r.tensors) * len(r.offsets) > MAX_SPANS or len(set(r.tensors)) != len(r.tensors):
        return Verdict("error")  # over the span cap, or a tensor named twice
    if slot < 0:
        if r.unit_bytes not in (0, cache.unit_bytes):
            return Verdict("error")
        base, limit = 0, cache.tensor_bytes
    else:
        if slot >= cache.units:
            return Verdict("error")
        base = slot * cache.unit_bytes
        limit = cache.tensor_bytes - base
    for off, n in zip(r.offsets, r.lengths, strict=True):
        if n > limit or off > limit - n:
            return Verdict("error")
    return Verdict(ok, tuple(cache.addrs[t] + base for t in r.tensors))


def memory(srv: Server, addr: int, n: int) -> bytes:
    """What the server's registered memory holds at ``[addr, addr + n)`` (it must be inside
    one registered tensor: the model asserts what the server may hand out)."""
    for c in (srv.blk, srv.kv):
        for t, lo in enumerate(c.addrs):
            if lo <= addr and addr + n <= lo + c.tensor_bytes:
                return c.data[t][addr - lo:addr - lo + n].tobytes()
    raise AssertionError(f"[{addr:#x}, +{n}) is outside every registered tensor")


def expected_bytes(srv: Server, v: Verdict, r: Req) -> bytes:
    spans = list(zip(r.offsets, r.lengths, strict=True))
    return b"".join(memory(srv, b + o, n) for b in v.bases for o, n in spans if n)


def read_granted(srv: Server, r: Req, bases: np.ndarray) -> bytes:
    """Read the granted spans out of the server, as a same-host decoder would."""
    lens = np.array(r.lengths * len(bases), dtype=np.uint64)
    if not len(lens) or not lens.any():
        return b""
    remote_bases = np.array([int(b) + o for b in bases for o in r.offsets], dtype=np.uint64)
    out = np.zeros(int(lens.sum()), dtype=np.uint8)
    local_bases = out.ctypes.data + np.concatenate(([0], np.cumsum(lens)[:-1])).astype(np.uint64)
    vm_copy(srv.pid, make_iov(local_bases, lens), make_iov(remote_bases, lens))
    return out.tobytes()


# ------------------------------------------------------------------------------ strategies


def u64() -> st.SearchStrategy[int]:
    return st.one_of(st.sampled_from([0, 1, 2**31, U32MAX, 2**32, 2**63, MAX - 1, MAX]),
                     st.integers(0, MAX))


def mostly(good: st.SearchStrategy, bad: st.SearchStrategy) -> st.SearchStrategy:
    """``good`` seven times in eight: hostile enough, yet most requests reach the checks
    that come after the first one they would fail."""
    return st.integers(0, 7).flatmap(lambda i: good if i else bad)


def _foreign_layout(tag: int) -> int:
    """A layout tag of another dtype than DT_UINT8 (see ``judge``)."""
    return tag ^ (1 << 32) if tag >> 32 == UINT8_DTYPE_WORD else tag


def requests(srv: Server) -> st.SearchStrategy[Req]:
    limit = max(srv.blk.tensor_bytes, srv.kv.tensor_bytes)
    span = mostly(st.one_of(st.integers(0, 3000), st.integers(0, limit + 16)),
                  st.one_of(st.sampled_from([limit - 1, limit, limit + 1, srv.kv.unit_bytes]),
                            u64()))
    bases = [lo for lo, _ in srv.tensor_ranges()]
    address = mostly(st.builds(lambda b, d: max(0, b + d), st.sampled_from(bases),
                               st.integers(-64, limit + 64)), u64())

    @st.composite
    def req(draw: st.DrawFn) -> Req:
        kind = draw(mostly(st.sampled_from([1, 2, 3, 4]), st.integers(0, 255)))
        if kind == 1:
            a = draw(mostly(st.integers(REQ_BASE - 1, REQ_BASE + 4), st.one_of(st.just(MAX),
                                                                              u64())))
            b = draw(mostly(st.just(0), u64()))
            c = draw(mostly(st.just(MAX), st.one_of(st.just(REQ_BASE), u64())))
        elif kind == 2:
            a = draw(mostly(st.sampled_from([srv.blk.cache_id, srv.kv.cache_id]),
                            st.one_of(st.sampled_from([0, srv.kv.cache_id + 50]), u64())))
            b, c = draw(mostly(st.integers(0, 9), u64())), draw(u64())
        else:
            a, b, c = draw(u64()), draw(mostly(st.just(0), st.one_of(st.just(1), u64()))), \
                draw(u64())
        unit = draw(mostly(st.sampled_from([0, 0, srv.blk.unit_bytes, srv.kv.unit_bytes]),
                           st.integers(0, U32MAX)))
        flags = draw(mostly(st.integers(0, KNOWN_READ_FLAGS), st.integers(0, U32MAX)))
        layout = draw(mostly(st.just(0), u64().map(_foreign_layout)))
        if kind == 4:  # spans must share one tensor: fewer and shorter ones, mostly
            n = draw(st.integers(0, 3))
            tensors = draw(mostly(st.just([0]), st.lists(st.integers(0, 3), max_size=3)))
            offsets = draw(st.lists(address, min_size=n, max_size=n))
            lengths = draw(st.lists(mostly(st.integers(0, 512), span), min_size=n, max_size=n))
        else:
            n = draw(st.integers(0, 5))
            # distinct mostly (a tensor named twice is refused), sometimes repeated
            tensors = draw(mostly(st.lists(mostly(st.integers(0, 1), st.integers(0, U32MAX)),
                                           max_size=4, unique=True),
                                  st.lists(st.integers(0, 1), min_size=2, max_size=4)))
            offsets = draw(st.lists(span, min_size=n, max_size=n))
            lengths = draw(st.lists(span, min_size=n, max_size=n))
        return Req(kind, a, b, c, unit, flags, tuple(tensors), tuple(offsets), tuple(lengths),
                   layout)

    return req()


def exchange(srv: Server, cli: RawClient, ops: list, rids: list[int],
             counts: dict[str, int]) -> None:
    """One connection: Hello, then each op; every answer checked against ``judge``.
    Grants held (not released) on the connection count against the owner's cap."""
    cli.hello(srv.cluster_id + 1)
    held = 0
    for (what, arg), rid in zip(ops, rids, strict=False):
        if what == "ping":
            cli.send(p.encode(p.Ping(arg), rid))
            got = cli.next()
            assert got == (rid, p.Pong(arg)), got
            continue
        if what == "release":  # unknown lease ids are ignored, no answer
            cli.send(p.encode(p.Release(*arg), rid))
            continue
        if what == "expanded":  # a small frame naming a huge expansion: refused, cheaply
            cli.send(expanded_frame(srv, *arg, rid))
            got = cli.next()
            assert got is not None and got[0] == rid and isinstance(got[1], p.Error), got
            counts["expanded:error"] = counts.get("expanded:error", 0) + 1
            continue
        req: Req = arg
        write = what == "write"
        if write and req.flags == p.WRITE_EAGER:
            continue  # its bytes follow it: the eager WRITE's own tests (test_eager_write.py)
        v = judge(srv, req, write)
        if write and v.outcome == "data":
            continue  # an accepted write would change the memory the model checks
        tag = f"{'address' if req.kind == 4 and not write else what}:{v.outcome}"
        counts[tag] = counts.get(tag, 0) + 1
        cli.send(req.frame(rid, write))
        got = cli.next()
        assert got is not None, f"the server hung up on {req} ({v.outcome})"
        got_rid, msg = got
        if v.outcome == "grant" and held >= MAX_GRANTS_PER_CONNECTION:
            assert isinstance(msg, p.Error) and msg.code == Code.LINK_BUSY, msg
            continue
        if v.outcome in ("fatal", "error"):
            assert isinstance(msg, p.Error), f"{req} must be refused, got {msg}"
            if v.outcome == "fatal":
                assert cli.drain() == [], "frames after a fatal error"
                return
            assert got_rid == rid
            continue
        assert got_rid == rid, (got_rid, rid)
        want = expected_bytes(srv, v, req)
        if v.outcome == "data":
            assert isinstance(msg, p.ReadData), f"{req} must be served, got {msg}"
            assert msg.nbytes == len(want), (msg, len(want))
            if want:
                raw = cli.next()
                assert raw is not None and isinstance(raw[1], bytes), raw
                assert GUARD_BYTE not in raw[1], "bytes from outside the cache"
                assert raw[1] == want, f"wrong bytes for {req}"
        else:
            assert isinstance(msg, p.Grant), f"{req} must be granted, got {msg}"
            assert tuple(int(b) for b in msg.bases) == v.bases, (msg.bases, v.bases)
            granted = read_granted(srv, req, msg.bases)
            assert GUARD_BYTE not in granted and granted == want
        if req.flags & CHECKSUM:
            got = cli.next()
            assert got is not None and got[0] == rid, got
            assert got[1] == p.Checksum(zlib.crc32(want), len(want)), (got, req)
        if v.outcome == "grant" and rid % 2:
            cli.send(p.encode(p.Release(msg.lease_id, True), 0))
        elif v.outcome == "grant":
            held += 1


def expanded_frame(srv: Server, kind: int, repeats: int, spans: int, write: bool,
                   rid: int) -> bytes:
    """A Read or Write of a few KiB whose tensors x spans expansion is what costs: one tensor
    index repeated ``repeats`` times (or, with ``repeats`` 0, more distinct tensors than the
    cache has) times ``spans`` one-byte spans, with a checksum asked for. The owner must
    refuse it (a tensor named twice, the span cap, a tensor out of range) before any
    per-span work, and keep the connection."""
    if kind == 3:
        key = p.KeyRef(p.KeyKind.BLOCKS_KEY, 0, 0, 0)
    else:
        key = p.KeyRef(p.KeyKind.CACHE_ID, srv.kv.cache_id, 0, 0)
    tensors = (np.zeros(repeats, np.uint32) if repeats
               else np.arange(4096, dtype=np.uint32))
    offsets = np.arange(spans, dtype=np.uint64) % 1024
    lengths = np.ones(spans, np.uint64)
    if write:
        return p.encode(p.Write(key, 0, 0, tensors, offsets, lengths), rid)
    return p.encode(p.Read(key, 0, p.ReadFlags.CHECKSUM, tensors, offsets, lengths), rid)


def expansions() -> st.SearchStrategy[tuple[int, int, int, bool]]:
    return st.tuples(st.sampled_from([2, 3]), st.one_of(st.integers(2, 4096), st.just(0)),
                     st.integers(1, 4096), st.booleans())


# ------------------------------------------------------------------------------ afterwards


def _assert_server_sound(peers: Peers, srv: Server, *, pattern_intact: bool) -> None:
    """Alive, guards intact, serves a good decoder the bytes it holds, no lease left."""
    for name in ("blk", "kv"):
        check = srv.peer.call("check", name=name)
        assert check["guards"], f"a write escaped the registered memory of {name}"
        if pattern_intact:
            assert check["pattern"], f"the registered memory of {name} changed"
    dec = peers.decoder(env={"DATADIST_TRANSPORT": "tcp"})
    dec.call("register", name="dst", **BLK)
    assert link(dec, srv.peer)["code"] == "LLM_SUCCESS"
    every = list(range(BLK["blocks"]))
    r = dec.call("pull", cid=srv.cluster_id, dst="dst", src_blocks=every, dst_blocks=every,
                 seed=srv.blk.seed if pattern_intact else None)
    assert r["ok"], r
    if pattern_intact:
        assert r["verified"], r
    assert dec.call("check", name="dst")["digest"] == srv.peer.call("check", name="blk")["digest"]
    assert dec.call("unlink", clusters=[[srv.cluster_id, srv.peer.ip, srv.port]],
                    force=True)["code"] == "LLM_SUCCESS"
    for name in ("blk", "kv"):
        u = srv.peer.call("unregister", name=name, timeout=60)
        assert u["elapsed"] < 5, f"a lease on {name} outlived its connection: {u}"


# Derandomized: CI runs the same examples every time (the coverage assertions below stay
# stable); DATADIST_FUZZ_EXAMPLES=n runs n fresh random examples by hand.
_BY_HAND = int(os.environ.get("DATADIST_FUZZ_EXAMPLES", "0"))
_SETTINGS = settings(max_examples=_BY_HAND or EXAMPLES, deadline=None, database=None,
                     derandomize=not _BY_HAND,
                     suppress_health_check=[HealthCheck.too_slow,
                                            HealthCheck.function_scoped_fixture])


# ------------------------------------------------------------------------------ tests


@pytest.mark.timeout(120)
def test_hostile_reads(peers: Peers) -> None:
    srv = _start_server(peers)
    counts: dict[str, int] = {}

    writes = st.tuples(mostly(st.just(0), st.integers(1, U32MAX)), requests(srv)).map(
        lambda fr: dataclasses.replace(fr[1], flags=fr[0]))
    op = st.one_of(
        st.tuples(st.just("read"), requests(srv)),
        st.tuples(st.just("read"), st.one_of(requests(srv), served_reads(srv))),
        st.tuples(st.just("write"), writes),
        st.tuples(st.just("release"), st.tuples(u64(), st.booleans())),
        mostly(st.tuples(st.just("ping"), u64()),
               st.tuples(st.just("expanded"), expansions())),
    )

    # Generated examples vary with the server's addresses: one served read and one grant
    # (held unreleased, then over the cap) are always among them.
    good = Req(2, srv.blk.cache_id, 0, 0, 0, 0, (0, 1), (0, 100), (64, 28))
    granted = dataclasses.replace(good, flags=GRANT)

    @_SETTINGS
    @given(ops=st.lists(op, min_size=1, max_size=6),
           rids=st.lists(st.integers(1, U32MAX), min_size=6, max_size=6))
    @example(ops=[("read", good)] + [("read", granted)] * 5, rids=[2, 4, 6, 8, 10, 12])
    # A 0-byte span is refused whatever else the request names (CI once drew one with no
    # tensors named, which the model had let through).
    @example(ops=[("read", Req(3, 0, 0, 0, 0, f, (), (8191,), (0,), 0)) for f in (0, GRANT)]
             + [("read", dataclasses.replace(good, lengths=(64, 0)))], rids=[1, 3, 5, 7, 9, 11])
    def run(ops: list, rids: list[int]) -> None:
        cli = RawClient(local_name(srv.pid, srv.cluster_id))  # grants: local channel only
        try:
            exchange(srv, cli, ops, rids, counts)
        except Hang as e:
            raise Hang(f"{e}; requests: {ops}") from None
        finally:
            cli.close()

    t0 = time.monotonic()
    run()
    measured(f"hostile reads: {EXAMPLES} examples {sorted(counts.items())}",
             time.monotonic() - t0, 120)
    # The model must have exercised every outcome, or the test proves little.
    for outcome in ("read:data", "read:grant", "read:error", "read:fatal", "write:error",
                    "write:fatal", "address:fatal", "expanded:error"):
        assert counts.get(outcome, 0) > 0, f"no {outcome} case was generated: {counts}"
    _assert_server_sound(peers, srv, pattern_intact=True)


def _template(srv: Server) -> st.SearchStrategy[bytes]:
    """A frame of any type, well-formed or not, that a client could send."""
    msgs = st.one_of(
        requests(srv).map(lambda r: r.frame(7)),
        requests(srv).map(lambda r: dataclasses.replace(r, flags=0).frame(7, write=True)),
        st.builds(lambda c: p.encode(p.Hello(c, 1, 1, 0, b"\x01" * 16), 3), u64()),
        st.builds(lambda x: p.encode(p.Release(x, True), 4), u64()),
        st.builds(lambda x: p.encode(p.Ping(x), 5), u64()),
        st.builds(lambda x: p.encode(p.ReadData(x), 6), u64()),
        st.builds(lambda x: p.encode(p.Grant(x, np.array([1, 2], dtype=np.uint64)), 6), u64()),
        st.builds(lambda b: p.encode(p.Auth(b), 8), st.binary(max_size=40)),
        st.sampled_from([p.encode(p.Bye()), p.encode(p.Ok()), p.encode(p.Error(5, "x"))]),
        expansions().map(lambda a: expanded_frame(srv, *a, 7)),
    )

    @st.composite
    def mutated(draw: st.DrawFn) -> bytes:
        frame = bytearray(draw(msgs))
        how = draw(st.sampled_from(["none", "truncate", "length", "type", "magic",
                                    "version", "flip"]))
        if how == "truncate":
            del frame[draw(st.integers(0, max(0, len(frame) - 1))):]
        elif how == "length":  # oversized, undersized or past MAX_PAYLOAD
            n = draw(st.one_of(st.integers(0, 64), st.sampled_from(
                [p.MAX_PAYLOAD, p.MAX_PAYLOAD + 1, U32MAX]), st.integers(0, U32MAX)))
            frame[8:12] = n.to_bytes(4, "little")
        elif how == "type":
            frame[3] = draw(st.integers(0, 255))
        elif how == "magic":
            frame[0:2] = draw(st.binary(min_size=2, max_size=2))
        elif how == "version":
            frame[2] = draw(st.integers(0, 255))
        elif how == "flip" and len(frame) > 0:
            for _ in range(draw(st.integers(1, 4))):
                i = draw(st.integers(0, len(frame) - 1))
                frame[i] ^= 1 << draw(st.integers(0, 7))
        return bytes(frame)

    return st.one_of(mutated(), st.binary(max_size=64), served_frames(srv))


def served_frames(srv: Server) -> st.SearchStrategy[bytes]:
    """Reads the owner must serve (data or grant), built to fit, so that replies carrying
    memory are common in the frame fuzzer too."""
    return served_reads(srv).map(lambda r: r.frame(9))


def served_reads(srv: Server) -> st.SearchStrategy[Req]:
    """Reads built to fit a cache: the owner must serve them (data or grant)."""

    @st.composite
    def read(draw: st.DrawFn) -> Req:
        if draw(st.booleans()):  # blocks cache by model_id, whole tensors addressable
            cache, kind, a, b = srv.blk, 3, 0, 0
            limit = cache.tensor_bytes
        else:  # contiguous cache by id, from a slot to the end of the tensor
            cache, kind, a = srv.kv, 2, srv.kv.cache_id
            b = draw(st.integers(0, cache.units - 1))
            limit = cache.tensor_bytes - b * cache.unit_bytes
        offsets, lengths = [], []
        for _ in range(draw(st.integers(1, 3))):
            off = draw(st.integers(0, limit - 1))
            offsets.append(off)
            lengths.append(draw(st.integers(1, limit - off)))
        tensors = draw(st.lists(st.integers(0, cache.num_tensors - 1), min_size=1,
                                max_size=3, unique=True))
        r = Req(kind, a, b, 0, 0, draw(st.sampled_from([0, 1, 4, 5])), tuple(tensors),
                tuple(offsets), tuple(lengths))
        assert judge(srv, r).outcome in ("data", "grant"), r
        return r

    return read()


@pytest.mark.timeout(120)
def test_hostile_frames(peers: Peers) -> None:
    srv = _start_server(peers)
    ranges = srv.tensor_ranges()
    stats = {"replies": 0, "data": 0, "grants": 0}

    @_SETTINGS
    @given(greet=st.booleans(), head=st.lists(served_frames(srv), max_size=3),
           chunks=st.lists(_template(srv), min_size=1, max_size=6))
    def run(greet: bool, head: list[bytes], chunks: list[bytes]) -> None:
        # Nothing we send may contain 0xEE: a fuzzed Write may land it in the cache.
        stream = b"".join(head + chunks).replace(bytes([GUARD_BYTE]), b"\xed")
        cli = RawClient(srv.port)
        try:
            if greet:
                cli.hello(srv.cluster_id + 1)
            cli.send(stream)
            with contextlib.suppress(OSError):
                cli.sock.shutdown(socket.SHUT_WR)
            try:
                replies = cli.drain()
            except p.RemoteProtocolError as e:  # pragma: no cover - a server bug
                raise AssertionError(f"the server sent a malformed frame: {e}") from e
            except Hang as e:
                raise Hang(f"{e}; sent: {greet=} {stream!r}") from None
        finally:
            cli.close()
        for _, item in replies:
            stats["replies"] += 1
            if isinstance(item, bytes):
                stats["data"] += 1
                assert GUARD_BYTE not in item, "a reply carried bytes from outside the cache"
            elif isinstance(item, p.Grant):
                stats["grants"] += 1
                for b in item.bases:
                    assert any(lo <= int(b) <= hi for lo, hi in ranges), \
                        f"granted base {int(b):#x} outside every registered tensor"
            else:
                assert isinstance(item, (p.Welcome, p.Error, p.ReadData, p.Pong, p.Ok,
                                         p.Checksum)), item

    t0 = time.monotonic()
    run()
    measured(f"hostile frames: {EXAMPLES} examples {stats}", time.monotonic() - t0, 120)
    assert stats["data"] + stats["grants"] > 0, f"no reply ever carried memory: {stats}"
    _assert_server_sound(peers, srv, pattern_intact=False)


SECRET = "fuzz-secret"


@pytest.mark.timeout(120)
def test_hostile_frames_before_authentication(peers: Peers) -> None:
    """A PROMPT with a shared secret: a client sends a Hello (asking to authenticate, or
    not, or none at all), then anything: requests it must not be served, Auth frames with
    wrong proofs, oversized and truncated frames. Until a valid proof, the only answers
    are Welcome and Error; then the server hangs up. No reply ever carries memory, and an
    honest decoder with the secret is served afterwards."""
    env = {"DATADIST_TRANSPORT": "tcp", "DATADIST_AUTH_SECRET": SECRET}
    prompt = peers.prompt(env=env)
    r = prompt.call("register", name="blk", seed=11, guard=4096, keys=0, **BLK)
    srv = Server(prompt, prompt.pid, prompt.port, prompt.cluster_id,  # type: ignore[arg-type]
                 CacheInfo(r["cache_id"], r["addrs"], BLK["num_tensors"],
                           BLK["blocks"] * BLK["block_bytes"], BLK["blocks"],
                           BLK["block_bytes"], 11, []),
                 CacheInfo(r["cache_id"], r["addrs"], BLK["num_tensors"],
                           BLK["blocks"] * BLK["block_bytes"], BLK["blocks"],
                           BLK["block_bytes"], 11, []))
    stats = {"welcome": 0, "error": 0, "closed": 0}
    hellos = st.sampled_from(["none", "plain", "auth"])

    @_SETTINGS
    @given(hello=hellos, chunks=st.lists(_template(srv), min_size=1, max_size=6))
    def run(hello: str, chunks: list[bytes]) -> None:
        cli = RawClient(srv.port)
        try:
            if hello != "none":
                flags, nonce = (p.FEATURE_AUTH, b"\x02" * 16) if hello == "auth" else (0, b"")
                cli.send(p.encode(p.Hello(srv.cluster_id + 1, 1, 1, 0, b"\x01" * 16, flags,
                                          nonce), 1))
            cli.send(b"".join(chunks))
            with contextlib.suppress(OSError):
                cli.sock.shutdown(socket.SHUT_WR)
            try:
                replies = cli.drain()
            except Hang as e:
                raise Hang(f"{e}; sent: {hello=} {chunks!r}") from None
        finally:
            cli.close()
        stats["closed"] += 1
        for _, item in replies:
            assert isinstance(item, (p.Welcome, p.Error)), \
                f"answered {item!r} before authentication ({hello=})"
            stats["welcome" if isinstance(item, p.Welcome) else "error"] += 1

    t0 = time.monotonic()
    run()
    measured(f"frames before authentication: {EXAMPLES} examples {stats}",
             time.monotonic() - t0, 120)
    assert stats["welcome"] and stats["error"], stats
    dec = peers.decoder(env=env)
    dec.call("register", name="dst", **BLK)
    assert link(dec, prompt)["code"] == "LLM_SUCCESS"
    every = list(range(BLK["blocks"]))
    got = dec.call("pull", cid=srv.cluster_id, dst="dst", src_blocks=every, dst_blocks=every,
                   seed=11)
    assert got["ok"] and got["verified"], got


@pytest.mark.timeout(60)
def test_silent_and_slow_clients_do_not_block_others(peers: Peers) -> None:
    """Connections that send nothing, half a header, or a header promising a 64 MiB payload
    that never comes must not stop the server from serving a good peer meanwhile."""
    srv = _start_server(peers)
    hogs = []
    try:
        for data in (b"", p.encode(p.Hello(5, 1, 1, 0, b"\x01" * 16))[:7],
                     p.HEADER.pack(p.MAGIC, p.VERSION, p.MsgType.READ, 1, p.MAX_PAYLOAD)):
            for _ in range(8):
                c = RawClient(srv.port)
                c.send(data)
                hogs.append(c)
        _assert_server_sound(peers, srv, pattern_intact=True)
    finally:
        for c in hogs:
            c.close()


def test_guard_bytes_are_not_in_the_pattern() -> None:
    """The premise of the outside-memory check: no pattern byte equals the guard byte."""
    for seed in (1, 11, 12):
        assert GUARD_BYTE not in pattern(seed, 0, 0, 1 << 16).tobytes()
