"""Finding the NIXL wheel: is it installed, and which of UCX's transports would carry it.

Who calls: the engine (:mod:`datadist.core.native`: ``load_nixl`` hands the installed wheel's C API
library, found by :func:`library`, to the core, which drives NIXL itself, without the GIL),
``datadist info`` and the bench (is NIXL here, which backends, does UCX check memory keys),
and test tools that act as raw NIXL peers (:mod:`datadist.testing.nixl_peer`). NIXL comes
with the ``datadist[nixl]`` extra (the ``nixl-cu12`` wheel, module ``nixl_cu12``). Nothing
here moves bytes or blocks, except :func:`plugins`, which creates a throwaway agent.

The NIXL path itself (control plane, grants, leases, revocation, memory kinds) is the core's:
cpp/src/nixl.{h,cc}, docs/protocol.md "NIXL", docs/security.md "The NIXL path".
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import os
from typing import Any

from datadist.core.errors import InvalidArgument

log = logging.getLogger(__name__)

MODULES = ("nixl_cu12", "nixl_cu13", "nixl")  # the wheels' module names, most likely first
BACKEND = "UCX"  # the NIXL backend datadist creates (the core's too)

RDMA_DEVICES = "/sys/class/infiniband"  # where the kernel lists RDMA devices (IB, RoCE, EFA)


def _skip_unusable_ib(devices: str = RDMA_DEVICES) -> bool:
    """Where the RDMA user libraries are installed but the host has no RDMA device, UCX's ib
    module loads, finds nothing, and crashes the process at exit (SIGSEGV after the program's
    last line; measured with nixl-cu12 1.5.1 and Debian's libibverbs1: a bare agent suffices).
    There it is not loaded (``UCX_MODULES=^ib``), unless the user set UCX_MODULES. Returns
    whether it did so. Called before the first agent is made."""
    if "UCX_MODULES" in os.environ:
        return False
    try:
        if os.listdir(devices):
            return False
    except OSError:
        pass  # no such directory: no RDMA device
    os.environ["UCX_MODULES"] = "^ib"
    return True


# UCX transports whose remote accesses the hardware checks against the memory key of a
# registration (InfiniBand / RoCE verbs: the HCA refuses an access outside the region the key
# was made for), and those that serve no remote access at all (local copies). Every other
# transport (tcp, cma, knem, xpmem, sysv / posix shared memory, cuda_ipc, self, "sm", "all",
# any name we do not know) lets the owner's UCX serve a GET or PUT at whatever address the
# initiator names: a peer holding our metadata reaches the whole process.
KEY_CHECKED_TLS = frozenset({
    "ib", "rc", "rc_v", "rc_x", "rc_verbs", "rc_mlx5", "dc", "dc_x", "dc_mlx5",
    "ud", "ud_v", "ud_x", "ud_verbs", "ud_mlx5", "cuda_copy", "rocm_copy", "gdr_copy",
})


def unchecked_transports(environ: Any = None, devices: str | None = None) -> str | None:
    """Why UCX may carry NIXL here over a transport whose memory keys the hardware does not
    check, or None where it cannot: ``UCX_TLS`` is set and names only :data:`KEY_CHECKED_TLS`
    transports, and the host has an RDMA device. Conservative: UCX_TLS unset (UCX then picks
    tcp and shared memory too), an exclusion list (``^...``), or a name we do not know all
    count as unchecked. Never raises; reads the environment (UCX reads UCX_TLS when an
    agent's worker is made, so this is what our agent uses). Called by the engine on every
    NIXL request it serves and when a link chooses NIXL."""
    env = os.environ if environ is None else environ
    raw = env.get("UCX_TLS", "").strip()
    if not raw:
        return "UCX_TLS is not set: UCX may use tcp and shared-memory transports"
    if raw.startswith("^"):
        return f"UCX_TLS={raw} excludes transports instead of naming them"
    names = [t.strip().lower().lstrip("\\") for t in raw.split(",")]
    bad = [t for t in names if t not in KEY_CHECKED_TLS]
    if bad:
        return f"UCX_TLS={raw} names {', '.join(bad)}, whose memory keys nothing checks"
    devices = RDMA_DEVICES if devices is None else devices
    try:
        present = bool(os.listdir(devices))
    except OSError:
        present = False
    if not present:
        return f"no RDMA device on this host ({devices} is empty)"
    return None


CAPI = "libnixl_capi.so"  # NIXL's C API, beside the nixl-cu12 wheel's other libraries


def library() -> str | None:
    """The path of the installed NIXL wheel's C API library (``libnixl_capi.so``), or None
    without one. Looks, without importing NIXL, in the wheel's library folder (meson-python
    puts a wheel's libraries in ``.<module>.mesonpy.libs`` beside the module) and the
    module's own folder. Never raises; returns at once."""
    for name in MODULES:
        with contextlib.suppress(ImportError, ValueError):
            spec = importlib.util.find_spec(name)
            if spec is None or not spec.submodule_search_locations:
                continue
            for where in spec.submodule_search_locations:
                pkg = os.path.abspath(where)
                for folder in (os.path.join(os.path.dirname(pkg), f".{name}.mesonpy.libs"),
                               os.path.join(os.path.dirname(pkg), f"{name}.libs"), pkg):
                    lib = os.path.join(folder, CAPI)
                    if os.path.isfile(lib):
                        return lib
    return None


def load() -> Any:
    """The NIXL module. Raises InvalidArgument (PARAM_INVALID) with what to install."""
    for name in MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        if _skip_unusable_ib():
            log.info("no RDMA device on this host: UCX's ib module is not loaded "
                     "(UCX_MODULES=^ib; set UCX_MODULES to choose yourself)")
        if not os.environ.get("NIXL_LOG_LEVEL"):
            # NIXL logs every agent and backend creation at INFO on stdout: a library's
            # stdout is its user's. NIXL_LOG_LEVEL still wins.
            logging.getLogger("nixl").setLevel(logging.WARNING)
        return mod
    raise InvalidArgument(
        "transport 'nixl' needs NIXL: pip install 'datadist[nixl]' (the nixl-cu12 wheel)"
    )


def available() -> str | None:
    """The importable NIXL module's name, or None. Never raises."""
    for name in MODULES:
        with contextlib.suppress(ImportError, ValueError):
            if importlib.util.find_spec(name) is not None:
                return name
    return None


def plugins() -> list[str]:
    """NIXL's available backend plugins (``datadist info``). Creates a throwaway agent with
    no backend; raises InvalidArgument without NIXL."""
    mod = load()
    cfg = mod.nixl_agent_config(enable_prog_thread=False, backends=[])
    agent = mod.nixl_agent(f"datadist-probe-{os.getpid()}", cfg)
    return list(agent.get_plugin_list())
