"""vLLM V1 KV connector on datadist (disaggregated prefill/decode).

Load it in vLLM with::

    KVTransferConfig(kv_connector="DatadistConnector",
                     kv_connector_module_path="datadist.integrations.vllm",
                     kv_role="kv_producer" | "kv_consumer" | "kv_both")

Only ``DatadistConnector`` needs vLLM; it is imported on first access, so the vLLM-free parts
(settings, scheduler bookkeeping, the datadist worker) import without vLLM installed.
See docs/vllm.md.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DatadistConnector"]


def __getattr__(name: str) -> Any:
    if name == "DatadistConnector":
        from datadist.integrations.vllm.connector import DatadistConnector

        return DatadistConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
