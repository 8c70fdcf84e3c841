"""docs/deployment.md's network-namespace rehearsal runs as the page shows it (issue 25,
item 2): its shell block is taken from the page, not copied here, and run as a script from
the repository root; the PROMPT serves in the background until killed, the DECODER verifies
every request over the veth cable, and nothing is left in the repository or the system."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "deployment.md"
NAMESPACES = ("prefill", "decode")

pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.timeout(180)]


def rehearsal_script() -> str:
    """The first ``sh`` block after the page's rehearsal heading."""
    text = PAGE.read_text()
    head = text.index("## A rehearsal of two hosts on one machine")
    found = re.compile(r"```sh\n(.*?)```", re.S).search(text, head)
    assert found, "docs/deployment.md lost its rehearsal block"
    return found.group(1)


def _netns() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


def _untracked_and_changed() -> str:
    return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"],
                          cwd=ROOT, capture_output=True, text=True, check=True).stdout


def test_the_page_block_is_a_script_that_waits_and_cleans_up() -> None:
    """Without root: what the rehearsal needs from its block (a regression of the old block,
    which read requests.jsonl before it existed and wrote it into the repository)."""
    script = rehearsal_script()
    assert "requests.jsonl" not in script and "mktemp" in script
    assert "wc -l" in script  # waits for the requests before the decoder reads them
    assert "ip netns del prefill" in script


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None,
                    reason="needs root and iproute2")
def test_the_rehearsal_runs_as_written() -> None:
    if _netns() & set(NAMESPACES):
        pytest.skip("namespaces prefill / decode exist already (another rehearsal running)")
    before = _untracked_and_changed()
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"),
                                                   env.get("PYTHONPATH")) if p)
    env.pop("DATADIST_TRANSPORT", None)
    proc = subprocess.Popen(["bash", "-e", "-c", rehearsal_script()], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the script's own process group
            proc.wait()
        for ns in set(NAMESPACES) & _netns():  # a failed run: undo its namespaces
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True,
                                  text=True).stdout.split()
            for pid in pids:
                os.kill(int(pid), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", ns], check=False)
    assert proc.returncode == 0, out
    assert out.count("bytes verified") == 3, out
    assert out.count(" over tcp ") == 3, out  # namespaces: no local socket crosses them
    assert "ok: 10.77.0.1:26000 is a datadist listener: cluster 1" in out, out
    assert "link to cluster 1 at 10.77.0.1:26000: path=tcp" in out, out
    assert not _netns() & set(NAMESPACES)
    assert _untracked_and_changed() == before  # nothing left in the repository
