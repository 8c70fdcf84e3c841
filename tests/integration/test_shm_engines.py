"""Shared memory between two processes on either engine (issue 24, "one engine, parity").

A prompt on the native or the Python engine allocates a blocks cache from its host pool (a
sealed memfd); a decoder on either engine pulls blocks of it. On the same-host path the
decoder maps the prompt's memfd and copies with memcpy ("shm"), whichever engine serves and
whichever reads: the same SHM_GRANT / CACHE_LEASE messages both ways. Forced ``cma`` reads the
same cache with process_vm_readv; forced ``shm`` names the path "shm".
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

ENGINES = ("native", "python")
SPEC = CacheSpec(2, (64, 2, 64))  # 64 blocks of 256 B per tensor
_ids = itertools.count(300)


@pytest.fixture(scope="module", params=ENGINES)
def prompt(request: pytest.FixtureRequest) -> Iterator[RunningPrompt]:
    env = {**PROMPT_ENV, "DATADIST_ENGINE": request.param, "DATADIST_NIXL_SERVE": None}
    running = start_prompt(PromptConfig(PROMPT_ID, host_pool_bytes=4 << 20), env=env)
    try:
        yield running
    finally:
        running.close()


def moved(dec: Decoder) -> str:
    """How the decoder's last pull from the prompt moved its bytes."""
    engine = dec.dd.engine
    if getattr(engine, "native", False):
        return str(engine.last_moved(PROMPT_ID))
    return str(getattr(engine.get_link(PROMPT_ID).path, "last", ""))


@pytest.mark.parametrize("decoder_engine", ENGINES)
@pytest.mark.parametrize(("transport", "path", "how"),
                         [(None, "cma", "shm"), ("shm", "shm", "shm"), ("cma", "cma", "cma")])
def test_a_pool_cache_is_read_from_shared_memory_on_either_engine(
        prompt: RunningPrompt, decoder_engine: str, transport: str | None, path: str, how: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DATADIST_ENGINE", decoder_engine)
    monkeypatch.delenv("DATADIST_NIXL_SERVE", raising=False)
    if transport is None:
        monkeypatch.delenv("DATADIST_TRANSPORT", raising=False)
    else:
        monkeypatch.setenv("DATADIST_TRANSPORT", transport)
    model, seed = next(_ids), next(_ids)
    cache_id = prompt.call("allocate_blocks_cache", spec=SPEC, seed=seed, model_id=model)
    dec = Decoder(DECODER_ID)
    try:
        assert bool(getattr(dec.dd.engine, "native", False)) == (decoder_engine == "native")
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
