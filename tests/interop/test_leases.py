"""A reader under the C++ API under whole-cache leases from an owner under the Python API (the
same core) on one host (docs/protocol.md,
"Cache leases"; docs/cpp.md): the C++ client asks LEASE_REQUEST once per cache and
direction, then checks and copies by itself; whatever the owner does to the cache after that
(unregister, a model id bound anew, dying) is what the next transfer sees. Every byte checked;
what the owner served is read from its metrics (``serve_lease``, ``serve_read``,
``serve_write`` for the C++ peer)."""

from __future__ import annotations

import numpy as np
import pytest

import datadist as llm
from datadist.testing.peers import CacheSpec, PromptConfig, start_prompt
from datadist.testing.peers import pattern as spec_pattern

from ._python_side import PY_ID, link_to, make_python, register
from .conftest import (
    LLM_KV_CACHE_NOT_EXIST,
    LLM_LINK_FAILED,
    LLM_PARAM_INVALID,
    LLM_TIMEOUT,
    pattern,
    wait_until,
)

pytestmark = pytest.mark.timeout(600)

CPP_ID, DECODER = 31, 2
BLOCK = 1024
SHAPE = (8, BLOCK)


def _served(py: llm.LLMDataDist, op: str) -> int:
    """Requests of kind ``op`` the in-process owner served for the C++ peer.

    A streamed read is counted when the owner's send of its bytes returned (the outcome is
    known only then), on the owner's connection thread: the reader may have every byte, and
    its pull may have returned, before that. The owner serves a connection's requests one
    after another, so a read is counted by the time the next request on that link is
    answered; after a link's last read, wait for the count (:func:`_served_reaches`)."""
    return int(py.engine.stats()["links"].get(str(CPP_ID), {}).get(op, {}).get("transfers", 0))


def _served_reaches(py: llm.LLMDataDist, op: str, want: int) -> bool:
    """Does the owner's count of ``op`` come to exactly ``want`` (within 5 s)? For the last
    streamed reads of a link, which the owner counts after the reader has their bytes."""
    return wait_until(lambda: _served(py, op) >= want) and _served(py, op) == want


def _fill(arrays: list[np.ndarray], seed: int) -> None:
    for i, a in enumerate(arrays):
        a.reshape(-1)[:] = np.frombuffer(pattern(seed + i, a.size), dtype=np.uint8)


def _linked(py: llm.LLMDataDist, xpeer, env: dict[str, str] | None = None):
    cpp = xpeer(env) if env else xpeer()
    cpp.init(CPP_ID, DECODER)
    cpp.ok(f"link {PY_ID} 127.0.0.1 {py.listen_address[1]} 3000")
    return cpp


def test_cpp_pulls_under_one_lease(xpeer):
    py = make_python(llm.LLMRole.PROMPT, listen=True)
    try:
        cache, arrays = register(py, 2, SHAPE)
        _fill(arrays, 200)
        cpp = _linked(py, xpeer)
        local = cpp.register(2, SHAPE)
        reads, leases = _served(py, "serve_read"), _served(py, "serve_lease")
        for i in range(12):
            s, d = (3 * i) % 8, (5 * i + 1) % 8
            cpp.ok(f"pullb {PY_ID} {cache.cache_id} 0 {local} {s} {d} -1 -1 -1 -1 2")
            cpp.ok(f"pullc {PY_ID} {cache.cache_id} {7 - s} {local} {s} -1 -1 -1 -1 -1 2")
            for t in range(2):
                got, src = cpp.read(local, t), arrays[t].tobytes()
                assert got[d * BLOCK:(d + 1) * BLOCK] == src[s * BLOCK:(s + 1) * BLOCK], (i, t)
                slot = src[(7 - s) * BLOCK:(8 - s) * BLOCK]
                assert got[s * BLOCK:(s + 1) * BLOCK] == slot, (i, t)
        # one lease for both (both name the cache by id), and no read asked the owner
        assert _served(py, "serve_lease") == leases + 1
        assert _served(py, "serve_read") == reads
        # the owner's checks, made by the reader: nothing reaches the owner either
        cmd = f"pullc {PY_ID} {cache.cache_id} 8 {local} 0 -1 -1 -1 -1 -1 2"
        assert cpp.status(cmd) == LLM_PARAM_INVALID
        cmd = f"pullb {PY_ID} {cache.cache_id} 0 {local} 8 0 -1 -1 -1 -1 2"
        assert cpp.status(cmd) == LLM_PARAM_INVALID
        cmd = f"pullb {PY_ID} {cache.cache_id} 0 {local} 0 0 2 2 0 0 1"
        assert cpp.status(cmd) == LLM_PARAM_INVALID
        assert _served(py, "serve_read") == reads
        # unregistered: the lease is revoked, the request path answers
        py.cache_manager.unregister_cache(cache.cache_id)
        cmd = f"pullb {PY_ID} {cache.cache_id} 0 {local} 1 1 -1 -1 -1 -1 2"
        assert cpp.status(cmd) == LLM_KV_CACHE_NOT_EXIST
        assert _served(py, "serve_read") == reads + 1
        # another data type: the reader checks the layout as the owner would
        other, oarrays = register(py, 2, SHAPE)
        _fill(oarrays, 210)
        halves = cpp.register(2, (8, BLOCK // 2), dtype=1)  # DT_FLOAT16, the same block bytes
        cpp.ok(f"pullb {PY_ID} {other.cache_id} 0 {local} 1 1 -1 -1 -1 -1 2")
        cmd = f"pullb {PY_ID} {other.cache_id} 0 {halves} 1 1 -1 -1 -1 -1 2"
        assert cpp.status(cmd) == LLM_PARAM_INVALID
        assert _served(py, "serve_lease") == leases + 2
        assert _served(py, "serve_read") == reads + 1
    finally:
        py.finalize()


def test_a_model_id_bound_anew_is_read_anew(xpeer):
    """Binding a model id to another cache revokes the old cache's lease (its BlocksCacheKey
    left it): the C++ reader, which names caches by id, asks the owner once, leases again,
    and reads each cache's own bytes throughout."""
    py = make_python(llm.LLMRole.PROMPT, listen=True)
    try:
        first, farr = register(py, 2, SHAPE, blocks=True, model_id=9)
        _fill(farr, 220)
        cpp = _linked(py, xpeer)
        local = cpp.register(2, SHAPE)
        cpp.ok(f"pullb {PY_ID} {first.cache_id} 0 {local} 2 0 -1 -1 -1 -1 2")
        reads, leases = _served(py, "serve_read"), _served(py, "serve_lease")
        second, sarr = register(py, 2, SHAPE, blocks=True, model_id=9)  # last binding wins
        _fill(sarr, 230)
        for _ in range(3):
            cpp.ok(f"pullb {PY_ID} {first.cache_id} 0 {local} 2,5 0,1 -1 -1 -1 -1 2")
            cpp.ok(f"pullb {PY_ID} {second.cache_id} 0 {local} 6,7 2,3 -1 -1 -1 -1 2")
        for t in range(2):
            got = cpp.read(local, t)
            assert got[:BLOCK] == farr[t][2].tobytes()
            assert got[BLOCK:2 * BLOCK] == farr[t][5].tobytes()
            assert got[2 * BLOCK:3 * BLOCK] == sarr[t][6].tobytes()
            assert got[3 * BLOCK:4 * BLOCK] == sarr[t][7].tobytes()
        # the revoked lease cost one read; then one new lease per cache
        assert _served(py, "serve_read") == reads + 1
        assert _served(py, "serve_lease") == leases + 2
    finally:
        py.finalize()


def test_cpp_pushes_under_a_write_lease(xpeer):
    py = make_python(llm.LLMRole.DECODER, listen=True)
    try:
        cache, arrays = register(py, 2, SHAPE)
        cpp = _linked(py, xpeer)
        src = cpp.register(2, SHAPE)
        data = [pattern(240 + t, 8 * BLOCK) for t in range(2)]
        for t in range(2):
            cpp.write(src, t, data[t])
        writes, leases = _served(py, "serve_write"), _served(py, "serve_lease")
        cpp.ok(f"pushc {src} {PY_ID} {cache.cache_id} 6 1 -1 -1 -1 -1 -1 2")
        cpp.ok(f"pushb {src} {PY_ID} {cache.cache_id} 3,4 0,2 -1 -1 -1 -1 2")
        for t in range(2):
            assert arrays[t][6].tobytes() == data[t][BLOCK:2 * BLOCK]
            assert arrays[t][0].tobytes() == data[t][3 * BLOCK:4 * BLOCK]
            assert arrays[t][2].tobytes() == data[t][4 * BLOCK:5 * BLOCK]
            assert not arrays[t][[1, 3, 4, 5, 7]].any()
        assert _served(py, "serve_lease") == leases + 1
        assert _served(py, "serve_write") == writes
        cmd = f"pushb {src} {PY_ID} {cache.cache_id} 0 8 -1 -1 -1 -1 2"
        assert cpp.status(cmd) == LLM_PARAM_INVALID
        assert _served(py, "serve_write") == writes
    finally:
        py.finalize()


def test_an_owner_without_remote_access_refuses_write_leases(xpeer):
    py = make_python(llm.LLMRole.DECODER, listen=True, accessible=False)
    try:
        cache, arrays = register(py, 2, SHAPE)
        cpp = _linked(py, xpeer)
        src = cpp.register(2, SHAPE)
        for t in range(2):
            cpp.write(src, t, pattern(250 + t, 8 * BLOCK))
        cmd = f"pushb {src} {PY_ID} {cache.cache_id} 1 1 -1 -1 -1 -1 2"
        assert cpp.status(cmd) == LLM_PARAM_INVALID
        assert not any(a.any() for a in arrays)
    finally:
        py.finalize()


def test_an_owner_that_cannot_lease_now_is_read_by_request(xpeer):
    """An owner out of descriptors cannot make a cache's fence: it answers the LEASE_REQUEST
    with FEATURE_NOT_ENABLED, which is no answer to the transfer: the reader asks the owner
    instead, and the next transfer may ask for a lease again (each refusal is counted as a
    serve_lease error). The owner is this process (the core under the Python API), run out
    of descriptors while the C++ reader pulls; it counts each read late (as it may, after the
    reader has the bytes): the count is waited for, never read as the last pull returns."""
    import os
    import resource

    py = make_python(llm.LLMRole.PROMPT, listen=True)
    try:
        cache, arrays = register(py, 2, SHAPE)
        _fill(arrays, 300)
        cpp = _linked(py, xpeer)
        local = cpp.register(2, SHAPE)
        reads = _served(py, "serve_read")
        # the core's counters are the process's: earlier tests' refusals from this peer id too
        before = py.engine.stats()["links"].get(str(CPP_ID), {}).get("serve_lease", {})
        refused = before.get("errors", {}).get("LLM_FEATURE_NOT_ENABLED", 0)
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        filler: list[int] = []
        try:
            top = max(map(int, os.listdir("/proc/self/fd")))
            resource.setrlimit(resource.RLIMIT_NOFILE, (top + 16, hard))
            try:
                while True:  # every descriptor number left: memfd_create fails EMFILE
                    filler.append(os.open("/dev/null", os.O_RDONLY))
            except OSError:
                pass
            for i in range(3):
                cpp.ok(f"pullb {PY_ID} {cache.cache_id} 0 {local} {i} {i + 4} -1 -1 -1 -1 2")
        finally:
            for fd in filler:
                os.close(fd)
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        for i in range(3):
            for t in range(2):
                got, src = cpp.read(local, t), arrays[t].tobytes()
                assert got[(i + 4) * BLOCK:(i + 5) * BLOCK] == src[i * BLOCK:(i + 1) * BLOCK]
        assert _served_reaches(py, "serve_read", reads + 3), _served(py, "serve_read") - reads
        leases = py.engine.stats()["links"][str(CPP_ID)]["serve_lease"]
        # asked each time: the refusal is for now, not for the link
        assert leases["errors"]["LLM_FEATURE_NOT_ENABLED"] - refused == 3, leases
    finally:
        py.finalize()


def test_a_killed_owner_is_an_error_not_stale_bytes(xpeer):
    spec = CacheSpec(2, SHAPE, data_type="DT_UINT8")
    prompt = start_prompt(PromptConfig(PY_ID))
    try:
        cid = prompt.call("register_cache", spec=spec, seed=260)
        cpp = xpeer()
        cpp.init(CPP_ID, DECODER, sync_ms=500)
        cpp.ok(f"link {PY_ID} 127.0.0.1 {prompt.address[1]} 3000")
        local = cpp.register(2, SHAPE)
        want = spec_pattern(spec, 260)
        for _ in range(2):  # the second under the lease
            cpp.ok(f"pullb {PY_ID} {cid} 0 {local} 4 4 -1 -1 -1 -1 2")
        assert cpp.read(local, 1)[4 * BLOCK:5 * BLOCK] == want[1][4 * BLOCK:5 * BLOCK].tobytes()
        prompt.peer.kill()
        for t in range(2):
            cpp.write(local, t, bytes(8 * BLOCK))
        cmd = f"pullb {PY_ID} {cid} 0 {local} 4 4 -1 -1 -1 -1 2"
        assert cpp.status(cmd) in (LLM_LINK_FAILED, LLM_TIMEOUT)
        assert all(cpp.read(local, t) == bytes(8 * BLOCK) for t in range(2))
    finally:
        prompt.close()


def test_python_reads_and_writes_a_cpp_owner_under_leases(xpeer):
    """The other way: an owner under the C++ API offers FEATURE_LEASE; a reader under the
    Python API leases its caches (by id and by BlocksCacheKey, read and write: three leases,
    no request for any transfer, as the owner's own counters say over STATS), and the C++
    unregister revokes them."""
    py = make_python(llm.LLMRole.DECODER, listen=False)
    try:
        cpp = xpeer()
        cpp.init(CPP_ID, 1, listen=True)
        remote = cpp.register(2, SHAPE)
        src = [pattern(270 + t, 8 * BLOCK) for t in range(2)]
        for t in range(2):
            cpp.write(remote, t, src[t])
        link_to(py, CPP_ID, cpp.port)
        link = py.engine.get_link(CPP_ID)
        assert link.path_name == "cma", link.reason
        cm = py.cache_manager
        cache, arrays = register(py, 2, SHAPE)
        bcache, barrays = register(py, 2, SHAPE, blocks=True, model_id=3)
        for _ in range(3):
            cm.pull_cache(llm.CacheKeyByIdAndIndex(CPP_ID, remote, 6), cache, batch_index=1)
            cm.pull_blocks(llm.BlocksCacheKey(CPP_ID, remote), bcache, [7, 0], [2, 5])
        for t in range(2):
            assert arrays[t][1].tobytes() == src[t][6 * BLOCK:7 * BLOCK]
            assert barrays[t][2].tobytes() == src[t][7 * BLOCK:8 * BLOCK]
            assert barrays[t][5].tobytes() == src[t][:BLOCK]
        barrays[0][4] = 0x5A
        cm.push_blocks(llm.BlocksCacheKey(CPP_ID, remote), bcache, [4], [3])
        assert cpp.read(remote, 0)[3 * BLOCK:4 * BLOCK] == bytes([0x5A]) * BLOCK
        served = py.engine.peer_stats(CPP_ID, 5.0)["total"]
        asked = {op: served.get(op, {}).get("transfers", 0)
                 for op in ("serve_lease", "serve_read", "serve_write")}
        # by id, by key, and to write; every transfer then under its lease
        assert asked == {"serve_lease": 3, "serve_read": 0, "serve_write": 0}, served
        with pytest.raises(llm.LLMException) as e:
            cm.pull_blocks(llm.BlocksCacheKey(CPP_ID, remote), bcache, [8], [0])
        assert e.value.status_code == llm.LLMStatusCode.LLM_PARAM_INVALID
        cpp.ok(f"unreg {remote}")
        with pytest.raises(llm.LLMException) as e:
            cm.pull_cache(llm.CacheKeyByIdAndIndex(CPP_ID, remote, 6), cache, batch_index=1)
        assert e.value.status_code == llm.LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    finally:
        py.finalize()
