"""The core's engine raises datadist's error classes for the core's codes that callers catch
by class (core/native.py ``_error``)."""

from __future__ import annotations

import pytest

from datadist.core import native
from datadist.core.config import EngineConfig
from datadist.core.errors import AlreadyLinked

pytestmark = [
    pytest.mark.timeout(30),
    pytest.mark.skipif(not native.available()[0], reason="the native core is not built"),
]


@pytest.mark.parametrize("as_announced", [False, True])
def test_linking_a_linked_cluster_again_is_already_linked(as_announced: bool) -> None:
    """link_clusters answers LLM_ALREADY_LINK only for AlreadyLinked, and a two-sided comm
    closes its duplicate on it. Before, the core's LLM_ALREADY_LINK came back as a
    RemoteError, which link_clusters reported as LLM_LINK_FAILED."""
    owner = native.NativeEngine(EngineConfig(cluster_id=1, role=1, listen=("127.0.0.1", 0)))
    puller = native.NativeEngine(EngineConfig(cluster_id=2, role=2))
    try:
        assert owner.listen_address is not None
        host, port = owner.listen_address
        assert puller.link(0 if as_announced else 1, host, port, 5.0,
                           as_announced=as_announced).cluster_id == 1
        with pytest.raises(AlreadyLinked):
            puller.link(1, host, port, 5.0, as_announced=as_announced)
    finally:
        puller.close()
        owner.close()
