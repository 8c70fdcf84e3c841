"""The enums of llm_datadist, with its names, values and ``str`` forms."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # numpy is imported where used
    import numpy as np
    from numpy.typing import DTypeLike


class LLMRole(enum.IntEnum):
    """A process's role: PROMPT (owns KV caches, is pulled from), DECODER (pulls) or MIX."""

    PROMPT = 1
    DECODER = 2
    MIX = 3

    def __str__(self) -> str:
        return f"LLMRole.{self.name}"


class Placement(enum.IntEnum):
    """Where a cache lives. On a host without CUDA, DEVICE memory is host memory too."""

    HOST = 0
    DEVICE = 1

    def __str__(self) -> str:
        return f"Placement.{self.name}"


class RegisterMemStatus(enum.Enum):
    """State of a two-sided ``link`` (``query_register_mem_status``): PREPARING, OK or FAILED."""

    OK = 0
    PREPARING = 1
    FAILED = 2


class Memtype(enum.Enum):
    """Where registered memory lives: device (MEM_TYPE_DEVICE) or host (MEM_TYPE_HOST)."""

    MEM_TYPE_DEVICE = 0
    MEM_TYPE_HOST = 1


class DataType(enum.Enum):
    """Element types, valued as GE's ``ge::DataType``."""

    DT_FLOAT = 0
    DT_FLOAT16 = 1
    DT_INT8 = 2
    DT_INT32 = 3
    DT_UINT8 = 4
    DT_INT16 = 6
    DT_UINT16 = 7
    DT_UINT32 = 8
    DT_INT64 = 9
    DT_UINT64 = 10
    DT_DOUBLE = 11
    DT_BOOL = 12
    DT_STRING = 13
    DT_BF16 = 27

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]

    def __str__(self) -> str:
        return f"DataType.{self.name}"


_ITEMSIZE = {
    DataType.DT_FLOAT: 4, DataType.DT_FLOAT16: 2, DataType.DT_BF16: 2, DataType.DT_INT8: 1,
    DataType.DT_INT16: 2, DataType.DT_UINT16: 2, DataType.DT_UINT8: 1, DataType.DT_INT32: 4,
    DataType.DT_INT64: 8, DataType.DT_UINT32: 4, DataType.DT_UINT64: 8, DataType.DT_BOOL: 1,
    DataType.DT_DOUBLE: 8, DataType.DT_STRING: 0,
}

_NP_NAMES = {
    DataType.DT_FLOAT: "float32", DataType.DT_FLOAT16: "float16", DataType.DT_BF16: "float16",
    DataType.DT_INT8: "int8", DataType.DT_INT16: "int16", DataType.DT_UINT16: "uint16",
    DataType.DT_UINT8: "uint8", DataType.DT_INT32: "int32", DataType.DT_INT64: "int64",
    DataType.DT_UINT32: "uint32", DataType.DT_UINT64: "uint64", DataType.DT_BOOL: "bool",
    DataType.DT_DOUBLE: "float64",
}


def numpy_dtype(dt: DataType) -> np.dtype[Any]:
    """The numpy dtype for a DataType (BF16 -> float16 of the same size, as llm_datadist)."""
    import numpy as np

    if dt not in _NP_NAMES:
        raise ValueError(f"{dt} has no numpy dtype")
    return np.dtype(_NP_NAMES[dt])


def from_numpy_dtype(dtype: DTypeLike) -> DataType:
    import numpy as np

    name = np.dtype(dtype).name
    for dt, n in _NP_NAMES.items():
        if n == name and dt != DataType.DT_BF16:
            return dt
    raise ValueError(f"no DataType for numpy dtype {name}")


def from_torch_dtype(dtype: object) -> DataType:
    """The DataType of a torch dtype (by name, so torch need not be imported here)."""
    name = str(dtype).replace("torch.", "")
    table = {
        "float32": DataType.DT_FLOAT, "float16": DataType.DT_FLOAT16,
        "bfloat16": DataType.DT_BF16, "int8": DataType.DT_INT8, "int16": DataType.DT_INT16,
        "uint8": DataType.DT_UINT8, "int32": DataType.DT_INT32, "int64": DataType.DT_INT64,
        "bool": DataType.DT_BOOL, "float64": DataType.DT_DOUBLE,
    }
    if name not in table:
        raise ValueError(f"no DataType for torch dtype {dtype}")
    return table[name]
