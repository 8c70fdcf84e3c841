"""``llm_datadist.v2.llm_types`` under its own name: descriptions, caches, keys and the
async-transfer types (``from llm_datadist.v2.llm_types import Cache, CacheDesc, ...``)."""

from datadist.api.enums import Memtype as Memtype
from datadist.api.enums import Placement
from datadist.api.enums import RegisterMemStatus as RegisterMemStatus
from datadist.api.tasks import CacheTask
from datadist.api.types import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    KvCache,
    LayerSynchronizer,
    TransferConfig,
)
from datadist.api.types import MemInfo as MemInfo
from datadist.api.types import TransferWithCacheKeyConfig as TransferWithCacheKeyConfig
from datadist.api.types import check_layer_range as check_layer_range

# llm_datadist's own __all__ for this module (the other names import all the same).
__all__ = ["CacheDesc", "CacheKey", "CacheKeyByIdAndIndex", "KvCache", "BlocksCacheKey",
           "Placement", "CacheTask", "TransferConfig", "LayerSynchronizer", "Cache"]
