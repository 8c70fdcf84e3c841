"""Cross-language tests: the C++ library (cpp/) against the Python package, over the wire.

Who runs this: pytest (tests/README.md). The C++ peer comes from the session's build of cpp/
(``cpp_build``, tests/conftest.py); without cmake or a C++ compiler every test here is
skipped, saying so.

``XPeer`` drives the C++ test peer (cpp/tests/xpeer.cc) over stdin/stdout, one command per
line, each answered within a deadline (a hung peer fails the test, never hangs it).
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CPP = ROOT / "cpp"
LLM_SUCCESS = 0
LLM_PARAM_INVALID = 0x5010B005
LLM_KV_CACHE_NOT_EXIST = 0x5010B002
LLM_TIMEOUT = 0x5010B01A
LLM_LINK_FAILED = 0x5010B009
LLM_FAILED = 0xFFFFFFFF


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class XPeer:
    """The C++ test peer in a child process."""

    def __init__(self, build: Path, env: dict[str, str] | None = None) -> None:
        """``env``: extra environment (``DATADIST_TRANSPORT``, ...). The peer logs its path
        choices (``DATADIST_CPP_LOG``) to a file that :meth:`log` reads."""
        import tempfile

        full = dict(os.environ)
        full["DATADIST_CPP_LOG"] = "1"
        full.update(env or {})
        if "thread" in os.environ.get("DATADIST_CPP_SANITIZE", ""):
            full["TSAN_OPTIONS"] = f"suppressions={CPP / 'tests' / 'tsan.supp'}"
        self._log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen([str(build / "dd_xpeer")], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, text=True,
                                     bufsize=1, env=full)
        self.port = 0

    def log(self) -> str:
        """What the peer wrote to stderr so far (DATADIST_CPP_LOG lines, sanitizer reports)."""
        self._log.flush()
        self._log.seek(0)
        return self._log.read()

    def cmd(self, line: str, timeout: float = 20.0) -> list[str]:
        """Send one command; returns the answer's fields after "ok" (status first)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"C++ peer did not answer {line!r} within {timeout} s")
        answer = self.proc.stdout.readline().split()
        assert answer and answer[0] == "ok", f"{line!r} -> {answer!r}"
        return answer[1:]

    def status(self, line: str, timeout: float = 20.0) -> int:
        return int(self.cmd(line, timeout)[0])

    def ok(self, line: str, timeout: float = 20.0) -> list[str]:
        got = self.cmd(line, timeout)
        assert int(got[0]) == LLM_SUCCESS, f"{line!r} -> status {int(got[0]):#x}"
        return got[1:]

    def init(self, cluster_id: int, role: int, listen: bool = False, sync_ms: int = 2000,
             secret: str = "", host: str = "127.0.0.1") -> None:
        """Initialize; with ``listen``, on a free port of ``host`` (another if that one was
        taken before the peer bound it)."""
        for _ in range(5):
            where = "-"
            if listen:
                self.port = free_port(host)
                where = f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"
            code = self.status(f"init {cluster_id} {role} {where} {sync_ms} {secret}".rstrip())
            if code != LLM_LINK_FAILED or not listen:
                break
        assert code == LLM_SUCCESS, f"init -> {code:#x}"

    def register(self, num_tensors: int, shape: tuple[int, ...], dtype: int = 4) -> int:
        """A zeroed cache of DT_UINT8 (4) unless told; returns its cache id."""
        return int(self.ok(f"reg {num_tensors} {dtype} {','.join(map(str, shape))}")[0])

    def write(self, cache_id: int, tensor: int, data: bytes) -> None:
        self.ok(f"write {cache_id} {tensor} {data.hex()}")

    def read(self, cache_id: int, tensor: int) -> bytes:
        return bytes.fromhex(self.ok(f"read {cache_id} {tensor}")[0])

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError, TimeoutError, AssertionError):
                self.cmd("quit", timeout=15.0)
            try:
                self.proc.wait(5.0)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5.0)
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()
        if self.proc.returncode:  # a sanitizer's report, or why it failed, in the test output
            print(self.log()[-8000:])
        self._log.close()


@pytest.fixture
def xpeer(cpp_build: Path) -> Iterator[Callable[..., XPeer]]:
    """Start C++ peers; each is told to quit (Finalize) at teardown and must exit cleanly."""
    made: list[XPeer] = []

    def make(env: dict[str, str] | None = None) -> XPeer:
        p = XPeer(cpp_build, env)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()
    for p in made:
        assert p.proc.returncode == 0, f"C++ peer exited with {p.proc.returncode}"


def pattern(seed: int, n: int) -> bytes:
    """Deterministic, position-dependent bytes (a shifted block lands visibly wrong)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, n, dtype=np.uint8).tobytes()


def wait_until(cond, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()
