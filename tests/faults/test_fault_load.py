"""Load: eight DECODER processes pull from one PROMPT at once, thousands of pulls in all,
over each data path. Every pulled byte is checked against the source pattern (the
destination blocks are wiped before each pull, so a pull that moved nothing cannot pass),
no pull may fail, and afterwards the prompt's memory and guards are untouched and no lease
is left behind (unregister returns at once)."""

from __future__ import annotations

import pytest
from fault_harness import Peers, link, measured

DECODERS = 8
PULLS = 500  # per decoder: 4000 pulls per data path
SRC = {"num_tensors": 2, "blocks": 256, "block_bytes": 4096}
DST = {"num_tensors": 2, "blocks": 64, "block_bytes": 4096}
PER_PULL = 4  # random source blocks into random destination blocks, 32 KiB per pull


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["tcp", "cma"])
def test_eight_decoders_thousands_of_pulls(peers: Peers, transport: str) -> None:
    env = {"DATADIST_TRANSPORT": transport}
    prompt = peers.prompt(env=env, sync_ms=10000)
    prompt.call("register", name="src", seed=7, guard=4096, **SRC)
    decs = peers.decoders(DECODERS, env=env, sync_ms=10000)
    for d in decs:
        d.call("register", name="dst", **DST)
        assert link(d, prompt)["code"] == "LLM_SUCCESS"
        assert d.call("path", cid=prompt.cluster_id)["path"] == transport
    for i, d in enumerate(decs):
        d.send("load", cid=prompt.cluster_id, dst="dst", seed=7, pulls=PULLS,
               src_total=SRC["blocks"], per_pull=PER_PULL, rng_seed=1000 + i)
    results = [d.recv(100) for d in decs]
    total = sum(r["bytes"] for r in results)
    slowest = max(r["elapsed"] for r in results)
    measured(f"[{transport}] {DECODERS}x{PULLS} pulls of {PER_PULL * 8} KiB, slowest decoder",
             slowest, 100)
    for i, r in enumerate(results):
        assert r["nerrors"] == 0, f"decoder {i}: {r['nerrors']} failed pulls: {r['errors']}"
        assert r["mismatches"] == 0, f"decoder {i}: {r['mismatches']} pulls with wrong bytes"
    assert total == DECODERS * PULLS * PER_PULL * DST["block_bytes"] * DST["num_tensors"]
    check = prompt.call("check", name="src")
    assert check["guards"] and check["pattern"], check
    for d in decs:
        assert d.call("unlink", clusters=[[prompt.cluster_id, prompt.ip, prompt.port]]
                      )["code"] == "LLM_SUCCESS"
    u = prompt.call("unregister", name="src")
    assert u["elapsed"] < 5, f"a lease outlived the load: unregister waited {u}"
