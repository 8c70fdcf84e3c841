"""vLLM's per-layer KV tensors as one datadist blocks cache.

Who calls: the connector's worker side, once, in ``register_kv_caches``; never blocks.
Imports torch (vLLM's tensors), not vLLM.
"""

from __future__ import annotations

import torch

import datadist as llm_datadist
from datadist.integrations.vllm.worker import KvLayout

_DTYPES = {
    torch.float16: llm_datadist.DataType.DT_FLOAT16,
    torch.bfloat16: llm_datadist.DataType.DT_BF16,
    torch.float32: llm_datadist.DataType.DT_FLOAT,
    torch.int8: llm_datadist.DataType.DT_INT8,
    torch.uint8: llm_datadist.DataType.DT_UINT8,
}


def kv_layout(kv_caches: dict[str, torch.Tensor], *,
              device_ok: bool = False) -> tuple[KvLayout, list[torch.Tensor]]:
    """datadist's view of vLLM's per-layer KV tensors, and the block-major tensors it covers.

    Handles the CPU backend's packed ``[num_blocks, kv_heads, block_size, 2 * head_dim]`` and
    any other block-major layout (one tensor per layer), and the ``[2, num_blocks, ...]``
    layout of CUDA backends (K and V as two tensors per layer). Each block must be contiguous.
    Tensors on a GPU only with ``device_ok`` (NIXL's VRAM path, staging.py); a CUDA vLLM's
    cache is otherwise staged through host tensors, which are what this is given.
    """
    if not kv_caches:
        raise ValueError("no KV cache tensors to register")
    parts: list[torch.Tensor] = []
    per_layer = None
    for name, t in kv_caches.items():
        if t.device.type != "cpu" and not device_ok:
            raise ValueError(f"layer {name}: the KV cache is on {t.device}; the datadist "
                             "connector registers host memory only here (a GPU's is "
                             "staged through host buffers, or read by NIXL: "
                             "kv_buffer_device)")
        split = [t[0], t[1]] if t.dim() == 5 and t.shape[0] == 2 else [t]
        per_layer = per_layer or len(split)
        if len(split) != per_layer:
            raise ValueError(f"layer {name}: mixed KV layouts across layers")
        for p in split:
            block_elems = int(torch.tensor(p.shape[1:]).prod().item())
            if p.stride(0) != block_elems or not p[0].is_contiguous():
                raise ValueError(f"layer {name}: blocks are not contiguous (shape "
                                 f"{tuple(p.shape)}, strides {p.stride()})")
        parts.extend(split)
    first = parts[0]
    for p in parts:
        if p.shape != first.shape or p.dtype != first.dtype:
            raise ValueError("KV tensors differ in shape or dtype across layers")
    if first.dtype not in _DTYPES:
        raise TypeError(f"KV cache dtype {first.dtype} is not supported; one of "
                        f"{', '.join(str(d) for d in _DTYPES)}")
    layout = KvLayout([p.data_ptr() for p in parts], first.shape[0], tuple(first.shape[1:]),
                      _DTYPES[first.dtype], per_layer or 1)
    return layout, parts
