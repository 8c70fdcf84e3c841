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


class NotListeningWarning(DatadistWarning):
    """A PROMPT registers caches but listens nowhere: no DECODER can link to it to pull
    them (``LLMConfig.listen_ip_info`` is unset). Told once per process instance."""


__all__ = ["DatadistWarning", "LinkFailedWarning", "NotListeningWarning"]
