"""The calls group's per-layer row (``datadist.bench.calls``) times datadist's calls, not the
making of their arguments: its 32 per-layer pulls and its one pull of every layer pass the
same key and block list objects every call, made once before timing, as a layer-wise caller
makes them once a request. Driven with a recording cache manager; nothing is timed."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import datadist as llm
from datadist.bench import calls
from datadist.bench.harness import LAYER_BLOCKS, LAYERS, LAYERS_MODEL, OWNER_ID


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def pull_blocks(self, key: Any, cache: Any, src: Any, dst: Any, **kwargs: Any) -> None:
        self.calls.append((key, cache, src, dst, kwargs))


def test_per_layer_pulls_pass_arguments_made_once() -> None:
    cm, cache = _Recorder(), object()
    puller = SimpleNamespace(dd=SimpleNamespace(cache_manager=cm), layers=cache, ll=llm)
    per_layer, every_layer = calls._layer_pulls(puller)  # type: ignore[arg-type]
    assert cm.calls == []  # nothing pulled while the arguments are made
    per_layer()
    per_layer()
    every_layer()
    assert len(cm.calls) == 2 * LAYERS + 1
    keys = {id(c[0]) for c in cm.calls}
    lists = {id(c[2]) for c in cm.calls} | {id(c[3]) for c in cm.calls}
    assert len(keys) == 1 and len(lists) == 1  # one key and one block list, every call
    key, got_cache, blocks = cm.calls[0][0], cm.calls[0][1], cm.calls[0][2]
    assert (key.cluster_id, key.model_id) == (OWNER_ID, LAYERS_MODEL) and got_cache is cache
    assert blocks == list(range(LAYER_BLOCKS))
    # layer i in turn, its range on both sides; then every layer, no ranges
    for i, c in enumerate(cm.calls[:LAYERS]):
        assert c[4] == {"src_layer_range": range(i, i + 1), "dst_layer_range": range(i, i + 1)}
    assert cm.calls[LAYERS:2 * LAYERS] == cm.calls[:LAYERS]
    assert cm.calls[-1][4] == {}
