"""A hostile NIXL peer: stock NIXL, driven by hand with whatever metadata it got hold of.

Who calls: the security and fault tests of the NIXL path (tests/security/test_nixl_trust.py),
to check what a peer holding an owner's NIXL metadata can do *outside* datadist's control
channel: post its own READs and WRITEs, and load a blob whose region lengths it rewrote (only
the initiator's NIXL checks descriptors against the regions it was told of; on UCX transports
whose memory keys the hardware does not check, the owner's UCX serves any address).

Blocking: :meth:`NixlThief.read` and :meth:`NixlThief.write` wait for their transfer, at most
``timeout`` seconds. Needs NIXL (``datadist[nixl]``); creating a thief without it raises
InvalidArgument. The thief drives NIXL's own Python bindings: of datadist it uses only what
finds NIXL (``datadist.core.nixl_wheel``: ``available``, ``_skip_unusable_ib``).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import secrets
import struct
import time
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["BACKEND", "NixlThief", "forge_region_length", "nixl_module"]

BACKEND = "UCX"  # the NIXL backend a thief's agent uses (the one datadist's agents use)


def nixl_module() -> Any:
    """NIXL's Python module (nixl_cu12, ...), imported. Raises InvalidArgument when none is
    installed. Where the host has no RDMA device, UCX's ib module is kept out first (it
    crashes such a process at exit; ``_skip_unusable_ib``)."""
    from datadist.core import nixl_wheel as nixl
    from datadist.core.errors import InvalidArgument

    name = nixl.available()
    if name is None:
        raise InvalidArgument("a NIXL thief needs NIXL: pip install 'datadist[nixl]'")
    nixl._skip_unusable_ib()
    if not os.environ.get("NIXL_LOG_LEVEL"):
        logging.getLogger("nixl").setLevel(logging.WARNING)  # NIXL logs every agent at INFO
    return importlib.import_module(name)


def forge_region_length(blob: bytes, addr: int, length: int, new_length: int) -> bytes:
    """``blob`` (an agent's metadata) with the region ``[addr, addr + length)`` claiming
    ``new_length`` bytes instead: NIXL serialises each registered region as address then
    length, little-endian 64-bit. ValueError if the region is not in the blob."""
    old = struct.pack("<QQ", addr, length)
    at = blob.find(old)
    if at < 0:
        raise ValueError(f"no region {addr:#x}+{length} in the metadata")
    return blob[:at] + struct.pack("<QQ", addr, new_length) + blob[at + len(old):]


class NixlThief:
    """A NIXL agent of our own (UCX backend) that reads and writes a remote agent's memory
    with nothing but its metadata. Not thread-safe; :meth:`close` when done."""

    def __init__(self) -> None:
        mod = nixl_module()
        cfg = mod.nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False,
                                    backends=[BACKEND])
        self.agent = mod.nixl_agent(f"thief-{os.getpid()}-{secrets.token_hex(4)}", cfg)
        self._buffers: list[np.ndarray] = []
        self._regs: list[Any] = []

    def load(self, blob: bytes) -> str:
        """Load a remote agent's metadata (as sent, or forged); returns its name."""
        name = self.agent.add_remote_agent(blob)
        return name.decode() if isinstance(name, bytes) else str(name)

    def _local(self, data: np.ndarray) -> Any:
        arr = np.array([[data.ctypes.data, data.nbytes, 0]], np.uint64)
        self._regs.append(self.agent.register_memory(arr, "DRAM"))
        self._buffers.append(data)
        return self.agent.get_xfer_descs(arr, "DRAM")

    def _run(self, op: str, remote: str, local: np.ndarray, addr: int, timeout: float,
             progress: Callable[[], object] | None) -> None:
        descs = self.agent.get_xfer_descs(np.array([[addr, local.nbytes, 0]], np.uint64),
                                          "DRAM")
        handle = self.agent.initialize_xfer(op, self._local(local), descs, remote)
        try:
            state = self.agent.transfer(handle)
            end = time.monotonic() + timeout
            while state not in ("DONE", "ERR"):
                if time.monotonic() > end:
                    raise TimeoutError(f"NIXL {op} still {state} after {timeout} s")
                if progress is not None:
                    progress()
                state = self.agent.check_xfer_state(handle)
            if state != "DONE":
                raise RuntimeError(f"NIXL {op} failed")
        finally:
            self.agent.release_xfer_handle(handle)

    def read(self, remote: str, addr: int, nbytes: int, *, timeout: float = 10.0,
             progress: Callable[[], object] | None = None) -> bytes:
        """NIXL READ of ``nbytes`` at the remote ``addr``. Raises what NIXL raises (a
        descriptor outside the remote's regions, as our NIXL knows them, is refused before
        anything moves), TimeoutError, or RuntimeError. ``progress``: called while waiting
        (drives the owner's agent where it has no progress thread)."""
        dst = np.zeros(nbytes, np.uint8)
        self._run("READ", remote, dst, addr, timeout, progress)
        return dst.tobytes()

    def write(self, remote: str, addr: int, data: bytes, *, timeout: float = 10.0,
              progress: Callable[[], object] | None = None) -> None:
        """NIXL WRITE of ``data`` at the remote ``addr``; raises as :meth:`read`."""
        src = np.frombuffer(bytearray(data), np.uint8)
        self._run("WRITE", remote, src, addr, timeout, progress)

    def close(self) -> None:
        for reg in self._regs:
            with contextlib.suppress(Exception):  # best effort at teardown
                self.agent.deregister_memory(reg)
        self._regs.clear()
        self._buffers.clear()
