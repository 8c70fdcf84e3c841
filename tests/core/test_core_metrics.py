"""Metrics kept by the C++ core (cpp/src/metrics.h): an owner on the native engine counts what
it serves and answers STATS (the asking peer's series only); ``datadist.metrics()``, the Prometheus
collector and ``peer_stats`` read the core's counters; a transfer issued to the core's workers
is counted when it ends, whether or not anyone polls its handle. In-process engines on
loopback, over TCP (requests, not same-host leases: the owner sees each read)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import datadist as llm
from datadist.api.cache_manager import CacheManager
from datadist.core import native
from datadist.core.config import EngineConfig

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not native.available()[0], reason="datadist._core is not built")]

OWNER, READER, OTHER = 31, 41, 42
DESC = llm.CacheDesc(1, [8, 16], llm.DataType.DT_UINT8, llm.Placement.DEVICE)  # 8 blocks of 16 B


@pytest.fixture
def made() -> Iterator[list[Any]]:
    engines: list[Any] = []
    llm.reset_metrics()
    yield engines
    for e in engines:
        e.close()
    llm.reset_metrics()


def make(made: list[Any], cluster_id: int, *, listen: bool = False) -> Any:
    config = EngineConfig(cluster_id=cluster_id, role=1 if listen else 2, transport="tcp",
                          listen=("127.0.0.1", 0) if listen else None,
                          remote_cache_accessible=True)
    engine = native.NativeEngine(config)
    made.append(engine)
    return engine


def blocks(engine: Any, model_id: int, seed: int | None) -> tuple[CacheManager, Any, np.ndarray]:
    arr = np.zeros((1, 128), np.uint8)
    if seed is not None:
        arr[...] = np.random.default_rng(seed).integers(0, 256, arr.shape, dtype=np.uint8)
    cm = CacheManager(engine, remote_cache_accessible=True)
    cache = cm.register_blocks_cache(DESC, [int(arr[0].ctypes.data)],
                                     llm.BlocksCacheKey(engine.config.cluster_id, model_id))
    return cm, cache, arr


def owner_and_reader(made: list[Any]) -> tuple[Any, Any, Any, Any]:
    owner = make(made, OWNER, listen=True)
    _, _, src = blocks(owner, 7, seed=3)
    reader = make(made, READER)
    reader.link(OWNER, *owner.listen_address, 5.0)
    cm, dst, _ = blocks(reader, 1, seed=None)
    return owner, reader, cm, dst


def test_a_native_owner_counts_what_it_serves(made: list[Any]) -> None:
    """Before: the core counted nothing it served (serve_read, serve_write were missing from
    ``datadist.metrics()``); the reader's pulls were counted by Python only."""
    _, _, cm, dst = owner_and_reader(made)
    key = llm.BlocksCacheKey(OWNER, 7)
    cm.pull_blocks(key, dst, [0, 1, 2], [0, 1, 2])
    cm.pull_blocks(key, dst, [5], [7])
    with pytest.raises(llm.LLMException):  # no model id 99 on the owner: refused, counted
        cm.pull_blocks(llm.BlocksCacheKey(OWNER, 99), dst, [0], [0])
    cm.push_blocks(key, dst, [0], [6])

    m = llm.metrics()
    served = m["links"][READER]["serve_read"]
    assert served["transfers"] == 3 and served["bytes"] == 4 * 16
    assert served["errors"] == {"LLM_KV_CACHE_NOT_EXIST": 1}
    assert max(served["latency_buckets"].values()) == 3 and served["p50_s"] is not None
    written = m["links"][READER]["serve_write"]
    assert written["transfers"] == 1 and written["bytes"] == 16 and written["errors"] == {}
    pulled = m["links"][OWNER]["pull"]  # the reader's side, counted by the core too
    assert pulled["transfers"] == 3 and pulled["bytes"] == 4 * 16
    assert pulled["errors"] == {"LLM_KV_CACHE_NOT_EXIST": 1}
    assert m["links"][OWNER]["push"]["bytes"] == 16
    assert m["total"]["serve_read"]["transfers"] == 3


def test_a_native_owner_answers_stats_with_the_asking_peers_series_only(made: list[Any]) -> None:
    """Before: a native owner did not speak STATS (the core refused type 21 at the header and
    closed the link) and NativeEngine had no peer_stats. Now a reader gets its own series,
    never another peer's."""
    owner, reader, cm, dst = owner_and_reader(made)
    other = make(made, OTHER)
    other.link(OWNER, *owner.listen_address, 5.0)
    ocm, odst, _ = blocks(other, 2, seed=None)
    ocm.pull_blocks(llm.BlocksCacheKey(OWNER, 7), odst, [3], [3])
    cm.pull_blocks(llm.BlocksCacheKey(OWNER, 7), dst, [1, 2], [1, 2])

    seen = reader.peer_stats(OWNER, 5.0)
    assert seen["cluster_id"] == OWNER and seen["role"] == 1
    assert set(seen["links"]) == {str(READER)}
    assert seen["total"] == seen["links"][str(READER)]
    mine = seen["total"]["serve_read"]
    assert mine["transfers"] == 1 and mine["bytes"] == 2 * 16 and mine["errors"] == {}
    # core/metrics.py's Series.snapshot() keys, with the bucket bounds as json.dumps writes them
    assert set(mine) == {"transfers", "bytes", "errors", "seconds", "latency_buckets",
                         "p50_s", "p99_s"}
    assert list(mine["latency_buckets"])[:4] == ["1e-05", "2.5e-05", "5e-05", "0.0001"]
    assert list(mine["latency_buckets"])[-1] == "100.0" and mine["p99_s"] >= mine["p50_s"]
    assert f'"{OTHER}"' not in json.dumps(seen)  # as a key anywhere (digits may be durations)
    assert set(other.peer_stats(OWNER, 5.0)["links"]) == {str(OTHER)}
    # The process itself sees everyone (stats() is the whole process).
    assert {str(READER), str(OTHER)} <= set(owner.stats()["links"])


def test_the_prometheus_collector_reads_the_core(made: list[Any]) -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    _, _, cm, dst = owner_and_reader(made)
    cm.pull_blocks(llm.BlocksCacheKey(OWNER, 7), dst, [4, 5], [0, 1])
    registry = prometheus_client.CollectorRegistry()
    registry.register(llm.metrics_collector())
    served = f'datadist_transfers_total{{cluster_id="{READER}",op="serve_read"}} 1.0'
    # The owner counts a read once its answer is sent, on its own I/O thread: the puller may
    # return (it holds the GIL throughout a leased or quick pull) before that count lands.
    deadline = time.monotonic() + 10.0
    text = prometheus_client.generate_latest(registry).decode()
    while served not in text and time.monotonic() < deadline:
        time.sleep(0.01)
        text = prometheus_client.generate_latest(registry).decode()
    assert served in text
    assert f'datadist_transfer_bytes_total{{cluster_id="{READER}",op="serve_read"}} 32.0' in text
    assert f'datadist_transfer_bytes_total{{cluster_id="{OWNER}",op="pull"}} 32.0' in text


def test_an_issued_pull_is_counted_when_it_ends_unpolled(made: list[Any]) -> None:
    """Before: an asynchronous pull was counted when its handle was polled (done / wait);
    one nobody polled was never counted. The core's worker counts it as it ends."""
    _, _, cm, dst = owner_and_reader(made)
    handle = cm.pull_blocks_async(llm.BlocksCacheKey(OWNER, 7), dst, [2], [2])
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        pulls = llm.metrics()["total"].get("pull", {})
        if pulls.get("transfers"):
            break
        time.sleep(0.01)
    assert pulls.get("transfers") == 1 and pulls.get("bytes") == 16
    handle.wait(5.0)
    assert llm.metrics()["total"]["pull"]["transfers"] == 1  # polling adds nothing

