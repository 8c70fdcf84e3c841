"""Reading datadist's transfer metrics: as a dict, or as Prometheus metrics.

Who calls: applications and ``datadist info``, whenever they like; nothing here blocks beyond
a short lock. ``prometheus_client`` is imported only by :func:`metrics_collector` (the
``datadist[prometheus]`` extra).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from datadist.core import metrics as _metrics
from datadist.core.metrics import BUCKETS


def metrics() -> dict[str, Any]:
    """This process's transfer counters: ``{"total": {op: m}, "links": {cluster_id: {op: m}}}``
    where ``op`` is what this process did (``"pull"``, ``"push"``) or served to a peer
    (``"serve_read"``, ``"serve_write"``: requests it answered; ``"serve_lease"``: whole-cache
    leases it granted to same-host readers, whose reads then copy its memory without asking:
    only the reader counts those reads, so ``serve_lease`` has 0 bytes) and ``m`` holds
    ``transfers``, ``bytes`` (moved by successful transfers), ``errors`` (count per status
    code name, e.g. ``"LLM_TIMEOUT"``), ``seconds`` (summed durations), ``latency_buckets``
    (cumulative counts per upper bound in seconds), ``p50_s`` and ``p99_s`` (bucket upper
    bounds). The C++ core's counters: one per process, whatever the number of instances."""
    return _metrics.snapshot()


def reset_metrics() -> None:
    """Clear every counter (tests; a Prometheus scraper sees a counter reset)."""
    _metrics.reset()


def metrics_collector() -> Any:
    """A ``prometheus_client`` collector of this process's metrics; register it with
    ``prometheus_client.REGISTRY.register(datadist.metrics_collector())``.

    Exposes ``datadist_transfers_total``, ``datadist_transfer_bytes_total``,
    ``datadist_transfer_errors_total`` (label ``code``) and the histogram
    ``datadist_transfer_seconds``, each labelled ``op`` and ``cluster_id``.
    """
    try:
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
    except ImportError as e:
        raise ImportError("metrics_collector needs prometheus_client: "
                          "pip install 'datadist[prometheus]'") from e

    class _Collector:
        def collect(self) -> Iterator[Any]:
            labels = ["op", "cluster_id"]
            transfers = CounterMetricFamily("datadist_transfers", "Transfers started, ended "
                                            "in any way (op serve_lease: leases granted, "
                                            "whose reads only the reader counts)",
                                            labels=labels)
            nbytes = CounterMetricFamily("datadist_transfer_bytes", "Bytes moved by "
                                         "successful transfers", labels=labels)
            errors = CounterMetricFamily("datadist_transfer_errors", "Failed transfers by "
                                         "status code", labels=[*labels, "code"])
            seconds = HistogramMetricFamily("datadist_transfer_seconds", "Duration of "
                                            "transfers", labels=labels)
            for op, cid, s in _metrics.process_series():
                lv = [op, str(cid)]
                transfers.add_metric(lv, s.transfers)
                nbytes.add_metric(lv, s.bytes)
                for code, n in sorted(s.errors.items()):
                    errors.add_metric([*lv, code], n)
                buckets, total = [], 0
                for bound, c in zip(BUCKETS, s.counts, strict=False):
                    total += c
                    buckets.append((repr(bound), total))
                buckets.append(("+Inf", s.transfers))
                seconds.add_metric(lv, buckets, s.seconds)
            yield from (transfers, nbytes, errors, seconds)

        def describe(self) -> list[Any]:
            return []  # unchecked collector: families are built at collect time

    return _Collector()
