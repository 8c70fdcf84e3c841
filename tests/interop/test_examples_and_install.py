"""examples/cpp run as two processes and check every byte; ``cmake --install`` gives a
library that a plain ``g++ ... -lllm_datadist`` line and ``find_package(llm_datadist)`` use."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from .conftest import ROOT, free_port

# The first test of a session builds cpp/ (tens of seconds on a busy machine).
pytestmark = pytest.mark.timeout(600)

PROGRAM = r"""
#include <cstdio>
#include "llm_datadist/llm_datadist.h"
using namespace llm_datadist;
int main() {
  LlmDataDist dd(5, LlmRole::kDecoder);
  std::map<AscendString, AscendString> options;
  options[OPTION_SYNC_CACHE_WAIT_TIME] = "100";
  if (dd.Initialize(options) != LLM_SUCCESS) return 1;
  Cache cache{};
  CacheDesc desc{};
  desc.num_tensors = 2;
  desc.data_type = ge::DT_FLOAT16;
  desc.shape = {4, 8};
  if (dd.AllocateCache(desc, cache) != LLM_SUCCESS || cache.cache_id != 1) return 2;
  CacheIndex remote{6, 1, 0, {}};
  Status s = dd.PullKvCache(remote, cache);
  std::printf("%u\n", s);
  dd.Finalize();
  return s == LLM_NOT_YET_LINK ? 0 : 3;
}
"""


def _start_prompt(ex: Path) -> tuple[subprocess.Popen, int, int]:
    """The example prompt, once it listens. A free port can be taken by another process
    before the prompt binds it (tests of other projects run here too): then try new ports."""
    first = ""
    for _ in range(5):
        port, control = free_port(), free_port()
        if port == control:  # two calls may be handed the same free port
            continue
        prompt = subprocess.Popen([str(ex / "dd_example_prompt"), "127.0.0.1", str(port),
                                   str(control)], stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
        assert prompt.stdout is not None
        first = prompt.stdout.readline()
        if "prompt listening" in first:
            return prompt, port, control
        prompt.communicate(timeout=30)
    pytest.fail(f"the example prompt could not listen: {first!r}")


def test_examples_prompt_and_decoder(cpp_build: Path) -> None:
    ex = cpp_build / "examples"
    prompt, port, control = _start_prompt(ex)
    try:
        decoder = subprocess.run([str(ex / "dd_example_decoder"), "127.0.0.1", str(port),
                                  str(control)], capture_output=True, text=True, timeout=120)
        out, _ = prompt.communicate(timeout=60)
    finally:
        if prompt.poll() is None:
            prompt.kill()
            prompt.wait()
    assert decoder.returncode == 0, (decoder.stdout + decoder.stderr
                                     + f"\n--- the prompt (exit {prompt.returncode}):\n{out}")
    assert "PullKvBlocks: every byte of blocks 1..7 is right" in decoder.stdout
    assert prompt.returncode == 0, out
    assert "every byte the decoder pushed is right" in out


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)
    assert done.returncode == 0, f"{cmd}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def test_install_then_link_with_gxx_and_find_package(cpp_build: Path, tmp_path: Path) -> None:
    if shutil.which("g++") is None:
        pytest.skip("g++ not found")
    if os.environ.get("DATADIST_CPP_SANITIZE"):
        pytest.skip("a sanitized library is not linked from a plain g++ line")
    prefix = tmp_path / "prefix"
    _run(["cmake", "--install", str(cpp_build), "--prefix", str(prefix)])
    libdir = next(p.parent for p in prefix.rglob("libllm_datadist.so"))
    assert (prefix / "include" / "llm_datadist" / "llm_datadist.h").exists()
    src = tmp_path / "main.cpp"
    src.write_text(PROGRAM)
    # the link line of CANN's samples
    exe = tmp_path / "plain"
    _run(["g++", "-std=c++17", "-Wall", "-Wextra", "-Werror", str(src), "-I",
          str(prefix / "include"), "-L", str(libdir), "-lllm_datadist", "-o", str(exe)])
    env = {"LD_LIBRARY_PATH": str(libdir), "PATH": "/usr/bin:/bin"}
    assert _run([str(exe)], env=env).stdout.strip() == str(0x5010B007)
    # and find_package, with examples/cpp as the consumer
    build = tmp_path / "ex"
    _run(["cmake", "-S", str(ROOT / "examples" / "cpp"), "-B", str(build),
          f"-DCMAKE_PREFIX_PATH={prefix}"])
    _run(["cmake", "--build", str(build), "-j", "2"])
    assert (build / "dd_example_decoder").exists()


# CANN ships llm_datadist/llm_error_codes.h (hicann/hixl include/llm_datadist/llm_error_codes.h):
# the ge::LLM_* codes, GE error numbers 0x5010B000 + n. Code that uses them, alone or beside
# llm_datadist.h (whose llm_datadist::LLM_* are the same constants), compiles.
ERROR_CODES_PROGRAM = r"""
#include <cstdio>
#include "llm_datadist/llm_error_codes.h"
#include "llm_datadist/llm_datadist.h"
#include "llm_datadist/llm_error_codes.h"  // twice: guarded
static_assert(ge::LLM_WAIT_PROC_TIMEOUT == 0x5010B001U, "");
static_assert(ge::LLM_REPEAT_REQUEST == 0x5010B003U, "");
static_assert(ge::LLM_REQUEST_ALREADY_COMPLETED == 0x5010B004U, "");
static_assert(ge::LLM_ENGINE_FINALIZED == 0x5010B006U, "");
static_assert(ge::LLM_PREFIX_ALREADY_EXIST == 0x5010B00FU, "");
static_assert(ge::LLM_PREFIX_NOT_EXIST == 0x5010B010U, "");
static_assert(ge::LLM_SEQ_LEN_OVER_LIMIT == 0x5010B011U, "");
static_assert(ge::LLM_NO_FREE_BLOCK == 0x5010B012U, "");
static_assert(ge::LLM_BLOCKS_OUT_OF_MEMORY == 0x5010B013U, "");
static_assert(ge::LLM_CACHE_INCOMPATIBLE == 0x5010B014U, "");
static_assert(ge::LLM_CACHE_KEY_ALREADY_EXIST == 0x5010B015U, "");
static_assert(ge::LLM_COPY_CACHE_FAILED == 0x5010B016U, "");
static_assert(ge::LLM_CACHE_ID_ALREADY_EXIST == 0x5010B017U, "");
static_assert(ge::LLM_OUT_OF_MEMORY == 0x5010B01CU, "");
using namespace ge;
using namespace llm_datadist;
int main() {
  LlmDataDist dd(5, LlmRole::kDecoder);
  std::map<AscendString, AscendString> options;
  if (dd.Initialize(options) != LLM_SUCCESS) return 1;
  Cache cache{};
  cache.cache_id = 42;
  CacheIndex remote{6, 1, 0, {}};
  Status s = dd.PullKvCache(remote, cache);  // not linked (and no such cache)
  dd.Finalize();
  std::printf("%u\n", s);
  // unqualified, with both namespaces in use: one entity, so not ambiguous
  return (s == LLM_NOT_YET_LINK || s == LLM_KV_CACHE_NOT_EXIST) && s != LLM_PARAM_INVALID ? 0 : 2;
}
"""


def test_installed_llm_error_codes_header_compiles(cpp_build: Path, tmp_path: Path) -> None:
    if shutil.which("g++") is None:
        pytest.skip("g++ not found")
    if os.environ.get("DATADIST_CPP_SANITIZE"):
        pytest.skip("a sanitized library is not linked from a plain g++ line")
    prefix = tmp_path / "prefix"
    _run(["cmake", "--install", str(cpp_build), "--prefix", str(prefix)])
    assert (prefix / "include" / "llm_datadist" / "llm_error_codes.h").exists()
    libdir = next(p.parent for p in prefix.rglob("libllm_datadist.so"))
    src = tmp_path / "codes.cpp"
    src.write_text(ERROR_CODES_PROGRAM)
    exe = tmp_path / "codes"
    _run(["g++", "-std=c++17", "-Wall", "-Wextra", "-Werror", str(src), "-I",
          str(prefix / "include"), "-L", str(libdir), "-lllm_datadist", "-o", str(exe)])
    env = {"LD_LIBRARY_PATH": str(libdir), "PATH": "/usr/bin:/bin"}
    _run([str(exe)], env=env)
