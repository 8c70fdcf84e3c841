"""Peer faults between real PROMPT and DECODER processes on one host: the prompt is killed
(SIGKILL) before, during and after a pull, stopped (SIGSTOP) before and during one, restarted
under the same identity, or its listener is closed.

What every test holds the decoder to: a pull that the fault hits ends with LLMException
LLM_TIMEOUT or LLM_LINK_FAILED within ``sync_kv_timeout`` plus a generous margin (a bound
against hangs, not a speed check), and the decoder process stays usable: it still pulls
correct bytes from a healthy prompt and ``unlink_clusters(force=True)`` succeeds.
"""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
from fault_harness import (
    Peer,
    Peers,
    RawClient,
    file_words_nonzero,
    link,
    measured,
    target,
    watch_progress,
)
from fault_peer import pattern

from datadist.core import nixl_wheel as nixl
from datadist.wire import protocol as p

MARGIN = 10.0  # seconds on top of a deadline: generous, this only catches hangs
FAILED = {"LLM_TIMEOUT", "LLM_LINK_FAILED"}
SMALL = {"num_tensors": 2, "blocks": 16, "block_bytes": 4096}
ALL = list(range(16))
# 512 MiB: two tensors of 64 blocks of 4 MiB, pulled whole (one span per tensor on the wire).
BIG = {"num_tensors": 2, "blocks": 64, "block_bytes": 4 << 20}
BIG_ALL = list(range(64))
BIG_SYNC_MS = 3000  # the deadline of the large pulls (they are cut long before it)

TRANSPORTS = ["tcp", "cma"]
if nixl.available() is not None:  # the optional NIXL data path, where its wheel is installed
    TRANSPORTS.append("nixl")


def _env(transport: str) -> dict[str, str]:
    if transport == "nixl":  # opt-in, and this host's UCX transports check no memory key
        return {"DATADIST_TRANSPORT": transport, "DATADIST_NIXL_SERVE": "1",
                "DATADIST_NIXL_ALLOW_WHOLE_PROCESS_ACCESS": "1"}
    return {"DATADIST_TRANSPORT": transport}


def _world(peers: Peers, transport: str, sync_ms: int = 1000) -> tuple[Peer, Peer, Peer]:
    """A victim prompt (seed 1), a healthy prompt (seed 2) and a decoder linked to both."""
    env = _env(transport)
    victim = peers.prompt(env=env, name="victim")
    healthy = peers.prompt(env=env, name="healthy")
    dec = peers.decoder(env=env, sync_ms=sync_ms)
    victim.call("register", name="src", seed=1, **SMALL)
    healthy.call("register", name="src", seed=2, **SMALL)
    dec.call("register", name="dst", **SMALL)
    for prompt in (victim, healthy):
        assert link(dec, prompt)["code"] == "LLM_SUCCESS"
    return victim, healthy, dec


def _pull(dec: Peer, prompt: Peer, seed: int | None = None, **kw) -> dict:  # type: ignore[no-untyped-def]
    args = {"dst": "dst", "src_blocks": ALL, "dst_blocks": ALL, "clear": True, **kw}
    return dec.call("pull", cid=prompt.cluster_id, seed=seed, timeout=120, **args)


def _assert_failed_in_time(r: dict, sync_s: float, label: str) -> None:
    assert not r["ok"], f"{label}: the pull succeeded, expected a failure: {r}"
    assert r["code"] in FAILED, f"{label}: {r}"
    measured(f"{label} -> {r['code']}", r["elapsed"], sync_s + MARGIN)
    assert r["elapsed"] < sync_s + MARGIN, f"{label}: took {r['elapsed']:.1f} s: {r}"


def _assert_usable(dec: Peer, healthy: Peer, victim: Peer) -> None:
    """The decoder still moves correct bytes, and can drop its end of the broken link."""
    r = _pull(dec, healthy, seed=2)
    assert r["ok"] and r["verified"], r
    r = dec.call("unlink", clusters=target(victim), force=True)
    assert r["code"] == "LLM_SUCCESS", r
    assert dec.call("pull", cid=victim.cluster_id, dst="dst", src_blocks=ALL,
                    dst_blocks=ALL)["code"] == "LLM_NOT_YET_LINK"


# ------------------------------------------------------------------------------ SIGKILL


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_killed_before_pull(peers: Peers, transport: str) -> None:
    victim, healthy, dec = _world(peers, transport)
    victim.kill()
    # The first pull finds the dead connection, the second one a refused reconnect.
    for attempt in ("first", "second"):
        r = _pull(dec, victim)
        _assert_failed_in_time(r, 1.0, f"[{transport}] killed before pull, {attempt} pull")
    _assert_usable(dec, healthy, victim)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_killed_after_pull(peers: Peers, transport: str) -> None:
    victim, healthy, dec = _world(peers, transport)
    r = _pull(dec, victim, seed=1)
    assert r["ok"] and r["verified"], r
    victim.kill()
    r = _pull(dec, victim, clear=False)
    _assert_failed_in_time(r, 1.0, f"[{transport}] killed after pull, next pull")
    # The failed pull may have landed nothing or part: the bytes pulled before are only
    # overwritten by bytes the peer really sent. Pull again from the healthy peer instead.
    _assert_usable(dec, healthy, victim)


@pytest.mark.timeout(90)
def test_killed_during_large_tcp_pull(tcp_peers: Peers, shm_dir: str) -> None:
    victim, healthy, dec = _world(tcp_peers, "tcp", sync_ms=BIG_SYNC_MS)
    victim.call("register", name="big", seed=5, model_id=1, cheap=True, **BIG)
    shm = os.path.join(shm_dir, "dst")
    dec.call("register", name="big", shm=shm, **BIG)
    tensor = BIG["blocks"] * BIG["block_bytes"]
    dec.send("pull", cid=victim.cluster_id, dst="big", model_id=1, src_blocks=BIG_ALL,
             dst_blocks=BIG_ALL)
    # Kill once 8 MiB have landed: the transfer is under way, most of it still to come.
    assert watch_progress(shm, 8 << 20, timeout=30), "the pull never started"
    victim.kill()
    r = dec.recv(BIG_SYNC_MS / 1000 + MARGIN + 5)
    _assert_failed_in_time(r, BIG_SYNC_MS / 1000, "[tcp] killed during a 512 MiB pull")
    assert not file_words_nonzero(shm, 2 * tensor - (1 << 20), 1 << 20), \
        "the last MiB arrived: the kill did not land mid-transfer"
    _assert_usable(dec, healthy, victim)


# ------------------------------------------------------------------------------ SIGSTOP


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_stopped_before_pull(peers: Peers, transport: str) -> None:
    """A silent peer (alive, connected, not answering) is noticed by the pull's deadline;
    once it runs again the same link works again (the timed-out channel is replaced)."""
    victim, healthy, dec = _world(peers, transport)
    victim.stop()
    try:
        r = _pull(dec, victim)
        assert r["code"] == "LLM_TIMEOUT", r
        _assert_failed_in_time(r, 1.0, f"[{transport}] stopped before pull")
        r = _pull(dec, healthy, seed=2)
        assert r["ok"] and r["verified"], r
    finally:
        victim.signal(signal.SIGCONT)
    r = _pull(dec, victim, seed=1)
    assert r["ok"] and r["verified"], f"no recovery after SIGCONT: {r}"
    _assert_usable(dec, healthy, victim)


@pytest.mark.timeout(90)
def test_stopped_during_large_tcp_pull(tcp_peers: Peers, shm_dir: str) -> None:
    victim, healthy, dec = _world(tcp_peers, "tcp", sync_ms=BIG_SYNC_MS)
    victim.call("register", name="big", seed=5, model_id=1, cheap=True, **BIG)
    shm = os.path.join(shm_dir, "dst")
    dec.call("register", name="big", shm=shm, **BIG)
    dec.send("pull", cid=victim.cluster_id, dst="big", model_id=1, src_blocks=BIG_ALL,
             dst_blocks=BIG_ALL)
    assert watch_progress(shm, 8 << 20, timeout=30), "the pull never started"
    victim.stop()
    try:
        r = dec.recv(BIG_SYNC_MS / 1000 + MARGIN + 5)
        assert r["code"] == "LLM_TIMEOUT", r
        _assert_failed_in_time(r, BIG_SYNC_MS / 1000, "[tcp] stopped during a 512 MiB pull")
    finally:
        victim.signal(signal.SIGCONT)
    # The owner's lease on the source ends once it notices the reader left: unregister
    # returns instead of waiting out its 30 s bound for live transfers.
    u = victim.call("unregister", name="big", timeout=60)
    measured("[tcp] owner releases the lease after SIGCONT (unregister)", u["elapsed"], 30)
    assert u["elapsed"] < 30, u
    r = _pull(dec, victim, seed=1)
    assert r["ok"] and r["verified"], f"no recovery after SIGCONT: {r}"
    _assert_usable(dec, healthy, victim)


# ------------------------------------------------------------------------------ restart


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_restarted_peer_same_identity(peers: Peers, transport: str) -> None:
    """A new process with the same cluster id on the same address: unlink(force), link,
    pull gives the NEW process's bytes, over the path the new link chose."""
    victim, healthy, dec = _world(peers, transport)
    r = _pull(dec, victim, seed=1)
    assert r["ok"] and r["verified"], r
    victim.kill()
    # Same id, same port; a different layout and different bytes (seed 3).
    reborn = peers.prompt(victim.cluster_id, port=victim.port, env=_env(transport),
                          name="reborn")
    assert reborn.port == victim.port
    reborn.call("register", name="src", seed=3, num_tensors=2, blocks=32, block_bytes=4096)
    r = dec.call("unlink", clusters=target(victim), force=True)
    assert r["code"] == "LLM_SUCCESS", r
    r = link(dec, reborn)
    assert r["code"] == "LLM_SUCCESS", r
    r = _pull(dec, reborn, seed=3, src_blocks=list(range(16, 32)))
    assert r["ok"] and r["verified"], f"stale or wrong bytes after relink: {r}"
    assert dec.call("path", cid=reborn.cluster_id)["path"] == transport


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_restarted_peer_without_unlink(peers: Peers, transport: str) -> None:
    """Without an unlink: the link reconnects by itself to the new process (on the first
    pull if the dead connection is noticed before it is used, else on the next one), checks
    it is the same cluster id, and reads the new process's memory, not the dead one's."""
    victim, healthy, dec = _world(peers, transport)
    assert _pull(dec, victim, seed=1)["verified"]
    victim.kill()
    reborn = peers.prompt(victim.cluster_id, port=victim.port, env=_env(transport),
                          name="reborn")
    reborn.call("register", name="src", seed=3, **SMALL)
    r = _pull(dec, reborn, seed=3)
    if not r["ok"]:  # the dead connection was found by this pull: the next one reconnects
        _assert_failed_in_time(r, 1.0, f"[{transport}] first pull after a restart")
        r = _pull(dec, reborn, seed=3)
    assert r["ok"] and r["verified"], f"stale or wrong bytes after the restart: {r}"
    assert dec.call("path", cid=reborn.cluster_id)["path"] == transport, \
        "the reconnected link kept the dead process's data path"


@pytest.mark.timeout(60)
def test_restarted_peer_with_other_identity_is_refused(peers: Peers) -> None:
    """A different cluster now answers at the old address: reconnecting must not read it."""
    victim, healthy, dec = _world(peers, "tcp")
    victim.kill()
    impostor = peers.prompt(victim.cluster_id + 1000, port=victim.port, name="impostor")
    impostor.call("register", name="src", seed=4, **SMALL)
    for _ in range(2):
        r = _pull(dec, victim)
        _assert_failed_in_time(r, 1.0, "[tcp] other cluster at the old address")
        assert r["code"] == "LLM_LINK_FAILED", r
    _assert_usable(dec, healthy, victim)


# ------------------------------------------------------------------------------ listener


@pytest.mark.timeout(60)
def test_listener_closed(peers: Peers) -> None:
    """The prompt finalizes (its port closes, the process lives on): link_clusters returns
    LLM_LINK_FAILED for that cluster, without raising, and links the others; a pull on a
    link made before fails in time."""
    victim, healthy, dec = _world(peers, "tcp")
    assert dec.call("unlink", clusters=target(healthy))["code"] == "LLM_SUCCESS"
    victim.call("finalize")
    r = _pull(dec, victim)
    _assert_failed_in_time(r, 1.0, "[tcp] pull after the prompt finalized")
    assert dec.call("unlink", clusters=target(victim), force=True)["code"] == "LLM_SUCCESS"
    r = dec.call("link", clusters=target(victim) + target(healthy), timeout_ms=2000)
    measured("link_clusters to a closed port (+ a live one)", r["elapsed"], 2 + MARGIN)
    assert r["codes"] == ["LLM_LINK_FAILED", "LLM_SUCCESS"], r
    assert r["code"] == "LLM_LINK_FAILED", r
    assert r["elapsed"] < 2 + MARGIN
    assert _pull(dec, healthy, seed=2)["verified"]


# ------------------------------------------------------------------------------ churn


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("force", [True, False], ids=["force", "graceful"])
def test_unlink_and_relink_during_pulls(peers: Peers, transport: str, force: bool) -> None:
    """One thread pulls without pause while another unlinks and relinks the same cluster,
    hundreds of times. A pull may fail (LINK_FAILED, NOT_YET_LINK, TIMEOUT) or, for a
    graceful unlink, make the unlink wait or answer LINK_BUSY, but a pull that succeeds
    carries exactly the right bytes, and the link works at the end."""
    victim, healthy, dec = _world(peers, transport)
    r = dec.call("churn", cid=victim.cluster_id, ip=victim.ip, port=victim.port, dst="dst",
                 seed=1, seconds=3.0, src_total=16, per_pull=4, force=force, timeout=60)
    print(f"[churn {transport} {'force' if force else 'graceful'}] {r}")
    assert not r["puller_alive"], r
    assert r["nwrong"] == 0, f"pulls that succeeded with wrong bytes: {r}"
    assert set(r["outcomes"]) <= {"ok", "LLM_LINK_FAILED", "LLM_NOT_YET_LINK", "LLM_TIMEOUT",
                                  "LLM_LINK_BUSY"}, r
    assert r["outcomes"].get("ok", 0) > 0 and r["cycles"] >= 20, r
    assert set(r["unlink"]) <= {"LLM_SUCCESS", "LLM_LINK_BUSY"}, r
    assert set(r["link"]) == {"LLM_SUCCESS"}, r
    assert _pull(dec, victim, seed=1)["verified"]
    assert _pull(dec, healthy, seed=2)["verified"]


# ------------------------------------------------------------------------------ owner side


@pytest.mark.timeout(90)
def test_owner_unregisters_during_a_pull(tcp_peers: Peers) -> None:
    """The prompt unregisters its cache while a pull of it is in flight: unregister waits
    for the transfer instead of letting the memory go while a peer still reads it, the pull
    completes with the right bytes, and the next pull finds no cache.

    The reader is a raw protocol client in this process that reads the first MiB and then
    stops reading, which holds the owner's transfer (and its lease) mid-way for as long as
    the test needs, with no race against the transfer's speed."""
    victim = tcp_peers.prompt(name="victim")
    # 128 MiB: far more than the socket buffers between the two processes hold
    geo = {"num_tensors": 2, "blocks": 64, "block_bytes": 1 << 20}
    tb = geo["blocks"] * geo["block_bytes"]
    victim.call("register", name="big", seed=9, model_id=1, **geo)
    assert victim.port is not None and victim.cluster_id is not None
    cli = RawClient(victim.port)
    try:
        cli.hello(victim.cluster_id + 1)
        n = np.array([tb], dtype=np.uint64)
        cli.send(p.encode(p.Read(p.KeyRef(p.KeyKind.BLOCKS_KEY, 0, 1, 0), 0, p.ReadFlags.NONE,
                                 np.array([0, 1], dtype=np.uint32),
                                 np.zeros(1, dtype=np.uint64), n), 5))
        head = cli.recv_exact(p.HEADER_SIZE)
        length = p.decode_header(head).length
        reply = p.decode_payload(p.decode_header(head).type, cli.recv_exact(length))
        assert reply == p.ReadData(2 * tb), reply
        first = cli.recv_exact(1 << 20)
        victim.send("unregister", name="big")
        with pytest.raises(AssertionError, match="no reply"):
            victim.recv(1.0)  # still waiting for the transfer's lease
        rest = cli.recv_exact(2 * tb - (1 << 20))
    finally:
        cli.close()
    want = np.concatenate([pattern(9, t, 0, tb) for t in range(2)]).tobytes()
    assert first + rest == want
    u = victim.recv(60)
    measured("owner unregister waited for the pull in flight", u["elapsed"], 30)
    dec = tcp_peers.decoder()
    dec.call("register", name="big", **geo)
    assert link(dec, victim)["code"] == "LLM_SUCCESS"
    r = dec.call("pull", cid=victim.cluster_id, dst="big", model_id=1,
                 src_blocks=list(range(64)), dst_blocks=list(range(64)))
    assert r["code"] == "LLM_KV_CACHE_NOT_EXIST", r


@pytest.mark.timeout(90)
def test_owner_drops_a_reader_that_stops_reading(tcp_peers: Peers) -> None:
    """A decoder that asks for a large read and then stops reading (alive, but its window
    stays shut) must not pin the owner's memory for ever: the owner gives the transfer up
    (kernel liveness on the socket), drops the lease, and unregister returns."""
    victim = tcp_peers.prompt(name="victim")
    geo = {"num_tensors": 2, "blocks": 64, "block_bytes": 1 << 20}  # 128 MiB
    tb = geo["blocks"] * geo["block_bytes"]
    victim.call("register", name="big", seed=9, model_id=1, **geo)
    assert victim.port is not None and victim.cluster_id is not None
    cli = RawClient(victim.port)
    try:
        cli.hello(victim.cluster_id + 1)
        cli.send(p.encode(p.Read(p.KeyRef(p.KeyKind.BLOCKS_KEY, 0, 1, 0), 0, p.ReadFlags.NONE,
                                 np.array([0, 1], dtype=np.uint32),
                                 np.zeros(1, dtype=np.uint64),
                                 np.array([tb], dtype=np.uint64)), 5))
        cli.recv_exact(p.HEADER_SIZE + 8 + (1 << 20))  # ReadData, then 1 MiB, then nothing
        u = victim.call("unregister", name="big", timeout=60)
    finally:
        cli.close()
    assert "elapsed" in u, f"unregister gave up waiting for the stalled transfer: {u}"
    measured("owner gives up a reader that stopped reading (unregister)", u["elapsed"], 45)
    assert u["elapsed"] < 45, u
