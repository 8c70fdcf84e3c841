"""One core under two APIs: a peer under the Python API (this process) and one under the C++
API (tests/xpeer), both ways, every byte checked: pulls and pushes by cache id, by blocks and
by layer range, and the owner's error codes crossing the language boundary."""

from __future__ import annotations

import numpy as np
import pytest

import datadist as llm

from ._python_side import PY_ID, link_to, make_python, register
from .conftest import LLM_KV_CACHE_NOT_EXIST, LLM_PARAM_INVALID, pattern

# The first test of a session builds cpp/ (tens of seconds on a busy machine).
pytestmark = pytest.mark.timeout(600)

CPP_ID = 3
PROMPT, DECODER = 1, 2


@pytest.fixture
def py_prompt():
    dd = make_python(llm.LLMRole.PROMPT, listen=True)
    yield dd
    dd.finalize()


@pytest.fixture
def py_decoder():
    dd = make_python(llm.LLMRole.DECODER, listen=True)
    yield dd
    dd.finalize()


def _fill(arrays: list[np.ndarray], seed: int) -> None:
    for i, a in enumerate(arrays):
        a.reshape(-1)[:] = np.frombuffer(pattern(seed + i, a.size), dtype=np.uint8)


def test_cpp_decoder_pulls_from_python_prompt(py_prompt, xpeer):
    # the Python prompt: cache 1 of 4 tensors, 4 slots of 8 x 4 bytes
    shape = (4, 8, 4)
    cache, arrays = register(py_prompt, 4, shape)
    assert cache.cache_id == 1
    _fill(arrays, 100)
    cpp = xpeer()
    cpp.init(CPP_ID, DECODER)
    local = cpp.register(4, shape)
    cpp.ok(f"link {PY_ID} 127.0.0.1 {py_prompt.listen_address[1]} 3000")
    unit = 32
    # PullKvCache: remote slot 2 -> local slot 1, all tensors
    cpp.ok(f"pullc {PY_ID} 1 2 {local} 1 -1 -1 -1 -1 -1 2")
    for t in range(4):
        got = cpp.read(local, t)
        want = bytearray(len(got))
        want[unit:2 * unit] = arrays[t].tobytes()[2 * unit:3 * unit]
        assert got == bytes(want)
    # PullKvBlocks: blocks 3,0 -> 0,2 of layer 1 only ({1,1}, 2 tensors per layer)
    cpp.ok(f"pullb {PY_ID} 1 0 {local} 3,0 0,2 1 1 1 1 2")
    for t in range(4):
        got = cpp.read(local, t)
        want = bytearray(len(got))
        want[unit:2 * unit] = arrays[t].tobytes()[2 * unit:3 * unit]
        if t in (2, 3):
            src = arrays[t].tobytes()
            want[0:unit] = src[3 * unit:4 * unit]
            want[2 * unit:3 * unit] = src[0:unit]
        assert got == bytes(want), t
    # the owner's checks cross over as status codes
    assert cpp.status(f"pullc {PY_ID} 9 0 {local} 0 -1 -1 -1 -1 -1 2") == LLM_KV_CACHE_NOT_EXIST
    assert cpp.status(f"pullc {PY_ID} 1 4 {local} 0 -1 -1 -1 -1 -1 2") == LLM_PARAM_INVALID
    assert cpp.status(f"pullb {PY_ID} 1 0 {local} 4 0 -1 -1 -1 -1 2") == LLM_PARAM_INVALID
    # and the link still works afterwards
    cpp.ok(f"pullc {PY_ID} 1 0 {local} 0 -1 -1 -1 -1 -1 2")
    assert cpp.read(local, 0)[:unit] == arrays[0].tobytes()[:unit]


def test_python_decoder_pulls_from_cpp_prompt(py_decoder, xpeer):
    shape = (4, 16)
    cpp = xpeer()
    cpp.init(CPP_ID, PROMPT, listen=True)
    remote = cpp.register(2, shape)
    assert remote == 1
    src = [pattern(7 + t, 64) for t in range(2)]
    for t in range(2):
        cpp.write(remote, t, src[t])
    link_to(py_decoder, CPP_ID, cpp.port)
    cm = py_decoder.cache_manager
    cache, arrays = register(py_decoder, 2, shape)
    # pull_cache by cache id and batch index: remote slot 3 -> local slot 0
    cm.pull_cache(llm.CacheKeyByIdAndIndex(CPP_ID, remote, 3), cache, batch_index=0)
    for t in range(2):
        assert arrays[t][0].tobytes() == src[t][48:64]
        assert not arrays[t][1:].any()
    # pull_blocks by BlocksCacheKey: a C++ owner resolves model_id as its cache id
    bcache, barrays = register(py_decoder, 2, shape, blocks=True, model_id=5)
    cm.pull_blocks(llm.BlocksCacheKey(CPP_ID, remote), bcache, [2, 1], [0, 3])
    for t in range(2):
        assert barrays[t][0].tobytes() == src[t][32:48]
        assert barrays[t][3].tobytes() == src[t][16:32]
        assert not barrays[t][1:3].any()
    # the C++ owner's checks come back as Python exceptions with the same codes
    with pytest.raises(llm.LLMException) as e:
        cm.pull_cache(llm.CacheKeyByIdAndIndex(CPP_ID, 42, 0), cache)
    assert e.value.status_code == llm.LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    with pytest.raises(llm.LLMException) as e:
        cm.pull_blocks(llm.BlocksCacheKey(CPP_ID, remote), bcache, [4], [0])
    assert e.value.status_code == llm.LLMStatusCode.LLM_PARAM_INVALID


def test_pushes_both_ways(py_decoder, xpeer):
    shape = (4, 16)
    cpp = xpeer()
    cpp.init(CPP_ID, PROMPT, listen=True)
    cpp_cache = cpp.register(2, shape)
    py_cache, py_arrays = register(py_decoder, 2, shape)
    # C++ pushes into the Python side: it links to Python's listener
    cpp.ok(f"link {PY_ID} 127.0.0.1 {py_decoder.listen_address[1]} 3000")
    src = [pattern(50 + t, 64) for t in range(2)]
    for t in range(2):
        cpp.write(cpp_cache, t, src[t])
    cpp.ok(f"pushc {cpp_cache} {PY_ID} {py_cache.cache_id} 2 1 -1 -1 -1 -1 -1 2")
    for t in range(2):
        assert py_arrays[t][2].tobytes() == src[t][16:32]
        assert not py_arrays[t][[0, 1, 3]].any()
    cpp.ok(f"pushb {cpp_cache} {PY_ID} {py_cache.cache_id} 0,3 1,0 -1 -1 -1 -1 2")
    for t in range(2):
        assert py_arrays[t][1].tobytes() == src[t][0:16]
        assert py_arrays[t][0].tobytes() == src[t][48:64]
    bad = f"pushb {cpp_cache} {PY_ID} {py_cache.cache_id} 0 4 -1 -1 -1 -1 2"
    assert cpp.status(bad) == LLM_PARAM_INVALID
    # Python pushes into the C++ side
    link_to(py_decoder, CPP_ID, cpp.port)
    cm = py_decoder.cache_manager
    for t in range(2):
        py_arrays[t].reshape(-1)[:] = np.frombuffer(pattern(80 + t, 64), dtype=np.uint8)
    cm.push_cache(llm.CacheKeyByIdAndIndex(CPP_ID, cpp_cache, 3), py_cache, src_batch_index=0)
    for t in range(2):
        got = cpp.read(cpp_cache, t)
        assert got[48:64] == py_arrays[t][0].tobytes()
        assert got[:48] == src[t][:48]
    bcache, barrays = register(py_decoder, 2, shape, blocks=True, model_id=9)
    for t in range(2):
        barrays[t].reshape(-1)[:] = np.frombuffer(pattern(90 + t, 64), dtype=np.uint8)
    cm.push_blocks(llm.BlocksCacheKey(CPP_ID, cpp_cache), bcache, [1, 2], [0, 1],
                   src_layer_range=range(1, 2), dst_layer_range=range(1, 2), tensor_num_per_layer=1)
    assert cpp.read(cpp_cache, 1)[0:32] == barrays[1][1:3].tobytes()
    assert cpp.read(cpp_cache, 0)[0:32] == src[0][0:32]  # layer 0 untouched


def test_python_pull_with_checksum_from_cpp_owner(xpeer):
    """With verify_checksum the Python puller asks for a CHECKSUM frame; the C++ owner's
    CRC-32 of what it sent must match what arrived."""
    py = make_python(llm.LLMRole.DECODER, listen=False, verify=True)
    try:
        cpp = xpeer()
        cpp.init(CPP_ID, PROMPT, listen=True)
        remote = cpp.register(3, (8, 64))
        src = [pattern(300 + t, 512) for t in range(3)]
        for t in range(3):
            cpp.write(remote, t, src[t])
        link_to(py, CPP_ID, cpp.port)
        bcache, arrays = register(py, 3, (8, 64), blocks=True, model_id=1)
        py.cache_manager.pull_blocks(llm.BlocksCacheKey(CPP_ID, remote), bcache,
                                     [7, 6, 0], [0, 1, 2])
        for t in range(3):
            assert arrays[t][:3].tobytes() == src[t][448:512] + src[t][384:448] + src[t][:64]
            assert not arrays[t][3:].any()
    finally:
        py.finalize()


def test_cpp_pull_with_checksum_from_a_python_api_owner(xpeer):
    """The C++ API with datadist.VerifyChecksum (here DATADIST_VERIFY_CHECKSUM=1) asks the
    owner under the Python API for its CRC-32 and checks it. (An owner that lies about it
    fails the pull with LLM_SUSPECT_REMOTE_ERROR: cpp/tests/verify_test.cc
    Verify.ALyingOwnersBytesAreSuspectAndNotConfirmed, against a hand-written owner.)"""
    py = make_python(llm.LLMRole.PROMPT, listen=True)
    try:
        shape = (4, 8, 4)
        _, arrays = register(py, 2, shape)
        _fill(arrays, 500)
        cpp = xpeer({"DATADIST_VERIFY_CHECKSUM": "1"})
        cpp.init(CPP_ID, DECODER)
        local = cpp.register(2, shape)
        cpp.ok(f"link {PY_ID} 127.0.0.1 {py.listen_address[1]} 3000")
        cpp.ok(f"pullc {PY_ID} 1 2 {local} 1 -1 -1 -1 -1 -1 2")
        for t in range(2):
            assert cpp.read(local, t)[32:64] == arrays[t].tobytes()[64:96]
    finally:
        py.finalize()


def _ipv6_loopback() -> bool:
    import socket

    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return socket.has_ipv6
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback on this host")
def test_pulls_both_ways_over_the_ipv6_loopback(xpeer):
    """Issue 22 item 8: each side listens on "[::1]:port" (the original's form) and links to
    the other at the bare ip "::1"; a pull crosses the language boundary both ways."""
    shape = (4, 16)
    py = make_python(llm.LLMRole.MIX, listen=True, listen_ip_info="[::1]:0")
    try:
        assert py.listen_address[0] == "::1"
        cache, arrays = register(py, 2, shape)
        _fill(arrays, 300)
        cpp = xpeer()
        cpp.init(CPP_ID, PROMPT, listen=True, host="::1")
        remote = cpp.register(2, shape)
        src = [pattern(310 + t, 64) for t in range(2)]
        for t in range(2):
            cpp.write(remote, t, src[t])
        # C++ pulls from Python: Python's slot 2 -> its slot 1
        local = cpp.register(2, shape)
        cpp.ok(f"link {PY_ID} ::1 {py.listen_address[1]} 3000")
        cpp.ok(f"pullc {PY_ID} {cache.cache_id} 2 {local} 1 -1 -1 -1 -1 -1 2")
        for t in range(2):
            assert cpp.read(local, t)[16:32] == arrays[t][2].tobytes()
        # Python pulls from C++: its slot 3 -> our slot 0
        link_to(py, CPP_ID, cpp.port, host="::1")
        mine, got = register(py, 2, shape)
        py.cache_manager.pull_cache(llm.CacheKeyByIdAndIndex(CPP_ID, remote, 3), mine,
                                    batch_index=0)
        for t in range(2):
            assert got[t][0].tobytes() == src[t][48:64]
            assert not got[t][1:].any()
    finally:
        py.finalize()


def test_cpp_owner_refusals_are_in_the_callers_units(xpeer):
    """The C++ owner names a source block out of range in blocks, a block size mismatch in
    elements and a data type by its name, in the caller's units (issue 25, item 5)."""
    cpp = xpeer()
    cpp.init(CPP_ID, PROMPT, listen=True)
    remote = cpp.register(2, (4, 16))  # DT_UINT8, 4 blocks of 16
    f16 = cpp.register(2, (4, 8), dtype=1)  # DT_FLOAT16, the same block bytes
    dd = make_python(llm.LLMRole.DECODER, listen=False, transport="tcp")
    try:
        link_to(dd, CPP_ID, cpp.port)
        cm = dd.cache_manager
        bcache, _ = register(dd, 2, (8, 16), blocks=True)
        with pytest.raises(llm.LLMException, match=f"src block 6 out of range: cache {remote} "
                                                   "has 4 blocks"):
            cm.pull_blocks(llm.BlocksCacheKey(CPP_ID, remote), bcache, [6], [0])
        with pytest.raises(llm.LLMException, match=f"cache {f16} holds DT_FLOAT16, the "
                                                   "requester's cache DT_UINT8"):
            cm.pull_blocks(llm.BlocksCacheKey(CPP_ID, f16), bcache, [1], [0])
        wide, _ = register(dd, 2, (4, 32), blocks=True, model_id=1)
        with pytest.raises(llm.LLMException, match=r"the requester's blocks hold 32 DT_UINT8 "
                           r"elements \(32 bytes\), cache \d+'s 16 DT_UINT8 elements"):
            cm.pull_blocks(llm.BlocksCacheKey(CPP_ID, remote), wide, [1], [0])
    finally:
        dd.finalize()
