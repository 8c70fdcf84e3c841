"""Transfer counters and latency histograms, per process and per link.

Who calls: the engine records every pull and push it starts, and every request it serves
(:meth:`Metrics.record`, after the transfer ended, in the calling or serving thread; never
blocks beyond a short lock). Users read them with
``datadist.metrics()`` (a plain dict), or export them to Prometheus with
``datadist.metrics_collector()`` when ``prometheus_client`` is installed.

What is counted, for each (operation, remote cluster id): transfers, bytes moved by the ones
that succeeded, failures by status code name, and a histogram of their durations. Operations
are ``pull`` and ``push`` (what this process asked of a peer) and ``serve_read`` and
``serve_write`` (what a peer asked of this process, from the lease's opening to its end; a
refused request counts with its status code). A link that is unlinked keeps its
counters (a Prometheus counter must never go down); ``reset()`` clears everything.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

# Upper bounds of the latency buckets, seconds: 10 us .. 100 s, three per decade.
BUCKETS: tuple[float, ...] = tuple(
    m * 10.0**e for e in range(-5, 2) for m in (1.0, 2.5, 5.0)
) + (100.0,)


@dataclass
class Series:
    """The counters of one (operation, cluster id)."""

    transfers: int = 0
    bytes: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    # counts[i]: durations <= BUCKETS[i] and > BUCKETS[i-1]; the last slot is "above all"
    counts: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS) + 1))
    seconds: float = 0.0

    def add(self, nbytes: int, seconds: float, error: str | None) -> None:
        self.transfers += 1
        self.seconds += seconds
        self.counts[bisect.bisect_left(BUCKETS, seconds)] += 1
        if error is None:
            self.bytes += nbytes
        else:
            self.errors[error] = self.errors.get(error, 0) + 1

    def snapshot(self) -> dict[str, Any]:
        cumulative, total = [], 0
        for c in self.counts[:-1]:
            total += c
            cumulative.append(total)
        return {
            "transfers": self.transfers,
            "bytes": self.bytes,
            "errors": dict(self.errors),
            "seconds": self.seconds,
            "latency_buckets": dict(zip(BUCKETS, cumulative, strict=True)),
            "p50_s": self.quantile(0.5),
            "p99_s": self.quantile(0.99),
        }

    def quantile(self, q: float) -> float | None:
        """The upper bound of the bucket that holds quantile ``q`` (None before any transfer;
        inf when it lies above the last bucket)."""
        if not self.transfers:
            return None
        rank, seen = q * self.transfers, 0
        for bound, c in zip((*BUCKETS, float("inf")), self.counts, strict=True):
            seen += c
            if seen >= rank:
                return bound
        return float("inf")


class Metrics:
    """Thread-safe counters of one process (every engine in it records here)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._series: dict[tuple[str, int], Series] = {}

    def record(self, op: str, cluster_id: int, nbytes: int, seconds: float,
               error: str | None = None) -> None:
        """Count one transfer that ended: ``error`` is its status code's name, None if it
        succeeded (then ``nbytes`` count as moved)."""
        with self._lock:
            s = self._series.get((op, cluster_id))
            if s is None:
                s = self._series[(op, cluster_id)] = Series()
            s.add(nbytes, seconds, error)

    def snapshot(self) -> dict[str, Any]:
        """``{"total": {op: ...}, "links": {cluster_id: {op: ...}}}``, each entry as
        :meth:`Series.snapshot` gives it."""
        with self._lock:
            items = [(k, _copy(s)) for k, s in self._series.items()]
        total: dict[str, Series] = {}
        links: dict[int, dict[str, Any]] = {}
        for (op, cid), s in items:
            links.setdefault(cid, {})[op] = s.snapshot()
            t = total.setdefault(op, Series())
            t.transfers += s.transfers
            t.bytes += s.bytes
            t.seconds += s.seconds
            t.counts = [a + b for a, b in zip(t.counts, s.counts, strict=True)]
            for name, n in s.errors.items():
                t.errors[name] = t.errors.get(name, 0) + n
        return {"total": {op: s.snapshot() for op, s in total.items()}, "links": links}

    def series(self) -> Iterator[tuple[str, int, Series]]:
        """Copies of every series, for exporters."""
        with self._lock:
            items = [(k, _copy(s)) for k, s in self._series.items()]
        for (op, cid), s in items:
            yield op, cid, s

    def reset(self) -> None:
        with self._lock:
            self._series.clear()


def _copy(s: Series) -> Series:
    return Series(s.transfers, s.bytes, dict(s.errors), list(s.counts), s.seconds)


PROCESS = Metrics()
