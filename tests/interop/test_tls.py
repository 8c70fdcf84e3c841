"""Mutual TLS between the core's two APIs: the C++ API (options from DATADIST_TLS_CERT / _KEY /
_CA, as the Python package reads them) and the Python API link and move bytes both ways, the
owner under the Python API pushes over a C++ linker's reverse channel, and a certificate from
another CA is refused both ways."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import datadist as llm
from datadist.core import native
from datadist.core.config import TlsConfig
from datadist.testing.certs import make_ca, make_leaf

from ._python_side import PY_ID, link_to, make_python, register
from .conftest import LLM_LINK_FAILED, pattern

# The first test of a session builds cpp/ (tens of seconds on a busy machine).
pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command"),
    pytest.mark.skipif(not native.tls_available()[0],
                       reason=f"the core was built without TLS: {native.tls_available()[1]}"),
]

CPP_ID = 31


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TlsConfig]:
    d: Path = tmp_path_factory.mktemp("tls-interop")
    make_ca(d, "ca")
    make_ca(d, "evil")
    return {"py": make_leaf(d, "py", "ca"), "cpp": make_leaf(d, "cpp", "ca"),
            "stranger": make_leaf(d, "stranger", "evil")}


def _env(tls: TlsConfig) -> dict[str, str]:
    return {"DATADIST_TLS_CERT": tls.cert_file, "DATADIST_TLS_KEY": tls.key_file,
            "DATADIST_TLS_CA": tls.ca_file}


@pytest.fixture
def python_tls(monkeypatch: pytest.MonkeyPatch, certs):
    """Sets the Python side's TLS files for what it makes next."""

    def use(tls: TlsConfig) -> None:
        for k, v in _env(tls).items():
            monkeypatch.setenv(k, v)

    return use


def test_cpp_linker_and_python_owner_under_tls(xpeer, certs, python_tls) -> None:
    python_tls(certs["py"])
    py = make_python(llm.LLMRole.PROMPT, listen=True)
    try:
        src, arrays = register(py, 2, (4, 16))
        arrays[1].reshape(-1)[:] = list(pattern(3, 64))
        port = py.listen_address[1]
        no_tls = dict.fromkeys(_env(certs["cpp"]), "")  # not the Python side's, inherited
        stranger, plain = xpeer(_env(certs["stranger"])), xpeer(no_tls)
        right = xpeer(_env(certs["cpp"]))
        stranger.init(CPP_ID, 2)
        plain.init(CPP_ID + 1, 2)
        right.init(CPP_ID + 2, 2, sync_ms=3000)
        assert stranger.status(f"link {PY_ID} 127.0.0.1 {port} 3000") == LLM_LINK_FAILED
        assert plain.status(f"link {PY_ID} 127.0.0.1 {port} 3000") == LLM_LINK_FAILED
        # LinkLlmClusters' warning (LastLinkFailure's text) asks, as the Python API's LinkFailed
        assert "during the handshake (does it require TLS?)" in plain.log(), plain.log()
        right.ok(f"link {PY_ID} 127.0.0.1 {port} 3000")
        local = right.register(2, (4, 16))
        right.ok(f"pullc {PY_ID} 1 2 {local} 0 -1 -1 -1 -1 -1 2")
        assert right.read(local, 1)[:16] == arrays[1][2].tobytes()
        # the owner under the Python API pushes over the C++ linker's reverse channel, in TLS
        py.cache_manager.push_cache(llm.CacheKeyByIdAndIndex(CPP_ID + 2, local, 3), src,
                                    src_batch_index=1)
        assert right.read(local, 1)[48:64] == arrays[1][1].tobytes()
    finally:
        py.finalize()


@pytest.mark.parametrize("who", ["good", "stranger", "plain"])
def test_python_linker_and_cpp_owner_under_tls(xpeer, certs, python_tls, who: str) -> None:
    cpp = xpeer(_env(certs["cpp"]))
    cpp.init(CPP_ID, 1, listen=True)
    remote = cpp.register(1, (4, 16))
    data = pattern(9, 64)
    cpp.write(remote, 0, data)
    if who != "plain":
        python_tls(certs["py" if who == "good" else "stranger"])
    py = make_python(llm.LLMRole.DECODER, listen=False)
    try:
        if who != "good":
            link_to(py, CPP_ID, cpp.port, expect=llm.LLMStatusCode.LLM_LINK_FAILED)
            return
        link_to(py, CPP_ID, cpp.port)
        cache, arrays = register(py, 1, (4, 16))
        py.cache_manager.pull_cache(llm.CacheKeyByIdAndIndex(CPP_ID, remote, 1), cache)
        assert arrays[0][0].tobytes() == data[16:32]
    finally:
        py.finalize()
