"""What an engine runs with: its configuration and the names of its choices.

Who calls: the facade (``LLMDataDist.init`` has the core's option table parse its options,
:func:`engine_settings` turns that into an :class:`EngineConfig`'s fields), the engine
(:mod:`datadist.core.native`), ``datadist info`` / ``probe`` and the bench. Plain data and
checks: nothing here blocks or opens a socket; only :func:`forced_path` asks the core's table.
"""

from __future__ import annotations

import enum
import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from datadist.core.errors import InvalidArgument
from datadist.core.options import parse_options
from datadist.memory.pool import PoolConfig

HOST, DEVICE = 0, 1  # a cache's placement, as the core's registry keeps it


# The option keys of the core's table (cpp/src/options.h) the Python face reads by name.
OPT_TRANSPORT = "datadist.Transport"
OPT_NIXL_SERVE = "datadist.NixlServe"
OPT_NIXL_WHOLE_PROCESS = "datadist.NixlAllowWholeProcessAccess"
OPT_NIXL_LIBRARY = "datadist.NixlLibrary"
OPT_AUTH_SECRET = "datadist.AuthSecret"
OPT_VERIFY = "datadist.VerifyChecksum"
OPT_ALLOW_PTRACE = "datadist.AllowPtrace"
OPT_TLS_CERT = "datadist.TlsCert"
OPT_TLS_KEY = "datadist.TlsKey"
OPT_TLS_CA = "datadist.TlsCa"
OPT_MAX_CONNECTIONS = "datadist.MaxConnections"
OPT_MAX_CONNECTIONS_PER_PEER = "datadist.MaxConnectionsPerPeer"
OPT_SYNC_KV_WAIT = "llm.SyncKvCacheWaitTime"


class PathKind(str, enum.Enum):
    """Data paths by name, as users force them (``datadist.Transport``)."""

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
    transport: str | None = None  # None: the table's (its variable, else auto)
    # NIXL (docs/security.md, "The NIXL path"): serve NIXL readers (our metadata, grants,
    # leases) only when asked to (datadist.NixlServe); and, where UCX would carry NIXL over a
    # transport whose memory keys the hardware does not check, only with
    # nixl_whole_process (datadist.NixlAllowWholeProcessAccess), which also lets a reader
    # link by NIXL there: a NIXL peer can then reach this whole process.
    nixl_serve: bool = False
    nixl_whole_process: bool = False
    nixl_library: str = ""  # NIXL's C API to load ("": the nixl-cu12 wheel's)
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


def engine_settings(parsed: Mapping[str, tuple[object, str]]) -> dict[str, Any]:
    """The :class:`EngineConfig` fields the core's option table decides, from what it parsed
    (``native.parse_options``: ``{key: (value, source)}``): transport, NIXL serving, secret,
    checksums, ptrace, TLS, connection caps and the pull / push deadline. Returns at once."""
    v = {key: value for key, (value, _source) in parsed.items()}
    files = (str(v[OPT_TLS_CERT]), str(v[OPT_TLS_KEY]), str(v[OPT_TLS_CA]))
    secret = str(v[OPT_AUTH_SECRET])
    return {
        "transport": str(v[OPT_TRANSPORT]),
        "nixl_serve": bool(v[OPT_NIXL_SERVE]),
        "nixl_whole_process": bool(v[OPT_NIXL_WHOLE_PROCESS]),
        "nixl_library": str(v[OPT_NIXL_LIBRARY]),
        "secret": secret.encode() if secret else None,
        "verify": bool(v[OPT_VERIFY]),
        "allow_ptrace": bool(v[OPT_ALLOW_PTRACE]),
        "tls": TlsConfig(*files) if all(files) else None,
        "max_connections": _int(v[OPT_MAX_CONNECTIONS]),
        "max_connections_per_peer": _int(v[OPT_MAX_CONNECTIONS_PER_PEER]),
        "sync_timeout": _int(v[OPT_SYNC_KV_WAIT]) / 1000.0,
    }


def _int(value: object) -> int:
    if not isinstance(value, int):
        raise TypeError(f"the option table gave {value!r} for an int option")
    return value


def forced_path(option: str | None) -> PathKind:
    """The path the user forces: the option, else its variable, else auto, as the core's
    option table reads them (InvalidArgument with the table's message for another name)."""
    parsed = parse_options({OPT_TRANSPORT: option or ""})
    return PathKind(str(parsed[OPT_TRANSPORT][0]))
