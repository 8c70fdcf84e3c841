"""Stalled and trickling clients against an owner, and the bench rows that measure what they
cost honest pulls (issue 35: "no peer, with or without a secret, can stop an owner serving the
others").

Theory of operation
-------------------
:class:`Attack` opens many connections to a listening owner (a PROMPT) and leaves each one
stuck at a chosen point of a frame or of a transfer, then holds them open until ``close``:

* where: TCP from several source addresses (loopback has the whole 127/8, so a client socket
  bound to 127.0.0.2, 127.0.0.3, ... is another peer address to the owner), TLS on TCP, or the
  owner's local channel (its abstract unix socket, ``wire.protocol.local_name``), optionally
  from processes forked under other uids (needs root);
* when (:data:`STAGES`): before the handshake (``pre``: HELLO not sent whole), between HELLO
  and AUTH when the owner has a secret (``auth``), before the TLS handshake is done (``tls``),
  or after the handshake (``post``: an authenticated peer);
* how (:data:`HOWS`): ``silent`` (nothing more), ``header_part`` (some bytes of a frame's
  12-byte header), ``payload_part`` (a header and part of its payload), ``big_frame`` (the
  header of a 1 MiB READ and one byte of it), ``slow_reader`` (a READ of a whole big cache,
  never read, on a socket with a small receive buffer), ``trickle_writer`` (a WRITE of a whole
  big cache whose data comes a byte every :data:`TRICKLE_EVERY` seconds), ``client_hello``
  (TLS: the client's first flight, then nothing); and, in no mix, asked for by name:
  ``largest_frame`` (after the handshake, the header of a READ of the protocol's largest
  payload, 64 MiB, and one byte: what a buffer sized to a declared length would cost).

The owner must hold a blocks cache for the honest pulls and the big cache (:data:`BIG_BYTES`) the
slow readers and trickling writers name by cache id, and take remote writes
(``enable_remote_cache_accessible``). Used by ``datadist bench --only stall`` (below) and by
tests/security/test_slow_clients.py; every socket wait is bounded (:data:`SOCK_TIMEOUT`).

The rows: for 2 and for 8 I/O threads in the owner (``DATADIST_IO_THREADS``), honest 16 KiB
pulls with end-to-end checksums (over TCP, then by the same-host path: each pull a request
served by the owner's I/O threads), p50 and p99, with :data:`ATTACKERS` stalled
connections (half TCP, half the local channel; half before authentication, half after: the
owner has a secret and the attackers that authenticate know it) against the same pulls with no
attacker, alternating, in one run. Goals (issue 35): p50 <= 1.5x, p99 <= 5x. A pull that fails
counts at the time it took and its row misses its goal, saying how many failed.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import ssl
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from datadist.bench.harness import BenchError, Progress, Row, Sizes, at_most
from datadist.wire import auth
from datadist.wire import protocol as p

SOCK_TIMEOUT = 5.0  # every wait on an attacking socket
TRICKLE_EVERY = 0.25  # seconds between two bytes of a trickling writer
SETTLE = 0.3  # seconds an attack waits after its stalls were sent, before counting them
SMALL_BLOCK = 16 << 10  # an honest pull moves one block of this
SMALL_BLOCKS = 64
BIG_BYTES = 8 << 20  # the cache slow readers read and trickling writers write, whole
ATTACKER_ID = 100_000  # attackers claim cluster ids from here on, one each
STAGES = ("pre", "auth", "tls", "post")
HOWS = ("silent", "header_part", "payload_part", "big_frame", "slow_reader", "trickle_writer",
        "client_hello", "largest_frame")
# What each stage can do (auth: only with a secret; tls: only on a TLS listener).
STAGE_HOWS = {
    "pre": ("silent", "header_part", "payload_part"),
    "auth": ("silent", "header_part", "payload_part"),
    "tls": ("silent", "header_part", "client_hello"),
    "post": ("header_part", "payload_part", "big_frame", "slow_reader", "trickle_writer"),
}


class AttackError(RuntimeError):
    """An attacking connection could not reach the point it was to stall at (the owner
    answered something unexpected, or the attack was set up wrong)."""


class Refused(AttackError):
    """The owner refused an attacking connection in its handshake (an ERROR, or a close):
    over a connection cap or a budget of connections in their handshake. Counted, not
    raised, by :class:`Attack`."""


@dataclass(frozen=True)
class Target:
    """The owner under attack: its TCP address, local channel name (None: not attacked
    there), cluster id, secret (attackers that authenticate know it), TLS client settings
    (an ssl.SSLContext with a certificate the owner's CA signed; None: no TLS), and the
    cache id of its big cache (:data:`BIG_BYTES` in one tensor of one slot)."""

    address: tuple[str, int]
    cluster_id: int
    big_cache_id: int
    local: bytes | None = None
    secret: bytes | None = None
    tls: ssl.SSLContext | None = None


@dataclass(frozen=True)
class Stall:
    """One attacking connection: over ``channel`` ("tcp" or "local"), from ``source`` (a
    loopback address for TCP; a uid for local, None: ours), stuck at ``stage`` / ``how``."""

    channel: str
    stage: str
    how: str
    source: str | int | None = None

_PREPARE_ORDER = {"post": 0, "auth": 1, "tls": 2, "pre": 3}


def mix(n: int, channel: str, stages: Sequence[str], sources: Sequence[str | int | None],
        ) -> list[Stall]:
    """``n`` stalls on ``channel``, the stages' ways in turn, the sources in turn."""
    kinds = [(s, h) for s in stages for h in STAGE_HOWS[s]]
    return [Stall(channel, *kinds[i % len(kinds)], sources[i % len(sources)])
            for i in range(n)]


# ---------------------------------------------------------------------------- one connection


def _frames(sock: socket.socket, dec: p.FrameDecoder, n: int) -> list[Any]:
    """The next ``n`` frames' messages (bounded by the socket's timeout)."""
    got: list[Any] = []
    while len(got) < n:
        try:
            chunk = sock.recv(1 << 16)
        except (ConnectionError, ssl.SSLError) as e:
            raise Refused(f"the owner closed the connection: {e}") from None
        except OSError as e:
            raise AttackError(f"the owner did not answer: {e}") from None
        if not chunk:
            raise Refused(f"the owner closed the connection after {got}")
        got += [m for _, m in dec.feed(chunk)]
    return got


def _hello(cluster_id: int, client_nonce: bytes) -> bytes:
    features = p.FEATURE_AUTH if client_nonce else 0
    return p.encode(p.Hello(cluster_id, 2, os.getpid(), 0, b"\0" * 16, features, client_nonce), 1)


def _handshake(sock: socket.socket, t: Target, me: int, *, prove: bool = True) -> bytes:
    """HELLO, WELCOME (and with a secret, AUTH and OK unless not ``prove``). Returns the
    AUTH frame it would send (b"" without a secret)."""
    cn = auth.nonce() if t.secret else b""
    sock.sendall(_hello(me, cn))
    dec = p.FrameDecoder()
    (welcome,) = _frames(sock, dec, 1)
    if isinstance(welcome, p.Error):
        raise Refused(f"HELLO answered {welcome}")
    if not isinstance(welcome, p.Welcome):
        raise AttackError(f"HELLO answered {welcome}")
    if not t.secret:
        return b""
    proof = p.split_token(welcome.proof, welcome.features)[0]
    sn = proof[:auth.NONCE_BYTES]
    frame = p.encode(p.Auth(auth.client_proof(t.secret, cn, sn, t.cluster_id, me)), 2)
    if prove:
        sock.sendall(frame)
        (ok,) = _frames(sock, dec, 1)
        if not isinstance(ok, p.Ok):
            raise AttackError(f"AUTH answered {ok}")
    return frame


def _answered(sock: socket.socket) -> bool:
    """The owner sent something on ``sock``, or closed it (without waiting)."""
    if isinstance(sock, ssl.SSLSocket) and sock.pending():
        return True
    return bool(select.select([sock], [], [], 0)[0])


def _big_request(t: Target, write: bool) -> bytes:
    key = p.KeyRef(p.KeyKind.CACHE_ID, t.big_cache_id, 0, 0)
    spans = (np.array([0], np.uint32), np.array([0], np.uint64),
             np.array([BIG_BYTES], np.uint64))
    msg: p.Message = (p.Write(key, 0, 0, *spans) if write
                      else p.Read(key, 0, p.ReadFlags.NONE, *spans))
    return p.encode(msg, 3)


def _client_hello(ctx: ssl.SSLContext) -> bytes:
    """The first flight of a TLS client (made in memory, sent by hand)."""
    inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(inc, out, server_side=False)
    with contextlib.suppress(ssl.SSLWantReadError):
        obj.do_handshake()
    return out.read()


def _connect(t: Target, s: Stall) -> socket.socket:
    if s.channel == "local":
        assert t.local is not None, "this owner's local channel is not attacked"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(SOCK_TIMEOUT)
        try:
            sock.connect(t.local)
        except BaseException:
            sock.close()
            raise
        return sock
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(SOCK_TIMEOUT)
    if s.how == "slow_reader":  # the owner's sends fill it at once
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    if s.source is not None:
        sock.bind((str(s.source), 0))
    sock.connect(t.address)
    if t.tls is not None and s.stage != "tls":
        try:
            sock = t.tls.wrap_socket(sock)
        except (ConnectionError, ssl.SSLError) as e:  # over a cap: closed without a word
            sock.close()
            raise Refused(f"the TLS handshake failed: {e}") from None
    return sock


def prepare(t: Target, s: Stall, me: int) -> tuple[socket.socket, bytes, bool]:
    """Open one attacking connection (claiming cluster id ``me``) and take it as far as its
    stall begins (connected; TLS and the handshake done where the stage comes after them).
    Returns the socket, the bytes that leave it stalled (sent by the caller, after every
    connection was prepared: a stall must not delay the next one's handshake), and whether
    it trickles (the caller then sends it a byte now and then). Blocks for the handshake,
    within SOCK_TIMEOUT per wait. Raises AttackError or OSError."""
    sock = _connect(t, s)
    try:
        first = b""  # the frame this stall sends part of
        if s.stage == "tls":
            assert t.tls is not None
            first = _client_hello(t.tls)
            if s.how == "client_hello":
                return sock, first, False
        elif s.stage == "pre":
            first = _hello(me, auth.nonce() if t.secret else b"")
        elif s.stage == "auth":
            if not t.secret:
                raise AttackError("an AUTH stall needs an owner with a secret")
            first = _handshake(sock, t, me, prove=False)
        else:
            _handshake(sock, t, me)
            if s.how in ("slow_reader", "trickle_writer"):
                return sock, _big_request(t, s.how == "trickle_writer"), s.how == "trickle_writer"
            if s.how in ("big_frame", "largest_frame"):
                declared = 1 << 20 if s.how == "big_frame" else p.MAX_PAYLOAD
                return sock, p.HEADER.pack(p.MAGIC, p.VERSION, p.MsgType.READ, 3,
                                           declared) + b"\0", False
            first = _big_request(t, write=False)
        if s.how == "header_part":
            return sock, first[: 1 + me % (p.HEADER_SIZE - 1)], False  # 1 to 11 bytes
        if s.how == "payload_part":
            return sock, first[: p.HEADER_SIZE + (len(first) - p.HEADER_SIZE) // 2], False
        return sock, b"", False
    except BaseException:
        sock.close()
        raise


# ---------------------------------------------------------------------------- many of them


@dataclass
class _Child:
    """A forked attacker under another uid, and our ends of its two pipes."""

    pid: int
    uid: int
    report: Any  # a binary file: "prepared N\n", then "placed N REFUSED\n", or "failed: ..."
    go: int  # we write a byte: send the tails; we close it: drop everything and exit


def _said(child: _Child, want: str, timeout: float) -> list[int]:
    """The counts in the child's next line, which must start with ``want``."""
    if not select.select([child.report], [], [], timeout)[0]:
        raise AttackError(f"the attacker of uid {child.uid} said nothing in {timeout} s")
    line = child.report.readline().decode().strip()
    if not line.startswith(want + " "):
        raise AttackError(f"the attacker of uid {child.uid}: {line or 'died'}")
    return [int(x) for x in line.split()[1:]]


@dataclass
class Attack:
    """Many stalled connections against ``target``: :meth:`open` places them (those of
    another uid from a forked child each), :meth:`close` drops them. Not thread-safe; one
    attack at a time per target. Who calls: the stall rows and the slow-client tests."""

    target: Target
    stalls: list[Stall]
    # connections left at their stall, open and unanswered SETTLE s after (ours and the
    # forked attackers'); the owner may refuse some later (over a budget: in answer to a
    # whole first frame, which a stalled one never sends, or at a deadline)
    placed: int = 0
    refused: int = 0  # connections the owner refused in their handshake (Refused)
    _socks: list[socket.socket] = field(default_factory=list)
    _tails: list[tuple[Stall, socket.socket, bytes]] = field(default_factory=list)
    _trickling: list[socket.socket] = field(default_factory=list)
    _children: list[_Child] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> Attack:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self) -> Attack:
        """Place every stall; returns once all are in place (the forked ones too). Every
        connection is prepared (connected, handshaken where its stage is later) before any
        stalls, so that on an owner that stalls with them the attack still gets in place.
        Raises AttackError (after closing what it opened) when one could not be placed."""
        try:
            others: dict[int, list[tuple[int, Stall]]] = {}
            mine: list[tuple[int, Stall]] = []
            for i, s in enumerate(self.stalls):
                uid = s.source if s.channel == "local" else None
                if isinstance(uid, int) and uid != os.getuid():
                    others.setdefault(uid, []).append((i, s))
                else:
                    mine.append((i, s))
            for uid, stalls in others.items():  # fork before our trickling thread starts
                self._fork(uid, stalls)
            for child in self._children:
                _said(child, "prepared", SOCK_TIMEOUT * 4)
            self._prepare(mine)
            for child in self._children:
                os.write(child.go, b"g")
            self._send_tails()
            for child in self._children:
                placed, refused = _said(child, "placed", SOCK_TIMEOUT * 4)
                self.placed += placed
                self.refused += refused
            self._stop.clear()
            self._thread = threading.Thread(target=self._trickle, name="stall-trickle",
                                            daemon=True)
            self._thread.start()
        except BaseException:
            self.close()
            raise
        return self

    def _prepare(self, stalls: Iterable[tuple[int, Stall]]) -> None:
        # Those that complete their handshake first, those that stall in it last: an owner
        # that budgets connections in their handshake (per address, per uid) then counts
        # the stalled ones only, and refuses what is over (Refused: counted).
        for i, s in sorted(stalls, key=lambda x: _PREPARE_ORDER[x[1].stage]):
            try:
                sock, tail, trickles = prepare(self.target, s, ATTACKER_ID + i)
            except (Refused, ConnectionError):  # answered ERROR, or closed (reset, EPIPE)
                self.refused += 1
                continue
            except OSError as e:
                raise AttackError(f"{s}: {e}") from None
            self._socks.append(sock)
            self._tails.append((s, sock, tail))
            if trickles:
                self._trickling.append(sock)

    def _send_tails(self) -> None:
        """Send every prepared connection's stalling bytes; then, after SETTLE seconds,
        count as refused those stalled in their handshake that the owner answered or closed
        meanwhile (an owner refuses a connection over a budget in answer to its first frame):
        ``placed`` counts what the owner holds."""
        sent = []
        for s, sock, tail in self._tails:
            try:
                sock.sendall(tail)
            except OSError:  # refused (and closed) by the owner meanwhile
                self.refused += 1
                continue
            sent.append((s, sock))
        self._tails.clear()
        time.sleep(SETTLE)
        for s, sock in sent:
            # in the handshake, the owner says nothing more unless it refuses (TLS: its
            # ServerHello answers a ClientHello, so those are not looked at)
            if s.stage in ("pre", "auth") and _answered(sock):
                self.refused += 1
            else:
                self.placed += 1

    def _fork(self, uid: int, stalls: list[tuple[int, Stall]]) -> None:
        """A child under ``uid`` prepares ``stalls``, says so, sends their tails when we
        say go, says so, and holds them until we close its go pipe (or die)."""
        report_r, report_w = os.pipe()
        go_r, go_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 1
            try:
                os.close(report_r)
                os.close(go_w)
                for earlier in self._children:  # else an earlier child could never go
                    os.close(earlier.go)
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
                self._socks, self._tails, self._trickling = [], [], []
                self.placed = self.refused = 0
                try:
                    self._prepare(stalls)
                    os.write(report_w, b"prepared %d\n" % len(self._socks))
                    if os.read(go_r, 1) == b"g":
                        self._send_tails()
                        os.write(report_w, b"placed %d %d\n" % (self.placed, self.refused))
                except BaseException as e:  # noqa: BLE001 - told to the parent
                    os.write(report_w, f"failed: {e}".replace("\n", " ").encode()[:500] + b"\n")
                os.read(go_r, 1)  # until the parent closes its end (or dies)
                code = 0
            finally:
                os._exit(code)
        os.close(report_w)
        os.close(go_r)
        self._children.append(_Child(pid, uid, os.fdopen(report_r, "rb", buffering=0), go_w))

    def _trickle(self) -> None:
        while not self._stop.wait(TRICKLE_EVERY):
            for sock in self._trickling:
                with contextlib.suppress(OSError, ssl.SSLError):
                    sock.settimeout(0.05)
                    sock.send(b"\x5a")

    def close(self) -> None:
        """Drop every attacking connection and end the forked attackers. Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None
        for sock in self._socks:
            with contextlib.suppress(OSError):
                sock.close()
        self._socks.clear()
        self._tails.clear()
        self._trickling.clear()
        for child in self._children:
            with contextlib.suppress(OSError):
                os.close(child.go)
        for child in self._children:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(child.pid, 0)
            child.report.close()
        self._children.clear()
        self.placed = self.refused = 0


def loopback_sources(n: int) -> list[str]:
    """``n`` loopback addresses other than 127.0.0.1 (each a peer address to an owner)."""
    return [f"127.0.0.{2 + i}" for i in range(n)]


def other_uids(n: int) -> list[int]:
    """``n`` uids to attack the local channel from: other users' (60001, ...) when we are
    root, else ours (a process cannot take another uid without privilege)."""
    return [60001 + i for i in range(n)] if os.getuid() == 0 else [os.getuid()]


def standard_mix(n: int, secret: bool, local: bool) -> list[Stall]:
    """The bench's ``n`` stalls: half on TCP (from 127.0.0.2 and .3), half on the local
    channel (from other uids where we may); on each, half before authentication (HELLO, and
    AUTH with a secret) and half after. Without ``local``: all TCP."""
    pre = ("pre", "auth") if secret else ("pre",)
    # one uid may hold 64 connections: without root the local channel gets fewer
    n_tcp = n if not local else n // 2 if os.getuid() == 0 else n - 60
    tcp = loopback_sources(-(-n_tcp // 50))  # at most 50 from one address (its cap: 64)
    out = mix(n_tcp // 2, "tcp", pre, tcp) + mix(n_tcp - n_tcp // 2, "tcp", ("post",), tcp)
    if local:
        n_local = n - n_tcp
        out += mix(n_local // 2, "local", pre, other_uids(2))
        out += mix(n_local - n_local // 2, "local", ("post",), [None])
    return out


# ---------------------------------------------------------------------------- the bench rows

OWNER_ID, PULLER_ID = 1, 2
IO_THREADS = (2, 8)
ATTACKERS = 200
PULL_TIMEOUT_MS = 3000
SECRET = "bench-stall-secret"
GOALS = {"p50": 1.5, "p99": 5.0}
# the honest puller's paths: (DATADIST_TRANSPORT, what the rows say)
PATHS = (("tcp", "TCP"), ("auto", "same host"))
ROWS = len(IO_THREADS) * len(PATHS) * len(GOALS)  # progress steps per repetition (runner)
NOTE = (f"stall rows: {ATTACKERS} stalled or trickling connections (TCP from 2 addresses and "
        "the local channel; half before authentication, half after), the owner with a secret")


def stall_rows(sizes: Sizes, repeat: int, progress: Progress) -> list[Row]:
    """The stall rows (module docstring), an owner per I/O thread count. Blocks: about
    ``repeat`` x 2 s per owner, more where pulls fail (each phase under attack is cut at
    10 s, 4 s in a --quick run). Raises BenchError when the owner cannot be started or
    linked, or a pull that succeeded brought wrong bytes."""
    rows: list[Row] = []
    pulls = max(10, sizes.small_iters // 2)  # per phase: 20 with --quick, 200 at full size
    max_s = 4.0 if sizes.small_iters < 100 else 10.0
    for threads in IO_THREADS:
        progress.set_label(f"stall: {threads} I/O threads, starting the owner")
        rows += _owner_rows(threads, pulls, max_s, repeat, progress)
    return rows


@contextlib.contextmanager
def _env(**values: str | None) -> Any:
    saved = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def owner_setup(model_id: int, seed: int) -> tuple[tuple[str, dict[str, Any]], ...]:
    """The setup ops of a PROMPT an attack can run against (datadist.testing.peers): the
    blocks cache honest pulls read (cache id 1), the big cache (cache id 2)."""
    from datadist.testing.peers import CacheSpec

    return (("register_blocks_cache", {"spec": small_spec(), "seed": seed, "model_id": model_id}),
            ("register_cache", {"spec": CacheSpec(1, (1, BIG_BYTES), "DT_UINT8"), "seed": 0}))


def small_spec() -> Any:
    from datadist.testing.peers import CacheSpec

    return CacheSpec(1, (SMALL_BLOCKS, SMALL_BLOCK), "DT_UINT8")


class HonestPuller:
    """An honest DECODER in this process pulling one 16 KiB block at a time, each checked
    end to end (verify_checksum) and against the owner's pattern. Who calls: the stall rows
    and the slow-client tests' peers. One per process at a time."""

    def __init__(self, cluster_id: int, owner_id: int, model_id: int, seed: int) -> None:
        import datadist as llm
        from datadist.testing.peers import Decoder, pattern

        self.llm = llm
        self.spec = small_spec()
        self.dec = Decoder(cluster_id, sync_kv_timeout=PULL_TIMEOUT_MS)
        self.cache, self.arr = self.dec.local(self.spec, blocks=True)
        self.want = pattern(self.spec, seed).reshape(SMALL_BLOCKS, SMALL_BLOCK)
        self.key = llm.BlocksCacheKey(owner_id, model_id)
        self.owner_id = owner_id
        self.i = 0

    def link(self, address: tuple[str, int]) -> None:
        code = self.dec.link(self.owner_id, address, timeout_ms=PULL_TIMEOUT_MS)
        if code != self.llm.LLMStatusCode.LLM_SUCCESS:
            raise BenchError(f"the honest puller could not link: {code}")

    def pull(self) -> tuple[float, str | None]:
        """One pull: (seconds it took, None or why it failed). Wrong bytes fail it too."""
        i, self.i = self.i, self.i + 1
        src, dst = i % SMALL_BLOCKS, (i * 7) % SMALL_BLOCKS
        view = self.arr.reshape(SMALL_BLOCKS, SMALL_BLOCK)
        view[dst] = 0
        t0 = time.perf_counter()
        try:
            self.dec.cm.pull_blocks(self.key, self.cache, [src], [dst])
        except Exception as e:  # noqa: BLE001 - a failed pull is a result here
            return time.perf_counter() - t0, f"{type(e).__name__}: {e}"
        took = time.perf_counter() - t0
        if not np.array_equal(view[dst], self.want[src]):
            return took, f"pull {i}: the bytes that arrived are not the owner's"
        return took, None

    def pulls(self, n: int, max_s: float) -> tuple[list[float], list[str]]:
        """Up to ``n`` pulls, fewer once ``max_s`` seconds passed: (seconds each, failures)."""
        times, failures = [], []
        end = time.monotonic() + max_s
        for _ in range(n):
            took, why = self.pull()
            times.append(took)
            if why:
                failures.append(why)
            if time.monotonic() > end:
                break
        return times, failures

    def close(self) -> None:
        self.dec.close()


def _owner_rows(threads: int, n: int, max_s: float, repeat: int, progress: Progress) -> list[Row]:
    """One owner on ``threads`` I/O threads; the rows of each path (:data:`PATHS`) in turn."""
    from datadist.testing.peers import PromptConfig, start_prompt

    config = PromptConfig(OWNER_ID, remote_cache_accessible=True, setup=owner_setup(0, 7))
    prompt = start_prompt(config, env={"DATADIST_IO_THREADS": str(threads),
                                       "DATADIST_AUTH_SECRET": SECRET,
                                       "DATADIST_TRANSPORT": None,
                                       "DATADIST_VERIFY_CHECKSUM": None})
    rows: list[Row] = []
    try:
        target = Target(prompt.address, OWNER_ID, big_cache_id=prompt.setup[1],
                        local=p.local_name(prompt.pid, OWNER_ID), secret=SECRET.encode())
        for transport, where in PATHS:
            rows += _path_rows(prompt.address, target, transport, where, threads, n, max_s,
                               repeat, progress)
    finally:
        prompt.close()
    return rows


def _path_rows(address: tuple[str, int], target: Target, transport: str, where: str,
               threads: int, n: int, max_s: float, repeat: int, progress: Progress
               ) -> list[Row]:
    held: list[tuple[int, int]] = []  # (placed, refused) of each repetition's attack
    clean: list[list[float]] = []  # seconds per pull, a list per repetition
    attacked: list[list[float]] = []
    failures: list[str] = []
    with _env(DATADIST_AUTH_SECRET=SECRET, DATADIST_TRANSPORT=transport,
              DATADIST_VERIFY_CHECKSUM="1"):
        puller = HonestPuller(PULLER_ID, OWNER_ID, 0, 7)
    try:
        puller.link(address)
        path = puller.dec.path_name(OWNER_ID)
        _, bad = puller.pulls(10, 10.0)  # warm-up, checked (rule 2)
        if bad:
            raise BenchError(f"stall rows: an honest pull failed with no attacker: {bad[0]}")
        label = f"stall: {where}, {threads} I/O threads"
        for _ in range(repeat):
            progress.set_label(f"{label}, no attacker")
            times, bad = puller.pulls(n, 10.0)
            if bad:
                raise BenchError(f"stall rows: an honest pull failed with no attacker: "
                                 f"{bad[0]}")
            clean.append(times)
            progress.set_label(f"{label}, {ATTACKERS} attackers")
            with Attack(target, standard_mix(ATTACKERS, True, True)) as attack:
                held.append((attack.placed, attack.refused))
                times, bad = puller.pulls(n, max_s)
            attacked.append(times)
            failures += bad
            progress.step(n=len(GOALS))
    finally:
        puller.close()
    return latency_rows(threads, clean, attacked, failures, held, where, path)


def _held_note(held: Sequence[tuple[int, int]]) -> str:
    """What became of the attack's connections (:class:`Attack`'s counts, the smallest and
    largest of the runs): left at their stall and unanswered (an owner may still refuse
    some of those: one over a budget that has not sent a whole frame yet gets its answer
    later), or refused in the handshake."""
    if not held:
        return ""
    placed, refused = [h[0] for h in held], [h[1] for h in held]
    return (f"; per run, open and unanswered once placed: {min(placed)}-{max(placed)}, "
            f"refused in the handshake: {min(refused)}-{max(refused)}")


def latency_rows(threads: int, clean: list[list[float]], attacked: list[list[float]],
                 failures: list[str], held: Sequence[tuple[int, int]] = (),
                 where: str = "TCP", path: str = "tcp") -> list[Row]:
    """The p50 and p99 rows of one owner from its pulls' seconds, a list per repetition
    (``clean``: no attacker; ``attacked``), judged by :data:`GOALS`. Any failed pull under
    attack misses both goals (its note says how many); a pull that brought wrong bytes is
    BenchError. The figure and limit are over every pull, the samples each repetition's."""
    wrong = [f for f in failures if "not the owner's" in f]
    if wrong:
        raise BenchError(f"stall rows: {wrong[0]}")
    rows = []
    for q, goal in GOALS.items():
        pct = 50 if q == "p50" else 99
        key = "tcp" if where == "TCP" else "same_host"
        row = Row(f"stall_{key}_io{threads}_{q}",
                  f"small pull, 16 KiB, {where}, {ATTACKERS} stalled clients, {threads} I/O "
                  f"threads, {q}", "us", float(np.percentile(np.concatenate(attacked), pct))
                  * 1e6, f"the same pulls, no attacker, {q}",
                  float(np.percentile(np.concatenate(clean), pct)) * 1e6, path=path,
                  figure_samples=[float(np.percentile(a, pct)) * 1e6 for a in attacked],
                  limit_samples=[float(np.percentile(c, pct)) * 1e6 for c in clean],
                  note=NOTE + _held_note(held))
        at_most(row, goal)
        if failures:
            row.met = False
            row.note = (f"{len(failures)} of {sum(map(len, attacked))} pulls under attack "
                        f"failed (first: {failures[0][:120]})")
        rows.append(row)
    return rows
