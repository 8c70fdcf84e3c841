"""Fixtures for the two-process tests: a PROMPT in a spawned child, a DECODER in this one.

The prompt runs ``datadist.testing.peers.prompt_main`` (public API only) and is shared by a
module (each module says what it needs in ``PROMPT_CONFIG``); tests keep independent by using
their own caches, keys and model ids. The decoder is made fresh for every test, after the
``transport`` fixture has put ``DATADIST_TRANSPORT`` in the environment.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

import datadist as llm_datadist
from datadist.testing.peers import Decoder, PromptConfig, RunningPrompt, start_prompt

from ._support import DECODER_ID, PROMPT_ENV, PROMPT_ID, TRANSPORTS, serving


@pytest.fixture(autouse=True)
def nixl_readers_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process decoders that force NIXL link by it on this host's key-unchecked UCX
    transports only with the whole-process allowance (docs/security.md, "The NIXL path")."""
    if "nixl" in TRANSPORTS:
        monkeypatch.setenv("DATADIST_NIXL_ALLOW_WHOLE_PROCESS_ACCESS", "1")


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("DATADIST_TRANSPORT", request.param)
    return str(request.param)


@pytest.fixture(scope="module")
def prompt(request: pytest.FixtureRequest) -> Iterator[RunningPrompt]:
    config = getattr(request.module, "PROMPT_CONFIG", PromptConfig(PROMPT_ID))
    if getattr(request.module, "PROMPT_SERVES_NIXL", True):
        config = serving(config)
    running = start_prompt(config, env=PROMPT_ENV)
    try:
        yield running
    finally:
        running.close()


@pytest.fixture
def make_decoder() -> Iterator[Callable[..., Decoder]]:
    """Make in-process decoders; every one is unlinked and finalized at teardown."""
    made: list[Decoder] = []

    def make(**kwargs: object) -> Decoder:
        dec = Decoder(DECODER_ID, **kwargs)  # type: ignore[arg-type]
        made.append(dec)
        return dec

    yield make
    for dec in made:
        dec.close()


@pytest.fixture
def decoder(transport: str, make_decoder: Callable[..., Decoder],
            prompt: RunningPrompt) -> Decoder:
    """A decoder linked to the module's prompt over ``transport``."""
    dec = make_decoder()
    assert dec.link(prompt.cluster_id, prompt.address) == llm_datadist.LLMStatusCode.LLM_SUCCESS
    assert dec.path_name(prompt.cluster_id) == transport
    return dec
