"""The CPUs the core's own threads run on (cpp/src/threads.h).

Linux starts a thread on its creator's CPUs, so an engine made from a compute thread that
OpenMP pinned to one core (vLLM's CPU workers bind theirs so) would move every byte on that
core, beside the forward pass. :func:`set_thread_cpus` names other CPUs for the threads the
core starts from then on: the I/O pool, the workers of issued transfers and layer runs, the
listener's threads. The vLLM connector calls it (its ``transfer_cpus`` setting); anyone may,
before making an engine. Threads already running keep their CPUs.

Who calls: applications, once, before the first ``LLMDataDist.init``. Never blocks.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any


def _core() -> Any:
    """``datadist._core``; RuntimeError when it is not built here."""
    from datadist.core.native import core_module

    mod = core_module()
    if mod is None:
        from datadist.core.native import available

        raise RuntimeError(f"datadist's core is not available: {available()[1]}")
    return mod


def set_thread_cpus(cpus: Iterable[int] | None) -> None:
    """Run the core's threads started from now on on ``cpus`` (CPU numbers as
    ``os.sched_setaffinity`` takes them); ``None``: on their creator's CPUs (the default).
    TypeError for a non-integer; ValueError for an empty set or a negative number or one
    past what the kernel's CPU sets hold (1024). CPUs the process may not use are the
    kernel's to refuse: a thread it refuses stays where it started."""
    if cpus is None:
        _core().set_thread_cpus([])
        return
    if isinstance(cpus, (str, bytes)) or not isinstance(cpus, Iterable):
        raise TypeError(f"cpus must be an iterable of int or None, not {type(cpus).__name__}")
    chosen: list[int] = []
    for c in cpus:
        if isinstance(c, bool) or not isinstance(c, int):
            raise TypeError(f"a CPU must be an int, not {type(c).__name__}")
        if not 0 <= c < 1024:
            raise ValueError(f"CPU {c} is out of range [0, 1024)")
        chosen.append(c)
    if not chosen:
        raise ValueError("cpus is empty: name at least one CPU, or None for the default")
    _core().set_thread_cpus(sorted(set(chosen)))


def thread_cpus() -> list[int] | None:
    """What :func:`set_thread_cpus` set (sorted), or None (the core's threads take their
    creator's CPUs)."""
    cpus: list[int] = list(_core().thread_cpus())
    return cpus or None


def cgroup_cpus() -> list[int]:
    """The CPUs this process's cgroup lets it use (cgroup v2 ``cpuset.cpus.effective``, v1
    ``cpuset.effective_cpus``), else every CPU the kernel reports. Not a thread's affinity:
    what an OpenMP binding narrowed one thread to is not what the process may use."""
    for path in ("/sys/fs/cgroup/cpuset.cpus.effective",
                 "/sys/fs/cgroup/cpuset/cpuset.effective_cpus"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        cpus = parse_cpu_list(text)
        if cpus:
            return cpus
    return list(range(os.cpu_count() or 1))


def node_cpus(cpu: int, root: str = "/sys/devices/system/node") -> list[int] | None:
    """The CPUs of the NUMA node that holds ``cpu`` (``node*/cpulist``), or None where the
    kernel does not say. Threads that move a compute thread's KV cache are best kept on its
    node: the cache's memory is there."""
    try:
        nodes = [n for n in os.listdir(root) if n.startswith("node") and n[4:].isdigit()]
    except OSError:
        return None
    for n in sorted(nodes):
        try:
            with open(os.path.join(root, n, "cpulist")) as f:
                cpus = parse_cpu_list(f.read().strip())
        except (OSError, ValueError):
            continue
        if cpu in cpus:
            return cpus
    return None


def parse_cpu_list(text: str) -> list[int]:
    """"0-3,8,10-11" -> [0, 1, 2, 3, 8, 10, 11] (the kernel's list format). ValueError for
    anything else."""
    out: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        a = int(lo)
        b = int(hi) if sep else a
        if a < 0 or b < a:
            raise ValueError(f"not a CPU list: {text!r}")
        out.update(range(a, b + 1))
    return sorted(out)
