"""End to end, the GPU path's staging (staging.py) driven by a real vLLM: a prefill and a
decode engine on the CPU backend whose connector (``_vllm_staged_node.py``) stages the KV
cache through host mirrors as on a GPU, with a stand-in engine whose copies run at once. So
every hook a CUDA vLLM calls runs for real: slot mappings read at the first
``save_kv_layer``, the prefill's copy of each step's blocks to the mirror before its hold,
the layer-wise prefill's per-layer copies before each layer is announced, the decode's copy
back before the request is reported. The datadist transfers only ever see the mirrors, so a
missed copy shows as wrong tokens: the decode tokens must be one instance's, in pull and
layer-wise mode; a control that skips the decode's copy back must change them. (What only a
GPU checks, streams and events, is test_vllm_staging.py's and examples/vllm/gpu_check.py's.)

Skipped without vLLM, as test_vllm.py. Two engines, started once.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import secrets
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from .test_vllm import BLOCK, LENGTHS, LOG_CONFIG, NEW_TOKENS, SRC, Node

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not installed (docs/vllm.md, Install)"),
]

HERE = Path(__file__).parent


class StagedNode(Node):
    """test_vllm's Node, running ``_vllm_staged_node.py`` (the staged connector)."""

    def __init__(self, name: str, model: Path, role: str, extra: dict, log: Path) -> None:
        log_config = log.with_suffix(".logging.json")
        log_config.write_text(json.dumps(LOG_CONFIG))
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", PYTHONUNBUFFERED="1",
                   VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND",
                                                            "nobind"),
                   VLLM_LOGGING_CONFIG_PATH=str(log_config),
                   PYTHONPATH=os.pathsep.join([str(SRC), str(HERE),
                                               os.environ.get("PYTHONPATH", "")]))
        self.name, self.log = name, log
        self._stderr = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "_vllm_staged_node.py"), str(model), role, "fail",
             json.dumps(extra)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, env=env,
            start_new_session=True)
        self._buf = b""


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    from datadist.integrations.vllm.tiny_model import make_tiny_llama

    tmp = tmp_path_factory.mktemp("vllm-staged")
    model = make_tiny_llama(tmp / "tiny-llama")
    skip = tmp / "skip.txt"
    skip.write_text("")
    # Layer-wise instances: they serve pull-mode requests too, so one pair tests both.
    nodes = {
        "prefill": StagedNode("prefill", model, "kv_producer", {"mode": "layerwise"},
                              tmp / "prefill.log"),
        "decode": StagedNode("decode", model, "kv_consumer",
                             {"mode": "layerwise", "test_skip_h2d_file": str(skip),
                              "sync_kv_timeout_ms": 5000, "link_timeout_ms": 3000},
                             tmp / "decode.log"),
    }
    try:
        for n in nodes.values():
            n.wait_ready()
        rng = np.random.default_rng(11)
        prompts = [rng.integers(3, 259, n).tolist() for n in LENGTHS]
        ref = [o["tokens"] for o in nodes["prefill"].generate(prompts, NEW_TOKENS,
                                                              [None] * len(prompts))]
        yield nodes, prompts, ref, skip
    finally:
        for n in nodes.values():
            with contextlib.suppress(Exception):
                n.stop()


def _pull(nodes, prompts: list[list[int]]) -> list[dict]:
    params = [o["params"] for o in nodes["prefill"].generate(
        prompts, 1, [{"do_remote_decode": True}] * len(prompts))]
    return nodes["decode"].generate(prompts, NEW_TOKENS, params)


def test_staged_pull_gives_one_instances_tokens(staged):
    nodes, prompts, ref, _ = staged
    outs = _pull(nodes, prompts)
    assert [o["tokens"] for o in outs] == ref
    log = nodes["decode"].log_text()
    assert re.search(r"KV cache on cpu staged through [\d.]+ MiB of host memory", log)
    assert len(re.findall(r"datadist: pulled request", log)) >= len(prompts)
    assert "failed" not in log


def test_staged_layerwise_gives_one_instances_tokens(staged):
    nodes, prompts, ref, _ = staged
    hello = nodes["prefill"].generate(
        [[5, 6, 7]], 1, [{"do_remote_decode": True, "datadist": {"mode": "layerwise"}}])
    dd = hello[0]["params"]["datadist"]
    tags = [secrets.token_hex(16) for _ in prompts]
    nodes["decode"].send(prompts, NEW_TOKENS, [
        {"do_remote_prefill": True, "datadist": {"mode": "layerwise", "tag": t,
                                                 "workers": dd["workers"],
                                                 "block_size": BLOCK}} for t in tags])
    nodes["prefill"].send(prompts, 1, [{"do_remote_decode": True, "datadist": {
        "mode": "layerwise", "tag": t}} for t in tags])
    nodes["prefill"].receive()
    outs = nodes["decode"].receive()
    assert [o["tokens"] for o in outs] == ref
    log = nodes["decode"].log_text()
    for t in tags:
        assert re.search(rf"received request \S+ layer by layer \(tag:{t}\)", log), log[-3000:]
    assert "failed" not in log


def test_control_without_the_copy_back_the_tokens_change(staged):
    """The decode's copy from its host mirror to vLLM's tensors is what vLLM reads: skip it
    and the tokens are no longer one instance's (the transfer landed only in the mirror)."""
    nodes, prompts, ref, skip = staged
    # A prompt the decoder never saw: its blocks there hold another request's KV (the
    # earlier tests' prompts may land in blocks that still hold their own).
    prompt = np.random.default_rng(12).integers(3, 259, LENGTHS[-1]).tolist()
    want = nodes["prefill"].generate([prompt], NEW_TOKENS, [None])[0]["tokens"]
    skip.write_text("skip")
    try:
        outs = _pull(nodes, [prompt])
    finally:
        skip.write_text("")
    assert outs[0]["tokens"] != want
    assert _pull(nodes, [prompt])[0]["tokens"] == want  # and with the copy back, equal
