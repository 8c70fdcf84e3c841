"""Mutual TLS on links: both ends need a certificate from the configured CA.

Owners and linkers are the C++ core's engines (core/native.py); hostile peers are raw sockets,
and TLS clients driven by hand with Python's ssl module (``_HandTls``)."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import ssl
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _hand import local_name

from datadist.core import native
from datadist.core.config import EngineConfig, TlsConfig
from datadist.core.errors import LinkFailed, Timeout
from datadist.core.layout import Geometry, every_tensor, plan_blocks, plan_slot
from datadist.core.native import NativeEngine
from datadist.testing.certs import make_ca as _ca
from datadist.testing.certs import make_leaf as _leaf
from datadist.wire import protocol as p

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command"),
]

_CORE_TLS = native.tls_available()[0] if native.available()[0] else False
pytestmark.append(pytest.mark.skipif(not _CORE_TLS,
                                     reason="the C++ core is not built with TLS here"))


def _engine(config: EngineConfig) -> NativeEngine:
    return NativeEngine(config)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TlsConfig]:
    d = tmp_path_factory.mktemp("tls")
    _ca(d, "ca")
    _ca(d, "evil")
    return {"prompt": _leaf(d, "prompt", "ca"), "decoder": _leaf(d, "decoder", "ca"),
            "stranger": _leaf(d, "stranger", "evil")}


def _owner(tls: TlsConfig | None, host: str = "127.0.0.1"):
    eng = _engine(EngineConfig(cluster_id=1, role=1, listen=(host, 0), tls=tls))
    blocks = [np.random.default_rng(i).integers(0, 255, (64, 4096), dtype=np.uint8)
              for i in range(2)]
    eng.register(Geometry(2, 64 * 4096, 64, True), [b.ctypes.data for b in blocks],
                 placement=0, blocks_model_id=0)
    big = np.random.default_rng(9).integers(0, 255, 8 << 20, dtype=np.uint8)
    eng.register(Geometry(1, 8 << 20, 1), [big.ctypes.data], placement=0)
    return eng, blocks, big


def _speaks_plain(address: tuple[str, int]) -> bool:
    """Does the listener at ``address`` answer a plain-TCP HELLO with a frame (a TLS one
    hangs up on it, or answers with a TLS alert)?"""
    with socket.create_connection(address[:2], timeout=5.0) as s:
        s.sendall(p.encode(p.Hello(9, 2, os.getpid(), 0, b"\0" * 16), 1))
        got = b""
        with contextlib.suppress(OSError):
            while len(got) < 2 and (chunk := s.recv(65536)):
                got += chunk
    return got[:2] == b"DD"


def _ipv6_loopback() -> bool:
    import socket

    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback on this host")
def test_tls_link_over_ipv6(certs) -> None:
    """Issue 22 item 8: mutual TLS checks certificates against the CA, never the peer's
    address, so a link to [::1] is as good as one to 127.0.0.1; a stranger still is not."""
    owner, blocks, _ = _owner(certs["prompt"], "::1")
    puller = _engine(EngineConfig(cluster_id=2, role=2, transport="tcp",
                                           tls=certs["decoder"]))
    stranger = _engine(EngineConfig(cluster_id=3, role=2, transport="tcp",
                                             tls=certs["stranger"]))
    try:
        host, port = owner.listen_address
        assert host == "::1"
        puller.link(1, host, port, 5.0)
        dst = [np.zeros((64, 4096), np.uint8) for _ in range(2)]
        local = puller.register(Geometry(2, 64 * 4096, 64, True), [d.ctypes.data for d in dst],
                                placement=0)
        plan = plan_blocks(local.geometry, [7], [1], every_tensor(2))
        puller.pull(1, p.KeyRef(p.KeyKind.BLOCKS_KEY, 0, 0), 4096, plan, local.cache_id, 10.0)
        for t in range(2):
            assert np.array_equal(dst[t][1], blocks[t][7])
        with pytest.raises((LinkFailed, Timeout)):
            stranger.link(1, host, port, 3.0)
    finally:
        for eng in (stranger, puller, owner):
            eng.close()


def test_tls_link_moves_the_right_bytes(certs) -> None:
    owner, blocks, big = _owner(certs["prompt"])
    puller = _engine(EngineConfig(cluster_id=2, role=2, transport="tcp",
                                           tls=certs["decoder"]))
    try:
        host, port = owner.listen_address
        puller.link(1, host, port, 5.0)
        # paged: scattered blocks, several spans
        dst = [np.zeros((64, 4096), np.uint8) for _ in range(2)]
        local = puller.register(Geometry(2, 64 * 4096, 64, True), [d.ctypes.data for d in dst],
                                placement=0)
        src_b, dst_b = [3, 4, 5, 40, 9], [0, 1, 2, 7, 63]
        plan = plan_blocks(local.geometry, src_b, dst_b, every_tensor(2))
        puller.pull(1, p.KeyRef(p.KeyKind.BLOCKS_KEY, 0, 0), 4096, plan, local.cache_id, 10.0)
        for t in range(2):
            assert np.array_equal(dst[t][dst_b], blocks[t][src_b])
        # contiguous, larger than any buffer
        out = np.zeros(8 << 20, np.uint8)
        c = puller.register(Geometry(1, 8 << 20, 1), [out.ctypes.data], placement=0)
        plan = plan_slot(c.geometry, 0, every_tensor(1))
        puller.pull(1, p.KeyRef(p.KeyKind.CACHE_ID, 2, 0), 0, plan, c.cache_id, 10.0)
        assert np.array_equal(out, big)
        puller.check_link(1, 5.0)
        assert not _speaks_plain(owner.listen_address)  # and it was TLS all along
    finally:
        puller.close()
        owner.close()


@pytest.mark.parametrize("who", ["plain", "stranger", "stranger-owner"])
def test_peers_without_a_valid_certificate_are_refused(certs, who: str) -> None:
    """A linker without TLS, or with a certificate another CA signed, is refused; so is an
    owner whose certificate another CA signed (the linker checks the owner's too)."""
    owner, _, _ = _owner(certs["stranger" if who == "stranger-owner" else "prompt"])
    tls = {"plain": None, "stranger": certs["stranger"], "stranger-owner": certs["decoder"]}[who]
    puller = _engine(EngineConfig(cluster_id=2, role=2, transport="tcp", tls=tls))
    try:
        host, port = owner.listen_address
        with pytest.raises((LinkFailed, Timeout)):
            puller.link(1, host, port, 3.0)
        assert not puller.links()
    finally:
        puller.close()
        owner.close()


def test_a_plain_linker_is_told_the_owner_may_require_tls(certs) -> None:
    """A linker without TLS whose HELLO a TLS owner drops hears why it may have been: the
    link error says the peer closed the connection during the handshake and asks whether it
    requires TLS (the core: Link::Handshake, for both APIs)."""
    owner, _, _ = _owner(certs["prompt"])
    puller = _engine(EngineConfig(cluster_id=2, role=2, transport="tcp"))
    try:
        host, port = owner.listen_address
        with pytest.raises(LinkFailed) as info:
            puller.link(1, host, port, 10.0)
        assert "during the handshake (does it require TLS?)" in str(info.value)
        assert f"{host}:{port}" in str(info.value)
        assert not puller.links()
    finally:
        puller.close()
        owner.close()


def test_tls_client_refuses_a_plain_server(certs) -> None:
    owner, _, _ = _owner(None)
    puller = _engine(EngineConfig(cluster_id=2, role=2, tls=certs["decoder"]))
    try:
        host, port = owner.listen_address
        with pytest.raises((LinkFailed, Timeout)):
            puller.link(1, host, port, 3.0)
    finally:
        puller.close()
        owner.close()


def test_same_host_link_runs_tls_on_the_local_channel(certs) -> None:
    """Between processes of one host the link moves to the local channel, still inside
    mutual TLS (certificates keep deciding who may link); a plain client there is refused."""
    owner, _, big = _owner(certs["prompt"])
    puller = _engine(EngineConfig(cluster_id=2, role=2, tls=certs["decoder"]))
    try:
        puller.link(1, *owner.listen_address, 5.0)
        link = puller.get_link(1)
        assert link.path_name == "cma", link
        assert f"verified by the kernel (pid {os.getpid()}," in link.reason, link
        out = np.zeros(8 << 20, np.uint8)
        c = puller.register(Geometry(1, 8 << 20, 1), [out.ctypes.data], placement=0)
        plan = plan_slot(c.geometry, 0, every_tensor(1))
        puller.pull(1, p.KeyRef(p.KeyKind.CACHE_ID, 2, 0), 0, plan, c.cache_id, 10.0)
        assert np.array_equal(out, big)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5.0)
            s.connect(local_name(os.getpid(), 1))
            s.sendall(p.encode(p.Hello(3, 2, os.getpid(), 0, b"\0" * 16), 1))
            got = b""
            with contextlib.suppress(OSError):
                while chunk := s.recv(65536):
                    got += chunk
            assert b"DD" not in got[:2]  # no Welcome: the TLS server hung up
    finally:
        puller.close()
        owner.close()


def test_the_listener_pushes_over_the_reverse_channel_with_tls_and_a_secret(certs) -> None:
    """The reverse channel (docs/protocol.md) is opened like the control channel: inside
    mutual TLS and with the shared-secret challenge; the listener's push lands."""
    owner = _engine(EngineConfig(cluster_id=1, role=1, listen=("127.0.0.1", 0),
                                          tls=certs["prompt"], secret=b"s3cret"))
    linker = _engine(EngineConfig(cluster_id=2, role=2, transport="tcp",
                                           tls=certs["decoder"], secret=b"s3cret"))
    try:
        dst = np.zeros((4, 256), np.uint8)
        linker.register(Geometry(1, 4 * 256, 4, True), [dst.ctypes.data], placement=0,
                        blocks_model_id=0)
        linker.link(1, *owner.listen_address, 5.0)
        src = np.random.default_rng(3).integers(0, 255, (4, 256), dtype=np.uint8)
        mine = owner.register(Geometry(1, 4 * 256, 4, True), [src.ctypes.data], placement=0)
        # remote (the linker's) blocks 2, 0 <- local blocks 1, 3
        plan = plan_blocks(mine.geometry, [2, 0], [1, 3], every_tensor(1))
        owner.push(2, p.KeyRef(p.KeyKind.BLOCKS_KEY, 0, 0), 256, plan, mine.cache_id, 5.0)
        assert np.array_equal(dst[[2, 0]], src[[1, 3]])
        assert not dst[[1, 3]].any()
        assert owner.get_link(2).inbound
        assert not _speaks_plain(owner.listen_address)
    finally:
        linker.close()
        owner.close()


# ---- stalls: a peer that stops mid-handshake, or mid-record, gets an error (never a hang)
# and holds nothing it should not: no I/O thread of the core's (there are 2 to 8 of them; each
# test stalls STALLED connections, more than that).

STALLED = 12


def _client_hello(ctx: ssl.SSLContext) -> bytes:
    """The first flight a TLS client sends (its ClientHello record), made in memory."""
    out = ssl.MemoryBIO()
    obj = ctx.wrap_bio(ssl.MemoryBIO(), out)
    with contextlib.suppress(ssl.SSLWantReadError):
        obj.do_handshake()
    return out.read()


class _HandTls:
    """A TLS client driven by hand over a plain socket (ssl.SSLObject on memory BIOs), so
    that a test chooses which of its bytes leave and when."""

    def __init__(self, address: tuple[str, int], tls: TlsConfig) -> None:
        self.sock = socket.create_connection(address, timeout=5.0)
        self.inc, self.out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.obj = tls.client_context().wrap_bio(self.inc, self.out)
        while True:
            try:
                self.obj.do_handshake()
                break
            except ssl.SSLWantReadError:
                self.sock.sendall(self.out.read())
                data = self.sock.recv(65536)
                assert data, "the owner closed during the TLS handshake"
                self.inc.write(data)
        self.sock.sendall(self.out.read())
        self.dec = p.FrameDecoder()

    def record(self, data: bytes) -> bytes:
        """``data`` as the bytes of the TLS record(s) that carry it (not sent)."""
        self.obj.write(data)
        return self.out.read()

    def frames(self, n: int) -> list[Any]:
        """The next ``n`` frames the owner sends (fewer if it closes)."""
        got: list[Any] = []
        while len(got) < n:
            try:
                got += [m for _, m in self.dec.feed(self.obj.read(65536))]
                continue
            except ssl.SSLWantReadError:
                pass
            data = self.sock.recv(65536)
            if not data:
                break
            self.inc.write(data)
        return got

    def close(self) -> None:
        self.sock.close()


def _hello() -> bytes:
    return p.encode(p.Hello(7, 2, os.getpid(), 0, b"\0" * 16), 1)


def _pull_big(puller: Any, owner: Any, big: np.ndarray) -> None:
    puller.link(1, *owner.listen_address, 5.0)
    out = np.zeros(8 << 20, np.uint8)
    c = puller.register(Geometry(1, 8 << 20, 1), [out.ctypes.data], placement=0)
    plan = plan_slot(c.geometry, 0, every_tensor(1))
    puller.pull(1, p.KeyRef(p.KeyKind.CACHE_ID, 2, 0), 0, plan, c.cache_id, 5.0)
    assert np.array_equal(out, big)


@pytest.mark.parametrize("where", ["mid-handshake", "mid-record"])
def test_peers_that_stall_hold_no_thread_and_are_dropped(certs, where: str) -> None:
    """STALLED clients stop halfway through their ClientHello, or (after the handshake) halfway
    through the record of their HELLO: an honest peer still links and pulls at once (a
    stalled connection stays parked: the core's I/O threads wait for a whole record, not on
    a peer), and the stalled ones are closed at the handshake's deadline (10 s)."""
    owner, _, big = _owner(certs["prompt"])
    puller = _engine(EngineConfig(cluster_id=2, role=2, transport="tcp",
                                           tls=certs["decoder"]))
    stalled: list[socket.socket] = []
    try:
        host, port = owner.listen_address
        for _ in range(STALLED):
            if where == "mid-handshake":
                s = socket.create_connection((host, port), timeout=5.0)
                hello = _client_hello(certs["decoder"].client_context())
                s.sendall(hello[: len(hello) // 2])
            else:
                hand = _HandTls((host, port), certs["decoder"])
                rec = hand.record(_hello())
                hand.sock.sendall(rec[:-3])
                s = hand.sock
            stalled.append(s)
        time.sleep(0.3)  # the owner has seen every stalled byte
        t0 = time.monotonic()
        _pull_big(puller, owner, big)
        assert time.monotonic() - t0 < 4.0  # not behind a stalled peer's deadline
        end = time.monotonic() + 15.0
        for s in stalled:  # closed by the owner at the handshake's deadline, not left open
            with contextlib.suppress(ConnectionResetError):
                while True:
                    s.settimeout(max(0.1, end - time.monotonic()))
                    if not s.recv(65536):
                        break
    finally:
        for s in stalled:
            s.close()
        puller.close()
        owner.close()


def test_a_linker_gives_up_on_a_listener_that_stalls_the_handshake(certs) -> None:
    """A listener that accepts and never answers the ClientHello: the link fails with its
    deadline, saying where it stopped, and holds nothing after."""
    quiet = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        quiet.settimeout(0.1)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError, OSError):
                accepted.append(quiet.accept()[0])

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    linker = _engine(EngineConfig(cluster_id=2, role=2, transport="tcp",
                                        tls=certs["decoder"]))
    try:
        t0 = time.monotonic()
        with pytest.raises((LinkFailed, Timeout)) as e:
            linker.link(1, *quiet.getsockname()[:2], 1.5)
        assert time.monotonic() - t0 < 4.0
        assert "TLS handshake" in str(e.value) and "timed out" in str(e.value)
        assert not linker.links()
    finally:
        stop.set()
        t.join()
        linker.close()
        for s in [quiet, *accepted]:
            s.close()


def test_frames_that_share_a_record_are_all_answered(certs) -> None:
    """Two PINGs in one TLS record: the owner answers both (the second is already decrypted
    when the first is served, and its socket will not wake for it)."""
    owner, _, _ = _owner(certs["prompt"])
    hand = _HandTls(owner.listen_address, certs["decoder"])
    try:
        hand.sock.sendall(hand.record(_hello()))
        assert isinstance(hand.frames(1)[0], p.Welcome)
        hand.sock.sendall(hand.record(p.encode(p.Ping(11), 2) + p.encode(p.Ping(12), 3)))
        assert [m.nonce for m in hand.frames(2)] == [11, 12]
    finally:
        hand.close()
        owner.close()


def test_tls_options_run_on_the_core(certs, monkeypatch) -> None:
    """A TLS configuration given to LLMDataDist runs on the core (a core built without
    OpenSSL refuses it: test_a_core_built_without_tls_refuses_tls)."""
    import datadist as llm

    tls = certs["decoder"]
    options = {"datadist.TlsCert": tls.cert_file, "datadist.TlsKey": tls.key_file,
               "datadist.TlsCa": tls.ca_file}
    dd = llm.LLMDataDist(llm.LLMRole.DECODER, 2)
    dd.init(dict(options))
    try:
        assert isinstance(dd.engine, NativeEngine)
        assert dd.engine.config.tls == tls
    finally:
        dd.finalize()


# Run in a child with the core built without TLS: the package's Python files beside that
# module. Prints one line per check; the parent asserts them.
_NO_TLS_CHILD = """
import sys
import datadist as llm
from datadist.core import native
from datadist.core.config import EngineConfig, TlsConfig
from datadist.core.errors import NotSupported

cert, key, ca = sys.argv[1:4]
assert native.core_module().__file__.startswith(sys.argv[4]), native.core_module().__file__
print("tls", native.tls_available())
dd = llm.LLMDataDist(llm.LLMRole.DECODER, 2)
try:
    dd.init({"datadist.TlsCert": cert, "datadist.TlsKey": key, "datadist.TlsCa": ca})
    print("init ok")
except llm.LLMException as e:
    print("init", e.status_code.name, e)
# The core itself, past the package's own check (native.refusal): its engine must refuse.
try:
    native.NativeEngine(EngineConfig(cluster_id=3, role=2,
                                     tls=TlsConfig(cert_file=cert, key_file=key, ca_file=ca)))
    print("engine ok")
except NotSupported as e:
    print("engine", int(e.code), e)
"""


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_a_core_built_without_tls_refuses_tls(certs, tmp_path) -> None:
    """The core built with -DDATADIST_TLS=OFF (docs/native-build.md; OpenSSL installed, so
    only the option keeps it out), into a temporary directory: LLMDataDist.init with TLS
    options fails with LLM_FEATURE_NOT_ENABLED saying why, and so does the core's own engine
    when handed a TLS configuration past the package's check; never a link without TLS.
    Builds the core once more (minutes on a busy 2-core machine): marked slow."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    build = tmp_path / "build"
    found = subprocess.run([sys.executable, "-m", "pybind11", "--cmakedir"],
                           capture_output=True, text=True)
    if found.returncode:  # the C++ API's test below builds the same core without it
        pytest.skip("building the module needs pybind11 here (pip install pybind11)")
    cmakedir = found.stdout.strip()
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    # An unset CMAKE_BUILD_TYPE: no optimisation, the quickest compile.
    for cmd in (["cmake", "-S", str(root), "-B", str(build), *gen, "-DDATADIST_TLS=OFF",
                 "-DDATADIST_CORE_INPLACE=OFF", f"-Dpybind11_DIR={cmakedir}",
                 f"-DPython_EXECUTABLE={sys.executable}"],
                ["cmake", "--build", str(build), "--target", "_core", "-j",
                 str(min(4, os.cpu_count() or 1))]):
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1400)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (module,) = build.glob("_core*.so")
    pkg = tmp_path / "pkg"
    src = Path(native.__file__).resolve().parents[1]  # src/datadist
    shutil.copytree(src, pkg / "datadist", ignore=shutil.ignore_patterns("_core*", "__pycache__"))
    shutil.copy2(module, pkg / "datadist" / module.name)
    tls = certs["decoder"]
    env = {**os.environ, "PYTHONPATH": str(pkg)}
    done = subprocess.run([sys.executable, "-c", _NO_TLS_CHILD, tls.cert_file, tls.key_file,
                           tls.ca_file, str(pkg)], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("tls (False, "), lines
    assert lines[1].startswith("init LLM_FEATURE_NOT_ENABLED"), lines
    assert "TLS" in lines[1], lines
    assert lines[2].startswith(f"engine {0x5010B019} "), lines  # FEATURE_NOT_ENABLED


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_a_cpp_api_built_without_tls_refuses_tls(certs, tmp_path) -> None:
    """The same refusal through CANN's C++ API: cpp/ built with -DDATADIST_TLS=OFF into a
    temporary directory (the library and its test peer, cpp/tests/xpeer.cc; no pybind11
    needed), whose Initialize with the three TLS files (DATADIST_TLS_* variables) answers
    LLM_FEATURE_NOT_ENABLED; without them it initializes. Builds the core once more: slow."""
    import subprocess

    from interop.conftest import LLM_SUCCESS, XPeer

    root = Path(__file__).resolve().parents[2]
    build = tmp_path / "build"
    for cmd in (["cmake", "-S", str(root / "cpp"), "-B", str(build), "-DDATADIST_TLS=OFF",
                 "-DDATADIST_BUILD_EXAMPLES=OFF"],
                ["cmake", "--build", str(build), "--target", "dd_xpeer", "-j",
                 str(min(4, os.cpu_count() or 1))]):
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1400)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    tls = certs["decoder"]
    env = {"DATADIST_TLS_CERT": tls.cert_file, "DATADIST_TLS_KEY": tls.key_file,
           "DATADIST_TLS_CA": tls.ca_file}
    for extra, want in ((env, 0x5010B019), ({}, LLM_SUCCESS)):  # LLM_FEATURE_NOT_ENABLED
        peer = XPeer(build, extra)
        try:
            got = peer.status("init 41 2 - 1000")
            assert got == want, f"{got:#x} != {want:#x}: {peer.log()[-2000:]}"
        finally:
            peer.close()
