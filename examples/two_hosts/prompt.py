"""A PROMPT (prefill) worker: computes KV caches and serves them to decoders on other hosts.

    python examples/two_hosts/prompt.py --listen 0.0.0.0:26000 --cluster-id 1

It registers one paged KV cache (K and V of every layer, ``num_blocks`` blocks each) under a
``BlocksCacheKey``, "prefills" a few requests by writing their blocks, and prints each
request's block table as one JSON line on stdout. datadist does not carry block tables: a
serving system sends them from prefill to decode with the request (vLLM's
``kv_transfer_params``, a router's RPC); here you paste the line into the decoder. Then it
serves: in a terminal's foreground until you press Enter; otherwise (in the background, from
a script, under a service manager) until it gets SIGTERM, SIGINT or SIGHUP.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading

import numpy as np

import datadist as llm_datadist

LAYERS, BLOCKS, BLOCK_TOKENS, KV_HEADS, HEAD_DIM = 4, 256, 16, 4, 64
MODEL_ID = 0


def block_content(cluster_id: int, block: int) -> np.ndarray:
    """What prefill "computed" for one block of every layer's K and V (so the decoder can
    check it byte for byte without another channel)."""
    rng = np.random.default_rng([cluster_id, block])
    return rng.standard_normal((2 * LAYERS, BLOCK_TOKENS, KV_HEADS, HEAD_DIM)).astype(np.float16)


def in_foreground_terminal() -> bool:
    """Is stdin a terminal whose foreground is this process? (A background job reading its
    terminal would be stopped by SIGTTIN; a closed or redirected stdin has no Enter.)"""
    try:
        return sys.stdin.isatty() and os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
    except (OSError, ValueError):
        return False


def serve_until_told() -> None:
    """Block until Enter (in a foreground terminal only) or SIGTERM / SIGINT / SIGHUP."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    if in_foreground_terminal():
        threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
    while not stop.wait(0.5):
        pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--listen", default="127.0.0.1:26000",
                    help="ip:port or [ipv6]:port to serve on: this host's address that decoders "
                         "can reach, or 0.0.0.0 (or [::]) for every interface "
                         "(default %(default)s)")
    ap.add_argument("--cluster-id", type=int, default=1, help="this worker's cluster id")
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=100, help="prompt tokens per request")
    args = ap.parse_args()

    cfg = llm_datadist.LLMConfig()
    cfg.device_id = 0
    cfg.local_comm_res = ""            # cache-manager mode, one-sided links (link_clusters)
    cfg.listen_ip_info = args.listen   # without it nobody can pull from this process
    dd = llm_datadist.LLMDataDist(llm_datadist.LLMRole.PROMPT, args.cluster_id)
    dd.init(cfg.generate_options())

    # One blocks cache: tensor 2*l is layer l's K, 2*l+1 its V; each [blocks, tokens, heads, dim].
    kv = np.zeros((2 * LAYERS, BLOCKS, BLOCK_TOKENS, KV_HEADS, HEAD_DIM), np.float16)
    desc = llm_datadist.CacheDesc(2 * LAYERS, [BLOCKS, BLOCK_TOKENS, KV_HEADS, HEAD_DIM],
                                  llm_datadist.DataType.DT_FLOAT16)
    dd.cache_manager.register_blocks_cache(
        desc, [kv[t].ctypes.data for t in range(2 * LAYERS)],
        llm_datadist.BlocksCacheKey(args.cluster_id, MODEL_ID))  # the key decoders pull by

    rng = np.random.default_rng(0)
    free = list(rng.permutation(BLOCKS))
    per_request = -(-args.tokens // BLOCK_TOKENS)
    for req in range(args.requests):
        table = [int(free.pop()) for _ in range(per_request)]
        for b in table:
            kv[:, b] = block_content(args.cluster_id, b)  # "prefill"
        print(json.dumps({"request": req, "prompt_cluster_id": args.cluster_id,
                          "prompt": dd.listen_address, "block_table": table}), flush=True)
    how = "Enter or Ctrl-C" if in_foreground_terminal() else f"kill {os.getpid()}"
    print(f"prompt: serving {args.requests} requests on {dd.listen_address[0]}:"
          f"{dd.listen_address[1]} as cluster {args.cluster_id}; {how} to stop",
          file=sys.stderr, flush=True)
    serve_until_told()
    dd.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
