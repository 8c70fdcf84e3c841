"""``datadist`` CLI errors (issue 9, item 18): every error is one clear line on stderr and a
non-zero exit code, never a traceback; ``info --peer`` predicts the path a pull really takes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from datadist import cli
from datadist.core import native
from datadist.testing.procs import Peer, PeerLink

pytestmark = pytest.mark.timeout(120)
SRC = str(Path(cli.__file__).resolve().parents[2])
# ``info --peer`` links with the core (the one engine), as the owner and the real decoder do.


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        rc = cli.main(argv)
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return rc, out, err


def one_error_line(rc: int, err: str) -> str:
    assert rc != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize("argv, says", [
    (["demo", "--layers", "0"], "--layers: 0 is out of range"),
    (["demo", "--blocks", "-5"], "--blocks: -5 is out of range"),
    (["demo", "--blocks", "1"], "--blocks: 1 is out of range"),
    (["demo", "--seq", "x"], "'x' is not an integer"),
    (["demo", "--layers", "4096", "--seq", "1000000"], "GiB"),
    (["info", "--cluster-id", "-1"], "--cluster-id"),
    (["info", "--peer", "nonsense"], "expected 'ip:port', got 'nonsense'"),
    (["info", "--peer", "127.0.0.1:99999"], "got '127.0.0.1:99999'"),
    (["info", "--peer", "127.0.0.1:1", "--cluster-id", "3", "--own-id", "3"], "both 3"),
    (["frobnicate"], "invalid choice"),
])
def test_bad_arguments_are_one_line(argv, says, capsys):
    line = one_error_line(*run(argv, capsys)[::2])
    assert says in line


def test_dead_port(capsys):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc, _, err = run(["info", "--peer", f"127.0.0.1:{port}", "--timeout", "2"], capsys)
    assert rc == 1
    assert "Connection refused" in one_error_line(rc, err)


def test_wrong_cluster_id(capsys):
    from datadist.core.config import EngineConfig

    owner = native.NativeEngine(EngineConfig(cluster_id=5, role=1, listen=("127.0.0.1", 0)))
    try:
        host, port = owner.listen_address
        rc, _, err = run(["info", "--peer", f"{host}:{port}", "--cluster-id", "7"], capsys)
        assert "is cluster 5, not 7" in one_error_line(rc, err)
        rc, out, err = run(["info", "--peer", f"{host}:{port}", "--cluster-id", "5"], capsys)
        assert rc == 0 and "link to cluster 5" in out and not err
        assert "peer metrics: cluster 5, role PROMPT" in out  # STATS, from the core
    finally:
        owner.close()


def test_demo_child_failure_is_one_line():
    """The PROMPT child fails in init (a bad transport in the environment): the parent says
    so in one line, without the child's traceback."""
    env = {**os.environ, "PYTHONPATH": SRC, "DATADIST_TRANSPORT": "bogus"}
    proc = subprocess.run([sys.executable, "-m", "datadist.cli", "demo", "--layers", "1",
                           "--blocks", "2", "--seq", "1", "--batch", "1", "--transport", "tcp"],
                          env=env, capture_output=True, text=True, timeout=100)
    line = one_error_line(proc.returncode, proc.stderr)
    assert "PROMPT process failed" in line and "unknown transport 'bogus'" in line


# ------------------------------------------------------------------ path prediction


def decoder_as(link: PeerLink, uid: int | None, host: str, port: int, cache_id: int) -> None:
    """As user ``uid`` (None: ours): run ``datadist info --peer`` and then a real pull from
    the owner, both on the core; report (the path and reason info predicted, the path and
    reason of the decoder's link after the pull, bytes right, info's output)."""
    import contextlib
    import encodings.idna  # noqa: F401 - socket name lookups load it lazily
    import io

    import datadist.api.llm_datadist  # noqa: F401 - everything imported before setuid
    import datadist.core.local  # noqa: F401
    import datadist.core.nixl_wheel

    datadist.core.nixl_wheel.available()  # info reports NIXL: its imports happen before setuid
    native.core_module()
    from datadist.api.cache_manager import CacheManager
    from datadist.api.enums import DataType, Placement
    from datadist.api.types import CacheDesc, CacheKeyByIdAndIndex
    from datadist.core.config import EngineConfig

    if uid is not None:
        os.setgid(uid)
        os.setuid(uid)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli.main(["info", "--peer", f"{host}:{port}", "--cluster-id", "5"])
    assert rc == 0
    link_line = next(x for x in out.getvalue().splitlines() if x.startswith("link to cluster"))
    predicted = re.fullmatch(r".*: path=(\w+) \((.*)\)", link_line).groups()
    decoder = native.NativeEngine(EngineConfig(cluster_id=9, role=2, sync_timeout=10.0))
    try:
        decoder.link(5, host, port, 5.0)
        dst = np.zeros(4096, np.uint8)
        cm = CacheManager(decoder)
        local = cm.register_cache(CacheDesc(1, [1, 4096], DataType.DT_UINT8, Placement.HOST),
                                  [dst])
        cm.pull_cache(CacheKeyByIdAndIndex(5, cache_id), local)
        ok = bool(np.array_equal(dst, np.arange(4096, dtype=np.uint32).astype(np.uint8)))
        taken = decoder.get_link(5)
        link.send((predicted, (taken.path_name, taken.reason), ok, out.getvalue()))
    finally:
        decoder.close()


@pytest.mark.parametrize("other_user", [False, True])
def test_info_predicts_the_path_of_a_real_pull(other_user):
    """``info --peer`` says the path the first pull really takes, and why, as the core sees
    it. A decoder of another user than the owner may not read its memory: the core pulls
    over the local channel ("local"); info must say so then, not cma."""
    if other_user and os.geteuid() != 0:
        pytest.skip("needs root to start a decoder as another user")
    from datadist.api.cache_manager import CacheManager
    from datadist.api.enums import DataType, Placement
    from datadist.api.types import CacheDesc
    from datadist.core.config import EngineConfig

    owner = native.NativeEngine(EngineConfig(cluster_id=5, role=1, listen=("127.0.0.1", 0)))
    try:
        data = np.arange(4096, dtype=np.uint32).astype(np.uint8)
        cache = CacheManager(owner).register_cache(
            CacheDesc(1, [1, 4096], DataType.DT_UINT8, Placement.HOST), [data])
        host, port = owner.listen_address
        with Peer(decoder_as, 65534 if other_user else None, host, port, cache.cache_id,
                  name="decoder") as peer:
            predicted, taken, ok, out = peer.recv(60)
    finally:
        owner.close()
    assert ok
    assert predicted[0] == taken[0], out
    assert predicted[1] == taken[1], out  # info asked the kernel as the first pull does
    if other_user:
        # the kernel refuses cross-memory attach to another user's process ("refused"), or
        # the local channel's credentials already tell it is not ours to read
        assert taken[0] == "local", out
        assert "refused" in out or "not ours to read" in out, out
    else:
        assert taken[0] == "cma", out


def test_llm_demo_child_failure_is_one_line(monkeypatch, capsys):
    pytest.importorskip("transformers")
    from datadist.demos import llm

    def failing_run(args, out=None):
        raise llm._ChildFailed("the prompt process failed:\nTraceback (most recent call "
                               "last):\n  File \"x.py\", line 1, in f\nValueError: bad block")

    monkeypatch.setattr(llm, "run", failing_run)
    rc, _, err = run(["demo", "--llm"], capsys)
    line = one_error_line(rc, err)
    assert "the prompt process failed" in line and "ValueError: bad block" in line
