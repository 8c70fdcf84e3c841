"""The bounded GIL hold of a blocking transfer (cpp/python/gil.h, cpp/src/blocking.h).

``Engine.run`` keeps the interpreter's lock while the core works and gives it up only right
before the core would really wait (a peer's answer not there within a short budget, a link
another transfer holds, a bulk transfer), so a call that ends in microseconds does not wait
up to the switch interval to get the GIL back from a busy thread. What must still hold:

- a leased same-host copy never waits, and so never lets another Python thread run;
- a pull whose owner is slow, or whose every byte goes through Python (a proxy of Python
  threads, which need the GIL to forward), ends: the GIL was released while it waited;
- two Python threads on one link, one waiting for the link the other holds while the owner is
  slow: both end, neither keeps the GIL the other's forwarding needs;
- a dead peer still ends the pull at its deadline (LLM_TIMEOUT), with the GIL released
  meanwhile (another thread ran);
- the calls the bench's busy rows make (CacheManager's pull_blocks / pull_cache, with and
  without layer ranges, and their issued forms waited for) keep the GIL through an answer that
  comes within the budget: an issued pull's ``wait`` too (it let the GIL go at once before).
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

import datadist as llm
from datadist.api.cache_manager import CacheManager
from datadist.core.config import EngineConfig
from datadist.core.errors import Timeout
from datadist.core.layout import Geometry, every_tensor, plan_slot
from datadist.core.native import NativeEngine
from datadist.testing.doubles import BusyCounter
from datadist.wire import protocol as p

BYTES = 16 << 10
HOLD_BYTES = 1 << 20  # gil.h's kHoldBytes: the largest call that keeps the GIL
OWNER_ID, PULLER_ID = 1, 2


class Proxy:
    """A TCP proxy whose bytes go through Python threads (they need the GIL to move
    anything), each chunk (at most ``chunk`` bytes) held ``delay`` seconds first: a small
    chunk makes a slow link, whose time grows with the bytes; ``stalled`` forwards nothing
    more."""

    def __init__(self, target: tuple[str, int], delay: float = 0.0, chunk: int = 1 << 20) -> None:
        self.target = target
        self.delay = delay
        self.chunk = chunk
        self.stalled = False
        self._lsock = socket.socket()
        self._lsock.bind(("127.0.0.1", 0))
        self._lsock.listen(16)
        self._socks: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._lsock.getsockname()
        return host, port

    def _accept(self) -> None:
        while not self._closed:
            try:
                a, _ = self._lsock.accept()
            except OSError:
                return
            b = socket.create_connection(self.target)
            self._socks += [a, b]
            for src, dst in ((a, b), (b, a)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(self.chunk)
                if not data:
                    break
                while self.stalled and not self._closed:
                    time.sleep(0.01)
                if self.delay:
                    time.sleep(self.delay)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._closed = True
        self._lsock.close()
        for s in self._socks:
            s.close()


class Pair:
    """An owner engine with one 16 KiB cache (a pattern) and a puller with its own cache."""

    def __init__(self, transport: str | None, size: int = BYTES) -> None:
        self.owner = NativeEngine(EngineConfig(cluster_id=OWNER_ID, role=1,
                                               listen=("127.0.0.1", 0), sync_timeout=5.0))
        self.puller = NativeEngine(EngineConfig(cluster_id=PULLER_ID, role=2, sync_timeout=5.0,
                                                transport=transport))
        self.src = np.random.default_rng(7).integers(0, 256, size, dtype=np.uint8)
        self.src_entry = self.owner.register(Geometry(1, size, 1), [self.src.ctypes.data],
                                             placement=0)
        self.dst = np.zeros(size, np.uint8)
        self.dst_entry = self.puller.register(Geometry(1, size, 1), [self.dst.ctypes.data],
                                              placement=0)
        self.plan = plan_slot(self.dst_entry.geometry, 0, every_tensor(1))
        self.key = p.KeyRef(p.KeyKind.CACHE_ID, self.src_entry.cache_id, 0)

    def link(self, address: tuple[str, int] | None = None) -> None:
        host, port = address or self.owner.listen_address
        self.puller.link(OWNER_ID, host, port, 5.0)

    def pull(self, timeout: float = 5.0) -> None:
        self.puller.pull(OWNER_ID, self.key, 0, self.plan, self.dst_entry.cache_id, timeout)

    def pulled_right(self) -> bool:
        ok = np.array_equal(self.dst, self.src)
        self.dst.fill(0)
        return ok

    def close(self) -> None:
        self.puller.close()
        self.owner.close()


@pytest.fixture
def make_pair() -> Iterator[Callable[..., Pair]]:
    made: list[Pair] = []

    def make(transport: str | None, size: int = BYTES) -> Pair:
        made.append(Pair(transport, size))
        return made[-1]

    yield make
    for pr in made:
        pr.close()


@pytest.fixture
def stalled_pair(make_pair) -> Iterator[tuple[Pair, Proxy]]:
    """A TCP pair linked through a Python proxy, one pull made right, the proxy then stalled
    (it forwards nothing more until ``stalled`` is False again)."""
    pr = make_pair("tcp")
    proxy = Proxy(pr.owner.listen_address)
    try:
        pr.link(proxy.address)
        pr.pull()
        assert pr.pulled_right()
        proxy.stalled = True
        yield pr, proxy
    finally:
        proxy.stalled = False
        proxy.close()


@pytest.fixture
def switch_interval() -> Iterator[Callable[[float], None]]:
    old = sys.getswitchinterval()
    yield sys.setswitchinterval
    sys.setswitchinterval(old)


def test_a_leased_same_host_pull_never_lets_a_busy_thread_run(make_pair, switch_interval) -> None:
    """Before: every pull released the GIL for its whole duration, so a busy thread ran (and
    the pull waited up to the switch interval to get the GIL back, when the copy outlasted
    the busy thread's wake-up). Now a leased copy of up to 1 MiB (the hold's bound), which
    never waits, keeps the GIL: with a switch interval long enough that the interpreter
    never takes the GIL from us on its own, a busy thread's counter does not move across 50
    pulls."""
    pr = make_pair(None, HOLD_BYTES)
    pr.link()
    pr.pull()
    pr.pull()  # the lease is asked for (a round trip) by the first pulls
    if pr.puller.last_moved(OWNER_ID) not in ("cma", "shm"):
        pytest.skip(f"no same-host lease here: pulls move by {pr.puller.last_moved(OWNER_ID)}")
    assert pr.pulled_right()
    switch_interval(1.0)
    with BusyCounter() as busy:
        time.sleep(0.01)  # the busy thread runs; we get the GIL back by the interval
        assert busy.steps > 0
        before = busy.steps
        for _ in range(50):
            pr.pull()
        after = busy.steps
    assert after == before, f"the busy thread ran {after - before} steps during 50 leased pulls"
    assert pr.pulled_right()


def test_a_small_tcp_pull_keeps_the_gil_through_a_quick_answer(make_pair,
                                                               switch_interval) -> None:
    """Over TCP a pull waits for its owner's answer. With no wait budget (the hold before)
    it gave the GIL up at that wait, every time: a busy thread ran, and the pull then waited
    a whole switch interval to get the GIL back (5 ms by default: on a quiet machine the
    p50 of a 16 KiB TCP pull beside a busy thread was 5.2 ms, against 30-80 us idle). Now
    it keeps the GIL while the answer comes within the budget (gil.h kWaitBudget): with a
    switch interval of 0.1 s, most of 20 pulls end without the busy thread running. (An
    answer later than the budget, on a loaded machine, lets it run: not every pull.)"""
    pr = make_pair("tcp")
    pr.link()
    pr.pull()
    assert pr.puller.last_moved(OWNER_ID) in ("tcp", "stream")  # over the socket, no lease
    assert pr.pulled_right()
    switch_interval(0.1)
    handed = 0
    with BusyCounter() as busy:
        time.sleep(0.01)
        for _ in range(20):
            before = busy.steps
            pr.pull()
            handed += busy.steps != before
    assert handed <= 10, f"{handed} of 20 quick TCP pulls let the busy thread run"
    assert pr.pulled_right()


@pytest.mark.parametrize("delay", [0.0, 0.03])
def test_a_pull_through_python_threads_ends(make_pair, delay: float) -> None:
    """Every byte of the link goes through a proxy of Python threads, which need the GIL to
    forward the answer: a pull that kept the GIL while it waited could never end. With the
    proxy holding each chunk 30 ms (beyond the hold's budget) or not at all."""
    pr = make_pair("tcp")
    proxy = Proxy(pr.owner.listen_address, delay)
    try:
        pr.link(proxy.address)
        for _ in range(5):
            pr.pull(10.0)
            assert pr.pulled_right()
    finally:
        proxy.close()


def test_two_threads_on_one_link_with_a_slow_owner_both_end(make_pair) -> None:
    """Two Python threads pull on one link through a slow proxy of Python threads: one holds
    the link and waits for the owner, the other waits for the link. Neither may keep the GIL
    while it waits (the proxy's forwarding and the other thread need it); both end, every
    pull's bytes right, and a third thread kept running meanwhile."""
    pr = make_pair("tcp")
    proxy = Proxy(pr.owner.listen_address, 0.02)
    errors: list[BaseException] = []

    def puller() -> None:
        try:
            for _ in range(4):
                pr.pull(20.0)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    try:
        pr.link(proxy.address)
        with BusyCounter() as busy:
            threads = [threading.Thread(target=puller) for _ in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert not any(t.is_alive() for t in threads), "a pull never ended"
            steps = busy.steps
        assert not errors, errors
        assert steps > 0
        assert pr.pulled_right()
    finally:
        proxy.close()


def test_a_dead_peer_still_ends_the_pull_at_its_deadline(stalled_pair) -> None:
    """A linked owner that stops answering (the proxy forwards nothing more): the pull fails
    LLM_TIMEOUT at its deadline, and another Python thread ran while it waited."""
    pr, _ = stalled_pair
    with BusyCounter() as busy:
        time.sleep(0.01)
        before = busy.steps
        t0 = time.monotonic()
        with pytest.raises(Timeout):
            pr.pull(0.5)
        took = time.monotonic() - t0
        during = busy.steps - before
    assert 0.4 <= took < 5.0
    assert during > 0, "the GIL was held while the pull waited for a dead peer"


def test_the_destination_is_held_for_a_blocking_pull_in_flight(stalled_pair) -> None:
    """``Engine.run`` holds the call's local cache in the core for the transfer (the driver makes
    one native call, not hold, run and release): unregistering the destination while a pull
    into it waits for a slow owner waits for the pull to end, and only then lets the cache go;
    a pull after that is refused (CacheNotFound) and moves nothing."""
    from datadist.core.errors import CacheNotFound

    pr, proxy = stalled_pair
    ended: list[float] = []
    errors: list[BaseException] = []

    def pull() -> None:
        try:
            pr.pull(20.0)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
        ended.append(time.monotonic())

    t = threading.Thread(target=pull)
    t.start()
    deadline = time.monotonic() + 10
    while pr.puller.leases(pr.dst_entry.cache_id) == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert pr.puller.leases(pr.dst_entry.cache_id) == 1, "the pull holds its destination"
    threading.Timer(0.3, lambda: setattr(proxy, "stalled", False)).start()
    pr.puller.unregister(pr.dst_entry.cache_id)
    # Every byte landed when unregister returns: it waited for the transfer's end. (Not
    # the pull thread's clock: it reads it only once it has the GIL back, which may be
    # after this thread's.)
    landed = np.array_equal(pr.dst, pr.src)
    t.join(30)
    assert not errors, errors
    assert ended and landed, "unregister returned before the pull in flight ended"
    assert pr.pulled_right()
    with pytest.raises(CacheNotFound):
        pr.pull()
    assert not pr.dst.any(), "a refused pull moved bytes"


# A TCP proxy in a process of its own (its threads share no GIL with the test): it forwards
# the owner's bytes to the puller each held DELAY_S first, so that an answer comes in a few
# hundred microseconds: within the hold's budget (gil.h kWaitBudget, 1 ms), and long enough
# that a call which gave the GIL up while it waited lets a busy thread take it nearly every
# time (a quicker answer often comes back before the busy thread wakes: a race, not a test).
DELAY_S = 0.0003
_PROXY = """
import socket, sys, threading, time
delay = float(sys.argv[2])
ls = socket.socket()
ls.bind(("127.0.0.1", 0))
ls.listen(16)
print(ls.getsockname()[1], flush=True)
def pump(src, dst, hold):
    try:
        while True:
            data = src.recv(1 << 20)
            if not data:
                break
            if hold:
                time.sleep(hold)
            dst.sendall(data)
    except OSError:
        pass
    for s in (src, dst):
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
while True:
    a, _ = ls.accept()
    b = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
    for s in (a, b):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    threading.Thread(target=pump, args=(a, b, 0.0), daemon=True).start()
    threading.Thread(target=pump, args=(b, a, delay), daemon=True).start()
"""


class ApiPair:
    """An owner and a TCP puller, each an engine with its CacheManager (the facade the bench's
    rows call), linked through the process proxy above. The owner has a blocks cache (4
    tensors, 2 layers, 8 blocks of 4 KiB) and a cache of one 8 KiB slot per tensor, both
    random; the puller one of each, zeroed."""

    TENSORS, BLOCK, BLOCKS, SLOT = 4, 4 << 10, 8, 8 << 10

    def __init__(self) -> None:
        self.owner = NativeEngine(EngineConfig(cluster_id=OWNER_ID, role=1,
                                               listen=("127.0.0.1", 0), sync_timeout=5.0))
        self.puller = NativeEngine(EngineConfig(cluster_id=PULLER_ID, role=2, sync_timeout=5.0,
                                                transport="tcp"))
        self.proxy: subprocess.Popen[str] | None = None
        self.arrays: list[np.ndarray] = []
        ocm, self.cm = CacheManager(self.owner), CacheManager(self.puller)
        u8, host = llm.DataType.DT_UINT8, llm.Placement.HOST
        blocks = llm.CacheDesc(self.TENSORS, [self.BLOCKS, self.BLOCK], u8, host)
        slots = llm.CacheDesc(self.TENSORS, [1, self.SLOT], u8, host)
        rng = np.random.default_rng(11)
        self.src_blocks, _ = self._register(ocm, blocks, rng, llm.BlocksCacheKey(OWNER_ID, 3))
        src_slots, _ = self._register(ocm, slots, rng)
        self.blocks, self.dst_blocks = self._register(self.cm, blocks, None,
                                                      llm.BlocksCacheKey(PULLER_ID, 3))
        self.slots, self.dst_slots = self._register(self.cm, slots, None)
        self.blocks_key = llm.BlocksCacheKey(OWNER_ID, 3)
        self.slot_key = llm.CacheKeyByIdAndIndex(OWNER_ID, src_slots.cache_id, 0)
        self.src = self.arrays[:2]

    def _register(self, cm: CacheManager, desc: llm.CacheDesc, rng: np.random.Generator | None,
                  blocks_key: llm.BlocksCacheKey | None = None) -> tuple[llm.Cache, np.ndarray]:
        arr = np.zeros((desc.num_tensors, desc.size), np.uint8)
        if rng is not None:
            arr[...] = rng.integers(0, 256, arr.shape, dtype=np.uint8)
        self.arrays.append(arr)
        addrs = [int(arr[t].ctypes.data) for t in range(desc.num_tensors)]
        if blocks_key is not None:
            return cm.register_blocks_cache(desc, addrs, blocks_key), arr
        return cm.register_cache(desc, addrs), arr

    def link_through_proxy(self, delay: float) -> None:
        _, port = self.owner.listen_address
        self.proxy = subprocess.Popen([sys.executable, "-c", _PROXY, str(port), str(delay)],
                                      stdout=subprocess.PIPE, text=True)
        assert self.proxy.stdout is not None
        self.puller.link(OWNER_ID, "127.0.0.1", int(self.proxy.stdout.readline()), 5.0)

    def calls(self) -> dict[str, Callable[[], None]]:
        """The pulls, each of 32 KiB or less (the bench's busy rows call pull_blocks of one
        block): a block (block 1 into block 2), the slot, each also of layer 0 only (tensors 0
        and 1), and the issued forms waited for."""
        cm, bk, sk, r = self.cm, self.blocks_key, self.slot_key, range(0, 1)
        return {
            "pull_blocks": lambda: cm.pull_blocks(bk, self.blocks, [1], [2]),
            "pull_blocks_layers": lambda: cm.pull_blocks(bk, self.blocks, [1], [2],
                                                         src_layer_range=r, dst_layer_range=r),
            "pull_cache": lambda: cm.pull_cache(sk, self.slots, 0),
            "pull_cache_layers": lambda: cm.pull_cache(sk, self.slots, 0, src_layer_range=r,
                                                       dst_layer_range=r),
            "pull_blocks_async_wait": lambda: cm.pull_blocks_async(bk, self.blocks, [1],
                                                                   [2]).wait(5),
            "pull_cache_async_wait": lambda: cm.pull_cache_async(sk, self.slots, 0).wait(5),
        }

    def pulled_right(self, call: str) -> bool:
        """What ``call`` pulls landed (layer 0: tensors 0 and 1), nothing else; then zeroed."""
        src_blocks, src_slots = self.src
        n = 2 if call.endswith("layers") else self.TENSORS
        b = self.BLOCK
        if call.startswith("pull_blocks"):
            want = np.zeros_like(self.dst_blocks)
            want[:n, 2 * b:3 * b] = src_blocks[:n, b:2 * b]
            got = self.dst_blocks
        else:
            want = np.zeros_like(self.dst_slots)
            want[:n] = src_slots[:n]
            got = self.dst_slots
        ok = np.array_equal(got, want)
        got.fill(0)
        return ok

    def close(self) -> None:
        self.puller.close()
        self.owner.close()
        if self.proxy is not None:
            self.proxy.kill()
            self.proxy.wait()


@pytest.fixture
def api_pair() -> Iterator[ApiPair]:
    pr = ApiPair()
    try:
        yield pr
    finally:
        pr.close()


# A rerun: the rule holds for answers within the core's budget of 1 ms, and on a loaded
# machine the proxy's 0.3 ms answers come later in more than half of 20 calls (seen once at
# load 4, for pull_cache, passing on the rerun of the whole suite).
@pytest.mark.flaky(reruns=1)
@pytest.mark.parametrize("call", ["pull_blocks", "pull_blocks_layers", "pull_cache",
                                  "pull_cache_layers", "pull_blocks_async_wait",
                                  "pull_cache_async_wait"])
def test_the_bench_calls_keep_the_gil_through_a_quick_answer(api_pair, switch_interval,
                                                              call: str) -> None:
    """Each call the busy rows of the bench make (and its siblings), through CacheManager over
    TCP, with the owner's answers held 0.3 ms (within the 1 ms budget): with a switch interval
    of 0.1 s, a busy thread beside it runs during at most half of 20 calls. A call that gives
    the GIL up while it waits lets it run in nearly every one (an issued pull's ``wait`` did,
    before it kept the GIL for the budget: 19-20 of 20), and beside a busy thread each such
    call pays up to a switch interval (5 ms by default) to get the GIL back. (An answer later
    than the budget, on a loaded machine, lets it run: not every call.)"""
    pr = api_pair
    pr.link_through_proxy(DELAY_S)
    pull = pr.calls()[call]
    for _ in range(3):  # planned, linked, warm
        pull()
    assert pr.puller.last_moved(OWNER_ID) in ("tcp", "stream")  # over the socket, no lease
    assert pr.pulled_right(call)
    switch_interval(0.1)
    handed = 0
    with BusyCounter() as busy:
        time.sleep(0.01)
        for _ in range(20):
            before = busy.steps
            pull()
            handed += busy.steps != before
    assert handed <= 10, f"{handed} of 20 quick {call} calls let the busy thread run"
    assert pr.pulled_right(call)
