"""``llm_datadist.v2.llm_utils`` under its own name: the helpers that need no native wrapper.

Left out (docs/compatibility.md): the ``pack_*`` functions, which build the tuples
llm_datadist hands to its native wrapper; ``TransferCacheParameters``, ``TransferCacheJob``,
``TransferAsyncThread`` and ``transfer_cache_async``, its layer-wise thread around that
wrapper (datadist's is :mod:`datadist.core.layerwise`); ``layer_range_to_tensor_indices``
(datadist's is the core's ``PairLayers``, cpp/src/plan.h); ``CacheDescParser``,
which reads the model-serving options ``llm.RefInputShapes`` / ``llm.RefInputDtypes``.
"""

from __future__ import annotations

from datadist.api.enums import DataType, Placement
from datadist.api.status import LLMException, LLMStatusCode, raise_if_false
from datadist.api.types import CacheDesc, is_invalid_id, is_valid_id
from datadist.core.address import parse_host_port
from datadist.core.errors import InvalidArgument


def clone_cache_desc(cache_desc: CacheDesc) -> CacheDesc:
    return CacheDesc(cache_desc.num_tensors, cache_desc.shape[:], cache_desc.data_type,
                     cache_desc.placement, cache_desc.batch_dim, cache_desc.seq_len_dim_index,
                     cache_desc.kv_tensor_format)


def verify_cache_shape(shape: list[int]) -> None:
    """No scalar, no 0 dim, no dim below -1 (LLMException otherwise)."""
    raise_if_false(len(shape) > 0, "scalar is not supported")
    raise_if_false(0 not in shape, f"empty dimension is not supported, shape = {shape}")
    for dim in shape:
        if dim < -1:  # llm_datadist raises this one without a status code (LLM_SUCCESS)
            raise LLMException(f"dim {dim} is not supported, shape = {shape}")


def to_data_type(data_type_str: str) -> DataType:
    """The DataType whose GE number is written in ``data_type_str``."""
    for dtype in DataType:
        if str(dtype.value) == data_type_str:
            return dtype
    raise LLMException(f"unsupported dtype: {data_type_str}",
                       status_code=LLMStatusCode.LLM_PARAM_INVALID)


def calc_tensor_size(shape: list[int], data_type: DataType) -> int:
    """Bytes of one tensor of ``shape`` and ``data_type`` (``CacheDesc.size``)."""
    return CacheDesc(1, list(shape), data_type, Placement.HOST).size


def parse_listen_ip_info(listen_ip_info: str) -> tuple[str, int]:
    """ "ip:port" -> (ip, port); any other form is LLM_PARAM_INVALID."""
    try:
        return parse_host_port(listen_ip_info)
    except InvalidArgument as e:
        raise LLMException(str(e), status_code=LLMStatusCode.LLM_PARAM_INVALID) from None


__all__ = ["clone_cache_desc", "verify_cache_shape", "to_data_type", "is_invalid_id",
           "is_valid_id", "calc_tensor_size", "parse_listen_ip_info"]
