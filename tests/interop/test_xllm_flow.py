"""The xLLM-style flow across languages: a C++ decoder and a Python prompt register the same
caches in the same order (so each addresses the remote cache by its own local id): a K and a
V cache of one tensor per layer, pulled with PullKvBlocks, {0, 0} ranges and
tensor_num_per_layer 1; then a cache of one tensor per layer pushed layer by layer with
{l, l}. Every byte checked."""

from __future__ import annotations

import numpy as np
import pytest

import datadist as llm

from ._python_side import PY_ID, make_python, register
from .conftest import pattern

# The first test of a session builds cpp/ (tens of seconds on a busy machine).
pytestmark = pytest.mark.timeout(600)

CPP_ID = (0x7F000001 << 32) | 26001  # xLLM's (ipv4 << 32) | port
LAYERS, BLOCKS, BLOCK = 3, 6, 32


def test_xllm_pull_per_layer_then_push_layerwise(xpeer):
    py = make_python(llm.LLMRole.PROMPT, listen=True)
    try:
        cpp = xpeer()
        cpp.init(CPP_ID, 2)
        shape = (BLOCKS, BLOCK)
        py_kv = []
        for layer in range(LAYERS):
            for kv in range(2):
                cache, arrays = register(py, 1, shape)
                arrays[0].reshape(-1)[:] = np.frombuffer(pattern(10 * layer + kv, BLOCKS * BLOCK),
                                                         dtype=np.uint8)
                cpp_id = cpp.register(1, shape)
                assert cpp_id == cache.cache_id == 2 * layer + kv + 1
                py_kv.append(arrays[0])
        py_all, py_all_arrays = register(py, LAYERS, shape)
        cpp_all = cpp.register(LAYERS, shape)
        assert cpp_all == py_all.cache_id
        cpp.ok(f"link {PY_ID} 127.0.0.1 {py.listen_address[1]} 3000")

        blocks = "4,0,1"
        for cid in range(1, 2 * LAYERS + 1):
            cpp.ok(f"pullb {PY_ID} {cid} 0 {cid} {blocks} {blocks} 0 0 0 0 1")
        for cid in range(1, 2 * LAYERS + 1):
            got = np.frombuffer(cpp.read(cid, 0), dtype=np.uint8).reshape(shape)
            want = np.zeros(shape, np.uint8)
            want[[4, 0, 1]] = py_kv[cid - 1].reshape(shape)[[4, 0, 1]]
            assert np.array_equal(got, want), cid

        src = [pattern(100 + t, BLOCKS * BLOCK) for t in range(LAYERS)]
        for t in range(LAYERS):
            cpp.write(cpp_all, t, src[t])
        for layer in range(LAYERS):
            cpp.ok(f"pushb {cpp_all} {PY_ID} {py_all.cache_id} 2,3 5,0 {layer} {layer} "
                   f"{layer} {layer} 1")
            for t in range(LAYERS):
                arr = py_all_arrays[t]
                if t <= layer:
                    assert arr[5].tobytes() == src[t][2 * BLOCK:3 * BLOCK]
                    assert arr[0].tobytes() == src[t][3 * BLOCK:4 * BLOCK]
                    assert not arr[1:5].any()
                else:
                    assert not arr.any()  # not pushed yet
    finally:
        py.finalize()
