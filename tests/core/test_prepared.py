"""core.prepared.Prepared: the least-recently-used map of prepared requests, bounded by count
and by the rows its values hold (a server whose requests never repeat must not grow it)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from datadist.core.prepared import Prepared


def test_a_hit_returns_what_was_built_and_builds_nothing() -> None:
    m: Prepared[list[int]] = Prepared(4)
    built = []

    def build(v: int):
        def f() -> list[int]:
            built.append(v)
            return [v]
        return f

    first = m.get("a", build(1))
    assert m.get("a", build(2)) is first and built == [1]


def test_the_least_recently_used_goes_first() -> None:
    m: Prepared[int] = Prepared(2)
    m.get("a", lambda: 1)
    m.get("b", lambda: 2)
    m.get("a", lambda: 0)  # a hit: "b" is now the oldest
    m.get("c", lambda: 3)
    assert len(m) == 2
    assert m.get("a", lambda: -1) == 1 and m.get("b", lambda: -2) == -2


def test_rows_are_bounded_whatever_the_count() -> None:
    m: Prepared[np.ndarray] = Prepared(512, len, max_weight=1000)
    for i in range(100):
        m.get(i, lambda: np.zeros((300, 2)))
    assert m.total <= 1000 and len(m) == 3
    # the newest is kept even alone above the bound (it is the one in use)
    m.get("big", lambda: np.zeros((5000, 2)))
    assert len(m) == 1 and m.total == 5000
    m.clear()
    assert len(m) == 0 and m.total == 0


def test_a_failed_build_keeps_nothing() -> None:
    m: Prepared[int] = Prepared(4, lambda v: v)

    def boom() -> int:
        raise ValueError("bad request")

    with pytest.raises(ValueError):
        m.get("x", boom)
    assert len(m) == 0 and m.total == 0


def test_concurrent_builders_of_one_key_count_it_once() -> None:
    m: Prepared[np.ndarray] = Prepared(8, len, max_weight=10**6)
    start = threading.Barrier(4)

    def run() -> None:
        start.wait()
        for i in range(200):
            m.get(i % 5, lambda: np.zeros((10, 2)))

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(m) == 5 and m.total == 50


def test_find_and_put_keep_the_same_bounds_as_get() -> None:
    kept: Prepared[list[int]] = Prepared(2, len, max_weight=5)
    assert kept.find("a") is None
    kept.put("a", [1, 2])
    kept.put("b", [3])
    assert kept.find("a") == [1, 2]  # now the most recently used
    kept.put("c", [4])  # over the count: the least recently used ("b") goes
    assert kept.find("b") is None and kept.find("a") == [1, 2]
    kept.put("c", [9])  # "c" the newest, "a" the oldest
    kept.put("a", [5, 6, 7, 8, 9])  # replaced, the newest; over the weight: "c" goes
    assert kept.find("c") is None and kept.find("a") == [5, 6, 7, 8, 9]
    assert kept.total == 5
