"""Integrity: end-to-end checksums, and the owner refusing caches of another dtype or
block shape instead of handing over bytes that would be read wrong."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from _hand import DENY_CMA, LIE, LyingOwner

from datadist.api.cache_manager import geometry_of
from datadist.api.enums import DataType, Placement
from datadist.api.types import CacheDesc
from datadist.core.config import EngineConfig
from datadist.core.errors import IntegrityError, InvalidArgument
from datadist.core.layout import every_tensor, plan_blocks, plan_slot
from datadist.core.native import NativeEngine
from datadist.wire import protocol as p

pytestmark = pytest.mark.timeout(30)
F16, BF16 = DataType.DT_FLOAT16, DataType.DT_BF16


def _pair(transport: str, verify: bool = False):
    owner = NativeEngine(EngineConfig(cluster_id=1, role=1, listen=("127.0.0.1", 0)))
    puller = NativeEngine(EngineConfig(cluster_id=2, role=2, transport=transport, verify=verify))
    host, port = owner.listen_address
    puller.link(1, host, port, 2.0)
    return owner, puller


def _register(eng: NativeEngine, desc: CacheDesc, arrays: list[np.ndarray], blocks: bool, **kw):
    return eng.register(geometry_of(desc, blocks=blocks), [a.ctypes.data for a in arrays],
                        placement=0, **kw)


@pytest.mark.parametrize("transport", ["tcp", "cma", "shm"])
def test_checksum_passes_when_bytes_are_right(transport: str) -> None:
    owner, puller = _pair(transport, verify=True)
    try:
        src = [np.random.default_rng(i).random((4, 64), dtype=np.float32).astype(np.float16)
               for i in range(2)]
        dst = [np.zeros((4, 64), np.float16) for _ in range(2)]
        desc = CacheDesc(2, [4, 64], F16, Placement.HOST)
        _register(owner, desc, src, False)
        local = _register(puller, desc, dst, False)
        plan = plan_slot(local.geometry, 1, every_tensor(2))
        puller.pull(1, p.KeyRef(p.KeyKind.CACHE_ID, 1, 2), 0, plan, local.cache_id, 2.0)
        for s, d in zip(src, dst, strict=True):
            assert np.array_equal(d[1], s[2])
    finally:
        puller.close()
        owner.close()


@pytest.mark.parametrize("transport", ["tcp", "cma"])
@pytest.mark.parametrize("asynchronous", [False, True], ids=["pull", "pull_async"])
def test_checksum_mismatch_raises(transport: str, asynchronous: bool) -> None:
    """An owner whose checksum disagrees with what arrived (a raw owner that lies once, over
    TCP or on the local channel of a same-host link) is caught by the core's reader:
    IntegrityError (LLM_SUSPECT_REMOTE_ERROR), and its verdict to the owner says so (ok = 0:
    a keyed cache stays); the retry, answered truly, lands and is confirmed."""
    src = np.arange(256, dtype=np.uint8)
    with LyingOwner(1, [src], local=transport == "cma") as liar:
        puller = NativeEngine(EngineConfig(cluster_id=2, role=2, transport=transport,
                                           verify=True))
        try:
            link = puller.link(1, *liar.address, 2.0)
            assert link.path_name == transport, link
            dst = [np.zeros(256, np.uint8)]
            desc = CacheDesc(1, [1, 256], DataType.DT_UINT8, Placement.HOST)
            local = _register(puller, desc, dst, False)
            plan = plan_slot(local.geometry, 0, every_tensor(1))
            key = p.KeyRef(p.KeyKind.CACHE_ID, 1, 0)

            def pull() -> None:
                if not asynchronous:
                    puller.pull(1, key, 0, plan, local.cache_id, 2.0)
                    return
                handle = puller.pull_async(1, key, 0, plan, local.cache_id, 2.0)
                assert handle.wait(10.0)
                if (error := handle.error()) is not None:
                    raise error

            with pytest.raises(IntegrityError, match=f"checksum mismatch: the owner sent crc "
                                                     f"{LIE:#x}") as e:
                pull()
            assert e.value.code == 507057  # LLM_SUSPECT_REMOTE_ERROR
            pull()
            assert np.array_equal(dst[0], src)
            assert [f & p.ReadFlags.CHECKSUM for _, f in liar.reads] == [p.ReadFlags.CHECKSUM] * 2
            end = time.monotonic() + 5  # the last verdict may still be on its way
            while len(liar.verdicts) < 2 and time.monotonic() < end:
                time.sleep(0.01)
            assert [ok for _, ok in liar.verdicts] == [False, True], liar.verdicts
            assert [rid for rid, _ in liar.verdicts] == [rid for rid, _ in liar.reads]
        finally:
            puller.close()


@pytest.mark.parametrize("transport", ["tcp", "cma"])
def test_dtype_mismatch_is_refused(transport: str) -> None:
    """fp16 and bf16 have the same size: only the handshake can tell them apart."""
    owner, puller = _pair(transport)
    try:
        src = [np.ones((8, 16, 4), np.float16) for _ in range(2)]
        dst = [np.zeros((8, 16, 4), np.float16) for _ in range(2)]
        _register(owner, CacheDesc(2, [8, 16, 4], F16, Placement.HOST), src, True,
                  blocks_model_id=0)
        local = _register(puller, CacheDesc(2, [8, 16, 4], BF16, Placement.HOST), dst, True)
        plan = plan_blocks(local.geometry, [1, 2], [3, 4], every_tensor(2))
        with pytest.raises(InvalidArgument, match="holds DT_FLOAT16, the requester's cache DT_BF16"):  # noqa: E501
            puller.pull(1, p.KeyRef(p.KeyKind.BLOCKS_KEY, 0, 0), local.geometry.unit_bytes,
                        plan, local.cache_id, 2.0)
        assert not any(d.any() for d in dst)
    finally:
        puller.close()
        owner.close()


def test_block_shape_mismatch_is_refused() -> None:
    """Same dtype, same block bytes, another block shape ([16, 4] vs [8, 8]): refused."""
    owner, puller = _pair("tcp")
    try:
        src = [np.ones((8, 16, 4), np.float16) for _ in range(2)]
        dst = [np.zeros((8, 8, 8), np.float16) for _ in range(2)]
        _register(owner, CacheDesc(2, [8, 16, 4], F16, Placement.HOST), src, True,
                  blocks_model_id=0)
        local = _register(puller, CacheDesc(2, [8, 8, 8], F16, Placement.HOST), dst, True)
        plan = plan_blocks(local.geometry, [1], [3], every_tensor(2))
        with pytest.raises(InvalidArgument, match="block shape"):
            puller.pull(1, p.KeyRef(p.KeyKind.BLOCKS_KEY, 0, 0), local.geometry.unit_bytes,
                        plan, local.cache_id, 2.0)
    finally:
        puller.close()
        owner.close()


def test_contiguous_slots_of_other_seq_len_still_pull() -> None:
    """Slot addressing compares the dtype only: a decoder with shorter slots may pull a
    prefix of a longer prompt slot (size given), as llm_datadist clients do."""
    owner, puller = _pair("tcp")
    try:
        src = [np.arange(2 * 32 * 4, dtype=np.float16).reshape(2, 32, 4)]
        dst = [np.zeros((1, 16, 4), np.float16)]
        _register(owner, CacheDesc(1, [2, 32, 4], F16, Placement.HOST), src, False)
        local = _register(puller, CacheDesc(1, [1, 16, 4], F16, Placement.HOST), dst, False)
        plan = plan_slot(local.geometry, 0, every_tensor(1))
        puller.pull(1, p.KeyRef(p.KeyKind.CACHE_ID, 1, 1), 0, plan, local.cache_id, 2.0)
        assert np.array_equal(dst[0][0], src[0][1][:16])
    finally:
        puller.close()
        owner.close()


def test_contiguous_push_into_blocks_checks_dtype_only() -> None:
    """A contiguous source pushed into a paged destination (transfer_cache_async does this)
    has slots of another shape than the blocks: only the dtype must match."""
    owner, pusher = _pair("tcp")
    try:
        dst = [np.zeros((8, 16, 4), np.float16) for _ in range(2)]
        _register(owner, CacheDesc(2, [8, 16, 4], F16, Placement.HOST), dst, True,
                  blocks_model_id=0)
        src = [np.full((1, 64, 2), i + 1, np.float16) for i in range(2)]  # 256 B = two blocks
        local = _register(pusher, CacheDesc(2, [1, 64, 2], F16, Placement.HOST), src, False)
        plan = plan_slot(local.geometry, 0, every_tensor(2))
        # remote offset 5 blocks (of 128 B) in: the slot lands in blocks 5 and 6
        from dataclasses import replace

        plan = replace(plan, remote_offsets=np.array([5 * 128], np.uint64))
        pusher.push(1, p.KeyRef(p.KeyKind.BLOCKS_KEY, 0, 0), 0, plan, local.cache_id, 2.0)
        assert (dst[0][5:7] == 1).all() and (dst[1][5:7] == 2).all() and not dst[0][4].any()
        bf = [np.ones((1, 64, 2), np.float16)]
        other = _register(pusher, CacheDesc(1, [1, 64, 2], BF16, Placement.HOST), bf, False)
        plan1 = replace(plan_slot(other.geometry, 0, every_tensor(1)),
                        remote_offsets=np.array([0], np.uint64))
        with pytest.raises(InvalidArgument, match="the requester's cache DT_BF16"):
            pusher.push(1, p.KeyRef(p.KeyKind.BLOCKS_KEY, 0, 0), 0, plan1, other.cache_id, 2.0)
    finally:
        pusher.close()
        owner.close()


def test_update_dim_after_register_cannot_overrun_the_cache() -> None:
    """CacheDesc.update_dim after registering must not let a pull write past the memory
    that was registered: plans use the registered geometry."""
    import datadist as llm_datadist

    owner = NativeEngine(EngineConfig(cluster_id=1, role=1, listen=("127.0.0.1", 0)))
    src = np.arange(64, dtype=np.uint8).reshape(4, 16)
    owner.register(geometry_of(CacheDesc(1, [4, 16], DataType.DT_UINT8, Placement.HOST),
                               blocks=False), [src.ctypes.data], placement=0)
    d = llm_datadist.LLMDataDist(llm_datadist.LLMRole.DECODER, 2)
    cfg = llm_datadist.LLMConfig()
    cfg.enable_cache_manager = True
    d.init(cfg.generate_options())
    try:
        buf = np.zeros(64, np.uint8)  # 16 registered bytes, then guard bytes
        desc = CacheDesc(1, [1, 16], DataType.DT_UINT8, Placement.HOST)
        cache = d.cache_manager.register_cache(desc, [buf.ctypes.data])
        desc.update_dim(0, 4)
        info = llm_datadist.LLMClusterInfo()
        info.remote_cluster_id = 1
        info.append_local_ip_info("127.0.0.1", 0)
        info.append_remote_ip_info(*owner.listen_address)
        assert d.link_clusters([info])[0] == llm_datadist.LLMStatusCode.LLM_SUCCESS
        with pytest.raises(llm_datadist.LLMException) as e:
            d.cache_manager.pull_cache(llm_datadist.CacheKeyByIdAndIndex(1, 1, 3), cache,
                                       batch_index=3)
        assert e.value.status_code == llm_datadist.LLMStatusCode.LLM_PARAM_INVALID
        assert not buf[16:].any()
        d.cache_manager.pull_cache(llm_datadist.CacheKeyByIdAndIndex(1, 1, 3), cache)
        assert np.array_equal(buf[:16], src[3]) and not buf[16:].any()
    finally:
        d.finalize()
        owner.close()


_REFUSED_ATTACH = DENY_CMA + textwrap.dedent("""
    import numpy as np
    from datadist.api.cache_manager import geometry_of
    from datadist.api.enums import DataType, Placement
    from datadist.api.types import CacheDesc
    from datadist.core.config import EngineConfig
    from datadist.core.layout import every_tensor, plan_slot
    from datadist.core.native import NativeEngine
    from datadist.wire import protocol as p

    owner = NativeEngine(EngineConfig(cluster_id=1, role=1, listen=("127.0.0.1", 0)))
    puller = NativeEngine(EngineConfig(cluster_id=2, role=2, transport="cma", verify=True))
    desc = CacheDesc(1, [1, 256], DataType.DT_UINT8, Placement.HOST)
    src = np.arange(256, dtype=np.uint8)
    dst = np.zeros(256, np.uint8)
    owner.register(geometry_of(desc, blocks=False), [src.ctypes.data], placement=0)
    local = puller.register(geometry_of(desc, blocks=False), [dst.ctypes.data], placement=0)
    puller.link(1, *owner.listen_address, 2.0)
    puller.probe_cma(1, 2.0)  # the kernel refuses: the link says so, and streams
    print("reason:", puller.get_link(1).reason)
    plan = plan_slot(local.geometry, 0, every_tensor(1))
    for _ in range(2):  # and the channel stays in step
        dst[:] = 0
        puller.pull(1, p.KeyRef(p.KeyKind.CACHE_ID, 1, 0), 0, plan, local.cache_id, 2.0)
        assert np.array_equal(dst, src)
        print("moved:", puller.last_moved(1))
    puller.close()
    owner.close()
""")


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the seccomp filter is x86-64's")
def test_checksum_after_a_refused_attach_streams() -> None:
    """A same-host link whose kernel refused cross-memory attach (a seccomp filter makes
    process_vm_readv answer EPERM, in a child process) streams caches that are not in
    shareable memory, checksummed, and the channel stays in step: two checked pulls land.
    (Before, in the Python reader, the CHECKSUM frame after a released grant was taken for
    the streamed READ's answer.)"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([sys.executable, "-c", _REFUSED_ATTACH], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-2000:])
    lines = r.stdout.splitlines()
    assert "refused by the kernel" in lines[0], lines
    assert lines[1:] == ["moved: stream", "moved: stream"], lines
