"""Shared-secret authentication: both ends prove the secret, and a peer without it reads nothing."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

import numpy as np
import pytest
from _hand import MAC_BYTES, NONCE_BYTES, client_proof, nonce, server_mac

from datadist.core.config import EngineConfig
from datadist.core.errors import LinkFailed
from datadist.core.layout import Geometry, every_tensor, plan_slot
from datadist.core.native import NativeEngine
from datadist.wire import protocol as p

pytestmark = pytest.mark.timeout(30)
SECRET = b"hunter2"


def _handshake(owner_eng: NativeEngine, proof_for: Callable[[bytes, bytes], bytes]) -> list:
    """A raw client (cluster 9) says HELLO with a fresh nonce to ``owner_eng`` (secret
    ``hunter2``, cluster 1), checks the WELCOME's proof against the oracle, answers AUTH with
    ``proof_for(client nonce, server nonce)`` and returns what the owner sends then."""
    host, port = owner_eng.listen_address
    with socket.create_connection((host, port), timeout=2) as s:
        cn = nonce()
        s.sendall(p.encode(p.Hello(9, 2, 1, 1, b"\0" * 16, p.FEATURE_AUTH, cn), 1))
        dec = p.FrameDecoder()
        s.settimeout(2)
        got: list = []
        while not got:
            got = [m for _, m in dec.feed(s.recv(65536))]
        welcome = got[0]
        assert isinstance(welcome, p.Welcome) and welcome.features & p.FEATURE_AUTH, got
        proof = p.split_token(welcome.proof, welcome.features)[0]
        assert len(proof) == NONCE_BYTES + MAC_BYTES
        sn, mac = proof[:NONCE_BYTES], proof[NONCE_BYTES:]
        # the owner proves the secret over both nonces and both ids, labelled as the server
        assert mac == server_mac(SECRET, cn, sn, 1, 9)
        assert mac != client_proof(SECRET, cn, sn, 1, 9)
        s.sendall(p.encode(p.Auth(proof_for(cn, sn)), 2))
        return got[1:] + _recv_frames(s, 1.0)


@pytest.mark.parametrize("variant", ["right", "other secret", "nonces swapped", "ids swapped",
                                     "server proof replayed"])
def test_the_core_checks_a_proof_over_everything(owner, variant: str) -> None:
    """The client's proof depends on the secret, both nonces in order, both cluster ids and
    its direction: the core's owner accepts the right one only (a server proof replayed as
    a client proof is refused: the labels differ)."""
    eng, _ = owner
    proofs: dict[str, Callable[[bytes, bytes], bytes]] = {
        "right": lambda cn, sn: client_proof(SECRET, cn, sn, 1, 9),
        "other secret": lambda cn, sn: client_proof(b"hunter3", cn, sn, 1, 9),
        "nonces swapped": lambda cn, sn: client_proof(SECRET, sn, cn, 1, 9),
        "ids swapped": lambda cn, sn: client_proof(SECRET, cn, sn, 9, 1),
        "server proof replayed": lambda cn, sn: server_mac(SECRET, cn, sn, 1, 9),
    }
    frames = _handshake(eng, proofs[variant])
    if variant == "right":
        assert frames and isinstance(frames[0], p.Ok), frames
    else:
        assert any(isinstance(m, p.Error) and m.code == LinkFailed.code for m in frames), frames
        assert not any(isinstance(m, p.Ok) for m in frames)


@pytest.fixture
def owner():
    eng = NativeEngine(EngineConfig(cluster_id=1, role=1, listen=("127.0.0.1", 0), secret=SECRET))
    data = np.arange(4096, dtype=np.uint8)
    eng.register(Geometry(1, 4096, 1), [data.ctypes.data], placement=0)
    yield eng, data
    eng.close()


def _pull(puller: NativeEngine, owner_eng: NativeEngine) -> np.ndarray:
    host, port = owner_eng.listen_address
    puller.link(1, host, port, 2.0)
    dst = np.zeros(4096, dtype=np.uint8)
    entry = puller.register(Geometry(1, 4096, 1), [dst.ctypes.data], placement=0)
    plan = plan_slot(Geometry(1, 4096, 1), 0, every_tensor(1))
    puller.pull(1, p.KeyRef(p.KeyKind.CACHE_ID, 1, 0), 0, plan, entry.cache_id, 2.0)
    return dst


@pytest.mark.parametrize("transport", ["tcp", "cma"])
def test_same_secret_links_and_pulls(owner, transport: str) -> None:
    eng, data = owner
    puller = NativeEngine(EngineConfig(cluster_id=2, role=2, secret=SECRET,
                                       transport=transport))
    try:
        assert np.array_equal(_pull(puller, eng), data)
    finally:
        puller.close()


@pytest.mark.parametrize("secret", [None, b"wrong"])
def test_missing_or_wrong_secret_is_refused(owner, secret: bytes | None) -> None:
    eng, _ = owner
    puller = NativeEngine(EngineConfig(cluster_id=2, role=2, secret=secret))
    try:
        with pytest.raises(LinkFailed):
            _pull(puller, eng)
        assert not puller.links()
    finally:
        puller.close()


def test_client_with_secret_refuses_server_without(owner) -> None:
    plain = NativeEngine(EngineConfig(cluster_id=3, role=1, listen=("127.0.0.1", 0)))
    puller = NativeEngine(EngineConfig(cluster_id=2, role=2, secret=SECRET))
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
    puller = NativeEngine(EngineConfig(cluster_id=2, role=2, secret=SECRET))
    try:
        assert np.array_equal(_pull(puller, eng), data)
    finally:
        puller.close()


def test_forged_proof_is_refused(owner) -> None:
    eng, _ = owner
    host, port = eng.listen_address
    with socket.create_connection((host, port), timeout=2) as s:
        s.sendall(p.encode(p.Hello(9, 2, 1, 1, b"\0" * 16, p.FEATURE_AUTH, nonce()), 1))
        dec = p.FrameDecoder()
        s.settimeout(2)
        got: list = []
        while not got:
            got = [m for _, m in dec.feed(s.recv(65536))]
        s.sendall(p.encode(p.Auth(b"\0" * MAC_BYTES), 2))
        frames = got[1:] + _recv_frames(s)
    assert any(isinstance(m, p.Error) and m.code == LinkFailed.code for m in frames), frames
    assert not any(isinstance(m, p.Ok) for m in frames)


@pytest.mark.timeout(90)
def test_a_peer_that_stops_mid_frame_is_dropped() -> None:
    """After the handshake, half a frame and then silence: the core's owner gives that frame
    its frame timeout (kFrameTimeout, 30 s in cpp/src/server.cc; not configurable), then
    drops the connection and forgets the peer. Before that, the peer is an inbound peer."""
    eng = NativeEngine(EngineConfig(cluster_id=1, role=1, listen=("127.0.0.1", 0)))
    try:
        host, port = eng.listen_address
        with socket.create_connection((host, port), timeout=60) as s:
            s.sendall(p.encode(p.Hello(9, 2, 1, 1, b"\0" * 16, 0, b""), 1))
            dec = p.FrameDecoder()
            got: list = []
            while not got:
                got = [m for _, m in dec.feed(s.recv(4096))]
            assert isinstance(got[0], p.Welcome)
            s.sendall(p.encode(p.Ping(1), 2)[:7])  # half a header, then nothing
            time.sleep(0.2)
            assert [pr.cluster_id for pr in eng.inbound_peers()] == [9]
            while s.recv(4096):  # until the server closes (an error frame may come first)
                pass
        end = time.monotonic() + 5  # the serving side forgets the peer on its way out
        while eng.inbound_peers() and time.monotonic() < end:
            time.sleep(0.01)
        assert not eng.inbound_peers()
    finally:
        eng.close()
