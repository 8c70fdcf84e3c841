"""What a user sees of a running datadist: transfer metrics (``datadist.metrics()`` and the
Prometheus collector) after real pulls between two processes, the counters' arithmetic, the
library's logger, and error messages that say what to set."""

from __future__ import annotations

import bisect
import logging

import pytest

import datadist as llm_datadist
from datadist.core.errors import LinkFailed
from datadist.core.metrics import BUCKETS, Series
from datadist.core.native import NativeEngine
from datadist.testing.peers import CacheSpec, Decoder, PromptConfig, RunningPrompt

from ._support import DECODER_ID, PROMPT_ID

pytestmark = pytest.mark.timeout(30)

BLOCKS = CacheSpec(2, (64, 4, 32))  # 2 tensors of 64 blocks x 256 B (fp16)
PROMPT_CONFIG = PromptConfig(PROMPT_ID, setup=(
    ("register_blocks_cache", {"spec": BLOCKS, "seed": 5, "model_id": 3}),))


@pytest.fixture(autouse=True)
def fresh_metrics():
    llm_datadist.reset_metrics()
    yield
    llm_datadist.reset_metrics()


def test_pulls_and_failures_are_counted_per_link(decoder: Decoder,
                                                 prompt: RunningPrompt) -> None:
    cache, _ = decoder.local(BLOCKS, blocks=True)
    key = llm_datadist.BlocksCacheKey(PROMPT_ID, 3)
    for n in (1, 4, 9):
        decoder.cm.pull_blocks(key, cache, list(range(n)), list(range(n)))
    with pytest.raises(llm_datadist.LLMException):  # no such model id on the prompt
        decoder.cm.pull_blocks(llm_datadist.BlocksCacheKey(PROMPT_ID, 99), cache, [0], [0])

    m = llm_datadist.metrics()
    pull = m["links"][PROMPT_ID]["pull"]
    assert pull["transfers"] == 4
    assert pull["bytes"] == (1 + 4 + 9) * 256 * 2  # successful pulls only, both tensors
    assert pull["errors"] == {"LLM_KV_CACHE_NOT_EXIST": 1}
    assert sum(pull["latency_buckets"].values()) >= 4 and pull["seconds"] > 0
    assert max(pull["latency_buckets"].values()) == 4  # cumulative: the last bucket has all
    assert pull["p50_s"] is not None and pull["p50_s"] <= pull["p99_s"]
    assert m["total"]["pull"]["transfers"] == 4 and "push" not in m["total"]


def test_prometheus_collector_exposes_the_same_counters(decoder: Decoder,
                                                        prompt: RunningPrompt) -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    cache, _ = decoder.local(BLOCKS, blocks=True)
    decoder.cm.pull_blocks(llm_datadist.BlocksCacheKey(PROMPT_ID, 3), cache, [5, 6], [1, 2])
    registry = prometheus_client.CollectorRegistry()
    registry.register(llm_datadist.metrics_collector())
    text = prometheus_client.generate_latest(registry).decode()
    labels = f'cluster_id="{PROMPT_ID}",op="pull"'
    assert f"datadist_transfers_total{{{labels}}} 1.0" in text
    assert f"datadist_transfer_bytes_total{{{labels}}} 1024.0" in text
    assert (f'datadist_transfer_seconds_bucket{{cluster_id="{PROMPT_ID}",le="+Inf",op="pull"}}'
            ' 1.0') in text
    assert f"datadist_transfer_seconds_count{{{labels}}} 1.0" in text


def test_series_arithmetic() -> None:
    """A series as the core hands it over (per-bucket counts) reads as cumulative buckets
    and bucket-bound quantiles."""
    counts = [0] * (len(BUCKETS) + 1)
    for s in (5e-6, 3e-4, 3e-4, 2e-3, 500.0, 0.1):  # counts[i]: <= BUCKETS[i], > BUCKETS[i-1]
        counts[bisect.bisect_left(BUCKETS, s)] += 1
    push = Series(6, 500, {"LLM_TIMEOUT": 1}, counts, 500.1023).snapshot()
    assert push["transfers"] == 6 and push["bytes"] == 500
    assert push["errors"] == {"LLM_TIMEOUT": 1}
    assert push["latency_buckets"][BUCKETS[0]] == 1  # 5 us <= 10 us
    assert push["latency_buckets"][5e-4] == 3
    assert push["latency_buckets"][BUCKETS[-1]] == 5  # 500 s lies above every bucket
    assert push["p50_s"] == 5e-4 and push["p99_s"] == float("inf")
    assert Series().snapshot()["p50_s"] is None


def test_the_library_logs_under_one_logger_with_a_null_handler() -> None:
    root = logging.getLogger("datadist")
    assert any(isinstance(h, logging.NullHandler) for h in root.handlers)
    from datadist.api import llm_datadist as facade
    from datadist.core import comm, native
    from datadist.memory import pool

    for mod in (facade, native, comm, pool):  # the core's own messages: "datadist.native"
        assert mod.log.name.startswith("datadist.")


def test_what_is_missing_is_named(make_decoder, prompt: RunningPrompt) -> None:
    """A newcomer's two first mistakes get messages that say what to set: a PROMPT that does
    not listen, and a pull by a key the PROMPT never registered."""
    import socket

    with socket.socket() as s:  # a port where nothing listens
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    dec = make_decoder()
    with pytest.raises(LinkFailed) as info:  # LLM_LINK_FAILED, naming what to set
        dec.dd.engine.link(PROMPT_ID, "127.0.0.1", dead, 2.0)
    assert "listen_ip_info" in str(info.value)
    assert dec.link(prompt.cluster_id, prompt.address) == llm_datadist.LLMStatusCode.LLM_SUCCESS
    cache, _ = dec.local(BLOCKS, blocks=True)
    with pytest.raises(llm_datadist.LLMException) as info:
        dec.cm.pull_blocks(llm_datadist.BlocksCacheKey(PROMPT_ID, 42), cache, [0], [0])
    assert info.value.status_code == llm_datadist.LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    assert "register_blocks_cache with BlocksCacheKey" in str(info.value)
    with pytest.raises(llm_datadist.LLMException) as info:
        dec.cm.pull_blocks(llm_datadist.CacheKey(PROMPT_ID, 777, 0), cache, (), [0])
    assert info.value.status_code == llm_datadist.LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    assert "with that CacheKey" in str(info.value)


def test_a_peer_reports_what_it_served(make_decoder, prompt: RunningPrompt, transport: str,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    """The owner counts the requests it serves (serve_read, per peer cluster id, refusals
    with their status code), and answers a StatsRequest over the link: what ``datadist info
    --peer`` prints for a running process. On the same host a BlocksCacheKey is read under a
    whole-cache lease: the owner counts the lease (serve_lease), not the reads. The decoder
    and ``info --peer`` run on the core."""
    decoder: Decoder = make_decoder()
    assert decoder.link(prompt.cluster_id, prompt.address) == \
        llm_datadist.LLMStatusCode.LLM_SUCCESS
    assert decoder.path_name(prompt.cluster_id) == transport
    assert isinstance(decoder.dd.engine, NativeEngine)
    op = "serve_lease" if transport in ("cma", "shm") else "serve_read"
    cache, _ = decoder.local(BLOCKS, blocks=True)
    key = llm_datadist.BlocksCacheKey(PROMPT_ID, 3)
    before = decoder.dd.engine.peer_stats(PROMPT_ID, 5.0)
    seen0 = before["links"].get(str(DECODER_ID), {}).get(op, {}) or {}
    decoder.cm.pull_blocks(key, cache, [1, 2, 3], [4, 5, 6])
    decoder.cm.pull_blocks(key, cache, [7], [8])
    with pytest.raises(llm_datadist.LLMException):
        decoder.cm.pull_blocks(llm_datadist.BlocksCacheKey(PROMPT_ID, 98), cache, [0], [0])
    stats = decoder.dd.engine.peer_stats(PROMPT_ID, 5.0)
    assert stats["cluster_id"] == PROMPT_ID
    mine = stats["links"][str(DECODER_ID)][op]  # our cluster id, as the owner sees us
    if transport == "nixl":  # the first pull asks; the second may read under a NIXL lease
        assert mine["bytes"] - seen0.get("bytes", 0) in (3 * 256 * 2, 4 * 256 * 2)
    elif op == "serve_read":
        assert mine["bytes"] - seen0.get("bytes", 0) == 4 * 256 * 2
    else:  # one lease for both pulls, and the refused one
        assert mine["transfers"] - seen0.get("transfers", 0) == 2
    assert mine["errors"].get("LLM_KV_CACHE_NOT_EXIST", 0) >= 1

    from datadist import cli

    host, port = prompt.address
    assert cli.main(["info", "--peer", f"{host}:{port}", "--cluster-id", str(PROMPT_ID)]) == 0
    out = capsys.readouterr().out
    assert f"peer metrics: cluster {PROMPT_ID}" in out
    assert f"peer metrics: cluster {PROMPT_ID}, role PROMPT" in out  # a name, not 1
    # The CLI links as a cluster of its own: the PROMPT tells it about its own link only,
    # never about the decoder's (issue 21 item 4: STATS was a side channel on other peers).
    assert f"cluster {DECODER_ID}" not in out and "LLM_KV_CACHE_NOT_EXIST" not in out
    # What the decoder's own link shows, as the CLI prints it.
    shown = "\n".join(cli.metrics_lines(stats))
    assert f"{op} with cluster {DECODER_ID}:" in shown and "LLM_KV_CACHE_NOT_EXIST" in shown
    if op == "serve_lease":  # not "N transfers, 0 bytes": the owner cannot see those reads
        assert "leases granted" in shown and "the reader counts" in shown
        leases = [ln for ln in shown.splitlines() if ln.strip().startswith("serve_lease")]
        assert leases and not any(" 0 bytes" in ln for ln in leases), leases
