"""core.local.vm_copy: cross-memory copies between our memory and a process's (local copies
of the API's copy / swap calls, ``datadist info``'s probe). Run here on our own process, which
the kernel always lets us read."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from datadist.core import local as iov_mod
from datadist.core.errors import BrokenLink
from datadist.core.layout import make_iov
from datadist.core.local import IOV_MAX, vm_copy

U64 = np.uint64


def _spans(buf: np.ndarray, starts: list[int], length: int) -> np.ndarray:
    base = buf.ctypes.data
    return make_iov(np.array([base + s for s in starts], U64), np.full(len(starts), length, U64))


def test_copies_every_span() -> None:
    src = np.random.default_rng(1).integers(0, 255, 1 << 16, dtype=np.uint8)
    dst = np.zeros_like(src)
    local, remote = _spans(dst, [0, 4096, 40000], 1000), _spans(src, [9000, 100, 60000], 1000)
    for nbytes in (None, 3000):
        dst[:] = 0
        vm_copy(os.getpid(), local, remote, nbytes=nbytes)
        for d, s in ((0, 9000), (4096, 100), (40000, 60000)):
            assert np.array_equal(dst[d:d + 1000], src[s:s + 1000])


def test_a_write_goes_the_other_way() -> None:
    mine = np.arange(4096, dtype=np.uint8)
    theirs = np.zeros_like(mine)
    vm_copy(os.getpid(), _spans(mine, [0], 4096), _spans(theirs, [0], 4096), write=True)
    assert np.array_equal(theirs, mine)


def test_more_spans_than_one_system_call_takes() -> None:
    n = IOV_MAX + 5
    src = np.random.default_rng(2).integers(0, 255, n * 8, dtype=np.uint8)
    dst = np.zeros_like(src)
    starts = list(range(0, n * 8, 8))
    vm_copy(os.getpid(), _spans(dst, starts[::-1], 8), _spans(src, starts, 8))
    assert np.array_equal(dst.reshape(n, 8), src.reshape(n, 8)[::-1])


def test_a_short_copy_is_retried_once_then_a_broken_link() -> None:
    """The second remote span is not mapped: the kernel copies the first and stops; the retry
    of the rest fails, and that is the other process's memory gone (BrokenLink), never a
    partial success."""
    src = np.arange(4096, dtype=np.uint8)
    dst = np.zeros(8192, dtype=np.uint8)
    local = _spans(dst, [0, 4096], 4096)
    remote = make_iov(np.array([src.ctypes.data, 4096], U64), np.array([4096, 4096], U64))
    calls = []
    real = iov_mod._vm_call

    def counted(*a: object) -> int:
        calls.append(a)
        return real(*a)  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(iov_mod, "_vm_call", counted)
        with pytest.raises(BrokenLink):
            vm_copy(os.getpid(), local, remote)
    assert len(calls) == 2  # the copy, then one retry of the rest
    assert np.array_equal(dst[:4096], src)


def test_a_process_that_is_gone_is_a_broken_link() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    buf = np.zeros(64, dtype=np.uint8)
    with pytest.raises(BrokenLink, match="gone"):
        vm_copy(child.pid, _spans(buf, [0], 64), _spans(buf, [0], 64))
