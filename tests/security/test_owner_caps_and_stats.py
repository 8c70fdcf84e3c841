"""Trust, round 3 (issue 21 items 1-4; issue 22 item 9): the owner and listener
(the C++ core's).

Each test names its item and says what happened before the fix. Owners are the core's
engines in this process, on loopback; hostile peers are raw sockets speaking the wire by hand.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest
from _hand import DECODER, PROMPT, Raw, blocks_cache, local_name, make

import datadist as llm
from datadist.api.cache_manager import CacheManager
from datadist.core.errors import Code, DatadistError
from datadist.core.native import NativeEngine
from datadist.wire import protocol as p

pytestmark = pytest.mark.timeout(60)


# ------------------------------------------------------------------ item 1: reverse channels


class TestReverseChannelHijack:
    """Item 1. Before: a raw HELLO(cluster 2, FEATURE_REVERSE) from any socket was adopted as
    the listener's end of cluster 2's link, replacing (and closing) the real decoder's; the
    prompt's next push went to the stranger and the decoder got nothing."""

    @pytest.mark.parametrize("proof", ["none", "wrong token"])
    def test_a_stranger_cannot_take_over_a_decoders_reverse_channel(
            self, engines: list[NativeEngine], proof: str) -> None:
        prompt = make(engines, PROMPT)
        decoder = make(engines, DECODER, listen=False)
        pcm = CacheManager(prompt, remote_cache_accessible=True)
        dcm = CacheManager(decoder, remote_cache_accessible=True)
        src, data = blocks_cache(pcm, PROMPT, 7, seed=3)
        _, dst = blocks_cache(dcm, DECODER, 9, seed=None)
        decoder.link(PROMPT, *prompt.listen_address, 5.0)
        real = prompt.get_link(DECODER)
        assert real.inbound

        stranger = Raw(prompt.listen_address)
        features, body = p.FEATURE_REVERSE, b""
        if proof == "wrong token":
            features, body = features | p.FEATURE_TOKEN, os.urandom(p.LINK_TOKEN_BYTES)
        answer = stranger.hello(DECODER, features, body)
        assert isinstance(answer, p.Error), answer
        assert answer.code == int(Code.LINK_FAILED)
        assert stranger.next() is None  # and closed
        stranger.close()

        assert prompt.get_link(DECODER) == real  # not replaced (NativeLink: same core link)
        prompt.check_link(DECODER, 5.0)  # nor closed: a PING over it reaches the decoder
        pcm.push_blocks(llm.BlocksCacheKey(DECODER, 9), src, [1, 2], [0, 3])
        want = np.zeros((4, 16), np.uint8)
        want[[0, 3]] = data.reshape(4, 16)[[1, 2]]
        np.testing.assert_array_equal(dst.reshape(4, 16), want)

    def test_a_token_of_another_cluster_does_not_count(self, engines: list[NativeEngine]
                                                       ) -> None:
        """A peer holding its own control channel (cluster 5) cannot file a reverse channel
        under another cluster id with its token."""
        prompt = make(engines, PROMPT)
        decoder = make(engines, DECODER, listen=False)
        decoder.link(PROMPT, *prompt.listen_address, 5.0)
        real = prompt.get_link(DECODER)
        control = Raw(prompt.listen_address)
        welcome = control.hello(5)
        assert isinstance(welcome, p.Welcome) and welcome.features & p.FEATURE_TOKEN
        token = p.split_token(welcome.proof, welcome.features)[1]
        rev = Raw(prompt.listen_address)
        answer = rev.hello(DECODER, p.FEATURE_REVERSE | p.FEATURE_TOKEN, token)
        assert isinstance(answer, p.Error) and answer.code == int(Code.LINK_FAILED)
        assert prompt.get_link(DECODER) == real  # not replaced (NativeLink: same core link)
        prompt.check_link(DECODER, 5.0)
        # ... and with its own cluster id the same token is accepted
        rev2 = Raw(prompt.listen_address)
        ok = rev2.hello(5, p.FEATURE_REVERSE | p.FEATURE_TOKEN, token)
        assert isinstance(ok, p.Welcome)
        assert prompt.get_link(5).inbound
        for r in (control, rev, rev2):
            r.close()

    def test_with_a_secret_the_token_rides_after_the_challenge(self, engines: list[NativeEngine]
                                                               ) -> None:
        prompt = make(engines, PROMPT, secret=b"s3cret")
        decoder = make(engines, DECODER, listen=False, secret=b"s3cret")
        decoder.link(PROMPT, *prompt.listen_address, 5.0)
        assert prompt.get_link(DECODER).inbound
        decoder.check_link(PROMPT, 5.0)
        prompt.check_link(DECODER, 5.0)  # over the reverse channel


# --------------------------------------------------- item 5 (issue 22 item 9): refusal = ERROR


def test_a_listener_at_its_reverse_cap_answers_an_error_the_linker_reports(
        engines: list[NativeEngine]) -> None:
    """Issue 22 item 9. Before: a listener that did not adopt a reverse channel still sent
    the handshake's last frame, so ``link`` succeeded and the listener could not push over
    it. Now the linker's link fails with the listener's code."""
    prompt = make(engines, PROMPT, max_connections=3, max_connections_per_peer=64)
    held = []
    for cid in (10, 11, 12):  # reverse channels whose control channels then go
        control = Raw(prompt.listen_address)
        welcome = control.hello(cid)
        token = p.split_token(welcome.proof, welcome.features)[1]
        rev = Raw(prompt.listen_address)
        assert isinstance(rev.hello(cid, p.FEATURE_REVERSE | p.FEATURE_TOKEN, token), p.Welcome)
        control.close()
        held.append(rev)
    decoder = make(engines, DECODER, listen=False)
    with pytest.raises(DatadistError) as e:
        decoder.link(PROMPT, *prompt.listen_address, 5.0)
    assert e.value.code == Code.LINK_FAILED and "reverse channels" in str(e.value)
    for r in held:
        r.close()


# ------------------------------------------------------------ item 2: the address oracle


def test_address_writes_answer_alike_wherever_they_point(
        engines: list[NativeEngine]) -> None:
    """Item 2. Before: a 0-byte WRITE by address passed the span checks and the answer (OK,
    "not remote accessible", KV_CACHE_NOT_EXIST) told whether an address lay inside a
    registered (even private) tensor. Now 0-byte spans are refused and every refusal for
    where the addresses point is one code and one message."""
    owner = make(engines, PROMPT)
    cm = CacheManager(owner)
    desc = llm.CacheDesc(1, [4, 64], llm.DataType.DT_UINT8, llm.Placement.DEVICE)
    private = np.zeros((1, 256), np.uint8)
    public = np.zeros((1, 256), np.uint8)
    cm.register_cache(desc, [int(private.ctypes.data)], [], False)
    cm.register_cache(desc, [int(public.ctypes.data)], [], True)
    peer = Raw(owner.listen_address)
    assert isinstance(peer.hello(DECODER), p.Welcome)
    one = np.array([0], np.uint32)
    probes = [(int(private.ctypes.data), 0), (int(private.ctypes.data), 8),
              (int(private.ctypes.data) + 250, 8), (0x1000, 8), (0x1000, 0),
              (int(public.ctypes.data), 0), (int(public.ctypes.data) + 250, 8)]
    answers = set()
    for rid, (addr, n) in enumerate(probes, start=2):
        peer.send(p.Write(p.KeyRef(p.KeyKind.ADDRESS), 0, 0, one,
                          np.array([addr], np.uint64), np.array([n], np.uint64)), rid)
        got = peer.next()
        assert got is not None and got[0] == rid
        assert isinstance(got[1], p.Error), (addr, n, got)
        answers.add((got[1].code, got[1].message))
    assert len(answers) == 1 and next(iter(answers))[0] == int(Code.PARAM_INVALID), answers
    peer.close()
    assert not private.any() and not public.any()


# ---------------------------------------------------------- item 3: the local channel's caps


def _local_hello(name: bytes) -> str:
    raw = Raw(name)
    answer = raw.hello(DECODER)
    kept.append(raw)
    return ("served" if isinstance(answer, p.Welcome)
            else "refused" if isinstance(answer, p.Error) else "closed")


kept: list[Raw] = []


@pytest.fixture
def keep() -> Iterator[list[Raw]]:
    yield kept
    for r in kept:
        r.close()
    kept.clear()


def test_the_local_channel_counts_in_the_configured_caps(engines: list[NativeEngine],
                                                          keep: list[Raw]) -> None:
    """Item 3. Before: the local channel had its own built-in caps (256, 32 per pid): with
    MaxConnections=4 one local process got every connection served. Now TCP and the local
    channel share the configured budget."""
    owner = make(engines, PROMPT, max_connections=4, max_connections_per_peer=64)
    name = local_name(os.getpid(), PROMPT)
    tcp = [Raw(owner.listen_address) for _ in range(2)]
    for r in tcp:
        assert isinstance(r.hello(DECODER), p.Welcome)
    got = [_local_hello(name) for _ in range(4)]
    assert got == ["served", "served", "refused", "refused"], got
    for r in tcp:
        r.close()


def test_the_local_per_peer_cap_counts_a_user_not_a_pid(engines: list[NativeEngine],
                                                         keep: list[Raw]) -> None:
    """Item 3. Before: local peers were counted per pid, so a fork got a fresh allowance.
    Now per uid: a child process of the same user finds the cap already used."""
    make(engines, PROMPT, max_connections=64, max_connections_per_peer=2)
    name = local_name(os.getpid(), PROMPT)
    assert [_local_hello(name) for _ in range(2)] == ["served", "served"]
    code = (
        "import socket, sys\n"
        "from datadist.wire import protocol as p\n"
        "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.settimeout(5)\n"
        f"s.connect({name!r})\n"
        f"s.sendall(p.encode(p.Hello({DECODER}, 2, 1, 0, bytes(16)), 1))\n"
        "d = p.FrameDecoder(); items = []\n"
        "while not items:\n"
        "    c = s.recv(65536)\n"
        "    if not c: break\n"
        "    items = d.feed(c)\n"
        "print(type(items[0][1]).__name__ if items else 'closed')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=30, env={**os.environ})
    assert out.stdout.strip() == "Error", (out.stdout, out.stderr)
    # and the owner's local listener is still up, the cap still used up by this user
    assert _local_hello(name) == "refused"


# ------------------------------------------------------------------------ item 4: STATS


def test_stats_tell_a_peer_only_its_own_series(engines: list[NativeEngine]) -> None:
    """Item 4. Before: STATS answered any linked peer with the whole process's metrics:
    other peers' cluster ids, transfer and byte counts, errors and latencies."""
    prompt = make(engines, PROMPT)
    pcm = CacheManager(prompt)
    src, _ = blocks_cache(pcm, PROMPT, 7, seed=1)
    a = make(engines, 20, listen=False)
    b = make(engines, 21, listen=False)
    for side in (a, b):
        side.link(PROMPT, *prompt.listen_address, 5.0)
        cm = CacheManager(side)
        dst, _ = blocks_cache(cm, side.config.cluster_id, 1, seed=None)
        cm.pull_blocks(llm.BlocksCacheKey(PROMPT, 7), dst, [0], [1])
    # The owner counts a pull once it has served it, which may be after the reader returned:
    # wait for both series, with a deadline (a fixed sleep raced the owner).
    deadline = time.monotonic() + 10
    while not {"20", "21"} <= set((whole := prompt.stats())["links"]):
        assert time.monotonic() < deadline, whole
        time.sleep(0.01)
    # the process itself sees everyone (above); a peer sees its own series only
    seen = a.peer_stats(PROMPT, 5.0)
    assert seen["cluster_id"] == PROMPT
    assert set(seen["links"]) == {"20"}
    assert seen["total"] == seen["links"]["20"]
    # as a key anywhere (not as digits: a duration such as 0.00021 is no disclosure)
    assert '"21"' not in json.dumps(seen)
