"""A DatadistConnector that scrambles the KV it pulled for chosen requests (test control).

The test writes prefill request ids, one a line, into the file named by
``kv_connector_extra_config["test_corrupt_file"]``; a pulled request whose prefill id is listed
gets random values in every layer of its blocks. Tokens that still match the reference would
mean the decoder did not use the transferred KV.
"""

from __future__ import annotations

from pathlib import Path

import torch

from datadist.integrations.vllm.connector import DatadistConnector
from datadist.integrations.vllm.scheduler import RecvTask


class CorruptingDatadistConnector(DatadistConnector):
    def _on_pulled(self, task: RecvTask) -> None:
        path = self._kv_transfer_config.kv_connector_extra_config.get("test_corrupt_file")
        if not path or not Path(path).exists():
            return
        if task.remote.request_id not in Path(path).read_text().split():
            return
        gen = torch.Generator().manual_seed(0)
        for t in self._kv_tensors:
            for b in task.local_block_ids:
                t[b].copy_(torch.randn(t[b].shape, generator=gen, dtype=torch.float32)
                           .to(t.dtype) * 4)
