"""``datadist info``: this host's datadist (version, native core, engine, NIXL); with
``--peer``, a link to a running PROMPT made as a pull would make it, the path it takes and
why, and the peer's metrics."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Any

import numpy as np

from datadist.cli.common import CliError, count

if TYPE_CHECKING:  # imported where used: the CLI starts without the engine
    from datadist.core.native import NativeEngine


def cmd_info(args: argparse.Namespace) -> int:
    """``datadist info [--peer IP:PORT]``: print this host's report; with ``--peer``, link and
    report the path (each step blocks <= ``--timeout``). CliError for what fails."""
    import datadist
    from datadist.core.config import HostIdentity, forced_path
    from datadist.core.layout import make_iov
    from datadist.core.local import IOV_MAX, CmaRefused, vm_copy

    ident = HostIdentity.current()
    print(f"datadist {datadist.__version__}")
    _info_native()
    print(f"host: boot_id={ident.boot_id.hex()} pid_ns={ident.pid_ns} pid={ident.pid}")
    print(f"IOV_MAX={IOV_MAX}")
    try:
        print(f"forced transport: {forced_path(None).value} "
              f"(DATADIST_TRANSPORT={os.environ.get('DATADIST_TRANSPORT', '')!r})")
    except Exception as e:  # noqa: BLE001 - report, do not crash
        print(f"forced transport: invalid ({e})")
    src = np.arange(4096, dtype=np.uint8)
    dst = np.zeros(4096, dtype=np.uint8)
    try:
        vm_copy(os.getpid(), make_iov(np.array([dst.ctypes.data], np.uint64),
                                      np.array([4096], np.uint64)),
                make_iov(np.array([src.ctypes.data], np.uint64), np.array([4096], np.uint64)))
        print("cross-memory attach (process_vm_readv): available")
    except CmaRefused as e:
        print(f"cross-memory attach: refused ({e}); same-host links fall back to tcp")
    _info_options()
    _info_engine()
    _info_nixl()
    if args.peer:
        _info_peer(args)
    return 0


def _info_options() -> None:
    """The init options of the core's table (cpp/src/options.h), each with the value this
    environment gives it and where from (the variable, or the default); a secret is not
    shown. What both APIs' init would start from, before their own options."""
    from datadist.core import options

    table = options.option_table()
    if not table:
        print("options: the native core is not built, its option table is unknown")
        return
    try:
        parsed = options.parse_options({})
    except Exception as e:  # noqa: BLE001 - report, do not crash
        print(f"options: this environment's settings are refused: {e}")
        return
    print("options (option, or variable: value, from where):")
    for spec in table:
        value, source = parsed[spec.key]
        shown = ("set" if value else "unset") if spec.kind == "secret" else (
            ("1" if value else "0") if isinstance(value, bool) else str(value) or '""')
        where = f" / {spec.env}" if spec.env else ""
        print(f"  {spec.key}{where}: {shown} ({source})")


def _info_engine() -> None:
    """The engine LLMDataDist.init gets here (the native core, the only one), for a
    configuration from this environment's settings (DATADIST_TRANSPORT,
    TLS, checksums, NIXL serving), or why it would refuse that configuration."""
    from datadist.core import native
    from datadist.core.config import EngineConfig, engine_settings
    from datadist.core.options import parse_options

    try:
        config = EngineConfig(cluster_id=1, role=2, **engine_settings(parse_options({})))
    except Exception as e:  # noqa: BLE001 - report, do not crash
        print(f"engine: cannot tell ({e})")
        return
    ok, why = native.available()
    if not ok:
        print(f"engine: none here: the native core is not available ({why}); "
              "docs/native-build.md")
        return
    refused = native.refusal(config)
    if refused is None:
        print("engine: native, the only one (the C++ core serves and moves bytes without the "
              "GIL, on every path: tcp, the local channel's cma / shm, NIXL)")
    else:
        print(f"engine: native, but init would refuse this configuration: {refused}")
    has_tls, what = native.tls_available()
    print(f"core TLS: {what}" if has_tls else
          f"core TLS: none, TLS configurations are refused ({what})")


def _info_peer(args: argparse.Namespace) -> None:
    """Link to ``--peer`` as a pull would, with the engine this host's configuration gets
    (``native.engine_for``: the core under auto; the same secret, TLS and transport settings
    from the environment), and say which path the pull will take and why, and the peer's
    metrics (STATS). Each step (link, the path probe, STATS) blocks <= ``--timeout``;
    CliError for what fails."""
    from datadist.api.status import LLMException
    from datadist.core import native
    from datadist.core.address import format_host_port, parse_host_port
    from datadist.core.config import EngineConfig, engine_settings
    from datadist.core.errors import DatadistError
    from datadist.core.options import parse_options

    try:
        host, port = parse_host_port(args.peer)
        if args.own_id == args.cluster_id:
            raise CliError(f"--own-id and --cluster-id are both {args.cluster_id}: a link "
                           "needs two clusters")
        table = engine_settings(parse_options({}))  # the secret, TLS and NIXL allowance
        eng = native.engine_for(EngineConfig(
            cluster_id=args.own_id, role=2, transport=args.transport,
            secret=table["secret"], tls=table["tls"],
            nixl_whole_process=table["nixl_whole_process"]))
    except (DatadistError, LLMException) as e:
        raise CliError(f"--peer {args.peer!r}: {e}") from None
    try:
        try:
            eng.link(args.cluster_id, host, port, args.timeout)
            path, reason = _first_pull_path(eng, args.cluster_id, args.timeout)
        except DatadistError as e:
            raise CliError(f"cannot link to cluster {args.cluster_id} at "
                           f"{format_host_port(host, port)}: {e}") from None
        print(f"link to cluster {args.cluster_id} at {format_host_port(host, port)}: "
              f"path={path} ({reason})")
        try:
            stats = eng.peer_stats(args.cluster_id, args.timeout)
        except DatadistError as e:  # an older peer, or another implementation
            print(f"peer metrics: not available ({e})")
        else:
            print("\n".join(metrics_lines(stats)))
    finally:
        eng.close()


def _first_pull_path(eng: NativeEngine, cluster_id: int, timeout: float) -> tuple[str, str]:
    """The path (and why) the first pull on ``eng``'s link to ``cluster_id`` will take: the
    link's, unless the kernel refuses cross-memory attach to the owner, which the core learns
    at a first pull (asked now, as it asks then). Blocks <= timeout (the core waits for the
    link)."""
    eng.probe_cma(cluster_id, timeout)
    link = eng.get_link(cluster_id)
    return str(link.path_name), str(link.reason)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds == float("inf"):
        return "> 100 s"
    return f"{seconds * 1e6:.0f} us" if seconds < 1e-3 else f"{seconds * 1e3:.1f} ms"


ROLE_NAMES = {1: "PROMPT", 2: "DECODER", 3: "MIX"}  # LLMRole's values, as Engine.stats has them


def metrics_lines(stats: dict[str, Any]) -> list[str]:
    """``datadist info``'s view of a process's metrics (a peer's ``Engine.stats()``).

    ``serve_lease`` counts whole-cache leases granted to same-host readers: the reads under
    a lease copy the owner's memory without asking it, so only the reader counts them (its
    ``pull`` rows); the owner's line says so instead of "0 bytes"."""
    role = stats.get("role")
    out = [f"peer metrics: cluster {stats.get('cluster_id')}, role "
           f"{ROLE_NAMES.get(role, role) if isinstance(role, int) else role}"]

    def line(name: str, m: dict[str, Any]) -> str:
        errors = ", ".join(f"{k} x{v}" for k, v in sorted(m.get("errors", {}).items()))
        failed = f"; failed: {errors}" if errors else ""
        if name.startswith("serve_lease"):
            return (f"  {name}: {m.get('transfers', 0)} leases granted (the reads under a "
                    "lease go to the owner's memory directly: the reader counts their "
                    f"transfers and bytes, the owner cannot){failed}")
        return (f"  {name}: {m.get('transfers', 0)} transfers, {m.get('bytes', 0):,} bytes, "
                f"p50 <= {_duration(m.get('p50_s'))}, p99 <= {_duration(m.get('p99_s'))}"
                + failed)

    total = stats.get("total") or {}
    if not total:
        out.append("  no transfers yet")
    for op, m in sorted(total.items()):
        out.append(line(op, m))
    for cid, ops in sorted((stats.get("links") or {}).items()):
        for op, m in sorted(ops.items()):
            out.append(line(f"{op} with cluster {cid}", m))
    return out


def _info_native() -> None:
    """The native core (datadist._core): built or not, and how it was built."""
    from datadist.core import native_build

    ok, what = native_build.native_available()
    if not ok:
        print(f"native core: not available ({what})")
        return
    info = native_build.build_info()
    print(f"native core: built, {what}: " +
          ", ".join(f"{key} {value}" for key, value in sorted(info.items())))


def _info_nixl() -> None:
    """The NIXL data path: installed or not, which backends NIXL offers here, and the C API
    library the core loads."""
    from datadist.core import nixl_wheel as nixl

    module = nixl.available()
    if module is None:
        print("nixl: not installed (pip install 'datadist[nixl]' for the NIXL data path)")
        return
    try:
        plugins = nixl.plugins()
    except Exception as e:  # noqa: BLE001 - report, do not crash
        print(f"nixl: {module} installed but unusable ({e})")
        return
    ucx = "UCX available" if nixl.BACKEND in plugins else "no UCX backend: unusable"
    print(f"nixl: {module}, backends {', '.join(plugins)} ({ucx}; transport=nixl uses "
          f"{nixl.BACKEND})")
    lib = nixl.library()
    print(f"nixl C API: {lib} (the core drives NIXL through it)" if lib else
          f"nixl C API: {nixl.CAPI} not found beside {module}: the core cannot use NIXL")
    from datadist.core.options import parse_options

    try:
        parsed = parse_options({})
        serve = bool(parsed["datadist.NixlServe"][0])
        whole = bool(parsed["datadist.NixlAllowWholeProcessAccess"][0])
    except Exception as e:  # noqa: BLE001 - report, do not crash
        print(f"nixl serving: cannot tell ({e})")
        return
    print("nixl serving: " + ("on" if serve else "off") +
          " (datadist.NixlServe, or its variable: options above; needs "
          "enable_remote_cache_accessible)")
    unchecked = nixl.unchecked_transports()
    print("nixl transports: " + (
        "RDMA verbs only (UCX_TLS): memory keys checked by the NIC, but UCX's software RMA "
        "still answers any address" if unchecked is None else f"keys UNCHECKED ({unchecked})")
        + ": a NIXL peer can reach the whole process; serving NIXL is "
        + ("ALLOWED (datadist.NixlAllowWholeProcessAccess)" if whole else
           "refused unless datadist.NixlAllowWholeProcessAccess is set"))


def add_parser(sub: Any) -> None:
    """The ``info`` subcommand's options."""
    info = sub.add_parser("info", help="what datadist can do on this host; with --peer, which "
                                       "data path a pull from that PROMPT takes, and why",
                          description="Print what datadist can do on this host: its version, "
                          "the native core, the data paths (cross-memory attach, TCP, NIXL) and "
                          "the settings taken from the environment. With --peer, also link to a "
                          "running PROMPT as a DECODER here would, then print the data path a "
                          "pull from it takes, why, and the PROMPT's transfer counters.")
    info.add_argument("--peer", metavar="IP:PORT",
                      help="the running PROMPT's address, as its LLMConfig.listen_ip_info gives "
                           "it ([IPv6]:PORT for IPv6)")
    info.add_argument("--cluster-id", type=count(0, 2**64 - 1), default=1,
                      help="that PROMPT's cluster id (default 1); a wrong id fails the link")
    info.add_argument("--own-id", type=count(0, 2**64 - 1), default=2**63 - 1,
                      help="the cluster id this check links as (default 2**63-1, an id no "
                           "real peer uses)")
    info.add_argument("--timeout", type=float, default=3.0,
                      help="seconds allowed for each step: the link, the path check, the "
                           "counters (default 3)")
    info.add_argument("--transport", choices=["auto", "tcp", "cma", "shm", "nixl"],
                      help="check this data path instead of the one datadist would pick "
                           "(default: DATADIST_TRANSPORT if set, else auto)")
    info.set_defaults(fn=cmd_info)
