"""Shareable host memory: the fastest same-host path.

Memory in a ``memfd`` can be mapped by a peer process on the same host (through
``/proc/<pid>/fd/<fd>``), which then copies out of it with plain memcpy: one copy, no system
call per span, no page pinning. datadist's pools live in such memory; users can put their own
KV caches there too:

    k = datadist.memory.shared_empty((num_blocks, block_size, heads, dim), np.float16)
    cache_manager.register_blocks_cache(desc, [k.ctypes.data, ...], key)

Every shareable mapping of this process is recorded here (``Arena``), so that the engine can
tell, for any registered address range, which memfd and offset hold it (``lookup``). Arrays
are page-aligned: copies between two of them never suffer 4K aliasing.

Who calls: users (``shared_empty``, ``shared_tensor``), the pool, and the engine (``lookup``).
Nothing blocks; thread-safe.
"""

from __future__ import annotations

import bisect
import ctypes
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from datadist.memory.pool import shareable_map, unmap


@dataclass(frozen=True, slots=True)
class Arena:
    """One shareable mapping in this process."""

    base: int
    size: int
    fd: int
    ino: int


class _Arenas:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bases: list[int] = []
        self._by_base: dict[int, Arena] = {}

    def add(self, arena: Arena) -> None:
        with self._lock:
            bisect.insort(self._bases, arena.base)
            self._by_base[arena.base] = arena

    def remove(self, base: int) -> None:
        with self._lock:
            if self._by_base.pop(base, None) is not None:
                self._bases.remove(base)

    def find(self, addr: int, nbytes: int) -> Arena | None:
        with self._lock:
            i = bisect.bisect_right(self._bases, addr) - 1
            if i < 0:
                return None
            arena = self._by_base[self._bases[i]]
        if addr + nbytes <= arena.base + arena.size:
            return arena
        return None


ARENAS = _Arenas()


def register_arena(base: int, size: int, fd: int) -> Arena:
    arena = Arena(base, size, fd, os.fstat(fd).st_ino)
    ARENAS.add(arena)
    return arena


def lookup(addrs: np.ndarray, nbytes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """For tensors at ``addrs`` of ``nbytes`` each: (fds, inos, offsets) if every one lies in
    shareable memory, else None."""
    fds, inos, offs = [], [], []
    for a in addrs.tolist():  # once per tensor at registration, not per transfer
        arena = ARENAS.find(a, nbytes)
        if arena is None:
            return None
        fds.append(arena.fd)
        inos.append(arena.ino)
        offs.append(a - arena.base)
    return (np.array(fds, dtype=np.int32), np.array(inos, dtype=np.uint64),
            np.array(offs, dtype=np.uint64))


class _Mapping:
    """Owns one memfd mapping; freed when the last array viewing it is collected."""

    def __init__(self, nbytes: int) -> None:
        mapped = shareable_map("datadist-shared", nbytes)  # huge pages where offered
        self.size, self.fd, self.base = mapped.size, mapped.fd, mapped.addr
        self.backing = mapped.backing
        register_arena(self.base, self.size, self.fd)
        weakref.finalize(self, _release, self.base, self.size, self.fd)


def _release(base: int, size: int, fd: int) -> None:
    ARENAS.remove(base)
    unmap(base, size)
    os.close(fd)


def shared_empty(shape: tuple[int, ...] | int, dtype: Any = np.uint8) -> np.ndarray:
    """A page-aligned numpy array in shareable memory (contents zero).

    Register it like any array; same-host peers then read it with memcpy. The memory lives
    as long as the array (or any view of it).
    """
    dt = np.dtype(dtype)
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = int(np.prod(shape)) * dt.itemsize
    m = _Mapping(nbytes)
    raw = (ctypes.c_byte * m.size).from_address(m.base)
    # An attribute of our own on the ctypes array (mypy knows only ctypes' own ones): it
    # keeps the mapping alive as long as the array.
    raw._datadist_mapping = m  # type: ignore[attr-defined]
    # memoryview(raw) keeps ``raw`` (and so the mapping) alive, like ``raw`` itself would.
    arr: np.ndarray = np.frombuffer(memoryview(raw), dtype=np.uint8,
                                    count=nbytes).view(dt).reshape(shape)
    return arr


def shared_tensor(shape: tuple[int, ...], dtype: Any) -> Any:
    """The same as :func:`shared_empty`, as a torch CPU tensor (torch imported here only)."""
    import torch

    np_dtype = torch.empty((), dtype=dtype).numpy().dtype if dtype != torch.bfloat16 else None
    if np_dtype is None:
        arr = shared_empty(shape, np.uint16)
        return torch.from_numpy(arr).view(torch.bfloat16)
    return torch.from_numpy(shared_empty(shape, np_dtype))
