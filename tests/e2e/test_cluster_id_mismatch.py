"""A wrong ``remote_cluster_id`` (issue 38, item 1), between two real processes.

What the original does (hicann/hixl src/llm_datadist/link_mgr/link_msg_handler.cc,
``LinkMsgHandler::LinkCluster`` then ``ExchangeInfoProcess``): the link succeeds and is filed
under the cluster id the peer answers (``AddEntity(peer_exchange_info.cluster_id, ...)``);
the id passed is never compared with it, so a transfer naming that id finds no link
(LLM_NOT_YET_LINK). datadist does the same, and says so: a ``ClusterIdMismatchWarning``
names both ids, attributed to the caller's line.
"""

from __future__ import annotations

import inspect
import warnings

import pytest

import datadist as llm
from datadist.testing.peers import CacheSpec, Decoder, PromptConfig, RunningPrompt

from ._support import PROMPT_ID

pytestmark = pytest.mark.timeout(60)

S = llm.LLMStatusCode
WRONG_ID = PROMPT_ID + 7
BLOCKS = CacheSpec(2, (8, 64))
PROMPT_CONFIG = PromptConfig(
    PROMPT_ID,
    setup=(("register_blocks_cache", {"spec": BLOCKS, "seed": 5, "model_id": 0}),),
)
PROMPT_SERVES_NIXL = False


def test_a_wrong_cluster_id_links_with_a_warning_naming_both_ids(
        make_decoder, prompt: RunningPrompt) -> None:
    dec: Decoder = make_decoder()
    info = dec.cluster(WRONG_ID, prompt.address)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
        ret, rets = dec.dd.link_clusters([info], 3000)  # the line the warning names
    assert (ret, rets) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])  # as the original
    mismatch = [w for w in caught if issubclass(w.category, llm.ClusterIdMismatchWarning)]
    assert len(mismatch) == 1, [str(w.message) for w in caught]
    text = str(mismatch[0].message)
    assert f"answered as cluster {PROMPT_ID}" in text
    assert f"remote_cluster_id {WRONG_ID}" in text
    assert mismatch[0].filename == __file__ and mismatch[0].lineno == line
    # The link is the peer's id, as the warning says; the id asked for has none.
    assert [link.cluster_id for link in dec.dd.engine.links()] == [PROMPT_ID]
    dst, _ = dec.local(BLOCKS, blocks=True)
    with pytest.raises(llm.LLMException) as e:
        dec.cm.pull_blocks(llm.BlocksCacheKey(WRONG_ID, 0), dst, [0], [0])
    assert e.value.status_code is S.LLM_NOT_YET_LINK
    dec.cm.pull_blocks(llm.BlocksCacheKey(PROMPT_ID, 0), dst, [0], [0])
    dec.dd.unlink_clusters([dec.cluster(PROMPT_ID, prompt.address)], 3000)


def test_the_right_cluster_id_links_without_a_warning(make_decoder,
                                                      prompt: RunningPrompt) -> None:
    dec: Decoder = make_decoder()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert dec.link(PROMPT_ID, prompt.address) == S.LLM_SUCCESS
    assert [str(w.message) for w in caught
            if issubclass(w.category, llm.DatadistWarning)] == []
    dec.unlink(PROMPT_ID)
