"""The core's lease fences, seen from the Python API: finalize closes every fence file it made.

The fence rules themselves (revoke, drain, a copy in flight, a replaced fence, the reader's
checks of the file) are the core's, tested in cpp/tests/registry_test.cc (Native.*Fence*,
LeaseFence.*) and cpp/tests/local_test.cc (Fence.*, Owner.CacheLeases*).
"""

from __future__ import annotations

import os

import numpy as np

from datadist.core.layout import Geometry
from datadist.wire.protocol import KeyKind, KeyRef

GEO = Geometry(2, 4096 * 4, 4, is_blocks=True)


def test_finalize_closes_the_fences() -> None:
    """The core's close: once nothing is in flight, every fence it made for a same-host lease
    (and the puller's mapping of it) is closed, so finalize + init cycles do not pile up
    memfds. Each cycle leases a blocks cache twice (the model id bound anew in between
    revokes the first lease: a second fence)."""
    from datadist.core.config import EngineConfig
    from datadist.core.layout import every_tensor, plan_blocks
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
            plan = plan_blocks(local.geometry, [1], [2], every_tensor(2))
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
