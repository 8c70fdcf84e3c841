"""The Python side of the cross-language tests: one real ``LLMDataDist`` in this process, the
core under the Python API (the other side is the same core under the C++ API, tests/xpeer)."""

from __future__ import annotations

import numpy as np

import datadist as llm

PY_ID = 7  # cluster id of the Python side


def make_python(role: llm.LLMRole, *, listen: bool, verify: bool = False,
                sync_ms: int = 3000, secret: str = "",
                transport: str = "", accessible: bool = True,
                listen_ip_info: str = "127.0.0.1:0") -> llm.LLMDataDist:
    """An initialized LLMDataDist in cache-manager mode with remote-cache-accessible on
    (unless ``accessible`` is False); the caller finalizes it."""
    dd = llm.LLMDataDist(role, PY_ID)
    cfg = llm.LLMConfig()
    cfg.device_id = 0
    cfg.enable_cache_manager = True
    cfg.enable_remote_cache_accessible = accessible
    cfg.sync_kv_timeout = sync_ms
    cfg.verify_checksum = verify
    if secret:
        cfg.auth_secret = secret
    if transport:
        cfg.transport = transport
    if listen:
        cfg.listen_ip_info = listen_ip_info
    dd.init(cfg.generate_options())
    return dd


def register(dd: llm.LLMDataDist, num_tensors: int, shape: tuple[int, ...], *,
             blocks: bool = False, model_id: int = 0) -> tuple[llm.Cache, list[np.ndarray]]:
    """A zeroed DT_UINT8 cache on numpy arrays (kept alive by the returned list)."""
    arrays = [np.zeros(shape, dtype=np.uint8) for _ in range(num_tensors)]
    desc = llm.CacheDesc(num_tensors, list(shape), llm.DataType.DT_UINT8, llm.Placement.HOST)
    addrs = [a.ctypes.data for a in arrays]
    cm = dd.cache_manager
    if blocks:
        cache = cm.register_blocks_cache(desc, addrs, llm.BlocksCacheKey(PY_ID, model_id))
    else:
        cache = cm.register_cache(desc, addrs)
    return cache, arrays


def link_to(dd: llm.LLMDataDist, cluster_id: int, port: int,
            expect: llm.LLMStatusCode = llm.LLMStatusCode.LLM_SUCCESS,
            host: str = "127.0.0.1") -> None:
    info = llm.LLMClusterInfo()
    info.remote_cluster_id = cluster_id
    info.append_local_ip_info(host, 0)
    info.append_remote_ip_info(host, port)
    code, codes = dd.link_clusters([info], timeout=5000)
    assert code == expect, codes
