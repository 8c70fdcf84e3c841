"""Fixtures for the API tests: two engines in this process, linked both ways.

Most behaviour of copies, layer-wise transfers, two-sided links and the legacy manager is
visible with two core engines (``NativeEngine``) in one process (the one-instance rule is
LLMDataDist's, not the engine's); each gets the facade it needs (``CacheManager`` /
``KvCacheManager``) directly.
Tests that need the real ``LLMDataDist`` take ``make_datadist`` (always finalized) or run a
peer process (see ``_peer.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

import datadist as llm
from datadist.api.cache_manager import CacheManager
from datadist.core.config import EngineConfig
from datadist.core.native import NativeEngine
from datadist.memory.pool import PoolConfig

from ._support import DECODER_ID, PROMPT_ID, Side


@pytest.fixture
def make_side() -> Iterator[Callable[..., Side]]:
    made: list[NativeEngine] = []

    def make(cluster_id: int, *, listen: bool = True, remote_cache_accessible: bool = False,
             pool: int = 0, role: int = 1, sync_timeout: float = 2.0) -> Side:
        engine = NativeEngine(EngineConfig(
            cluster_id=cluster_id, role=role, listen=("127.0.0.1", 0) if listen else None,
            sync_timeout=sync_timeout,
            device_pool=PoolConfig(pool, 12) if pool else None))
        made.append(engine)
        return Side(engine, CacheManager(engine, remote_cache_accessible=remote_cache_accessible))

    yield make
    for engine in made:
        engine.close()


@pytest.fixture
def pair(make_side: Callable[..., Side]) -> tuple[Side, Side]:
    """A PROMPT and a DECODER engine, each linked to the other (plain cache-manager mode)."""
    return _linked(make_side, False)


@pytest.fixture
def ra_pair(make_side: Callable[..., Side]) -> tuple[Side, Side]:
    """As ``pair``, with remote-cache-accessible on (push by key)."""
    return _linked(make_side, True)


def _linked(make_side: Callable[..., Side], ra: bool) -> tuple[Side, Side]:
    p = make_side(PROMPT_ID, remote_cache_accessible=ra)
    d = make_side(DECODER_ID, remote_cache_accessible=ra, role=2)
    d.engine.link(PROMPT_ID, *p.engine.listen_address, 5.0)
    p.engine.link(DECODER_ID, *d.engine.listen_address, 5.0)
    return p, d


@pytest.fixture
def make_datadist() -> Iterator[Callable[..., llm.LLMDataDist]]:
    """Real LLMDataDist instances (one initialized at a time), finalized at teardown."""
    made: list[llm.LLMDataDist] = []

    def make(options: dict[str, str], role: llm.LLMRole = llm.LLMRole.PROMPT,
             cluster_id: int = PROMPT_ID) -> llm.LLMDataDist:
        dd = llm.LLMDataDist(role, cluster_id)
        dd.init(dict(options))
        made.append(dd)
        return dd

    yield make
    for dd in made:
        dd.finalize()
