"""A PROMPT that stopped (Ctrl-C) is reported as stopped, not as one without a listen address
(issue 38 item 8). The hint "a PROMPT must set LLMConfig.listen_ip_info" came from the core's
refused-connection text (cpp/src/net.cc), given on every refusal; a link that reconnects to a
peer that listened there before now says that the peer stopped, and a first connection asks
whether the PROMPT runs and listens on that port."""

from __future__ import annotations

import socket

import datadist as llm

from ._support import PROMPT_ID, code

S = llm.LLMStatusCode


def test_a_stopped_prompt_is_reported_as_stopped(make_side):
    p = make_side(PROMPT_ID)
    d = make_side(2, role=2)
    p.register(2, [4, 64], blocks=True, model_id=0)
    mine, _ = d.register(2, [4, 64], blocks=True)
    d.engine.link(PROMPT_ID, *p.engine.listen_address, 5.0)
    d.cm.pull_blocks(llm.BlocksCacheKey(PROMPT_ID, 0), mine, [0], [1])
    p.engine.close()  # the PROMPT process stops (Ctrl-C): its listener closes
    with code(S.LLM_LINK_FAILED) as e:
        d.cm.pull_blocks(llm.BlocksCacheKey(PROMPT_ID, 0), mine, [0], [1])
    text = str(e.value)
    # before: "... nothing listens there (a PROMPT must set LLMConfig.listen_ip_info ...)"
    assert "listen_ip_info" not in text, text
    assert "nothing listens there any more" in text and "stopped" in text, text


def test_a_first_link_to_a_closed_port_asks_what_to_check(make_side):
    d = make_side(2, role=2)
    with socket.socket() as s:  # a port where nothing listens
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        d.engine.link(PROMPT_ID, "127.0.0.1", port, 2.0)
    except Exception as e:  # noqa: BLE001 - the core's error, its text checked
        text = str(e)
    else:
        raise AssertionError("a link to a closed port succeeded")
    assert "nothing listens there" in text
    assert "is the PROMPT running" in text and "listen_ip_info" in text, text
