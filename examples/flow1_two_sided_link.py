"""Flow 1: paged blocks over a two-sided link (the vllm-ascend LLMDataDist connector, MindIE).

Both sides register one blocks cache per model_id (K = 0, V = 1) under their own cluster id,
both call ``link(comm_name, {cluster_id: rank}, rank_table)`` with the same HCCL rank table
(it returns once both have joined), and both poll ``query_register_mem_status(comm_id)``
until OK, as the connectors do. The DECODER then pulls blocks
of each cache with ``pull_blocks(BlocksCacheKey(prompt, model_id), cache, src, dst)``, checks
every byte, and both ``unlink(comm_id)``.

On one host, each rank's ``device_port`` in the rank table says where it listens.

    python examples/flow1_two_sided_link.py
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
from _twoproc import free_port, launch, pattern, ready, role_args, same_bytes, wait_done

import datadist as llm_datadist

PROMPT_ID, DECODER_ID = 1001, 2002
LAYERS, BLOCKS, BLOCK_SHAPE = 4, 32, (16, 2, 8)  # 16 tokens x 2 heads x 8 dims per block
SRC_BLOCKS, DST_BLOCKS = [3, 4, 5, 9, 17], [0, 1, 2, 30, 8]


def rank_table(ports: list[int]) -> str:
    devices = [{"device_id": str(r), "device_ip": "127.0.0.1", "rank_id": str(r),
                "device_port": ports[r]} for r in range(2)]
    return json.dumps({"version": "1.2", "server_count": "1", "status": "completed",
                       "server_list": [{"server_id": "localhost", "device": devices}]})


def run(role: str, setup: dict) -> int:
    me = PROMPT_ID if role == "prompt" else DECODER_ID
    cfg = llm_datadist.LLMConfig()
    cfg.device_id = 0
    cfg.enable_cache_manager = True
    cfg.sync_kv_timeout = 10000
    cfg.link_total_time = 30
    dd = llm_datadist.LLMDataDist(
        llm_datadist.LLMRole.PROMPT if role == "prompt" else llm_datadist.LLMRole.DECODER, me)
    dd.init(cfg.generate_options())
    cm = dd.cache_manager
    desc = llm_datadist.CacheDesc(LAYERS, [BLOCKS, *BLOCK_SHAPE],
                                  llm_datadist.DataType.DT_FLOAT16,
                                  llm_datadist.Placement.DEVICE)
    arrays, caches = {}, {}
    for model_id in (0, 1):  # register before linking
        arr = (pattern((LAYERS, BLOCKS, *BLOCK_SHAPE), model_id, role=role) if role == "prompt"
               else np.zeros((LAYERS, BLOCKS, *BLOCK_SHAPE), np.float16))
        arrays[model_id] = arr
        caches[model_id] = cm.register_blocks_cache(
            desc, [int(arr[i].ctypes.data) for i in range(LAYERS)],
            llm_datadist.BlocksCacheKey(me, model_id))
    if role == "prompt":
        ready()  # the launcher starts the decoder now: link blocks until both have joined
    comm_id = dd.link(f"pd_comm_{PROMPT_ID}_{DECODER_ID}", {PROMPT_ID: 0, DECODER_ID: 1},
                      rank_table(setup["ports"]))
    deadline = time.monotonic() + 30
    while (status := dd.query_register_mem_status(comm_id)) != llm_datadist.RegisterMemStatus.OK:
        if status == llm_datadist.RegisterMemStatus.FAILED or time.monotonic() > deadline:
            print(f"{role}: link failed ({status})", flush=True)
            return 1
        time.sleep(0.02)
    print(f"{role}: comm {comm_id} is OK", flush=True)
    ok = True
    if role == "decoder":
        for model_id in (0, 1):
            cm.pull_blocks(llm_datadist.BlocksCacheKey(PROMPT_ID, model_id), caches[model_id],
                           SRC_BLOCKS, DST_BLOCKS)
            want = pattern((LAYERS, BLOCKS, *BLOCK_SHAPE), model_id, role="decoder")
            ok &= same_bytes(f"model_id {model_id}, {len(SRC_BLOCKS)} blocks x {LAYERS} layers",
                             arrays[model_id][:, DST_BLOCKS], want[:, SRC_BLOCKS])
            untouched = np.setdiff1d(np.arange(BLOCKS), DST_BLOCKS)
            ok &= same_bytes(f"model_id {model_id}, other blocks untouched",
                             arrays[model_id][:, untouched],
                             np.zeros((LAYERS, len(untouched), *BLOCK_SHAPE), np.float16))
    else:
        wait_done()
    dd.unlink(comm_id)
    dd.finalize()
    return 0 if ok else 1


if __name__ == "__main__":
    args = role_args()
    if args is None:
        sys.exit(launch(__file__, {"ports": [free_port(), free_port()]}))
    sys.exit(run(*args))
