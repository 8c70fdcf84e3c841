"""Mutual TLS on links: both ends need a certificate from the configured CA."""

from __future__ import annotations

import contextlib
import shutil

import numpy as np
import pytest

from datadist.core.engine import Engine, EngineConfig
from datadist.core.errors import LinkFailed, Timeout
from datadist.core.layout import Geometry, layer_tensor_indices, plan_blocks, plan_slot
from datadist.testing.certs import make_ca as _ca
from datadist.testing.certs import make_leaf as _leaf
from datadist.transport.tls import TlsConfig
from datadist.wire import protocol as p

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command"),
]


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TlsConfig]:
    d = tmp_path_factory.mktemp("tls")
    _ca(d, "ca")
    _ca(d, "evil")
    return {"prompt": _leaf(d, "prompt", "ca"), "decoder": _leaf(d, "decoder", "ca"),
            "stranger": _leaf(d, "stranger", "evil")}


def _owner(tls: TlsConfig | None, host: str = "127.0.0.1"):
    eng = Engine(EngineConfig(cluster_id=1, role=1, listen=(host, 0), tls=tls))
    blocks = [np.random.default_rng(i).integers(0, 255, (64, 4096), dtype=np.uint8)
              for i in range(2)]
    eng.register(Geometry(2, 64 * 4096, 64, True), [b.ctypes.data for b in blocks],
                 placement=0, blocks_model_id=0)
    big = np.random.default_rng(9).integers(0, 255, 8 << 20, dtype=np.uint8)
    eng.register(Geometry(1, 8 << 20, 1), [big.ctypes.data], placement=0)
    return eng, blocks, big


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
    puller = Engine(EngineConfig(cluster_id=2, role=2, transport="tcp", tls=certs["decoder"]))
    stranger = Engine(EngineConfig(cluster_id=3, role=2, transport="tcp",
                                   tls=certs["stranger"]))
    try:
        host, port = owner.listen_address
        assert host == "::1"
        puller.link(1, host, port, 5.0)
        dst = [np.zeros((64, 4096), np.uint8) for _ in range(2)]
        local = puller.register(Geometry(2, 64 * 4096, 64, True), [d.ctypes.data for d in dst],
                                placement=0)
        plan = plan_blocks(local.geometry, [7], [1], layer_tensor_indices(2, None, None, 2))
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
    puller = Engine(EngineConfig(cluster_id=2, role=2, transport="tcp", tls=certs["decoder"]))
    try:
        host, port = owner.listen_address
        puller.link(1, host, port, 5.0)
        # paged: scattered blocks, several spans
        dst = [np.zeros((64, 4096), np.uint8) for _ in range(2)]
        local = puller.register(Geometry(2, 64 * 4096, 64, True), [d.ctypes.data for d in dst],
                                placement=0)
        src_b, dst_b = [3, 4, 5, 40, 9], [0, 1, 2, 7, 63]
        plan = plan_blocks(local.geometry, src_b, dst_b, layer_tensor_indices(2, None, None, 2))
        puller.pull(1, p.KeyRef(p.KeyKind.BLOCKS_KEY, 0, 0), 4096, plan, local.cache_id, 10.0)
        for t in range(2):
            assert np.array_equal(dst[t][dst_b], blocks[t][src_b])
        # contiguous, larger than any buffer
        out = np.zeros(8 << 20, np.uint8)
        c = puller.register(Geometry(1, 8 << 20, 1), [out.ctypes.data], placement=0)
        plan = plan_slot(c.geometry, 0, layer_tensor_indices(1, None, None, 2))
        puller.pull(1, p.KeyRef(p.KeyKind.CACHE_ID, 2, 0), 0, plan, c.cache_id, 10.0)
        assert np.array_equal(out, big)
        puller.check_link(1, 5.0)
    finally:
        puller.close()
        owner.close()


@pytest.mark.parametrize("who", ["plain", "stranger"])
def test_peers_without_a_valid_certificate_are_refused(certs, who: str) -> None:
    owner, _, _ = _owner(certs["prompt"])
    tls = None if who == "plain" else certs["stranger"]
    puller = Engine(EngineConfig(cluster_id=2, role=2, transport="tcp", tls=tls))
    try:
        host, port = owner.listen_address
        with pytest.raises((LinkFailed, Timeout)):
            puller.link(1, host, port, 3.0)
        assert not puller.links()
    finally:
        puller.close()
        owner.close()


def test_tls_client_refuses_a_plain_server(certs) -> None:
    owner, _, _ = _owner(None)
    puller = Engine(EngineConfig(cluster_id=2, role=2, tls=certs["decoder"]))
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
    import os
    import socket

    from datadist.transport.local import local_name
    from datadist.transport.paths import CmaPath
    from datadist.transport.tls import TlsChannel

    owner, _, big = _owner(certs["prompt"])
    puller = Engine(EngineConfig(cluster_id=2, role=2, tls=certs["decoder"]))
    try:
        link = puller.link(1, *owner.listen_address, 5.0)
        assert isinstance(link.path, CmaPath) and isinstance(link.chan, TlsChannel)
        assert link.chan.local_cred is not None and link.chan.local_cred.pid == os.getpid()
        out = np.zeros(8 << 20, np.uint8)
        c = puller.register(Geometry(1, 8 << 20, 1), [out.ctypes.data], placement=0)
        plan = plan_slot(c.geometry, 0, layer_tensor_indices(1, None, None, 2))
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
    owner = Engine(EngineConfig(cluster_id=1, role=1, listen=("127.0.0.1", 0),
                                tls=certs["prompt"], secret=b"s3cret"))
    linker = Engine(EngineConfig(cluster_id=2, role=2, transport="tcp", tls=certs["decoder"],
                                 secret=b"s3cret"))
    try:
        dst = np.zeros((4, 256), np.uint8)
        linker.register(Geometry(1, 4 * 256, 4, True), [dst.ctypes.data], placement=0,
                        blocks_model_id=0)
        linker.link(1, *owner.listen_address, 5.0)
        src = np.random.default_rng(3).integers(0, 255, (4, 256), dtype=np.uint8)
        mine = owner.register(Geometry(1, 4 * 256, 4, True), [src.ctypes.data], placement=0)
        # remote (the linker's) blocks 2, 0 <- local blocks 1, 3
        plan = plan_blocks(mine.geometry, [2, 0], [1, 3], layer_tensor_indices(1, None, None, 1))
        owner.push(2, p.KeyRef(p.KeyKind.BLOCKS_KEY, 0, 0), 256, plan, mine.cache_id, 5.0)
        assert np.array_equal(dst[[2, 0]], src[[1, 3]])
        assert not dst[[1, 3]].any()
        assert owner.get_link(2).inbound
    finally:
        linker.close()
        owner.close()
