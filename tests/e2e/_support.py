"""Constants and numpy views shared by the two-process tests."""

from __future__ import annotations

import dataclasses

import numpy as np

from datadist.core import nixl_wheel as nixl
from datadist.testing.peers import CacheSpec, PromptConfig
from datadist.wire.protocol import local_name  # noqa: F401 - the tests import it from here

PROMPT_ID = 100
DECODER_ID = 200

# The conformance idea: every data-moving test runs once per data path, the path forced in
# the decoder's environment. A new path is one more entry here. ("shm" maps caches that the
# owner allocated from its pool and falls back to cross-memory attach for user memory.)
TRANSPORTS: tuple[str, ...] = ("tcp", "cma", "shm")
# NIXL is an optional extra: its path joins the suite where its wheel is installed (the
# prompts are told to serve NIXL readers: PROMPT_ENV and serving() below).
if nixl.available() is not None:
    TRANSPORTS += ("nixl",)

# Peers never inherit the decoder's forced path: they only serve. Where NIXL is installed they
# serve NIXL readers too, which is opt-in, and on this kind of host (UCX over tcp and shared
# memory, whose memory keys nothing checks) needs the whole-process allowance as well
# (docs/security.md, "The NIXL path"; tests/security/test_nixl_trust.py).
PROMPT_ENV: dict[str, str | None] = {"DATADIST_TRANSPORT": None}
if "nixl" in TRANSPORTS:
    PROMPT_ENV.update({"DATADIST_NIXL_SERVE": "1", "DATADIST_NIXL_ALLOW_WHOLE_PROCESS_ACCESS": "1"})


def serving(config: PromptConfig) -> PromptConfig:
    """``config`` for a prompt that NIXL readers can use: serving NIXL needs remote cache
    access (a NIXL registration is writable), so it is turned on where NIXL runs."""
    if "nixl" not in TRANSPORTS:
        return config
    return dataclasses.replace(config, remote_cache_accessible=True)


def units(arr: np.ndarray, spec: CacheSpec) -> np.ndarray:
    """``arr`` (num_tensors, tensor_bytes) as (num_tensors, units, unit_bytes): slots or
    blocks, byte-addressed."""
    return arr.reshape(spec.num_tensors, spec.units, spec.unit_bytes)


def assert_bytes_equal(got: np.ndarray, want: np.ndarray) -> None:
    """Every byte equal; on failure say how many differ and where the first one is."""
    assert got.shape == want.shape, f"shape {got.shape} != {want.shape}"
    bad = np.flatnonzero(got.reshape(-1) != want.reshape(-1))
    assert bad.size == 0, (
        f"{bad.size} of {got.size} bytes differ; first at flat index {int(bad[0])} "
        f"(got {int(got.reshape(-1)[bad[0]])}, want {int(want.reshape(-1)[bad[0]])})"
    )


def assert_zero(arr: np.ndarray, what: str = "untouched bytes") -> None:
    nz = np.count_nonzero(arr)
    assert nz == 0, f"{nz} {what} were written"
