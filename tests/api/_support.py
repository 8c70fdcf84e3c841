"""Helpers shared by the API tests (importable; conftest.py holds the fixtures)."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

import datadist as llm
from datadist.api.cache_manager import CacheManager
from datadist.core.native import NativeEngine

PROMPT_ID, DECODER_ID = 1, 2


@dataclass
class Side:
    """One engine and its cache manager; ``register`` keeps the numpy memory alive."""

    engine: NativeEngine
    cm: CacheManager
    arrays: list[np.ndarray] = field(default_factory=list)

    @property
    def cluster_id(self) -> int:
        return self.engine.config.cluster_id

    def register(self, num_tensors: int, shape: list[int], *, blocks: bool = False,
                 placement: llm.Placement = llm.Placement.DEVICE, model_id: int | None = None,
                 keys: list[Any] = (), seed: int | None = None,
                 dtype: llm.DataType = llm.DataType.DT_UINT8,
                 remote_accessible: bool | None = None) -> tuple[Any, np.ndarray]:
        """A cache over numpy memory: ``arr[i]`` is tensor i as uint8 of ``shape``'s bytes.
        Random contents with ``seed``, zeros without."""
        desc = llm.CacheDesc(num_tensors, shape, dtype, placement)
        arr = np.zeros((num_tensors, desc.size), dtype=np.uint8)
        if seed is not None:
            arr[...] = np.random.default_rng(seed).integers(0, 256, arr.shape, dtype=np.uint8)
        addrs = [int(arr[i].ctypes.data) for i in range(num_tensors)]
        if blocks:
            key = None if model_id is None else llm.BlocksCacheKey(self.cluster_id, model_id)
            cache = self.cm.register_blocks_cache(desc, addrs, key, remote_accessible)
        else:
            cache = self.cm.register_cache(desc, addrs, list(keys), remote_accessible)
        self.arrays.append(arr)
        return cache, arr


def units(arr: np.ndarray, n: int) -> np.ndarray:
    """(num_tensors, bytes) -> (num_tensors, n units, unit bytes)."""
    return arr.reshape(arr.shape[0], n, -1)



def code(status: llm.LLMStatusCode) -> Any:
    """``with code(X):`` expects an LLMException with status X."""
    return _Code(status)


class _Code:
    def __init__(self, status: llm.LLMStatusCode) -> None:
        self.status = status
        self._raises = pytest.raises(llm.LLMException)

    def __enter__(self) -> Any:
        self.info = self._raises.__enter__()
        return self.info

    def __exit__(self, *exc: Any) -> bool:
        handled = self._raises.__exit__(*exc)
        if handled:
            got = self.info.value.status_code
            assert got == self.status, f"status {got}, expected {self.status}: {self.info.value}"
        return bool(handled)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (now)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def loopback_info(cluster_id: int, port: int) -> llm.LLMClusterInfo:
    """An LLMClusterInfo for cluster ``cluster_id`` listening at 127.0.0.1:``port``."""
    info = llm.LLMClusterInfo()
    info.remote_cluster_id = cluster_id
    info.append_local_ip_info("127.0.0.1", 0)
    info.append_remote_ip_info("127.0.0.1", port)
    return info
