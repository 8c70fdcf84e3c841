"""The legacy "v1" surface: ``KvCacheManager``, ``Tensor`` and ``TensorDesc``.

In llm_datadist these load lazily from ``llm_datadist_v1``; here too (module ``__getattr__``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from datadist.api.checks import check_isinstance
from datadist.api.enums import DataType, LLMRole, from_numpy_dtype, numpy_dtype
from datadist.api.status import LLMException, LLMStatusCode
from datadist.core.engine import Engine


class TensorDesc:
    def __init__(self, dtype: DataType, shape: list[int] | tuple[int, ...]) -> None:
        check_isinstance("dtype", dtype, DataType, allow_none=False)
        check_isinstance("shape", shape, (list, tuple), allow_none=False)
        self._dtype, self._shape = dtype, list(shape)

    dtype = property(lambda self: self._dtype)
    shape = property(lambda self: list(self._shape))

    def __repr__(self) -> str:
        return f"TensorDesc(dtype={self._dtype}, shape={self._shape})"


class Tensor:
    """A host tensor: wraps a numpy array, another Tensor, or a raw address plus a desc."""

    def __init__(self, data: np.ndarray | Tensor | int, tensor_desc: TensorDesc | None = None
                 ) -> None:
        check_isinstance("data", data, (np.ndarray, Tensor, int), allow_none=False)
        check_isinstance("tensor_desc", tensor_desc, TensorDesc)
        if isinstance(data, Tensor):
            self._array = data._array
        elif isinstance(data, np.ndarray):
            self._array = data
        else:
            if tensor_desc is None:
                raise LLMException("a Tensor from an address needs a tensor_desc",
                                   status_code=LLMStatusCode.LLM_PARAM_INVALID)
            import ctypes

            dt = numpy_dtype(tensor_desc.dtype)
            count = int(np.prod(tensor_desc.shape)) if tensor_desc.shape else 1
            buf = (ctypes.c_byte * (count * dt.itemsize)).from_address(data)
            self._array = np.frombuffer(buf, dtype=dt).reshape(tensor_desc.shape)
        self._desc = tensor_desc or TensorDesc(from_numpy_dtype(self._array.dtype),
                                               list(self._array.shape))

    def numpy(self, copy: bool = False) -> np.ndarray:
        return self._array.copy() if copy else self._array

    def get_tensor_desc(self) -> TensorDesc:
        return self._desc

    def __repr__(self) -> str:
        return f"Tensor({self._desc})"


class KvCacheManager:
    """Legacy (non-cache-manager) mode. Its transfer methods come in a later release."""

    def __init__(self, engine: Engine, role: LLMRole) -> None:
        self._engine = engine
        self._role = role
        self._initialized = True

    def is_initialized(self) -> bool:
        return self._initialized

    def _invalidate(self) -> None:
        self._initialized = False

    def __getattr__(self, name: str) -> Any:
        if name in {"allocate_cache", "allocate_blocks_cache", "deallocate_cache",
                    "remove_cache_key", "pull_cache", "pull_blocks", "copy_cache",
                    "copy_blocks", "get_cache_tensors", "swap_blocks", "transfer_cache_async"}:
            def not_enabled(*args: Any, **kwargs: Any) -> Any:
                raise LLMException(f"KvCacheManager.{name} is not available in this release; "
                                   "use cache-manager mode", status_code=
                                   LLMStatusCode.LLM_FEATURE_NOT_ENABLED)
            return not_enabled
        raise AttributeError(name)
