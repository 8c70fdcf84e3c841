"""datadist's warnings: what a caller should hear although no call failed.

Python's ``warnings``: with the default filters each distinct message reaches stderr once
per place; ``warnings.filterwarnings("ignore", category=DatadistWarning)`` silences them
all, a subclass silences one kind.
"""

from __future__ import annotations


class DatadistWarning(UserWarning):
    """The base of datadist's warnings."""


class LinkFailedWarning(DatadistWarning):
    """A link in ``link_clusters`` failed; the message says why (the return code cannot)."""


class ClusterIdMismatchWarning(DatadistWarning):
    """``link_clusters`` linked, but the listener at the address answered with another
    cluster id than ``remote_cluster_id``. As LLM-DataDist (LinkMsgHandler files the link
    under the id the peer answers and never compares), the link succeeds and is known by the
    answered id: transfers and unlinks must name that id, and transfers naming the one asked
    for answer LLM_NOT_YET_LINK. The message names both ids."""


class NotListeningWarning(DatadistWarning):
    """A PROMPT registers caches but listens nowhere: no DECODER can link to it to pull
    them (``LLMConfig.listen_ip_info`` is unset). Told once per process instance."""


__all__ = ["ClusterIdMismatchWarning", "DatadistWarning", "LinkFailedWarning",
           "NotListeningWarning"]
