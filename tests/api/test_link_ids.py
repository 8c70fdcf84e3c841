"""Which id a link is known by, and the HIXL backend's unlink (issue 22, items 1 and 2).

A real ``LLMDataDist`` links to a listening engine of this process (``make_side``).

- hicann/hixl src/llm_datadist/link_mgr/link_msg_handler.cc, ``ExchangeInfoProcess``: the
  default backend files a link under the cluster id the peer reports
  (``AddEntity(peer_exchange_info.cluster_id, ...)``) and never compares it with the
  ``remote_cluster_id`` the caller passed.
- hicann/hixl src/llm_datadist/transfer_engine/hixl_transfer_engine.cc,
  ``HixlTransferEngine::UnlinkCluster``: with ``llm.TransferBackend = "hixl"`` an unlink
  destroys the link of ``remote_cluster_id`` alone; no ip info, ``force`` ignored, nothing to
  destroy is a success (``CommEntityManager::DestroyEntity``).
"""

from __future__ import annotations

import numpy as np
import pytest

import datadist as llm

from ._support import DECODER_ID, PROMPT_ID, code, units

pytestmark = pytest.mark.timeout(60)

S = llm.LLMStatusCode


def cluster(remote_id: int, address: tuple[str, int] | None) -> llm.LLMClusterInfo:
    c = llm.LLMClusterInfo()
    c.remote_cluster_id = remote_id
    if address is not None:
        c.append_local_ip_info("127.0.0.1", 0)
        c.append_remote_ip_info(*address)
    return c


def decoder_options(hixl: bool = False) -> dict[str, str]:
    cfg = llm.LLMConfig()
    cfg.enable_cache_manager = True
    cfg.enable_remote_cache_accessible = True
    if hixl:
        cfg.transfer_backend = "hixl"
        cfg.listen_ip_info = "127.0.0.1:0"
    return cfg.generate_options()


def blocks_cache(dd: llm.LLMDataDist, keep: list[np.ndarray]) -> tuple[llm.Cache, np.ndarray]:
    desc = llm.CacheDesc(2, [4, 32], llm.DataType.DT_UINT8, llm.Placement.HOST)
    arr = np.zeros((2, desc.size), np.uint8)
    keep.append(arr)
    return dd.cache_manager.register_blocks_cache(
        desc, [int(arr[i].ctypes.data) for i in range(2)]), arr


class TestLinkedUnderTheAnnouncedId:
    def test_any_id_links_and_the_link_is_the_peers_id(self, make_side, make_datadist):
        p = make_side(PROMPT_ID, remote_cache_accessible=True)
        _, x = p.register(2, [4, 32], blocks=True, model_id=0, seed=3)
        d = make_datadist(decoder_options(), llm.LLMRole.DECODER, DECODER_ID)
        keep: list[np.ndarray] = []
        dst, y = blocks_cache(d, keep)
        ret, rets = d.link_clusters([cluster(0, p.engine.listen_address)], 3000)
        assert (ret, rets) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        # the id passed names no link (as in the original, which filed it under PROMPT_ID)
        with code(S.LLM_NOT_YET_LINK):
            d.cache_manager.pull_blocks(llm.BlocksCacheKey(0, 0), dst, [0], [0])
        d.cache_manager.pull_blocks(llm.BlocksCacheKey(PROMPT_ID, 0), dst, [1, 3], [0, 2])
        np.testing.assert_array_equal(units(y, 4)[:, [0, 2]], units(x, 4)[:, [1, 3]])
        # one link per peer: the same listener by its own id is already linked
        ret, rets = d.link_clusters([cluster(PROMPT_ID, p.engine.listen_address)], 3000)
        assert rets == [S.LLM_ALREADY_LINK]
        ret, rets = d.unlink_clusters([cluster(PROMPT_ID, p.engine.listen_address)], 3000)
        assert rets == [S.LLM_SUCCESS]
        assert not d.engine.has_links()

    def test_the_peer_knows_the_linker_by_its_own_id(self, make_side, make_datadist):
        p = make_side(PROMPT_ID, remote_cache_accessible=True)
        src, x = p.register(2, [4, 32], blocks=True, seed=5)
        d = make_datadist(decoder_options(), llm.LLMRole.DECODER, DECODER_ID)
        keep: list[np.ndarray] = []
        d.cache_manager.register_blocks_cache(
            llm.CacheDesc(2, [4, 32], llm.DataType.DT_UINT8, llm.Placement.HOST),
            [int(a.ctypes.data) for a in _zeros(keep)], llm.BlocksCacheKey(DECODER_ID, 0))
        assert d.link_clusters([cluster(12345, p.engine.listen_address)], 3000)[0] == \
            S.LLM_SUCCESS
        p.cm.push_blocks(llm.BlocksCacheKey(DECODER_ID, 0), src, [2], [1])
        np.testing.assert_array_equal(units(keep[0], 4)[:, 1], units(x, 4)[:, 2])


def _zeros(keep: list[np.ndarray]) -> list[np.ndarray]:
    arr = np.zeros((2, 128), np.uint8)
    keep.append(arr)
    return [arr[0], arr[1]]


class TestHixlUnlink:
    def test_no_address_and_force_ignored(self, make_side, make_datadist):
        p = make_side(PROMPT_ID, remote_cache_accessible=True)
        d = make_datadist(decoder_options(hixl=True), llm.LLMRole.DECODER, DECODER_ID)
        for force in (False, True):
            assert d.link_clusters([cluster(PROMPT_ID, p.engine.listen_address)], 3000)[0] == \
                S.LLM_SUCCESS
            assert p.engine.has_links()
            ret, rets = d.unlink_clusters([cluster(PROMPT_ID, None)], 3000, force=force)
            assert (ret, rets) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
            assert not d.engine.has_links()
            # told (BYE) whatever force said: the listener's end goes too
            _wait(lambda: not p.engine.has_links())

    def test_nothing_to_destroy_is_a_success(self, make_datadist):
        d = make_datadist(decoder_options(hixl=True), llm.LLMRole.DECODER, DECODER_ID)
        assert d.unlink_clusters([cluster(77, None)], 1000) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])

    def test_the_default_backend_keeps_its_rule(self, make_side, make_datadist):
        # LinkMsgHandler::UnlinkCluster: without force exactly one remote ip info
        p = make_side(PROMPT_ID, remote_cache_accessible=True)
        d = make_datadist(decoder_options(), llm.LLMRole.DECODER, DECODER_ID)
        assert d.link_clusters([cluster(PROMPT_ID, p.engine.listen_address)], 3000)[0] == \
            S.LLM_SUCCESS
        assert d.unlink_clusters([cluster(PROMPT_ID, None)], 1000)[1] == [S.LLM_PARAM_INVALID]
        assert d.engine.has_links()


def _wait(pred, timeout: float = 5.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_a_shared_secret_is_proved_for_the_announced_id():
    """With a shared secret both sides prove it for the listener's own id: a link made with
    another id is still authenticated (and a wrong secret still fails)."""
    from datadist.core.config import EngineConfig
    from datadist.core.errors import LinkFailed
    from datadist.core.native import NativeEngine

    engines = [NativeEngine(EngineConfig(cluster_id=PROMPT_ID, role=1,
                                         listen=("127.0.0.1", 0), secret=b"s3cret"))]
    try:
        for secret, ok in ((b"s3cret", True), (b"wrong", False)):
            d = NativeEngine(EngineConfig(cluster_id=DECODER_ID, role=2, secret=secret))
            engines.append(d)
            if ok:
                link = d.link(0, *engines[0].listen_address, 5.0, as_announced=True)
                assert link.cluster_id == PROMPT_ID
            else:
                with pytest.raises(LinkFailed):
                    d.link(0, *engines[0].listen_address, 5.0, as_announced=True)
    finally:
        for e in engines:
            e.close()
