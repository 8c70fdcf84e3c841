"""The README's two-process program runs as printed (only its port is changed to a free one):
a newcomer copying it gets a PROMPT that serves and a DECODER that links and pulls."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def program(name: str) -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    found = [b for b in blocks if b.startswith(f"# {name}")]
    assert len(found) == 1, f"README has no single ```python block starting '# {name}'"
    return found[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(90)
def test_readme_prompt_and_decoder_run_as_printed(tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "DATADIST_TRANSPORT"}
    for name in ("prompt.py", "decoder.py"):
        code = program(name)
        assert "26000" in code
        (tmp_path / name).write_text(code.replace("26000", str(port)))
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
                assert time.monotonic() < deadline, "the README's PROMPT never listened"
                time.sleep(0.1)
        done = subprocess.run([sys.executable, "decoder.py"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
    finally:
        out, err = prompt.communicate("\n", timeout=30)
    assert prompt.returncode == 0, err
