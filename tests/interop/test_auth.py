"""Shared-secret links across languages (docs/protocol.md, Authentication): the same secret
links and moves bytes both ways; a wrong or missing one is refused both ways."""

from __future__ import annotations

import pytest

import datadist as llm

from ._python_side import PY_ID, link_to, make_python, register
from .conftest import LLM_LINK_FAILED, pattern

# The first test of a session builds cpp/ (tens of seconds on a busy machine).
pytestmark = pytest.mark.timeout(600)

CPP_ID = 21


def test_cpp_client_and_python_owner_with_a_secret(xpeer):
    py = make_python(llm.LLMRole.PROMPT, listen=True, secret="k1-secret")
    try:
        _, arrays = register(py, 2, (4, 16))
        arrays[1].reshape(-1)[:] = list(pattern(3, 64))
        port = py.listen_address[1]
        wrong, none, right = xpeer(), xpeer(), xpeer()
        wrong.init(CPP_ID, 2, secret="not-it")
        none.init(CPP_ID + 1, 2)
        right.init(CPP_ID + 2, 2, secret="k1-secret")
        assert wrong.status(f"link {PY_ID} 127.0.0.1 {port} 3000") == LLM_LINK_FAILED
        assert none.status(f"link {PY_ID} 127.0.0.1 {port} 3000") == LLM_LINK_FAILED
        right.ok(f"link {PY_ID} 127.0.0.1 {port} 3000")
        local = right.register(2, (4, 16))
        right.ok(f"pullc {PY_ID} 1 2 {local} 0 -1 -1 -1 -1 -1 2")
        assert right.read(local, 1)[:16] == arrays[1][2].tobytes()
    finally:
        py.finalize()


@pytest.mark.parametrize("py_secret", ["k2-secret", "wrong", ""])
def test_python_client_and_cpp_owner_with_a_secret(xpeer, py_secret):
    cpp = xpeer()
    cpp.init(CPP_ID, 1, listen=True, secret="k2-secret")
    remote = cpp.register(1, (4, 16))
    data = pattern(9, 64)
    cpp.write(remote, 0, data)
    py = make_python(llm.LLMRole.DECODER, listen=False, secret=py_secret)
    try:
        if py_secret != "k2-secret":
            link_to(py, CPP_ID, cpp.port, expect=llm.LLMStatusCode.LLM_LINK_FAILED)
            return
        link_to(py, CPP_ID, cpp.port)
        cache, arrays = register(py, 1, (4, 16))
        py.cache_manager.pull_cache(llm.CacheKeyByIdAndIndex(CPP_ID, remote, 1), cache)
        assert arrays[0][0].tobytes() == data[16:32]
    finally:
        py.finalize()


def test_reverse_channel_with_a_secret(xpeer):
    """The reverse channel proves the secret too: a Python prompt with a secret pushes to a
    C++ decoder (same secret) that never listens."""
    py = make_python(llm.LLMRole.PROMPT, listen=True, secret="k3-secret")
    try:
        src, arrays = register(py, 1, (4, 16))
        arrays[0].reshape(-1)[:] = list(pattern(11, 64))
        cpp = xpeer()
        cpp.init(CPP_ID, 2, secret="k3-secret")
        dst = cpp.register(1, (4, 16))
        cpp.ok(f"link {PY_ID} 127.0.0.1 {py.listen_address[1]} 3000")
        py.cache_manager.push_cache(llm.CacheKeyByIdAndIndex(CPP_ID, dst, 2), src,
                                    src_batch_index=3)
        assert cpp.read(dst, 0)[32:48] == arrays[0][3].tobytes()
    finally:
        py.finalize()
