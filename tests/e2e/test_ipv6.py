"""Links, pulls and pushes between two processes over IPv6 (issue 22 item 8).

The original takes an IPv6 listen address written in brackets, "[::1]:26000"
(hicann/hixl src/llm_datadist/common/llm_utils.cc, ``LLMUtils::ParseListenIpInfo``, and
src/hixl/common/hixl_utils.cc, ``CheckIp``: IPv4 or IPv6). datadist takes IPv6 for every
address of both APIs: the listener, ``LLMClusterInfo``'s ip infos, unlink, and the CLI's
``--peer``. The same-host decision (shared memory or cross-memory attach instead of TCP) goes
by the peer's boot id, so it holds over ``::1`` and over any IPv6 address of this host.

Skipped where the host has no IPv6 loopback.
"""

from __future__ import annotations

import itertools
import socket

import numpy as np
import pytest

import datadist as llm_datadist
from datadist.testing.peers import CacheSpec, Decoder, PromptConfig, RunningPrompt, pattern

from ._support import PROMPT_ID, assert_bytes_equal, units

pytestmark = pytest.mark.timeout(30)

S = llm_datadist.LLMStatusCode
BLOCKS = CacheSpec(2, (64, 4, 64))  # 64 blocks of 512 B per tensor
_models = itertools.count(300)


def _can_bind(host: str) -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
        return True
    except OSError:
        return False


def _global_ipv6() -> str | None:
    """An IPv6 address of this host that is neither loopback nor link-local, if any."""
    try:
        with open("/proc/net/if_inet6") as f:
            rows = [line.split() for line in f]
    except OSError:
        return None
    for row in rows:
        addr = ":".join(row[0][i:i + 4] for i in range(0, 32, 4))
        text = socket.inet_ntop(socket.AF_INET6, socket.inet_pton(socket.AF_INET6, addr))
        if text != "::1" and not text.startswith("fe80") and _can_bind(text):
            return text
    return None


if not _can_bind("::1"):
    pytest.skip("no IPv6 loopback on this host", allow_module_level=True)

PROMPT_CONFIG = PromptConfig(PROMPT_ID + 60, listen_ip_info="[::1]:0",
                             remote_cache_accessible=True)


def _cluster(cluster_id: int, host: str, port: int) -> llm_datadist.LLMClusterInfo:
    info = llm_datadist.LLMClusterInfo()
    info.remote_cluster_id = cluster_id
    info.append_local_ip_info("::1", 0)
    info.append_remote_ip_info(host, port)
    return info


@pytest.fixture
def ipv6_decoder(transport: str, make_decoder, prompt: RunningPrompt) -> Decoder:
    dec = make_decoder(remote_cache_accessible=True)
    host, port = prompt.address
    code, codes = dec.dd.link_clusters([_cluster(prompt.cluster_id, host, port)], 3000)
    assert (code, codes) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
    dec._clusters[prompt.cluster_id] = _cluster(prompt.cluster_id, host, port)
    return dec


def test_the_prompt_listens_on_the_ipv6_loopback(prompt: RunningPrompt) -> None:
    host, port = prompt.address
    assert host == "::1" and port > 0


def test_pull_and_push_over_ipv6(ipv6_decoder: Decoder, prompt: RunningPrompt,
                                 transport: str) -> None:
    """Every byte of a pull and of a push over a link made to [::1], on every data path: the
    same-host paths (cma, shm) are chosen over ::1 as over 127.0.0.1."""
    dec = ipv6_decoder
    assert dec.path_name(prompt.cluster_id) == transport
    model, seed = next(_models), 7
    prompt.call("register_blocks_cache", spec=BLOCKS, seed=seed, model_id=model)
    key = llm_datadist.BlocksCacheKey(prompt.cluster_id, model)
    cache, arr = dec.local(BLOCKS, blocks=True)
    dec.cm.pull_blocks(key, cache, [1, 2, 40], [5, 6, 7])
    want = units(pattern(BLOCKS, seed), BLOCKS)
    assert_bytes_equal(units(arr, BLOCKS)[:, [5, 6, 7]], want[:, [1, 2, 40]])

    src, data = dec.local(BLOCKS, blocks=True)
    data[:] = np.random.default_rng(3).integers(0, 256, data.shape, dtype=np.uint8)
    dec.cm.push_blocks(key, src, [0, 1], [60, 61])
    back, got = dec.local(BLOCKS, blocks=True)
    dec.cm.pull_blocks(key, back, list(range(64)), list(range(64)))
    want = want.copy()
    want[:, [60, 61]] = units(data, BLOCKS)[:, [0, 1]]
    assert_bytes_equal(units(got, BLOCKS), want)


def test_auto_chooses_a_same_host_path_over_ipv6(make_decoder, prompt: RunningPrompt,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Unforced, a peer reached at ::1 (and at a global IPv6 address of this host, where it
    has one) is on this host: the link takes a same-host path, not TCP."""
    monkeypatch.delenv("DATADIST_TRANSPORT", raising=False)
    dec = make_decoder()
    host, port = prompt.address
    assert dec.dd.link_clusters([_cluster(prompt.cluster_id, host, port)], 3000)[0] == \
        S.LLM_SUCCESS
    dec._clusters[prompt.cluster_id] = _cluster(prompt.cluster_id, host, port)
    link = dec.dd.engine.links()[0]
    assert link.path_name != "tcp" and "same host" in link.reason, link.reason


def test_a_global_ipv6_address_of_this_host_is_the_same_host(
        make_decoder, monkeypatch: pytest.MonkeyPatch) -> None:
    addr = _global_ipv6()
    if addr is None:
        pytest.skip("no global IPv6 address on this host")
    from datadist.testing.peers import start_prompt

    from ._support import PROMPT_ENV

    owner = start_prompt(PromptConfig(PROMPT_ID + 61, listen_ip_info=f"[{addr}]:0"),
                         env=PROMPT_ENV)
    try:
        assert owner.address[0] == addr
        monkeypatch.delenv("DATADIST_TRANSPORT", raising=False)
        dec = make_decoder()
        info = _cluster(owner.cluster_id, *owner.address)
        assert dec.dd.link_clusters([info], 3000)[0] == S.LLM_SUCCESS
        dec._clusters[owner.cluster_id] = info
        link = dec.dd.engine.links()[0]
        assert link.path_name != "tcp" and "same host" in link.reason, link.reason
    finally:
        owner.close()


def test_unlink_over_ipv6(make_decoder, prompt: RunningPrompt,
                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Unlink without force tells the peer at its IPv6 address; a cluster not linked is
    LLM_SUCCESS when its listener answers at [::1], LLM_UNLINK_FAILED when nothing does."""
    monkeypatch.setenv("DATADIST_TRANSPORT", "tcp")
    dec = make_decoder()
    host, port = prompt.address
    info = _cluster(prompt.cluster_id, host, port)
    assert dec.dd.link_clusters([info], 3000)[0] == S.LLM_SUCCESS
    assert dec.dd.unlink_clusters([info], 3000) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
    assert dec.dd.engine.links() == []
    assert dec.dd.unlink_clusters([info], 3000) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::1", 0))
        closed = s.getsockname()[1]  # bound, not listening: refused
        nobody = _cluster(prompt.cluster_id, "::1", closed)
        assert dec.dd.unlink_clusters([nobody], 1000) == (S.LLM_UNLINK_FAILED,
                                                          [S.LLM_UNLINK_FAILED])


def test_cli_info_takes_a_bracketed_peer(prompt: RunningPrompt,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    from datadist import cli

    host, port = prompt.address
    assert cli.main(["info", "--peer", f"[{host}]:{port}", "--cluster-id",
                     str(prompt.cluster_id), "--own-id", "7"]) == 0
    out = capsys.readouterr().out
    assert f"link to cluster {prompt.cluster_id} at [::1]:{port}: path=" in out
