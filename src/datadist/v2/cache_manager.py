"""``llm_datadist.v2.cache_manager`` under its own name."""

from datadist.api.cache_manager import CacheManager

__all__ = ["CacheManager"]
