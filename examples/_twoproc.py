"""What every example shares: run its PROMPT and DECODER as two processes on this host.

An example script run with no arguments is the *launcher*: it picks free ports, starts
``script prompt SETUP`` and waits for the prompt's ``READY {json}`` line (what the decoder
needs to know: ports, cache ids), starts ``script decoder SETUP+INFO``, waits for it, then
tells the prompt to finish (a line on its stdin) and exits non-zero if either side did.
Every wait is bounded (``TIMEOUT`` seconds); a child that overruns is killed.

The bytes each side holds are a seeded pattern (:func:`pattern`), so the decoder checks what
it pulled against what the prompt wrote without any extra channel. ``DATADIST_EXAMPLE_SKEW``
(an int, default 0) shifts the prompt's seed: with it the decoder must find a mismatch and
the example must fail, which is how the tests check that the check works.
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import time
from typing import Any

import numpy as np

TIMEOUT = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pattern(shape: tuple[int, ...], seed: int, *, role: str) -> np.ndarray:
    """Deterministic float16 contents (built from random bits, compared as bytes)."""
    if role == "prompt":
        seed += int(os.environ.get("DATADIST_EXAMPLE_SKEW", "0"))
    bits = np.random.default_rng(seed).integers(0, 1 << 16, size=shape, dtype=np.uint16)
    return bits.view(np.float16)


def same_bytes(what: str, got: np.ndarray, want: np.ndarray) -> bool:
    g = np.ascontiguousarray(got).view(np.uint8).reshape(-1)
    w = np.ascontiguousarray(want).view(np.uint8).reshape(-1)
    bad = int(np.count_nonzero(g != w)) if g.shape == w.shape else -1
    print(f"decoder: {what}: {g.size} bytes {'match' if bad == 0 else 'MISMATCH'}"
          + ("" if bad <= 0 else f" ({bad} bytes differ)"), flush=True)
    return bad == 0


def ready(**info: Any) -> None:
    """Prompt side: tell the launcher we are set up (and what the decoder needs)."""
    print("READY " + json.dumps(info), flush=True)


def wait_done() -> None:
    """Prompt side: block until the launcher says the decoder finished."""
    sys.stdin.readline()


def role_args() -> tuple[str, dict[str, Any]] | None:
    if len(sys.argv) == 3 and sys.argv[1] in ("prompt", "decoder"):
        return sys.argv[1], json.loads(sys.argv[2])
    return None


def _read_ready(proc: subprocess.Popen[str], deadline: float) -> dict[str, Any]:
    assert proc.stdout is not None
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([proc.stdout], [], [], left)[0]:
            raise TimeoutError("the prompt did not get ready in time")
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the prompt exited early (code {proc.wait(5)})")
        if line.startswith("READY "):
            return json.loads(line[len("READY "):])  # type: ignore[no-any-return]
        print(line, end="", flush=True)


def launch(script: str, setup: dict[str, Any]) -> int:
    """Run both roles of ``script``; returns the exit code for the launcher."""
    cmd = [sys.executable, script]
    prompt = subprocess.Popen([*cmd, "prompt", json.dumps(setup)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    decoder = None
    try:
        info = _read_ready(prompt, time.monotonic() + TIMEOUT)
        decoder = subprocess.Popen([*cmd, "decoder", json.dumps({**setup, **info})])
        decoder_rc = decoder.wait(TIMEOUT)
        assert prompt.stdin is not None
        prompt.stdin.write("done\n")
        prompt.stdin.flush()
        out, _ = prompt.communicate(timeout=TIMEOUT)
        print(out, end="", flush=True)
        prompt_rc = prompt.returncode
    finally:
        for proc in (prompt, decoder):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(10)
    ok = decoder_rc == 0 and prompt_rc == 0
    print(f"{os.path.basename(script)}: prompt exit {prompt_rc}, decoder exit {decoder_rc}: "
          f"{'OK' if ok else 'FAILED'}", flush=True)
    return 0 if ok else 1
