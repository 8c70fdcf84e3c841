"""The error tree of datadist, grouped by cause, each class carrying its status code.

Leaf module: imports nothing from datadist. The numeric codes are LLM-DataDist's
(``0x5010B000 + n``); the facade (``datadist.api.status``) turns any ``DatadistError``
into CANN's ``LLMException`` with the same code, in one place.
"""

from __future__ import annotations

import enum


class Code(enum.IntEnum):
    """Status codes, numerically identical to ``llm_datadist.LLMStatusCode``."""

    SUCCESS = 0
    FAILED = 0xFFFFFFFF
    WAIT_PROCESS_TIMEOUT = 0x5010B001
    KV_CACHE_NOT_EXIST = 0x5010B002
    REPEAT_REQUEST = 0x5010B003
    REQUEST_ALREADY_COMPLETED = 0x5010B004
    PARAM_INVALID = 0x5010B005
    ENGINE_FINALIZED = 0x5010B006
    NOT_YET_LINK = 0x5010B007
    ALREADY_LINK = 0x5010B008
    LINK_FAILED = 0x5010B009
    UNLINK_FAILED = 0x5010B00A
    NOTIFY_PROMPT_UNLINK_FAILED = 0x5010B00B
    CLUSTER_NUM_EXCEED_LIMIT = 0x5010B00C
    PROCESSING_LINK = 0x5010B00D
    DEVICE_OUT_OF_MEMORY = 0x5010B00E
    PREFIX_ALREADY_EXIST = 0x5010B00F
    PREFIX_NOT_EXIST = 0x5010B010
    SEQ_LEN_OVER_LIMIT = 0x5010B011
    NO_FREE_BLOCK = 0x5010B012
    BLOCKS_OUT_OF_MEMORY = 0x5010B013
    EXIST_LINK = 0x5010B018
    FEATURE_NOT_ENABLED = 0x5010B019
    TIMEOUT = 0x5010B01A
    LINK_BUSY = 0x5010B01B
    OUT_OF_MEMORY = 0x5010B01C
    DEVICE_MEM_ERROR = 507053
    SUSPECT_REMOTE_ERROR = 507057
    UNKNOWN_ERROR = -1

    @property
    def status_name(self) -> str:
        """llm_datadist's name of this code (``LLM_TIMEOUT``), for logs and metrics."""
        if self is Code.SEQ_LEN_OVER_LIMIT:
            return "LLM_SEQ_LENOVERLIMIT"  # sic: llm_datadist's spelling
        return f"LLM_{self.name}"


class DatadistError(Exception):
    """Base of every error datadist raises on purpose. ``code`` is its status code."""

    code: Code = Code.FAILED  # per class; an instance may set its own

    def __init__(self, message: str = "", *, code: Code | int | None = None) -> None:
        super().__init__(message)
        if code is not None:
            # An instance may carry a more precise code than its class (a remote error).
            self.code = Code(code)


class InvalidArgument(DatadistError, ValueError):
    """A bad argument or option value (also a ValueError): PARAM_INVALID."""

    code = Code.PARAM_INVALID


class NotSupported(DatadistError):
    """A feature this process, path or peer does not offer: FEATURE_NOT_ENABLED."""

    code = Code.FEATURE_NOT_ENABLED


class CacheError(DatadistError):
    """Base of the errors about a cache (registered memory); FAILED unless a subclass says."""

    code = Code.FAILED


class CacheNotFound(CacheError):
    """No cache (or cache key) by that id or key here: KV_CACHE_NOT_EXIST."""

    code = Code.KV_CACHE_NOT_EXIST


class OutOfMemory(CacheError, MemoryError):
    """A pool or host allocation failed (also a MemoryError): OUT_OF_MEMORY."""

    code = Code.OUT_OF_MEMORY


class DeviceOutOfMemory(OutOfMemory):
    """The device memory pool (``mem_pool_cfg``) is exhausted: DEVICE_OUT_OF_MEMORY."""

    code = Code.DEVICE_OUT_OF_MEMORY


class LinkError(DatadistError):
    """Base of the errors about a link to a peer: LINK_FAILED unless a subclass says."""

    code = Code.LINK_FAILED


class NotLinked(LinkError):
    """No link to that cluster id (yet, or any more): NOT_YET_LINK."""

    code = Code.NOT_YET_LINK


class AlreadyLinked(LinkError):
    """A link to that cluster id exists already: ALREADY_LINK."""

    code = Code.ALREADY_LINK


class LinkFailed(LinkError):
    """A link could not be made (refused, unreachable, handshake failed): LINK_FAILED."""

    code = Code.LINK_FAILED


class ProtocolError(DatadistError):
    """A frame broke the protocol. Use a subclass: who broke it matters."""

    code = Code.FAILED

    def __init__(self, message: str = "", *, code: Code | int | None = None) -> None:
        if type(self) is ProtocolError:
            raise TypeError("raise LocalProtocolError or RemoteProtocolError")
        super().__init__(message, code=code)


class LocalProtocolError(ProtocolError):
    """We were about to send something illegal: a bug in datadist."""


class RemoteProtocolError(ProtocolError):
    """The peer sent something illegal: malformed, oversized or out of order."""

    code = Code.SUSPECT_REMOTE_ERROR


class TransferError(DatadistError):
    """Base of the errors of a transfer under way; FAILED unless a subclass says."""

    code = Code.FAILED


class BrokenLink(TransferError):
    """The peer vanished mid-transfer (connection reset or closed)."""

    code = Code.LINK_FAILED


class RemoteError(TransferError):
    """The peer refused a request and said why; ``code`` is the peer's code."""


class IntegrityError(TransferError):
    """The bytes that arrived are not the bytes the owner sent (checksum mismatch)."""

    code = Code.SUSPECT_REMOTE_ERROR


class Timeout(DatadistError, TimeoutError):
    """A deadline passed (also a TimeoutError): TIMEOUT."""

    code = Code.TIMEOUT


class Closed(DatadistError):
    """Used after finalize()/close()."""

    code = Code.ENGINE_FINALIZED


class Busy(DatadistError):
    """A link busy with another transfer, or a peer holding too many grants: LINK_BUSY."""

    code = Code.LINK_BUSY


def error_for_code(code: int, message: str) -> DatadistError:
    """Rebuild a typed error from a status code, as received from a peer.

    Called by the client side of a transport when the peer answers with an error frame.
    """
    by_code: dict[int, type[DatadistError]] = {
        Code.KV_CACHE_NOT_EXIST: CacheNotFound,
        Code.PARAM_INVALID: InvalidArgument,
        Code.TIMEOUT: Timeout,
        Code.NOT_YET_LINK: NotLinked,
        Code.LINK_FAILED: LinkFailed,
        Code.LINK_BUSY: Busy,
        Code.FEATURE_NOT_ENABLED: NotSupported,
        Code.OUT_OF_MEMORY: OutOfMemory,
    }
    try:
        known = Code(code)
    except ValueError:
        known = Code.FAILED
    cls = by_code.get(known, RemoteError)
    return cls(message, code=known)
