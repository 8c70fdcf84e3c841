"""Fence files and the registry's revocation of whole-cache leases (transport/fence.py).

A reader's view is opened through /proc/self/fd, as another process would: its own open file
description, so its flock conflicts with the owner's exactly as across processes.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from datadist.core.errors import CacheNotFound, Timeout
from datadist.core.layout import Geometry
from datadist.core.registry import Registry
from datadist.transport.fence import Fence, FenceUnavailable, FenceView
from datadist.wire.protocol import KeyKind, KeyRef


def view_of(fence: Fence) -> FenceView:
    return FenceView(os.getpid(), fence.fd, fence.ino)


def test_a_copy_in_flight_keeps_the_fence_from_draining() -> None:
    fence = Fence()
    view = view_of(fence)
    try:
        assert view.enter()
        fence.revoke()
        assert not fence.drained()  # the copy that started before the revocation runs on
        view.leave()
        assert fence.drained()
        assert not view.enter()  # revoked: no copy starts any more
        assert view.revoked()
    finally:
        view.close()
        fence.close()


def test_a_reader_never_waits_for_the_owner() -> None:
    fence = Fence()
    view = view_of(fence)
    try:
        import fcntl

        fcntl.flock(fence.fd, fcntl.LOCK_EX)  # the owner draining right now
        t0 = time.monotonic()
        assert not view.enter()
        assert time.monotonic() - t0 < 0.5
        fcntl.flock(fence.fd, fcntl.LOCK_UN)
        assert view.enter()  # not revoked: the next copy goes ahead
        view.leave()
    finally:
        view.close()
        fence.close()


def test_the_flag_outlives_the_owners_descriptor() -> None:
    fence = Fence()
    view = view_of(fence)
    fence.close()  # revokes and closes: the reader's file keeps the flag
    try:
        assert view.revoked() and not view.enter()
    finally:
        view.close()


def test_a_view_checks_what_it_opens() -> None:
    fence = Fence()
    try:
        with pytest.raises(FenceUnavailable, match="not the fence"):
            FenceView(os.getpid(), fence.fd, fence.ino + 1)
        r, w = os.pipe()
        try:
            with pytest.raises(FenceUnavailable):
                FenceView(os.getpid(), r, os.fstat(r).st_ino)
        finally:
            os.close(r)
            os.close(w)
        unsealed = os.memfd_create("plain")
        try:
            os.ftruncate(unsealed, 4096)
            with pytest.raises(FenceUnavailable, match="sealed"):
                FenceView(os.getpid(), unsealed, os.fstat(unsealed).st_ino)
        finally:
            os.close(unsealed)
    finally:
        fence.close()


# ------------------------------------------------------------------------------ registry

GEO = Geometry(2, 4096 * 4, 4, is_blocks=True)


def _blocks(reg: Registry, model: int, **kw: object) -> object:
    buf = np.zeros(2 * GEO.tensor_bytes, np.uint8)
    addrs = [buf.ctypes.data, buf.ctypes.data + GEO.tensor_bytes]
    entry = reg.add(GEO, addrs, owned=bool(kw.get("free")), blocks_model_id=model,
                    free=kw.get("free"))  # type: ignore[arg-type]
    entry._buf = buf  # type: ignore[attr-defined]
    return entry


def test_unregister_waits_for_a_leased_copy_and_revokes() -> None:
    reg = Registry()
    entry = _blocks(reg, 5)
    got, fence = reg.lease_cache(KeyRef(KeyKind.BLOCKS_KEY, 0, 5))
    assert got is entry
    view = view_of(fence)
    try:
        assert view.enter()
        with pytest.raises(Timeout):  # a copy is still in flight: the cache stays
            reg.unregister(entry.cache_id, wait=0.05)  # type: ignore[attr-defined]
        assert reg.get(entry.cache_id) is entry  # type: ignore[attr-defined]
        done = threading.Event()
        threading.Thread(target=lambda: (reg.unregister(entry.cache_id, wait=5),  # type: ignore[attr-defined]
                                         done.set())).start()
        time.sleep(0.05)
        assert not done.is_set()
        view.leave()
        assert done.wait(2)
        assert not view.enter()  # revoked
        with pytest.raises(CacheNotFound):
            reg.lease_cache(KeyRef(KeyKind.BLOCKS_KEY, 0, 5))
    finally:
        view.close()


def test_pool_memory_goes_back_only_once_the_copy_ended() -> None:
    freed = threading.Event()
    reg = Registry()
    entry = _blocks(reg, 6, free=freed.set)
    _, fence = reg.lease_cache(KeyRef(KeyKind.CACHE_ID, entry.cache_id))  # type: ignore[attr-defined]
    view = view_of(fence)
    try:
        assert view.enter()
        reg.deallocate(entry.cache_id, drop_keys=True)  # type: ignore[attr-defined]
        time.sleep(0.05)
        assert not freed.is_set()  # a leased copy is still reading it
        assert reg.wait_unleased([entry], 0.01) == 1  # type: ignore[list-item]
        view.leave()
        assert freed.wait(2)
        assert reg.wait_unleased([entry], 1) == 0  # type: ignore[list-item]
    finally:
        view.close()


def test_binding_a_model_id_anew_revokes_the_old_lease() -> None:
    reg = Registry()
    _blocks(reg, 7)
    _, fence = reg.lease_cache(KeyRef(KeyKind.BLOCKS_KEY, 0, 7))
    view = view_of(fence)
    try:
        assert view.enter()
        view.leave()
        new = _blocks(reg, 7)
        assert not view.enter()  # the model id names another cache now
        got, fence2 = reg.lease_cache(KeyRef(KeyKind.BLOCKS_KEY, 0, 7))
        assert got is new and fence2 is not fence
    finally:
        view.close()


def test_a_revoked_cache_is_leased_with_a_new_fence() -> None:
    reg = Registry()
    entry = _blocks(reg, 8)
    _, fence = reg.lease_cache(KeyRef(KeyKind.CACHE_ID, entry.cache_id))  # type: ignore[attr-defined]
    fence.revoke()  # e.g. an unregister that timed out: the cache stays, the lease went
    _, again = reg.lease_cache(KeyRef(KeyKind.CACHE_ID, entry.cache_id))  # type: ignore[attr-defined]
    assert again is not fence and not again.revoked


def test_cache_keys_are_never_leased() -> None:
    from datadist.core.errors import InvalidArgument

    with pytest.raises(InvalidArgument):
        Registry().lease_cache(KeyRef(KeyKind.CACHE_KEY, 1, 0))


# ------------------------------------------------------------------------------ review fixes


def test_a_copy_under_a_replaced_fence_is_waited_for_too() -> None:
    """A cache leased by model id, the model id bound to another cache (the fence revoked,
    not drained: the old cache is still valid), then leased again by id (a new fence): its
    unregister and its pool memory must still wait for the copy under the first fence."""
    freed = threading.Event()
    reg = Registry()
    a = _blocks(reg, 9, free=freed.set)
    _, f1 = reg.lease_cache(KeyRef(KeyKind.BLOCKS_KEY, 0, 9))
    v1 = view_of(f1)
    try:
        assert v1.enter()  # a long copy under the first fence
        _blocks(reg, 9)  # model 9 names another cache now
        _, f2 = reg.lease_cache(KeyRef(KeyKind.CACHE_ID, a.cache_id))  # type: ignore[attr-defined]
        assert f2 is not f1
        with pytest.raises(Timeout):
            reg.unregister(a.cache_id, wait=0.05)  # type: ignore[attr-defined]
        reg.deallocate(a.cache_id, drop_keys=True)  # type: ignore[attr-defined]
        time.sleep(0.05)
        assert not freed.is_set()
        v1.leave()
        assert freed.wait(2)
    finally:
        v1.close()


def test_finalize_closes_the_fences() -> None:
    """The core's close: once nothing is in flight, every fence it made for a same-host lease
    (and the puller's mapping of it) is closed, so finalize + init cycles do not pile up
    memfds. Each cycle leases a blocks cache twice (the model id bound anew in between
    revokes the first lease: a second fence)."""
    from datadist.core.config import EngineConfig
    from datadist.core.layout import layer_tensor_indices, plan_blocks
    from datadist.core.native import NativeEngine

    def fences() -> int:  # fence files open here (a mapping holds a second descriptor)
        inodes = set()
        for fd in os.listdir("/proc/self/fd"):
            try:
                if "datadist-fence" in os.readlink(f"/proc/self/fd/{fd}"):
                    inodes.add(os.stat(f"/proc/self/fd/{fd}").st_ino)
            except OSError:
                pass
        return len(inodes)

    before = fences()
    for _ in range(3):
        owner = NativeEngine(EngineConfig(cluster_id=5, role=1, listen=("127.0.0.1", 0)))
        puller = NativeEngine(EngineConfig(cluster_id=6, role=2))
        try:
            assert owner.listen_address is not None
            puller.link(5, *owner.listen_address, 5.0)
            bufs = [np.full(GEO.tensor_bytes * 2, i + 1, np.uint8) for i in range(2)]
            dst = np.zeros(GEO.tensor_bytes * 2, np.uint8)
            local = puller.register(GEO, [dst.ctypes.data, dst.ctypes.data + GEO.tensor_bytes],
                                    placement=0)
            plan = plan_blocks(local.geometry, [1], [2], layer_tensor_indices(2, None, None, 2))
            for buf in bufs:  # the second binds model 3 anew: the first lease is revoked
                owner.register(GEO, [buf.ctypes.data, buf.ctypes.data + GEO.tensor_bytes],
                               placement=0, blocks_model_id=3)
                puller.pull(5, KeyRef(KeyKind.BLOCKS_KEY, 0, 3), GEO.unit_bytes, plan,
                            local.cache_id, 5.0)
                assert dst[2 * GEO.unit_bytes] == buf[0]  # moved, from the cache bound now
            assert fences() >= before + 1
        finally:
            puller.close()
            owner.close()
        assert fences() == before
