"""How a request names a remote cache (:class:`KeyRef`, :class:`KeyKind`) and a READ's flags
(:class:`ReadFlags`): the values the facade builds, the engine hands to the core
(:mod:`datadist.core.native`), and the protocol's frames carry. And how a local cache is named
by a CacheKey (:class:`KeyId`, :func:`key_id`: what the core's registry binds and consumes,
cpp/src/registry.h ``KeyId``). A plan's size is checked by the core (session.cc
``CheckRequestSize``, for both faces) and again by the owner.

Who calls: the facade (``api/``: geometry, cache manager, async transfers, v1), the engine
binding, and the protocol's reference codec (:mod:`datadist.wire.protocol`), which encodes and
decodes them and re-exports them under its own name. Plain values: nothing here blocks.
The numbers are the wire's (docs/protocol.md "Messages"); the core's are cpp/src/wire.h's.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import ClassVar

UINT64_MAX = 2**64 - 1
# Most spans (tensors x spans per tensor, counted after the expansion) one request may name
# (docs/protocol.md; the core's owner refuses more, kMaxRequestSpans in cpp/src/registry.h).
MAX_REQUEST_SPANS = 1 << 22


class KeyKind(enum.IntEnum):
    """How a request names the remote cache."""

    CACHE_KEY = 1  # a = req_id, b = model_id, c = prefix_id; source unit = the key's slot
    CACHE_ID = 2  # a = cache_id, b = batch index; source unit = that slot
    BLOCKS_KEY = 3  # b = model_id; offsets are absolute within each tensor
    # Raw addresses (transfer_cache_async's TransferConfig; WRITE only, a READ naming them is
    # a protocol error): tensors == [0] and offsets are absolute addresses in the owner's
    # memory; the owner accepts them only inside one tensor of a remote-accessible cache it
    # registered (the core's Registry::OpenAddresses, cpp/src/registry.cc).
    ADDRESS = 4


class ReadFlags(enum.IntFlag):
    """Flags of a READ: ask for a grant (same host), shared memory, or an end-to-end checksum."""

    NONE = 0
    GRANT = 1  # same host: answer with addresses (a lease), not with the bytes
    SHM = 2  # with GRANT: answer with an ShmGrant if the cache is in shareable memory
    CHECKSUM = 4  # follow the answer with a Checksum frame over the source spans
    # The requester asked for every tensor (no layer range): the cache must have exactly as
    # many tensors as the request names, as CANN's GetSendTask requires of a pull.
    WHOLE = 8


@dataclass(frozen=True, slots=True)
class KeyRef:
    """How a request names the remote cache: a ``KeyKind`` and up to three integers."""

    kind: KeyKind
    a: int = 0
    b: int = 0
    c: int = 0

    _S: ClassVar[struct.Struct] = struct.Struct("<BQQQ")


@dataclass(frozen=True, slots=True)
class KeyId:
    """A local CacheKey: a req_id or a prefix_id, within a model_id (cluster ids are not part).
    The core's registry binds it to a slot of a cache (cpp/src/registry.h ``KeyId``)."""

    value: int
    model_id: int
    is_prefix: bool = False


def key_id(req_id: int, prefix_id: int, model_id: int) -> KeyId | None:
    """The local key for a CacheKey's fields; None for the padding key (both unset)."""
    if req_id != UINT64_MAX:
        return KeyId(req_id, model_id, False)
    if prefix_id != UINT64_MAX:
        return KeyId(prefix_id, model_id, True)
    return None


__all__ = ["MAX_REQUEST_SPANS", "UINT64_MAX", "KeyId", "KeyKind", "KeyRef", "ReadFlags",
           "key_id"]
