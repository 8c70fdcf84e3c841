"""Fixtures of the fault matrix: peer processes that are always killed, scratch memory files,
and two network namespaces joined by a veth pair (``netns`` tests)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator

import pytest
from fault_harness import Peers
from fault_netns import NetnsPair


@pytest.fixture
def peers() -> Iterator[Peers]:
    """Start PROMPT/DECODER processes; all of them die at teardown, pass or fail."""
    p = Peers()
    try:
        yield p
    finally:
        p.close()


@pytest.fixture
def tcp_peers() -> Iterator[Peers]:
    p = Peers(env={"DATADIST_TRANSPORT": "tcp"})
    try:
        yield p
    finally:
        p.close()


@pytest.fixture
def shm_dir() -> Iterator[str]:
    """A scratch directory in memory (files there are destination caches the test watches)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    d = tempfile.mkdtemp(prefix="datadist-faults-", dir=base)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


# ------------------------------------------------------------------------------ netns


def _netns_unavailable() -> str:
    if os.geteuid() != 0:
        return "network namespace tests need root (ip netns add)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"network namespace tests need the '{tool}' command (iproute2)"
    return ""


def _teardown_netns(names: list[str]) -> None:
    for ns in names:
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True,
                              timeout=10).stdout.split()
        for pid in pids:  # only processes inside our own namespaces
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), 9)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


@pytest.fixture
def netns_pair() -> Iterator[NetnsPair]:
    reason = _netns_unavailable()
    if reason:
        pytest.skip(reason)
    tag = f"{os.getpid() % 100000}"
    pair = NetnsPair(a=f"ddf{tag}a", b=f"ddf{tag}b", dev_a=f"ddf{tag}va", dev_b=f"ddf{tag}vb",
                     ip_a="10.213.77.1", ip_b="10.213.77.2")
    names = [pair.a, pair.b]
    _teardown_netns(names)  # leftovers of a crashed earlier run with the same pid
    steps = [
        ["ip", "netns", "add", pair.a],
        ["ip", "netns", "add", pair.b],
        ["ip", "link", "add", pair.dev_a, "type", "veth", "peer", "name", pair.dev_b],
        ["ip", "link", "set", pair.dev_a, "netns", pair.a],
        ["ip", "link", "set", pair.dev_b, "netns", pair.b],
        ["ip", "-n", pair.a, "addr", "add", f"{pair.ip_a}/24", "dev", pair.dev_a],
        ["ip", "-n", pair.b, "addr", "add", f"{pair.ip_b}/24", "dev", pair.dev_b],
        ["ip", "-n", pair.a, "link", "set", "lo", "up"],
        ["ip", "-n", pair.b, "link", "set", "lo", "up"],
        ["ip", "-n", pair.a, "link", "set", pair.dev_a, "up"],
        ["ip", "-n", pair.b, "link", "set", pair.dev_b, "up"],
    ]
    try:
        for cmd in steps:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
            if r.returncode != 0:
                pytest.skip(f"cannot build network namespaces here: {' '.join(cmd)}: "
                            f"{r.stderr.strip()}")
        yield pair
    finally:
        _teardown_netns(names)
        # A veth whose namespace vanished is deleted with it; be sure about the host side.
        subprocess.run(["ip", "link", "del", pair.dev_a], capture_output=True, timeout=10)
