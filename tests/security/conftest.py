"""Fixtures of the security suite: every engine a test makes, directly or through
``LLMDataDist``, is the C++ core's."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from datadist.core.native import NativeEngine


@pytest.fixture
def engines() -> Iterator[list[NativeEngine]]:
    """The core's engines a test makes (``_hand.make``), closed after it."""
    made: list[NativeEngine] = []
    yield made
    for e in made:
        e.close()
