# Generated from the built datadist._core by pybind11-stubgen 3.0.0 (python tools/gen_stub.py):
# do not edit; change the binding (cpp/python/) and regenerate (tests/project/test_stub.py checks it).
"""
Hooks into an Engine for tests and tools (datadist.testing.engine); not for production code.
"""
from __future__ import annotations
import datadist._core
import typing
__all__: list[str] = ['link_nixl_leases', 'nixl_agent', 'nixl_leases', 'nixl_progress', 'nixl_refusal', 'nixl_regions', 'set_nixl_options', 'set_nixl_revoke_wait', 'transport_settings']
def link_nixl_leases(engine: datadist._core.Engine, cluster_id: typing.SupportsInt | typing.SupportsIndex) -> int:
    """
    NIXL leases on whole caches the link to `cluster_id` holds now.
    """
def nixl_agent(engine: datadist._core.Engine) -> tuple[str, int, int, int, int] | None:
    """
    (name, generation, leases keeping its pump beating, of them on connections without a completed NIXL read, transfers prepared so far) of the engine's NIXL agent, or None before one was needed.
    """
def nixl_leases(engine: datadist._core.Engine) -> int:
    """
    NIXL cache leases readers hold on the engine's caches now.
    """
def nixl_progress(engine: datadist._core.Engine) -> None:
    """
    One progress call of the owner's NIXL agent, if made (driven while no lease is open).
    """
def nixl_refusal(engine: datadist._core.Engine) -> str:
    """
    Why the engine serves no NIXL reader ("": it does).
    """
def nixl_regions(engine: datadist._core.Engine) -> list[tuple[int, int, int, int]]:
    """
    Every tensor the engine's NIXL agent registered: (start, end, memory kind: 0 DRAM, 1 VRAM, CUDA device), by address; empty before an agent was made.
    """
def set_nixl_options(engine: datadist._core.Engine, *, serve: bool, whole_process: bool) -> None:
    """
    Serving NIXL turned on or off on a running engine (asked anew on every NIXL request).
    """
def set_nixl_revoke_wait(engine: datadist._core.Engine, seconds: typing.SupportsFloat | typing.SupportsIndex) -> None:
    """
    How long a reader has to give a revoked NIXL lease back (5 s).
    """
def transport_settings(transport: str) -> dict[str, bool]:
    """
    What a forced transport means for links (options.h ApplyTransport): local_channel (used and served), shm, shm_forced, nixl_read.
    """
