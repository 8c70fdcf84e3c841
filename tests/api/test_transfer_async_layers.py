"""``transfer_cache_async``'s layer loop: layers issued ahead, outcomes settled in layer order.

The loop (``datadist.core.layerwise``) issues each layer as soon as it is synchronized and
goes on to synchronize the next one while it moves; it waits for layer i - DEPTH before it
synchronizes layer i, settles outcomes in layer order, and stops a destination once one of
its layers is seen to fail. Checked two ways, none by timing:

* the loop alone, with transfers the test ends by hand (``Gate``): what was in flight when
  each layer was awaited, which code a destination reports when two of its layers fail,
  a transfer that never ends (the deadline);
* through the facade on two engines in this process (``pair`` / ``ra_pair``), with the
  engine's issued pushes watched: a layer's push is issued before the next layer is awaited
  and not waited for until two layers later; a failing layer stops the later ones.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

import datadist as llm
from datadist.api import async_transfer
from datadist.core import layerwise
from datadist.core.errors import Code, DatadistError, NotLinked, Timeout
from datadist.testing.doubles import Spy

from ._support import DECODER_ID, units

pytestmark = pytest.mark.timeout(30)

S = llm.LLMStatusCode
WAIT = 5.0  # s, every wait of these tests


class Gate:
    """An issued transfer the test ends: ``end(code)`` once; records whether (and when, in
    the loop's log) the loop waited on it."""

    def __init__(self, layer: int, log: list[tuple[str, int]],
                 end_on_wait: DatadistError | None = None) -> None:
        self.layer = layer
        self._ended = threading.Event()
        self._error: DatadistError | None = None
        self._log = log
        self._end_on_wait = end_on_wait  # ends (with this error) once the loop waits on it

    def end(self, error: DatadistError | None = None) -> None:
        self._error = error
        self._ended.set()

    def done(self) -> bool:
        return self._ended.is_set()

    def wait(self, timeout_s: float | None = None) -> bool:
        self._log.append(("wait", self.layer))
        if self._end_on_wait is not None:
            self.end(self._end_on_wait)
        return self._ended.wait(timeout_s)

    def error(self) -> DatadistError | None:
        return self._error


def run_loop(num_layers: int, jobs: list[layerwise.LayerJob], synchronize,
             wait_s: float | None = WAIT) -> dict[int, Code]:
    reports: dict[int, Code] = {}
    order: list[int] = []
    finished = threading.Event()

    def report(k: int, c: Code) -> None:
        assert k not in reports, f"destination {k} reported twice"
        reports[k] = c
        order.append(k)

    layerwise.LayerwiseTransfer(num_layers, synchronize, jobs, report, finished.set,
                                wait_s=wait_s).start()
    assert finished.wait(WAIT), "the loop never ended"
    return reports


class TestLoop:
    def test_a_layer_moves_while_the_next_is_awaited(self):
        """At synchronize(i), layer i-1 is issued and still moving (the test ends it only
        then), every earlier layer has ended, and the loop has waited on none but i-2."""
        n = 6
        log: list[tuple[str, int]] = []
        gates = [Gate(i, log) for i in range(n)]
        seen: dict[int, tuple[list[int], list[int]]] = {}

        def synchronize(i: int) -> bool:
            moving = [g.layer for g in gates if g in issued and not g.done()]
            seen[i] = (moving, [layer for what, layer in log if what == "wait"])
            if i >= 1:
                gates[i - 1].end()  # layer i-1 ends once layer i is awaited
            if i == n - 1:
                gates[i].end()
            return True

        issued: list[Gate] = []

        def send(i: int) -> Gate:
            issued.append(gates[i])
            return gates[i]

        reports = run_loop(n, [layerwise.LayerJob(range(n), send)], synchronize)
        assert reports == {0: Code.SUCCESS}
        for i in range(n):
            moving, waited = seen[i]
            assert moving == ([i - 1] if i else []), (i, moving)
            # a layer is waited on (if at all: done() is asked first) only once two later
            # layers were issued
            assert all(layer <= i - layerwise.DEPTH for layer in waited), (i, waited)

    def test_outcomes_are_settled_in_layer_order(self):
        """Layer 2 fails at once, layer 1 (issued before it) fails later: the destination
        reports layer 1's code. The transfer stops at the failure, as LLM-DataDist's
        (v2/llm_utils.py TransferCacheJob.transfer_layers returns at its first failure):
        layer 2 is not sent to the second destination, no layer after it to either, and the
        second destination, stopped before its last layer, reports nothing (None)."""
        log: list[tuple[str, int]] = []
        gates = {0: Gate(0, log), 1: Gate(1, log, end_on_wait=Timeout("too late")),
                 2: Gate(2, log)}
        gates[0].end()
        gates[2].end(NotLinked("gone"))
        sent: list[tuple[int, int]] = []
        synced: list[int] = []

        def send_a(i: int) -> Gate:
            sent.append((0, i))
            return gates[i]

        def send_b(i: int) -> None:
            sent.append((1, i))

        reports = run_loop(5, [layerwise.LayerJob(range(5), send_a),
                               layerwise.LayerJob(range(5), send_b)],
                           lambda i: synced.append(i) or True)
        assert reports == {0: Code.TIMEOUT}
        assert [i for k, i in sent if k == 0] == [0, 1, 2]
        assert [i for k, i in sent if k == 1] == [0, 1]
        assert synced == [0, 1, 2]
        assert ("wait", 1) in log and ("wait", 2) not in log

    def test_a_failure_seen_stops_the_destination(self):
        """Layer 0 failed and ended at once: layer 1 (synchronized before the loop looked)
        may go out, layer 2 is neither synchronized nor sent for that destination."""
        sent: list[int] = []
        synced: list[int] = []
        log: list[tuple[str, int]] = []

        def send(i: int) -> Gate:
            sent.append(i)
            g = Gate(i, log)
            g.end(NotLinked("gone") if i == 0 else None)
            return g

        reports = run_loop(4, [layerwise.LayerJob(range(4), send)],
                           lambda i: synced.append(i) or True)
        assert reports == {0: Code.NOT_YET_LINK}
        assert sent == synced == [0]  # ended before layer 1 was looked at: seen then

    def test_a_synchronizer_refusal_waits_for_earlier_layers(self):
        """synchronize(1) says False while layer 0 is moving; layer 0 then fails: its code is
        the destination's (layer order), not the refusal's PARAM_INVALID."""
        log: list[tuple[str, int]] = []
        g0 = Gate(0, log)

        def synchronize(i: int) -> bool:
            if i == 1:
                g0.end(NotLinked("gone"))  # after this call returns, in the loop's eyes
                return False
            return True

        reports = run_loop(3, [layerwise.LayerJob(range(3), lambda i: g0)], synchronize)
        assert reports == {0: Code.NOT_YET_LINK}

    def test_a_transfer_that_never_ends_is_a_timeout(self):
        """The deadline: an issued layer not ended within wait_s is TIMEOUT, and the loop ends
        (it does not wait for ever on a transfer the core failed to end)."""
        log: list[tuple[str, int]] = []
        stuck = Gate(0, log)
        reports = run_loop(2, [layerwise.LayerJob(range(2), lambda i: stuck if i == 0 else None)],
                           lambda i: True, wait_s=0.05)
        assert reports == {0: Code.TIMEOUT}
        assert ("wait", 0) in log

    def test_loop_threads_are_reused(self, monkeypatch):
        """A transfer does not start a thread when one is idle: two transfers in a row run on
        the same loop thread."""
        threads = layerwise._LoopThreads()
        monkeypatch.setattr(layerwise, "_THREADS", threads)
        names: list[int] = []
        for _ in range(2):
            run_loop(1, [layerwise.LayerJob(range(1), lambda i: None)],
                     lambda i: names.append(threading.get_ident()) or True)
            deadline = time.monotonic() + WAIT  # it files itself idle after the loop's done()
            while threads._idle != 1:
                assert time.monotonic() < deadline, "the loop thread never went idle"
                time.sleep(0.001)
        assert names[0] == names[1]

    @pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
    def test_a_forked_child_runs_its_own_loops(self):
        """After fork the parent's idle loop threads do not exist in the child: a transfer
        there starts its own thread instead of waiting for one that never comes."""
        run_loop(1, [layerwise.LayerJob(range(1), lambda i: None)], lambda i: True)
        deadline = time.monotonic() + WAIT  # the parent's loop thread is idle now
        while layerwise._THREADS._idle < 1:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        pid = os.fork()
        if pid == 0:  # the child: exit 0 once its transfer ended, 1 if it never did
            ended = threading.Event()
            layerwise.LayerwiseTransfer(1, lambda i: True,
                                        [layerwise.LayerJob(range(1), lambda i: None)],
                                        lambda k, c: None, ended.set).start()
            os._exit(0 if ended.wait(WAIT) else 1)
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status

    def test_transfers_at_once_each_get_a_thread(self):
        """Two transfers whose synchronizers block each other's progress: each runs on its own
        loop thread (the second does not queue behind the first)."""
        first_waiting, release = threading.Event(), threading.Event()
        done = [threading.Event(), threading.Event()]

        def blocked(i: int) -> bool:
            first_waiting.set()
            return release.wait(WAIT)

        layerwise.LayerwiseTransfer(1, blocked, [layerwise.LayerJob(range(1), lambda i: None)],
                                    lambda k, c: None, done[0].set).start()
        assert first_waiting.wait(WAIT)
        layerwise.LayerwiseTransfer(1, lambda i: True,
                                    [layerwise.LayerJob(range(1), lambda i: None)],
                                    lambda k, c: None, done[1].set).start()
        assert done[1].wait(WAIT)  # while the first is still blocked
        assert not done[0].is_set()
        release.set()
        assert done[0].wait(WAIT)


# ============================================================================ through the facade


class Watched:
    """Wraps an engine's ``layers`` (the core's LayerRun, transfer_cache_async's loop): each
    run is recorded, and every ``go`` / ``wait_ended`` it is given is logged, with the calls
    added by then."""

    def __init__(self, engine, log: list[tuple[str, int]]) -> None:
        self.runs: list[object] = []
        self.added = 0  # calls handed to the core so far
        self._real = engine.layers
        self._log = log
        engine.layers = self.layers

    def layers(self, *args, **kwargs):
        watched = self
        run = self._real(*args, **kwargs)

        class Run:
            def __getattr__(self, name):
                return getattr(run, name)

            def add(self, *a, **k):
                watched.added += 1
                return run.add(*a, **k)

            def add_all(self, first, job, calls, per_step):
                watched.added += len(calls)
                return run.add_all(first, job, calls, per_step)

            def go(self, step):
                watched._log.append(("go", step))
                return run.go(step)

            def wait_ended(self, steps, timeout_s):
                watched._log.append(("wait", steps - 1))  # waits for step `steps - 1` to end
                return run.wait_ended(steps, timeout_s)

        self.runs.append(run)
        return Run()

    def gone(self) -> int:
        return sum(1 for what, _ in self._log if what == "go")


class Sync(llm.LayerSynchronizer):
    def __init__(self, hook=None):
        self.calls: list[int] = []
        self.hook = hook

    def synchronize_layer(self, layer_index, timeout_in_millis):
        self.calls.append(layer_index)
        if self.hook is not None:
            self.hook(layer_index)
        return True


class TestThroughTheFacade:
    def test_each_layer_is_issued_before_the_next_is_awaited(self, ra_pair):
        """Blocks by key, 8 layers, through the core's layer loop (issue 37): every layer's
        call is handed to the core before layer 0 is awaited (planned once); at
        synchronize(i) layers 0..i-1 were let go and the loop has waited on no layer after
        i-2; the core ran one call per layer (one push each: no extra round trip); every
        byte lands. A second transfer of the same layers prepares nothing anew."""
        p, d = ra_pair
        src, a = p.register(16, [4, 64], blocks=True, seed=21)
        _, b = d.register(16, [4, 64], blocks=True, model_id=3)
        log: list[tuple[str, int]] = []
        watched = Watched(p.engine, log)
        seen: dict[int, tuple[int, int, list[int]]] = {}
        sync = Sync(hook=lambda i: seen.__setitem__(
            i, (watched.added, watched.gone(), [n for what, n in log if what == "wait"])))
        cfg = llm.TransferWithCacheKeyConfig(llm.BlocksCacheKey(DECODER_ID, 3), range(8),
                                             range(8))
        task = p.cm.transfer_cache_async(src, sync, [cfg], [0, 1, 2, 3], [3, 2, 1, 0])
        assert task.synchronize(int(WAIT * 1000)) == S.LLM_SUCCESS
        assert sync.calls == list(range(8))
        for i in range(8):
            added, gone, waited = seen[i]
            assert added == 8, (i, added)  # every layer's call handed over before layer 0
            assert gone == i, (i, gone)  # layers 0..i-1 let go, layer i not yet
            assert all(n <= i - layerwise.DEPTH for n in waited), (i, waited)
        (run,) = watched.runs
        assert run.calls_run == 8 and run.ended() == 8  # one push per layer, all ended
        want = np.zeros_like(b)
        units(want, 4)[:, [3, 2, 1, 0]] = units(a, 4)[:, [0, 1, 2, 3]]
        np.testing.assert_array_equal(b, want)
        assert p.engine.leases(src.cache_id) == 0  # every layer ended: no hold left
        prepares = []
        real_prepare = p.engine._core.prepare
        real_layers = p.engine._core.prepare_layer_pushes
        p.engine._core = Spy(p.engine._core, prepare=lambda *a_, **k: (
            prepares.append(1), real_prepare(*a_, **k))[1],
            prepare_layer_pushes=lambda **k: (prepares.append(2), real_layers(**k))[1])
        b[:] = 0
        task = p.cm.transfer_cache_async(src, Sync(), [cfg], [0, 1, 2, 3], [3, 2, 1, 0])
        assert task.synchronize(int(WAIT * 1000)) == S.LLM_SUCCESS
        np.testing.assert_array_equal(b, want)
        assert prepares == []  # the calls of the first transfer, kept

    def test_a_failing_layer_stops_the_later_ones(self, pair):
        """Raw addresses, 6 layers; layer 1's point outside every registered cache. The
        destination reports PARAM_INVALID; layer 0 landed; layer 1 did not; layers 3 to 5
        were neither awaited nor sent (layer 1's failure was seen before layer 3 at the
        latest: the loop waits for layer i - 2 before awaiting layer i)."""
        p, d = pair
        src, a = p.register(12, [1, 64], seed=22)
        _, b = d.register(12, [1, 64])
        scratch = np.zeros(4096, np.uint8)
        dst = [int(b[t].ctypes.data) for t in range(12)]
        dst[2] = dst[3] = int(scratch.ctypes.data)  # layer 1's K and V
        sync = Sync()
        task = p.cm.transfer_cache_async(src, sync, [llm.TransferConfig(DECODER_ID, dst)])
        assert task.get_results(int(WAIT * 1000)) == [S.LLM_PARAM_INVALID]
        # layer 2 was awaited (and sent) only if layer 1's failure was not seen by then
        assert sync.calls in ([0, 1], [0, 1, 2])
        np.testing.assert_array_equal(b[:2], a[:2])
        assert not scratch.any() and not b[2:4].any()
        if sync.calls == [0, 1]:
            assert not b[4:6].any()
        assert not b[6:].any()
        assert p.engine.leases(src.cache_id) == 0  # no issued push holds the source

    def test_several_destinations_in_flight(self, ra_pair, make_side):
        """Two destinations, 4 layers: both get every layer's call handed to the core before
        layer 0 is awaited, and the core runs one push per destination and layer. With an
        unlinked destination between them, the transfer stops at its refusal, as
        LLM-DataDist's (v2/llm_utils.py TransferCacheJob.transfer_layers returns at the
        first failure): layer 0 reached the first destination, nothing the third (a layer
        goes to no destination after the failing one), no layer past those started beside
        the failing one; the two linked ones report nothing (None)."""
        p, d = ra_pair
        src, a = p.register(8, [2, 32], blocks=True, seed=23)
        _, b = d.register(8, [2, 32], blocks=True, model_id=4)
        _, c = d.register(8, [2, 32], blocks=True, model_id=5)
        log: list[tuple[str, int]] = []
        watched = Watched(p.engine, log)
        seen: dict[int, int] = {}
        sync = Sync(hook=lambda i: seen.__setitem__(i, watched.added))
        to_b, to_c = (llm.TransferWithCacheKeyConfig(llm.BlocksCacheKey(DECODER_ID, m),
                                                     range(4), range(4)) for m in (4, 5))
        task = p.cm.transfer_cache_async(src, sync, [to_b, to_c], [0, 1], [1, 0])
        assert task.get_results(int(WAIT * 1000)) == [S.LLM_SUCCESS, S.LLM_SUCCESS]
        assert seen[0] == 8  # both destinations' 4 layers before layer 0 is awaited
        assert watched.runs[0].calls_run == 8
        want = np.zeros_like(b)
        units(want, 2)[:, [1, 0]] = units(a, 2)[:, [0, 1]]
        np.testing.assert_array_equal(b, want)
        np.testing.assert_array_equal(c, want)
        b[:] = 0
        c[:] = 0
        unlinked = llm.TransferWithCacheKeyConfig(llm.BlocksCacheKey(77, 4), range(4), range(4))
        sync = Sync()
        task = p.cm.transfer_cache_async(src, sync, [to_b, unlinked, to_c], [0, 1], [1, 0])
        assert task.get_results(int(WAIT * 1000)) == [None, S.LLM_NOT_YET_LINK, None]
        assert task.synchronize(int(WAIT * 1000)) == S.LLM_NOT_YET_LINK
        np.testing.assert_array_equal(b[:2], want[:2])  # layer 0 to the first
        # The core starts no layer once it saw the failure; a layer started beside the
        # failing one (DEPTH at once) ends as it ends. Within each layer the refused
        # destination comes before the third, which so gets nothing at all.
        assert not b[2 * layerwise.DEPTH:].any() and not c.any()
        assert watched.runs[1].calls_run in range(2, 2 * layerwise.DEPTH + 1)
        # the loop synchronizes at most DEPTH layers before the failure is seen
        assert sync.calls == list(range(len(sync.calls))) and len(sync.calls) <= layerwise.DEPTH

    def test_a_layer_issued_in_part_is_waited_for(self, pair, monkeypatch):
        """Raw addresses send K and V apart: when V's call cannot be had after K's was
        handed to the run, the destination reports the refusal at that layer, after K's push
        ran (in order, in the core), and nothing holds the source cache after."""
        p, d = pair
        src, a = p.register(4, [1, 64], seed=24)
        _, b = d.register(4, [1, 64])
        real_job = async_transfer._Job

        def job(layers, calls, prepared=None, per_layer=1):
            # no `prepared`: the run takes the layers one by one, from `parts`
            def parts(i):
                got = calls(i)  # the core's calls of layer i: K's, then V's
                yield got[0]
                if i == layers.start:
                    raise NotLinked("refused after the first tensor's call was made")
                yield from got[1:]
            return real_job(layers, parts)

        monkeypatch.setattr(async_transfer, "_Job", job)
        sync = Sync()
        task = p.cm.transfer_cache_async(src, sync, [llm.TransferConfig(
            DECODER_ID, [int(b[t].ctypes.data) for t in range(4)])])
        assert task.get_results(int(WAIT * 1000)) == [S.LLM_NOT_YET_LINK]
        assert sync.calls == [0]  # the refusal is layer 0's, seen there
        np.testing.assert_array_equal(b[0], a[0])  # K of layer 0 went out
        assert not b[1:].any()
        assert p.engine.leases(src.cache_id) == 0  # no transfer holds the source


class TestLayerRanges:
    def test_destinations_with_their_own_layers(self, ra_pair):
        """Two destinations taking layers 1-2 and 4-5 of 6 (the core's steps: layers some
        destination needs): the synchronizer is called for those four only, in order; each
        destination gets its layers, into its own range, and succeeds at its last one."""
        p, d = ra_pair
        src, a = p.register(12, [2, 32], blocks=True, seed=26)
        _, b = d.register(12, [2, 32], blocks=True, model_id=7)
        _, c = d.register(12, [2, 32], blocks=True, model_id=8)
        to_b = llm.TransferWithCacheKeyConfig(llm.BlocksCacheKey(DECODER_ID, 7), range(1, 3),
                                              range(0, 2))
        to_c = llm.TransferWithCacheKeyConfig(llm.BlocksCacheKey(DECODER_ID, 8), range(4, 6),
                                              range(3, 5))
        log: list[tuple[str, int]] = []
        watched = Watched(p.engine, log)
        sync = Sync()
        task = p.cm.transfer_cache_async(src, sync, [to_b, to_c], [0, 1], [0, 1])
        assert task.get_results(int(WAIT * 1000)) == [S.LLM_SUCCESS, S.LLM_SUCCESS]
        assert sync.calls == [1, 2, 4, 5]
        assert watched.runs[0].steps == 4 and watched.runs[0].calls_run == 4
        np.testing.assert_array_equal(b[0:4], a[2:6])
        assert not b[4:].any()
        np.testing.assert_array_equal(c[6:10], a[8:12])
        assert not c[:6].any() and not c[10:].any()


class TestMergedLayers:
    """Layers the synchronizer gives back together reach the core before a worker starts
    them, and the core sends them in one request (issue 37: LayerRun merges one
    destination's layers by key); the rules stay per layer."""

    def test_layers_ready_together_go_in_fewer_requests(self, ra_pair):
        """32 layers of 256 KiB, every one ready at once (as the bench's synchronizer): the
        loop runs ahead (the run merges), every layer's bytes land where they belong, the
        destination succeeds, and the core sent fewer requests than layers. Before: one
        request a layer, the loop two layers ahead."""
        p, d = ra_pair
        src, a = p.register(64, [4, 64 << 10], blocks=True, seed=31)
        _, b = d.register(64, [4, 64 << 10], blocks=True, model_id=11)
        watched = Watched(p.engine, [])
        sync = Sync()
        cfg = llm.TransferWithCacheKeyConfig(llm.BlocksCacheKey(DECODER_ID, 11), range(32),
                                             range(32))
        task = p.cm.transfer_cache_async(src, sync, [cfg], [0, 1, 2, 3], [3, 2, 1, 0])
        assert task.synchronize(int(WAIT * 1000)) == S.LLM_SUCCESS
        assert sync.calls == list(range(32))
        want = np.zeros_like(b)
        units(want, 4)[:, [3, 2, 1, 0]] = units(a, 4)[:, [0, 1, 2, 3]]
        np.testing.assert_array_equal(b, want)
        (run,) = watched.runs
        assert run.merges() and run.calls_run == 32 and run.ended() == 32
        assert run.requests_run < 32
        assert p.engine.leases(src.cache_id) == 0

    def test_large_layers_split_between_workers_land_where_asked(self, ra_pair):
        """32 layers of 1 MiB, every one ready at once, blocks in reversed order: layers let
        go together past 4 MiB are split between the run's two workers (LayerRun kSplitBytes),
        each part one request; every byte lands where its layer and block put it, and the
        destination succeeds. With a destination of 20 layers (the config names 32), the
        outcome is the owner's refusal of layer 20, whichever part carried it, layers 0-19
        land whole and nothing is written past them."""
        p, d = ra_pair
        src, a = p.register(64, [4, 128 << 10], blocks=True, seed=34)
        _, b = d.register(64, [4, 128 << 10], blocks=True, model_id=13)
        _, c = d.register(40, [4, 128 << 10], blocks=True, model_id=14)
        cfg = llm.TransferWithCacheKeyConfig(llm.BlocksCacheKey(DECODER_ID, 13), range(32),
                                             range(32))
        task = p.cm.transfer_cache_async(src, Sync(), [cfg], [0, 1, 2, 3], [3, 2, 1, 0])
        assert task.synchronize(int(WAIT * 1000)) == S.LLM_SUCCESS
        want = np.zeros_like(b)
        units(want, 4)[:, [3, 2, 1, 0]] = units(a, 4)[:, [0, 1, 2, 3]]
        np.testing.assert_array_equal(b, want)
        short = llm.TransferWithCacheKeyConfig(llm.BlocksCacheKey(DECODER_ID, 14), range(32),
                                               range(32))
        task = p.cm.transfer_cache_async(src, Sync(), [short], [0, 1, 2, 3], [3, 2, 1, 0])
        assert task.get_results(int(WAIT * 1000)) == [S.LLM_PARAM_INVALID]
        np.testing.assert_array_equal(c, want[:40])
        assert p.engine.leases(src.cache_id) == 0

    def test_synchronize_wakes_from_the_run_itself(self, ra_pair, monkeypatch):
        """The caller's synchronize waits on the core's run, not on a relay from the loop
        thread: it returns SUCCESS, with every byte landed, while the loop thread is held at
        its end (after its last layer let go). Before, the loop thread waited for the run and
        then woke the caller: one more hand-over between the last byte and the caller."""
        p, d = ra_pair
        src, a = p.register(8, [4, 1 << 10], blocks=True, seed=33)
        _, b = d.register(8, [4, 1 << 10], blocks=True, model_id=12)
        release, held = threading.Event(), threading.Event()
        real_finish = llm.CacheTask._finish

        def held_finish(task):
            held.set()
            release.wait(WAIT)
            real_finish(task)

        monkeypatch.setattr(llm.CacheTask, "_finish", held_finish)
        cfg = llm.TransferWithCacheKeyConfig(llm.BlocksCacheKey(DECODER_ID, 12), range(4),
                                             range(4))
        try:
            task = p.cm.transfer_cache_async(src, Sync(), [cfg], [0, 1, 2, 3], [0, 1, 2, 3])
            assert task.synchronize(1000) == S.LLM_SUCCESS
            assert not release.is_set()
            np.testing.assert_array_equal(b, a)
            assert task.get_results(0) == [S.LLM_SUCCESS]
        finally:
            release.set()
        assert held.wait(WAIT)

    def test_a_refused_layer_among_merged_ones_settles_as_alone(self, ra_pair):
        """The destination has 5 layers, the config names 8: whether layers 5-7 went out in
        one request with earlier ones or not, the outcome is the owner's refusal of layer 5
        (PARAM_INVALID), layers 0-4 landed whole, and nothing was written past them."""
        p, d = ra_pair
        src, a = p.register(16, [4, 64 << 10], blocks=True, seed=32)
        _, b = d.register(10, [4, 64 << 10], blocks=True, model_id=12)
        watched = Watched(p.engine, [])
        cfg = llm.TransferWithCacheKeyConfig(llm.BlocksCacheKey(DECODER_ID, 12), range(8),
                                             range(8))
        task = p.cm.transfer_cache_async(src, Sync(), [cfg], [0, 1, 2, 3], [0, 1, 2, 3])
        assert task.get_results(int(WAIT * 1000)) == [S.LLM_PARAM_INVALID]
        np.testing.assert_array_equal(b, a[:10])
        (run,) = watched.runs
        assert run.merges() and run.stopped()
        assert p.engine.leases(src.cache_id) == 0
