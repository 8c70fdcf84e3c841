"""``llm_datadist.data_type`` under its own name: ``DataType`` and its numpy tables.

datadist has no native wrapper: a "wrapper dtype" is the GE type number, ``DataType.value``.
DT_BF16 maps to numpy float16 (same size), as in llm_datadist.
"""

from __future__ import annotations

import numpy as np

from datadist.api.enums import DataType, numpy_dtype

dtype_to_np_dtype: dict[DataType, type[np.generic]] = {
    **{dt: numpy_dtype(dt).type for dt in DataType if dt is not DataType.DT_STRING},
    DataType.DT_STRING: np.bytes_,
}

valid_np_dtypes = list(dtype_to_np_dtype.values())

np_dtype_to_dtype = {
    np.dtype(t): dt for dt, t in dtype_to_np_dtype.items() if dt is not DataType.DT_BF16
}

python_dtype_2_dwrapper_dtype = {dt: dt.value for dt in DataType}


def get_python_dtype_from_wrapper_dtype(wrapper_dtype: int) -> DataType:
    """The DataType of a GE type number; ValueError for an unknown one."""
    try:
        return DataType(wrapper_dtype)
    except ValueError:
        raise ValueError(f"The data type {wrapper_dtype} is not support.") from None


__all__ = ["DataType", "dtype_to_np_dtype", "valid_np_dtypes", "np_dtype_to_dtype",
           "python_dtype_2_dwrapper_dtype", "get_python_dtype_from_wrapper_dtype"]
