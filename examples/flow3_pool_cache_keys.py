"""Flow 3: request-keyed caches from a memory pool.

The PROMPT allocates one batch cache from its pool with a ``CacheKey(prompt, req_id)`` per
batch slot (``req_id = 2**64-1`` pads a slot). The DECODER allocates its own cache, links
with ``link_clusters``, and pulls each request into a slot with
``pull_cache(CacheKey(prompt, req_id), cache, batch_index=i)``. A successful pull consumes
the key: pulling it again is LLM_KV_CACHE_NOT_EXIST, and the PROMPT's ``remove_cache_key``
afterwards is a no-op.

    python examples/flow3_pool_cache_keys.py
"""

from __future__ import annotations

import ctypes
import json
import sys

import numpy as np
from _twoproc import free_port, launch, pattern, ready, role_args, same_bytes, wait_done

import datadist as llm_datadist

PROMPT_ID, DECODER_ID = 5, 6
LAYERS, BATCH, SEQ, HEADS, DIM = 3, 4, 32, 2, 16
REQ_IDS = [700, 2**64 - 1, 702, 703]  # slot 1 is padding
POOL = json.dumps({"memory_size": 64 << 20})


def view(addr: int, shape: tuple[int, ...]) -> np.ndarray:
    """A numpy view of pool memory at ``addr``."""
    count = int(np.prod(shape))
    buf = (ctypes.c_uint16 * count).from_address(addr)
    return np.frombuffer(buf, dtype=np.float16).reshape(shape)


def run(role: str, setup: dict) -> int:
    me = PROMPT_ID if role == "prompt" else DECODER_ID
    cfg = llm_datadist.LLMConfig()
    cfg.device_id = 0
    cfg.enable_cache_manager = True
    cfg.mem_pool_cfg = POOL
    cfg.sync_kv_timeout = 10000
    if role == "prompt":
        cfg.listen_ip_info = f"127.0.0.1:{setup['port']}"
    dd = llm_datadist.LLMDataDist(
        llm_datadist.LLMRole.PROMPT if role == "prompt" else llm_datadist.LLMRole.DECODER, me)
    dd.init(cfg.generate_options())
    cm = dd.cache_manager
    n = 2 * LAYERS
    shape = (BATCH, SEQ, HEADS, DIM)
    desc = llm_datadist.CacheDesc(n, list(shape), llm_datadist.DataType.DT_FLOAT16,
                                  llm_datadist.Placement.DEVICE)
    if role == "prompt":
        keys = [llm_datadist.CacheKey(PROMPT_ID, r) for r in REQ_IDS]
        cache = cm.allocate_cache(desc, keys)
        for i, addr in enumerate(cache.tensor_addrs):
            view(addr, shape)[...] = pattern(shape, i, role=role)
        ready()
        wait_done()
        cm.remove_cache_key(keys[0])  # consumed by the decoder's pull: a no-op
        cm.deallocate_cache(cache)
        dd.finalize()
        return 0
    cache = cm.allocate_cache(desc)
    info = llm_datadist.LLMClusterInfo()
    info.remote_cluster_id = PROMPT_ID
    info.append_local_ip_info("127.0.0.1", 0)
    info.append_remote_ip_info("127.0.0.1", setup["port"])
    code, _ = dd.link_clusters([info], 5000)
    if code != llm_datadist.LLMStatusCode.LLM_SUCCESS:
        print(f"decoder: link_clusters -> {code}", flush=True)
        return 1
    ok = True
    # request 702 (the prompt's slot 2) into our slot 0, 700 (slot 0) into 1, 703 into 3
    placements = {702: (2, 0), 700: (0, 1), 703: (3, 3)}
    for req_id, (_, dst_slot) in placements.items():
        cm.pull_cache(llm_datadist.CacheKey(PROMPT_ID, req_id), cache, batch_index=dst_slot)
    got = np.stack([view(addr, shape) for addr in cache.tensor_addrs])  # (tensor, slot, ...)
    want = np.stack([pattern(shape, i, role="decoder") for i in range(n)])
    for req_id, (src_slot, dst_slot) in placements.items():
        ok &= same_bytes(f"req {req_id} into slot {dst_slot}, {n} tensors",
                         got[:, dst_slot], want[:, src_slot])
    ok &= same_bytes("slot 2 untouched", got[:, 2], np.zeros_like(got[:, 2]))
    try:
        cm.pull_cache(llm_datadist.CacheKey(PROMPT_ID, 700), cache, batch_index=2)
        print("decoder: a consumed key was pulled again", flush=True)
        ok = False
    except llm_datadist.LLMException as e:
        print(f"decoder: pulling req 700 again -> {e.status_code}", flush=True)
        ok &= e.status_code == llm_datadist.LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    dd.unlink_clusters([info], 5000)
    cm.deallocate_cache(cache)
    dd.finalize()
    return 0 if ok else 1


if __name__ == "__main__":
    args = role_args()
    if args is None:
        sys.exit(launch(__file__, {"port": free_port()}))
    sys.exit(run(*args))
