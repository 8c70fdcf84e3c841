"""Why a link failed reaches the caller: a warning (stderr by default), the last failure per
cluster, and ``datadist probe`` naming the step that fails (issue 25, item 1). The codes stay
CANN's: LLM_LINK_FAILED whatever the reason."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import threading

import pytest

import datadist as llm
from datadist.core.config import EngineConfig
from datadist.core.native import NativeEngine
from datadist.probe import probe
from datadist.wire import protocol as p

from ._support import free_port, loopback_info

pytestmark = pytest.mark.timeout(60)


_free_port, _info = free_port, loopback_info


@pytest.fixture
def decoder():
    d = llm.LLMDataDist(llm.LLMRole.DECODER, 2)
    cfg = llm.LLMConfig()
    cfg.enable_cache_manager = True
    d.init(cfg.generate_options())
    yield d
    d.finalize()


@pytest.fixture
def owner():
    eng = NativeEngine(EngineConfig(cluster_id=1, role=1, listen=("127.0.0.1", 0)))
    yield eng
    eng.close()


def test_a_failed_link_keeps_its_code_and_warns_with_the_reason(decoder) -> None:
    port = _free_port()
    with pytest.warns(llm.LinkFailedWarning, match="nothing listens there"):
        code, codes = decoder.link_clusters([_info(1, port)], 1000)
    assert code == llm.LLMStatusCode.LLM_LINK_FAILED
    assert codes == [llm.LLMStatusCode.LLM_LINK_FAILED]
    last = decoder.last_link_failure(1)
    assert last is not None and "nothing listens there" in last
    assert f"datadist probe 127.0.0.1:{port} --cluster-id 1" in last
    assert decoder.last_link_failure(7) is None


def test_the_last_failure_says_why_and_clears_on_success(decoder, owner) -> None:
    """(A wrong cluster id is no failure any more: the link is filed under the id the
    listener announces, as the original's LinkMsgHandler; tests/api/test_link_ids.py.)"""
    _, port = owner.listen_address
    with pytest.warns(llm.LinkFailedWarning, match="nothing listens"):
        code, _ = decoder.link_clusters([_info(5, _free_port())], 2000)
    assert code == llm.LLMStatusCode.LLM_LINK_FAILED
    assert "nothing listens" in (decoder.last_link_failure(5) or "")
    with pytest.warns(llm.LinkFailedWarning):
        decoder.link_clusters([_info(1, _free_port())], 1000)
    assert decoder.last_link_failure(1) is not None
    code, _ = decoder.link_clusters([_info(1, port)], 2000)
    assert code == llm.LLMStatusCode.LLM_SUCCESS
    assert decoder.last_link_failure(1) is None  # a success clears it
    assert decoder.last_link_failure(5) is not None  # other clusters keep theirs


def test_the_warning_reaches_stderr_with_default_settings() -> None:
    """No logging configured, no warning filter: the reason is on stderr."""
    port = _free_port()
    code = (
        "import datadist as llm\n"
        "d = llm.LLMDataDist(llm.LLMRole.DECODER, 2)\n"
        "c = llm.LLMConfig(); c.enable_cache_manager = True\n"
        "d.init(c.generate_options())\n"
        "i = llm.LLMClusterInfo(); i.remote_cluster_id = 1\n"
        "i.append_local_ip_info('127.0.0.1', 0)\n"
        f"i.append_remote_ip_info('127.0.0.1', {port})\n"
        "print(d.link_clusters([i], 1000)[0])\n"
        "d.finalize()\n"
    )
    out = subprocess.run([sys.executable, "-W", "default", "-c", code], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "LLM_LINK_FAILED" in out.stdout
    assert "LinkFailedWarning" in out.stderr and "nothing listens there" in out.stderr
    # and without -W at all (Python's own default filters)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert "nothing listens there" in out.stderr


# ------------------------------------------------------------------------------ the probe


def test_probe_port_closed() -> None:
    assert probe("127.0.0.1", _free_port(), 1, timeout=2).kind == "closed"


def test_probe_ok_and_wrong_cluster_id(owner) -> None:
    host, port = owner.listen_address
    ok = probe(host, port, 1, timeout=2)
    assert ok.ok and "cluster 1" in ok.text and "PROMPT" in ok.text
    assert probe(host, port, None, timeout=2).ok
    wrong = probe(host, port, 3, timeout=2)
    assert wrong.kind == "cluster-id" and "is cluster 1, not 3" in wrong.text


def test_probe_auth() -> None:
    eng = NativeEngine(EngineConfig(cluster_id=1, role=1, listen=("127.0.0.1", 0),
                                    secret=b"s3cret"))
    try:
        host, port = eng.listen_address
        none = probe(host, port, 1, timeout=2)
        assert none.kind == "auth" and "requires a shared secret" in none.text
        wrong = probe(host, port, 1, secret=b"other", timeout=2)
        assert wrong.kind == "auth" and "another shared secret" in wrong.text
        assert probe(host, port, 1, secret=b"s3cret", timeout=2).ok
    finally:
        eng.close()
    plain = NativeEngine(EngineConfig(cluster_id=1, role=1, listen=("127.0.0.1", 0)))
    try:
        found = probe(*plain.listen_address, 1, secret=b"s3cret", timeout=2)
        assert found.kind == "auth" and "uses no shared secret" in found.text
    finally:
        plain.close()


def _serve_once(answer: bytes) -> tuple[int, threading.Thread]:
    """A listener that reads a little and answers ``answer`` (then closes)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def run() -> None:
        with srv:
            conn, _ = srv.accept()
            with conn:
                conn.recv(64)
                conn.sendall(answer)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return srv.getsockname()[1], t


def test_probe_not_datadist_and_version() -> None:
    port, t = _serve_once(b"HTTP/1.1 400 Bad Request\r\n\r\n")
    found = probe("127.0.0.1", port, 1, timeout=2)
    t.join(5)
    assert found.kind == "not-datadist" and "HTTP server" in found.text
    frame = bytearray(p.encode(p.Ok()))
    frame[2] = p.VERSION + 1  # a datadist of another protocol version
    port, t = _serve_once(bytes(frame))
    found = probe("127.0.0.1", port, 1, timeout=2)
    t.join(5)
    assert found.kind == "version" and f"version {p.VERSION + 1}" in found.text


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_probe_tls(tmp_path) -> None:
    """The probe tells the core's TLS listener from a plain one."""
    from datadist.core import native
    from datadist.testing.certs import make_ca as _ca
    from datadist.testing.certs import make_leaf as _leaf

    if not (native.available()[0] and native.tls_available()[0]):
        pytest.skip("the C++ core is not built with TLS here")
    make = native.NativeEngine
    _ca(tmp_path, "ca")
    server, client = _leaf(tmp_path, "prompt", "ca"), _leaf(tmp_path, "decoder", "ca")
    eng = make(EngineConfig(cluster_id=1, role=1, listen=("127.0.0.1", 0), tls=server))
    try:
        host, port = eng.listen_address
        plain = probe(host, port, 1, timeout=2)
        assert plain.kind == "tls" and "requires TLS" in plain.text
        assert probe(host, port, 1, tls=client.client_context(), timeout=2).ok
    finally:
        eng.close()
    plain_eng = make(EngineConfig(cluster_id=1, role=1, listen=("127.0.0.1", 0)))
    try:
        found = probe(*plain_eng.listen_address, 1, tls=client.client_context(), timeout=2)
        assert found.kind == "tls"
    finally:
        plain_eng.close()


def test_probe_command_exit_codes(owner, capsys) -> None:
    from datadist.cli import main

    host, port = owner.listen_address
    assert main(["probe", f"{host}:{port}", "--cluster-id", "1"]) == 0
    assert capsys.readouterr().out.startswith("ok: ")
    assert main(["probe", f"{host}:{port}", "--cluster-id", "4"]) == 1
    assert capsys.readouterr().out.startswith("cluster-id: ")
