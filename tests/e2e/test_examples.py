"""Every example in examples/ runs (a PROMPT and a DECODER process each) and checks the bytes
it moved; with a skewed prompt pattern it must fail, so the check is real."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
FLOWS = sorted(p.name for p in EXAMPLES.glob("flow*.py"))


def run(name: str, **env: str) -> subprocess.CompletedProcess[str]:
    # the examples choose their data path themselves unless a test forces one
    full_env = {k: v for k, v in os.environ.items() if k != "DATADIST_TRANSPORT"}
    full_env.update(env)
    return subprocess.run([sys.executable, str(EXAMPLES / name)], capture_output=True,
                          text=True, timeout=90, env=full_env, cwd=EXAMPLES.parent)


def test_one_example_per_client_flow():
    assert [n.split("_")[0] for n in FLOWS] == ["flow1", "flow2", "flow3", "flow4"]


@pytest.mark.timeout(100)
@pytest.mark.parametrize("name", FLOWS)
def test_example_runs_and_checks_its_bytes(name):
    done = run(name)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "prompt exit 0, decoder exit 0: OK" in done.stdout
    assert "match" in done.stdout and "MISMATCH" not in done.stdout


@pytest.mark.timeout(100)
def test_two_sided_link_over_tcp():
    done = run("flow1_two_sided_link.py", DATADIST_TRANSPORT="tcp")
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.timeout(100)
@pytest.mark.parametrize("name", ["flow2_one_sided_link.py", "flow4_legacy_kv_cache_manager.py"])
def test_example_fails_on_wrong_bytes(name):
    done = run(name, DATADIST_EXAMPLE_SKEW="1")
    assert done.returncode != 0
    assert "MISMATCH" in done.stdout and "FAILED" in done.stdout


@pytest.mark.timeout(100)
@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_two_hosts_programs_move_and_check_blocks(transport):
    """examples/two_hosts: the README's two-process program, run as a user runs it: the
    PROMPT prints each request's block table, the DECODER gets them (here on stdin), links,
    pulls and checks every byte. Its stdin is closed, as a background job's or a service's:
    it serves all the same until SIGTERM (docs/deployment.md's rehearsal relies on it)."""
    env = {k: v for k, v in os.environ.items() if k != "DATADIST_TRANSPORT"}
    env["DATADIST_TRANSPORT"] = transport
    folder = EXAMPLES / "two_hosts"
    prompt = subprocess.Popen([sys.executable, "prompt.py", "--listen", "127.0.0.1:0",
                               "--cluster-id", "7", "--requests", "3"], cwd=folder, env=env,
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
    try:
        lines = [prompt.stdout.readline() for _ in range(3)]
        port = json.loads(lines[0])["prompt"][1]
        done = subprocess.run([sys.executable, "decoder.py", "--peer", f"127.0.0.1:{port}",
                               "--cluster-id", "8"], input="".join(lines), cwd=folder, env=env,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        assert done.stdout.count("bytes verified") == 3, done.stdout
        if transport == "tcp":
            assert " over tcp " in done.stdout
        assert prompt.poll() is None  # still serving, its stdin closed long ago
    finally:
        prompt.terminate()  # SIGTERM: it finalizes and exits 0
        prompt.communicate(timeout=30)
    assert prompt.returncode == 0


def _ipv6_loopback() -> bool:
    import socket

    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.timeout(100)
@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback on this host")
def test_two_hosts_programs_over_ipv6():
    """The same programs with the addresses written as for an IPv6-only network (issue 22
    item 8): the PROMPT listens on "[::1]:0", the DECODER is given "--peer [::1]:PORT"."""
    env = {k: v for k, v in os.environ.items() if k != "DATADIST_TRANSPORT"}
    folder = EXAMPLES / "two_hosts"
    prompt = subprocess.Popen([sys.executable, "prompt.py", "--listen", "[::1]:0",
                               "--cluster-id", "7", "--requests", "1"], cwd=folder, env=env,
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
    try:
        line = prompt.stdout.readline()
        host, port = json.loads(line)["prompt"]
        assert host == "::1"
        done = subprocess.run([sys.executable, "decoder.py", "--peer", f"[::1]:{port}",
                               "--cluster-id", "8"], input=line, cwd=folder, env=env,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        assert done.stdout.count("bytes verified") == 1, done.stdout
    finally:
        prompt.terminate()  # SIGTERM: it serves until a signal with no terminal (issue 25)
        prompt.communicate(timeout=30)
    assert prompt.returncode == 0
