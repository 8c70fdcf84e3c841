"""Shared memory between two processes on the core (issue 24, "one engine, parity").

A prompt allocates a blocks cache from its host pool (a sealed memfd); a decoder in this
process pulls blocks of it. On the same-host path the decoder maps the prompt's memfd and
copies with memcpy ("shm"): SHM_GRANT, then CACHE_LEASE. Forced ``cma`` reads the same cache
with process_vm_readv; forced ``shm`` names the path "shm".
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

import datadist as llm_datadist
from datadist.core import native
from datadist.testing.peers import (
    CacheSpec,
    Decoder,
    PromptConfig,
    RunningPrompt,
    pattern,
    start_prompt,
)

from ._support import DECODER_ID, PROMPT_ENV, PROMPT_ID, assert_bytes_equal, units

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not native.available()[0], reason="the native core is not built"),
]

SPEC = CacheSpec(2, (64, 2, 64))  # 64 blocks of 256 B per tensor
_ids = itertools.count(300)


@pytest.fixture(scope="module")
def prompt() -> Iterator[RunningPrompt]:
    env = {**PROMPT_ENV, "DATADIST_NIXL_SERVE": None}
    running = start_prompt(PromptConfig(PROMPT_ID, host_pool_bytes=4 << 20), env=env)
    try:
        yield running
    finally:
        running.close()


def moved(dec: Decoder) -> str:
    """How the decoder's last pull from the prompt moved its bytes."""
    return str(dec.dd.engine.last_moved(PROMPT_ID))


@pytest.mark.parametrize(("transport", "path", "how"),
                         [(None, "cma", "shm"), ("shm", "shm", "shm"), ("cma", "cma", "cma")])
def test_a_pool_cache_is_read_from_shared_memory(
        prompt: RunningPrompt, transport: str | None, path: str, how: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DATADIST_NIXL_SERVE", raising=False)
    if transport is None:
        monkeypatch.delenv("DATADIST_TRANSPORT", raising=False)
    else:
        monkeypatch.setenv("DATADIST_TRANSPORT", transport)
    model, seed = next(_ids), next(_ids)
    cache_id = prompt.call("allocate_blocks_cache", spec=SPEC, seed=seed, model_id=model)
    dec = Decoder(DECODER_ID)
    try:
        assert dec.link(PROMPT_ID, prompt.address) == llm_datadist.LLMStatusCode.LLM_SUCCESS
        assert dec.path_name(PROMPT_ID) == path
        cache, arr = dec.local(SPEC, blocks=True)
        key = llm_datadist.BlocksCacheKey(PROMPT_ID, model)
        want = units(pattern(SPEC, seed), SPEC)
        for src, dst in (([5, 6, 63], [0, 1, 2]), ([7], [3])):  # asks a lease, then under it
            dec.cm.pull_blocks(key, cache, src, dst)
            assert moved(dec) == how
        got = units(arr, SPEC)
        assert_bytes_equal(got[:, [0, 1, 2, 3]], want[:, [5, 6, 63, 7]])
        assert not got[:, 4:].any()
    finally:
        dec.close()
        prompt.call("deallocate_blocks_cache", cache_id=cache_id)
