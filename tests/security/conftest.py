"""Fixtures of the security suite."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from datadist.core.engine import Engine


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    """Engines a test makes (``_hand.make``), closed after it."""
    made: list[Engine] = []
    yield made
    for e in made:
        e.close()
