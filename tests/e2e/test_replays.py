"""Replays of real llm_datadist code, call for call, as separate processes on this host.

Each test runs the processes of one official sample (hicann/hixl examples/python) or one
real connector (vllm-ascend, MindIE-LLM) from tests/e2e/_replays.py, with datadist in
place of llm_datadist, and checks every byte that moved against the sender's seeded
pattern. Each names the sample or connector, and the rule of the original it depends on.
"""

from __future__ import annotations

import multiprocessing as mp
import socket

import numpy as np
import pytest

from datadist.api.rank_table import DEFAULT_BASE_PORT
from datadist.testing.procs import Peer

from . import _replays as r

pytestmark = pytest.mark.timeout(120)

IP = "127.0.0.1"
ENV = {"DATADIST_TRANSPORT": None}
_SPAWN = mp.get_context("spawn")


def free_port(ip: str = IP) -> int:
    with socket.socket() as s:
        s.bind((ip, 0))
        return int(s.getsockname()[1])


def free_device_ids(n: int, ips: list[str] | None = None) -> list[int]:
    """Device ids d whose default port (16666 + d) is free on the given addresses, so the
    default port rule itself is what the replay uses."""
    ips = ips or [IP] * n
    found: list[int] = []
    for d in range(n, 2000):
        with socket.socket() as s:
            try:
                s.bind((ips[len(found)], DEFAULT_BASE_PORT + d))
            except OSError:
                continue
        found.append(d)
        if len(found) == n:
            return found
    raise RuntimeError("no free default ports")


def run(*roles, timeout: float = 90.0):
    """Start every ``(target, *args)`` as its own process with a shared barrier; return
    their results in order. A failure in any of them fails the test with its traceback."""
    barrier = _SPAWN.Barrier(len(roles), timeout=60)
    peers = [Peer(target, *args[:1], barrier, *args[1:], env=ENV,
                  name=target.__name__) for target, *args in roles]
    try:
        return [p.join(timeout) for p in peers]
    finally:
        for p in peers:
            p.close()


def f32(nbytes_seed: tuple[int, int], shape: tuple[int, ...]) -> np.ndarray:
    n, seed = nbytes_seed
    return r.pattern(n, seed).view(np.float32).reshape(shape)


def same(got: np.ndarray, want: np.ndarray) -> None:
    g = np.ascontiguousarray(got).view(np.uint8)
    w = np.ascontiguousarray(want).view(np.uint8)
    assert g.shape == w.shape and np.array_equal(g, w), \
        f"{int(np.count_nonzero(g != w))} of {g.size} bytes differ"


SR = (r.SR_BLOCKS, r.SR_KV)
SR_N = r.SR_BLOCKS * r.SR_KV * 4


def test_switch_role_sample():
    """hixl examples/python/switch_role_sample.py: the decoder links, pulls, unlinks; both
    switch roles; the prompt (now not listening) links to the decoder, and the decoder,
    the listening side, pushes to it over that inbound link; both unlink with force=True.
    Original rules: a link is usable from both ends; each end unlinks its own; switch_role
    needs no live link (LLM_EXIST_LINK otherwise)."""
    setup = {"ip": IP, "prompt_port": free_port(), "decoder_port": free_port()}
    prompt, decoder = run((r.switch_role_prompt, setup), (r.switch_role_decoder, setup))
    p0, p1 = f32((SR_N, 1), SR), f32((SR_N, 2), SR)
    for got, src in zip(decoder["after_pull"], (p0, p1), strict=True):
        want = np.zeros(SR, np.float32)
        want[[0, 2]] = src[[0, 1]]  # src_blocks=[0, 1] -> dst_blocks=[0, 2]
        same(got, want)
    for got, pulled in zip(prompt["after_push"], decoder["after_pull"], strict=True):
        same(got, pulled)  # all 3 blocks of both tensors pushed back


def test_push_blocks_sample():
    """hixl examples/python/push_blocks_sample.py: the decoder links and pushes; the prompt,
    linked to, unlinks its own end with force=True and must get LLM_SUCCESS."""
    setup = {"ip": IP, "prompt_port": free_port(), "decoder_port": free_port()}
    prompt, _ = run((r.push_blocks_prompt, setup), (r.push_blocks_decoder, setup))
    for got, own, pushed in zip(prompt["after_push"], (f32((SR_N, 1), SR), f32((SR_N, 2), SR)),
                                (f32((SR_N, 3), SR), f32((SR_N, 4), SR)), strict=True):
        want = own.copy()
        want[[0, 2]] = pushed[[0, 1]]
        same(got, want)


def test_transfer_cache_async_sample():
    """hixl examples/python/transfer_cache_async_sample.py: transfer_cache_async from a
    blocks cache with no block indices, TransferWithCacheKeyConfig(BlocksCacheKey(decoder,
    0), range(0, 1), range(0, 1)). Original rule: indices are checked only when given; the
    native side copies cache to cache with a blocks cache's batch being one block
    (layer_wise_transfer_job.cc): block 0 of layer 0's two tensors."""
    setup = {"ip": IP, "prompt_port": free_port(), "decoder_port": free_port()}
    prompt, decoder = run((r.transfer_async_prompt, setup), (r.transfer_async_decoder, setup))
    assert prompt["results"] == [0]
    for got, src in zip(decoder["after"], (f32((SR_N, 1), SR), f32((SR_N, 2), SR)),
                        strict=True):
        want = np.zeros(SR, np.float32)
        want[0] = src[0]
        same(got, want)


def test_hixl_transfer_backend_sample():
    """hixl examples/python/hixl_transfer_backend_sample.py: llm.TransferBackend "hixl",
    each side listens and links to the other; the prompt pulls block 2 from the decoder and
    the decoder pushes blocks 0, 1 to the prompt; then each unlinks with remote_cluster_id
    alone (no ip info, no force) and must get LLM_SUCCESS. Original rule
    (src/llm_datadist/transfer_engine/hixl_transfer_engine.cc, HixlTransferEngine::
    UnlinkCluster): the link of that id is destroyed, no address needed, force ignored; both
    ends end unlinked."""
    setup = {"ip": IP, "prompt_port": free_port(), "decoder_port": free_port()}
    prompt, decoder = run((r.hixl_backend_prompt, setup), (r.hixl_backend_decoder, setup))
    for got, seed in zip(prompt["after"], (3, 4), strict=True):
        same(got, f32((SR_N, seed), SR))  # every block now the decoder's
    assert not prompt["still_linked"] and not decoder["still_linked"]


def test_pull_cache_sample():
    """hixl examples/python/pull_cache_sample.py (single machine): both sides link(...)
    with a v1.2 rank table of two devices and poll query_register_mem_status; the prompt
    allocates with two CacheKeys, the decoder pull_caches each into its batch index, the
    prompt's remove_cache_key afterwards is a no-op. Rule: link returns once both joined;
    the default port of each rank is 16666 + device_id."""
    setup = {"ip": IP, "device_ids": free_device_ids(2)}
    _, decoder = run((r.pull_cache_prompt, setup), (r.pull_cache_decoder, setup))
    n = int(np.prod(r.PC_SHAPE)) * 2
    for i, got in enumerate(decoder["tensors"]):
        same(got, r.pattern(n, 10 + i))


def test_pull_blocks_sample():
    """hixl examples/python/pull_blocks_sample.py (single machine): register_blocks_cache
    (the decoder's without a key), link, pull_blocks, then swap_blocks out to a CPU cache
    and back."""
    setup = {"ip": IP, "device_ids": free_device_ids(2)}
    _, decoder = run((r.pull_blocks_prompt, setup), (r.pull_blocks_decoder, setup))
    n = int(np.prod(r.PC_SHAPE)) * 4
    src = f32((n, 20), tuple(r.PC_SHAPE))
    same(decoder["after_pull"], src)
    same(decoder["after_swap_out"], src)
    same(decoder["after_swap_in"], src)


def test_vllm_ascend_v0_connector():
    """vllm-ascend V0 LLMDataDistConnector (vllm_ascend/distributed/llmdatadist_connector.py):
    legacy mode, cluster id = local rank on *both* sides (0 and 0). The decoder
    link_clusters to the prompt with its own cluster id, pulls the four caches by
    CacheKeyByIdAndIndex(0, 1..4, 0) and unlink_clusters. Original rule: a peer with an
    equal cluster id is linked and pulled from in legacy mode (only cache-manager mode's
    native PullCache refuses the caller's own id)."""
    setup = {"ip": IP, "prompt_port": free_port()}
    prompt, decoder = run((r.v0_prompt, setup), (r.v0_decoder, setup))
    assert prompt["cache_ids"] == [1, 2, 3, 4]
    assert decoder["link"] == [0] and decoder["unlink"] == [0, 0]
    for i, tensors in enumerate(decoder["tensors"]):
        for t, got in enumerate(tensors):
            same(got, r.pattern(got.size, 100 + 10 * i + t))


def test_vllm_ascend_llmdatadist_cmgr_connector():
    """vllm-ascend LLMDataDistCMgrConnector (MHA): both workers register one blocks cache of
    every layer's K and V under BlocksCacheKey(cluster_id), then both add_remote_agent at
    once: link(pd_comm_..., {p: 0, d: 1}, a v1.2 table of device_id/device_ip/rank_id on one
    server and one shared host address), poll until OK; the decoder pull_blocks; both
    unlink. Rules: link blocks until both joined; ports from device_id never collide."""
    ids = free_device_ids(2)
    setup = {"prefill": {"cluster_id": 0, "local_rank": 0, "device_id": str(ids[0]),
                         "device_ip": IP, "super_device_id": None, "server_id": IP},
             "decode": {"cluster_id": 1, "local_rank": 0, "device_id": str(ids[1]),
                        "device_ip": IP, "super_device_id": None, "server_id": IP}}
    _, decode = run((r.cmgr_prefill, setup), (r.cmgr_decode, setup))
    shape = (r.CM_BLOCKS, *r.CM_BLOCK)
    n = int(np.prod(shape)) * 2
    for j, got in enumerate(decode["tensors"]):  # layer-major (K, V) order, as registered
        src = r.pattern(n, 1000 + j).view(np.float16).reshape(shape)
        want = np.zeros(shape, np.float16)
        want[r.CM_LOCAL_BLOCKS] = src[r.CM_REMOTE_BLOCKS]
        same(got, want)


def test_mindie_separate_deployment_worker():
    """MindIE-LLM SeparateDeploymentWorker (separate_deployment_engine.py): K and V blocks
    caches (model_id 0 and 1), a v1.0 table of two devices on one server with ranks by
    device IP, and a decoder that links to two prefill instances *at once* (its link
    window). Original rule: links inside one process are serialised
    (CommLinkManager::Link holds a process lock), so the two never race for the decoder's
    member address."""
    ips = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
    ids = free_device_ids(3, ips)
    setup = {
        name: {"cluster_id": 10 + k, "logic_device_id": ids[k], "physical_device_id": ids[k],
               "device_ip": ips[k], "host_ip": IP, "seed": 5000 + 1000 * k}
        for k, name in enumerate(("decode", "prefill1", "prefill2"))
    }
    decode, _, _ = run((r.mindie_decode, setup), (r.mindie_prefill, setup, "prefill1"),
                       (r.mindie_prefill, setup, "prefill2"))
    shape = (r.MI_BLOCKS, *r.MI_BLOCK)
    n = int(np.prod(shape)) * 2
    for model_id in (0, 1):
        for t, got in enumerate(decode["tensors"][model_id]):
            want = np.zeros(shape, np.float16)
            for which, src_blocks, dst_blocks in (("prefill1", [0, 1], [4, 5]),
                                                  ("prefill2", [2, 5], [0, 1])):
                src = r.pattern(n, setup[which]["seed"] + 10 * model_id + t)
                want[dst_blocks] = src.view(np.float16).reshape(shape)[src_blocks]
            same(got, want)
