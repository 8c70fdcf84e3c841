"""``llm_datadist.status`` under its own name: status codes, exceptions and the helpers that
raise them, with llm_datadist's signatures. The types live in :mod:`datadist.api.status`."""

from __future__ import annotations

from typing import Any

from datadist.api.status import LLMException, LLMStatusCode, Status, code_to_status


def code_2_status(status: int) -> LLMStatusCode:
    """The LLMStatusCode of a native code; any unknown code is LLM_FAILED."""
    return code_to_status(status)


def handle_llm_status(status: int, func_name: str, other_info: Any) -> None:
    """Raise ``LLMException`` for a code other than LLM_SUCCESS."""
    if status != LLMStatusCode.LLM_SUCCESS:
        code = code_to_status(status)
        raise LLMException(f"{func_name} failed, error code is {code}, {other_info}.",
                           status_code=code)


def raise_if_false(pred: Any, fmt: str, *args: Any,
                   status_code: LLMStatusCode = LLMStatusCode.LLM_PARAM_INVALID,
                   **kwargs: Any) -> None:
    """Raise ``LLMException(fmt.format(*args, **kwargs), status_code)`` unless ``pred``."""
    if not pred:
        raise LLMException(fmt.format(*args, **kwargs), status_code=status_code)


def raise_if_true(pred: Any, fmt: str, *args: Any,
                  status_code: LLMStatusCode = LLMStatusCode.LLM_PARAM_INVALID,
                  **kwargs: Any) -> None:
    """Raise ``LLMException(fmt.format(*args, **kwargs), status_code)`` if ``pred``."""
    raise_if_false(not pred, fmt, *args, status_code=status_code, **kwargs)


__all__ = ["LLMStatusCode", "LLMException", "Status", "code_2_status", "handle_llm_status",
           "raise_if_false", "raise_if_true"]
