"""Fixtures of the security suite: every engine a test makes, directly or through
``LLMDataDist``, is the C++ core's."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from datadist.core.native import ENGINE_ENV, NativeEngine


@pytest.fixture(autouse=True)
def _core_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """``LLMDataDist.init`` runs the core (a configuration it could not serve fails at init,
    never falls back)."""
    monkeypatch.setenv(ENGINE_ENV, "native")


@pytest.fixture
def engines() -> Iterator[list[NativeEngine]]:
    """The core's engines a test makes (``_hand.make``), closed after it."""
    made: list[NativeEngine] = []
    yield made
    for e in made:
        e.close()
