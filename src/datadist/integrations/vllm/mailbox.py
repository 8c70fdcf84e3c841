"""The hold/done mailbox: how a decoder tells a producer it has pulled a request's blocks.

Theory of operation. datadist moves bytes between registered caches and has no message
channel of its own, so the notification is itself a tiny blocks cache. Every producer worker
registers a mailbox (``MAILBOX_MODEL_ID``): ``slots`` records of ``RECORD_BYTES`` bytes, one
per finished request it holds. The producer's scheduler gives each held request a slot and a
random 16-byte tag, and puts both in the request's ``kv_transfer_params``.

Rule 1: the producer writes ``(tag, HELD)`` into the slot before it can report the request
    done, and clears the slot (all zeros) before it reports the blocks free (done sending).
Rule 2: a decoder pulls the slot before and after pulling the KV blocks and uses the blocks
    only when both reads say ``(tag, HELD)``: blocks freed by the producer's timeout (and
    perhaps reused) are never taken for the request's KV.
Rule 3: after pulling, the decoder pushes ``(tag, DONE)`` into the slot; the producer frees
    the blocks the next time it polls. A lost or late DONE only delays the free until the
    producer's timeout; a stale DONE for an older tag never matches a newer request's tag.

Records are plain bytes: ``tag[16] | state[1] | zero padding``.
"""

from __future__ import annotations

import numpy as np

RECORD_BYTES = 32
TAG_BYTES = 16
FREE, HELD, DONE = 0, 1, 2


def encode(tag: bytes, state: int) -> np.ndarray:
    """The record bytes for ``tag`` in ``state``."""
    if len(tag) != TAG_BYTES:
        raise ValueError(f"tag must be {TAG_BYTES} bytes, got {len(tag)}")
    rec = np.zeros(RECORD_BYTES, np.uint8)
    rec[:TAG_BYTES] = np.frombuffer(tag, np.uint8)
    rec[TAG_BYTES] = state
    return rec


def decode(rec: np.ndarray) -> tuple[bytes, int]:
    """(tag, state) of one record."""
    return bytes(rec[:TAG_BYTES]), int(rec[TAG_BYTES])


class Mailbox:
    """A producer's mailbox memory: ``slots`` records, registered with datadist by the caller.

    Used by the producer worker's thread only (the scheduler thread of vLLM's worker), so it
    takes no lock: a decoder's push lands bytes in ``buf`` at any time, and a torn read of a
    record only delays a DONE until the next poll.
    """

    def __init__(self, slots: int) -> None:
        self.buf = np.zeros((slots, RECORD_BYTES), np.uint8)

    @property
    def slots(self) -> int:
        return self.buf.shape[0]

    def hold(self, slot: int, tag: bytes) -> None:
        self.buf[slot] = encode(tag, HELD)

    def is_done(self, slot: int, tag: bytes) -> bool:
        return decode(self.buf[slot]) == (tag, DONE)

    def clear(self, slot: int) -> None:
        self.buf[slot] = 0
