"""``local_comm_res`` is checked when linking, as the original parses it then (issue 38,
item 15).

hicann/hixl tests/cpp/llm_datadist/llm_datadist_v2_api_unittest.cc,
``TestLocalCommResInvalidJson`` / ``TestLocalCommResInvalidVersion``: init accepts a value
that is not JSON, or of version "1.9"; the link fails (src/llm_datadist/common/
rank_table_generator.cc, ``RankTableGeneratorFactory::Create``: at most 64 KiB, JSON, a string
"version" of "1.0" or "1.2", else LLM_PARAM_INVALID from ``LinkMsgHandler::GenerateRankInfo``
on both ends). Here the listener is an engine of this process with its own llm.LocalCommRes.
"""

from __future__ import annotations

import json
import warnings

import pytest

import datadist as llm
from datadist.core.config import EngineConfig
from datadist.core.native import NativeEngine

pytestmark = pytest.mark.timeout(60)

S = llm.LLMStatusCode


def comm_res(version: str = "1.0", *, broken: bool = False) -> str:
    text = json.dumps({"server_count": "1", "server_list": [{"device": [
        {"device_id": "0", "device_ip": "1.1.1.1"}], "server_id": "127.0.0.1"}],
        "status": "completed", "version": version})
    return text.replace('"0",', '"0",xxxxxxxxxxxxxxx') if broken else text


@pytest.fixture
def listener():
    """A PROMPT's engine (cluster 1) whose llm.LocalCommRes the test sets."""
    eng = NativeEngine(EngineConfig(cluster_id=1, role=1, listen=("127.0.0.1", 0)))
    yield eng
    eng.close()


def link(listener: NativeEngine, own: str | None) -> tuple[S, list[S], llm.LLMDataDist]:
    cfg = llm.LLMConfig()
    if own is not None:
        cfg.local_comm_res = own
    else:
        cfg.enable_cache_manager = True
    d = llm.LLMDataDist(llm.LLMRole.DECODER, 2)
    d.init(cfg.generate_options())  # accepted whatever it holds, as the original
    info = llm.LLMClusterInfo()
    info.remote_cluster_id = 1
    info.append_local_ip_info("127.0.0.1", 0)
    info.append_remote_ip_info(*listener.listen_address)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", llm.LinkFailedWarning)
        ret, rets = d.link_clusters([info], 3000)
    return ret, rets, d


@pytest.mark.parametrize("peer, why", [
    (comm_res(broken=True), "the llm.LocalCommRes of cluster 1 (the peer) is not valid: it is "
                            "not JSON"),
    (comm_res("1.9"), 'its version "1.9" is not one CANN knows'),
])
def test_the_listeners_bad_value_fails_the_link(listener, peer, why) -> None:
    listener.set_local_comm_res(peer)
    ret, rets, d = link(listener, comm_res())
    try:
        assert (ret, rets) == (S.LLM_PARAM_INVALID, [S.LLM_PARAM_INVALID])
        assert why in (d.last_link_failure(1) or "")
        assert d.engine.links() == []  # nothing kept of the refused link
    finally:
        d.finalize()


@pytest.mark.parametrize("own, why", [
    (comm_res(broken=True), "it is not JSON"),
    (comm_res("2.0"), 'its version "2.0"'),
    ('{"version": 1.0}', '"version" is not a string'),
    ("[]", "not a JSON object"),
    ("x" * (64 * 1024 + 1), "over the limit of 65536 bytes"),
])
def test_our_own_bad_value_fails_the_link(listener, own, why) -> None:
    ret, rets, d = link(listener, own)
    try:
        assert (ret, rets) == (S.LLM_PARAM_INVALID, [S.LLM_PARAM_INVALID])
        text = d.last_link_failure(1) or ""
        assert "our llm.LocalCommRes is not valid" in text and why in text
    finally:
        d.finalize()


@pytest.mark.parametrize("peer, own", [
    (comm_res(), comm_res()), (comm_res("1.2"), comm_res("1.0")), (comm_res(), ""),
    (None, ""),  # a listener that never set it
])
def test_good_values_link(listener, peer, own) -> None:
    if peer is not None:
        listener.set_local_comm_res(peer)
    ret, rets, d = link(listener, own)
    try:
        assert (ret, rets) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
    finally:
        d.finalize()


def test_a_linker_without_local_comm_res_does_not_ask(listener) -> None:
    # Only an end that sets local_comm_res compares (docs/compatibility.md).
    listener.set_local_comm_res(comm_res("1.9"))
    ret, _, d = link(listener, None)
    d.finalize()
    assert ret == S.LLM_SUCCESS


def test_the_hixl_backends_format_is_not_checked(listener) -> None:
    # With llm.TransferBackend = "hixl" the original reads local_comm_res as HIXL's endpoint
    # list (hixl src/hixl/engine/endpoint_generator/endpoint_generator.cc, version "1.3"),
    # not through RankTableGeneratorFactory: such a value links.
    hixl_res = json.dumps({"net_instance_id": "superpod1_1", "endpoint_list": [
        {"protocol": "roce", "comm_id": "127.0.0.1", "placement": "host"}], "version": "1.3"})
    cfg = llm.LLMConfig()
    cfg.local_comm_res = hixl_res
    cfg.transfer_backend = "hixl"
    cfg.listen_ip_info = "127.0.0.1:0"
    d = llm.LLMDataDist(llm.LLMRole.DECODER, 2)
    d.init(cfg.generate_options())
    try:
        info = llm.LLMClusterInfo()
        info.remote_cluster_id = 1
        info.append_remote_ip_info(*listener.listen_address)
        assert d.link_clusters([info], 3000) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
    finally:
        d.finalize()
