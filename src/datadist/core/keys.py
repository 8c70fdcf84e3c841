"""How a request names a remote cache (:class:`KeyRef`, :class:`KeyKind`) and a READ's flags
(:class:`ReadFlags`): the values the facade builds, the engine hands to the core
(:mod:`datadist.core.native`), and the protocol's frames carry.

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


__all__ = ["KeyKind", "KeyRef", "ReadFlags"]
