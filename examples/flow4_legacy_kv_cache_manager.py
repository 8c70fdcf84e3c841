"""Flow 4: legacy mode (``KvCacheManager``), as the vLLM V0 LLMDataDist connector uses it.

The options are a hand-written dict without ``llm.EnableCacheManager``, so ``init`` selects
legacy mode: methods are gated by role, caches come from the pool ``ge.flowGraphMemMaxSize``
sizes, and only the PROMPT listens. The PROMPT allocates one cache per model_id (key, value,
...) with a ``CacheKey``; their cache ids are 1, 2, 3, ... in allocation order, and the
DECODER relies on that: it pulls ``CacheKeyByIdAndIndex(prompt, cache_id, 0)`` with
hard-coded ids, once whole and once with ``size``, ``src_cache_offset`` and
``dst_cache_offset``, and reads what landed through ``get_cache_tensors(...)[0].numpy()``.

    python examples/flow4_legacy_kv_cache_manager.py
"""

from __future__ import annotations

import sys

import numpy as np
from _twoproc import free_port, launch, pattern, ready, role_args, same_bytes, wait_done

import datadist as llm_datadist

PROMPT_ID, DECODER_ID = 300, 400
LAYERS, SEQ, HEADS, DIM = 4, 64, 2, 32
MODEL_IDS = (1, 2, 3, 4)  # key, value, input, hidden
SIZE, SRC_OFFSET, DST_OFFSET = 1024, 2048, 512  # bytes, within the one batch slot


def desc() -> llm_datadist.CacheDesc:
    return llm_datadist.CacheDesc(LAYERS, [1, SEQ, HEADS, DIM], llm_datadist.DataType.DT_FLOAT16)


def tensors(kv: object, cache: llm_datadist.KvCache) -> np.ndarray:
    return np.stack([kv.get_cache_tensors(cache, i)[0].numpy() for i in range(LAYERS)])


def run(role: str, setup: dict) -> int:
    options = {"ge.exec.deviceId": "0", "llm.SyncKvCacheWaitTime": "10000",
               "ge.flowGraphMemMaxSize": str(64 << 20)}
    if role == "prompt":
        options["llm.listenIpInfo"] = f"127.0.0.1:{setup['port']}"
        dd = llm_datadist.LLMDataDist(llm_datadist.LLMRole.PROMPT, PROMPT_ID)
    else:
        dd = llm_datadist.LLMDataDist(llm_datadist.LLMRole.DECODER, DECODER_ID)
    dd.init(options)
    kv = dd.kv_cache_manager
    shape = (LAYERS, 1, SEQ, HEADS, DIM)
    if role == "prompt":
        caches = [kv.allocate_cache(desc(), [llm_datadist.CacheKey(PROMPT_ID, 0, m)])
                  for m in MODEL_IDS]
        for cache in caches:
            data = pattern(shape, cache.cache_id, role=role)
            for i in range(LAYERS):
                kv.get_cache_tensors(cache, i)[0].numpy()[...] = data[i]
        ready(cache_ids=[c.cache_id for c in caches])
        wait_done()
        for cache in caches:
            kv.deallocate_cache(cache)
        dd.finalize()
        return 0
    print(f"decoder: the prompt's cache ids are {setup['cache_ids']}", flush=True)
    info = llm_datadist.LLMClusterInfo()
    info.remote_cluster_id = PROMPT_ID
    info.append_local_ip_info("127.0.0.1", 0)
    info.append_remote_ip_info("127.0.0.1", setup["port"])
    code, _ = dd.link_clusters([info], 20000)
    if code != llm_datadist.LLMStatusCode.LLM_SUCCESS:
        print(f"decoder: link_clusters -> {code}", flush=True)
        return 1
    dd.check_link_status(PROMPT_ID)  # raises if the link is bad
    ok = True
    for cache_id in (1, 2, 3, 4):  # hard-coded, as the V0 connector does
        buf = kv.allocate_cache(desc())
        kv.pull_cache(llm_datadist.CacheKeyByIdAndIndex(PROMPT_ID, cache_id, 0), buf, 0)
        ok &= same_bytes(f"cache {cache_id}, whole", tensors(kv, buf),
                         pattern(shape, cache_id, role="decoder"))
    part = kv.allocate_cache(desc())
    # Pool memory is not zeroed (nor in llm_datadist, where the dropped buffers above are
    # freed and their memory reused): clear it, so that only the pulled bytes are non-zero.
    for i in range(LAYERS):
        kv.get_cache_tensors(part, i)[0].numpy()[...] = 0
    kv.pull_cache(llm_datadist.CacheKeyByIdAndIndex(PROMPT_ID, 4, 0), part, 0, SIZE,
                  src_cache_offset=SRC_OFFSET, dst_cache_offset=DST_OFFSET)
    got = tensors(kv, part).reshape(LAYERS, -1).view(np.uint8)
    want = np.zeros_like(got)
    src = pattern(shape, 4, role="decoder").reshape(LAYERS, -1).view(np.uint8)
    want[:, DST_OFFSET:DST_OFFSET + SIZE] = src[:, SRC_OFFSET:SRC_OFFSET + SIZE]
    ok &= same_bytes(f"cache 4, {SIZE} bytes from offset {SRC_OFFSET} to {DST_OFFSET}", got, want)
    code, _ = dd.unlink_clusters([info], 5000)
    ok &= code == llm_datadist.LLMStatusCode.LLM_SUCCESS
    dd.finalize()
    return 0 if ok else 1


if __name__ == "__main__":
    args = role_args()
    if args is None:
        sys.exit(launch(__file__, {"port": free_port()}))
    sys.exit(run(*args))
