"""CANN's own C++ samples (hicann/hixl examples/cpp, ported in tests/interop/samples/) against
datadist's library: each prompt/decoder pair runs as two processes with the originals' API
calls, options, order and checks; the test then checks their exit codes and every byte of every
buffer (tests/interop/samples/acl_host_shim.h dumps them)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from .conftest import free_port

pytestmark = pytest.mark.timeout(600)

SAMPLES = Path(__file__).resolve().parent / "samples"
NAMES = ("prompt_pull", "decoder_pull", "prompt_push", "decoder_push")
NUM_TENSORS, BLOCKS, BLOCK_ELEMS = 4, 8, 16
UNWRITTEN = 0xA5  # what the shim's aclrtMalloc fills a buffer with
# A5-style local_comm_res (a JSON string; datadist accepts and ignores it)
LOCAL_COMM_RES = ('{"net_instance_id": "superpod1_1", "endpoint_list": [{"protocol": "roce", '
                  '"comm_id": "127.0.0.1", "placement": "host"}], "version": "1.3"}')


@pytest.fixture(scope="module")
def samples(cpp_build: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The four samples, compiled with a plain g++ line against the installed library."""
    if shutil.which("g++") is None:
        pytest.skip("g++ not found")
    if os.environ.get("DATADIST_CPP_SANITIZE"):
        pytest.skip("a sanitized library is not linked from a plain g++ line")
    tmp = tmp_path_factory.mktemp("samples")
    prefix = tmp / "prefix"
    subprocess.run(["cmake", "--install", str(cpp_build), "--prefix", str(prefix)], check=True,
                   capture_output=True, timeout=300)
    libdir = next(p.parent for p in prefix.rglob("libllm_datadist.so"))
    exes = {}
    for name in NAMES:
        exe = tmp / name
        done = subprocess.run(
            ["g++", "-std=c++17", "-Wall", "-Wextra", "-Werror",
             str(SAMPLES / f"{name}_cache_and_blocks.cpp"), "-I", str(prefix / "include"),
             "-L", str(libdir), "-lllm_datadist",
             f"-Wl,-rpath,{libdir}", "-o", str(exe)], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-4000:]
        exes[name] = exe
    return exes


def _run_pair(first: list[str], second: list[str],
              tmp: Path) -> tuple[subprocess.CompletedProcess, ...]:
    """Start `first` (the side that waits for the other's notification), then `second`; returns
    both, each with its buffers dumped under tmp/<index>. Ports are free ones (new ones if one
    was taken before a sample bound it)."""
    for attempt in range(4):
        env = dict(os.environ)
        env.update({"DD_PROMPT_PORT": str(free_port()), "DD_DECODER_PORT": str(free_port()),
                    "DD_PROMPT_CONTROL_PORT": str(free_port()),
                    "DD_DECODER_CONTROL_PORT": str(free_port())})
        procs, dirs = [], []
        for i, cmd in enumerate((first, second)):
            d = tmp / f"try{attempt}" / str(i)
            d.mkdir(parents=True)
            dirs.append(d)
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True, env={**env, "DD_SAMPLE_DUMP_DIR": str(d)}))
        outs = []
        try:
            for p in procs:
                outs.append(p.communicate(timeout=120)[0])
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if not any("Initialize failed" in o or "control socket" in o for o in outs):
            break
    results = tuple(subprocess.CompletedProcess(p.args, p.returncode, o, "")
                    for p, o in zip(procs, outs, strict=True))
    for r, d in zip(results, dirs, strict=True):
        r.dump_dir = d  # type: ignore[attr-defined]
    return results


def _tensors(done: subprocess.CompletedProcess) -> list[np.ndarray]:
    d = done.dump_dir  # type: ignore[attr-defined]
    bufs = [np.fromfile(d / f"buf{i}.bin", dtype=np.uint8) for i in range(NUM_TENSORS)]
    assert all(b.size == BLOCKS * BLOCK_ELEMS * 4 for b in bufs), [b.size for b in bufs]
    return bufs


def _check(done: subprocess.CompletedProcess, written_blocks: set[int] | None) -> None:
    """Every byte: the blocks in `written_blocks` hold the prompt's 0, 1, 2, ... (int32), every
    other byte is untouched (0xA5); None: the whole buffer is the prompt's (a source)."""
    iota = np.arange(BLOCKS * BLOCK_ELEMS, dtype=np.int32).view(np.uint8)
    block_bytes = BLOCK_ELEMS * 4
    for t, buf in enumerate(_tensors(done)):
        for b in range(BLOCKS):
            got = buf[b * block_bytes:(b + 1) * block_bytes]
            if written_blocks is None or b in written_blocks:
                want = iota[b * block_bytes:(b + 1) * block_bytes]
            else:
                want = np.full(block_bytes, UNWRITTEN, dtype=np.uint8)
            assert np.array_equal(got, want), f"tensor {t} block {b}: {got[:16]} != {want[:16]}"


def _assert_ok(done: subprocess.CompletedProcess, *lines: str) -> None:
    assert done.returncode == 0, f"{done.args} -> {done.returncode}\n{done.stdout[-4000:]}"
    for line in lines:
        assert line in done.stdout, done.stdout[-4000:]


@pytest.mark.parametrize("extra", [[], ["hixl"], ["hixl", LOCAL_COMM_RES]],
                         ids=["default", "hixl", "comm_res"])
def test_pull_cache_and_blocks(samples: dict[str, Path], tmp_path: Path, extra: list[str]) -> None:
    """The decoder links to the prompt, pulls blocks 1..3 and batch 0 of the prompt's cache 1,
    unlinks and tells the prompt, which then unregisters."""
    prompt, decoder = _run_pair(
        [str(samples["prompt_pull"]), "0", "127.0.0.1", *extra],
        [str(samples["decoder_pull"]), "2", "127.0.0.1", "127.0.0.1", *extra], tmp_path)
    _assert_ok(decoder, "[INFO] PullKvBlocks success", "[INFO] PullKvCache success",
               "[INFO] CheckBuffers success", "[INFO] UnlinkLlmClusters success",
               "[INFO] Decoder Sample end")
    _assert_ok(prompt, "[INFO] Wait decoder unlink done success",
               "[INFO] UnregisterKvCache success", "[INFO] Prompt Sample end")
    _check(prompt, None)
    _check(decoder, {0, 1, 2, 3})


@pytest.mark.parametrize("extra", [[], ["hixl"]], ids=["default", "hixl"])
def test_push_cache_and_blocks(samples: dict[str, Path], tmp_path: Path, extra: list[str]) -> None:
    """The prompt links to the decoder, pushes blocks 5..7 layer by layer and batch 4 of all four
    tensors, unlinks and tells the decoder, which checked blocks 4..7 and unregisters."""
    decoder, prompt = _run_pair(
        [str(samples["decoder_push"]), "4", "127.0.0.1", *extra],
        [str(samples["prompt_push"]), "0", "127.0.0.1", "127.0.0.1", *extra], tmp_path)
    _assert_ok(prompt, "[INFO] LinkLlmClusters success", "[INFO] PushKvBlocks success",
               "[INFO] PushKvCache success", "[INFO] UnlinkLlmClusters success",
               "[INFO] UnregisterKvCache success", "[INFO] Prompt Sample end")
    _assert_ok(decoder, "[INFO] CheckBuffers success", "[INFO] Wait prompt unlink done success",
               "[INFO] UnregisterKvCache success", "[INFO] Decoder Sample end")
    _check(prompt, None)
    _check(decoder, {4, 5, 6, 7})
