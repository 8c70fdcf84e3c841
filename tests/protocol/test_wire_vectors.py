"""The Python codec (datadist.wire.protocol) against the protocol's golden frames.

tests/vectors/frames.txt is made by tests/vectors/generate.py from docs/protocol.md's payload
table written as data, with nothing from either codec; cpp/tests/wire_vectors_test.cc tests the
C++ codec against the same file. Here: the file is what the generator makes; every valid frame
decodes to the expected fields and re-encodes to the same bytes; every malformed one is refused
with RemoteProtocolError at the stage the vector names (the header alone, or the payload), and
never with another exception.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from datadist.core.errors import RemoteProtocolError
from datadist.wire import protocol as p

ROOT = Path(__file__).resolve().parents[2]


def _python_side() -> ModuleType:
    path = ROOT / "tests/vectors/python_side.py"
    spec = importlib.util.spec_from_file_location("dd_vectors_python_side", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


side = _python_side()
gen = side.load("generate")
fields_of = side.fields_of
VECTORS = gen.load()
VALID = [v for v in VECTORS if v.refused is None]
MALFORMED = [v for v in VECTORS if v.refused is not None]


def test_checked_in_vectors_are_what_the_generator_makes() -> None:
    """A protocol change regenerates them with one command (the message says which)."""
    assert gen.FRAMES.read_text() == gen.render(gen.vectors()), (
        "tests/vectors/frames.txt is stale: run python tests/vectors/generate.py")


def test_every_message_type_of_the_codec_and_the_document_has_valid_vectors() -> None:
    documented = {int(n): name for n, name in re.findall(
        r"^\| (\d+) \| ([A-Z_]+) \|", (ROOT / "docs/protocol.md").read_text(), re.M)}
    assert documented == {t: name for t, name in gen.TYPE_NAMES.items()}
    assert {t.value: t.name for t in p.MsgType} == documented
    assert {v.type for v in VALID} == set(documented)
    # every type is also refused padded, and truncated where it has a payload
    for name, (_, fields) in gen.SCHEMA.items():
        prefix = name.lower() + "."
        kinds = {v.expect.split(" ", 2)[2] for v in MALFORMED if v.name.startswith(prefix)}
        assert "trailing bytes" in kinds, name
        assert "truncated" in kinds or not fields, name


@pytest.mark.parametrize("v", VALID, ids=lambda v: v.name)
def test_valid_frame_decodes_to_its_fields_and_encodes_to_its_bytes(v: Any) -> None:
    head = p.decode_header(v.frame[: p.HEADER_SIZE])
    assert head.length == len(v.frame) - p.HEADER_SIZE
    msg = p.decode_payload(head.type, v.frame[p.HEADER_SIZE :])
    assert fields_of(msg, head.request_id) == gen.parse_summary(v.expect)
    assert p.encode(msg, head.request_id) == v.frame
    # and the incremental decoder agrees, fed one byte at a time
    dec = p.FrameDecoder()
    got = [item for i in range(len(v.frame)) for item in dec.feed(v.frame[i : i + 1])]
    assert len(got) == 1 and got[0][0] == head.request_id
    assert p.encode(got[0][1], head.request_id) == v.frame  # type: ignore[arg-type]


@pytest.mark.parametrize("v", MALFORMED, ids=lambda v: v.name)
def test_malformed_frame_is_refused_with_remote_protocol_error(v: Any) -> None:
    if v.refused == "header":
        assert len(v.frame) >= p.HEADER_SIZE
        with pytest.raises(RemoteProtocolError):
            p.decode_header(v.frame[: p.HEADER_SIZE])
    else:
        head = p.decode_header(v.frame[: p.HEADER_SIZE])
        assert head.length == len(v.frame) - p.HEADER_SIZE
        with pytest.raises(RemoteProtocolError):
            p.decode_payload(head.type, v.frame[p.HEADER_SIZE :])
    with pytest.raises(RemoteProtocolError):  # the stream decoder too, in one piece
        p.FrameDecoder().feed(v.frame)
