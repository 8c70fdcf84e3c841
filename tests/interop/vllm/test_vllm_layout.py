"""vLLM's KV tensors as datadist sees them (``integrations/vllm/layout.py``): torch only, no
vLLM. The CPU backend's packed layout and the ``[2, blocks, ...]`` layout become one blocks
cache; a GPU cache or an unsupported dtype is refused when registered, with what is wrong."""

from __future__ import annotations

import pytest

import datadist as llm_datadist

torch = pytest.importorskip("torch")

from datadist.integrations.vllm.layout import kv_layout  # noqa: E402 - after torch's check


def test_packed_cpu_layout_is_one_tensor_per_layer():
    kv = {f"layer.{i}": torch.zeros(6, 2, 32, 2 * 32, dtype=torch.float16) for i in range(3)}
    layout, parts = kv_layout(kv)
    assert layout.addrs == [t.data_ptr() for t in kv.values()]
    assert (layout.num_blocks, layout.block_shape) == (6, (2, 32, 64))
    assert layout.dtype == llm_datadist.DataType.DT_FLOAT16 and layout.tensors_per_layer == 1
    assert len(parts) == 3


def test_k_and_v_first_layout_is_two_tensors_per_layer():
    kv = {"a": torch.zeros(2, 5, 32, 2, 32, dtype=torch.bfloat16)}
    layout, _ = kv_layout(kv)
    t = kv["a"]
    assert layout.addrs == [t[0].data_ptr(), t[1].data_ptr()]
    assert layout.tensors_per_layer == 2 and layout.num_blocks == 5
    assert layout.dtype == llm_datadist.DataType.DT_BF16


def test_device_memory_is_refused_with_where_it_is():
    kv = {"layer.0": torch.zeros(4, 2, 32, 64, dtype=torch.float16, device="meta")}
    with pytest.raises(ValueError, match="layer.0: the KV cache is on meta; .*host memory only"):
        kv_layout(kv)


def test_an_unsupported_dtype_is_a_type_error_naming_the_supported_ones():
    kv = {"layer.0": torch.zeros(4, 2, 32, 64, dtype=torch.float64)}
    with pytest.raises(TypeError, match=r"torch.float64 is not supported; one of .*float16"):
        kv_layout(kv)


def test_blocks_that_are_not_contiguous_are_refused():
    base = torch.zeros(4, 2, 32, 128, dtype=torch.float16)
    with pytest.raises(ValueError, match="blocks are not contiguous"):
        kv_layout({"layer.0": base[:, :, :, :64]})
