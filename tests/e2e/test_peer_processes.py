"""The peer-process helpers themselves: what the parent sees when a child fails, dies,
hangs or stops, and that teardown always kills it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from datadist.testing.procs import Peer, PeerDied, PeerError, PeerLink, PeerTimeout, serve

pytestmark = pytest.mark.timeout(30)


# Child targets: module level, so that spawn can import them by name.


def _nested_failure(depth: int) -> None:
    if depth == 0:
        raise ValueError("boom from the child")
    _nested_failure(depth - 1)


def raising_target(link: PeerLink) -> None:
    link.send("started")
    _nested_failure(2)


def returning_target(link: PeerLink, a: int, b: int) -> dict[str, object]:
    return {"sum": a + b, "pid": os.getpid(), "env": (os.environ.get("DD_TEST_SET"),
                                                      os.environ.get("DD_TEST_UNSET"))}


def exiting_target(link: PeerLink, code: int) -> None:
    link.send(os.getpid())
    os._exit(code)


def sleeping_target(link: PeerLink) -> None:
    link.send(os.getpid())
    time.sleep(3600)


def serving_target(link: PeerLink) -> None:
    state = {"n": 0}

    def incr(by: int = 1) -> int:
        state["n"] += by
        return state["n"]

    def fail(message: str) -> None:
        raise RuntimeError(message)

    def nap(seconds: float) -> str:
        time.sleep(seconds)
        return "woke"

    serve(link, {"incr": incr, "fail": fail, "nap": nap})


def _gone(pid: int) -> bool:
    """No such process, or a zombie nobody reaped yet (it no longer runs)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _wait_gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _gone(pid):
            return True
        time.sleep(0.02)
    return False


# Tests.


def test_child_traceback_is_forwarded() -> None:
    with Peer(raising_target) as peer:
        assert peer.recv(timeout=20) == "started"
        with pytest.raises(PeerError) as err:
            peer.recv(timeout=20)
    text = str(err.value)
    assert "ValueError: boom from the child" in text
    assert "_nested_failure" in text and "raising_target" in text
    assert err.value.remote_traceback.startswith("Traceback")


def test_return_value_and_environment() -> None:
    os.environ["DD_TEST_UNSET"] = "parent value"
    try:
        with Peer(returning_target, 2, 40,
                  env={"DD_TEST_SET": "child value", "DD_TEST_UNSET": None}) as peer:
            result = peer.join(timeout=20)
            pid = peer.pid
    finally:
        del os.environ["DD_TEST_UNSET"]
    assert result["sum"] == 42
    assert result["pid"] == pid != os.getpid()
    assert result["env"] == ("child value", None)


def test_serve_reports_failures_and_keeps_serving() -> None:
    with Peer(serving_target) as peer:
        assert peer.call("incr") == 1
        with pytest.raises(PeerError) as err:
            peer.call("fail", message="op went wrong")
        assert "RuntimeError: op went wrong" in str(err.value)
        with pytest.raises(PeerError, match="unknown op 'nope'"):
            peer.call("nope")
        assert peer.call("incr", by=10) == 11
        assert peer.alive


def test_late_reply_is_not_taken_for_the_next_one() -> None:
    with Peer(serving_target) as peer:
        with pytest.raises(PeerTimeout):
            peer.call("nap", timeout=0.1, seconds=0.5)
        assert peer.call("incr", by=5) == 5  # not "woke", the nap's late reply
        assert peer.call("nap", seconds=0) == "woke"


@pytest.mark.parametrize("how", ["exit", "sigkill"])
def test_child_death_is_reported(how: str) -> None:
    with Peer(exiting_target if how == "exit" else sleeping_target,
              *((3,) if how == "exit" else ())) as peer:
        pid = peer.recv(timeout=20)
        if how == "sigkill":
            os.kill(pid, signal.SIGKILL)
        with pytest.raises(PeerDied) as err:
            peer.recv(timeout=20)
    assert ("exit code 3" if how == "exit" else "killed by SIGKILL") in str(err.value)


def test_silent_child_times_out() -> None:
    peer = Peer(sleeping_target)
    try:
        peer.recv(timeout=20)
        with pytest.raises(PeerTimeout):
            peer.recv(timeout=0.2)
        assert peer.alive
    finally:
        peer.close(grace=0.1)  # it never reads the stop request: no point waiting long
    assert peer.exitcode == -signal.SIGKILL


def test_close_kills_a_stopped_child() -> None:
    peer = Peer(sleeping_target)
    pid = peer.recv(timeout=20)
    peer.stop()
    with open(f"/proc/{pid}/stat") as f:
        assert f.read().rsplit(")", 1)[1].split()[0] == "T"
    peer.close(grace=0.2)
    assert not peer.alive
    assert peer.exitcode == -signal.SIGKILL
    assert _gone(pid)
    peer.close()  # idempotent


def test_closing_a_serving_child_stops_it_cleanly() -> None:
    peer = Peer(serving_target)
    assert peer.call("incr") == 1
    peer.close()
    assert peer.exitcode == 0


# A parent that starts a peer, prints its pid and vanishes without any teardown.
_ORPHANING_PARENT = """
import os
from datadist.testing.procs import Peer
from e2e.test_peer_processes import sleeping_target
peer = Peer(sleeping_target)
print(peer.recv(timeout=20), flush=True)
os._exit(0)
"""


def test_child_dies_with_its_parent() -> None:
    tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [
        tests_dir, os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-c", _ORPHANING_PARENT], env=env,
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    child_pid = int(out.stdout.split()[0])
    assert _wait_gone(child_pid), f"peer {child_pid} outlived its parent"
