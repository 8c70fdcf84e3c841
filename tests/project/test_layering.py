"""Layering: production code does not import the protocol's reference codec.

``datadist.wire.protocol`` is the protocol's reference in Python (docs/protocol.md): test peers,
fuzzers, the vectors and the bench speak it to check the core, which has its own codec
(cpp/src/wire.{h,cc}). What the facade and the engine need of it, the keys and the READ flags,
live in ``datadist.core.keys``. The rule, read from the source (AST, so comments and strings
do not count): under src/, only these may import the reference codec.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
REFERENCE = "datadist.wire.protocol"

# Where under src/ the reference may be imported, and why.
ALLOWED_DIRS = {
    "datadist/wire": "the reference itself (the codec and the auth MACs beside it)",
    "datadist/testing": "test peers and fakes that speak the protocol on purpose",
    "datadist/bench": "the bench's raw NIXL and protocol peers",
}
ALLOWED_FILES = {
    # `datadist probe` checks a peer's handshake with a client written on the reference,
    # independent of the core it may be diagnosing.
    "datadist/probe.py": "the protocol probe (`datadist probe`)",
}


def imports_of(tree: ast.AST) -> set[str]:
    """Every module ``tree`` imports, by full dotted name: ``import a.b`` gives a.b,
    ``from a import b`` gives a.b (b may be a module) and a, relative imports resolved
    against nothing (they are kept with their dots, and datadist uses none)."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def imports_reference(source: str) -> bool:
    return any(name == REFERENCE or name.startswith(REFERENCE + ".")
               for name in imports_of(ast.parse(source)))


def allowed(rel: str) -> bool:
    return rel in ALLOWED_FILES or any(rel.startswith(d + "/") for d in ALLOWED_DIRS)


@pytest.mark.parametrize("source", [
    "import datadist.wire.protocol",
    "import datadist.wire.protocol as p",
    "from datadist.wire import protocol",
    "from datadist.wire import protocol as p",
    "from datadist.wire.protocol import KeyRef",
    "def f():\n    from datadist.wire import auth, protocol\n",
])
def test_every_form_of_the_import_is_seen(source: str) -> None:
    assert imports_reference(source)


@pytest.mark.parametrize("source", [
    "from datadist.wire import auth",
    "from datadist.core.keys import KeyRef",
    "x = 'from datadist.wire import protocol'  # a string, not an import",
    "import datadist.wire.protocolx",
])
def test_other_imports_are_not_taken_for_it(source: str) -> None:
    assert not imports_reference(source)


def test_only_the_reference_testing_and_bench_import_the_codec() -> None:
    offenders = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if not allowed(rel) and imports_reference(path.read_text()):
            offenders.append(rel)
    assert not offenders, (
        f"{offenders} import {REFERENCE}, the protocol's test reference: production code "
        "takes KeyRef / KeyKind / ReadFlags from datadist.core.keys (tests/unit/test_layering.py "
        "lists who may)")


def test_the_allowed_places_exist() -> None:
    """A renamed folder must not leave the rule allowing nothing (or something else)."""
    for rel in [*ALLOWED_DIRS, *ALLOWED_FILES]:
        assert (SRC / rel).exists(), rel


def test_the_keys_are_the_codecs() -> None:
    """The reference codec encodes the very classes production code builds."""
    from datadist.core import keys
    from datadist.wire import protocol

    assert protocol.KeyRef is keys.KeyRef
    assert protocol.KeyKind is keys.KeyKind
    assert protocol.ReadFlags is keys.ReadFlags
