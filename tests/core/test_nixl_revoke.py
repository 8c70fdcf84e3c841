"""How the core's NIXL owner takes cache leases back (unregister / deallocate / finalize).

Each reader gets the revoke wait (NIXL_REVOKE_WAIT; ``set_nixl_revoke_wait`` here) for all
of its leases, and the readers are asked at once: a reader that never answers has its
connection shut down after that time, and neither makes the owner wait per lease nor uses up
another reader's time. The readers are spoken by hand on the wire (a control channel that
takes the leases, a reverse channel on which the revokes come), against a NativeEngine owner
in this process; no NIXL transfer runs, but the owner needs NIXL to serve leases.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import numpy as np
import pytest

from datadist.core import nixl_wheel as nixl
from datadist.core.config import EngineConfig
from datadist.core.layout import Geometry
from datadist.core.native import NativeEngine
from datadist.testing import engine as hooks
from datadist.wire import protocol as p

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(nixl.available() is None, reason="NIXL is not installed")]

WAIT = 0.6
OWNER, MODEL = 1, 1
BOOT = b"\x01" * 16  # another host: no same-host path


class Raw:
    """One connection spoken by hand; every wait bounded."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.dec = p.FrameDecoder()
        self.items: list[tuple[int, Any]] = []

    def send(self, msg: Any, rid: int) -> None:
        self.sock.sendall(p.encode(msg, rid))

    def next(self) -> tuple[int, Any] | None:
        """The next (request id, message); None once the owner closed or shut us down."""
        while not self.items:
            try:
                chunk = self.sock.recv(1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                return None
            self.items.extend(self.dec.feed(chunk))
        return self.items.pop(0)

    def call(self, msg: Any, rid: int) -> Any:
        self.send(msg, rid)
        got = self.next()
        assert got is not None and got[0] == rid, got
        return got[1]

    def close(self) -> None:
        self.sock.close()


class Reader:
    """A NIXL reader of cluster ``cid``: its control channel holds ``leases`` leases of the
    owner's blocks cache; its reverse channel answers each revoke at once (``silent``: never)."""

    def __init__(self, port: int, cid: int, leases: int, silent: bool) -> None:
        self.fwd = Raw(port)
        welcome = self.fwd.call(p.Hello(cid, 2, 100 + cid, 0, BOOT), 1)
        assert isinstance(welcome, p.Welcome), welcome
        token = p.split_token(welcome.proof, welcome.features)[1]
        self.rev = Raw(port)
        got = self.rev.call(p.Hello(cid, 2, 100 + cid, 0, BOOT,
                                    p.FEATURE_REVERSE | p.FEATURE_TOKEN, token), 1)
        assert isinstance(got, p.Welcome), got
        assert isinstance(self.fwd.call(p.NixlMdRequest(), 2), p.NixlMd)
        for i in range(leases):
            leased = self.fwd.call(p.NixlLease(p.KeyRef(p.KeyKind.BLOCKS_KEY, 0, MODEL, 0), 0),
                                   10 + i)
            assert isinstance(leased, p.NixlLeased), leased
        self.asked = 0
        self.silent = silent
        threading.Thread(target=self._answer, daemon=True).start()

    def _answer(self) -> None:
        while (item := self.rev.next()) is not None:
            self.asked += 1
            if not self.silent:
                self.rev.send(p.Ok(), item[0])

    def alive(self) -> bool:
        """Does the owner still answer on the control channel?"""
        self.fwd.send(p.Ping(7), 99)
        got = self.fwd.next()
        return got is not None and isinstance(got[1], p.Pong)

    def close(self) -> None:
        self.fwd.close()
        self.rev.close()


def test_a_silent_reader_costs_one_wait_and_no_other_reader_its_lease() -> None:
    owner = NativeEngine(EngineConfig(cluster_id=OWNER, role=1, listen=("127.0.0.1", 0),
                                      nixl_serve=True, nixl_whole_process=True))
    readers: list[Reader] = []
    try:
        hooks.set_nixl_revoke_wait(owner, WAIT)
        assert owner.listen_address is not None
        port = owner.listen_address[1]
        buf = np.ones(2 * 16 * 4096, np.uint8)
        geo = Geometry(2, 16 * 4096, 16, is_blocks=True)
        entry = owner.register(geo, [buf.ctypes.data, buf.ctypes.data + 16 * 4096],
                               placement=0, blocks_model_id=MODEL)
        silent = Reader(port, 2, 4, silent=True)  # the silent reader's four leases first
        readers.append(silent)
        honest = Reader(port, 3, 1, silent=False)
        readers.append(honest)
        assert hooks.nixl_leases(owner) == 5
        t0 = time.monotonic()
        owner.unregister(entry.cache_id)
        took = time.monotonic() - t0
        assert took < 3 * WAIT, took  # one wait, not one per lease (4 x WAIT before)
        assert hooks.nixl_leases(owner) == 0  # every lease ends
        assert silent.asked >= 1 and honest.asked == 1
        assert honest.alive()  # only the silent reader is cut off
        assert not silent.alive()
    finally:
        for r in readers:
            r.close()
        owner.close()
