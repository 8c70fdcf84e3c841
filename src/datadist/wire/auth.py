"""Shared-secret mutual authentication of a link, by challenge and response.

Theory of operation
-------------------
Both ends know a secret; it never crosses the wire. The client's Hello carries a fresh
16-byte nonce; the server answers with its own nonce and a MAC over both nonces and both
cluster ids (so the client knows the server holds the secret); the client then sends its
own MAC over the nonces in the other order (so the server knows the client does). Until that
last step succeeds the server answers nothing but an error: a peer without the secret can
read nothing. Fresh nonces on both sides defeat replay; the direction labels defeat
reflection. HMAC-SHA256, compared in constant time.

Pure functions: no I/O, no clocks. The core computes the same MACs (cpp/src/auth.cc); these are
the protocol's reference, for the probe (``datadist probe``) and for test peers.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct

NONCE_BYTES = 16
MAC_BYTES = 32


def nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def _mac(secret: bytes, label: bytes, first: bytes, second: bytes, server_id: int,
         client_id: int) -> bytes:
    msg = label + first + second + struct.pack("<QQ", server_id, client_id)
    return hmac.new(secret, msg, hashlib.sha256).digest()


def server_proof(secret: bytes, client_nonce: bytes, server_nonce: bytes, server_id: int,
                 client_id: int) -> bytes:
    """What the server sends in Welcome.proof: its nonce, then its MAC."""
    return server_nonce + _mac(secret, b"datadist-server", client_nonce, server_nonce,
                               server_id, client_id)


def client_proof(secret: bytes, client_nonce: bytes, server_nonce: bytes, server_id: int,
                 client_id: int) -> bytes:
    return _mac(secret, b"datadist-client", server_nonce, client_nonce, server_id, client_id)


def split_server_proof(proof: bytes) -> tuple[bytes, bytes] | None:
    if len(proof) != NONCE_BYTES + MAC_BYTES:
        return None
    return proof[:NONCE_BYTES], proof[NONCE_BYTES:]


def same(a: bytes, b: bytes) -> bool:
    return hmac.compare_digest(a, b)
