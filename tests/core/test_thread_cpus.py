"""The CPUs the core's threads run on (cpp/src/threads.h, datadist.set_thread_cpus).

A fresh interpreter per case (the core's I/O pool is process-wide: threads started by an
earlier test would keep their CPUs): its main thread is pinned to CPU 0 as OpenMP pins a
compute thread, then two engines link over TCP and a pull is issued and waited, so that the
I/O pool, the issued transfers' workers and the listener's accept thread all exist. Each
core thread's name and CPUs are read from /proc.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

import datadist

pytestmark = pytest.mark.timeout(120)

SCRIPT = textwrap.dedent("""
    import json, os, sys
    import numpy as np
    import datadist as ll

    os.sched_setaffinity(0, {0})  # the calling thread, as OpenMP binds a compute thread
    if sys.argv[1] != "default":
        ll.set_thread_cpus(json.loads(sys.argv[1]))

    from datadist.api.cache_manager import CacheManager
    from datadist.core.config import EngineConfig
    from datadist.core.native import NativeEngine

    desc = ll.CacheDesc(1, [4, 64], ll.DataType.DT_UINT8, ll.Placement.DEVICE)
    # the owner: the core's engine (one LLMDataDist a process), listening
    owner = NativeEngine(EngineConfig(cluster_id=1, role=1, listen=("127.0.0.1", 0)))
    parr = np.arange(4 * 64, dtype=np.uint8).reshape(1, 4 * 64)
    CacheManager(owner, remote_cache_accessible=True).register_blocks_cache(
        desc, [int(parr[0].ctypes.data)], ll.BlocksCacheKey(1, 0))
    pp = owner.listen_address[1]
    # the puller: the public API, over TCP
    cfg = ll.LLMConfig()
    cfg.local_comm_res = ""
    cfg.transport = "tcp"
    d = ll.LLMDataDist(ll.LLMRole.DECODER, 2)
    d.init(cfg.generate_options())
    darr = np.zeros((1, 4 * 64), np.uint8)
    dcache = d.cache_manager.register_blocks_cache(desc, [int(darr[0].ctypes.data)],
                                                   ll.BlocksCacheKey(2, 0))
    info = ll.LLMClusterInfo()
    info.remote_cluster_id = 1
    info.append_local_ip_info("127.0.0.1", 0)
    info.append_remote_ip_info("127.0.0.1", pp)
    code, _ = d.link_clusters([info], 5000)
    assert code == ll.LLMStatusCode.LLM_SUCCESS, code
    h = d.cache_manager.pull_blocks_async(ll.BlocksCacheKey(1, 0), dcache, [0, 1, 2, 3],
                                          [0, 1, 2, 3])
    h.wait()
    assert (darr == parr).all()
    threads = {}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            name = f.read().strip()
        if name.startswith("datadist-"):
            threads.setdefault(name, set()).update(os.sched_getaffinity(int(tid)))
    print(json.dumps({"cpus": ll.thread_cpus(),
                      "threads": {k: sorted(v) for k, v in threads.items()}}))
    d.finalize(); owner.close()
""")


def _run(arg: str) -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT, arg], capture_output=True, text=True,
                         timeout=90, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


needs_two = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or 1 not in os.sched_getaffinity(0)
                               or 0 not in os.sched_getaffinity(0),
                               reason="needs CPUs 0 and 1")


@needs_two
def test_by_default_the_core_s_threads_take_their_creator_s_cpus() -> None:
    """The problem set_thread_cpus is for: from a thread pinned to CPU 0, every core thread
    (named, so that top -H and /proc tell them apart) lands on CPU 0 too."""
    got = _run("default")
    assert got["cpus"] is None
    names = set(got["threads"])
    assert {"datadist-io", "datadist-task", "datadist-accept"} <= names, names
    assert all(cpus == [0] for cpus in got["threads"].values()), got


@needs_two
def test_set_thread_cpus_moves_every_core_thread_started_after_it() -> None:
    got = _run("[0, 1]")
    assert got["cpus"] == [0, 1]
    assert {"datadist-io", "datadist-task", "datadist-accept"} <= set(got["threads"]), got
    assert all(cpus == [0, 1] for cpus in got["threads"].values()), got


def test_bad_cpu_sets_are_refused_and_none_restores_the_default() -> None:
    before = datadist.thread_cpus()
    try:
        with pytest.raises(TypeError):
            datadist.set_thread_cpus("0-3")  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            datadist.set_thread_cpus([0, 1.5])  # type: ignore[list-item]
        with pytest.raises(TypeError):
            datadist.set_thread_cpus([True])
        with pytest.raises(ValueError, match="empty"):
            datadist.set_thread_cpus([])
        with pytest.raises(ValueError, match="range"):
            datadist.set_thread_cpus([-1])
        with pytest.raises(ValueError, match="range"):
            datadist.set_thread_cpus([1024])
        assert datadist.thread_cpus() == before  # nothing changed by a refusal
        datadist.set_thread_cpus([3, 1, 1])
        assert datadist.thread_cpus() == [1, 3]
        datadist.set_thread_cpus(None)
        assert datadist.thread_cpus() is None
    finally:
        datadist.set_thread_cpus(before)


def test_cpu_lists_parse_as_the_kernel_writes_them() -> None:
    from datadist.core.threads import cgroup_cpus, parse_cpu_list

    assert parse_cpu_list("0-3,8,10-11\n".strip()) == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpu_list("5") == [5]
    with pytest.raises(ValueError):
        parse_cpu_list("3-1")
    with pytest.raises(ValueError):
        parse_cpu_list("a")
    assert set(os.sched_getaffinity(0)) <= set(cgroup_cpus())


def test_a_cpu_s_numa_node_is_read_from_sysfs(tmp_path) -> None:
    from datadist.core.threads import node_cpus

    for n, cpus in (("node0", "0-3,8-11"), ("node1", "4-7,12-15")):
        (tmp_path / n).mkdir()
        (tmp_path / n / "cpulist").write_text(cpus + "\n")
    (tmp_path / "possible").write_text("0-1\n")  # not a node
    assert node_cpus(13, str(tmp_path)) == [4, 5, 6, 7, 12, 13, 14, 15]
    assert node_cpus(2, str(tmp_path)) == [0, 1, 2, 3, 8, 9, 10, 11]
    assert node_cpus(99, str(tmp_path)) is None
    assert node_cpus(0, str(tmp_path / "absent")) is None
