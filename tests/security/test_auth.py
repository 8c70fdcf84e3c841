"""Shared-secret authentication: both ends prove the secret, and a peer without it reads nothing."""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest
from datadist.core.engine import Engine

from datadist.core import auth
from datadist.core.config import EngineConfig
from datadist.core.errors import LinkFailed
from datadist.core.layout import Geometry, layer_tensor_indices, plan_slot
from datadist.wire import protocol as p

pytestmark = pytest.mark.timeout(30)


def test_proofs_depend_on_everything() -> None:
    cn, sn = auth.nonce(), auth.nonce()
    base = auth.client_proof(b"s", cn, sn, 1, 2)
    assert base == auth.client_proof(b"s", cn, sn, 1, 2)
    assert base != auth.client_proof(b"t", cn, sn, 1, 2)
    assert base != auth.client_proof(b"s", sn, cn, 1, 2)
    assert base != auth.client_proof(b"s", cn, sn, 2, 1)
    # a server proof can never be replayed as a client proof (direction labels differ)
    assert auth.server_proof(b"s", cn, sn, 1, 2)[auth.NONCE_BYTES:] != base


@pytest.fixture
def owner():
    eng = Engine(EngineConfig(cluster_id=1, role=1, listen=("127.0.0.1", 0), secret=b"hunter2"))
    data = np.arange(4096, dtype=np.uint8)
    eng.register(Geometry(1, 4096, 1), [data.ctypes.data], placement=0)
    yield eng, data
    eng.close()


def _pull(puller: Engine, owner_eng: Engine) -> np.ndarray:
    host, port = owner_eng.listen_address
    puller.link(1, host, port, 2.0)
    dst = np.zeros(4096, dtype=np.uint8)
    entry = puller.register(Geometry(1, 4096, 1), [dst.ctypes.data], placement=0)
    plan = plan_slot(Geometry(1, 4096, 1), 0, layer_tensor_indices(1, None, None, 2))
    puller.pull(1, p.KeyRef(p.KeyKind.CACHE_ID, 1, 0), 0, plan, entry.cache_id, 2.0)
    return dst


@pytest.mark.parametrize("transport", ["tcp", "cma"])
def test_same_secret_links_and_pulls(owner, transport: str) -> None:
    eng, data = owner
    puller = Engine(EngineConfig(cluster_id=2, role=2, secret=b"hunter2", transport=transport))
    try:
        assert np.array_equal(_pull(puller, eng), data)
    finally:
        puller.close()


@pytest.mark.parametrize("secret", [None, b"wrong"])
def test_missing_or_wrong_secret_is_refused(owner, secret: bytes | None) -> None:
    eng, _ = owner
    puller = Engine(EngineConfig(cluster_id=2, role=2, secret=secret))
    try:
        with pytest.raises(LinkFailed):
            _pull(puller, eng)
        assert not puller.links()
    finally:
        puller.close()


def test_client_with_secret_refuses_server_without(owner) -> None:
    plain = Engine(EngineConfig(cluster_id=3, role=1, listen=("127.0.0.1", 0)))
    puller = Engine(EngineConfig(cluster_id=2, role=2, secret=b"hunter2"))
    try:
        host, port = plain.listen_address
        with pytest.raises(LinkFailed, match="did not prove"):
            puller.link(3, host, port, 2.0)
    finally:
        puller.close()
        plain.close()


def _recv_frames(sock: socket.socket, seconds: float = 2.0) -> list:
    """Everything the server sends until it closes (or the time is up)."""
    dec = p.FrameDecoder()
    out: list = []
    sock.settimeout(0.2)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        if not chunk:
            break
        out += [m for _, m in dec.feed(chunk)]
    return out


def test_unauthenticated_raw_client_reads_nothing(owner) -> None:
    """A client that skips Auth and sends a Read gets an error and a closed connection; no
    byte of the registered memory comes back."""
    eng, data = owner
    host, port = eng.listen_address
    with socket.create_connection((host, port), timeout=2) as s:
        hello = p.Hello(9, 2, 1, 1, b"\0" * 16, 0, b"")
        read = p.Read(p.KeyRef(p.KeyKind.CACHE_ID, 1, 0), 0, p.ReadFlags.NONE,
                      np.array([0], np.uint32), np.array([0], np.uint64),
                      np.array([4096], np.uint64))
        s.sendall(p.encode(hello, 1) + p.encode(read, 2))
        frames = _recv_frames(s)
    kinds = [type(m).__name__ for m in frames]
    assert kinds[0] == "Welcome" and frames[0].features & p.FEATURE_AUTH
    assert "ReadData" not in kinds and "Grant" not in kinds and not any(
        isinstance(m, bytes) for m in frames), kinds
    errors = [m for m in frames if isinstance(m, p.Error)]
    assert errors and errors[0].code == LinkFailed.code
    # and the owner still serves a peer that knows the secret
    puller = Engine(EngineConfig(cluster_id=2, role=2, secret=b"hunter2"))
    try:
        assert np.array_equal(_pull(puller, eng), data)
    finally:
        puller.close()


def test_forged_proof_is_refused(owner) -> None:
    eng, _ = owner
    host, port = eng.listen_address
    with socket.create_connection((host, port), timeout=2) as s:
        s.sendall(p.encode(p.Hello(9, 2, 1, 1, b"\0" * 16, p.FEATURE_AUTH, auth.nonce()), 1))
        dec = p.FrameDecoder()
        s.settimeout(2)
        got: list = []
        while not got:
            got = [m for _, m in dec.feed(s.recv(65536))]
        s.sendall(p.encode(p.Auth(b"\0" * auth.MAC_BYTES), 2))
        frames = got[1:] + _recv_frames(s)
    assert any(isinstance(m, p.Error) and m.code == LinkFailed.code for m in frames), frames
    assert not any(isinstance(m, p.Ok) for m in frames)


def test_a_peer_that_stops_mid_frame_is_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    """After the handshake, half a frame and then silence: the server gives that frame
    FRAME_TIMEOUT, then drops the connection (its thread is freed)."""
    import datadist.transport.tcp as tcp_mod

    monkeypatch.setattr(tcp_mod, "FRAME_TIMEOUT", 0.5)
    eng = Engine(EngineConfig(cluster_id=1, role=1, listen=("127.0.0.1", 0)))
    try:
        host, port = eng.listen_address
        with socket.create_connection((host, port), timeout=5) as s:
            s.sendall(p.encode(p.Hello(9, 2, 1, 1, b"\0" * 16, 0, b""), 1))
            dec = p.FrameDecoder()
            got: list = []
            while not got:
                got = [m for _, m in dec.feed(s.recv(4096))]
            assert isinstance(got[0], p.Welcome)
            s.sendall(p.encode(p.Ping(1), 2)[:7])  # half a header, then nothing
            t0 = time.monotonic()
            while s.recv(4096):  # until the server closes (an error frame may come first)
                pass
            assert time.monotonic() - t0 < 4.5  # FRAME_TIMEOUT (0.5 s), not the socket's 5 s
        end = time.monotonic() + 5  # the serving thread forgets the peer on its way out
        while eng.inbound_peers() and time.monotonic() < end:
            time.sleep(0.01)
        assert not eng.inbound_peers()
    finally:
        eng.close()
