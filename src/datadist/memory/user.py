"""Memory users bring: what an ``addrs`` item of ``register_cache`` may be.

Who calls: the facade's ``register_cache`` / ``register_blocks_cache``, once per tensor.

llm_datadist takes integer addresses only. datadist also takes the objects that own memory,
so that their size can be checked against the cache description and they stay alive while
registered (the caller may drop its own reference):

* an ``int``: an address; its size is the caller's promise (checked against the mappings);
* a CPU ``torch.Tensor`` (anything with ``data_ptr()``, ``numel()``, ``element_size()``):
  contiguous, on the CPU;
* anything with the buffer protocol (numpy arrays, ``bytearray``, ``mmap``): C-contiguous
  and writable.

torch is never imported here: a tensor is recognised by its methods.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

from datadist.core.errors import InvalidArgument


@dataclass(frozen=True)
class UserMemory:
    """One tensor's memory: its address, its size when known, and the object to keep."""

    addr: int
    nbytes: int | None  # None: a bare address
    owner: Any = None


def _torch(obj: Any, name: str) -> UserMemory:
    device = getattr(obj, "device", None)
    if device is not None and getattr(device, "type", "cpu") != "cpu":
        raise InvalidArgument(f"{name} is a tensor on {device}: only CPU tensors can be "
                              "registered")
    contiguous = getattr(obj, "is_contiguous", None)
    if contiguous is not None and not contiguous():
        raise InvalidArgument(f"{name} is not contiguous")
    return UserMemory(int(obj.data_ptr()), int(obj.numel()) * int(obj.element_size()), obj)


def _buffer(obj: Any, name: str) -> UserMemory:
    try:
        view = memoryview(obj)
    except TypeError:
        raise TypeError(f"{name} only support int, a CPU torch tensor or a buffer "
                        f"(numpy array), but got {type(obj)}.") from None
    with view:
        if not view.c_contiguous:
            raise InvalidArgument(f"{name} is not C-contiguous")
        if view.readonly:
            raise InvalidArgument(f"{name} is read-only: a cache needs writable memory")
        nbytes = view.nbytes
        if nbytes == 0:
            raise InvalidArgument(f"{name} is empty")
        flat = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        with flat:
            addr = ctypes.addressof(ctypes.c_char.from_buffer(flat))
    return UserMemory(addr, nbytes, obj)


def user_memory(obj: Any, name: str) -> UserMemory:
    """Resolve one ``addrs`` item. TypeError for an unusable kind of object, InvalidArgument
    for one that cannot hold a cache (on a GPU, strided, read-only, empty)."""
    if isinstance(obj, int):  # bool too, as llm_datadist's int checks allow
        return UserMemory(obj, None)
    if callable(getattr(obj, "data_ptr", None)) and callable(getattr(obj, "numel", None)):
        return _torch(obj, name)
    return _buffer(obj, name)


__all__ = ["UserMemory", "user_memory"]
