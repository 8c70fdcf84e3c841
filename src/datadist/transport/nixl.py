"""NIXL: an optional data path through the field's transfer engine (UCX and its backends).

Imported only when the NIXL path is chosen (``transport = "nixl"``, ``datadist.Transport``,
``DATADIST_TRANSPORT``); NIXL itself comes with the ``datadist[nixl]`` extra (the
``nixl-cu12`` wheel, module ``nixl_cu12``).

datadist keeps its own control plane: keys, bounds, leases, deadlines and errors travel on the
link's control channel (docs/protocol.md, "NIXL"); only the bytes move through NIXL, as one
READ per pull. Pulls by cache id or blocks key read under a lease on the whole cache, which
the owner revokes on the reader's reverse channel (NixlPath.revoke) before the memory goes:
no control message per pull.

Who calls:

* the engine owns one :class:`NixlAgent` (created at init, closed at finalize), registers its
  pools and remote-accessible caches with it once, and, as an owner that consents to serve
  NIXL (``Engine.nixl_refusal``: an option, remote cache access, and, on transports whose
  memory keys nothing checks (:func:`unchecked_transports`), the whole-process allowance),
  answers NixlMdRequest and NixlRead with it (:meth:`NixlAgent.metadata`,
  :meth:`NixlAgent.grant_info`);
* a link forced to NIXL reads through a :class:`NixlPath` under the link's lock.

Progress: the agent has no progress thread (NIXL's spins a core even when idle). The reader
drives its own transfer while it waits for it; the owner drives its agent from a pump thread
that sleeps on a condition while no NIXL lease is open (between NixlGrant and Release, or
while a reader holds a lease on a whole cache), beats
fast while a new connection's first read is under way and slowly otherwise (PUMP_FAST,
PUMP_SLOW). Each progress call holds the owner's GIL, which is why the beat is not faster.

Memory: host memory is NIXL DRAM. Device-placed caches whose addresses are CUDA memory (a
``cudaPointerGetAttributes`` query) are NIXL VRAM with their device id, per NIXL's contract;
there is no GPU where this was written, so that branch is untested.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import importlib
import logging
import math
import os
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from datadist.core.errors import (
    BrokenLink,
    CacheNotFound,
    InvalidArgument,
    LinkFailed,
    NotSupported,
    RemoteProtocolError,
    Timeout,
)
from datadist.core.layout import Geometry
from datadist.core.prepared import KEPT, SMALL_REQUEST, Prepared
from datadist.core.registry import check_read
from datadist.transport.base import TransportCaps
from datadist.transport.iov import crc_iov, iov_nbytes, iovecs
from datadist.wire import protocol as p

log = logging.getLogger(__name__)

MODULES = ("nixl_cu12", "nixl_cu13", "nixl")  # the wheels' module names, most likely first
BACKEND = "UCX"
# Seconds between two progress calls of the owner's pump: fast while a lease of a connection
# that has not completed a NIXL read yet is open (UCX wires the endpoint up then, which needs
# the owner), slow otherwise (measured: once wired up, UCX reads complete without the owner;
# the slow beat only keeps UCX's housekeeping going). Idle (no lease open): no beat at all.
PUMP_FAST = 50e-6
PUMP_SLOW = 2e-3
HANDLE_CACHE = 32  # prepared transfer handles kept per link, for repeated identical pulls
# NixlRevokes a reader keeps for a lease it has not been told of yet: only while a NixlLease
# of its own is in flight on the link (its NixlLeased may come after the owner revoked it),
# and at most this many; forgotten once that answer came.
MAX_EARLY_REVOKES = 16
PEER_CHECK_EVERY = 64  # polls of a transfer between two looks at the control channel
_KIND = {p.MEM_DRAM: "DRAM", p.MEM_VRAM: "VRAM"}


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


SOFTWARE_RMA = ("UCX's software RMA emulation (ucp/rma/rma_sw.c) serves a PUT or GET at any "
                "address a peer names, with no key, on every transport that carries active "
                "messages, RDMA verbs included")


def whole_process_reach(environ: Any = None, devices: str | None = None) -> str:
    """How a NIXL peer of this process could reach memory that was never registered: over a
    key-unchecked transport (:func:`unchecked_transports`) with stock UCX, else, on RDMA verbs
    only, through UCX's software RMA emulation with a modified UCX. There is always a way, so
    serving NIXL always needs the whole-process allowance; this says which, for the refusal
    and ``datadist info``. Never raises."""
    return unchecked_transports(environ, devices) or SOFTWARE_RMA


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
    import importlib.util

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


# ----------------------------------------------------------------------------- memory kinds


class _CudaPointerAttributes(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("device", ctypes.c_int),
                ("devicePointer", ctypes.c_void_p), ("hostPointer", ctypes.c_void_p)]


_cudart: Any = None


def cuda_runtime() -> Any:
    """The CUDA runtime library (loaded once), or None where there is none. Device-placed
    caches are asked of it (:func:`memory_kind`); core/native.py's ``refusal`` keeps NIXL
    configurations on this engine where it sees a GPU (:func:`cuda_devices`), the core's
    NIXL being host memory only."""
    global _cudart
    if _cudart is None:
        _cudart = False
        for lib in ("libcudart.so", "libcudart.so.12", "libcudart.so.13"):
            with contextlib.suppress(OSError):
                _cudart = ctypes.CDLL(lib)
                break
    return _cudart or None


def cuda_devices() -> int:
    """How many CUDA devices this process sees (0 without a runtime or a GPU)."""
    rt = cuda_runtime()
    if rt is None:
        return 0
    n = ctypes.c_int(0)
    if rt.cudaGetDeviceCount(ctypes.byref(n)) != 0:
        rt.cudaGetLastError()
        return 0
    return n.value


def _cuda_device(addr: int) -> int | None:
    """The CUDA device ``addr`` lies on, or None for host memory (or no CUDA runtime)."""
    if cuda_runtime() is None:
        return None
    attrs = _CudaPointerAttributes()
    if _cudart.cudaPointerGetAttributes(ctypes.byref(attrs), ctypes.c_void_p(addr)) != 0:
        _cudart.cudaGetLastError()
        return None
    return attrs.device if attrs.type in (2, 3) else None  # cudaMemoryTypeDevice, Managed


def memory_kind(addr: int, device_placement: bool) -> tuple[int, int]:
    """(MEM_DRAM or MEM_VRAM, device id) of a cache's memory. Only device-placed caches are
    asked of CUDA; host placement is always DRAM."""
    if device_placement:
        dev = _cuda_device(addr)
        if dev is not None:
            return p.MEM_VRAM, dev
    return p.MEM_DRAM, 0


# ----------------------------------------------------------------------------- the agent


class NixlAgent:
    """One NIXL agent per engine. Thread-safe (NIXL in strict sync mode, plus our lock)."""

    def __init__(self, cluster_id: int) -> None:
        mod = load()
        cfg = mod.nixl_agent_config(
            enable_prog_thread=False, enable_listen_thread=False, backends=[BACKEND],
            sync_mode=mod.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        self.name = f"datadist-{cluster_id}-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            self.agent = mod.nixl_agent(self.name, cfg)
        except Exception as e:  # NIXL raises its own types
            raise NotSupported(f"cannot create a NIXL agent: {e}") from e
        if BACKEND not in self.agent.backends:
            raise NotSupported(f"NIXL has no {BACKEND} backend here "
                               f"(plugins: {self.agent.get_plugin_list()})")
        self.generation = 1
        self._lock = threading.Lock()
        self._regions: dict[object, tuple[Any, np.ndarray, int, int]] = {}
        self._starts: list[tuple[int, int, int, int]] = []  # (addr, end, mem, dev), sorted
        self._private: set[object] = set()  # keys of private registrations: no metadata
        self._remote: dict[str, int] = {}  # loaded remote agents -> links using them
        self._pump_users = 0
        self._pump_fresh = 0  # of those, leases of connections without a completed read
        self._pump_cv = threading.Condition(self._lock)
        self._pump: threading.Thread | None = None
        self._stuck: list[Any] = []  # handles NIXL could not release yet
        self.no_leases: set[str] = set()  # remote agents that know no NixlLease (older)
        self._closed = False

    def __repr__(self) -> str:
        return (f"<NixlAgent {self.name} regions={len(self._regions)} "
                f"remotes={len(self._remote)} gen={self.generation}>")

    @property
    def backends(self) -> list[str]:
        return list(self.agent.backends)

    # -------------------------------------------------------------- registration

    def register(self, key: object, addrs: np.ndarray, nbytes: int, mem: int, dev: int,
                 private: bool = False) -> None:
        """Register ``len(addrs)`` regions of ``nbytes`` each under ``key`` (a cache id, a
        pool). Called by the engine once per cache; raises NotSupported if NIXL refuses.
        ``private``: memory no peer may reach (a reader's private destination): while one is
        registered, :meth:`metadata` refuses."""
        if key in self._regions:
            return
        arr = np.empty((len(addrs), 3), dtype=np.uint64)
        arr[:, 0] = addrs
        arr[:, 1] = nbytes
        arr[:, 2] = dev
        try:
            reg = self.agent.register_memory(arr, _KIND[mem])
        except Exception as e:
            raise NotSupported(f"NIXL cannot register {_KIND[mem]} memory: {e}") from e
        with self._lock:
            self._regions[key] = (reg, arr, mem, dev)
            if private:
                self._private.add(key)
            for a in addrs.tolist():
                bisect.insort(self._starts, (a, a + nbytes, mem, dev))
            self.generation += 1

    def deregister(self, key: object) -> None:
        """Forget what ``register(key, ...)`` registered. Unknown keys: no-op. The engine
        calls it once no lease uses the memory any more."""
        with self._lock:
            got = self._regions.pop(key, None)
            self._private.discard(key)
            if got is None:
                return
            reg, arr, mem, dev = got
            n = int(arr[0, 1]) if len(arr) else 0
            for a in arr[:, 0].tolist():
                with contextlib.suppress(ValueError):
                    self._starts.remove((a, a + n, mem, dev))
            self.generation += 1
        try:
            self.agent.deregister_memory(reg)
        except Exception as e:  # pragma: no cover - NIXL refuses only on a bad list
            log.warning("NIXL deregistration of %r failed: %s", key, e)

    def kind_of(self, addr: int, nbytes: int) -> tuple[int, int] | None:
        """(mem, dev) of the registered region holding [addr, addr + nbytes), else None."""
        with self._lock:
            i = bisect.bisect_right(self._starts, (addr, math.inf))
            for _start, end, mem, dev in reversed(self._starts[max(0, i - 8):i]):
                if addr + nbytes <= end:
                    return mem, dev
        return None

    # -------------------------------------------------------------- owner side

    def metadata(self) -> p.NixlMd:
        """Our metadata for a reader (NixlMdRequest). NotSupported while a private region is
        registered: the metadata carries every registration's address and key."""
        with self._lock:
            if self._private:
                raise NotSupported("this process registered private memory with NIXL: it "
                                   "hands its NIXL metadata to no one")
            gen = self.generation
        return p.NixlMd(self.name.encode(), gen, bytes(self.agent.get_agent_metadata()))

    def grant_info(self, addrs: np.ndarray, nbytes: int) -> tuple[int, int]:
        """(mem, dev) of the tensors ``addrs`` (``nbytes`` each) of a lease; NotSupported if
        one lies outside NIXL-registered memory (nothing is granted then)."""
        found = {self.kind_of(a, nbytes) for a in set(addrs.tolist())}
        kinds = {kind for kind in found if kind is not None}
        if len(found) != 1 or len(kinds) != 1:  # a None among them, or two kinds
            raise NotSupported("the cache is not registered with NIXL on the owner")
        return kinds.pop()

    def pump_acquire(self, fresh: bool) -> None:
        """A NIXL lease opened: keep the agent progressing until pump_release. ``fresh``:
        its connection has not completed a NIXL read yet (the endpoint is being wired up)."""
        with self._pump_cv:
            self._pump_users += 1
            self._pump_fresh += int(fresh)
            if self._pump is None and not self._closed:
                self._pump = threading.Thread(target=self._run_pump, daemon=True,
                                              name="datadist-nixl-pump")
                self._pump.start()
            self._pump_cv.notify()

    def pump_release(self, fresh: bool) -> None:
        with self._pump_cv:
            self._pump_users = max(0, self._pump_users - 1)
            self._pump_fresh = max(0, self._pump_fresh - int(fresh))

    @property
    def pump_busy(self) -> bool:
        """True while a lease keeps the pump beating (tests, ``datadist info``)."""
        with self._lock:
            return bool(self._pump_users)

    def _run_pump(self) -> None:
        while True:
            with self._pump_cv:
                while not self._pump_users and not self._closed:
                    self._pump_cv.wait()  # idle: no lease, no beat, no CPU
                if self._closed:
                    return
                beat = PUMP_FAST if self._pump_fresh else PUMP_SLOW
            try:
                self.agent.get_new_notifs()  # progresses every backend's worker
            except Exception as e:  # pragma: no cover
                log.debug("NIXL progress failed: %s", e)
            time.sleep(beat)

    # -------------------------------------------------------------- reader side

    def add_remote(self, md: p.NixlMd) -> str:
        """Load (or reload) a peer's metadata; returns its agent name."""
        try:
            name = self.agent.add_remote_agent(md.metadata)
        except Exception as e:
            raise LinkFailed(f"NIXL refused the peer's metadata: {e}") from e
        name = name.decode() if isinstance(name, bytes) else str(name)
        if name != md.agent.decode(errors="replace"):
            raise RemoteProtocolError(f"NIXL metadata names agent {name!r}, not {md.agent!r}")
        with self._lock:
            self._remote[name] = self._remote.get(name, 0) + 1
        return name

    def drop_remote(self, name: str) -> None:
        with self._lock:
            left = self._remote.get(name, 0) - 1
            if left > 0:
                self._remote[name] = left
                return
            self._remote.pop(name, None)
        with contextlib.suppress(Exception):
            self.agent.remove_remote_agent(name)

    def make_xfer(self, op: str, remote: str, local: np.ndarray, src: np.ndarray,
                  src_mem: int, src_dev: int) -> Any:
        """A READ (or WRITE) handle between local spans ``local`` (registered here) and the
        peer's spans ``src``; both (n, 2) iovs of equal lengths."""
        kind = self.kind_of(int(local[0, 0]), int(local[0, 1])) if len(local) else None
        if kind is None:
            raise InvalidArgument("the destination cache is not registered with NIXL")
        mem, dev = kind
        ld = np.empty((len(local), 3), dtype=np.uint64)
        ld[:, :2] = local
        ld[:, 2] = dev
        rd = np.empty((len(src), 3), dtype=np.uint64)
        rd[:, :2] = src
        rd[:, 2] = src_dev
        a = self.agent
        try:
            return a.initialize_xfer(op, a.get_xfer_descs(ld, _KIND[mem]),
                                     a.get_xfer_descs(rd, _KIND[src_mem]), remote)
        except Exception as e:
            raise LinkFailed(f"NIXL cannot prepare the {op}: {e}") from e

    def run(self, handle: Any, deadline: float, peer_gone: Any) -> None:
        """Post ``handle`` and drive it to completion. Raises Timeout past ``deadline``,
        BrokenLink when NIXL reports an error or ``peer_gone()`` turns true; the handle is
        then released (the caller must not reuse it)."""
        a = self.agent
        try:
            state = a.transfer(handle)
        except Exception as e:
            self.release(handle)
            raise BrokenLink(f"NIXL could not post the transfer: {e}") from e
        polls = 0
        while state == "PROC":
            polls += 1
            if polls % PEER_CHECK_EVERY == 0:
                if time.monotonic() > deadline:
                    self.release(handle)
                    raise Timeout("NIXL transfer did not complete before the deadline")
                if peer_gone():
                    self.release(handle)
                    raise BrokenLink("the owner went away during a NIXL transfer")
            try:
                state = a.check_xfer_state(handle)
            except Exception as e:
                self.release(handle)
                raise BrokenLink(f"NIXL transfer failed: {e}") from e
        if state != "DONE":
            self.release(handle)
            raise BrokenLink("NIXL transfer failed (transfer state ERR)")

    def release(self, handle: Any) -> None:
        """Release a transfer handle; one NIXL cannot cancel yet is retried at close."""
        try:
            handle.release()
        except Exception as e:
            log.warning("NIXL could not release a transfer handle yet (%s); kept", e)
            with self._lock:
                self._stuck.append(handle)

    def close(self) -> None:
        """Stop the pump, release what is left, deregister everything. Idempotent."""
        with self._pump_cv:
            if self._closed:
                return
            self._closed = True
            pump, stuck, keys = self._pump, list(self._stuck), list(self._regions)
            self._stuck.clear()
            self._pump_cv.notify_all()
        if pump is not None:
            pump.join(1.0)
        for h in stuck:
            with contextlib.suppress(Exception):
                h.release()
        for key in keys:
            self.deregister(key)


# ----------------------------------------------------------------------------- the path


@dataclass(eq=False)
class _ReadLease:
    """A lease on a whole remote cache (NixlLeased), as the reader holds it: reads under it
    need no request until the owner revokes it (NixlPath.revoke)."""

    info: p.NixlLeased
    key: tuple[int, int]  # (key kind, cache id or blocks model id)
    reading: int = 0  # reads under it in flight
    revoked: bool = False


def _leased_bases(info: p.NixlLeased, msg: p.Read) -> np.ndarray:
    """The source base of each requested tensor under a lease, after the owner's checks of a
    NixlRead (core/registry.py, check_read) made against the lease's geometry. Raises
    InvalidArgument."""
    try:
        g = Geometry(len(info.addrs), info.tensor_bytes, info.units, info.blocks, info.layout)
    except InvalidArgument as e:
        raise RemoteProtocolError(f"a NIXL lease with an impossible geometry: {e}") from None
    base = check_read(g, None, -1 if info.blocks else msg.key.b, msg.unit_bytes, msg.tensors,
                      msg.offsets, msg.lengths, msg.layout, bool(msg.flags & p.ReadFlags.WHOLE))
    bases: np.ndarray = info.addrs[msg.tensors] + np.uint64(base)
    return bases


class NixlPath:
    """The client side of a link forced to NIXL. Used under the link's lock.

    A pull by cache id or blocks key reads under a lease on the whole remote cache
    (NixlLease -> NixlLeased, asked once per cache and connection): no request per pull, the
    bounds checked here against the lease's geometry, one NIXL READ. The owner revokes the
    lease on our reverse channel (:meth:`revoke`) before its memory goes. Other pulls (by
    request key, with a checksum, the first of a connection, or where the owner grants no
    lease) are one exchange on the control channel (NixlRead -> NixlGrant: the owner resolved
    the key and checked the bounds), one NIXL READ from the granted spans, and a Release.
    The peer's metadata is loaded at link time and reloaded when a grant or lease shows a
    newer generation or another agent (the peer restarted). Handles for identical reads are
    kept (up to HANDLE_CACHE) and reposted.
    """

    caps = TransportCaps("nixl", same_host_only=False, one_sided=True, device_memory=True)

    def __init__(self, agent: NixlAgent) -> None:
        self.agent = agent
        self.remote: str | None = None
        self.generation = -1
        self._handles: OrderedDict[tuple[str, str, int, int, bytes, bytes], Any] = OrderedDict()
        self._wired = False  # a NIXL read completed on this connection (the endpoint is up)
        self._lease_ok = True  # False once the owner refused a lease on this connection
        self._cv = threading.Condition()  # guards the leases below (revoke comes from elsewhere)
        self._leases: dict[tuple[int, int], _ReadLease] = {}
        self._lease_ids: dict[int, _ReadLease] = {}
        # revoked before their NixlLeased was read: kept only while we ask for a lease
        self._revoked_early: set[int] = set()
        self._asking = False  # a NixlLease of ours is in flight
        # checked source spans of small reads under a lease, by lease and request
        self._sources: Prepared[np.ndarray] = Prepared(KEPT, len)

    def __repr__(self) -> str:
        return (f"<NixlPath remote={self.remote} gen={self.generation} "
                f"leases={len(self._leases)}>")

    def connect(self, chan: Any, deadline: float) -> None:
        """Fetch and load the owner's metadata (link time, and when it changed)."""
        md = chan.call(p.NixlMdRequest(), deadline)
        if not isinstance(md, p.NixlMd):
            chan.close()
            raise RemoteProtocolError(f"expected NixlMd, got {type(md).__name__}")
        name = self.agent.add_remote(md)
        if self.remote is not None:
            self._forget()
            self.agent.drop_remote(self.remote)
        self.remote, self.generation = name, md.generation

    def read(self, chan: Any, msg: p.Read, local: np.ndarray, deadline: float) -> None:
        lease = self._lease(chan, msg, deadline)
        if lease is not None:
            with self._cv:
                usable = not lease.revoked
                lease.reading += usable
            if usable:
                try:
                    self._read_leased(chan, lease, msg, local, deadline)
                    return
                finally:
                    with self._cv:
                        lease.reading -= 1
                        self._cv.notify_all()
        self._read_granted(chan, msg, local, deadline)
        self._wired = True

    def _lease(self, chan: Any, msg: p.Read, deadline: float) -> _ReadLease | None:
        """The lease to read ``msg`` under, asked for if need be; None: read by request."""
        k = msg.key
        if (not self._wired or not self._lease_ok or msg.flags & p.ReadFlags.CHECKSUM
                or k.kind not in (p.KeyKind.CACHE_ID, p.KeyKind.BLOCKS_KEY)
                or self.remote in self.agent.no_leases):
            return None
        key = (int(k.kind), k.a if k.kind == p.KeyKind.CACHE_ID else k.b)
        with self._cv:
            lease = self._leases.get(key)
            if lease is not None and not lease.revoked:
                return lease
            self._leases.pop(key, None)
        req = p.NixlLease(p.KeyRef(k.kind, k.a, 0, 0) if k.kind == p.KeyKind.CACHE_ID
                          else p.KeyRef(k.kind, 0, k.b, 0),
                          msg.unit_bytes if k.kind == p.KeyKind.BLOCKS_KEY else 0)
        with self._cv:
            self._asking = True
            self._revoked_early.clear()
        try:
            return self._ask_lease(chan, req, key, deadline)
        finally:
            with self._cv:  # revokes of ids we were not told of are forgotten from here on
                self._asking = False
                self._revoked_early.clear()

    def _ask_lease(self, chan: Any, req: p.NixlLease, key: tuple[int, int],
                   deadline: float) -> _ReadLease | None:
        """One NixlLease exchange (while ``_asking``: revokes of unknown ids are kept)."""
        try:
            info = chan.call(req, deadline)
        except (NotSupported, CacheNotFound) as e:
            # No reverse channel at the owner, memory not registered with NIXL, or the cache
            # is going: a request says what holds (and fails as it would on any path).
            self._lease_ok = not isinstance(e, NotSupported)
            return None
        except RemoteProtocolError:
            # An owner of an earlier version (NIXL without leases) answers with an error
            # and closes: this pull fails, the link reconnects and reads by request.
            if self.remote is not None:
                self.agent.no_leases.add(self.remote)
            raise
        if not isinstance(info, p.NixlLeased) or not len(info.addrs):
            chan.close()
            raise RemoteProtocolError(f"expected a NixlLeased, got {info!r}")
        self._refresh(chan, info.agent, info.generation, deadline)
        lease = _ReadLease(info, key)
        with self._cv:
            if info.lease_id in self._revoked_early:  # revoked while on its way
                return None
            self._leases[key] = lease
            self._lease_ids[info.lease_id] = lease
        return lease

    def _read_leased(self, chan: Any, lease: _ReadLease, msg: p.Read, local: np.ndarray,
                     deadline: float) -> None:
        info = lease.info

        def source() -> np.ndarray:
            iov = iovecs(_leased_bases(info, msg), msg.offsets, msg.lengths)
            iov.flags.writeable = False  # kept: never edited
            return iov

        if len(msg.tensors) * len(msg.lengths) <= SMALL_REQUEST:  # checked once, then kept
            src = self._sources.get((lease, msg.key.b, msg.unit_bytes, msg.layout,
                                     msg.tensors.tobytes(), msg.offsets.tobytes(),
                                     msg.lengths.tobytes()), source)
        else:
            src = source()
        if iov_nbytes(src) != iov_nbytes(local):
            raise InvalidArgument("the destination spans do not match the source spans")
        try:
            self._xfer("READ", chan, local, src, info.mem, info.device, deadline)
            if time.monotonic() > deadline:  # NIXL may copy within the post (UCX cma)
                raise Timeout("the NIXL read under the lease ended past the deadline")
            if chan.peer_gone():
                # The owner shut the connection down: it gave up waiting for us to give a
                # revoked lease back, and may have reused the memory we just read.
                raise BrokenLink("the owner dropped the connection during a leased NIXL read")
        except BaseException:
            chan.close()  # the owner drops our leases with it; the link reconnects
            raise

    def revoke(self, lease_id: int, wait: float) -> bool:
        """The owner revokes ``lease_id`` (NixlRevoke, on our reverse channel): no read under
        it starts any more. Returns False if one is still in flight after ``wait`` s."""
        end = time.monotonic() + wait
        with self._cv:
            lease = self._lease_ids.pop(lease_id, None)
            if lease is None:
                # Its NixlLeased may still be on its way: remembered only while we wait for
                # one, and boundedly (a revoke of an id we never asked for changes nothing).
                if self._asking and len(self._revoked_early) < MAX_EARLY_REVOKES:
                    self._revoked_early.add(lease_id)
                return True
            lease.revoked = True
            if self._leases.get(lease.key) is lease:
                del self._leases[lease.key]
            while lease.reading:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def _read_granted(self, chan: Any, msg: p.Read, local: np.ndarray,
                      deadline: float) -> None:
        flags = msg.flags & (p.ReadFlags.CHECKSUM | p.ReadFlags.WHOLE)
        req = p.NixlRead(msg.key, msg.unit_bytes, flags, msg.tensors, msg.offsets,
                         msg.lengths, msg.layout)
        grant = chan.call(req, deadline)
        if not isinstance(grant, p.NixlGrant) or len(grant.bases) != len(msg.tensors):
            chan.close()
            raise RemoteProtocolError(f"expected a NixlGrant for the request, got {grant!r}")
        ok = False
        try:
            ck = chan.answer(deadline) if flags & p.ReadFlags.CHECKSUM else None
            if ck is not None and not isinstance(ck, p.Checksum):
                chan.close()
                raise RemoteProtocolError(f"expected Checksum, got {type(ck).__name__}")
            self._refresh(chan, grant.agent, grant.generation, deadline)
            src = iovecs(grant.bases, msg.offsets, msg.lengths)
            if iov_nbytes(src) != iov_nbytes(local):
                raise RemoteProtocolError("the grant does not match the request")
            self._xfer("READ", chan, local, src, grant.mem, grant.device, deadline)
            if ck is not None:
                got = crc_iov(local)
                if ck.crc != got or ck.nbytes != iov_nbytes(local):
                    from datadist.core.errors import IntegrityError

                    raise IntegrityError(f"checksum mismatch over NIXL: owner {ck.crc:#010x}, "
                                         f"arrived {got:#010x}")
            ok = True
        finally:
            self._release(chan, grant, ok, deadline)

    def write(self, chan: Any, msg: p.Write, local: np.ndarray, deadline: float) -> None:
        """A push: NixlWrite (the owner checks and leases the destination spans), one NIXL
        WRITE, Release."""
        req = p.NixlWrite(msg.key, msg.unit_bytes, 0, msg.tensors, msg.offsets, msg.lengths,
                          msg.layout)
        grant = chan.call(req, deadline)
        if not isinstance(grant, p.NixlGrant) or len(grant.bases) != len(msg.tensors):
            chan.close()
            raise RemoteProtocolError(f"expected a NixlGrant for the push, got {grant!r}")
        ok = False
        try:
            self._refresh(chan, grant.agent, grant.generation, deadline)
            dst = iovecs(grant.bases, msg.offsets, msg.lengths)
            if iov_nbytes(dst) != iov_nbytes(local):
                raise RemoteProtocolError("the grant does not match the push")
            self._xfer("WRITE", chan, local, dst, grant.mem, grant.device, deadline)
            ok = True
        finally:
            self._release(chan, grant, ok, deadline)

    def _refresh(self, chan: Any, agent: bytes, generation: int, deadline: float) -> None:
        """Reload the owner's metadata when a grant or lease shows another agent or a newer
        generation than the one loaded."""
        if agent.decode(errors="replace") != self.remote or generation > self.generation:
            self.connect(chan, deadline)

    @staticmethod
    def _release(chan: Any, grant: p.NixlGrant, ok: bool, deadline: float) -> None:
        if not chan.closed:
            try:
                chan.send(p.Release(grant.lease_id, ok), deadline)
            except Exception:
                if ok:
                    raise

    def _xfer(self, op: str, chan: Any, local: np.ndarray, remote: np.ndarray, mem: int,
              dev: int, deadline: float) -> None:
        assert self.remote is not None
        # Both sides' registration generations: a handle never outlives the registrations
        # it was made against (a cache unregistered and another registered at its address).
        key = (op, self.remote, self.generation, self.agent.generation, local.tobytes(),
               remote.tobytes())
        handle = self._handles.pop(key, None)
        if handle is None:
            handle = self.agent.make_xfer(op, self.remote, local, remote, mem, dev)
        try:
            self.agent.run(handle, deadline, chan.peer_gone)
        except BaseException:
            self._forget()  # a broken transfer may have broken the connection behind them
            raise
        self._handles[key] = handle
        while len(self._handles) > HANDLE_CACHE:
            self.agent.release(self._handles.popitem(last=False)[1])

    def _forget(self) -> None:
        while self._handles:
            self.agent.release(self._handles.popitem()[1])

    def close(self) -> None:
        """Release the kept handles and the peer's metadata; no read under a lease starts
        any more (the owner drops them with the connection). Idempotent."""
        with self._cv:
            for lease in self._lease_ids.values():
                lease.revoked = True
            self._leases.clear()
            self._lease_ids.clear()
        self._forget()
        if self.remote is not None:
            self.agent.drop_remote(self.remote)
            self.remote = None


__all__ = ["NixlAgent", "NixlPath", "available", "load", "memory_kind", "plugins",
           "unchecked_transports", "whole_process_reach"]
