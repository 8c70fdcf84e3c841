"""``llm_datadist.v2`` under its own name: the cache-manager generation's modules
(:mod:`.llm_datadist`, :mod:`.cache_manager`, :mod:`.llm_types`, :mod:`.llm_utils`,
:mod:`.config`), re-exported from :mod:`datadist.api`."""

from datadist.v2 import cache_manager, config, llm_datadist, llm_types, llm_utils

__all__ = ["cache_manager", "config", "llm_datadist", "llm_types", "llm_utils"]
