"""Looking into a native engine from tests and tools: the core's test hooks.

The core binds what only tests and tools need (NIXL's agent, its registrations and leases, a
shorter revoke wait, a forced progress call) in its own submodule, ``datadist._core.testing``,
not on the production ``Engine`` class; this module calls them on a
:class:`~datadist.core.native.NativeEngine`. Production code never imports it
(tests/project/test_stub.py checks).

Who calls: datadist's NIXL tests, the NIXL trust and revoke tests, ``examples/nixl``. Every
function returns at once, except :func:`nixl_progress` (one progress call of NIXL's agent,
without the GIL).
"""

from __future__ import annotations

import os
from typing import NamedTuple

from datadist.core.native import NativeEngine

# Each function imports datadist._core.testing when called, so that importing this module
# needs no built core (a test module importing it is still collected, and skips).


class NixlAgent(NamedTuple):
    """The engine's NIXL agent as the core reports it."""

    name: str
    generation: int  # a new agent (after every registration went) gets a new one
    pump_users: int  # leases keeping its progress pump beating
    pump_fresh: int  # of them, on connections without a completed NIXL read
    prepared: int  # transfers prepared so far (identical pulls reuse theirs)


def nixl_agent(engine: NativeEngine) -> NixlAgent | None:
    """The engine's NIXL agent, or None before one was needed (a reader asked, or the engine
    reads by NIXL)."""
    from datadist._core import testing as _hooks

    got = _hooks.nixl_agent(engine._core)
    return None if got is None else NixlAgent(*got)


def nixl_prepared(engine: NativeEngine) -> int:
    """NIXL transfers the engine's agent prepared so far (0 without an agent)."""
    agent = nixl_agent(engine)
    return 0 if agent is None else agent.prepared


def nixl_refusal(engine: NativeEngine) -> str | None:
    """Why the engine serves no NIXL reader (None: it does; docs/security.md, "The NIXL
    path")."""
    from datadist._core import testing as _hooks

    return _hooks.nixl_refusal(engine._core) or None


def nixl_leases(engine: NativeEngine) -> int:
    """NIXL cache leases readers hold on the engine's caches now (its owner side)."""
    from datadist._core import testing as _hooks

    return _hooks.nixl_leases(engine._core)


def link_nixl_leases(engine: NativeEngine, cluster_id: int) -> int:
    """NIXL leases on whole caches the engine's link to ``cluster_id`` holds (its reader
    side); 0 without such a link."""
    from datadist._core import testing as _hooks

    return _hooks.link_nixl_leases(engine._core, cluster_id)


def nixl_regions(engine: NativeEngine) -> list[tuple[int, int, int, int]]:
    """Every tensor the engine's NIXL agent registered, by address: (start, end, memory kind:
    0 DRAM, 1 VRAM, CUDA device); [] before an agent was made."""
    from datadist._core import testing as _hooks

    return _hooks.nixl_regions(engine._core)


def set_nixl_options(engine: NativeEngine, *, serve: bool, whole_process: bool) -> None:
    """Serve NIXL readers (and with ``whole_process`` their whole-process reach) or stop, on
    a running engine: asked anew on every NIXL request."""
    from datadist._core import testing as _hooks

    _hooks.set_nixl_options(engine._core, serve=serve, whole_process=whole_process)


def set_nixl_revoke_wait(engine: NativeEngine, seconds: float) -> None:
    """How long a reader has to give a revoked NIXL lease back (5 s unless set here)."""
    from datadist._core import testing as _hooks

    _hooks.set_nixl_revoke_wait(engine._core, seconds)


def nixl_progress(engine: NativeEngine) -> None:
    """One progress call of the engine's NIXL agent, if it has one (for a test that drives
    the agent while no lease keeps its pump beating)."""
    from datadist._core import testing as _hooks

    _hooks.nixl_progress(engine._core)


__all__ = ["NixlAgent", "host_pool_fd", "link_nixl_leases", "nixl_agent", "nixl_leases",
           "nixl_prepared", "nixl_progress", "nixl_refusal", "nixl_regions", "set_nixl_options",
           "set_nixl_revoke_wait"]


def host_pool_fd() -> int:
    """This process's descriptor of the memfd the core made for an engine's HOST pool (its
    name: ``datadist-host-pool``). AssertionError when there is none. Reads /proc only."""
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:datadist-host-pool "):
                return int(fd)
        except OSError:  # the directory's own descriptor, closed since
            continue
    raise AssertionError("no host pool memfd")
