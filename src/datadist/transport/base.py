"""The interfaces between the engine and the transports.

The engine (core) implements :class:`RequestHandler`; transports call it from their serving
threads. Transports implement :class:`DataPath` for the client side of a transfer. Nothing
here imports core.engine or the api.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import numpy as np

from datadist.wire.protocol import (
    CacheLease,
    Hello,
    LeaseRequest,
    NixlGrant,
    NixlLease,
    NixlLeased,
    NixlMd,
    NixlRead,
    NixlRevoke,
    NixlWrite,
    Read,
    Welcome,
    Write,
)

if TYPE_CHECKING:
    from datadist.transport.local import LocalCred


@dataclass(frozen=True, slots=True)
class TransportCaps:
    """What a data path can do, as data (never probed with hasattr)."""

    name: str
    same_host_only: bool
    one_sided: bool
    host_memory: bool = True
    device_memory: bool = False


@dataclass(frozen=True, slots=True)
class PeerInfo:
    """Who is on the other end of a connection, from the handshake."""

    cluster_id: int
    role: int
    pid: int
    pid_ns: int
    boot_id: bytes  # pid, pid_ns, boot_id: what the peer *says*; never trusted for memory
    address: str
    # Set only on the local channel (transport/local.py): who the kernel says the peer is.
    local: LocalCred | None = None
    # The link token (protocol FEATURE_TOKEN): on a control channel the one we issued in its
    # Welcome; on a reverse channel the one its Hello echoed (b"": none).
    token: bytes = b""

    @property
    def key(self) -> tuple[int, str]:
        return (self.cluster_id, self.address)


class LeaseLike(Protocol):
    """What a transport needs of a handler's lease: the leased bytes as iovecs, their size,
    their base addresses (for grants), and whether the owner wants the memory back."""

    # The leased tensors' base addresses (uint64), sent in a same-host GRANT.
    bases: np.ndarray

    @property
    def nbytes(self) -> int: ...

    def iov(self) -> tuple[np.ndarray, np.ndarray]: ...

    def iovecs(self) -> np.ndarray: ...

    def wanted_back(self) -> bool:
        """The owner wants the leased memory back (grants on it expire sooner)."""
        ...


LeaseT = TypeVar("LeaseT", bound=LeaseLike)


class RequestHandler(Protocol[LeaseT]):
    """The owner side of the protocol, implemented by the engine.

    ``LeaseT`` is the handler's own lease type: a transport gives back to ``close_*``,
    ``sent_read`` and ``settle_read`` only leases that this handler's ``open_*`` returned.

    Called from a transport's serving thread, one thread per connection; every method must
    be thread-safe and must not block for long (none does I/O).
    """

    def on_hello(self, hello: Hello, address: str) -> Welcome:
        """Accept (return our Welcome) or refuse (raise DatadistError) a new peer."""
        ...

    def check_auth(self, hello: Hello, welcome: Welcome, proof: bytes) -> None:
        """Check a client's answer to the challenge in ``welcome``; raise LinkFailed if wrong."""
        ...

    def open_read(self, peer: PeerInfo, msg: Read) -> LeaseT:
        """Resolve and bounds-check a read; the lease pins the memory until close_read."""
        ...

    def close_read(self, lease: LeaseT, ok: bool) -> None:
        """End a read: the memory is free again; ``ok`` commits its key reservation (a
        req_id key may be consumed), otherwise the reservation is dropped."""
        ...

    def sent_read(self, lease: LeaseT) -> None:
        """The bytes of a read are sent (the memory is free again), but the requester's
        verdict is still to come: :meth:`settle_read` follows, exactly once."""
        ...

    def settle_read(self, lease: LeaseT, ok: bool) -> None: ...

    def open_write(self, peer: PeerInfo, msg: Write) -> LeaseT: ...

    def close_write(self, lease: LeaseT, ok: bool) -> None: ...

    def on_peer_ready(self, peer: PeerInfo) -> None:
        """The handshake completed (authenticated, when a secret is set): a linked peer."""
        ...

    def nixl_metadata(self) -> NixlMd:
        """Our NIXL agent's metadata (NixlMdRequest); NotSupported without NIXL."""
        ...

    def open_nixl(self, peer: PeerInfo, msg: NixlRead | NixlWrite, lease_id: int
                  ) -> tuple[LeaseT, NixlGrant]:
        """Resolve and bounds-check a read or write to be moved by NIXL, as open_read and
        open_write; the lease pins the memory (and keeps our NIXL agent progressing) until
        close_read, which the connection calls for every lease (it closes a write lease as
        close_write would)."""
        ...

    def lease_cache(self, peer: PeerInfo, msg: LeaseRequest) -> CacheLease:
        """A whole-cache lease for a kernel-verified same-host reader (local channel
        only); raises what open_read would for the cache it names."""
        ...

    def open_nixl_lease(self, peer: PeerInfo, msg: NixlLease, drop: Callable[[], None]
                        ) -> NixlLeased:
        """Lease a whole cache to a NIXL reader until revoked (NixlRevoke on the reader's
        reverse channel) or until its connection ends; ``drop`` shuts that connection down.
        NotSupported when the reader has no reverse channel here (it reads by request)."""
        ...

    def nixl_revoke(self, peer: PeerInfo, msg: NixlRevoke) -> None:
        """Reader side: the owner revokes a lease; return once no read under it is in
        flight (Timeout if one still is)."""
        ...

    def stats(self, peer: PeerInfo) -> dict[str, Any]:
        """Who we are and ``peer``'s own series of our transfer metrics, for its
        StatsRequest (JSON-ready); never other peers' series."""
        ...

    def on_bye(self, peer: PeerInfo) -> None:
        """The peer unlinked politely."""
        ...

    def on_disconnect(self, peer: PeerInfo) -> None:
        """The connection ended, for whatever reason."""
        ...

    def adopt_reverse(self, peer: PeerInfo, chan: object) -> Callable[[], None]:
        """``peer`` opened a reverse channel (Hello with FEATURE_REVERSE), checked up to the
        handshake's last frame: ``chan`` (a ``tcp.Channel``) is now ours to send requests
        on, as a link to ``peer.cluster_id``, and ours to close. The link stays locked until
        the returned function is called (after that last frame is sent). Raises a
        DatadistError (nothing adopted, ``chan`` still the caller's) when the channel is not
        taken: its token (``peer.token``) is not that of a live control channel of
        ``peer.cluster_id``, the engine is finalized, or at its cap; the caller answers the
        handshake with that error instead of its last frame."""
        ...
