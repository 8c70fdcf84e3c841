"""Deadlines across languages: a stopped or dead peer gives an error within the deadline,
never a hang, and a peer that comes back is served again."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

import datadist as llm

from ._python_side import PY_ID, link_to, make_python, register
from .conftest import LLM_LINK_FAILED, LLM_TIMEOUT, pattern, wait_until

# The first test of a session builds cpp/ (tens of seconds on a busy machine).
pytestmark = pytest.mark.timeout(600)

CPP_ID = 12


def _stopped(pid: int) -> bool:
    """Every thread of ``pid`` has stopped (SIGSTOP takes effect asynchronously)."""
    tasks = Path(f"/proc/{pid}/task")
    return all((t / "stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
               for t in tasks.iterdir())


def test_stopped_cpp_owner_times_out_a_python_pull_then_recovers(xpeer):
    py = make_python(llm.LLMRole.DECODER, listen=False, sync_ms=500)
    cpp = xpeer()
    try:
        cpp.init(CPP_ID, 1, listen=True)
        remote = cpp.register(2, (4, 16))
        data = pattern(5, 64)
        cpp.write(remote, 1, data)
        link_to(py, CPP_ID, cpp.port)
        cache, arrays = register(py, 2, (4, 16))
        key = llm.CacheKeyByIdAndIndex(CPP_ID, remote, 1)
        os.kill(cpp.proc.pid, signal.SIGSTOP)
        try:
            assert wait_until(lambda: _stopped(cpp.proc.pid), 5.0)
            t0 = time.monotonic()
            with pytest.raises(llm.LLMException) as e:
                py.cache_manager.pull_cache(key, cache)
            assert e.value.status_code == llm.LLMStatusCode.LLM_TIMEOUT
            assert time.monotonic() - t0 < 3.0
        finally:
            os.kill(cpp.proc.pid, signal.SIGCONT)
        py.cache_manager.pull_cache(key, cache)  # reconnects
        assert arrays[1][0].tobytes() == data[16:32]
    finally:
        py.finalize()


def test_cpp_pull_from_a_gone_python_owner_fails_within_the_deadline(xpeer):
    py = make_python(llm.LLMRole.PROMPT, listen=True)
    cpp = xpeer()
    cpp.init(CPP_ID, 2, sync_ms=500)
    local = cpp.register(2, (4, 16))
    try:
        register(py, 2, (4, 16))
        cpp.ok(f"link {PY_ID} 127.0.0.1 {py.listen_address[1]} 3000")
        cpp.ok(f"pullc {PY_ID} 1 0 {local} 0 -1 -1 -1 -1 -1 2")
    finally:
        py.finalize()
    t0 = time.monotonic()
    code = cpp.status(f"pullc {PY_ID} 1 0 {local} 0 -1 -1 -1 -1 -1 2", timeout=10.0)
    assert code in (LLM_LINK_FAILED, LLM_TIMEOUT)
    assert time.monotonic() - t0 < 3.0
