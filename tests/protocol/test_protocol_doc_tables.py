"""docs/protocol.md's payload tables against the vectors' schema (tests/vectors/generate.py).

The golden frames are built from ``SCHEMA``, "the payload table of docs/protocol.md written
as data"; both codecs pass them. This checks the other half of that promise: the table a
person reads says the same as the schema the vectors come from, message by message (number,
name, each field's name and type, in wire order), and so does the key table. A field added to
one and not the other fails here, naming the message and both versions.
"""

from __future__ import annotations

import re
from pathlib import Path

from vectors.python_side import load  # tests/ is on sys.path (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "protocol.md"


GEN = load("generate")  # the vectors' schema, loaded as their own tests load it


def _table_after(heading: str) -> list[list[str]]:
    """The rows (cells stripped) of the first table after the line ``heading``."""
    lines = DOC.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == heading)
    rows: list[list[str]] = []
    for line in lines[start + 1:]:
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not all(set(c) <= set("-: ") for c in cells):  # the |---| rule
                rows.append(cells)
        elif rows:
            break
    return rows[1:]  # without the header row


_FIELD = re.compile(r"^([a-z_]+) ([a-z0-9]+(?:\[[a-z_]+\])?)$")


def _doc_fields(text: str) -> list[tuple[str, str]]:
    """A payload cell as (name, type) pairs, in wire order. The cell's shorthands: "(empty)";
    "key" for the key's four fields; "same fields as X" / "as X" for X's payload; what
    follows ";" or "then" is prose (raw bytes that travel after the frame, or notes on flags)."""
    text = text.strip()
    if text.startswith("(empty)"):
        return []
    same = re.match(r"^(?:same fields )?as ([A-Z_]+)\b", text)
    if same:
        return GEN.SCHEMA[same.group(1)][1] if same.group(1) in GEN.SCHEMA else [("?", text)]
    text = re.sub(r"\([^()]*\)", "", text)  # parenthesised notes, ";" inside them too
    text = text.split(";")[0]
    out: list[tuple[str, str]] = []
    for part in (p.strip() for p in text.split(",")):
        if part.startswith("then "):
            break
        if part == "key":
            out.extend(GEN.KEY)
            continue
        m = _FIELD.match(part)
        out.append((m.group(1), m.group(2)) if m else ("?", part))
    return out


def test_every_message_of_the_schema_is_in_the_table_with_its_number() -> None:
    rows = _table_after("## Messages")
    doc = {cells[1]: cells[0] for cells in rows if cells[0].isdigit()}
    schema = {name: str(number) for name, (number, _) in GEN.SCHEMA.items()}
    assert doc == schema


def test_each_message_payload_matches_the_schema_field_for_field() -> None:
    rows = _table_after("## Messages")
    wrong = []
    for cells in rows:
        if not cells[0].isdigit():
            continue  # the reserved range
        name, payload = cells[1], cells[2]
        want = GEN.SCHEMA[name][1]
        got = _doc_fields(payload)
        if got != want:
            wrong.append(f"{name}: docs say {got}, the schema {want}")
    assert not wrong, "\n".join(wrong)


def test_the_key_table_is_the_schemas_key() -> None:
    lines = DOC.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if "A *key* is" in line)
    rows: list[list[str]] = []
    for line in lines[start + 1:]:
        if line.startswith("|"):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif rows:
            break
    fields = [(r[0], r[1]) for r in rows[2:]]  # past the header and the rule
    assert fields == GEN.KEY
    size = {"u8": 1, "u64": 8}
    assert f"A *key* is {sum(size[t] for _, t in fields)} bytes" in DOC.read_text()


def test_the_parser_refuses_what_it_cannot_read() -> None:
    """The cell parser itself: a misspelt type or a prose field does not pass as a field."""
    assert _doc_fields("lease_id u64, n u32, bases u64[n]") == [
        ("lease_id", "u64"), ("n", "u32"), ("bases", "u64[n]")]
    assert _doc_fields("lease_id, n u32")[0][0] == "?"
    assert _doc_fields("as READ; flags: only CHECKSUM") == GEN.REQUEST
