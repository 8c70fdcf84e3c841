"""``llm_datadist.v2.llm_datadist`` under its own name."""

from datadist.api.llm_datadist import LLMDataDist
from datadist.api.llm_datadist import _shutdown_handler as _shutdown_handler  # the atexit hook

__all__ = ["LLMDataDist"]
