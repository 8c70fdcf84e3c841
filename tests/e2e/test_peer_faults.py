"""Faults between two real processes: a peer that stops, dies, or leaves mid-transfer, and
unlinked clusters. Every blocking call must come back with a status code, never hang.

Time bounds here are deliberately loose (several times ``sync_kv_timeout``): they check that
the deadline is honoured at all, not how fast anything is.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator

import pytest

import datadist as llm_datadist
from datadist.testing.fakes import fake_owner_main
from datadist.testing.peers import (
    CacheSpec,
    Decoder,
    PromptConfig,
    RunningPrompt,
    pattern,
    start_prompt,
)
from datadist.testing.procs import Peer

from ._support import PROMPT_ENV, PROMPT_ID, assert_bytes_equal, assert_zero, serving, units

pytestmark = pytest.mark.timeout(30)

S = llm_datadist.LLMStatusCode
SPEC = CacheSpec(4, (4, 8, 64))
SEED = 5
SYNC_KV_TIMEOUT_MS = 500
BOUND_S = 5.0  # 10x the timeout: generous, so a loaded machine cannot fail it
VICTIM_ID = PROMPT_ID + 1
FAKE_ID = PROMPT_ID + 2

PROMPT_CONFIG = PromptConfig(PROMPT_ID, setup=(("register_cache", {"spec": SPEC, "seed": SEED}),))
VICTIM_CONFIG = PromptConfig(VICTIM_ID, setup=(("register_cache", {"spec": SPEC, "seed": SEED}),
                                                ("register_cache", {"spec": SPEC, "seed": SEED})))


@pytest.fixture
def victim() -> Iterator[RunningPrompt]:
    """A prompt of its own, for the tests that stop or kill it."""
    running = start_prompt(serving(VICTIM_CONFIG), env=PROMPT_ENV)
    try:
        yield running
    finally:
        running.close()


def timed_pull(dec: Decoder, cluster: int, cache: object, batch_index: int = 0,
               cache_id: int = 1) -> tuple[llm_datadist.LLMException, float]:
    start = time.monotonic()
    with pytest.raises(llm_datadist.LLMException) as err:
        dec.cm.pull_cache(llm_datadist.CacheKeyByIdAndIndex(cluster, cache_id, 0), cache,
                          batch_index)
    return err.value, time.monotonic() - start


def linked_to(make_decoder: Callable[..., Decoder], cluster: int,
              address: tuple[str, int]) -> Decoder:
    dec = make_decoder(sync_kv_timeout=SYNC_KV_TIMEOUT_MS)
    assert dec.link(cluster, address) == S.LLM_SUCCESS
    return dec


def test_stopped_peer_gives_timeout_then_link_recovers(
        transport: str, make_decoder: Callable[..., Decoder], victim: RunningPrompt) -> None:
    dec = linked_to(make_decoder, VICTIM_ID, victim.address)
    assert dec.path_name(VICTIM_ID) == transport
    cache, arr = dec.local(SPEC)
    dec.cm.pull_cache(llm_datadist.CacheKeyByIdAndIndex(VICTIM_ID, 1, 0), cache, 0)

    victim.peer.stop()  # SIGSTOP, waited for: holds its sockets open, answers nothing
    try:
        # Cache 2 was never read: the owner must answer (a READ, or on the same host a
        # lease request), and does not.
        err, elapsed = timed_pull(dec, VICTIM_ID, cache, 1, cache_id=2)
        assert err.status_code == S.LLM_TIMEOUT, err
        assert elapsed < BOUND_S
        assert_zero(units(arr, SPEC)[:, 1:], "bytes of the timed-out pull")
        if transport in ("cma", "shm"):
            # Cache 1 is leased: its memory is still registered and readable while the
            # owner is stopped (as a NIC reads it), so the pull succeeds with the right bytes.
            dec.cm.pull_cache(llm_datadist.CacheKeyByIdAndIndex(VICTIM_ID, 1, 1), cache, 1)
            assert_bytes_equal(units(arr, SPEC)[:, 1], units(pattern(SPEC, SEED), SPEC)[:, 1])
            units(arr, SPEC)[:, 1] = 0
    finally:
        victim.peer.resume()

    # The peer is back: the next pull reconnects on its own and moves the right bytes.
    dec.cm.pull_cache(llm_datadist.CacheKeyByIdAndIndex(VICTIM_ID, 1, 3), cache, 2)
    want = units(pattern(SPEC, SEED), SPEC)
    assert_bytes_equal(units(arr, SPEC)[:, 0], want[:, 0])
    assert_bytes_equal(units(arr, SPEC)[:, 2], want[:, 3])


def test_killed_peer_gives_link_failed_or_timeout(
        transport: str, make_decoder: Callable[..., Decoder], victim: RunningPrompt) -> None:
    dec = linked_to(make_decoder, VICTIM_ID, victim.address)
    assert dec.path_name(VICTIM_ID) == transport
    cache, _ = dec.local(SPEC)
    dec.cm.pull_cache(llm_datadist.CacheKeyByIdAndIndex(VICTIM_ID, 1, 0), cache, 0)

    victim.peer.kill()  # SIGKILL, reaped
    assert victim.peer.exitcode == -signal.SIGKILL
    for _ in range(2):  # the broken link, then the failed reconnect
        err, elapsed = timed_pull(dec, VICTIM_ID, cache, 1)
        assert err.status_code in (S.LLM_LINK_FAILED, S.LLM_TIMEOUT), err
        assert elapsed < BOUND_S

    assert dec.unlink(VICTIM_ID, force=True) == S.LLM_SUCCESS
    # Linking to the dead address reports the failure as a code; it does not raise.
    assert dec.link(VICTIM_ID, victim.address, timeout_ms=1000) == S.LLM_LINK_FAILED


def test_unlink_then_pull_is_not_yet_link_and_relink_works(
        transport: str, decoder: Decoder, prompt: RunningPrompt) -> None:
    cache, arr = decoder.local(SPEC)
    key = llm_datadist.CacheKeyByIdAndIndex(PROMPT_ID, 1, 1)
    decoder.cm.pull_cache(key, cache, 0)
    assert decoder.link(PROMPT_ID, prompt.address) == S.LLM_ALREADY_LINK

    assert decoder.unlink(PROMPT_ID) == S.LLM_SUCCESS
    assert decoder.dd.engine.links() == []
    with pytest.raises(llm_datadist.LLMException) as err:
        decoder.cm.pull_cache(key, cache, 1)
    assert err.value.status_code == S.LLM_NOT_YET_LINK
    info = decoder.cluster(PROMPT_ID, prompt.address)
    # nothing of ours left; as the original, which dials the (live) listener to tell it
    assert decoder.dd.unlink_clusters([info], 1000)[1] == [S.LLM_SUCCESS]

    assert decoder.link(PROMPT_ID, prompt.address) == S.LLM_SUCCESS
    assert decoder.path_name(PROMPT_ID) == transport
    decoder.cm.pull_cache(key, cache, 2)
    got, want = units(arr, SPEC), units(pattern(SPEC, SEED), SPEC)
    assert_bytes_equal(got[:, 0], want[:, 1])
    assert_bytes_equal(got[:, 2], want[:, 1])
    assert_zero(got[:, [1, 3]])


@pytest.mark.parametrize(
    ("behaviour", "codes"),
    [
        ("stall", {S.LLM_TIMEOUT}),
        ("exit", {S.LLM_LINK_FAILED}),
        ("reset", {S.LLM_LINK_FAILED}),
        ("oversize", {S.LLM_SUSPECT_REMOTE_ERROR}),
    ],
)
def test_owner_failing_mid_transfer(behaviour: str, codes: set[S],
                                    make_decoder: Callable[..., Decoder],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A fake owner sends half the bytes it announced, then stalls, exits or resets (or
    announces more bytes than were asked for). The pull fails with a code, in time."""
    monkeypatch.setenv("DATADIST_TRANSPORT", "tcp")
    with Peer(fake_owner_main, FAKE_ID, behaviour, env=PROMPT_ENV) as fake:
        address = tuple(fake.recv(timeout=10))
        dec = linked_to(make_decoder, FAKE_ID, address)  # type: ignore[arg-type]
        assert dec.path_name(FAKE_ID) == "tcp"
        cache, _ = dec.local(SPEC)
        err, elapsed = timed_pull(dec, FAKE_ID, cache)
        assert err.status_code in codes, err
        assert elapsed < BOUND_S
        if behaviour != "exit":
            assert fake.recv(timeout=10) == "partial"
