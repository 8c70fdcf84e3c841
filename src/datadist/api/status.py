"""LLM-DataDist's status codes and exceptions, and the one place core errors become them."""

from __future__ import annotations

import enum

from datadist.core.errors import Code, DatadistError


class LLMStatusCode(enum.IntEnum):
    """Status codes, with llm_datadist's names and values."""

    LLM_SUCCESS = Code.SUCCESS
    LLM_FAILED = Code.FAILED
    LLM_WAIT_PROCESS_TIMEOUT = Code.WAIT_PROCESS_TIMEOUT
    LLM_KV_CACHE_NOT_EXIST = Code.KV_CACHE_NOT_EXIST
    LLM_REPEAT_REQUEST = Code.REPEAT_REQUEST
    LLM_REQUEST_ALREADY_COMPLETED = Code.REQUEST_ALREADY_COMPLETED
    LLM_PARAM_INVALID = Code.PARAM_INVALID
    LLM_ENGINE_FINALIZED = Code.ENGINE_FINALIZED
    LLM_NOT_YET_LINK = Code.NOT_YET_LINK
    LLM_ALREADY_LINK = Code.ALREADY_LINK
    LLM_LINK_FAILED = Code.LINK_FAILED
    LLM_UNLINK_FAILED = Code.UNLINK_FAILED
    LLM_NOTIFY_PROMPT_UNLINK_FAILED = Code.NOTIFY_PROMPT_UNLINK_FAILED
    LLM_CLUSTER_NUM_EXCEED_LIMIT = Code.CLUSTER_NUM_EXCEED_LIMIT
    LLM_PROCESSING_LINK = Code.PROCESSING_LINK
    LLM_DEVICE_OUT_OF_MEMORY = Code.DEVICE_OUT_OF_MEMORY
    LLM_PREFIX_ALREADY_EXIST = Code.PREFIX_ALREADY_EXIST
    LLM_PREFIX_NOT_EXIST = Code.PREFIX_NOT_EXIST
    LLM_SEQ_LENOVERLIMIT = Code.SEQ_LEN_OVER_LIMIT  # sic: llm_datadist's spelling
    LLM_NO_FREE_BLOCK = Code.NO_FREE_BLOCK
    LLM_BLOCKS_OUT_OF_MEMORY = Code.BLOCKS_OUT_OF_MEMORY
    LLM_EXIST_LINK = Code.EXIST_LINK
    LLM_FEATURE_NOT_ENABLED = Code.FEATURE_NOT_ENABLED
    LLM_TIMEOUT = Code.TIMEOUT
    LLM_LINK_BUSY = Code.LINK_BUSY
    LLM_OUT_OF_MEMORY = Code.OUT_OF_MEMORY
    LLM_DEVICE_MEM_ERROR = Code.DEVICE_MEM_ERROR
    LLM_SUSPECT_REMOTE_ERROR = Code.SUSPECT_REMOTE_ERROR
    LLM_UNKNOWN_ERROR = Code.UNKNOWN_ERROR

    def __str__(self) -> str:
        return f"LLMStatusCode.{self.name}"


def code_to_status(code: int) -> LLMStatusCode:
    """Any native code not in the map becomes LLM_FAILED, as in llm_datadist."""
    try:
        return LLMStatusCode(code)
    except ValueError:
        return LLMStatusCode.LLM_FAILED


def _as_given(code: int) -> int:
    """A code as the caller gave it (llm_datadist keeps it as is), as its LLMStatusCode
    member when it has one (equal to it either way: LLMStatusCode is an IntEnum)."""
    try:
        return LLMStatusCode(code)
    except ValueError:
        return code


class LLMException(RuntimeError):
    """The exception llm_datadist raises for semantic and native failures."""

    def __init__(self, *args: object, status_code: int = LLMStatusCode.LLM_SUCCESS) -> None:
        super().__init__(*args)
        self._status_code = _as_given(status_code)

    @property
    def status_code(self) -> LLMStatusCode | int:
        """The code: its LLMStatusCode member, or the int as given when it has none."""
        return self._status_code


class Status:
    """A status code wrapper, exported for compatibility."""

    def __init__(self, status: int) -> None:
        self._status = _as_given(status)

    def is_ok(self) -> bool:
        return self._status == LLMStatusCode.LLM_SUCCESS

    @property
    def status_code(self) -> LLMStatusCode | int:
        """The code: its LLMStatusCode member, or the int as given when it has none."""
        return self._status

    def __repr__(self) -> str:
        return f"Status({self._status})"


def to_llm_exception(err: DatadistError, func: str = "") -> LLMException:
    code = code_to_status(int(err.code))
    # llm_datadist's prefix, with the code's name beside its number: "1343270919" alone
    # sends every user to a table
    prefix = f"{func} failed, error code is {int(code)} ({code.name}), " if func else ""
    return LLMException(f"{prefix}{err}", status_code=code)


class llm_errors:  # noqa: N801 - used as a function-like context manager
    """``with llm_errors("pull_cache"):`` translates any DatadistError raised inside into
    LLMException, keeping the cause.

    TypeError and ValueError that are not DatadistErrors pass through: they are the
    documented argument errors. A class, not a generator: every transfer call enters it.
    """

    __slots__ = ("func",)

    def __init__(self, func: str = "") -> None:
        self.func = func

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None,
                 tb: object) -> None:
        if isinstance(err, DatadistError):
            raise to_llm_exception(err, self.func) from err


def check_same_session(name: str, cache_id: int, owner: object, manager: object) -> None:
    """A cache handle belongs to the manager (session) that made it: one that ``finalize()``
    invalidated names a cache id of a finished session, which the new session may have given
    to another cache, so it is refused as an unknown cache, LLM_KV_CACHE_NOT_EXIST.
    ``owner`` None: a handle no manager made (``create_cpu_cache``), always accepted."""
    if owner is not None and owner is not manager:
        raise LLMException(
            f"{name} (cache_id {cache_id}) belongs to another LLMDataDist session "
            "(made before finalize()); it does not exist in this one",
            status_code=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)


def raise_if_false(cond: bool, message: str,
                   code: LLMStatusCode = LLMStatusCode.LLM_PARAM_INVALID) -> None:
    if not cond:
        raise LLMException(message, status_code=code)
