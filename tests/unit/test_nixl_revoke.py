"""Engine._nixl_revoke: how unregister / deallocate / finalize take NIXL cache leases back.

Each reader gets NIXL_REVOKE_WAIT for all of its leases, and the readers are asked at once: a
reader that never answers (or answers each revoke just in time) has its connection shut down
after that time, and neither makes the owner wait per lease nor uses up another reader's
time. Readers are stand-ins here (no NIXL needed): a reverse link whose ``run`` answers at
once, or only when the deadline has passed.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

from datadist.core import engine as engine_mod
from datadist.core.config import EngineConfig
from datadist.core.engine import Engine, _CacheLease
from datadist.core.errors import Timeout

WAIT = 0.6


class _Reverse:
    """A reader's reverse channel: answers a revoke at once, or never (until the deadline)."""

    def __init__(self, pid: int, silent: bool) -> None:
        self.welcome = SimpleNamespace(pid=pid)
        self.chan = SimpleNamespace(closed=False)
        self.closing = False
        self.silent = silent
        self.asked = 0

    def run(self, deadline: float, op: Any) -> None:
        self.asked += 1
        if self.silent:
            time.sleep(max(0.0, deadline - time.monotonic()))
            raise Timeout("no answer")


@pytest.fixture
def owner(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(engine_mod, "NIXL_REVOKE_WAIT", WAIT)
    eng = Engine(EngineConfig(cluster_id=1, role=1))
    ended: list[int] = []
    monkeypatch.setattr(eng, "_nixl_end", lambda lease_id: ended.append(lease_id))
    yield eng, ended
    eng._nixl_held.clear()  # the stand-ins are not real links
    eng._reverse.clear()
    eng.close()


def _lease(eng: Engine, lease_id: int, cluster_id: int, dropped: list[int]) -> None:
    eng._nixl_held[lease_id] = _CacheLease(
        lease=SimpleNamespace(entry=SimpleNamespace(cache_id=7)), peer=(cluster_id, "peer"),
        cluster_id=cluster_id, pid=100 + cluster_id, drop=lambda: dropped.append(lease_id))


def test_a_silent_reader_costs_one_wait_and_no_other_reader_its_lease(owner) -> None:
    eng, ended = owner
    silent, honest = _Reverse(102, True), _Reverse(103, False)
    eng._reverse.update({2: silent, 3: honest})
    dropped: list[int] = []
    for lease_id in (1, 2, 3, 4):  # the silent reader's four leases come first
        _lease(eng, lease_id, 2, dropped)
    _lease(eng, 5, 3, dropped)
    t0 = time.monotonic()
    eng._nixl_revoke(lambda held: held.lease.entry.cache_id == 7)
    took = time.monotonic() - t0
    assert sorted(ended) == [1, 2, 3, 4, 5]  # every lease ends
    assert sorted(dropped) == [1, 2, 3, 4]  # only the silent reader is cut off
    assert silent.asked == 1 and honest.asked == 1  # its later leases: its time was spent
    assert took < 3 * WAIT, took  # one wait, not one per lease (4 x WAIT before)
