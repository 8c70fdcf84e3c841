"""``llm_datadist.configs`` under its own name: roles, ``LlmConfig`` and ``LLMClusterInfo``.
The classes live in :mod:`datadist.api.config` and :mod:`datadist.api.enums`."""

from __future__ import annotations

from typing import Any

from datadist.api.config import LLMClusterInfo, LlmConfig, ip_value
from datadist.api.enums import LLMRole


def trans_str_ip(ip: Any) -> Any:
    """A dotted IPv4 string as llm_datadist's little-endian uint32, an IPv6 one as its
    short-form literal; anything else unchanged. A string that is no IP address is a
    RuntimeError("Can not parse ip str:...")."""
    return ip_value(ip) if isinstance(ip, str) else ip


__all__ = ["LLMRole", "LLMClusterInfo", "LlmConfig", "trans_str_ip"]
