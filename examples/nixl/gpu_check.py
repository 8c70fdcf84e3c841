"""NIXL and GPU memory, end to end, on a host with a CUDA GPU (not run where datadist is built:
there is no GPU there; docs/transports.md, "VRAM").

An owner (a child process) serves a cache of CUDA tensors (DEVICE placement) by NIXL; a
decoder forced to NIXL pulls batch slots of it into CUDA tensors of its own, then into host
memory, and every byte is compared. Both run on the C++ core. It checks what only a GPU can:
that the core asks CUDA, registers the tensors with NIXL as VRAM of their device (printed from
the core's agents), that the owner's grants and leases say VRAM, and that UCX moves the bytes.

Needs torch with CUDA, the nixl-cu12 wheel, and a UCX with CUDA support (the wheel's). Run:

    python examples/nixl/gpu_check.py [--device 0]

Exit status 0 when every check passes; each check prints one line.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
from typing import Any

import numpy as np

import datadist as llm_datadist
from datadist.testing import engine as hooks

OWNER, DECODER = 101, 202
TENSORS, SLOTS, SLOT_SHAPE = 4, 8, (16, 256)  # 4 tensors of 8 slots of 16x256 fp16 (8 KiB)
VRAM = 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def instance(role: llm_datadist.LLMRole, me: int, port: int, **nixl: Any) -> Any:
    cfg = llm_datadist.LLMConfig()
    cfg.local_comm_res = ""
    cfg.listen_ip_info = f"127.0.0.1:{port}"
    cfg.sync_kv_timeout = 10000
    for name, value in nixl.items():
        setattr(cfg, name, value)
    dd = llm_datadist.LLMDataDist(role, me)
    dd.init(cfg.generate_options())
    return dd


def register(dd: Any, tensors: list[Any], placement: Any) -> Any:
    desc = llm_datadist.CacheDesc(len(tensors), [SLOTS, *SLOT_SHAPE],
                                  llm_datadist.DataType.DT_FLOAT16, placement)
    addrs = [int(t.data_ptr()) if hasattr(t, "data_ptr") else int(t.ctypes.data)
             for t in tensors]
    return dd.cache_manager.register_cache(desc, addrs, remote_accessible=True)


def regions(dd: Any) -> list[tuple[int, int, int, int]]:
    """(start, end, memory kind, device) of what the core's NIXL agent registered."""
    return [tuple(r) for r in hooks.nixl_regions(dd.engine)]


def check(ok: bool, what: str) -> bool:
    print(f"{'ok  ' if ok else 'FAIL'} {what}", flush=True)
    return ok


def pattern(torch: Any, t: int, device: Any) -> Any:
    """Tensor ``t`` of the owner's cache: the same in both processes."""
    n = SLOTS * SLOT_SHAPE[0] * SLOT_SHAPE[1]
    vals = (torch.arange(n, device=device) * (t + 3) % 251).to(torch.float16)
    return vals.reshape(SLOTS, *SLOT_SHAPE)


def serve(torch: Any, device: int, port: int) -> int:
    """The owner (a process of its own, as in production: UCX moves VRAM between processes):
    serves its CUDA cache by NIXL until its stdin closes."""
    dev = torch.device("cuda", device)
    src = [pattern(torch, t, dev) for t in range(TENSORS)]
    torch.cuda.synchronize()
    owner = instance(llm_datadist.LLMRole.PROMPT, OWNER, port, nixl_serve=True,
                     nixl_allow_whole_process_access=True)
    try:
        cache = register(owner, src, llm_datadist.Placement.DEVICE)
        print(f"CACHE {cache.cache_id}", flush=True)
        print("READY", flush=True)
        sys.stdin.read()  # the decoder's checks; its link made our agent meanwhile
        theirs = {r[0]: r for r in regions(owner)}
        ok = check(all(theirs.get(t.data_ptr(), (0, 0, 0, -1))[2:] == (VRAM, device) for t in src),
                   f"the owner registered its CUDA tensors as VRAM of device {device}: "
                   f"{sorted(theirs.values())}")
    finally:
        owner.finalize()
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", type=int, default=0, help="CUDA device (default 0)")
    ap.add_argument("--serve", type=int, default=0, help=argparse.SUPPRESS)  # the owner's port
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: run this on a GPU host", file=sys.stderr)
        return 2
    torch.cuda.set_device(args.device)
    if args.serve:
        return serve(torch, args.device, args.serve)
    dev = torch.device("cuda", args.device)
    shape = (SLOTS, *SLOT_SHAPE)
    want = [pattern(torch, t, dev) for t in range(TENSORS)]
    dst = [torch.zeros(shape, dtype=torch.float16, device=dev) for _ in range(TENSORS)]
    host = [np.zeros(shape, np.float16) for _ in range(TENSORS)]
    torch.cuda.synchronize()

    port, mine_port = free_port(), free_port()
    owner = subprocess.Popen([sys.executable, __file__, "--device", str(args.device),
                              "--serve", str(port)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    assert owner.stdin is not None and owner.stdout is not None
    cache_id = -1
    for line in owner.stdout:
        print(f"owner: {line.rstrip()}", flush=True)
        if line.startswith("CACHE "):
            cache_id = int(line.split()[1])
        if line.startswith("READY"):
            break
    decoder = instance(llm_datadist.LLMRole.DECODER, DECODER, mine_port, transport="nixl",
                       nixl_allow_whole_process_access=True)
    ok = cache_id >= 0
    try:
        into_gpu = register(decoder, dst, llm_datadist.Placement.DEVICE)
        into_host = register(decoder, host, llm_datadist.Placement.HOST)
        info = llm_datadist.LLMClusterInfo()
        info.remote_cluster_id = OWNER
        info.append_local_ip_info("127.0.0.1", mine_port)
        info.append_remote_ip_info("127.0.0.1", port)
        code, _ = decoder.link_clusters([info], 5000)
        ok &= check(code == llm_datadist.LLMStatusCode.LLM_SUCCESS, f"link_clusters -> {code}")
        link = decoder.engine.get_link(OWNER)
        ok &= check(link.path_name == "nixl",
                    f"the link's path is {link.path_name} ({link.reason})")
        mine = {r[0]: r for r in regions(decoder)}
        ok &= check(all(mine.get(t.data_ptr(), (0, 0, 0, -1))[2:] == (VRAM, args.device)
                        for t in dst), "the decoder registered its CUDA tensors as VRAM")
        ok &= check(all(mine.get(int(h.ctypes.data), (0, 0, -1, -1))[2] == 0 for h in host),
                    "the decoder's host cache is DRAM")
        for rnd in range(3):  # a grant, then under a whole-cache lease
            slot = 2 + rnd
            for t in dst:
                t.zero_()
            torch.cuda.synchronize()
            key = llm_datadist.CacheKeyByIdAndIndex(OWNER, cache_id, slot)
            decoder.cache_manager.pull_cache(key, into_gpu, batch_index=slot)
            torch.cuda.synchronize()
            ok &= check(all(torch.equal(d[slot], w[slot]) for d, w in zip(dst, want, strict=True)),
                        f"pull {rnd + 1}: VRAM -> VRAM, slot {slot}, bytes equal")
            ok &= check(all(not d[slot - 1].any() for d in dst),
                        f"pull {rnd + 1}: nothing else written")
        key = llm_datadist.CacheKeyByIdAndIndex(OWNER, cache_id, 5)
        decoder.cache_manager.pull_cache(key, into_host, batch_index=5)
        same = [np.array_equal(h[5], w[5].cpu().numpy()) for h, w in zip(host, want, strict=True)]
        ok &= check(all(same), "VRAM -> DRAM, bytes equal")
    finally:
        decoder.finalize()
        owner.stdin.close()
        for line in owner.stdout:
            print(f"owner: {line.rstrip()}", flush=True)
        ok &= owner.wait(timeout=60) == 0
    print("all checks passed" if ok else "SOME CHECKS FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
