"""datadist: the LLM-DataDist KV-cache transfer API for ordinary Linux hosts.

    import datadist as llm_datadist

Names, defaults, exceptions and status codes are llm_datadist's. Importing this package
starts nothing and imports neither torch nor CUDA.
"""

from __future__ import annotations

import logging
from typing import Any

from datadist.api.cache_manager import CacheManager
from datadist.api.config import LLMClusterInfo, LLMConfig, LlmConfig
from datadist.api.enums import DataType, LLMRole, Memtype, Placement, RegisterMemStatus
from datadist.api.llm_datadist import LLMDataDist
from datadist.api.metrics import metrics, metrics_collector, reset_metrics
from datadist.api.notices import (
    ClusterIdMismatchWarning,
    DatadistWarning,
    LinkFailedWarning,
    NotListeningWarning,
)
from datadist.api.status import LLMException, LLMStatusCode, Status
from datadist.api.tasks import CacheTask
from datadist.api.transfer_handle import TransferHandle as TransferHandle  # explicit re-export
from datadist.api.types import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    KvCache,
    LayerSynchronizer,
    MemInfo,
    TransferConfig,
    TransferWithCacheKeyConfig,
)
from datadist.core.threads import set_thread_cpus as set_thread_cpus  # explicit re-exports
from datadist.core.threads import thread_cpus as thread_cpus

__version__ = "0.1.0"
__datadist__ = True  # llm_datadist has no such attribute: tells the two apart

__all__ = [
    "LLMClusterInfo", "LLMStatusCode", "LLMException", "LLMRole", "LlmConfig", "LLMConfig",
    "DataType", "Status", "CacheDesc", "CacheKey", "CacheKeyByIdAndIndex", "KvCache", "Cache",
    "BlocksCacheKey", "LLMDataDist", "Placement", "RegisterMemStatus", "LayerSynchronizer",
    "TransferConfig", "CacheTask", "TransferWithCacheKeyConfig", "Memtype", "MemInfo",
    "TensorDesc", "Tensor", "KvCacheManager",
]

# llm_datadist's list of its v2 (cache-manager generation) names: __all__ less the v1 ones.
v2_list = [name for name in __all__ if name not in ("TensorDesc", "Tensor", "KvCacheManager")]

_LAZY_V1 = {"TensorDesc", "Tensor", "KvCacheManager"}
# llm_datadist's module paths (``llm_datadist.v2.llm_types`` ...) as datadist.<same path>;
# imported on first use.
_SUBMODULES = {"status", "configs", "data_type", "utils", "v2"}


def __getattr__(name: str) -> Any:
    if name in _LAZY_V1:
        from datadist.api import v1

        return getattr(v1, name)
    if name in _SUBMODULES:
        import importlib

        return importlib.import_module(f"datadist.{name}")
    raise AttributeError(f"module 'datadist' has no attribute {name!r}")


_: object = CacheManager  # re-exported for type hints; not in llm_datadist's __all__
# datadist's own extras, outside llm_datadist's __all__: metrics(), reset_metrics(),
# metrics_collector() (Prometheus), the warnings of api/notices.py, the TransferHandle that
# CacheManager's *_async transfers return, set_thread_cpus() / thread_cpus() (core/threads.py)
_ = (metrics, metrics_collector, reset_metrics, DatadistWarning, LinkFailedWarning,
     NotListeningWarning, ClusterIdMismatchWarning, TransferHandle, set_thread_cpus,
     thread_cpus)

# Every logger of the library hangs under "datadist"; the application decides where they go.
logging.getLogger("datadist").addHandler(logging.NullHandler())
