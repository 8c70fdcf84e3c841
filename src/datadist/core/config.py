"""What an engine runs with: its configuration and the names of its choices.

Who calls: the facade (``LLMDataDist.init`` parses its options into an :class:`EngineConfig`),
the engine (:mod:`datadist.core.native`), ``datadist info`` / ``probe`` and the bench. Plain
data and checks: nothing here blocks, opens a socket or imports the core.
"""

from __future__ import annotations

import enum
import os
import ssl
from dataclasses import dataclass

from datadist.core.errors import InvalidArgument
from datadist.memory.pool import PoolConfig

HOST, DEVICE = 0, 1  # a cache's placement, as the core's registry keeps it


class PathKind(str, enum.Enum):
    """Data paths by name, as users force them (``DATADIST_TRANSPORT``)."""

    AUTO = "auto"
    TCP = "tcp"
    CMA = "cma"
    SHM = "shm"
    NIXL = "nixl"  # optional: NIXL (UCX) moves the bytes, datadist keeps the control plane


@dataclass(frozen=True)
class TlsConfig:
    """PEM files: this process's certificate and key, and the CA that signs every peer's."""

    cert_file: str
    key_file: str
    ca_file: str

    def check(self) -> None:
        """Each file is a readable regular file; else InvalidArgument naming it. The PEM
        contents are checked when the contexts are made (``init``), also InvalidArgument."""
        for what, path in (("certificate", self.cert_file), ("key", self.key_file),
                           ("CA", self.ca_file)):
            try:
                with open(path, "rb"):
                    pass
            except OSError as e:
                raise InvalidArgument(
                    f"cannot read the TLS {what} file {path!r}: {e.strerror or e}"
                ) from None
            if not os.path.isfile(path):
                raise InvalidArgument(f"the TLS {what} file {path!r} is not a regular file")

    def _context(self, purpose: ssl.Purpose) -> ssl.SSLContext:
        self.check()
        try:
            ctx = ssl.create_default_context(purpose, cafile=self.ca_file)
        except (OSError, ssl.SSLError) as e:
            raise InvalidArgument(f"cannot load the TLS CA file {self.ca_file!r}: {e}") from e
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_REQUIRED
        try:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        except (OSError, ssl.SSLError) as e:
            raise InvalidArgument(
                f"cannot load the TLS certificate {self.cert_file!r} with its key "
                f"{self.key_file!r}: {e}"
            ) from e
        return ctx

    def client_context(self) -> ssl.SSLContext:
        return self._context(ssl.Purpose.SERVER_AUTH)


@dataclass(frozen=True)
class EngineConfig:
    """What an Engine runs with, parsed from ``LLMDataDist.init``'s options (cluster id, role,
    listen address, timeouts, pools, transport, auth, TLS, connection caps)."""

    cluster_id: int
    role: int
    listen: tuple[str, int] | None = None
    sync_timeout: float = 1.0  # seconds, bounds every pull and push
    device_pool: PoolConfig | None = None
    host_pool: PoolConfig | None = None
    transport: str | None = None
    # NIXL (docs/security.md, "The NIXL path"): serve NIXL readers (our metadata, grants,
    # leases) only when asked to (datadist.NixlServe); and, where UCX would carry NIXL over a
    # transport whose memory keys the hardware does not check, only with
    # nixl_whole_process (datadist.NixlAllowWholeProcessAccess), which also lets a reader
    # link by NIXL there: a NIXL peer can then reach this whole process.
    nixl_serve: bool = False
    nixl_whole_process: bool = False
    secret: bytes | None = None  # shared secret peers must prove at link time
    verify: bool = False  # end-to-end CRC-32 of every pull
    tls: TlsConfig | None = None  # mutual TLS on every connection
    # May same-user readers be let in under Yama ptrace_scope=1 (PR_SET_PTRACER_ANY, set
    # only once cross-memory attach is used)? Off: they fall back to a stream path.
    allow_ptrace: bool = True
    # enable_remote_cache_accessible: off, peers' WRITEs by key or cache id (push_cache,
    # push_blocks, transfer_cache_async by key) are refused here, on the owner; WRITEs by
    # raw address (transfer_cache_async with TransferConfig, that mode's push) stay allowed.
    remote_cache_accessible: bool = True
    max_connections: int = 256  # inbound connections served at once (listener cap)
    max_connections_per_peer: int = 64  # ... of them from one peer IP (a link takes two)


def _read_boot_id() -> bytes:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return bytes.fromhex(f.read().strip().replace("-", ""))[:16].ljust(16, b"\0")
    except OSError:  # pragma: no cover - not Linux
        return b"\0" * 16


def _read_pid_ns() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:  # pragma: no cover
        return 0


@dataclass(frozen=True, slots=True)
class HostIdentity:
    """What makes two processes 'on the same host' for memory access."""

    boot_id: bytes
    pid_ns: int
    pid: int

    @classmethod
    def current(cls) -> HostIdentity:
        return cls(_read_boot_id(), _read_pid_ns(), os.getpid())

    def claims_same_host(self, boot_id: bytes) -> bool:
        """A peer's boot id is ours: worth trying the local channel. A claim, not a proof."""
        return self.boot_id == boot_id and any(self.boot_id)


def forced_path(option: str | None) -> PathKind:
    """The path the user forces: the option wins over ``DATADIST_TRANSPORT``."""
    raw = option or os.environ.get("DATADIST_TRANSPORT", "") or "auto"
    try:
        return PathKind(raw.strip().lower())
    except ValueError:
        raise InvalidArgument(
            f"unknown transport {raw!r}; use one of {[k.value for k in PathKind]}"
        ) from None
