"""memory.mapped.first_unreadable: the owner's per-request probe of memory a user registered.
A few addresses (a list) take the ctypes path, more (or an array) numpy's; both must name the
same first unreadable address, whatever its position."""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Iterator

import numpy as np
import pytest

from datadist.memory import mapped

PAGE = mmap.PAGESIZE


@pytest.fixture()
def hole() -> Iterator[tuple[int, int]]:
    """A readable page and the address of the page after it, which is not mapped."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    base = libc.mmap(None, 2 * PAGE, mmap.PROT_READ | mmap.PROT_WRITE,
                     mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    assert base not in (None, ctypes.c_void_p(-1).value)
    assert libc.munmap(base + PAGE, PAGE) == 0  # the second page goes; the first stays
    yield base, base + PAGE
    libc.munmap(base, PAGE)


@pytest.mark.parametrize("n", [1, 2, 15, 16, 17, 40, 3000])
def test_first_unreadable_names_the_first_bad_address(hole: tuple[int, int], n: int) -> None:
    good, bad = hole
    ok = [good + (i % PAGE) for i in range(n)]
    assert mapped.first_unreadable(ok) is None
    assert mapped.first_unreadable(np.array(ok, np.uint64)) is None
    for at in sorted({0, n // 2, n - 1}):
        probes = list(ok)
        probes[at] = bad + 7
        assert mapped.first_unreadable(probes) == at
        assert mapped.first_unreadable(np.array(probes, np.uint64)) == at


def test_nothing_to_probe() -> None:
    assert mapped.first_unreadable([]) is None
    assert mapped.first_unreadable(np.zeros(0, np.uint64)) is None


def test_address_zero_and_the_top_of_the_address_space_are_unreadable() -> None:
    assert mapped.first_unreadable([0]) == 0
    assert mapped.first_unreadable([2**64 - 1]) == 0
