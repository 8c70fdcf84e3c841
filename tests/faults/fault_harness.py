"""Parent side of the fault tests: start ``fault_peer.py`` processes, talk to them, hurt them.

Every wait here is bounded: a reply that does not come within its timeout fails the test with
the child's stderr attached, and every process is killed at teardown (``Peers.close``), so a
fault test can fail but never hang.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from datadist.wire import protocol as p
from datadist.wire.protocol import local_name  # noqa: F401 - the tests import it from here

PEER = Path(__file__).with_name("fault_peer.py")
LOCALHOST = "127.0.0.1"


class PeerDied(AssertionError):
    pass


class Peer:
    """One child process. ``call`` sends an op and waits for its reply (bounded)."""

    def __init__(self, name: str, env: dict[str, str] | None = None,
                 prefix: list[str] | None = None) -> None:
        self.name = name
        self._err = tempfile.TemporaryFile()  # noqa: SIM115 - closed in close()
        full_env = dict(os.environ)
        full_env.update(env or {})
        self.proc = subprocess.Popen(
            [*(prefix or []), sys.executable, str(PEER)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, env=full_env,
        )
        self.pid = self.proc.pid
        self._buf = b""
        self.port: int | None = None
        self.cluster_id: int | None = None
        self.ip = LOCALHOST

    def __repr__(self) -> str:
        return f"<Peer {self.name} pid={self.pid} port={self.port}>"

    def stderr(self) -> str:
        self._err.seek(0)
        return self._err.read().decode(errors="replace")[-4000:]

    def send(self, op: str, **kw: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"op": op, **kw}) + "\n").encode())
        self.proc.stdin.flush()

    def recv(self, timeout: float) -> dict:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(
                    f"{self.name} gave no reply within {timeout} s (a hang?)\n{self.stderr()}")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise PeerDied(f"{self.name} exited (rc={self.proc.poll()})\n"
                                   f"{self.stderr()}")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        if not line.startswith(b"@@"):
            return self.recv(max(0.1, deadline - time.monotonic()))
        reply = json.loads(line[2:])
        if "exception" in reply:
            raise AssertionError(f"{self.name} failed:\n{reply['exception']}")
        return reply

    def call(self, op: str, timeout: float = 30.0, **kw: Any) -> dict:
        self.send(op, **kw)
        return self.recv(timeout)

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)

    def stop(self, within: float = 5.0) -> None:
        """SIGSTOP, then wait until every thread has stopped. The stop takes effect
        asynchronously: the kernel wakes one thread, which stops the others when it runs, so on
        a loaded host the peer's I/O thread can still serve a request sent right after kill()
        returns."""
        self.signal(signal.SIGSTOP)
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            try:
                states = [(t / "stat").read_text().rsplit(")", 1)[1].split()[0]
                          for t in Path(f"/proc/{self.pid}/task").iterdir()]
            except (FileNotFoundError, ProcessLookupError):
                return  # gone
            if all(s == "T" for s in states):
                return
            time.sleep(0.001)
        raise AssertionError(f"{self.name} did not stop within {within} s")

    def kill(self) -> None:
        """SIGKILL and reap (a stopped process dies too)."""
        self.signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):  # the kernel always kills it
            self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.signal(signal.SIGCONT)
            try:
                self.send("quit")
                self.proc.wait(5)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if self.proc.poll() is None:
            self.kill()
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()
        self._err.close()


class Peers:
    """Starts peers and owns them: ``close`` kills whatever is left."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        self.env = env or {}
        self.all: list[Peer] = []
        self._next_id = 100

    def _start(self, name: str, env: dict[str, str] | None,
               prefix: list[str] | None) -> Peer:
        peer = Peer(name, {**self.env, **(env or {})}, prefix)
        self.all.append(peer)
        return peer

    def prompt(self, cluster_id: int | None = None, *, port: int = 0, ip: str = LOCALHOST,
               sync_ms: int = 1000, env: dict[str, str] | None = None,
               prefix: list[str] | None = None, name: str = "prompt",
               remote_access: bool | None = None) -> Peer:
        cid = cluster_id if cluster_id is not None else self._new_id()
        peer = self._start(name, env, prefix)
        peer.cluster_id, peer.ip = cid, ip
        peer.port = peer.call("init", role="PROMPT", cluster_id=cid, listen=f"{ip}:{port}",
                              sync_ms=sync_ms, remote_access=remote_access)["port"]
        return peer

    def decoder(self, cluster_id: int | None = None, *, sync_ms: int = 1000,
                env: dict[str, str] | None = None, prefix: list[str] | None = None,
                name: str = "decoder") -> Peer:
        cid = cluster_id if cluster_id is not None else self._new_id()
        peer = self._start(name, env, prefix)
        peer.cluster_id = cid
        peer.call("init", role="DECODER", cluster_id=cid, sync_ms=sync_ms)
        return peer

    def decoders(self, n: int, *, sync_ms: int = 1000,
                 env: dict[str, str] | None = None) -> list[Peer]:
        """``n`` decoders, started in parallel (process start-up dominates otherwise)."""
        out = []
        for i in range(n):
            peer = self._start(f"decoder{i}", env, None)
            peer.cluster_id = self._new_id()
            peer.send("init", role="DECODER", cluster_id=peer.cluster_id, sync_ms=sync_ms)
            out.append(peer)
        for peer in out:
            peer.recv(60)
        return out

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def close(self) -> None:
        for peer in self.all:
            peer.close()


def target(prompt: Peer) -> list:
    """The ``clusters`` argument of link/unlink for one prompt."""
    return [[prompt.cluster_id, prompt.ip, prompt.port]]


def link(decoder: Peer, prompt: Peer, timeout_ms: int = 3000) -> dict:
    return decoder.call("link", clusters=target(prompt), timeout_ms=timeout_ms)


def measured(label: str, seconds: float, bound: float) -> None:
    """Print a measured time (pytest -s, or the captured output of a failure) so that the
    figures in docs/reliability.md can be refreshed from a run."""
    print(f"[measured] {label}: {seconds:.3f} s (bound {bound:.1f} s)")


def watch_progress(shm: str, offset: int, timeout: float, *, stop_if=None) -> bool:
    """Wait until the word at ``offset`` of file ``shm`` turns non-zero (the pull reached it).

    Polls the file mapping directly: no round trip through the decoder, so the parent can
    hit the prompt while the transfer is in flight. Returns False on timeout.
    """
    import mmap

    import numpy as np

    deadline = time.monotonic() + timeout
    while not os.path.exists(shm) or os.path.getsize(shm) < offset + 8:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    with open(shm, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        try:
            word = np.frombuffer(m, dtype=np.uint64, count=1, offset=offset)
            while time.monotonic() < deadline:
                if word[0]:
                    return True
                if stop_if is not None and stop_if():
                    return False
            return False
        finally:
            del word
            m.close()


def file_words_nonzero(shm: str, offset: int, nbytes: int) -> bool:
    import numpy as np

    with open(shm, "rb") as f:
        f.seek(offset)
        data = np.frombuffer(f.read(nbytes), dtype=np.uint8)
    return bool(data.any())


# ------------------------------------------------------------------------------ raw client

SOCK_TIMEOUT = 10.0  # a reply that takes longer is a hang
# Unreleased GRANTs an owner answers on one connection before LINK_BUSY (cpp/src/server.cc,
# kMaxGrantsPerConnection; docs/security.md).
MAX_GRANTS_PER_CONNECTION = 4


class Hang(BaseException):
    """The server left a request unanswered past the bound. A BaseException so that
    hypothesis stops at once instead of shrinking through more multi-second waits."""


class RawClient:
    """A client that speaks the wire protocol by hand, every wait bounded."""

    def __init__(self, port: int | bytes) -> None:
        if isinstance(port, bytes):  # a local channel's abstract unix name
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(SOCK_TIMEOUT)
            self.sock.connect(port)
        else:
            self.sock = socket.create_connection(("127.0.0.1", port), timeout=SOCK_TIMEOUT)
        self.sock.settimeout(SOCK_TIMEOUT)
        self.decoder = p.FrameDecoder()
        self.items: list[tuple[int, p.Message | bytes]] = []
        self.eof = False

    def close(self) -> None:
        self.sock.close()

    def send(self, data: bytes) -> bool:
        try:
            self.sock.sendall(data)
            return True
        except (BrokenPipeError, ConnectionResetError):
            return False

    def _fill(self) -> None:
        try:
            chunk = self.sock.recv(1 << 20)
        except ConnectionResetError:
            chunk = b""
        except TimeoutError:
            raise Hang(f"the server sent nothing for {SOCK_TIMEOUT} s") from None
        if not chunk:
            self.eof = True
            return
        self.items.extend(self.decoder.feed(chunk))

    def next(self) -> tuple[int, p.Message | bytes] | None:
        """The next frame or raw-bytes item; None once the server closed."""
        while not self.items and not self.eof:
            self._fill()
        return self.items.pop(0) if self.items else None

    def drain(self) -> list[tuple[int, p.Message | bytes]]:
        """Everything until the server closes (it must, within the bound)."""
        end = time.monotonic() + SOCK_TIMEOUT
        while not self.eof:
            if time.monotonic() > end:
                raise Hang("the server kept a hostile connection open after EOF")
            self._fill()
        out, self.items = self.items, []
        return out

    def recv_exact(self, n: int) -> bytes:
        """``n`` raw bytes straight from the socket (no frame decoding), bounded."""
        out = bytearray()
        while len(out) < n:
            try:
                chunk = self.sock.recv(min(n - len(out), 1 << 20))
            except TimeoutError:
                raise Hang(f"the server sent nothing for {SOCK_TIMEOUT} s") from None
            if not chunk:
                raise AssertionError(f"the server hung up after {len(out)} of {n} bytes")
            out += chunk
        return bytes(out)

    def hello(self, cluster_id: int) -> None:
        # No 0xEE anywhere in it (see the module docstring).
        self.send(p.encode(p.Hello(cluster_id, 1, 1, 0, b"\x01" * 16), 1))
        got = self.next()
        assert got is not None and isinstance(got[1], p.Welcome), got
