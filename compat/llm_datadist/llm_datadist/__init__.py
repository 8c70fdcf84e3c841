"""``llm_datadist`` on datadist: LLM-DataDist's import name over datadist, for code that
cannot change its imports. Installed only on purpose (``pip install ./compat/llm_datadist``).

Which one is loaded: ``getattr(llm_datadist, "__datadist__", False)`` is True only here (the
real package has no such attribute), and ``llm_datadist.__version__`` is datadist's version.

Every module path of llm_datadist (``llm_datadist.status``, ``llm_datadist.v2.llm_types``,
...) is the very module ``datadist.<same path>``: the same objects, whichever name imports
them. Importing this package refuses (ImportError) when it would hide a real llm_datadist
further down ``sys.path``, unless ``DATADIST_SHADOW_LLM_DATADIST=1``.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import sys


def _real_llm_datadist_hidden_by_us() -> str | None:
    """The directory of a real llm_datadist that this package hides, if any. The real one
    has a ``v2`` package inside; this one has none."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for entry in sys.path:
        if os.path.abspath(entry or os.curdir) == here:
            continue
        spec = importlib.machinery.PathFinder.find_spec(__name__, [entry])
        for location in (spec.submodule_search_locations or []) if spec else []:
            if os.path.isdir(os.path.join(location, "v2")):
                return location
    return None


if os.environ.get("DATADIST_SHADOW_LLM_DATADIST") != "1":
    _hidden = _real_llm_datadist_hidden_by_us()
    if _hidden is not None:
        raise ImportError(
            f"this llm_datadist is datadist's compatibility package ({__file__}) and would hide "
            f"the real llm_datadist at {_hidden}. Uninstall one of them (pip uninstall "
            "datadist-llm-datadist), or set DATADIST_SHADOW_LLM_DATADIST=1 to use datadist.")

try:
    import datadist as _datadist
except ImportError as e:  # pragma: no cover - depends on the installation
    raise ImportError("llm_datadist (datadist-llm-datadist) needs datadist: pip install it "
                      "from the datadist repository first") from e

from datadist import (  # noqa: E402, F401  (re-exported: __all__ is datadist's)
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    CacheTask,
    DataType,
    KvCache,
    LayerSynchronizer,
    LLMClusterInfo,
    LLMConfig,
    LlmConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    MemInfo,
    Memtype,
    Placement,
    RegisterMemStatus,
    Status,
    TransferConfig,
    TransferWithCacheKeyConfig,
    v2_list,
)

__all__ = list(_datadist.__all__)
__version__ = _datadist.__version__
__datadist__ = True

# llm_datadist's module paths, each bound to datadist's module of the same path.
_MODULES = ("status", "configs", "data_type", "utils", "utils.log", "utils.utils", "v2",
            "v2.cache_manager", "v2.config", "v2.llm_datadist", "v2.llm_types", "v2.llm_utils")
for _path in _MODULES:
    sys.modules[f"{__name__}.{_path}"] = importlib.import_module(f"datadist.{_path}")
status = sys.modules[f"{__name__}.status"]
configs = sys.modules[f"{__name__}.configs"]
data_type = sys.modules[f"{__name__}.data_type"]
utils = sys.modules[f"{__name__}.utils"]
v2 = sys.modules[f"{__name__}.v2"]


def __getattr__(name: str) -> object:
    """``TensorDesc``, ``Tensor`` and ``KvCacheManager`` load on first use, as there."""
    if name in ("TensorDesc", "Tensor", "KvCacheManager"):
        return getattr(_datadist, name)
    raise AttributeError(f"Module 'llm_datadist' has no attribute '{name}'")
