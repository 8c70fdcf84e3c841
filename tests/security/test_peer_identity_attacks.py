"""Trust, round 3, attacked (issues 21 and 26 after their fixes): what a hostile review of
the link tokens, the connection budget, STATS and NIXL consent found, one test per defect.

Owners are the core's engines in this process, on loopback; hostile peers are raw sockets
speaking the wire by hand. Each test says what happened before its fix.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
from _hand import DECODER, PROMPT, Raw, blocks_cache, make

import datadist as llm
from datadist.api.cache_manager import CacheManager
from datadist.core.errors import Code
from datadist.core.native import NativeEngine
from datadist.testing import engine as hooks
from datadist.wire import protocol as p

pytestmark = pytest.mark.timeout(60)


def impostor_token(listener: tuple[str, int], cluster_id: int, **kw: Any) -> tuple[Raw, bytes]:
    """A stranger's own control channel under ``cluster_id`` (the id is only a claim), and
    the link token the listener issued it."""
    control = Raw(listener)
    welcome = control.hello(cluster_id, **kw)
    assert isinstance(welcome, p.Welcome) and welcome.features & p.FEATURE_TOKEN
    return control, p.split_token(welcome.proof, welcome.features)[1]


def assert_kept(engine: NativeEngine, cluster_id: int, real: Any) -> None:
    """``engine``'s link to ``cluster_id`` is still ``real`` (a NativeLink snapshot: equal
    only for the same core link) and its channel is
    open: a PING over it (for a decoder's link to a listener: over its reverse channel)
    reaches the peer and is answered."""
    assert engine.get_link(cluster_id) == real
    engine.check_link(cluster_id, 5.0)


class TestSecondControlChannel:
    """Before: any live control channel of cluster 2 made its token good for cluster 2's
    reverse channel, so a stranger opened its own control channel claiming cluster 2, echoed
    the token it was given, and replaced (and closed) the real decoder's reverse channel: the
    prompt's next push went to the stranger (the push timed out, the decoder got nothing).
    The token proved holding *a* control channel of that id, not *the* link's."""

    def test_a_second_control_channel_cannot_take_a_live_reverse_channel(
            self, engines: list[NativeEngine]) -> None:
        prompt = make(engines, PROMPT)
        decoder = make(engines, DECODER, listen=False)
        pcm = CacheManager(prompt, remote_cache_accessible=True)
        dcm = CacheManager(decoder, remote_cache_accessible=True)
        src, data = blocks_cache(pcm, PROMPT, 7, seed=3)
        _, dst = blocks_cache(dcm, DECODER, 9, seed=None)
        decoder.link(PROMPT, *prompt.listen_address, 5.0)
        real = prompt.get_link(DECODER)

        control, token = impostor_token(prompt.listen_address, DECODER)
        rev = Raw(prompt.listen_address)
        answer = rev.hello(DECODER, p.FEATURE_REVERSE | p.FEATURE_TOKEN, token)
        assert isinstance(answer, p.Error) and answer.code == int(Code.LINK_FAILED), answer
        assert rev.next() is None
        assert_kept(prompt, DECODER, real)

        pcm.push_blocks(llm.BlocksCacheKey(DECODER, 9), src, [1, 2], [0, 3])
        want = np.zeros((4, 16), np.uint8)
        want[[0, 3]] = data.reshape(4, 16)[[1, 2]]
        np.testing.assert_array_equal(dst.reshape(4, 16), want)
        for r in (control, rev):
            r.close()

    def test_a_relink_after_the_first_control_channel_went_replaces_it(
            self, engines: list[NativeEngine]) -> None:
        """What still works: once the control channel a reverse channel belongs to is gone,
        a reverse channel of a new control channel of that id replaces it."""
        prompt = make(engines, PROMPT)
        first, token1 = impostor_token(prompt.listen_address, 30)
        rev1 = Raw(prompt.listen_address)
        assert isinstance(rev1.hello(30, p.FEATURE_REVERSE | p.FEATURE_TOKEN, token1),
                          p.Welcome)
        old = prompt.get_link(30)
        first.close()  # its control channel goes; its reverse channel stays open
        second, token2 = impostor_token(prompt.listen_address, 30)
        for _ in range(100):  # the listener notices the close on its serving thread
            rev2 = Raw(prompt.listen_address)
            answer = rev2.hello(30, p.FEATURE_REVERSE | p.FEATURE_TOKEN, token2)
            if isinstance(answer, p.Welcome):
                break
            rev2.close()
        assert isinstance(answer, p.Welcome), answer
        assert prompt.get_link(30) != old  # replaced (NativeLink: another core link)
        for r in (rev1, second, rev2):
            r.close()

    def test_a_strangers_bye_with_the_linkers_pid_does_not_end_its_link(
            self, engines: list[NativeEngine]) -> None:
        """Before: a Bye on any control channel of cluster 2 whose Hello named the linker's
        pid and boot id (a same-host linker has the listener's boot id, which the
        listener's Welcome tells; pids are few) closed the real reverse channel."""
        prompt = make(engines, PROMPT)
        decoder = make(engines, DECODER, listen=False)
        decoder.link(PROMPT, *prompt.listen_address, 5.0)
        real = prompt.get_link(DECODER)
        ident = decoder.identity
        control, _ = impostor_token(prompt.listen_address, DECODER, pid=ident.pid,
                                    boot_id=ident.boot_id)
        control.send(p.Bye(), 2)
        got = control.next()
        assert got is not None and isinstance(got[1], p.Ok)
        control.close()
        assert_kept(prompt, DECODER, real)


def test_stats_are_not_told_to_a_connection_that_claims_a_linked_peers_id(
        engines: list[NativeEngine]) -> None:
    """Before: STATS answered the series of whatever cluster id the asking connection's Hello
    claimed, so a raw Hello naming cluster 20 (a linked decoder's id) read that decoder's
    transfer counts, bytes and latencies. Now, while cluster 20's link has a live reverse
    channel, only the control channel it belongs to is told them."""
    prompt = make(engines, PROMPT)
    pcm = CacheManager(prompt)
    blocks_cache(pcm, PROMPT, 7, seed=1)
    a = make(engines, 20, listen=False)
    a.link(PROMPT, *prompt.listen_address, 5.0)
    cm = CacheManager(a)
    dst, _ = blocks_cache(cm, 20, 1, seed=None)
    cm.pull_blocks(llm.BlocksCacheKey(PROMPT, 7), dst, [0], [1])
    assert set(a.peer_stats(PROMPT, 5.0)["links"]) == {"20"}  # the real one still is
    stranger = Raw(prompt.listen_address)
    assert isinstance(stranger.hello(20), p.Welcome)
    stranger.send(p.StatsRequest(), 2)
    got = stranger.next()
    assert got is not None and isinstance(got[1], p.Stats)
    told = got[1].json.decode()
    assert '"links":{}' in told and "transfers" not in told, told
    stranger.close()


def test_a_nixl_lease_needs_the_readers_own_reverse_channel(engines: list[NativeEngine]) -> None:
    """Before: NixlLease was granted to any connection whose Hello named a linked NIXL
    reader's cluster id, pid and boot id (a same-host reader shares the owner's boot id,
    which the owner's Welcome tells; pids are few): the stranger pinned the cache, and its
    revokes went to the real reader's reverse channel. Now only the connection the reader's
    reverse channel belongs to (its link token) gets a lease."""
    from datadist.core import nixl_wheel as nixl
    from datadist.core.layout import Geometry

    if nixl.available() is None:
        pytest.skip("nixl-cu12 not installed")
    owner = make(engines, PROMPT, nixl_serve=True, nixl_whole_process=True,
                 remote_cache_accessible=True)
    reader = make(engines, DECODER, listen=False, transport="nixl", nixl_whole_process=True)
    src = np.full(4096, 3, np.uint8)
    entry = owner.register(Geometry(1, 4096, 1), [src.ctypes.data], placement=0)
    link = reader.link(PROMPT, *owner.listen_address, 5.0)
    assert link.path_name == "nixl", link.reason
    ident = reader.identity
    stranger = Raw(owner.listen_address)
    assert isinstance(stranger.hello(DECODER, pid=ident.pid, boot_id=ident.boot_id), p.Welcome)
    stranger.send(p.NixlLease(p.KeyRef(p.KeyKind.CACHE_ID, entry.cache_id, 0, 0), 0), 2)
    got = stranger.next()
    assert got is not None and isinstance(got[1], p.Error), got
    assert got[1].code == int(Code.FEATURE_NOT_ENABLED) and "reverse channel" in got[1].message
    assert hooks.nixl_leases(owner) == 0
    stranger.close()


def test_one_address_cannot_fill_the_reverse_channel_table(engines: list[NativeEngine]) -> None:
    """Before: reverse channels were capped in all (max_connections) but not per address:
    one host opened a control channel, its reverse channel, closed the control channel and
    went on with the next cluster id, until the table was full and every other peer's link
    failed ("too many reverse channels"), whatever max_connections_per_peer said."""
    prompt = make(engines, PROMPT, max_connections=8, max_connections_per_peer=2)
    held: list[Raw] = []
    answers = []
    for cid in range(10, 14):
        for _ in range(100):  # until the listener noticed the last control channel's close
            control = Raw(prompt.listen_address)
            welcome = control.hello(cid)
            if isinstance(welcome, p.Welcome):
                break
            control.close()
            time.sleep(0.02)
        assert isinstance(welcome, p.Welcome), welcome
        token = p.split_token(welcome.proof, welcome.features)[1]
        rev = Raw(prompt.listen_address)
        answers.append(type(rev.hello(cid, p.FEATURE_REVERSE | p.FEATURE_TOKEN,
                                      token)).__name__)
        control.close()
        held.append(rev)
    assert answers == ["Welcome", "Welcome", "Error", "Error"], answers
    assert prompt.reverse_ids() == [10, 11]  # the refused two were not adopted
    for r in held:
        r.close()
