"""A checksummed pull of registered memory with a hole never kills the owner (issue 35, item 4).

The owner's caller registers a tensor and then unmaps a page in the middle of it (its bug,
which docs/reliability.md says the core contains). A DECODER pulls it with ``verify`` (the
checksum) on the same host, where a slot above 64 KiB is granted (GRANT: the owner computes
the CRC while the grant holds the memory), and over TCP (streamed: the CRC goes after the
bytes). Before the fix the owner computed the CRC in-process and died of SIGSEGV on the GRANT
path, and over TCP the probe of each tensor's first and last byte let the hole through to a
send that failed mid-answer, cutting the link. Now the owner reads for the CRC through the
kernel (``process_vm_readv`` on itself, which answers EFAULT), the pull fails with
LLM_DEVICE_MEM_ERROR, the owner says so on stderr, and the same link serves a healthy pull next.

The owner runs in a child process, so that a crash is seen as one (its exit status), not as
the test's own death.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import datadist as llm
from datadist.api.cache_manager import CacheManager
from datadist.core.config import EngineConfig
from datadist.core.native import NativeEngine

pytestmark = pytest.mark.timeout(120)

PROMPT_ID, DECODER_ID = 1, 2
PAGE = 4096
PAGES = 24  # 96 KiB: above the 64 KiB a same-host pull streams below, so it is granted
HOLE = 11   # the page the owner's caller unmaps

_OWNER = """
import ctypes, json, mmap, sys
import numpy as np
import datadist as llm
from datadist.api.cache_manager import CacheManager
from datadist.core.config import EngineConfig
from datadist.core.native import NativeEngine

PAGE, PAGES, HOLE = {page}, {pages}, {hole}
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
owner = NativeEngine(EngineConfig(cluster_id={prompt}, role=1, listen=("127.0.0.1", 0)))
cm = CacheManager(owner)
desc = llm.CacheDesc(1, [1, PAGES * PAGE], llm.DataType.DT_UINT8, llm.Placement.HOST)
addr = libc.mmap(None, PAGES * PAGE, mmap.PROT_READ | mmap.PROT_WRITE,
                 mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
ctypes.memset(addr, 7, PAGES * PAGE)
holed = cm.register_cache(desc, [addr])
good = np.arange(PAGES * PAGE, dtype=np.uint32).astype(np.uint8)
kept = cm.register_cache(desc, [good])
assert libc.munmap(addr + HOLE * PAGE, PAGE) == 0  # freed behind the registry's back
print(json.dumps({{"port": owner.listen_address[1], "holed": holed.cache_id,
                   "kept": kept.cache_id}}), flush=True)
sys.stdin.readline()  # until the test is done
print("ALIVE", flush=True)
owner.close()
"""


@pytest.fixture
def owner() -> Iterator[tuple[subprocess.Popen[str], dict[str, int]]]:
    src = str(Path(llm.__file__).resolve().parents[1])
    code = _OWNER.format(page=PAGE, pages=PAGES, hole=HOLE, prompt=PROMPT_ID)
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={"PYTHONPATH": src, "PATH": ""})
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, proc.stderr.read() if proc.stderr else "the owner said nothing"
        yield proc, json.loads(line)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)  # reaped, its pipes closed


def _finish(proc: subprocess.Popen[str]) -> tuple[str, str]:
    """Lets the owner go; its stdout and stderr. Fails if it died before."""
    if proc.poll() is not None:
        pytest.fail(f"the owner died (exit {proc.returncode}): {proc.communicate()[1][-3000:]}")
    out, err = proc.communicate("done\n", timeout=30)
    assert "ALIVE" in out, err[-3000:]
    return out, err


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_checksummed_pull_of_memory_with_a_hole(owner, transport: str) -> None:
    proc, ids = owner
    config = EngineConfig(cluster_id=DECODER_ID, role=2, verify=True, sync_timeout=10.0,
                          transport=None if transport == "auto" else transport)
    reader = NativeEngine(config)
    try:
        reader.link(PROMPT_ID, "127.0.0.1", ids["port"], 10.0)
        link = reader.get_link(PROMPT_ID)
        rcm = CacheManager(reader)
        desc = llm.CacheDesc(1, [1, PAGES * PAGE], llm.DataType.DT_UINT8, llm.Placement.HOST)
        dst_arr = np.zeros(PAGES * PAGE, np.uint8)
        dst = rcm.register_cache(desc, [dst_arr])
        with pytest.raises(llm.LLMException) as e:
            rcm.pull_cache(llm.CacheKeyByIdAndIndex(PROMPT_ID, ids["holed"]), dst)
        # (before the fix: LLM_LINK_FAILED, the owner dead of SIGSEGV or the link cut)
        assert e.value.status_code == llm.LLMStatusCode.LLM_DEVICE_MEM_ERROR, (
            e.value, f"owner exit status: {proc.poll()}")
        assert "not mapped" in str(e.value)
        assert proc.poll() is None, "the owner died"
        # an error frame, not a cut link: the same link serves the healthy cache next
        rcm.pull_cache(llm.CacheKeyByIdAndIndex(PROMPT_ID, ids["kept"]), dst)
        assert np.array_equal(dst_arr, np.arange(PAGES * PAGE, dtype=np.uint32).astype(np.uint8))
        assert reader.get_link(PROMPT_ID) == link
        reader.check_link(PROMPT_ID, 5.0)
    finally:
        reader.close()
    _, err = _finish(proc)
    assert "is not mapped any more" in err  # the owner's own account of its caller's bug
