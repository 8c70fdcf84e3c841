"""The core under its C++ and its Python API on one host: the local channel both ways
(docs/protocol.md, "The local channel", "Pull on the same host"). Every byte is checked; the
path each side took is read from the Python API's link and from the C++ peer's log
(DATADIST_CPP_LOG)."""

from __future__ import annotations

import os
import re
import signal
import time

import numpy as np
import pytest

import datadist as llm

from ._python_side import PY_ID, link_to, make_python, register
from .conftest import LLM_PARAM_INVALID, pattern

# The first test of a session builds cpp/ (tens of seconds on a busy machine).
pytestmark = pytest.mark.timeout(600)

CPP_ID, CPP2_ID = 21, 22
PROMPT, DECODER = 1, 2


def _fill(arrays: list[np.ndarray], seed: int) -> None:
    for i, a in enumerate(arrays):
        a.reshape(-1)[:] = np.frombuffer(pattern(seed + i, a.size), dtype=np.uint8)


def _path_lines(log: str, cluster: int) -> list[str]:
    return re.findall(rf"link to cluster {cluster}: (\S+ \(.*\))", log)


def test_cpp_pulls_from_python_over_the_local_channel(xpeer):
    py = make_python(llm.LLMRole.PROMPT, listen=True)
    try:
        shape = (8, 64)
        cache, arrays = register(py, 4, shape)
        _fill(arrays, 10)
        cpp = xpeer()
        cpp.init(CPP_ID, DECODER)
        local = cpp.register(4, shape)
        cpp.ok(f"link {PY_ID} 127.0.0.1 {py.listen_address[1]} 3000")
        paths = _path_lines(cpp.log(), PY_ID)
        assert paths and paths[-1].startswith("cma") and f"pid {os.getpid()}," in paths[-1], paths
        # PullKvCache: remote slot 5 -> local slot 1; PullKvBlocks: layer 1, blocks 7,0 -> 2,6
        cpp.ok(f"pullc {PY_ID} {cache.cache_id} 5 {local} 1 -1 -1 -1 -1 -1 2")
        cpp.ok(f"pullb {PY_ID} {cache.cache_id} 0 {local} 7,0 2,6 1 1 1 1 2")
        for t in range(4):
            src = arrays[t].tobytes()
            want = bytearray(8 * 64)
            want[64:128] = src[5 * 64:6 * 64]
            if t >= 2:
                want[2 * 64:3 * 64] = src[7 * 64:8 * 64]
                want[6 * 64:7 * 64] = src[0:64]
            assert cpp.read(local, t) == bytes(want), t
        # the owner serves the C++ peer's control channel (its local one: the C++ side's log
        # above named our pid, which only the kernel's SO_PEERCRED tells it)
        assert [p.cluster_id for p in py.engine.inbound_peers()] == [CPP_ID]
        # the owner's checks cross over as before
        bad = f"pullc {PY_ID} {cache.cache_id} 8 {local} 0 -1 -1 -1 -1 -1 2"
        assert cpp.status(bad) == LLM_PARAM_INVALID
        cpp.ok(f"pullc {PY_ID} {cache.cache_id} 0 {local} 0 -1 -1 -1 -1 -1 2")
        assert cpp.read(local, 3)[:64] == arrays[3].tobytes()[:64]
        # over 64 KiB: granted, and copied with process_vm_readv from the Python process
        big, barrays = register(py, 2, (16, 16384), blocks=True, model_id=4)
        _fill(barrays, 20)
        blocal = cpp.register(2, (16, 16384))
        cpp.ok(f"pullb {PY_ID} {big.cache_id} 0 {blocal} 15,0,9,4,7 1,2,3,10,11 -1 -1 -1 -1 2")
        for t in range(2):
            got, srcb = cpp.read(blocal, t), barrays[t].tobytes()
            for s, d in [(15, 1), (0, 2), (9, 3), (4, 10), (7, 11)]:
                assert got[d * 16384:(d + 1) * 16384] == srcb[s * 16384:(s + 1) * 16384]
        assert _path_lines(cpp.log(), PY_ID)[-1].startswith("cma")  # no refusal, no fallback
    finally:
        py.finalize()


def test_python_pulls_from_cpp_over_the_local_channel(xpeer):
    py = make_python(llm.LLMRole.DECODER, listen=False)
    try:
        shape = (8, 32)
        cpp = xpeer()
        cpp.init(CPP_ID, PROMPT, listen=True)
        remote = cpp.register(2, shape)
        src = [pattern(40 + t, 256) for t in range(2)]
        for t in range(2):
            cpp.write(remote, t, src[t])
        link_to(py, CPP_ID, cpp.port)
        link = py.engine.get_link(CPP_ID)
        assert link.path_name == "cma", link.reason
        assert f"pid {cpp.proc.pid}" in link.reason
        cm = py.cache_manager
        cache, arrays = register(py, 2, shape)
        cm.pull_cache(llm.CacheKeyByIdAndIndex(CPP_ID, remote, 6), cache, batch_index=1)
        assert py.engine.last_moved(CPP_ID) == "cma"
        bcache, barrays = register(py, 2, shape, blocks=True, model_id=3)
        # blocks in no order: one grant, one span per block
        src_blocks = [7, 1, 4, 2, 0, 6]
        cm.pull_blocks(llm.BlocksCacheKey(CPP_ID, remote), bcache, src_blocks, [0, 2, 4, 6, 1, 3])
        for t in range(2):
            assert arrays[t][1].tobytes() == src[t][6 * 32:7 * 32]
            assert not arrays[t][[0, 2, 3, 4, 5, 6, 7]].any()
            for s, d in zip(src_blocks, [0, 2, 4, 6, 1, 3], strict=True):
                assert barrays[t][d].tobytes() == src[t][s * 32:(s + 1) * 32]
        # the C++ owner's checks still answer (a grant is never given for a bad span)
        with pytest.raises(llm.LLMException) as e:
            cm.pull_blocks(llm.BlocksCacheKey(CPP_ID, remote), bcache, [8], [0])
        assert e.value.status_code == llm.LLMStatusCode.LLM_PARAM_INVALID
        with pytest.raises(llm.LLMException) as e:
            cm.pull_cache(llm.CacheKeyByIdAndIndex(CPP_ID, 9, 0), cache)
        assert e.value.status_code == llm.LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
        # every grant was released: the C++ owner can drop the cache at once
        t0 = time.monotonic()
        cpp.ok(f"unreg {remote}")
        assert time.monotonic() - t0 < 2.0
    finally:
        py.finalize()


def test_pushes_both_ways_over_the_local_channel(xpeer):
    py = make_python(llm.LLMRole.DECODER, listen=True)
    try:
        shape = (4, 16)
        cpp = xpeer()
        cpp.init(CPP_ID, PROMPT, listen=True)
        cpp_cache = cpp.register(2, shape)
        py_cache, py_arrays = register(py, 2, shape)
        cpp.ok(f"link {PY_ID} 127.0.0.1 {py.listen_address[1]} 3000")
        assert _path_lines(cpp.log(), PY_ID)[-1].startswith("cma")
        src = [pattern(60 + t, 64) for t in range(2)]
        for t in range(2):
            cpp.write(cpp_cache, t, src[t])
        cpp.ok(f"pushc {cpp_cache} {PY_ID} {py_cache.cache_id} 3 0 -1 -1 -1 -1 -1 2")
        cpp.ok(f"pushb {cpp_cache} {PY_ID} {py_cache.cache_id} 1,2 0,1 -1 -1 -1 -1 2")
        for t in range(2):
            assert py_arrays[t][3].tobytes() == src[t][0:16]
            assert py_arrays[t][0:2].tobytes() == src[t][16:48]
            assert not py_arrays[t][2].any()
        link_to(py, CPP_ID, cpp.port)
        assert py.engine.get_link(CPP_ID).path_name == "cma"
        for t in range(2):
            py_arrays[t].reshape(-1)[:] = np.frombuffer(pattern(70 + t, 64), dtype=np.uint8)
        py.cache_manager.push_cache(llm.CacheKeyByIdAndIndex(CPP_ID, cpp_cache, 2), py_cache,
                                    src_batch_index=1)
        for t in range(2):
            got = cpp.read(cpp_cache, t)
            assert got[32:48] == py_arrays[t][1].tobytes()
            assert got[:32] + got[48:] == src[t][:32] + src[t][48:]
    finally:
        py.finalize()


@pytest.mark.parametrize("owner", ["python-api", "cpp-api"])
def test_refused_cross_memory_attach_falls_back_to_the_stream(xpeer, owner):
    """The kernel refuses the C++ puller's process_vm_readv (a seccomp filter makes it answer
    EPERM, as Yama or another uid would): the pull still lands, streamed over the local
    channel, and the link says why. (Pulls over 64 KiB are granted; smaller ones stream.)
    The link stays on the same-host path for caches in the owner's shared memory (which needs
    no ptrace permission); registered memory is streamed. The owner is the core under either
    API."""
    block = 16384
    shape = (8, block)
    py = None
    if owner == "python-api":
        py = make_python(llm.LLMRole.PROMPT, listen=True)
        cache, arrays = register(py, 2, shape)
        _fill(arrays, 90)
        rid, port, owner_id, owner_pid = cache.cache_id, py.listen_address[1], PY_ID, os.getpid()
        src = [a.tobytes() for a in arrays]
    else:
        own = xpeer()
        own.init(CPP2_ID, PROMPT, listen=True)
        rid = own.register(2, shape)
        src = [pattern(95 + t, 8 * block) for t in range(2)]
        for t in range(2):
            own.write(rid, t, src[t])
        port, owner_id, owner_pid = own.port, CPP2_ID, own.proc.pid
    try:
        cpp = xpeer()
        cpp.ok("denycma")
        cpp.init(CPP_ID, DECODER)
        local = cpp.register(2, shape)
        cpp.ok(f"link {owner_id} 127.0.0.1 {port} 3000")
        assert _path_lines(cpp.log(), owner_id)[-1].startswith("cma")
        cpp.ok(f"pullb {owner_id} {rid} 0 {local} 3,5,1 0,7,2 -1 -1 -1 -1 2")  # 96 KiB: granted
        lines = _path_lines(cpp.log(), owner_id)
        assert lines[-1].startswith("cma") and "refused" in lines[-1], lines
        assert "shared memory" in lines[-1] and "stream" in lines[-1], lines
        assert f"pid {owner_pid}" in lines[-1]
        cpp.ok(f"pullb {owner_id} {rid} 0 {local} 6,4,2 3,4,5 -1 -1 -1 -1 2")  # stays usable
        for t in range(2):
            got = cpp.read(local, t)
            for s, d in [(3, 0), (5, 7), (1, 2), (6, 3), (4, 4), (2, 5)]:
                assert got[d * block:(d + 1) * block] == src[t][s * block:(s + 1) * block], (t, d)
            assert got[block:2 * block] == bytes(block) and got[6 * block:7 * block] == bytes(block)
        assert len(_path_lines(cpp.log(), owner_id)) == 2  # said once
    finally:
        if py is not None:
            py.finalize()


def test_refused_cross_memory_attach_still_reads_allocated_caches_from_shared_memory(xpeer):
    """AllocateCache puts a C++ cache in a sealed memfd: a C++ puller whose kernel refuses
    process_vm_readv reads it from the owner's mapped memfd (no ptrace permission needed),
    granted and leased, with no refusal to report; a registered cache of the same owner is
    streamed after the refusal (tests/security/test_same_host_trust.py)."""
    block = 16384
    shape = (8, block)
    own = xpeer()
    own.init(CPP2_ID, PROMPT, listen=True)
    alloc = int(own.ok(f"alloc 2 4 {','.join(map(str, shape))}")[0])
    src = [pattern(40 + t, 8 * block) for t in range(2)]
    for t in range(2):
        own.write(alloc, t, src[t])
    reg = own.register(2, shape)
    for t in range(2):
        own.write(reg, t, src[t])
    cpp = xpeer()
    cpp.ok("denycma")
    cpp.init(CPP_ID, DECODER)
    local = cpp.register(2, shape)
    cpp.ok(f"link {CPP2_ID} 127.0.0.1 {own.port} 3000")
    first = _path_lines(cpp.log(), CPP2_ID)
    assert first[-1].startswith("cma") and "shared memory" in first[-1], first
    for rid, picks in ((alloc, "3,5,1 0,7,2"), (alloc, "6,4,2 3,4,5"), (reg, "0 6")):
        cpp.ok(f"pullb {CPP2_ID} {rid} 0 {local} {picks} -1 -1 -1 -1 2")  # 48 KiB x 2: granted
    for t in range(2):
        got = cpp.read(local, t)
        for s, d in [(3, 0), (5, 7), (1, 2), (6, 3), (4, 4), (2, 5), (0, 6)]:
            assert got[d * block:(d + 1) * block] == src[t][s * block:(s + 1) * block], (t, d)
        assert got[block:2 * block] == bytes(block)
    lines = _path_lines(cpp.log(), CPP2_ID)
    # the allocated cache's pulls needed no cross-memory attach: the registered one's did
    assert len(lines) == 2 and "refused" in lines[-1], lines


def test_dead_owners_fail_within_the_deadline_over_the_local_channel(xpeer):
    # (an owner under the Python API gone under a C++ puller's local link: test_dead_peers.py,
    # whose links between the two APIs take the local channel on one host)
    # an owner under the C++ API killed under a Python API puller's local link
    puller = make_python(llm.LLMRole.DECODER, listen=False, sync_ms=500)
    try:
        owner = xpeer()
        owner.init(CPP2_ID, PROMPT, listen=True)
        remote = owner.register(2, (4, 16))
        link_to(puller, CPP2_ID, owner.port)
        assert puller.engine.get_link(CPP2_ID).path_name == "cma"
        cache, _ = register(puller, 2, (4, 16))
        key = llm.CacheKeyByIdAndIndex(CPP2_ID, remote, 1)
        puller.cache_manager.pull_cache(key, cache)
        os.kill(owner.proc.pid, signal.SIGKILL)
        owner.proc.wait(5.0)
        t0 = time.monotonic()
        with pytest.raises(llm.LLMException) as e:
            puller.cache_manager.pull_cache(key, cache)
        assert e.value.status_code in (llm.LLMStatusCode.LLM_LINK_FAILED,
                                       llm.LLMStatusCode.LLM_TIMEOUT)
        assert time.monotonic() - t0 < 3.0
        owner.proc.returncode = 0  # killed on purpose: the fixture's clean-exit check passes
    finally:
        puller.finalize()

    # a stopped owner under the C++ API: LLM_TIMEOUT at the deadline, then served again
    stopped = xpeer()
    stopped.init(CPP2_ID + 1, PROMPT, listen=True)
    remote = stopped.register(2, (4, 16))
    data = pattern(7, 64)
    stopped.write(remote, 0, data)
    puller = make_python(llm.LLMRole.DECODER, listen=False, sync_ms=500)
    try:
        link_to(puller, CPP2_ID + 1, stopped.port)
        cache, arrays = register(puller, 2, (4, 16))
        key = llm.CacheKeyByIdAndIndex(CPP2_ID + 1, remote, 2)
        os.kill(stopped.proc.pid, signal.SIGSTOP)
        try:
            time.sleep(0.2)
            t0 = time.monotonic()
            with pytest.raises(llm.LLMException) as e:
                puller.cache_manager.pull_cache(key, cache)
            assert e.value.status_code == llm.LLMStatusCode.LLM_TIMEOUT
            assert time.monotonic() - t0 < 3.0
        finally:
            os.kill(stopped.proc.pid, signal.SIGCONT)
        puller.cache_manager.pull_cache(key, cache)
        assert arrays[0][0].tobytes() == data[32:48]
    finally:
        puller.finalize()


def test_forced_tcp_on_one_host(xpeer):
    """DATADIST_TRANSPORT=tcp (C++) and transport="tcp" (Python): no local channel is served
    or used, and both directions still move every byte."""
    py = make_python(llm.LLMRole.PROMPT, listen=True, transport="tcp")
    try:
        cache, arrays = register(py, 2, (4, 16))
        _fill(arrays, 30)
        cpp = xpeer({"DATADIST_TRANSPORT": "tcp"})
        cpp.init(CPP_ID, PROMPT, listen=True)
        remote = cpp.register(2, (4, 16))
        src = [pattern(33 + t, 64) for t in range(2)]
        for t in range(2):
            cpp.write(remote, t, src[t])
        local = cpp.register(2, (4, 16))
        cpp.ok(f"link {PY_ID} 127.0.0.1 {py.listen_address[1]} 3000")
        assert _path_lines(cpp.log(), PY_ID)[-1].startswith("tcp (forced tcp)")
        cpp.ok(f"pullc {PY_ID} {cache.cache_id} 2 {local} 0 -1 -1 -1 -1 -1 2")
        assert cpp.read(local, 1)[:16] == arrays[1][2].tobytes()
        link_to(py, CPP_ID, cpp.port)
        assert py.engine.get_link(CPP_ID).path_name == "tcp"
        mine, marr = register(py, 2, (4, 16))
        py.cache_manager.pull_cache(llm.CacheKeyByIdAndIndex(CPP_ID, remote, 3), mine)
        assert marr[0][0].tobytes() == src[0][48:64]
    finally:
        py.finalize()
