"""What a lying same-host owner can and cannot do to a reader on the native engine through
shared-memory grants (the rules of tests/security/test_same_host_trust.py, item 7, for the
C++ core's reader, cpp/src/shm.h).

The fake owner serves the local channel on the abstract name of *this* process (a local
squatter), so the kernel verifies the reader's peer as this process, and its SHM_GRANTs name
descriptors of this process: memfds made here, a pipe. The reader must never read outside a
mapping, never map a file its owner could shrink, never hang on a FIFO, and refuse one
descriptor named with two inodes; a refused grant fails the pull, nothing is copied.
"""

from __future__ import annotations

import itertools
import mmap
import os
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from _hand import local_name

from datadist.core import native
from datadist.core.config import EngineConfig
from datadist.core.errors import DatadistError
from datadist.core.layout import Geometry, every_tensor, plan_slot
from datadist.memory.pool import memfd_map, unmap
from datadist.testing.fakes import EchoOwner
from datadist.wire import protocol as p

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not native.available()[0], reason="the native core is not built"),
]

PULLER = 32
_owners = itertools.count(1000)  # a fresh owner id (and local name) per fake: a closed one's
# abstract name is free only once its accept thread lets go of the socket
N = 1 << 17  # above the native reader's 64 KiB: granted, not streamed
GEO = Geometry(1, N, 1)
KEY = p.KeyRef(p.KeyKind.CACHE_ID, 1, 0)


@pytest.fixture
def sealed() -> Iterator[tuple[int, int]]:
    """A sealed memfd of N bytes, all 0x11: (fd, inode)."""
    fd, addr = memfd_map("trust", N)
    mm = mmap.mmap(fd, N)
    mm[:] = b"\x11" * N
    mm.close()
    yield fd, os.fstat(fd).st_ino
    unmap(addr, N)
    os.close(fd)


def _pull(grant: Callable[[p.Read], p.ShmGrant | None], grant_addr: int = 0,
          ) -> tuple[np.ndarray, str, list[int]]:
    """A native puller pulls one N-byte tensor from a fake owner answering GRANT | SHM with
    ``grant(read)``: (destination, how it moved or the error's text, the READs' flags)."""
    dst = np.zeros(N, dtype=np.uint8)
    owner = next(_owners)
    with EchoOwner(owner, grant_addr=grant_addr, local_name=local_name(os.getpid(), owner),
                   shm_grant=grant) as fake:
        eng = native.NativeEngine(EngineConfig(cluster_id=PULLER, role=2))
        try:
            link = eng.link(owner, *fake.address, 2.0)
            assert link.path_name == "cma", link
            entry = eng.register(GEO, [dst.ctypes.data], placement=0)
            plan = plan_slot(GEO, 0, every_tensor(1))
            try:
                eng.pull(owner, KEY, 0, plan, entry.cache_id, 2.0)
                how = eng.last_moved(owner)
            except DatadistError as e:
                how = f"refused: {e}"
        finally:
            eng.close()
        return dst, how, fake.reads


def test_an_honest_shm_grant_is_read_by_memcpy(sealed: tuple[int, int]) -> None:
    fd, ino = sealed
    dst, how, reads = _pull(lambda m: p.ShmGrant(1, np.array([fd], "<i4"),
                                                 np.array([ino], "<u8"), np.array([0], "<u8")))
    assert how == "shm" and (dst == 0x11).all()
    assert reads[-1] & p.ReadFlags.SHM and reads[-1] & p.ReadFlags.GRANT


@pytest.mark.parametrize("offset", [N // 2, N + 1, 2**64 - 8])
def test_spans_past_the_mapping_are_refused(sealed: tuple[int, int], offset: int) -> None:
    fd, ino = sealed
    dst, how, _ = _pull(lambda m: p.ShmGrant(1, np.array([fd], "<i4"), np.array([ino], "<u8"),
                                             np.array([offset], "<u8")))
    assert how.startswith("refused") and "mapping" in how, how
    assert not dst.any()


def test_another_inode_than_the_file_is_refused(sealed: tuple[int, int]) -> None:
    fd, ino = sealed
    dst, how, _ = _pull(lambda m: p.ShmGrant(1, np.array([fd], "<i4"),
                                             np.array([ino + 1], "<u8"), np.array([0], "<u8")))
    assert how.startswith("refused") and "not the memory the owner named" in how, how
    assert not dst.any()


def test_one_fd_named_with_two_inodes_is_refused(sealed: tuple[int, int]) -> None:
    fd, ino = sealed
    geo = Geometry(2, N, 1)
    dst = np.zeros((2, N), dtype=np.uint8)
    grant = p.ShmGrant(1, np.array([fd, fd], "<i4"), np.array([ino, ino + 1], "<u8"),
                       np.array([0, 0], "<u8"))
    owner = next(_owners)
    with EchoOwner(owner, local_name=local_name(os.getpid(), owner),
                   shm_grant=lambda m: grant) as fake:
        eng = native.NativeEngine(EngineConfig(cluster_id=PULLER, role=2))
        try:
            eng.link(owner, *fake.address, 2.0)
            entry = eng.register(geo, [dst.ctypes.data, dst.ctypes.data + N], placement=0)
            plan = plan_slot(geo, 0, every_tensor(2))
            with pytest.raises(DatadistError, match="with two different files"):
                eng.pull(owner, KEY, 0, plan, entry.cache_id, 2.0)
        finally:
            eng.close()
    assert not dst.any()


def test_an_unsealed_memfd_is_not_mapped_cross_memory_attach_instead() -> None:
    """A file its owner could shrink under our copy (SIGBUS) is not mapped: the reader asks
    again without SHM and copies with cross-memory attach from the granted address."""
    loose = os.memfd_create("unsealed", os.MFD_CLOEXEC)
    os.ftruncate(loose, N)
    src = np.full(N, 0x22, dtype=np.uint8)
    try:
        dst, how, reads = _pull(lambda m: p.ShmGrant(
            1, np.array([loose], "<i4"), np.array([os.fstat(loose).st_ino], "<u8"),
            np.array([0], "<u8")), grant_addr=src.ctypes.data)
    finally:
        os.close(loose)
    assert how == "cma" and (dst == 0x22).all(), how
    assert reads[-2] & p.ReadFlags.SHM and not reads[-1] & p.ReadFlags.SHM


def test_a_fifo_is_refused_without_waiting() -> None:
    r, w = os.pipe()
    try:
        dst, how, _ = _pull(lambda m: p.ShmGrant(1, np.array([r], "<i4"),
                                                 np.array([os.fstat(r).st_ino], "<u8"),
                                                 np.array([0], "<u8")))
    finally:
        os.close(r)
        os.close(w)
    assert how.startswith("refused") and "not the memory the owner named" in how, how
    assert not dst.any()
