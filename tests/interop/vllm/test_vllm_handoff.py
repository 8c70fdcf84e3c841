"""When a step's holds happen, against vLLM's own step order (needs vLLM; no engine).

vLLM 0.32 calls ``start_load_kv`` after a step's forward when no load is synchronous
(``KVConnectorModelRunnerMixin._get_kv_connector_output``). A prefill engine that finished a
request and then spent seconds on another request's prefill marked the finished request HELD
only after that forward: the decoder, which may read the mark once the prefill answered,
gave up after ``hold_grace_s`` and recomputed (the bench's steady-rate mode found it). The
connector now starts a step's holds and pulls when vLLM binds the step's metadata, before
the forward. This test runs vLLM's real context manager with a real producer worker and
looks at the mailbox from inside the "forward".
"""

from __future__ import annotations

import importlib.util
import warnings
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import datadist as llm_datadist
from datadist.integrations.vllm import mailbox
from datadist.integrations.vllm.scheduler import SendTask, StepMeta
from datadist.integrations.vllm.settings import Settings
from datadist.integrations.vllm.worker import DatadistWorker, KvLayout

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="needs vLLM")]

TAG = "3c" * 16
SLOT = 7


def _vllm() -> tuple[Any, Any, Any]:
    """(DatadistConnector, DatadistConnectorMetadata, vLLM's model-runner mixin module);
    vLLM's import warns (deprecations), which this suite turns into errors."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from vllm.v1.worker import kv_connector_model_runner_mixin as mixin

        from datadist.integrations.vllm.connector import (
            DatadistConnector,
            DatadistConnectorMetadata,
        )
    return DatadistConnector, DatadistConnectorMetadata, mixin


def _connector(cls: Any, worker: DatadistWorker) -> Any:
    """A worker-role connector around ``worker`` (vLLM's config-driven __init__ skipped: it
    only picks the role and settings, set here)."""
    conn = cls.__new__(cls)
    conn._connector_metadata = None
    conn.settings = worker.settings
    conn._worker = worker
    conn._sched = None
    conn._trace = False
    conn._lw_meta = None
    conn._started = None
    conn._early = (set(), set())
    conn._layer_index = {}
    conn._kv_tensors = []
    conn._staging = None  # host KV: nothing staged
    conn._block_size = 4
    return conn


def test_a_finished_request_is_held_before_the_next_steps_forward(monkeypatch):
    connector_cls, meta_cls, mixin = _vllm()
    arrs = [np.zeros((4, 2, 32, 8), np.float32) for _ in range(2)]
    worker = DatadistWorker(Settings(), producer=True, consumer=False)
    worker.start(KvLayout([a.ctypes.data for a in arrs], 4, (2, 32, 8),
                          llm_datadist.DataType.DT_FLOAT, 1))
    try:
        conn = _connector(connector_cls, worker)
        monkeypatch.setattr(mixin, "get_kv_transfer_group", lambda: conn)
        monkeypatch.setattr(mixin, "get_forward_context", lambda: None)
        step = SimpleNamespace(
            kv_connector_metadata=meta_cls(
                StepMeta(send=[SendTask("p1", SLOT, TAG)])),
            has_sync_kv_loads=False, finished_req_ids=set())
        seen = []
        with mixin.KVConnectorModelRunnerMixin._get_kv_connector_output(step) as out:
            # the step's forward runs here (seconds, with another request's long prefill)
            seen.append(mailbox.decode(worker._mailbox.buf[SLOT]))
        assert seen == [(bytes.fromhex(TAG), mailbox.HELD)]
        assert not out.finished_sending  # held for its decoder, not freed
        # the step's own start_load_kv (after the forward) does not hold it twice
        assert len(worker._held) == 1
    finally:
        worker.close()
