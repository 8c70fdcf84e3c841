"""Two-sided links: a small communication domain that every member joins (``LLMDataDist.link``).

Who calls: the facade's ``link`` / ``query_register_mem_status`` / ``unlink``, with members
already resolved to (cluster id, rank, host, port). ``link`` blocks until every member has
joined (or raises LinkFailed at the deadline), as LLM-DataDist's does: its native side holds a
process-wide lock and initialises the HCCL communicator, which returns only when every rank
is in (hicann/hixl src/llm_datadist/link_mgr/comm_link_manager.cc, CommLinkManager::Link).
So links inside one process are serialised: a second ``link`` waits for the first.
``status`` and ``unlink`` never block for long. Thread-safe.

Theory of operation
-------------------
Every member calls ``link`` with the same member list. Each member then, in the calling thread:

1. listens on its own (host, port): the engine's listener when it is that address, else a
   listener this module starts (and shares between comms on the same address);
2. connects to every other member's (host, port), retrying until the peer listens or the
   deadline passes; the connection is made and checked (the peer must be the cluster id the
   member list names) but *not yet* usable for transfers;
3. waits until every other member has connected back (the engine's inbound peers), so that
   both directions are up and the peer has joined too;
4. registers its links with the engine: state OK. Transfers to a member before this point
   find no link (NOT_YET_LINK), as LLM-DataDist promises ("pulls before OK").

Any failure, or the deadline, closes what step 2 opened, forgets the comm and raises
LinkFailed (LLM_LINK_FAILED): no comm id is handed out. Rules:

* a comm id handed out is OK until ``unlink`` removes it; unknown ids are NotLinked
  (LLM_NOT_YET_LINK, as the original's Unlink and QueryRegisterMemStatus);
* a link to a member that already exists (``link_clusters``, another comm) is used as it is
  and is not this comm's to drop: ``unlink`` drops only the links this comm registered.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from datadist.core.address import serves
from datadist.core.errors import (
    AlreadyLinked,
    BrokenLink,
    Busy,
    Closed,
    DatadistError,
    InvalidArgument,
    LinkFailed,
    NotLinked,
    Timeout,
)

if TYPE_CHECKING:
    from datadist._core import PendingLink
    from datadist.core.native import NativeEngine, NativeListener

log = logging.getLogger(__name__)

CONNECT_ATTEMPT = 1.0  # seconds one connection attempt may take
RETRY_INTERVAL = 0.05  # seconds between attempts while a peer is not listening yet
POLL_INTERVAL = 0.02  # seconds between checks for the peers' connections back
UNLINK_TIMEOUT = 1.0  # seconds to tell a peer we leave


class CommState(enum.Enum):
    """Where a communication domain stands: PREPARING until every member joined, then OK or
    FAILED (``reason`` says why)."""

    PREPARING = "preparing"
    OK = "ok"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class Member:
    """One member of a communication domain: its cluster id, rank, and the address it listens on."""

    cluster_id: int
    rank: int
    host: str
    port: int


@dataclass(eq=False)
class Comm:
    """One communication domain made by ``link``: its members, state and the links it opened."""

    comm_id: int
    name: str
    me: Member
    peers: list[Member]
    deadline: float
    state: CommState = CommState.PREPARING
    reason: str = ""
    opened: dict[int, PendingLink] = field(default_factory=dict)  # open, not yet filed
    owned: set[int] = field(default_factory=set)  # links this comm registered
    listener: tuple[str, int] | None = None
    cancel: threading.Event = field(default_factory=threading.Event)

    def __repr__(self) -> str:
        return (f"<Comm {self.comm_id} {self.name!r} rank={self.me.rank} "
                f"peers={[m.cluster_id for m in self.peers]} {self.state.value}"
                f"{': ' + self.reason if self.reason else ''}>")


class CommManager:
    """The comms of one engine. Created lazily by the facade; ``close`` at finalize."""

    def __init__(self, engine: NativeEngine) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._comms: dict[int, Comm] = {}
        self._listeners: dict[tuple[str, int], list[Any]] = {}  # addr -> [NativeListener, users]
        self._link_lock = threading.Lock()  # one link at a time in a process
        self._closed = False

    # ------------------------------------------------------------------ public

    def link(self, name: str, me: Member, peers: list[Member], timeout: float) -> int:
        """Join; blocks until every member has joined, then returns the comm id (state OK).

        Waits first for a link of this process still in progress (one at a time). Raises
        LinkFailed when the members do not all join within ``timeout`` seconds (counted from
        the call), AlreadyLinked when ``name`` is live, InvalidArgument when a member is
        ourselves twice, Closed after ``close``.
        """
        if any(m.cluster_id == me.cluster_id for m in peers):
            raise InvalidArgument(f"cluster {me.cluster_id} is listed twice")
        deadline = time.monotonic() + timeout
        if not self._link_lock.acquire(timeout=max(0.0, timeout)):
            raise LinkFailed(f"comm {name!r}: another link of this process took the whole "
                             "link time")
        try:
            with self._lock:
                if self._closed:
                    raise Closed("the engine is finalized")
                if any(c.name == name for c in self._comms.values()):
                    raise AlreadyLinked(f"comm {name!r} is already linked")
                comm = Comm(next(self._ids), name, me, list(peers), deadline)
                self._comms[comm.comm_id] = comm
            try:
                self._join(comm)
            except DatadistError as e:
                with self._lock:
                    self._comms.pop(comm.comm_id, None)
                for link in comm.opened.values():
                    link.close()
                comm.opened.clear()
                self._release_listener(comm)
                if isinstance(e, Closed):
                    raise
                log.warning("comm %r failed: %s", name, e)
                raise LinkFailed(f"comm {name!r}: {e}") from e
            comm.state = CommState.OK
            log.debug("comm.complete %r", comm)
            return comm.comm_id
        finally:
            self._link_lock.release()

    def status(self, comm_id: int) -> CommState:
        return self._get(comm_id).state

    def describe(self, comm_id: int) -> Comm:
        return self._get(comm_id)

    def unlink(self, comm_id: int) -> None:
        """Leave the comm: stop joining, drop the links it registered, stop its listener."""
        comm = self._get(comm_id)
        with self._lock:
            self._comms.pop(comm_id, None)
        self._leave(comm, tell_peers=True)

    def close(self) -> None:
        """Leave every comm without telling peers (finalize). Idempotent."""
        with self._lock:
            self._closed = True
            comms = list(self._comms.values())
            self._comms.clear()
        for comm in comms:
            self._leave(comm, tell_peers=False)
        with self._lock:
            listeners = [entry[0] for entry in self._listeners.values()]
            self._listeners.clear()
        for listener in listeners:
            listener.close()

    # ------------------------------------------------------------------ internals

    def _get(self, comm_id: int) -> Comm:
        with self._lock:
            comm = self._comms.get(comm_id)
        if comm is None:
            raise NotLinked(f"comm_id {comm_id} is not a live link")
        return comm

    def _leave(self, comm: Comm, *, tell_peers: bool) -> None:
        comm.cancel.set()
        for link in list(comm.opened.values()):
            link.close()
        comm.opened.clear()
        for cid in sorted(comm.owned):
            try:
                self.engine.unlink(cid, UNLINK_TIMEOUT, force=not tell_peers)
            except NotLinked:
                pass
            except Busy:
                # A transfer outlasted the polite unlink: unlink(comm_id) must still end the
                # link, so close our end (the transfer fails with LLM_LINK_FAILED).
                with contextlib.suppress(NotLinked):
                    self.engine.unlink(cid, 0, force=True)
            except DatadistError as e:  # the peer may be gone already; our end is closed
                log.info("comm %d: unlink of cluster %d: %s", comm.comm_id, cid, e)
        comm.owned.clear()
        self._release_listener(comm)

    def _acquire_listener(self, comm: Comm) -> None:
        host, port = comm.me.host, comm.me.port
        own = self.engine.listener
        if own is not None and own.port == port and serves(own.host, host):
            return  # the engine already serves this address
        with self._lock:
            entry = self._listeners.get((host, port))
            if entry is not None:
                entry[1] += 1
                comm.listener = (host, port)
                return
        listener: NativeListener | None = self.engine.make_listener(host, port)
        # (LinkFailed above if the port is taken)
        with self._lock:
            entry = self._listeners.get((host, port))
            if entry is None:
                self._listeners[(host, port)] = [listener, 1]
                listener = None  # kept
            else:  # raced with another comm on the same address
                entry[1] += 1
            comm.listener = (host, port)
        if listener is not None:
            listener.close()

    def _release_listener(self, comm: Comm) -> None:
        if comm.listener is None:
            return
        with self._lock:
            entry = self._listeners.get(comm.listener)
            comm.listener = None
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] > 0:
                return
            del self._listeners[(entry[0].host, entry[0].port)]
        entry[0].close()

    def _left(self, comm: Comm) -> float:
        if comm.cancel.is_set():
            raise Closed("unlinked")
        left = comm.deadline - time.monotonic()
        if left <= 0:
            raise Timeout(f"comm {comm.name!r} did not come up before the link deadline")
        return left

    def _join(self, comm: Comm) -> None:
        engine = self.engine
        # A peer counts as joined once it has connected to us: it is connected now, was at
        # the start, or has said Hello since (it may finish, pull and unlink between two of
        # our polls: it can only finish after we connected to it).
        hellos = {m.cluster_id: engine.hello_count(m.cluster_id) for m in comm.peers}
        joined = {p.cluster_id for p in engine.inbound_peers()}
        self._acquire_listener(comm)
        pending = {m.cluster_id: m for m in comm.peers}
        last_error: DatadistError | None = None
        while pending:  # step 2: connect to every peer (they may start listening late)
            for cid, m in list(pending.items()):
                left = self._left(comm)
                if any(link.cluster_id == cid for link in engine.links()):
                    del pending[cid]  # linked already: use it, not ours to drop
                    continue
                try:
                    # Every member connects to every other: no reverse channels needed.
                    comm.opened[cid] = engine.open_link(cid, m.host, m.port,
                                                        min(CONNECT_ATTEMPT, left),
                                                        reverse=False)
                    del pending[cid]
                except (LinkFailed, Timeout, BrokenLink) as e:
                    last_error = e
            if pending and comm.cancel.wait(RETRY_INTERVAL):
                raise Closed("unlinked")
            if pending and time.monotonic() >= comm.deadline:
                raise Timeout(f"members {sorted(pending)} not reachable: {last_error}")
        want = {m.cluster_id for m in comm.peers}
        while True:  # step 3: every peer connected back
            joined |= {p.cluster_id for p in engine.inbound_peers()}
            joined |= {cid for cid in want if engine.hello_count(cid) != hellos[cid]}
            missing = want - joined
            if not missing:
                break
            self._left(comm)
            if comm.cancel.wait(POLL_INTERVAL):
                raise Closed("unlinked")
        for cid, link in list(comm.opened.items()):  # step 4: usable now
            try:
                engine.adopt_link(link)
                comm.owned.add(cid)
            except AlreadyLinked:
                link.close()  # someone linked meanwhile: theirs serves
            del comm.opened[cid]


__all__ = ["Comm", "CommManager", "CommState", "Member"]
