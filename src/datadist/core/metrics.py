"""Transfer counters and latency histograms, per process and per link.

Who calls: nobody records here: the C++ core keeps the counters (``cpp/src/metrics.h``,
recorded by its transfer and serving threads without the GIL; the binding counts the pulls
and pushes this process issues). This module reads them: :func:`process_series` and
:func:`snapshot` give the process's view, :func:`stats` what STATS answers. Users read them with
``datadist.metrics()`` (a plain dict), or export them to Prometheus with
``datadist.metrics_collector()`` when ``prometheus_client`` is installed.

What is counted, for each (operation, remote cluster id): transfers, bytes moved by the ones
that succeeded, failures by status code name, and a histogram of their durations. Operations
are ``pull`` and ``push`` (what this process asked of a peer) and ``serve_read`` and
``serve_write``, ``serve_lease`` (what a peer asked of this process, from the lease's opening
to its end; a refused request counts with its status code). A link that is unlinked keeps its
counters (a Prometheus counter must never go down); ``reset()`` clears everything.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from datadist.core import native_build
from datadist.core.errors import RemoteProtocolError

# Upper bounds of the latency buckets, seconds: 10 us .. 100 s, three per decade.
BUCKETS: tuple[float, ...] = tuple(
    m * 10.0**e for e in range(-5, 2) for m in (1.0, 2.5, 5.0)
) + (100.0,)


@dataclass
class Series:
    """The counters of one (operation, cluster id), as the core hands them over."""

    transfers: int = 0
    bytes: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    # counts[i]: durations <= BUCKETS[i] and > BUCKETS[i-1]; the last slot is "above all"
    counts: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS) + 1))
    seconds: float = 0.0

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


def _merge(into: Series, s: Series) -> None:
    into.transfers += s.transfers
    into.bytes += s.bytes
    into.seconds += s.seconds
    into.counts = [a + b for a, b in zip(into.counts, s.counts, strict=True)]
    for name, n in s.errors.items():
        into.errors[name] = into.errors.get(name, 0) + n


def _snapshot_of(items: Iterator[tuple[str, int, Series]]) -> dict[str, Any]:
    total: dict[str, Series] = {}
    links: dict[int, dict[str, Any]] = {}
    for op, cid, s in items:
        links.setdefault(cid, {})[op] = s.snapshot()
        _merge(total.setdefault(op, Series()), s)
    return {"total": {op: s.snapshot() for op, s in total.items()}, "links": links}


def _core_loaded() -> bool:
    """Has something imported the C++ core's module (an engine ran on it)? Reading metrics
    never loads the extension: without it there is nothing to read or reset."""
    return native_build.MODULE in sys.modules


def _core_series() -> Iterator[tuple[str, int, Series]]:
    if not _core_loaded():
        return
    from datadist import _core as core

    for op, cid, transfers, nbytes, errors, counts, nanos in core.metrics_series():
        yield str(op), int(cid), Series(int(transfers), int(nbytes),
                                        {str(k): int(v) for k, v in errors.items()},
                                        [int(c) for c in counts], nanos / 1e9)


def process_series() -> Iterator[tuple[str, int, Series]]:
    """Every series of the process, as the core keeps them per (operation, cluster id): one
    core serves every instance of the process. Copies; for exporters and :func:`snapshot`.
    Called at any time; takes no lock (the core's counters are atomics)."""
    yield from _core_series()


def snapshot() -> dict[str, Any]:
    """The process's metrics (:func:`process_series`) as :meth:`Metrics.snapshot` has them:
    what ``datadist.metrics()`` returns."""
    return _snapshot_of(process_series())


def reset() -> None:
    """Clear every counter of the process (tests)."""
    if _core_loaded():
        from datadist import _core as core

        core.metrics_reset()


def stats(cluster_id: int, role: int) -> dict[str, Any]:
    """What the engine says of the whole process (``NativeEngine.stats()``, JSON-ready): who it is,
    and :func:`snapshot` with the cluster ids of ``links`` as strings, as STATS carries them."""
    snap = snapshot()
    return {"cluster_id": cluster_id, "role": role, "total": snap["total"],
            "links": {str(cid): ops for cid, ops in snap["links"].items()}}


def parse_stats(raw: bytes) -> dict[str, Any]:
    """A peer's STATS answer (JSON bytes) as a dict; RemoteProtocolError if it is not a
    JSON object. Called by the engine's ``peer_stats``."""
    try:
        got = json.loads(raw)
    except ValueError as e:
        raise RemoteProtocolError(f"the peer's Stats is not JSON: {e}") from None
    if not isinstance(got, dict):
        raise RemoteProtocolError("the peer's Stats is not a JSON object")
    return got
