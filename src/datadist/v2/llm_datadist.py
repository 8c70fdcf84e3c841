"""``llm_datadist.v2.llm_datadist`` under its own name."""

from datadist.api.llm_datadist import LLMDataDist

__all__ = ["LLMDataDist"]
