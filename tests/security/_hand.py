"""Hand-driven peers for the round-3 trust tests (test_trust_round3.py,
test_attack_round3.py): a raw client speaking the wire by hand, in-process engines on
loopback, and a small blocks cache. Imported by those test modules (pytest puts this
directory on sys.path); every socket wait is bounded by SOCK_TIMEOUT."""

from __future__ import annotations

import os
import socket
from typing import Any

import numpy as np

import datadist as llm
from datadist.api.cache_manager import CacheManager
from datadist.core.config import EngineConfig
from datadist.core.engine import Engine
from datadist.core.native import NativeEngine
from datadist.wire import protocol as p

PROMPT, DECODER = 1, 2
SOCK_TIMEOUT = 5.0


class Raw:
    """A hand-driven client on TCP (an (ip, port)) or the local channel (an abstract socket
    name, bytes); every wait bounded."""

    def __init__(self, address: tuple[str, int] | bytes) -> None:
        if isinstance(address, bytes):
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(SOCK_TIMEOUT)
            self.sock.connect(address)
        else:
            self.sock = socket.create_connection(address, timeout=SOCK_TIMEOUT)
        self.dec = p.FrameDecoder()
        self.items: list[Any] = []

    def send(self, msg: p.Message, rid: int = 1) -> None:
        self.sock.sendall(p.encode(msg, rid))

    def next(self) -> Any:
        """The next (request id, frame); None once the server closed."""
        while not self.items:
            try:
                chunk = self.sock.recv(1 << 16)
            except (ConnectionResetError, TimeoutError):
                chunk = b""
            if not chunk:
                return None
            self.items.extend(self.dec.feed(chunk))
        return self.items.pop(0)

    def hello(self, cluster_id: int, features: int = 0, proof: bytes = b"",
              pid: int = 1, boot_id: bytes = b"\x01" * 16) -> Any:
        """Send a HELLO and return the answer frame (None if the server closed)."""
        self.send(p.Hello(cluster_id, 2, pid, 0, boot_id, features, proof), 1)
        got = self.next()
        return got[1] if got is not None else None

    def close(self) -> None:
        self.sock.close()


def make(made: list[Engine], cluster_id: int, *, listen: bool = True, **kw: Any) -> Engine:
    """An engine on loopback (a PROMPT that listens, or a DECODER), closed by the test's
    ``engines`` fixture (conftest.py) through ``made``: the Python engine, or the C++ core's
    when DATADIST_ENGINE=native (the tests that need only the engines' common interface then
    run against the core)."""
    config = EngineConfig(cluster_id=cluster_id, role=1 if listen else 2,
                          listen=("127.0.0.1", 0) if listen else None, **kw)
    native = os.environ.get("DATADIST_ENGINE", "").lower() == "native"
    engine: Any = NativeEngine(config) if native else Engine(config)
    made.append(engine)
    return engine


def blocks_cache(cm: CacheManager, cluster_id: int, model_id: int, seed: int | None
                 ) -> tuple[Any, np.ndarray]:
    """A one-tensor blocks cache of 4 blocks of 16 bytes (random bytes from ``seed``, or
    zeros) registered under BlocksCacheKey(cluster_id, model_id)."""
    desc = llm.CacheDesc(1, [4, 16], llm.DataType.DT_UINT8, llm.Placement.DEVICE)
    arr = np.zeros((1, 64), np.uint8)
    if seed is not None:
        arr[...] = np.random.default_rng(seed).integers(0, 256, arr.shape, dtype=np.uint8)
    cache = cm.register_blocks_cache(desc, [int(arr[0].ctypes.data)],
                                     llm.BlocksCacheKey(cluster_id, model_id))
    return cache, arr
