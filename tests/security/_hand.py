"""Hand-driven peers for the security suite: a raw client speaking the wire by hand, the
core's engines on loopback, a small blocks cache, the link proofs computed from
docs/protocol.md (an oracle independent of the core's own code), and a raw owner that lies
about its checksums. Imported by the test modules (pytest puts this directory on sys.path);
every socket wait is bounded by SOCK_TIMEOUT."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import zlib
from typing import Any

import numpy as np

import datadist as llm
from datadist.api.cache_manager import CacheManager
from datadist.core.config import EngineConfig
from datadist.core.errors import Code
from datadist.core.native import NativeEngine
from datadist.testing.fakes import FakeServer
from datadist.wire import auth
from datadist.wire import protocol as p
from datadist.wire.auth import MAC_BYTES, NONCE_BYTES, client_proof, nonce  # noqa: F401
from datadist.wire.protocol import local_name  # noqa: F401 - the tests import it from here

PROMPT, DECODER = 1, 2
SOCK_TIMEOUT = 5.0


def server_mac(secret: bytes, client_nonce: bytes, server_nonce: bytes, server_id: int,
               client_id: int) -> bytes:
    """The MAC a server proves the secret with in its WELCOME (after its nonce)."""
    proof = auth.server_proof(secret, client_nonce, server_nonce, server_id, client_id)
    return proof[NONCE_BYTES:]


class Raw:
    """A hand-driven client on TCP (an (ip, port)) or the local channel (an abstract socket
    name, bytes); every wait bounded."""

    def __init__(self, address: tuple[str, int] | bytes) -> None:
        if isinstance(address, bytes):
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(SOCK_TIMEOUT)
            self.sock.connect(address)
        else:
            self.sock = socket.create_connection(address, timeout=SOCK_TIMEOUT)
        self.dec = p.FrameDecoder()
        self.items: list[Any] = []

    def send(self, msg: p.Message, rid: int = 1) -> None:
        self.sock.sendall(p.encode(msg, rid))

    def next(self) -> Any:
        """The next (request id, frame); None once the server closed."""
        while not self.items:
            try:
                chunk = self.sock.recv(1 << 16)
            except (ConnectionResetError, TimeoutError):
                chunk = b""
            if not chunk:
                return None
            self.items.extend(self.dec.feed(chunk))
        return self.items.pop(0)

    def hello(self, cluster_id: int, features: int = 0, proof: bytes = b"",
              pid: int = 1, boot_id: bytes = b"\x01" * 16) -> Any:
        """Send a HELLO and return the answer frame (None if the server closed)."""
        self.send(p.Hello(cluster_id, 2, pid, 0, boot_id, features, proof), 1)
        got = self.next()
        return got[1] if got is not None else None

    def close(self) -> None:
        self.sock.close()


def make(made: list[NativeEngine], cluster_id: int, *, listen: bool = True,
         **kw: Any) -> NativeEngine:
    """The core's engine on loopback (a PROMPT that listens, or a DECODER), closed by the
    test's ``engines`` fixture (conftest.py) through ``made``."""
    config = EngineConfig(cluster_id=cluster_id, role=1 if listen else 2,
                          listen=("127.0.0.1", 0) if listen else None, **kw)
    engine = NativeEngine(config)
    made.append(engine)
    return engine


def blocks_cache(cm: CacheManager, cluster_id: int, model_id: int, seed: int | None
                 ) -> tuple[Any, np.ndarray]:
    """A one-tensor blocks cache of 4 blocks of 16 bytes (random bytes from ``seed``, or
    zeros) registered under BlocksCacheKey(cluster_id, model_id)."""
    desc = llm.CacheDesc(1, [4, 16], llm.DataType.DT_UINT8, llm.Placement.DEVICE)
    arr = np.zeros((1, 64), np.uint8)
    if seed is not None:
        arr[...] = np.random.default_rng(seed).integers(0, 256, arr.shape, dtype=np.uint8)
    cache = cm.register_blocks_cache(desc, [int(arr[0].ctypes.data)],
                                     llm.BlocksCacheKey(cluster_id, model_id))
    return cache, arr


# Python source for a child process: from then on the kernel answers its process_vm_readv
# with EPERM, as for a reader that may not ptrace its owner (Yama, another user): a seccomp
# filter on every thread (x86-64). Used by the tests of a refused cross-memory attach.
DENY_CMA = """
import ctypes as _ct, struct as _st
_prog = [(0x20, 0, 0, 4), (0x15, 1, 0, 0xC000003E), (0x06, 0, 0, 0x7FFF0000),  # x86-64 only
         (0x20, 0, 0, 0), (0x15, 1, 0, 310), (0x06, 0, 0, 0x7FFF0000),  # process_vm_readv
         (0x06, 0, 0, 0x00050000 | 1)]  # SECCOMP_RET_ERRNO | EPERM
_buf = _ct.create_string_buffer(b"".join(_st.pack("<HBBI", *i) for i in _prog))
_fprog = _ct.create_string_buffer(_st.pack("<HxxxxxxQ", len(_prog), _ct.addressof(_buf)))
_libc = _ct.CDLL(None, use_errno=True)
_libc.syscall.restype = _ct.c_long
assert _libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
assert _libc.syscall(317, 1, 1, _fprog) == 0, _ct.get_errno()  # seccomp: FILTER, TSYNC
"""

LIE = 0xDEADBEEF  # the CRC a lying owner claims


class LyingOwner(FakeServer):
    """A raw owner that serves ``tensors`` (one numpy uint8 array per tensor index) and lies
    about the CRC-32 of its first ``lies`` checksummed answers (claims :data:`LIE`).

    It answers HELLO with a WELCOME of another host (an all-zero boot id: the puller takes
    TCP), or, with ``local``, one that echoes the puller's identity, offers the local channel
    and also serves it on this process's abstract name for ``cluster_id`` (the kernel then
    verifies it as this process). A READ (any flags; the key's slot is ignored, offsets are
    into the tensor) is answered READ_DATA, the spans tensor by tensor, then with flag
    CHECKSUM a CHECKSUM frame. ``verdicts`` records each RELEASE with lease 0 as (request
    id, ok); ``reads`` each READ's (request id, flags). Serves on threads until ``close``."""

    def __init__(self, cluster_id: int, tensors: list[np.ndarray], *, lies: int = 1,
                 local: bool = False) -> None:
        self.cluster_id, self.tensors, self.lies, self.local = (cluster_id, tensors, lies,
                                                                local)
        self.verdicts: list[tuple[int, bool]] = []
        self.reads: list[tuple[int, int]] = []
        self._lock = threading.Lock()
        super().__init__(local_name=local_name(os.getpid(), cluster_id) if local else None,
                         conn_timeout=SOCK_TIMEOUT * 2)

    def _answer(self, rid: int, msg: p.Read) -> bytes:
        body = b"".join(bytes(self.tensors[int(t)][int(o):int(o) + int(n)])
                        for t in msg.tensors
                        for o, n in zip(msg.offsets, msg.lengths, strict=True))
        out = p.encode(p.ReadData(len(body)), rid) + body
        if msg.flags & p.ReadFlags.CHECKSUM:
            with self._lock:
                lie, self.lies = self.lies > 0, self.lies - 1
            out += p.encode(p.Checksum(LIE if lie else zlib.crc32(body), len(body)), rid)
        return out

    def _serve(self, conn: socket.socket) -> None:
        dec = p.FrameDecoder()
        pending: list[Any] = []
        with contextlib.suppress(OSError), conn:
            while not self._closing.is_set():
                while not pending:
                    chunk = conn.recv(1 << 16)
                    if not chunk:
                        return
                    pending.extend(dec.feed(chunk))
                rid, msg = pending.pop(0)
                if isinstance(msg, p.Hello):
                    if self.local:
                        welcome = p.Welcome(self.cluster_id, 1, msg.pid, msg.pid_ns,
                                            msg.boot_id, p.FEATURE_LOCAL)
                    else:
                        welcome = p.Welcome(self.cluster_id, 1, os.getpid(), 0, b"\0" * 16)
                    conn.sendall(p.encode(welcome, rid))
                elif isinstance(msg, p.Read):
                    self.reads.append((rid, int(msg.flags)))
                    conn.sendall(self._answer(rid, msg))
                elif isinstance(msg, p.Release):
                    if msg.lease_id == 0:
                        self.verdicts.append((rid, bool(msg.ok)))
                elif isinstance(msg, p.Ping):
                    conn.sendall(p.encode(p.Pong(msg.nonce), rid))
                elif isinstance(msg, p.Bye):
                    conn.sendall(p.encode(p.Ok(), rid))
                    return
                else:
                    conn.sendall(p.encode(p.Error(int(Code.PARAM_INVALID),
                                                  f"{type(msg).__name__} not served"), rid))


class Mitm:
    """A hostile owner in the middle: a listener that forwards every connection a reader
    makes to the real owner at ``owner`` (frame by frame, re-encoded), clearing
    FEATURE_LOCAL in the owner's WELCOMEs (so the link stays on these TCP connections).
    ``rewrite`` (settable) sees every frame the owner sends on a control channel and returns
    what the reader gets instead; :meth:`inject` sends a request of its own to the reader
    over the reader's reverse channel, as only the owner may, and returns the reader's
    answer (which the owner never sees). Serves on daemon threads until ``close``."""

    def __init__(self, owner: tuple[str, int]) -> None:
        self.owner = owner
        self.rewrite: Any = None
        self._server = socket.create_server(("127.0.0.1", 0))
        self._server.settimeout(0.2)
        self.address: tuple[str, int] = self._server.getsockname()[:2]
        self._closing = threading.Event()
        self._socks: list[socket.socket] = []
        self._reverse: list[tuple[socket.socket, threading.Lock]] = []
        self._answers: dict[int, Any] = {}
        self._cond = threading.Condition()
        self._rid = 1 << 30  # request ids of ours: far above the owner's
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def __enter__(self) -> Mitm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._closing.set()
        self._thread.join(5)
        for s in [self._server, *self._socks]:
            with contextlib.suppress(OSError):
                s.close()

    def inject(self, msg: p.Message, timeout: float = SOCK_TIMEOUT) -> Any:
        """Send ``msg`` to the reader on its (latest) reverse channel; its answer."""
        with self._cond:
            assert self._reverse, "no reverse channel from the reader yet"
            sock, lock = self._reverse[-1]
            self._rid += 1
            rid = self._rid
        with lock:
            sock.sendall(p.encode(msg, rid))
        with self._cond:
            if not self._cond.wait_for(lambda: rid in self._answers, timeout):
                raise TimeoutError(f"the reader did not answer {type(msg).__name__}")
            return self._answers.pop(rid)

    def _accept(self) -> None:
        while not self._closing.is_set():
            try:
                reader, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            owner = socket.create_connection(self.owner, timeout=SOCK_TIMEOUT)
            for s in (reader, owner):
                s.settimeout(None)
                self._socks.append(s)
            state: dict[str, Any] = {"reverse": None, "lock": threading.Lock()}
            threading.Thread(target=self._up, args=(reader, owner, state), daemon=True).start()
            threading.Thread(target=self._down, args=(owner, reader, state), daemon=True).start()

    @staticmethod
    def _frames(src: socket.socket) -> Any:
        dec = p.FrameDecoder()
        with contextlib.suppress(OSError):
            while chunk := src.recv(1 << 16):
                yield from dec.feed(chunk)

    @staticmethod
    def _encoded(rid: int, msg: Any) -> bytes:
        return msg if isinstance(msg, bytes) else p.encode(msg, rid)

    def _up(self, reader: socket.socket, owner: socket.socket, state: dict[str, Any]) -> None:
        """Reader to owner: the HELLO says which channel this is; answers to our own
        requests stop here."""
        for rid, msg in self._frames(reader):
            if isinstance(msg, p.Hello) and state["reverse"] is None:
                state["reverse"] = bool(msg.features & p.FEATURE_REVERSE)
                if state["reverse"]:
                    with self._cond:
                        self._reverse.append((reader, state["lock"]))
            if state["reverse"] and rid > 1 << 30:
                with self._cond:
                    self._answers[rid] = msg
                    self._cond.notify_all()
                continue
            with contextlib.suppress(OSError):
                owner.sendall(self._encoded(rid, msg))
        with contextlib.suppress(OSError):
            owner.shutdown(socket.SHUT_WR)

    def _down(self, owner: socket.socket, reader: socket.socket, state: dict[str, Any]) -> None:
        """Owner to reader: WELCOMEs lose FEATURE_LOCAL; control frames pass ``rewrite``."""
        for rid, msg in self._frames(owner):
            if isinstance(msg, p.Welcome):
                msg = p.Welcome(msg.cluster_id, msg.role, msg.pid, msg.pid_ns, msg.boot_id,
                                msg.features & ~p.FEATURE_LOCAL, msg.proof)
            elif not state["reverse"] and self.rewrite is not None \
                    and not isinstance(msg, bytes):
                msg = self.rewrite(msg)
            with state["lock"], contextlib.suppress(OSError):
                reader.sendall(self._encoded(rid, msg))
        with contextlib.suppress(OSError):
            reader.shutdown(socket.SHUT_WR)
