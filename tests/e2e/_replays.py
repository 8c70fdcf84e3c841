"""The two (or three) processes of each replay in test_replays.py.

Every function here is one process of a real llm_datadist client, replayed call for call
with datadist imported as llm_datadist: the official samples of hicann/hixl
(examples/python/*.py) and the real connectors (vllm-ascend's LLMDataDistCMgrConnector and
V0 LLMDataDistConnector, MindIE-LLM's SeparateDeploymentWorker). Only what needs an NPU is
replaced: device tensors are page-aligned numpy buffers (their addresses stand in for
``tensor.data_ptr()``), ``torch.distributed`` barriers are a multiprocessing barrier,
``hccn_tool`` device IPs are loopback addresses, and fixed ports (26000) are free ports.
Sizes are scaled down where the sample used megabytes.

Each function runs in a fresh interpreter (``datadist.testing.procs.Peer``); it returns the
bytes its buffers hold at the points the test checks, and the test compares every byte
against what the peer's seeded pattern says must be there.
"""

from __future__ import annotations

import json
import math
import threading
import time
from typing import Any

import numpy as np

ALIGN = 2 << 20  # vllm-ascend asserts 2 MiB-aligned KV cache addresses
_KEEP: list[np.ndarray] = []


def buffer(shape: tuple[int, ...], dtype: Any, seed: int | None = None) -> np.ndarray:
    """A zeroed (or seeded, see :func:`pattern`) buffer at a 2 MiB-aligned address."""
    n = math.prod(shape) * np.dtype(dtype).itemsize
    raw = np.zeros(n + ALIGN, np.uint8)
    _KEEP.append(raw)
    off = (-raw.ctypes.data) % ALIGN
    out = raw[off:off + n].view(dtype).reshape(shape)
    if seed is not None:
        out.view(np.uint8).reshape(-1)[:] = pattern(n, seed)
    return out


def pattern(nbytes: int, seed: int) -> np.ndarray:
    """The seeded bytes a buffer starts with; the test recomputes them to check."""
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def addr(a: np.ndarray) -> int:
    return int(a.ctypes.data)


def raw_bytes(address: int, nbytes: int) -> np.ndarray:
    """A copy of ``nbytes`` at ``address`` (a cache datadist allocated)."""
    import ctypes

    return np.frombuffer((ctypes.c_char * nbytes).from_address(address), np.uint8).copy()


def ok(ret: Any, what: str) -> None:
    """The samples' ``if ret != LLMStatusCode.LLM_SUCCESS: raise Exception(...)``."""
    import datadist as llm_datadist

    if ret != llm_datadist.LLMStatusCode.LLM_SUCCESS:
        raise Exception(f"{what} failed: {ret}")


# ============================================================ hixl examples/python/switch_role

SR_BLOCKS, SR_KV = 3, 10


def switch_role_prompt(link: Any, setup: dict, barrier: Any) -> dict:
    from datadist import (
        BlocksCacheKey,
        CacheDesc,
        DataType,
        LLMClusterInfo,
        LLMConfig,
        LLMDataDist,
        LLMRole,
        Placement,
    )

    ip, port = setup["ip"], setup["prompt_port"]
    datadist = LLMDataDist(LLMRole.PROMPT, 0)
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.local_comm_res = ""
    cfg.listen_ip_info = f"{ip}:{port}"
    datadist.init(cfg.generate_options())
    cache_manager = datadist.cache_manager
    desc = CacheDesc(num_tensors=2, shape=[SR_BLOCKS, SR_KV], data_type=DataType.DT_FLOAT,
                     placement=Placement.DEVICE)
    tensor = buffer((SR_BLOCKS, SR_KV), np.float32, seed=1)
    tensor2 = buffer((SR_BLOCKS, SR_KV), np.float32, seed=2)
    cache = cache_manager.register_blocks_cache(desc, [addr(tensor), addr(tensor2)],
                                                BlocksCacheKey(0, 0))
    barrier.wait()  # register end
    barrier.wait()  # decoder unlink
    datadist.switch_role(LLMRole.DECODER)
    barrier.wait()  # prompt switch role end, close listen
    barrier.wait()  # decoder switch role end, listen
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = 1
    cluster.append_local_ip_info(ip, port)
    cluster.append_remote_ip_info(ip, setup["decoder_port"])
    ret, _ = datadist.link_clusters([cluster], 5000)
    ok(ret, "link")
    barrier.wait()  # prompt link end
    barrier.wait()  # decoder push blocks end
    after_push = [tensor.copy(), tensor2.copy()]
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = 1
    ret, _ = datadist.unlink_clusters([cluster], 5000, force=True)
    ok(ret, "unlink")
    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()
    return {"after_push": after_push}


def switch_role_decoder(link: Any, setup: dict, barrier: Any) -> dict:
    from datadist import (
        BlocksCacheKey,
        CacheDesc,
        DataType,
        LLMClusterInfo,
        LLMConfig,
        LLMDataDist,
        LLMRole,
        Placement,
    )

    ip = setup["ip"]
    datadist = LLMDataDist(LLMRole.DECODER, 1)
    cfg = LLMConfig()
    cfg.device_id = 1
    cfg.local_comm_res = ""
    datadist.init(cfg.generate_options())
    cache_manager = datadist.cache_manager
    desc = CacheDesc(num_tensors=2, shape=[SR_BLOCKS, SR_KV], data_type=DataType.DT_FLOAT,
                     placement=Placement.DEVICE)
    tensor = buffer((SR_BLOCKS, SR_KV), np.float32)
    tensor2 = buffer((SR_BLOCKS, SR_KV), np.float32)
    cache = cache_manager.register_blocks_cache(desc, [addr(tensor), addr(tensor2)],
                                                BlocksCacheKey(1, 0))
    barrier.wait()  # register end
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = 0
    cluster.append_local_ip_info(ip, setup["decoder_port"])
    cluster.append_remote_ip_info(ip, setup["prompt_port"])
    ret, _ = datadist.link_clusters([cluster], 5000)
    ok(ret, "link")
    cache_manager.pull_blocks(BlocksCacheKey(0, 0), cache, src_blocks=[0, 1],
                              dst_blocks=[0, 2])
    after_pull = [tensor.copy(), tensor2.copy()]
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = 0
    cluster.append_remote_ip_info(ip, setup["prompt_port"])
    ret, _ = datadist.unlink_clusters([cluster], 5000)
    ok(ret, "unlink")
    barrier.wait()  # decoder unlink
    barrier.wait()  # prompt switch role end, close listen
    cfg = LLMConfig()
    cfg.listen_ip_info = f"{ip}:{setup['decoder_port']}"
    datadist.switch_role(LLMRole.PROMPT, cfg.generate_options())
    barrier.wait()  # decoder switch role end, listen
    barrier.wait()  # prompt link end
    cache_manager.push_blocks(BlocksCacheKey(0, 0), cache, src_blocks=[0, 1, 2],
                              dst_blocks=[0, 1, 2], src_layer_range=range(0, 2),
                              dst_layer_range=range(0, 2), tensor_num_per_layer=1)
    barrier.wait()  # decoder push blocks end
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = 0
    ret, _ = datadist.unlink_clusters([cluster], 5000, force=True)
    ok(ret, "unlink")
    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()
    return {"after_pull": after_pull}


# ============================================================ hixl examples/python/push_blocks

def push_blocks_prompt(link: Any, setup: dict, barrier: Any) -> dict:
    from datadist import (
        BlocksCacheKey,
        CacheDesc,
        DataType,
        LLMClusterInfo,
        LLMConfig,
        LLMDataDist,
        LLMRole,
        Placement,
    )

    datadist = LLMDataDist(LLMRole.PROMPT, 0)
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.local_comm_res = ""
    cfg.listen_ip_info = f"{setup['ip']}:{setup['prompt_port']}"
    datadist.init(cfg.generate_options())
    cache_manager = datadist.cache_manager
    desc = CacheDesc(num_tensors=2, shape=[SR_BLOCKS, SR_KV], data_type=DataType.DT_FLOAT,
                     placement=Placement.DEVICE)
    tensor = buffer((SR_BLOCKS, SR_KV), np.float32, seed=1)
    tensor2 = buffer((SR_BLOCKS, SR_KV), np.float32, seed=2)
    cache = cache_manager.register_blocks_cache(desc, [addr(tensor), addr(tensor2)],
                                                BlocksCacheKey(0, 0))
    barrier.wait()  # register end
    barrier.wait()  # decoder push blocks end
    after_push = [tensor.copy(), tensor2.copy()]
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = 1
    ret, _ = datadist.unlink_clusters([cluster], 5000, force=True)
    ok(ret, "unlink")  # the listening end unlinks its own end of the decoder's link
    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()
    return {"after_push": after_push}


def push_blocks_decoder(link: Any, setup: dict, barrier: Any) -> dict:
    from datadist import (
        BlocksCacheKey,
        CacheDesc,
        DataType,
        LLMClusterInfo,
        LLMConfig,
        LLMDataDist,
        LLMRole,
        Placement,
    )

    ip = setup["ip"]
    datadist = LLMDataDist(LLMRole.DECODER, 1)
    cfg = LLMConfig()
    cfg.device_id = 1
    cfg.local_comm_res = ""
    cfg.listen_ip_info = f"{ip}:{setup['decoder_port']}"
    datadist.init(cfg.generate_options())
    cache_manager = datadist.cache_manager
    desc = CacheDesc(num_tensors=2, shape=[SR_BLOCKS, SR_KV], data_type=DataType.DT_FLOAT,
                     placement=Placement.DEVICE)
    tensor = buffer((SR_BLOCKS, SR_KV), np.float32, seed=3)
    tensor2 = buffer((SR_BLOCKS, SR_KV), np.float32, seed=4)
    cache = cache_manager.register_blocks_cache(desc, [addr(tensor), addr(tensor2)],
                                                BlocksCacheKey(1, 0))
    barrier.wait()  # register end
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = 0
    cluster.append_local_ip_info(ip, setup["decoder_port"])
    cluster.append_remote_ip_info(ip, setup["prompt_port"])
    ret, _ = datadist.link_clusters([cluster], 5000)
    ok(ret, "link")
    cache_manager.push_blocks(BlocksCacheKey(0, 0), cache, src_blocks=[0, 1], dst_blocks=[0, 2])
    barrier.wait()  # push_blocks end
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = 0
    ret, _ = datadist.unlink_clusters([cluster], 5000, force=True)
    ok(ret, "unlink")
    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()
    return {}


# ================================================== hixl examples/python/transfer_cache_async

def transfer_async_prompt(link: Any, setup: dict, barrier: Any) -> dict:
    from datadist import (
        BlocksCacheKey,
        CacheDesc,
        DataType,
        LayerSynchronizer,
        LLMClusterInfo,
        LLMConfig,
        LLMDataDist,
        LLMRole,
        Placement,
        TransferWithCacheKeyConfig,
    )

    class LayerSynchronizerImpl(LayerSynchronizer):
        def __init__(self, ret=True):
            self._ret = ret

        def synchronize_layer(self, layer_index, timeout_in_millis):
            return self._ret

    ip = setup["ip"]
    datadist = LLMDataDist(LLMRole.PROMPT, 0)
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.listen_ip_info = f"{ip}:{setup['prompt_port']}"
    cfg.enable_cache_manager = True
    cfg.enable_remote_cache_accessible = True
    datadist.init(cfg.generate_options())
    cache_manager = datadist.cache_manager
    desc = CacheDesc(num_tensors=2, shape=[SR_BLOCKS, SR_KV], data_type=DataType.DT_FLOAT,
                     placement=Placement.DEVICE)
    tensor = buffer((SR_BLOCKS, SR_KV), np.float32, seed=1)
    tensor2 = buffer((SR_BLOCKS, SR_KV), np.float32, seed=2)
    cache = cache_manager.register_blocks_cache(desc, [addr(tensor), addr(tensor2)],
                                                BlocksCacheKey(0, 0))
    barrier.wait()  # register end
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = 1
    cluster.append_local_ip_info(ip, setup["prompt_port"])
    cluster.append_remote_ip_info(ip, setup["decoder_port"])
    ret, _ = datadist.link_clusters([cluster], 5000)
    ok(ret, "link")
    transfer_config = TransferWithCacheKeyConfig(BlocksCacheKey(1, 0), range(0, 1), range(0, 1))
    cache_task = cache_manager.transfer_cache_async(cache, LayerSynchronizerImpl(True),
                                                    [transfer_config])
    results = cache_task.get_results()
    barrier.wait()  # transfer cache end
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = 1
    ret, _ = datadist.unlink_clusters([cluster], 5000, force=True)
    ok(ret, "unlink")
    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()
    return {"results": [int(r) for r in results]}


def transfer_async_decoder(link: Any, setup: dict, barrier: Any) -> dict:
    from datadist import (
        BlocksCacheKey,
        CacheDesc,
        DataType,
        LLMClusterInfo,
        LLMConfig,
        LLMDataDist,
        LLMRole,
        Placement,
    )

    datadist = LLMDataDist(LLMRole.DECODER, 1)
    cfg = LLMConfig()
    cfg.device_id = 1
    cfg.listen_ip_info = f"{setup['ip']}:{setup['decoder_port']}"
    cfg.enable_cache_manager = True
    cfg.enable_remote_cache_accessible = True
    datadist.init(cfg.generate_options())
    cache_manager = datadist.cache_manager
    desc = CacheDesc(num_tensors=2, shape=[SR_BLOCKS, SR_KV], data_type=DataType.DT_FLOAT,
                     placement=Placement.DEVICE)
    tensor = buffer((SR_BLOCKS, SR_KV), np.float32)
    tensor2 = buffer((SR_BLOCKS, SR_KV), np.float32)
    cache = cache_manager.register_blocks_cache(desc, [addr(tensor), addr(tensor2)],
                                                BlocksCacheKey(1, 0))
    barrier.wait()  # register end
    barrier.wait()  # prompt transfer cache end
    after = [tensor.copy(), tensor2.copy()]
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = 0
    ret, _ = datadist.unlink_clusters([cluster], 5000, force=True)
    ok(ret, "unlink")  # the linked-to end tears down its own end
    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()
    return {"after": after}


# ============================================== hixl examples/python/hixl_transfer_backend_sample


def _hixl_side(setup: dict, me: str, barrier: Any) -> tuple[Any, Any, Any, list[np.ndarray]]:
    """The sample's init_llm_datadist and registration: transfer_backend "hixl", a listen
    address on each side, two DEVICE tensors of [3, 10] floats under BlocksCacheKey(me, 0)."""
    from datadist import (
        BlocksCacheKey,
        CacheDesc,
        DataType,
        LLMConfig,
        LLMDataDist,
        LLMRole,
        Placement,
    )

    cluster_id = 0 if me == "prompt" else 1
    datadist = LLMDataDist(LLMRole.PROMPT if me == "prompt" else LLMRole.DECODER, cluster_id)
    cfg = LLMConfig()
    cfg.device_id = cluster_id
    cfg.local_comm_res = ""
    cfg.transfer_backend = "hixl"
    cfg.listen_ip_info = f"{setup['ip']}:{setup[me + '_port']}"
    datadist.init(cfg.generate_options())
    cache_manager = datadist.cache_manager
    desc = CacheDesc(num_tensors=2, shape=[SR_BLOCKS, SR_KV], data_type=DataType.DT_FLOAT,
                     placement=Placement.DEVICE)
    seeds = (1, 2) if me == "prompt" else (3, 4)
    tensors = [buffer((SR_BLOCKS, SR_KV), np.float32, seed=s) for s in seeds]
    cache = cache_manager.register_blocks_cache(desc, [addr(t) for t in tensors],
                                                BlocksCacheKey(cluster_id, 0))
    barrier.wait()  # register end
    return datadist, cache_manager, cache, tensors


def _hixl_link(datadist: Any, setup: dict, me: str, peer: str) -> None:
    from datadist import LLMClusterInfo

    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = 0 if peer == "prompt" else 1
    cluster.append_local_ip_info(setup["ip"], setup[me + "_port"])
    cluster.append_remote_ip_info(setup["ip"], setup[peer + "_port"])
    ret, _ = datadist.link_clusters([cluster], 5000)
    ok(ret, "link")


def _hixl_unlink(datadist: Any, remote_cluster_id: int) -> None:
    """The sample's unlink: remote_cluster_id alone, no ip info, no force."""
    from datadist import LLMClusterInfo

    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = remote_cluster_id
    ret, _ = datadist.unlink_clusters([cluster], 5000)
    ok(ret, "unlink")


def hixl_backend_prompt(link: Any, setup: dict, barrier: Any) -> dict:
    from datadist import BlocksCacheKey

    datadist, cache_manager, cache, tensors = _hixl_side(setup, "prompt", barrier)
    _hixl_link(datadist, setup, "prompt", "decoder")
    cache_manager.pull_blocks(BlocksCacheKey(1, 0), cache, src_blocks=[2], dst_blocks=[2])
    barrier.wait()  # the decoder's push is done
    after = [t.copy() for t in tensors]
    _hixl_unlink(datadist, 1)
    barrier.wait()  # wait peer unlink end
    still_linked = datadist.engine.has_links()
    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()
    return {"after": after, "still_linked": still_linked}


def hixl_backend_decoder(link: Any, setup: dict, barrier: Any) -> dict:
    from datadist import BlocksCacheKey

    datadist, cache_manager, cache, _ = _hixl_side(setup, "decoder", barrier)
    _hixl_link(datadist, setup, "decoder", "prompt")
    cache_manager.push_blocks(BlocksCacheKey(0, 0), cache, src_blocks=[0, 1], dst_blocks=[0, 1])
    barrier.wait()  # push_blocks end
    _hixl_unlink(datadist, 0)
    barrier.wait()  # wait peer unlink end
    still_linked = datadist.engine.has_links()
    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()
    return {"still_linked": still_linked}


# ============================================ pull_cache / pull_blocks samples (two-sided link)

def rank_table_two_devices(setup: dict) -> str:
    """The samples' single-machine table: one server, two devices (ids from /dev/davinci*,
    IPs from hccn_tool; here the device ids the test chose and one shared IP)."""
    devices = [{"device_id": str(setup["device_ids"][r]), "device_ip": setup["ip"],
                "rank_id": str(r)} for r in range(2)]
    return json.dumps({"server_count": "1", "status": "completed", "version": "1.2",
                       "server_list": [{"device": devices, "host_ip": setup["ip"],
                                        "server_id": "1"}]})


def sample_link(datadist: Any, setup: dict) -> int:
    from datadist import RegisterMemStatus

    comm_id = datadist.link("link", {1: 0, 2: 1}, rank_table_two_devices(setup))
    while True:
        ret = datadist.query_register_mem_status(comm_id)
        if ret == RegisterMemStatus.OK:
            break
        elif ret == RegisterMemStatus.FAILED:
            raise RuntimeError("link failed")
        time.sleep(1)
    return comm_id


PC_SHAPE = [2, 4096]  # the sample's [2, 1024 * 1024], scaled down


def pull_cache_prompt(link: Any, setup: dict, barrier: Any) -> dict:
    from datadist import CacheDesc, CacheKey, DataType, LLMConfig, LLMDataDist, LLMRole, Placement

    datadist = LLMDataDist(LLMRole.PROMPT, 1)
    cfg = LLMConfig()
    cfg.device_id = setup["device_ids"][0]
    cfg.enable_cache_manager = True
    cfg.mem_pool_cfg = '{"memory_size": 67108864}'
    datadist.init(cfg.generate_options())
    comm_id = sample_link(datadist, setup)
    cache_manager = datadist.cache_manager
    desc = CacheDesc(num_tensors=4, shape=PC_SHAPE, data_type=DataType.DT_FLOAT16,
                     placement=Placement.DEVICE)
    key0 = CacheKey(prompt_cluster_id=1, req_id=0, model_id=0)
    key1 = CacheKey(prompt_cluster_id=1, req_id=1, model_id=0)
    cache = cache_manager.allocate_cache(desc, [key0, key1])
    nbytes = math.prod(PC_SHAPE) * 2
    import ctypes

    for i, a in enumerate(cache.tensor_addrs):  # the sample fills tensors[0] with 1
        src = pattern(nbytes, 10 + i)
        ctypes.memmove(a, src.ctypes.data, nbytes)
    barrier.wait()  # prompt prepared (the sample's sleep)
    barrier.wait()  # decoder pulled
    cache_manager.remove_cache_key(key0)  # a no-op after a successful pull
    cache_manager.remove_cache_key(key1)
    cache_manager.deallocate_cache(cache)
    datadist.unlink(comm_id)
    datadist.finalize()
    return {}


def pull_cache_decoder(link: Any, setup: dict, barrier: Any) -> dict:
    from datadist import CacheDesc, CacheKey, DataType, LLMConfig, LLMDataDist, LLMRole, Placement

    datadist = LLMDataDist(LLMRole.DECODER, 2)
    cfg = LLMConfig()
    cfg.device_id = setup["device_ids"][1]
    cfg.enable_cache_manager = True
    cfg.mem_pool_cfg = '{"memory_size": 67108864}'
    datadist.init(cfg.generate_options())
    comm_id = sample_link(datadist, setup)
    cache_manager = datadist.cache_manager
    desc = CacheDesc(num_tensors=4, shape=PC_SHAPE, data_type=DataType.DT_FLOAT16,
                     placement=Placement.DEVICE)
    cache = cache_manager.allocate_cache(desc)
    barrier.wait()  # prompt prepared
    cache_manager.pull_cache(CacheKey(prompt_cluster_id=1, req_id=0, model_id=0), cache,
                             batch_index=0)
    cache_manager.pull_cache(CacheKey(prompt_cluster_id=1, req_id=1, model_id=0), cache,
                             batch_index=1)
    nbytes = math.prod(PC_SHAPE) * 2
    got = [raw_bytes(a, nbytes) for a in cache.tensor_addrs]
    barrier.wait()  # decoder pulled
    cache_manager.deallocate_cache(cache)
    datadist.unlink(comm_id)
    datadist.finalize()
    return {"tensors": got}


def pull_blocks_prompt(link: Any, setup: dict, barrier: Any) -> dict:
    from datadist import (
        BlocksCacheKey,
        CacheDesc,
        DataType,
        LLMConfig,
        LLMDataDist,
        LLMRole,
        Placement,
    )

    datadist = LLMDataDist(LLMRole.PROMPT, 1)
    cfg = LLMConfig()
    cfg.device_id = setup["device_ids"][0]
    cfg.enable_cache_manager = True
    datadist.init(cfg.generate_options())
    cache_manager = datadist.cache_manager
    desc = CacheDesc(num_tensors=1, shape=PC_SHAPE, data_type=DataType.DT_FLOAT,
                     placement=Placement.DEVICE)
    tensor = buffer(tuple(PC_SHAPE), np.float32, seed=20)
    cache_manager.register_blocks_cache(desc, [addr(tensor)], BlocksCacheKey(1, 0))
    comm_id = sample_link(datadist, setup)
    barrier.wait()  # the sample's 30 s wait: the decoder pulls and swaps meanwhile
    datadist.unlink(comm_id)
    datadist.finalize()
    return {}


def pull_blocks_decoder(link: Any, setup: dict, barrier: Any) -> dict:
    from datadist import (
        BlocksCacheKey,
        Cache,
        CacheDesc,
        DataType,
        LLMConfig,
        LLMDataDist,
        LLMRole,
        Placement,
    )

    datadist = LLMDataDist(LLMRole.DECODER, 2)
    cfg = LLMConfig()
    cfg.device_id = setup["device_ids"][1]
    cfg.enable_cache_manager = True
    datadist.init(cfg.generate_options())
    cache_manager = datadist.cache_manager
    desc = CacheDesc(num_tensors=1, shape=PC_SHAPE, data_type=DataType.DT_FLOAT,
                     placement=Placement.DEVICE)
    tensor = buffer(tuple(PC_SHAPE), np.float32, seed=21)  # the sample: torch.ones
    cache = cache_manager.register_blocks_cache(desc, [addr(tensor)])
    comm_id = sample_link(datadist, setup)
    cache_manager.pull_blocks(BlocksCacheKey(1, 0), cache, src_blocks=[0, 1], dst_blocks=[0, 1])
    after_pull = tensor.copy()
    # swap blocks through a CPU cache (the sample's _allocate_cpu_cache with torch.rand)
    cpu_tensor = buffer(tuple(PC_SHAPE), np.float32, seed=22)
    cpu_desc = CacheDesc(num_tensors=1, shape=PC_SHAPE, data_type=DataType.DT_FLOAT,
                         placement=Placement.HOST)
    cpu_cache = Cache.create_cpu_cache(cpu_desc, [addr(cpu_tensor)])
    cache_manager.swap_blocks(cache, cpu_cache, {0: 0, 1: 1})  # swap out
    after_swap_out = cpu_tensor.copy()
    tensor[...] = 0
    cache_manager.swap_blocks(cpu_cache, cache, {0: 0, 1: 1})  # swap in
    after_swap_in = tensor.copy()
    barrier.wait()
    datadist.unlink(comm_id)
    datadist.finalize()
    return {"after_pull": after_pull, "after_swap_out": after_swap_out,
            "after_swap_in": after_swap_in}


# ============================================ vllm-ascend V0 LLMDataDistConnector (legacy mode)

V0_TOKENS, V0_HEADS, V0_HEAD, V0_LAYERS, V0_HIDDEN = 5, 2, 8, 3, 16


def _v0_descs(llm_datadist: Any, seq_dim: int) -> list:
    kv_shape = (1, V0_TOKENS, V0_HEADS, V0_HEAD)
    return [
        llm_datadist.CacheDesc(V0_LAYERS, kv_shape, llm_datadist.DataType.DT_FLOAT16,
                               seq_len_dim_index=seq_dim),
        llm_datadist.CacheDesc(V0_LAYERS, kv_shape, llm_datadist.DataType.DT_FLOAT16,
                               seq_len_dim_index=seq_dim),
        llm_datadist.CacheDesc(1, (1, V0_TOKENS, 1, 1), llm_datadist.DataType.DT_INT32,
                               seq_len_dim_index=-1),
        llm_datadist.CacheDesc(1, (1, V0_TOKENS, 1, V0_HIDDEN), llm_datadist.DataType.DT_FLOAT16,
                               seq_len_dim_index=-1),
    ]


def v0_prompt(link: Any, setup: dict, barrier: Any) -> dict:
    import ctypes

    import datadist as llm_datadist

    local_rank = 0
    cluster_id = local_rank  # KVTransferEngine: self.cluster_id = local_rank
    data_dist = llm_datadist.LLMDataDist(llm_datadist.LLMRole.PROMPT, cluster_id)
    options = {"llm.SyncKvCacheWaitTime": "5000", "ge.exec.deviceId": str(local_rank),
               "llm.listenIpInfo": f"{setup['ip']}:{setup['prompt_port']}"}
    data_dist.init(options)
    barrier.wait()  # the prefill instance is up before the decoder starts (deployment order)
    kv_transfer = data_dist.kv_cache_manager
    buffers = []
    for model_id, desc in enumerate(_v0_descs(llm_datadist, 1), start=1):
        keys = [llm_datadist.CacheKey(cluster_id, 0, model_id)]
        buffers.append(kv_transfer.allocate_cache(desc, keys))
    for i, buf in enumerate(buffers):  # scatter_update_ into the buffers
        base = buf.per_device_tensor_addrs[0]
        n = buf.cache_desc.size
        for t, a in enumerate(base):
            src = pattern(n, 100 + 10 * i + t)
            ctypes.memmove(a, src.ctypes.data, n)
    barrier.wait()  # KV send DONE
    barrier.wait()  # the decoder pulled and closed
    data_dist.finalize()
    return {"cache_ids": [b.cache_id for b in buffers]}


def v0_decoder(link: Any, setup: dict, barrier: Any) -> dict:
    import datadist as llm_datadist

    local_rank = 0
    cluster_id = local_rank
    data_dist = llm_datadist.LLMDataDist(llm_datadist.LLMRole.DECODER, cluster_id)
    data_dist.init({"llm.SyncKvCacheWaitTime": "5000", "ge.exec.deviceId": str(local_rank)})
    kv_transfer = data_dist.kv_cache_manager
    cluster = llm_datadist.LLMClusterInfo()
    cluster.remote_cluster_id = cluster_id  # make_cluster(prefill_ip, self.cluster_id)
    cluster.append_local_ip_info(setup["ip"], 0)
    cluster.append_remote_ip_info(setup["ip"], setup["prompt_port"])
    barrier.wait()  # the prefill instance is up
    _, ret = data_dist.link_clusters([cluster], 20000)
    barrier.wait()  # KV send DONE
    buffers = [kv_transfer.allocate_cache(desc) for desc in _v0_descs(llm_datadist, -1)]
    for cache_id, buf in enumerate(buffers, start=1):
        key = llm_datadist.CacheKeyByIdAndIndex(cluster.remote_cluster_id, cache_id, 0)
        kv_transfer.pull_cache(key, buf, 0)
    got = [[raw_bytes(a, buf.cache_desc.size) for a in buf.per_device_tensor_addrs[0]]
           for buf in buffers]
    overall, codes = data_dist.unlink_clusters([cluster], 5000)  # close()
    barrier.wait()
    data_dist.finalize()
    return {"link": [int(c) for c in ret], "unlink": [int(overall), *map(int, codes)],
            "tensors": got}


# ================================== vllm-ascend LLMDataDistCMgrConnector (MHA, one host)

CM_LAYERS, CM_BLOCKS, CM_BLOCK = 2, 8, (4, 2, 8)  # 2 layers, 8 blocks of 4 tokens x 2 x 8


def _cmgr_worker(setup: dict, role_name: str, barrier: Any) -> tuple:
    import datadist as llm_datadist
    from datadist import BlocksCacheKey, CacheDesc, LLMConfig, LLMDataDist, LLMRole

    me = setup[role_name]
    role = LLMRole.PROMPT if role_name == "prefill" else LLMRole.DECODER
    datadist = LLMDataDist(role, me["cluster_id"])
    cfg = LLMConfig()
    cfg.device_id = me["local_rank"]
    cfg.sync_kv_timeout = 5000
    cfg.enable_switch_role = True
    cfg.enable_cache_manager = True
    cfg.enable_remote_cache_accessible = True
    datadist.init(cfg.generate_options())
    cache_manager = datadist.cache_manager
    seed = 1000 if role_name == "prefill" else None
    kv_caches = {f"layer.{i}": (buffer((CM_BLOCKS, *CM_BLOCK), np.float16,
                                       None if seed is None else seed + 2 * i),
                                buffer((CM_BLOCKS, *CM_BLOCK), np.float16,
                                       None if seed is None else seed + 2 * i + 1))
                 for i in range(CM_LAYERS)}
    cache_addr = []
    for cache_or_caches in kv_caches.values():
        for cache in cache_or_caches:
            base_addr = cache.ctypes.data
            assert base_addr % ALIGN == 0
            cache_addr.append(base_addr)
    cache_desc = CacheDesc(len(cache_addr), [*cache.shape], llm_datadist.DataType.DT_FLOAT16)
    cache_key = BlocksCacheKey(cluster_id=int(me["cluster_id"]))
    registered = cache_manager.register_blocks_cache(cache_desc, cache_addr, cache_key)
    # add_remote_agent, on both sides at about the same time (the prefill side answers the
    # decoder's metadata request first)
    p, d = setup["prefill"], setup["decode"]
    rank_table: dict[str, Any] = {"version": "1.2", "server_count": "1", "status": "completed"}
    devices = [{k: v for k, v in [("device_id", m["device_id"]), ("device_ip", m["device_ip"]),
                                  ("super_device_id", m["super_device_id"]),
                                  ("rank_id", r)] if v is not None}
               for m, r in ((p, "0"), (d, "1"))]
    rank_table["server_list"] = [{"device": devices, "server_id": p["server_id"]}]
    comm_name = f"pd_comm_{p['device_ip']}_{d['device_ip']}"
    barrier.wait()
    comm_id = datadist.link(comm_name, {p["cluster_id"]: 0, d["cluster_id"]: 1},
                            json.dumps(rank_table))
    while True:
        ret = datadist.query_register_mem_status(comm_id=comm_id)
        if ret == llm_datadist.RegisterMemStatus.OK:
            break
        elif ret == llm_datadist.RegisterMemStatus.FAILED:
            raise RuntimeError(f"Linking failed, comm id: {comm_id}")
        time.sleep(1)
    return datadist, cache_manager, registered, kv_caches, comm_id


CM_REMOTE_BLOCKS, CM_LOCAL_BLOCKS = [5, 0, 3], [1, 2, 7]


def cmgr_prefill(link: Any, setup: dict, barrier: Any) -> dict:
    datadist, _, _, _, comm_id = _cmgr_worker(setup, "prefill", barrier)
    barrier.wait()  # the decoder read the blocks (ReqForFinished)
    datadist.unlink(comm_id)  # remove_remote_agent
    datadist.finalize()
    return {}


def cmgr_decode(link: Any, setup: dict, barrier: Any) -> dict:
    from datadist import BlocksCacheKey

    datadist, cache_manager, cache, kv_caches, comm_id = _cmgr_worker(setup, "decode", barrier)
    remote_cache_key = BlocksCacheKey(cluster_id=setup["prefill"]["cluster_id"])
    cache_manager.pull_blocks(remote_cache_key, cache, CM_REMOTE_BLOCKS, CM_LOCAL_BLOCKS)
    got = [t.copy() for pair in kv_caches.values() for t in pair]
    barrier.wait()
    datadist.unlink(comm_id)
    datadist.finalize()
    return {"tensors": got}


# ======================================== MindIE-LLM SeparateDeploymentWorker (decoder + 2 P)

MI_BLOCKS, MI_BLOCK, MI_TENSORS = 6, (4, 16), 2


def _mindie_engine(me: dict, role: Any) -> Any:
    from datadist import LLMConfig, LLMDataDist

    engine = LLMDataDist(role, me["cluster_id"])
    llm_config = LLMConfig()
    llm_config.device_id = me["logic_device_id"]
    llm_config.enable_cache_manager = True
    llm_config.enable_remote_cache_accessible = True
    llm_config.link_total_time = 30
    llm_config.link_retry_count = 80
    llm_config.sync_kv_timeout = 5 * 1000
    engine.init(llm_config.generate_options())
    return engine


def _mindie_caches(engine: Any, me: dict, seed: int | None) -> tuple[dict, dict]:
    from datadist import BlocksCacheKey, CacheDesc, DataType, Placement

    caches, arrays = {}, {}
    for model_id in (0, 1):  # K npu_cache model_id is 0, V npu_cache model_id is 1
        desc = CacheDesc(num_tensors=MI_TENSORS, shape=(MI_BLOCKS, *MI_BLOCK),
                         data_type=DataType.DT_FLOAT16, placement=Placement.DEVICE)
        arrays[model_id] = [buffer((MI_BLOCKS, *MI_BLOCK), np.float16,
                                   None if seed is None else seed + 10 * model_id + t)
                            for t in range(MI_TENSORS)]
        key = BlocksCacheKey(cluster_id=me["cluster_id"], model_id=model_id)
        caches[model_id] = engine.cache_manager.register_blocks_cache(
            desc, [addr(a) for a in arrays[model_id]], key)
    return caches, arrays


def _mindie_rank_info(local: dict, remote: dict) -> tuple[dict, str]:
    """RankInfo.get_cluster_rank_info / get_rank_table for two devices on one server."""
    lo, hi = sorted((local, remote), key=lambda m: tuple(map(int, m["device_ip"].split("."))))
    ranks = {lo["device_ip"]: 0, hi["device_ip"]: 1}
    info = {int(m["cluster_id"]): ranks[m["device_ip"]] for m in (lo, hi)}
    devices = [{"device_id": str(m["physical_device_id"]), "device_ip": m["device_ip"],
                "rank_id": str(ranks[m["device_ip"]])} for m in (local, remote)]
    table = {"server_count": "1", "server_list": [{"device": devices,
                                                   "server_id": str(local["host_ip"])}],
             "status": "completed", "version": "1.0"}
    return info, json.dumps(table)


def _mindie_link(engine: Any, local: dict, remote: dict) -> int:
    import datadist as llm_datadist

    info, table = _mindie_rank_info(local, remote)
    ip1, ip2 = local["device_ip"], remote["device_ip"]
    link_name = f"link{max(ip1, ip2)}:{min(ip1, ip2)}_0:0"
    result = engine.link(link_name, info, table)
    if result == llm_datadist.LLMStatusCode.LLM_ALREADY_LINK:
        raise RuntimeError("already linked")
    for _ in range(3):  # _query_mem_status
        if engine.query_register_mem_status(result) == llm_datadist.RegisterMemStatus.OK:
            return result
        time.sleep(1)
    raise RuntimeError("link not OK")


def mindie_prefill(link: Any, setup: dict, barrier: Any, which: str) -> dict:
    from datadist import LLMRole

    me = setup[which]
    engine = _mindie_engine(me, LLMRole.PROMPT)
    _mindie_caches(engine, me, seed=me["seed"])
    barrier.wait()  # every worker registered
    comm_id = _mindie_link(engine, me, setup["decode"])
    barrier.wait()  # the decoder pulled from every prefill instance
    engine.unlink(comm_id)
    engine.finalize()
    return {}


def mindie_decode(link: Any, setup: dict, barrier: Any) -> dict:
    from datadist import BlocksCacheKey, LLMRole

    me = setup["decode"]
    engine = _mindie_engine(me, LLMRole.DECODER)
    caches, arrays = _mindie_caches(engine, me, seed=None)
    barrier.wait()
    # the fill/process window links to every prefill instance at once (window of 16)
    comm_ids: dict[str, int] = {}
    errors: list[BaseException] = []

    def one(which: str) -> None:
        try:
            comm_ids[which] = _mindie_link(engine, me, setup[which])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(w,)) for w in ("prefill1", "prefill2")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    got = {}
    for which, (src, dst) in (("prefill1", ([0, 1], [4, 5])), ("prefill2", ([2, 5], [0, 1]))):
        for model_id in caches:  # SeparateDeploymentWorker.pull_blocks -> pull_kv per model
            engine.cache_manager.pull_blocks(
                BlocksCacheKey(cluster_id=setup[which]["cluster_id"], model_id=model_id),
                caches[model_id], src, dst)
    for model_id in caches:
        got[model_id] = [a.copy() for a in arrays[model_id]]
    barrier.wait()
    for comm_id in comm_ids.values():
        engine.unlink(comm_id)
    engine.finalize()
    return {"tensors": got}
