"""``llm_datadist.configs`` under its own name: roles, ``LlmConfig`` and ``LLMClusterInfo``.
The classes live in :mod:`datadist.api.config` and :mod:`datadist.api.enums`."""

from __future__ import annotations

from typing import Any

from datadist.api.config import LLMClusterInfo, LlmConfig, ip_to_int
from datadist.api.enums import LLMRole


def trans_str_ip(ip: Any) -> Any:
    """A dotted IPv4 string as llm_datadist's little-endian uint32; anything else unchanged.
    A string that is no IPv4 address is a RuntimeError("Can not parse ip str:...")."""
    return ip_to_int(ip) if isinstance(ip, str) else ip


__all__ = ["LLMRole", "LLMClusterInfo", "LlmConfig", "trans_str_ip"]
