"""Flow 2: paged blocks over a one-sided link (the vllm-ascend HIXL connector).

Both sides set ``local_comm_res = ""`` (cache-manager mode, remote-cache-accessible) and
``listen_ip_info``, and register one blocks cache holding every layer's K and V
(``num_tensors = 2 x layers``). The DECODER links with ``link_clusters([LLMClusterInfo],
timeout)`` -> ``(code, [codes])``, pulls a run of blocks for a layer range
(``src_layer_range=range(a, b), dst_layer_range=range(c, d)``), checks every byte, and
``unlink_clusters(..., force=True)``.

    python examples/flow2_one_sided_link.py
"""

from __future__ import annotations

import sys

import numpy as np
from _twoproc import free_port, launch, pattern, ready, role_args, same_bytes, wait_done

import datadist as llm_datadist

PROMPT_ID, DECODER_ID = 11, 22
LAYERS, BLOCKS, BLOCK_SHAPE = 6, 64, (16, 4, 16)  # K and V of 6 layers: 12 tensors
SRC_BLOCKS, DST_BLOCKS = list(range(10, 26)), list(range(40, 56))  # one contiguous run
SRC_LAYERS, DST_LAYERS = range(2, 5), range(0, 3)  # layers 2..4 into the first three


def run(role: str, setup: dict) -> int:
    me = PROMPT_ID if role == "prompt" else DECODER_ID
    port = setup["ports"][0 if role == "prompt" else 1]
    cfg = llm_datadist.LLMConfig()
    cfg.device_id = 0
    cfg.local_comm_res = ""
    cfg.listen_ip_info = f"127.0.0.1:{port}"
    cfg.sync_kv_timeout = 10000
    dd = llm_datadist.LLMDataDist(
        llm_datadist.LLMRole.PROMPT if role == "prompt" else llm_datadist.LLMRole.DECODER, me)
    dd.init(cfg.generate_options())
    cm = dd.cache_manager
    n = 2 * LAYERS
    shape = (n, BLOCKS, *BLOCK_SHAPE)
    arr = pattern(shape, 7, role=role) if role == "prompt" else np.zeros(shape, np.float16)
    desc = llm_datadist.CacheDesc(n, [BLOCKS, *BLOCK_SHAPE], llm_datadist.DataType.DT_FLOAT16,
                                  llm_datadist.Placement.DEVICE)
    cache = cm.register_blocks_cache(desc, [int(arr[i].ctypes.data) for i in range(n)],
                                     llm_datadist.BlocksCacheKey(me, 0), remote_accessible=True)
    if role == "prompt":
        ready()
        wait_done()
        dd.finalize()
        return 0
    info = llm_datadist.LLMClusterInfo()
    info.remote_cluster_id = PROMPT_ID
    info.append_local_ip_info("127.0.0.1", port)
    info.append_remote_ip_info("127.0.0.1", setup["ports"][0])
    code, codes = dd.link_clusters([info], 5000)
    print(f"decoder: link_clusters -> {code}, {codes}", flush=True)
    if code != llm_datadist.LLMStatusCode.LLM_SUCCESS:
        return 1
    cm.pull_blocks(llm_datadist.BlocksCacheKey(PROMPT_ID, 0), cache, src_blocks=SRC_BLOCKS,
                   dst_blocks=DST_BLOCKS, src_layer_range=SRC_LAYERS, dst_layer_range=DST_LAYERS)
    want = pattern(shape, 7, role="decoder")
    src_t = list(range(2 * SRC_LAYERS.start, 2 * SRC_LAYERS.stop))
    dst_t = list(range(2 * DST_LAYERS.start, 2 * DST_LAYERS.stop))
    ok = same_bytes(f"{len(SRC_BLOCKS)} blocks of layers {SRC_LAYERS.start}..{SRC_LAYERS.stop - 1}",
                    arr[dst_t][:, DST_BLOCKS], want[src_t][:, SRC_BLOCKS])
    expect = np.zeros(shape, np.float16)
    expect[np.ix_(dst_t, DST_BLOCKS)] = want[np.ix_(src_t, SRC_BLOCKS)]
    ok &= same_bytes("the whole destination cache", arr, expect)
    code, codes = dd.unlink_clusters([info], 5000, force=True)
    print(f"decoder: unlink_clusters -> {code}, {codes}", flush=True)
    ok &= code == llm_datadist.LLMStatusCode.LLM_SUCCESS
    dd.finalize()
    return 0 if ok else 1


if __name__ == "__main__":
    args = role_args()
    if args is None:
        sys.exit(launch(__file__, {"ports": [free_port(), free_port()]}))
    sys.exit(run(*args))
