"""A DECODER worker: links to a PROMPT worker and pulls a request's KV blocks into its own cache.

    python examples/two_hosts/decoder.py --peer 10.0.0.1:26000 --cluster-id 2 \
        '{"request": 0, "prompt_cluster_id": 1, "block_table": [17, 201, 5, ...]}'

Each argument (or each line on stdin, without arguments) is a request as the PROMPT printed
it. The decoder picks free blocks of its own cache, pulls the PROMPT's blocks into them with
``pull_blocks``, checks every byte, and prints what moved and how fast.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
from prompt import BLOCK_TOKENS, BLOCKS, HEAD_DIM, KV_HEADS, LAYERS, MODEL_ID, block_content

import datadist as llm_datadist


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peer", default="127.0.0.1:26000", help="the PROMPT's ip:port ([ipv6]:port)")
    ap.add_argument("--cluster-id", type=int, default=2, help="this worker's cluster id")
    ap.add_argument("--timeout-ms", type=int, default=5000,
                    help="deadline of every pull (sync_kv_timeout; size it for your link)")
    ap.add_argument("requests", nargs="*", help="request JSON lines (default: read stdin)")
    args = ap.parse_args()
    requests = [json.loads(r) for r in (args.requests or sys.stdin) if r.strip()]
    if not requests:
        ap.error("no request given")
    ip, _, port = args.peer.rpartition(":")
    ip = ip.removeprefix("[").removesuffix("]")  # "[::1]:26000": an IPv6 ip is bare here

    cfg = llm_datadist.LLMConfig()
    cfg.device_id = 0
    cfg.local_comm_res = ""
    cfg.sync_kv_timeout = args.timeout_ms
    dd = llm_datadist.LLMDataDist(llm_datadist.LLMRole.DECODER, args.cluster_id)
    dd.init(cfg.generate_options())
    kv = np.zeros((2 * LAYERS, BLOCKS, BLOCK_TOKENS, KV_HEADS, HEAD_DIM), np.float16)
    desc = llm_datadist.CacheDesc(2 * LAYERS, [BLOCKS, BLOCK_TOKENS, KV_HEADS, HEAD_DIM],
                                  llm_datadist.DataType.DT_FLOAT16)
    cache = dd.cache_manager.register_blocks_cache(
        desc, [kv[t].ctypes.data for t in range(2 * LAYERS)],
        llm_datadist.BlocksCacheKey(args.cluster_id, MODEL_ID))

    prompt_id = requests[0]["prompt_cluster_id"]
    info = llm_datadist.LLMClusterInfo()
    info.remote_cluster_id = prompt_id
    info.append_local_ip_info("0.0.0.0", 0)
    info.append_remote_ip_info(ip, int(port))
    code, codes = dd.link_clusters([info], timeout=5000)
    if code != llm_datadist.LLMStatusCode.LLM_SUCCESS:
        print(f"decoder: link to {args.peer} failed: {codes[0]!s}: "
              f"{dd.last_link_failure(prompt_id)}", file=sys.stderr)
        return 1
    path = dd.engine.get_link(prompt_id).path_name
    ok = True
    next_free = 0
    for req in requests:
        src = req["block_table"]
        dst = list(range(next_free, next_free + len(src)))  # this decoder's own block table
        next_free += len(src)
        t0 = time.perf_counter()
        dd.cache_manager.pull_blocks(llm_datadist.BlocksCacheKey(prompt_id, MODEL_ID), cache,
                                     src, dst)
        dt = time.perf_counter() - t0
        good = all(np.array_equal(kv[:, d], block_content(prompt_id, s))
                   for s, d in zip(src, dst, strict=True))
        ok &= good
        nbytes = len(src) * kv[:, 0].nbytes
        print(f"decoder: request {req['request']}: {len(src)} blocks, {nbytes / 2**20:.2f} MiB "
              f"over {path} in {dt * 1e3:.2f} ms ({nbytes / dt / 1e9:.2f} GB/s), "
              f"{'bytes verified' if good else 'WRONG BYTES'}", flush=True)
    dd.unlink_clusters([info], 5000, force=True)
    dd.finalize()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
