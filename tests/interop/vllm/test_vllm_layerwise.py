"""End to end, layer-wise mode: a vLLM prefill and a vLLM decode engine whose connectors run
``mode="layerwise"`` (docs/vllm.md, "Layer-wise mode"). The router (this test) sends each
request to both engines at once with one random tag; the prefill announces each layer as
vLLM saves it, the decoder pulls it. The decode tokens must be one instance's; a decoder
whose prefill never comes, or dies, recomputes (``recompute`` policy).

Skipped without vLLM, as test_vllm.py. Two engines (about a minute to start on 2 cores).
"""

from __future__ import annotations

import importlib.util
import re
import secrets
import time

import numpy as np
import pytest

from .test_vllm import BLOCK, LENGTHS, NEW_TOKENS, Node

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not installed (docs/vllm.md, Install)"),
]

LAYERWISE_TIMEOUT_S = 4.0
SYNC_KV_TIMEOUT_MS = 2000


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from datadist.integrations.vllm.tiny_model import make_tiny_llama

    tmp = tmp_path_factory.mktemp("vllm-layerwise")
    model = make_tiny_llama(tmp / "tiny-llama")
    corrupt = tmp / "corrupt.txt"
    corrupt.write_text("")
    nodes = {
        "prefill": Node("prefill", model, "kv_producer", "fail",
                        {"mode": "layerwise", "abort_timeout_s": 8}, tmp / "prefill.log"),
        "decode": Node("decode", model, "kv_consumer", "recompute",
                       {"mode": "layerwise", "test_corrupt_file": str(corrupt),
                        "layerwise_timeout_s": LAYERWISE_TIMEOUT_S,
                        "sync_kv_timeout_ms": SYNC_KV_TIMEOUT_MS, "link_timeout_ms": 3000},
                       tmp / "decode.log", connector="CorruptingDatadistConnector"),
    }
    try:
        for n in nodes.values():
            n.wait_ready()
        yield nodes, corrupt
    finally:
        for n in nodes.values():
            n.stop()


@pytest.fixture(scope="module")
def setup(pair):
    """The prompts, one instance's tokens for them, and the prefill's workers (learnt as a
    router does: from any layer-wise answer of the prefill instance, here one without a
    tag, which holds nothing)."""
    nodes, _ = pair
    rng = np.random.default_rng(23)
    prompts = [rng.integers(3, 259, n).tolist() for n in LENGTHS]
    ref = [o["tokens"] for o in nodes["prefill"].generate(prompts, NEW_TOKENS,
                                                          [None] * len(prompts))]
    hello = nodes["prefill"].generate(
        [[5, 6, 7]], 1, [{"do_remote_decode": True, "datadist": {"mode": "layerwise"}}])
    dd = hello[0]["params"]["datadist"]
    assert dd["workers"] and dd["block_size"] == BLOCK
    return prompts, ref, dd


def params_for(dd: dict, n: int) -> tuple[list[dict], list[dict], list[str]]:
    tags = [secrets.token_hex(16) for _ in range(n)]
    pre = [{"do_remote_decode": True, "datadist": {"mode": "layerwise", "tag": t}}
           for t in tags]
    dec = [{"do_remote_prefill": True,
            "datadist": {"mode": "layerwise", "tag": t, "workers": dd["workers"],
                         "block_size": dd["block_size"]}} for t in tags]
    return pre, dec, tags


def received_blocks(log: str, tag: str) -> int | None:
    m = re.search(rf"datadist: received request \S+ layer by layer \(tag:{tag}\): (\d+) "
                  rf"blocks", log)
    return None if m is None else int(m.group(1))


def test_layerwise_tokens_equal_one_instance(pair, setup):
    nodes, _ = pair
    prompts, ref, dd = setup
    pre, dec, tags = params_for(dd, len(prompts))
    nodes["decode"].send(prompts, NEW_TOKENS, dec)  # both at once, as a layer-wise router
    nodes["prefill"].send(prompts, 1, pre)
    first = nodes["prefill"].receive()
    outs = nodes["decode"].receive()
    assert all(o["params"]["datadist"]["workers"] == dd["workers"] for o in first)
    assert [o["tokens"] for o in outs] == ref
    log = nodes["decode"].log_text()
    for p, t in zip(prompts, tags, strict=True):
        assert received_blocks(log, t) == -(-len(p) // BLOCK), log[-3000:]
    assert "failed" not in log
    deadline = time.monotonic() + 10
    while True:  # every request's prefill said when its last layer was written
        text = nodes["prefill"].log_text()
        written = [re.search(rf"\(tag {t}\): every layer of (\d+) blocks written", text)
                   for t in tags]
        if all(written):
            break
        assert time.monotonic() < deadline, text[-3000:]
        time.sleep(0.1)
    for p, m in zip(prompts, written, strict=True):
        assert m is not None and int(m.group(1)) == -(-len(p) // BLOCK)
    # the decoder pulled them, layer by layer (8 layers: more than one pull per request)
    pulls = [re.search(rf"\(tag:{t}\): .* in (\d+) pulls", log) for t in tags]
    assert all(m is not None and int(m.group(1)) >= 1 for m in pulls), log[-3000:]
    assert "pushed request" not in nodes["prefill"].log_text()


def test_layerwise_corrupted_transfer_changes_tokens(pair, setup):
    """Control: the decoder really uses the pulled KV."""
    nodes, corrupt = pair
    prompts, ref, dd = setup
    pre, dec, tags = params_for(dd, 1)
    corrupt.write_text(f"tag:{tags[0]}\n")
    try:
        nodes["decode"].send(prompts[1:2], NEW_TOKENS, dec)
        nodes["prefill"].send(prompts[1:2], 1, pre)
        nodes["prefill"].receive()
        outs = nodes["decode"].receive()
    finally:
        corrupt.write_text("")
    assert received_blocks(nodes["decode"].log_text(), tags[0]) == 3
    assert outs[0]["tokens"] != ref[1]


def test_layerwise_decoder_without_its_prefill_recomputes(pair, setup):
    """The prefill never gets the request: after layerwise_timeout_s the decoder gives it
    up, then recomputes."""
    nodes, _ = pair
    prompts, ref, dd = setup
    _, dec, tags = params_for(dd, 1)
    t0 = time.monotonic()
    outs = nodes["decode"].generate(prompts[:1], NEW_TOKENS, dec)
    took = time.monotonic() - t0
    assert outs[0]["tokens"] == ref[0]
    log = nodes["decode"].log_text()
    assert re.search(rf"tag {tags[0]}\) failed: no KV within", log), log[-3000:]
    assert received_blocks(log, tags[0]) is None
    assert LAYERWISE_TIMEOUT_S <= took < LAYERWISE_TIMEOUT_S + SYNC_KV_TIMEOUT_MS / 1e3 + 20


def test_layerwise_prefill_killed_mid_request(pair, setup):
    """The prefill engine dies while the decoder waits for its layers: the decoder's next
    read of its record fails the request, well before layerwise_timeout_s, and it
    recomputes."""
    nodes, _ = pair
    prompts, ref, dd = setup
    _, dec, tags = params_for(dd, 2)
    nodes["decode"].send(prompts[1:3], NEW_TOKENS, dec)
    time.sleep(1.0)  # the decoder (linked since the first test) reads the directory
    t0 = time.monotonic()
    nodes["prefill"].kill()
    outs = nodes["decode"].receive()
    took = time.monotonic() - t0
    assert [o["tokens"] for o in outs] == ref[1:3]
    log = nodes["decode"].log_text()
    for t in tags:
        assert f"tag {t}) failed" in log
    assert took < LAYERWISE_TIMEOUT_S + 20
