"""Reverse channels across languages (docs/protocol.md): a decoder that never listens links to
the prompt, and the prompt then pushes to (and pulls from) the decoder's cluster id over that
link. Both ways between C++ and Python, every byte checked."""

from __future__ import annotations

import numpy as np
import pytest

import datadist as llm

from ._python_side import PY_ID, link_to, make_python, register
from .conftest import LLM_LINK_FAILED, LLM_SUCCESS, pattern

# The first test of a session builds cpp/ (tens of seconds on a busy machine).
pytestmark = pytest.mark.timeout(600)

CPP_ID = 31


def test_cpp_prompt_pushes_to_a_python_decoder_that_never_listens(xpeer):
    cpp = xpeer()
    cpp.init(CPP_ID, 1, listen=True)
    src = cpp.register(2, (4, 16))
    data = [pattern(40 + t, 64) for t in range(2)]
    for t in range(2):
        cpp.write(src, t, data[t])
    py = make_python(llm.LLMRole.DECODER, listen=False)
    try:
        cache, arrays = register(py, 2, (4, 16))
        link_to(py, CPP_ID, cpp.port)
        cpp.ok(f"pushb {src} {PY_ID} {cache.cache_id} 3,0 0,2 -1 -1 -1 -1 2")
        cpp.ok(f"pushc {src} {PY_ID} {cache.cache_id} 1 2 -1 -1 -1 -1 -1 2")
        for t in range(2):
            assert arrays[t][0].tobytes() == data[t][48:64]
            assert arrays[t][2].tobytes() == data[t][0:16]
            assert arrays[t][1].tobytes() == data[t][32:48]
            assert not arrays[t][3].any()
        # the C++ prompt also pulls from it
        arrays[1][3] = np.frombuffer(pattern(77, 16), dtype=np.uint8)
        back = cpp.register(2, (4, 16))
        cpp.ok(f"pullc {PY_ID} {cache.cache_id} 3 {back} 0 -1 -1 -1 -1 -1 2")
        assert cpp.read(back, 1)[:16] == pattern(77, 16)
        # the decoder unlinks: the prompt's end of the link fails
        code, _ = py.unlink_clusters([_info(CPP_ID, cpp.port)], timeout=3000)
        assert code == llm.LLMStatusCode.LLM_SUCCESS
        assert cpp.status(f"pushc {src} {PY_ID} {cache.cache_id} 0 0 -1 -1 -1 -1 -1 2") == \
            LLM_LINK_FAILED
    finally:
        py.finalize()


def test_python_prompt_pushes_to_a_cpp_decoder_that_never_listens(xpeer):
    py = make_python(llm.LLMRole.PROMPT, listen=True)
    try:
        src, arrays = register(py, 2, (4, 16))
        bsrc, barrays = register(py, 2, (4, 16), blocks=True, model_id=3)
        for t in range(2):
            arrays[t].reshape(-1)[:] = np.frombuffer(pattern(60 + t, 64), dtype=np.uint8)
            barrays[t][:] = arrays[t]
        cpp = xpeer()
        cpp.init(CPP_ID, 2)  # no listen_ip_info
        dst = cpp.register(2, (4, 16))
        assert cpp.status(f"link {PY_ID} 127.0.0.1 {py.listen_address[1]} 3000") == LLM_SUCCESS
        cm = py.cache_manager
        cm.push_cache(llm.CacheKeyByIdAndIndex(CPP_ID, dst, 3), src, src_batch_index=1)
        # a C++ owner resolves a BlocksCacheKey's model_id as its cache id
        cm.push_blocks(llm.BlocksCacheKey(CPP_ID, dst), bsrc, [0], [1],
                       src_layer_range=range(1, 2), dst_layer_range=range(1, 2),
                       tensor_num_per_layer=1)
        got = [cpp.read(dst, t) for t in range(2)]
        assert got[0][48:64] == arrays[0][1].tobytes()
        assert got[1][48:64] == arrays[1][1].tobytes()
        assert got[1][16:32] == arrays[1][0].tobytes()
        assert got[0][:48] == bytes(48)  # layer 0's blocks untouched
        assert got[1][:16] == bytes(16) and got[1][32:48] == bytes(16)
    finally:
        py.finalize()


def _info(cluster_id: int, port: int) -> llm.LLMClusterInfo:
    info = llm.LLMClusterInfo()
    info.remote_cluster_id = cluster_id
    info.append_local_ip_info("127.0.0.1", 0)
    info.append_remote_ip_info("127.0.0.1", port)
    return info


def _stranger_reverse_hello(port: int, cluster_id: int, token: bytes = b"") -> object:
    """A raw HELLO with FEATURE_REVERSE (and a token when given) from a fresh socket; the
    answer frame, or None if the listener closed without one."""
    import socket

    from datadist.wire import protocol as p

    features = p.FEATURE_REVERSE | (p.FEATURE_TOKEN if token else 0)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(p.encode(p.Hello(cluster_id, 2, 1, 0, bytes(16), features, token), 1))
        dec, items = p.FrameDecoder(), []
        while not items:
            chunk = s.recv(65536)
            if not chunk:
                return None
            items = dec.feed(chunk)
        return items[0][1]


@pytest.mark.parametrize("token", [b"", b"\x5a" * 16])
def test_a_stranger_cannot_hijack_a_cpp_decoders_reverse_channel_at_a_python_prompt(
        xpeer, token):
    """Issue 21 item 1, across languages: the C++ decoder echoes the Python listener's link
    token; a stranger's reverse HELLO for the decoder's cluster id is refused and the
    prompt's push still lands in the C++ decoder. Before, the stranger's channel replaced
    the decoder's and the push went to the stranger."""
    from datadist.wire import protocol as p

    py = make_python(llm.LLMRole.PROMPT, listen=True)
    try:
        src, arrays = register(py, 2, (4, 16))
        for t in range(2):
            arrays[t].reshape(-1)[:] = np.frombuffer(pattern(80 + t, 64), dtype=np.uint8)
        cpp = xpeer()
        cpp.init(CPP_ID, 2)
        dst = cpp.register(2, (4, 16))
        assert cpp.status(f"link {PY_ID} 127.0.0.1 {py.listen_address[1]} 3000") == LLM_SUCCESS
        answer = _stranger_reverse_hello(py.listen_address[1], CPP_ID, token)
        assert isinstance(answer, p.Error) and answer.code == LLM_LINK_FAILED
        py.cache_manager.push_cache(llm.CacheKeyByIdAndIndex(CPP_ID, dst, 2), src,
                                    src_batch_index=0)
        assert cpp.read(dst, 1)[32:48] == arrays[1][0].tobytes()
    finally:
        py.finalize()


def test_a_stranger_cannot_hijack_a_python_decoders_reverse_channel_at_a_cpp_prompt(xpeer):
    """Issue 21 item 1, the other way: the Python decoder echoes the C++ listener's token."""
    from datadist.wire import protocol as p

    cpp = xpeer()
    cpp.init(CPP_ID, 1, listen=True)
    src = cpp.register(2, (4, 16))
    data = [pattern(90 + t, 64) for t in range(2)]
    for t in range(2):
        cpp.write(src, t, data[t])
    py = make_python(llm.LLMRole.DECODER, listen=False)
    try:
        cache, arrays = register(py, 2, (4, 16))
        link_to(py, CPP_ID, cpp.port)
        answer = _stranger_reverse_hello(cpp.port, PY_ID)
        assert isinstance(answer, p.Error) and answer.code == LLM_LINK_FAILED
        cpp.ok(f"pushc {src} {PY_ID} {cache.cache_id} 1 2 -1 -1 -1 -1 -1 2")
        assert arrays[1][1].tobytes() == data[1][32:48]  # (dst slot 1 <- src slot 2)
    finally:
        py.finalize()
