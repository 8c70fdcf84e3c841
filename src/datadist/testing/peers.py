"""A PROMPT peer for tests, driven over a pipe, using only the public ``llm_datadist`` API.

Who calls: tests and examples that need a real prompt process. Start it with
``Peer(prompt_main, PromptConfig(...))`` (see :mod:`datadist.testing.procs`); it reports
``{"address": (ip, port), "pid": ..., "setup": [...]}`` once it listens, then serves the ops
of :class:`PromptService` (``peer.call("register_cache", spec=..., seed=...)``) until closed.

Cache contents are seeded random bytes (:func:`pattern`), so the decoder can recompute what
the prompt wrote and compare every byte with numpy, without shipping the data back.

:class:`CacheSpec` describes a cache in plain, picklable values; ``spec.desc()`` builds the
``CacheDesc``. :func:`register_array` gives the decoder side a zeroed numpy-backed cache.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from datadist.testing.procs import Peer, PeerLink, serve

__all__ = ["CacheSpec", "Decoder", "PromptConfig", "PromptService", "RunningPrompt", "pattern",
           "prompt_main", "register_array", "start_prompt"]

UINT64_MAX = 2**64 - 1


@dataclass(frozen=True)
class CacheSpec:
    """``num_tensors`` tensors of ``shape``; dim 0 counts batch slots or blocks.

    ``data_type`` and ``placement`` are the names of the ``DataType`` / ``Placement``
    members, so that a spec pickles without importing datadist's enums.
    """

    num_tensors: int
    shape: tuple[int, ...]
    data_type: str = "DT_FLOAT16"
    placement: str = "HOST"

    @property
    def itemsize(self) -> int:
        from datadist import DataType

        return DataType[self.data_type].itemsize

    @property
    def tensor_bytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    @property
    def units(self) -> int:
        return self.shape[0]

    @property
    def unit_bytes(self) -> int:
        return self.tensor_bytes // self.units

    def desc(self) -> Any:
        import datadist as llm_datadist

        return llm_datadist.CacheDesc(
            self.num_tensors, list(self.shape), llm_datadist.DataType[self.data_type],
            llm_datadist.Placement[self.placement],
        )


def pattern(spec: CacheSpec, seed: int) -> np.ndarray:
    """The bytes a cache made with ``seed`` holds: uint8, shape (num_tensors, tensor_bytes).

    Deterministic for a numpy version, so both processes compute the same array.
    """
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(spec.num_tensors, spec.tensor_bytes), dtype=np.uint8)


def _views(arr: np.ndarray) -> list[int]:
    return [int(arr[i].ctypes.data) for i in range(arr.shape[0])]


def register_array(cache_manager: Any, spec: CacheSpec, *, blocks: bool = False,
                   keys: Sequence[Any] = (), blocks_cache_key: Any = None,
                   fill: np.ndarray | None = None) -> tuple[Any, np.ndarray]:
    """Register numpy memory (zeroed, or a copy of ``fill``) as a cache; returns
    ``(cache, array)`` with ``array[i]`` the bytes of tensor ``i``. Keep the array alive
    while the cache is registered."""
    arr = np.zeros((spec.num_tensors, spec.tensor_bytes), dtype=np.uint8)
    if fill is not None:
        arr[...] = fill
    if blocks:
        cache = cache_manager.register_blocks_cache(spec.desc(), _views(arr), blocks_cache_key)
    else:
        cache = cache_manager.register_cache(spec.desc(), _views(arr), list(keys))
    return cache, arr


@dataclass(frozen=True)
class PromptConfig:
    """How to start a prompt: LLMConfig values, and ops to run before reporting ready.

    ``setup`` ops run first, in order, so their caches get the first cache ids (1, 2, ...),
    which is what old clients that hard-code cache ids rely on.
    """

    cluster_id: int
    listen_ip_info: str = "127.0.0.1:0"
    host_pool_bytes: int = 0
    sync_kv_timeout: int | None = None
    setup: tuple[tuple[str, dict[str, Any]], ...] = field(default_factory=tuple)
    remote_cache_accessible: bool = False  # peers may push into its caches by key


class PromptService:
    """The ops a prompt peer serves. Each runs in the prompt process and returns plain data."""

    def __init__(self, datadist: Any, cluster_id: int) -> None:
        self.dd = datadist
        self.cm = datadist.cache_manager
        self.cluster_id = cluster_id
        self._arrays: dict[int, np.ndarray] = {}  # registered memory, kept alive by us
        self._caches: dict[int, Any] = {}

    def ops(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in (
            "register_cache", "register_blocks_cache", "allocate_cache", "deallocate_cache",
            "allocate_blocks_cache", "deallocate_blocks_cache", "unregister_cache",
            "remove_cache_key", "info",
        )}

    def _keys(self, req_ids: Sequence[int | None], model_id: int) -> list[Any]:
        import datadist as llm_datadist

        return [llm_datadist.CacheKey(self.cluster_id, UINT64_MAX if r is None else r, model_id)
                for r in req_ids]

    def register_cache(self, spec: CacheSpec, seed: int, req_ids: Sequence[int | None] = (),
                       model_id: int = 0) -> int:
        """Register numpy memory holding ``pattern(spec, seed)``; key i binds slot i."""
        cache, arr = register_array(self.cm, spec, keys=self._keys(req_ids, model_id),
                                    fill=pattern(spec, seed))
        self._arrays[cache.cache_id] = arr
        self._caches[cache.cache_id] = cache
        return int(cache.cache_id)

    def register_blocks_cache(self, spec: CacheSpec, seed: int, model_id: int) -> int:
        import datadist as llm_datadist

        key = llm_datadist.BlocksCacheKey(self.cluster_id, model_id)
        cache, arr = register_array(self.cm, spec, blocks=True, blocks_cache_key=key,
                                    fill=pattern(spec, seed))
        self._arrays[cache.cache_id] = arr
        self._caches[cache.cache_id] = cache
        return int(cache.cache_id)

    def allocate_cache(self, spec: CacheSpec, seed: int, req_ids: Sequence[int | None] = (),
                       model_id: int = 0) -> int:
        """Allocate from the pool (needs ``host_pool_bytes``) and write the pattern in."""
        cache = self.cm.allocate_cache(spec.desc(), self._keys(req_ids, model_id))
        self._write(cache, spec, seed)
        self._caches[cache.cache_id] = cache
        return int(cache.cache_id)

    def allocate_blocks_cache(self, spec: CacheSpec, seed: int, model_id: int) -> int:
        """A pool blocks cache under ``BlocksCacheKey(self, model_id)``, holding the pattern."""
        import datadist as llm_datadist

        key = llm_datadist.BlocksCacheKey(self.cluster_id, model_id)
        cache = self.cm.allocate_blocks_cache(spec.desc(), key)
        self._write(cache, spec, seed)
        self._caches[cache.cache_id] = cache
        return int(cache.cache_id)

    def _write(self, cache: Any, spec: CacheSpec, seed: int) -> None:
        data = pattern(spec, seed)
        for i, addr in enumerate(cache.tensor_addrs):
            ctypes.memmove(addr, data[i].ctypes.data, spec.tensor_bytes)

    def deallocate_cache(self, cache_id: int) -> None:
        self.cm.deallocate_cache(self._caches.pop(cache_id))

    def deallocate_blocks_cache(self, cache_id: int) -> None:
        self.cm.deallocate_blocks_cache(self._caches.pop(cache_id))

    def unregister_cache(self, cache_id: int) -> None:
        self.cm.unregister_cache(cache_id)
        self._caches.pop(cache_id, None)
        self._arrays.pop(cache_id, None)

    def remove_cache_key(self, req_id: int, model_id: int = 0) -> None:
        (key,) = self._keys([req_id], model_id)
        self.cm.remove_cache_key(key)

    def info(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "address": self.dd.listen_address,
                "cluster_id": self.cluster_id}


def prompt_main(link: PeerLink, config: PromptConfig) -> None:
    """Child entry point: init a PROMPT, run the setup ops, report, then serve until closed."""
    import datadist as llm_datadist

    options = llm_datadist.LLMConfig()
    options.device_id = 0
    options.enable_cache_manager = True
    options.listen_ip_info = config.listen_ip_info
    if config.host_pool_bytes:
        options.host_mem_pool_cfg = json.dumps({"memory_size": config.host_pool_bytes})
    if config.sync_kv_timeout is not None:
        options.sync_kv_timeout = config.sync_kv_timeout
    if config.remote_cache_accessible:
        options.enable_remote_cache_accessible = True
    dd = llm_datadist.LLMDataDist(llm_datadist.LLMRole.PROMPT, config.cluster_id)
    dd.init(options.generate_options())
    try:
        service = PromptService(dd, config.cluster_id)
        ops = service.ops()
        setup = [ops[name](**kwargs) for name, kwargs in config.setup]
        link.send({"address": dd.listen_address, "pid": os.getpid(), "setup": setup})
        serve(link, ops)
    finally:
        dd.finalize()


# ------------------------------------------------------------------------------ parent side


@dataclass
class RunningPrompt:
    """A started prompt peer: where it listens, and the results of its setup ops."""

    peer: Peer
    config: PromptConfig
    address: tuple[str, int]
    pid: int
    setup: list[Any]

    @property
    def cluster_id(self) -> int:
        return self.config.cluster_id

    def call(self, op: str, **kwargs: Any) -> Any:
        """Run a :class:`PromptService` op in the prompt; raises PeerError on failure."""
        return self.peer.call(op, **kwargs)

    def close(self) -> None:
        self.peer.close()


def start_prompt(config: PromptConfig, *, env: dict[str, str | None] | None = None,
                 timeout: float = 30.0) -> RunningPrompt:
    """Start :func:`prompt_main` in a spawned child; returns once it listens (or raises,
    with the child's traceback, and the child killed)."""
    peer = Peer(prompt_main, config, env=env, name=f"prompt-{config.cluster_id}")
    try:
        ready = peer.recv(timeout)
    except BaseException:
        peer.kill()
        raise
    return RunningPrompt(peer, config, tuple(ready["address"]), ready["pid"], ready["setup"])


class Decoder:
    """A DECODER in *this* process, made and linked through the public API only.

    Who calls: tests. One per process at a time (llm_datadist allows one initialized
    ``LLMDataDist``); ``close()`` unlinks and finalizes. The data path follows
    ``DATADIST_TRANSPORT`` as read at construction.
    """

    def __init__(self, cluster_id: int, *, sync_kv_timeout: int | None = None,
                 remote_cache_accessible: bool = False) -> None:
        import datadist as llm_datadist

        self.llm = llm_datadist
        options = llm_datadist.LLMConfig()
        options.device_id = 0
        options.enable_cache_manager = True
        if sync_kv_timeout is not None:
            options.sync_kv_timeout = sync_kv_timeout
        if remote_cache_accessible:
            options.enable_remote_cache_accessible = True
        self.dd = llm_datadist.LLMDataDist(llm_datadist.LLMRole.DECODER, cluster_id)
        self.dd.init(options.generate_options())
        self.cm = self.dd.cache_manager
        self._clusters: dict[int, Any] = {}
        self._arrays: list[np.ndarray] = []

    def cluster(self, remote_cluster_id: int, address: tuple[str, int]) -> Any:
        info = self.llm.LLMClusterInfo()
        info.remote_cluster_id = remote_cluster_id
        info.append_local_ip_info("127.0.0.1", 0)
        info.append_remote_ip_info(address[0], address[1])
        return info

    def link(self, remote_cluster_id: int, address: tuple[str, int],
             timeout_ms: int = 3000) -> Any:
        """``link_clusters`` to one peer; returns its per-cluster status code."""
        info = self.cluster(remote_cluster_id, address)
        _, codes = self.dd.link_clusters([info], timeout_ms)
        if codes[0] == self.llm.LLMStatusCode.LLM_SUCCESS:
            self._clusters[remote_cluster_id] = info
        return codes[0]

    def unlink(self, remote_cluster_id: int, *, force: bool = False,
               timeout_ms: int = 3000) -> Any:
        info = self._clusters.pop(remote_cluster_id)
        _, codes = self.dd.unlink_clusters([info], timeout_ms, force=force)
        return codes[0]

    def path_name(self, remote_cluster_id: int) -> str:
        """Which data path the link to that cluster uses (``tcp``, ``cma``, ...)."""
        for link in self.dd.engine.links():
            if link.cluster_id == remote_cluster_id:
                return str(link.path_name)
        raise KeyError(f"no link to cluster {remote_cluster_id}")

    def local(self, spec: CacheSpec, *, blocks: bool = False) -> tuple[Any, np.ndarray]:
        """A zeroed local cache in numpy memory (kept alive until ``close``)."""
        cache, arr = register_array(self.cm, spec, blocks=blocks)
        self._arrays.append(arr)
        return cache, arr

    def close(self) -> None:
        """Unlink every cluster (forced: the peer may be dead) and finalize."""
        for info in list(self._clusters.values()):
            self.dd.unlink_clusters([info], 1000, force=True)
        self._clusters.clear()
        self.dd.finalize()
        self._arrays.clear()
