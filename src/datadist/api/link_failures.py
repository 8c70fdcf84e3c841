"""Why a link failed: told to the caller, without changing CANN's return codes.

``link_clusters`` returns LLM_LINK_FAILED for a refused port, a wrong cluster id, a missing
secret, a TLS mismatch and an unreachable host alike (as LLM-DataDist does). The reason
goes three ways, none of which changes the codes or the application's logging:

* a :class:`LinkFailedWarning` (Python's ``warnings``): with Python's default filters it
  reaches stderr, once per distinct message and place (a retry loop that fails the same
  way prints it once). ``warnings.filterwarnings("ignore", category=LinkFailedWarning)``
  silences it; ``"error"`` turns it into an exception;
* :meth:`LinkFailures.last` (``LLMDataDist.last_link_failure(cluster_id)``): the last
  failure's text per cluster, until a link to that cluster succeeds;
* the ``datadist`` logger, at WARNING, as before.

``datadist probe HOST:PORT`` (datadist/probe.py) tells which of the reasons it is when the
text alone does not.
"""

from __future__ import annotations

import logging
import threading
import warnings

from datadist.api.notices import LinkFailedWarning
from datadist.core.address import format_host_port

log = logging.getLogger("datadist.api.llm_datadist")


class LinkFailures:
    """The last link failure per remote cluster. Thread-safe: ``link_clusters`` links
    clusters in parallel. Who calls: the facade, after each link attempt; never blocks."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: dict[int, str] = {}

    def report(self, cluster_id: int, host: str, port: int, code_name: str,
               reason: str) -> str:
        """A link to ``cluster_id`` at ``host:port`` failed with ``code_name``: remember
        ``reason`` and log it; returns the text for :func:`warn_caller`. Called from the
        facade's link workers (threads), which is why it does not warn itself: a warning
        raised there would name the worker's frame, not the application's line."""
        where = format_host_port(host, port)  # [v6]:port, as datadist probe takes it
        text = (f"link to cluster {cluster_id} at {where} failed ({code_name}): "
                f"{reason} [for more: datadist probe {where} --cluster-id {cluster_id}]")
        with self._lock:
            self._last[cluster_id] = text
        log.warning("%s", text)
        return text

    def succeeded(self, cluster_id: int) -> None:
        """A link to ``cluster_id`` was made: its old failure no longer applies."""
        with self._lock:
            self._last.pop(cluster_id, None)

    def last(self, cluster_id: int) -> str | None:
        """The last failure's text for ``cluster_id``; None when none since the last success."""
        with self._lock:
            return self._last.get(cluster_id)


def warn_caller(texts: list[str], category: type[Warning], stacklevel: int) -> None:
    """Warn once per text, attributed ``stacklevel`` frames up from the caller of this
    function (2: the caller's caller). Who calls: ``LLMDataDist.link_clusters``, in the
    application's thread after its link workers finished, with the stacklevel that names
    the application's call of ``link_clusters`` (Python's ``warnings`` shows that file and
    line, and filters by it). Never blocks."""
    for text in texts:
        warnings.warn(text, category, stacklevel=stacklevel + 1)


__all__ = ["LinkFailedWarning", "LinkFailures", "warn_caller"]
