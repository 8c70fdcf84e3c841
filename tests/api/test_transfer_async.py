"""``transfer_cache_async``: layer-wise sending driven by a LayerSynchronizer.

Two engines in this process, linked both ways (``pair`` / ``ra_pair``): the PROMPT sends,
the DECODER's registered memory receives. Raw-address destinations (``TransferConfig``) are
resolved by the receiving side to one of its registered caches; key destinations
(``TransferWithCacheKeyConfig``) are pushes by key.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import datadist as llm
from datadist.core import layerwise
from datadist.core.errors import Code, NotLinked
from datadist.testing.doubles import Spy

from ._support import DECODER_ID, PROMPT_ID, code, units

pytestmark = pytest.mark.timeout(30)

S = llm.LLMStatusCode
WAIT = 5000  # ms


class Sync(llm.LayerSynchronizer):
    """Answers True unless told otherwise; records calls; may run a hook first."""

    def __init__(self, answers=None, hook=None, raise_at=None):
        self.calls = []
        self.answers = answers or {}
        self.hook = hook
        self.raise_at = raise_at

    def synchronize_layer(self, layer_index, timeout_in_millis):
        self.calls.append((layer_index, timeout_in_millis))
        if self.hook is not None:
            self.hook(layer_index)
        if layer_index == self.raise_at:
            raise RuntimeError("compute failed")
        return self.answers.get(layer_index, True)


def addrs(arr, tensors, offset=0):
    return [int(arr[t].ctypes.data) + offset for t in tensors]


# ================================================================================ TransferConfig


class TestRawAddresses:
    def test_slot_to_addresses_layer_by_layer(self, pair):
        p, d = pair
        src, a = p.register(8, [4, 64], seed=1)  # 4 layers of (K, V), 4 slots of 64 bytes
        dst, b = d.register(4, [2, 64])  # 2 layers, 2 slots
        sync = Sync()
        # source layers 1..2, slot 3 -> the decoder's slot 1 (address = tensor base + 64)
        cfg = llm.TransferConfig(DECODER_ID, addrs(b, range(4), 64), range(1, 3), 3)
        task = p.cm.transfer_cache_async(src, sync, [cfg])
        assert task.synchronize(WAIT) == S.LLM_SUCCESS
        assert task.get_results() == [S.LLM_SUCCESS]
        assert sync.calls == [(1, None), (2, None)]  # only the layers some config needs
        want = np.zeros_like(b)
        units(want, 2)[:, 1] = units(a, 4)[2:6, 3]
        np.testing.assert_array_equal(b, want)

    def test_layer_i_has_landed_when_layer_i_plus_2_is_awaited(self, pair):
        """The overlap promise: while the user computes layer i+1 (inside
        synchronize_layer(i+1)), layer i is on its way (issued, maybe still moving, see
        test_transfer_async_layers.py); by synchronize_layer(i+2) it has landed."""
        p, d = pair
        src, a = p.register(8, [1, 256], seed=2)
        _, b = d.register(8, [1, 256])
        seen = {}

        def hook(i):
            seen[i] = [bool((b[t] == a[t]).all()) for t in range(8)]

        cfg = llm.TransferConfig(DECODER_ID, addrs(b, range(8)))
        task = p.cm.transfer_cache_async(src, Sync(hook=hook), [cfg])
        assert task.synchronize(WAIT) == S.LLM_SUCCESS
        assert seen[0] == [False] * 8
        assert seen[1][2:] == [False] * 6  # layer 0 may have landed already, or not
        for i in (2, 3):  # layers 0 .. i-2 (tensors 0 .. 2i-3) landed; i and later not sent
            assert seen[i][:2 * (i - 1)] == [True] * (2 * (i - 1)), (i, seen[i])
            assert seen[i][2 * i:] == [False] * (8 - 2 * i), (i, seen[i])
        np.testing.assert_array_equal(b, a)

    def test_blocks_to_blocks(self, pair):
        p, d = pair
        src, a = p.register(4, [8, 32], blocks=True, seed=3)
        _, b = d.register(4, [16, 32], blocks=True)
        cfg = llm.TransferConfig(DECODER_ID, addrs(b, range(4)))
        task = p.cm.transfer_cache_async(src, Sync(), [cfg], [0, 1, 2, 7], [9, 10, 11, 0])
        assert task.synchronize(WAIT) == S.LLM_SUCCESS
        want = np.zeros_like(b)
        units(want, 16)[:, [9, 10, 11, 0]] = units(a, 8)[:, [0, 1, 2, 7]]
        np.testing.assert_array_equal(b, want)

    def test_blocks_into_larger_destination_blocks(self, pair):
        p, d = pair
        src, a = p.register(2, [4, 16], blocks=True, seed=4)
        _, b = d.register(2, [4, 32], blocks=True)
        cfg = llm.TransferConfig(DECODER_ID, addrs(b, range(2)))
        task = p.cm.transfer_cache_async(src, Sync(), [cfg], [1, 2], [3, 0], 32)
        assert task.synchronize(WAIT) == S.LLM_SUCCESS
        want = np.zeros((2, 4, 32), np.uint8)
        want[:, [3, 0], :16] = units(a, 4)[:, [1, 2]]
        np.testing.assert_array_equal(units(b, 4), want)

    def test_slot_cut_into_destination_blocks(self, pair):
        """A contiguous slot of 100 bytes into 32-byte blocks: 4 chunks, the last 4 bytes."""
        p, d = pair
        src, a = p.register(2, [3, 100], seed=5)
        _, b = d.register(2, [8, 32], blocks=True)
        cfg = llm.TransferConfig(DECODER_ID, addrs(b, range(2)), None, 2)
        task = p.cm.transfer_cache_async(src, Sync(), [cfg], None, [6, 1, 2, 4], 32)
        assert task.synchronize(WAIT) == S.LLM_SUCCESS
        want = np.zeros((2, 8, 32), np.uint8)
        slot = units(a, 3)[:, 2]
        for k, blk in enumerate([6, 1, 2, 4]):
            chunk = slot[:, k * 32:(k + 1) * 32]
            want[:, blk, :chunk.shape[1]] = chunk
        np.testing.assert_array_equal(units(b, 8), want)

    def test_several_destinations(self, pair, make_side):
        p, d = pair
        third = make_side(3)
        p.engine.link(3, *third.engine.listen_address, 5.0)
        src, a = p.register(4, [2, 32], seed=6)
        _, b = d.register(4, [2, 32])
        _, c = third.register(2, [1, 32])
        cfgs = [llm.TransferConfig(DECODER_ID, addrs(b, range(4))),
                llm.TransferConfig(3, addrs(c, range(2)), range(1, 2), 1)]
        task = p.cm.transfer_cache_async(src, Sync(), cfgs)
        assert task.get_results(WAIT) == [S.LLM_SUCCESS, S.LLM_SUCCESS]
        np.testing.assert_array_equal(units(b, 2)[:, 0], units(a, 2)[:, 0])
        np.testing.assert_array_equal(c, units(a, 2)[2:4, 1])


# ================================================================================ by cache key


class TestByKey:
    def test_cache_id_slot_with_layer_ranges(self, ra_pair):
        p, d = ra_pair
        src, a = p.register(4, [2, 48], seed=7)
        dst, b = d.register(6, [3, 48])
        key = llm.CacheKeyByIdAndIndex(DECODER_ID, dst.cache_id, 2)
        cfg = llm.TransferWithCacheKeyConfig(key, range(0, 2), range(1, 3), src_batch_index=1)
        task = p.cm.transfer_cache_async(src, Sync(), [cfg])
        assert task.synchronize(WAIT) == S.LLM_SUCCESS
        want = np.zeros_like(b)
        units(want, 3)[2:6, 2] = units(a, 2)[0:4, 1]
        np.testing.assert_array_equal(b, want)

    def test_blocks_key(self, ra_pair):
        p, d = ra_pair
        src, a = p.register(4, [8, 16], blocks=True, seed=8)
        _, b = d.register(4, [8, 16], blocks=True, model_id=5)
        cfg = llm.TransferWithCacheKeyConfig(llm.BlocksCacheKey(DECODER_ID, 5), range(1, 2),
                                             range(0, 1))
        task = p.cm.transfer_cache_async(src, Sync(), [cfg], [3, 4], [0, 7])
        assert task.synchronize(WAIT) == S.LLM_SUCCESS
        want = np.zeros_like(b)
        units(want, 8)[0:2, [0, 7]] = units(a, 8)[2:4, [3, 4]]
        np.testing.assert_array_equal(b, want)

    def test_a_model_s_layers_are_planned_once(self, ra_pair, monkeypatch):
        """Every request of a model sends the same layers of (often) the same blocks: each
        destination's 80 layers are planned and prepared by the core in one call
        (Engine.prepare_layer_pushes: no span planned in Python, no raw plan handed over),
        and the second transfer of the model to two destinations (into other layers of
        each) prepares nothing (160 calls kept)."""
        p, d = ra_pair
        src, a = p.register(160, [4, 16], blocks=True, seed=9)
        _, b = d.register(160, [4, 16], blocks=True, model_id=6)
        _, c = d.register(320, [4, 16], blocks=True, model_id=7)
        planned, raw = [], []
        core = p.engine._core
        monkeypatch.setattr(p.engine, "_core", Spy(
            core, prepare=lambda *a_, **k: raw.append(1) or core.prepare(*a_, **k),
            prepare_layer_pushes=lambda **k: planned.append(k) or core.prepare_layer_pushes(**k)))
        cfgs = [llm.TransferWithCacheKeyConfig(llm.BlocksCacheKey(DECODER_ID, 6), range(80),
                                               range(80)),
                llm.TransferWithCacheKeyConfig(llm.BlocksCacheKey(DECODER_ID, 7), range(80),
                                               range(80, 160))]
        for round_ in range(2):
            b[...] = 0
            c[...] = 0
            task = p.cm.transfer_cache_async(src, Sync(), cfgs, [1, 3], [2, 0])
            assert task.synchronize(WAIT) == S.LLM_SUCCESS
            assert task.get_results() == [S.LLM_SUCCESS, S.LLM_SUCCESS]
            # one core call per destination, in the first round only
            assert [(k["dst_first"], k["layers"]) for k in planned] == [(0, 80), (80, 80)], round_
            assert raw == []
            for dst, first in ((b, 0), (c, 160)):
                want = np.zeros_like(dst)
                units(want, 4)[first:first + 160, [2, 0]] = units(a, 4)[:, [1, 3]]
                np.testing.assert_array_equal(dst, want)

    def test_slot_into_blocks_by_key(self, ra_pair):
        # The owner refuses block writes from a cache of another per-unit shape (layout
        # tags), so the source slot here is exactly one destination block.
        p, d = ra_pair
        src, a = p.register(2, [2, 32], seed=9)
        _, b = d.register(2, [4, 32], blocks=True, model_id=1)
        cfg = llm.TransferWithCacheKeyConfig(llm.BlocksCacheKey(DECODER_ID, 1), range(1),
                                             range(1), src_batch_index=0)
        task = p.cm.transfer_cache_async(src, Sync(), [cfg], None, [3], 32)
        assert task.synchronize(WAIT) == S.LLM_SUCCESS
        want = np.zeros((2, 4, 32), np.uint8)
        want[:, 3] = units(a, 2)[:, 0]
        np.testing.assert_array_equal(units(b, 4), want)

    def test_unknown_destination_cache(self, ra_pair):
        p, _ = ra_pair
        src, _ = p.register(2, [1, 16], seed=1)
        cfg = llm.TransferWithCacheKeyConfig(llm.CacheKeyByIdAndIndex(DECODER_ID, 99),
                                             range(1), range(1))
        task = p.cm.transfer_cache_async(src, Sync(), [cfg])
        assert task.synchronize(WAIT) == S.LLM_KV_CACHE_NOT_EXIST


# ================================================================================ outcomes


class TestOutcomes:
    def test_false_aborts_the_configs_needing_that_layer(self, pair):
        p, d = pair
        src, a = p.register(8, [1, 32], seed=10)
        _, b = d.register(4, [1, 32])
        _, c = d.register(4, [1, 32])
        sync = Sync(answers={1: False})
        cfgs = [llm.TransferConfig(DECODER_ID, addrs(b, range(4)), range(0, 2)),
                llm.TransferConfig(DECODER_ID, addrs(c, range(4)), range(2, 4))]
        task = p.cm.transfer_cache_async(src, sync, cfgs)
        # The transfer stops at the refusal, as LLM-DataDist's (v2/llm_utils.py
        # TransferCacheJob.transfer_layers returns there): the second config never started
        # and reports nothing; synchronize() reports the first failure.
        assert task.get_results(WAIT) == [S.LLM_PARAM_INVALID, None]
        assert task.synchronize(WAIT) == S.LLM_PARAM_INVALID
        assert [i for i, _ in sync.calls] == [0, 1]
        np.testing.assert_array_equal(b[:2], a[:2])  # layer 0 went before the abort
        assert not b[2:].any()  # layer 1 never did
        assert not c.any()

    def test_synchronizer_raising_gives_the_default_error(self, pair):
        p, d = pair
        src, _ = p.register(4, [1, 32], seed=11)
        _, b = d.register(4, [1, 32])
        task = p.cm.transfer_cache_async(src, Sync(raise_at=0),
                                         [llm.TransferConfig(DECODER_ID, addrs(b, range(4)))])
        assert task.synchronize(WAIT) == S.LLM_TIMEOUT
        assert not b.any()

    def test_results_while_running(self, pair):
        """A config not started yet is None; waiting past the timeout gives the default
        error; once released, both finish."""
        p, d = pair
        src, a = p.register(4, [1, 32], seed=12)
        _, b = d.register(2, [1, 32])
        _, c = d.register(2, [1, 32])
        gate = threading.Event()
        sync = Sync(hook=lambda i: gate.wait(WAIT / 1000) if i == 1 else None)
        cfgs = [llm.TransferConfig(DECODER_ID, addrs(b, range(2)), range(0, 1)),
                llm.TransferConfig(DECODER_ID, addrs(c, range(2)), range(1, 2))]
        task = p.cm.transfer_cache_async(src, sync, cfgs)
        assert task.synchronize(50) == S.LLM_TIMEOUT
        assert task.get_results(50)[1] is None
        gate.set()
        assert task.get_results(WAIT) == [S.LLM_SUCCESS, S.LLM_SUCCESS]
        np.testing.assert_array_equal(c, a[2:4])

    @pytest.mark.parametrize("where,status", [
        # one answer wherever the addresses point (issue 21 item 2: no address oracle)
        ("nowhere", S.LLM_PARAM_INVALID),
        ("spill", S.LLM_PARAM_INVALID),
        ("private", S.LLM_PARAM_INVALID),
    ])
    def test_destination_must_be_inside_a_registered_cache(self, pair, where, status):
        p, d = pair
        src, _ = p.register(2, [2, 32], seed=13)
        private, pr = d.register(2, [2, 32], remote_accessible=False)
        _, b = d.register(2, [2, 32])
        scratch = np.zeros(4096, np.uint8)
        dst = {"nowhere": [int(scratch.ctypes.data)] * 2,
               "spill": addrs(b, range(2), 40),  # a 64-byte slot from offset 40 leaves it
               "private": addrs(pr, range(2))}[where]
        task = p.cm.transfer_cache_async(src, Sync(), [llm.TransferConfig(DECODER_ID, dst)])
        assert task.synchronize(WAIT) == status
        assert not scratch.any() and not pr.any() and not b.any()

    def test_unlinked_destination(self, pair):
        p, _ = pair
        src, _ = p.register(2, [1, 16], seed=14)
        task = p.cm.transfer_cache_async(src, Sync(), [llm.TransferConfig(77, [4096, 8192])])
        assert task.synchronize(WAIT) == S.LLM_NOT_YET_LINK

    def test_no_configs(self, pair):
        p, _ = pair
        src, _ = p.register(2, [1, 16])
        sync = Sync()
        task = p.cm.transfer_cache_async(src, sync, [])
        assert task.synchronize(WAIT) == S.LLM_SUCCESS and task.get_results() == []
        assert sync.calls == []


# ================================================================================ arguments


class TestArguments:
    @pytest.fixture
    def setup(self, pair):
        p, d = pair
        src, _ = p.register(4, [2, 32])
        blocks, _ = p.register(4, [4, 16], blocks=True)
        _, b = d.register(4, [2, 32])
        return p.cm, src, blocks, llm.TransferConfig(DECODER_ID, addrs(b, range(4)))

    def test_types(self, setup):
        cm, src, _, cfg = setup
        key_cfg = llm.TransferWithCacheKeyConfig(llm.CacheKeyByIdAndIndex(DECODER_ID, 1),
                                                 range(1), range(1))
        for call in [
            lambda: cm.transfer_cache_async("src", Sync(), [cfg]),
            lambda: cm.transfer_cache_async(src, object(), [cfg]),
            lambda: cm.transfer_cache_async(src, Sync(), cfg),
            lambda: cm.transfer_cache_async(src, Sync(), [key_cfg]),  # not in this mode
            lambda: cm.transfer_cache_async(src, Sync(), [cfg], src_block_indices=0),
            lambda: cm.transfer_cache_async(src, Sync(), [cfg], None, [0], "32"),
        ]:
            with pytest.raises(TypeError):
                call()
        with pytest.raises(ValueError):
            cm.transfer_cache_async(src, Sync(), [cfg], None, [-1], 32)
        with pytest.raises(ValueError):
            cm.transfer_cache_async(src, Sync(), [cfg], None, [0], -1)

    def test_key_configs_only_with_remote_cache_accessible(self, ra_pair):
        p, _ = ra_pair
        src, _ = p.register(2, [1, 16])
        with pytest.raises(TypeError):
            p.cm.transfer_cache_async(src, Sync(), [llm.TransferConfig(DECODER_ID, [1, 2])])

    def test_param_invalid(self, setup, pair):
        cm, src, blocks, cfg = setup
        p, d = pair
        host, _ = p.register(4, [2, 32], placement=llm.Placement.HOST)
        odd, _ = p.register(3, [2, 32])
        two = [4096, 8192]
        for call in [
            lambda: cm.transfer_cache_async(host, Sync(), [cfg]),
            lambda: cm.transfer_cache_async(odd, Sync(), [llm.TransferConfig(DECODER_ID, two)]),
            lambda: cm.transfer_cache_async(blocks, Sync(), [cfg], [0]),  # no dst blocks
            lambda: cm.transfer_cache_async(blocks, Sync(), [cfg], [0, 1], [0]),
            lambda: cm.transfer_cache_async(src, Sync(), [cfg], None, [0]),  # no block size
            lambda: cm.transfer_cache_async(src, Sync(), [cfg], None, None, 32),
            lambda: cm.transfer_cache_async(src, Sync(), [cfg], [0], [0]),  # src not blocks
            lambda: cm.transfer_cache_async(src, Sync(), [cfg], [0], [0], 16),  # not blocks
            lambda: cm.transfer_cache_async(src, Sync(), [llm.TransferConfig(
                DECODER_ID, two, range(2, 3))]),  # past the last layer
            lambda: cm.transfer_cache_async(src, Sync(), [llm.TransferConfig(DECODER_ID, two)]),
            lambda: cm.transfer_cache_async(src, Sync(), [llm.TransferConfig(
                DECODER_ID, cfg.dst_addrs, None, 2)]),  # batch index out of range
            lambda: cm.transfer_cache_async(blocks, Sync(), [llm.TransferConfig(
                DECODER_ID, cfg.dst_addrs, None, 1)], [0], [0]),
            lambda: cm.transfer_cache_async(src, Sync(), [llm.TransferConfig(
                DECODER_ID, [0, 1, 2, 3])]),  # a null address
            lambda: cm.transfer_cache_async(blocks, Sync(), [cfg], [0], [0], 8),  # too small
            lambda: cm.transfer_cache_async(src, Sync(), [cfg], None, [0, 1, 2], 16),  # 48 > 32
        ]:
            with code(S.LLM_PARAM_INVALID):
                call()

    def test_key_config_param_invalid(self, ra_pair):
        p, _ = ra_pair
        cm = p.cm
        src, _ = p.register(4, [2, 32])
        blocks, _ = p.register(4, [4, 16], blocks=True)
        by_id = llm.CacheKeyByIdAndIndex(DECODER_ID, 1)
        by_blocks = llm.BlocksCacheKey(DECODER_ID, 0)
        K = llm.TransferWithCacheKeyConfig
        with pytest.raises(TypeError):  # ranges required (hixl v2/llm_types.py, at construction)
            cm.transfer_cache_async(src, Sync(), [K(by_id)])
        for call in [
            lambda: cm.transfer_cache_async(src, Sync(), [K(by_id, range(2), range(1))]),
            lambda: cm.transfer_cache_async(src, Sync(), [K(by_id, range(1), range(1))],
                                            None, [0], 16),  # contiguous destination
            lambda: cm.transfer_cache_async(blocks, Sync(), [K(by_blocks, range(1), range(1))],
                                            [0], [0], 8),  # smaller than a source block
        ]:
            with code(S.LLM_PARAM_INVALID):
                call()

    def test_source_must_exist(self, setup, pair):
        cm, _, _, cfg = setup
        p, _ = pair
        gone, _ = p.register(4, [2, 32])
        p.cm.unregister_cache(gone.cache_id)
        with code(S.LLM_KV_CACHE_NOT_EXIST):
            cm.transfer_cache_async(gone, Sync(), [cfg])

    def test_transfer_config_setters(self):
        cfg = llm.TransferConfig(1, [4096, 8192])
        with pytest.raises(TypeError):
            cfg.dst_addrs = 4096
        with pytest.raises(ValueError):
            cfg.dst_cluster_id = -1
        with code(S.LLM_PARAM_INVALID):
            cfg.src_layer_range = range(0, 4, 2)
        with pytest.raises(TypeError):
            llm.TransferWithCacheKeyConfig(llm.CacheKey(1, 1))


# ================================================================================ core


class TestCore:
    def test_the_core_refuses_spans_with_the_face_s_texts(self, pair):
        """The spans' refusals are the core's (PlanLayerSpans, CheckAddressSpans), raised from
        the call as LLMException PARAM_INVALID with the texts the Python planners had."""
        p, _ = pair
        src, _ = p.register(2, [3, 100])  # 1 layer, 3 slots of 100 bytes
        blocks, _ = p.register(2, [4, 16], blocks=True)
        top = 2**64 - 64  # slot 1 (offset 100) of 100 bytes ends past 2**64 - 1
        for call, text in [
            (lambda: p.cm.transfer_cache_async(src, Sync(), [llm.TransferConfig(
                DECODER_ID, [top, 4096], None, 1)]),
             f"dst address {top:#x} plus a span offset overflows 64 bits"),
            (lambda: p.cm.transfer_cache_async(src, Sync(), [llm.TransferConfig(
                DECODER_ID, [4096, 8192], None, 0)], None, [0, 1, 2], 50),
             "3 destination blocks of 50 bytes do not fit a source slot of 100 bytes"),
            (lambda: p.cm.transfer_cache_async(blocks, Sync(), [llm.TransferConfig(
                DECODER_ID, [4096, 8192])], [0], [0], 8),
             "dst_block_memory_size 8 is smaller than a source block (16 bytes)"),
            (lambda: p.cm.transfer_cache_async(blocks, Sync(), [llm.TransferConfig(
                DECODER_ID, [4096, 8192])], [4], [0]),
             "src block 4 out of range [0, 4)"),
            (lambda: p.cm.transfer_cache_async(src, Sync(), [llm.TransferConfig(
                DECODER_ID, [4096, 8192])], None, [2**63], 64),
             f"dst block {2**63} is out of range: its offset (64 bytes a block) overflows "
             "64 bits"),
        ]:
            with code(S.LLM_PARAM_INVALID) as info:
                call()
            assert text in str(info.value), (text, str(info.value))

    def test_runner_reports_each_job(self):
        sent, reports, done = [], {}, threading.Event()

        def send_ok(i):
            sent.append(("ok", i))

        def send_fails(i):
            raise NotLinked("gone")

        jobs = [layerwise.LayerJob(range(0, 3), send_ok),
                layerwise.LayerJob(range(1, 2), send_fails),
                layerwise.LayerJob(range(4, 5), send_ok)]
        layerwise.LayerwiseTransfer(5, lambda i: i != 4, jobs,
                                    lambda k, c: reports.setdefault(k, c), done.set).start()
        assert done.wait(5)
        # layer 1 goes to job 0, then fails for job 1: the transfer stops there (LLM-DataDist's
        # TransferCacheJob.transfer_layers), so jobs 0 and 2 never end and report nothing
        assert sent == [("ok", 0), ("ok", 1)]
        assert reports == {1: Code.NOT_YET_LINK}


class TestAddressKind:
    """Key kind 4 on the wire and at the core's owner."""

    def test_write_only_on_the_wire(self):
        from datadist.core.errors import LocalProtocolError, RemoteProtocolError
        from datadist.wire import protocol as p

        u32 = np.zeros(1, np.uint32)
        u64 = np.array([4096], np.uint64)
        write = p.Write(p.KeyRef(p.KeyKind.ADDRESS), 0, 0, u32, u64, u64)
        frame = p.encode(write, 3)
        (rid, got), = p.FrameDecoder().feed(frame)[:1]
        assert rid == 3 and got.key.kind == p.KeyKind.ADDRESS
        read = p.Read(p.KeyRef(p.KeyKind.ADDRESS), 0, p.ReadFlags.NONE, u32, u64, u64)
        with pytest.raises(LocalProtocolError):
            p.encode(read)
        forged = bytearray(frame)
        forged[3] = p.MsgType.READ
        with pytest.raises(RemoteProtocolError, match="WRITE only"):
            p.FrameDecoder().feed(bytes(forged))

    def test_the_owner_writes_raw_addresses_inside_one_tensor_only(self, make_side):
        """Over the wire to the core's owner (Registry::OpenAddresses): a WRITE by raw
        addresses lands exactly at those addresses of the tensor holding them; spans leaving
        that tensor, or two pseudo-tensors, are refused (PARAM_INVALID, nothing written, the
        connection usable). The rest of the rules: cpp/tests/registry_test.cc
        (Native.AnAddressWrite*, UnknownPrivateAndEmptyAddressSpansGetOneAnswer,
        MalformedAddressWritesAreRefused)."""
        import socket

        from datadist.wire import protocol as p

        side = make_side(PROMPT_ID)
        _, arr = side.register(2, [4, 64])
        base = int(arr[1].ctypes.data)
        sock = socket.create_connection(side.engine.listen_address, timeout=5.0)
        dec, got = p.FrameDecoder(), []

        def call(msg, rid, raw=b""):
            sock.sendall(p.encode(msg, rid) if msg is not None else raw)
            while not got:
                chunk = sock.recv(65536)
                assert chunk, "the owner closed the connection"
                got.extend(dec.feed(chunk))
            answer_rid, answer = got.pop(0)
            assert answer_rid == rid
            return answer

        def write(tensors, offsets, lengths, rid):
            return call(p.Write(p.KeyRef(p.KeyKind.ADDRESS), 0, 0, np.array(tensors, np.uint32),
                                np.array(offsets, np.uint64), np.array(lengths, np.uint64)), rid)

        try:
            assert isinstance(call(p.Hello(DECODER_ID, 2, 1, 0, b"\1" * 16), 1), p.Welcome)
            assert isinstance(write([0], [base + 64, base + 192], [64, 64], 2), p.Ok)
            assert isinstance(call(None, 2, b"\xab" * 128), p.Ok)  # the bytes landed
            want = np.zeros(256, np.uint8)
            want[64:128] = want[192:256] = 0xAB
            assert np.array_equal(arr[1].reshape(-1), want) and not arr[0].any()
            for rid, (tensors, offsets, lengths) in enumerate(
                    [([0], [base, base + 200], [64, 64]),  # the second span leaves tensor 1
                     ([0, 0], [base + 64], [1])], start=4):  # two pseudo-tensors
                answer = write(tensors, offsets, lengths, rid)
                assert isinstance(answer, p.Error) and answer.code == Code.PARAM_INVALID, answer
            assert isinstance(call(p.Ping(9), 9), p.Pong)
            assert np.array_equal(arr[1].reshape(-1), want)
        finally:
            sock.close()


# ================================================================ blocks source without indices


class TestBlocksSourceWithoutIndices:
    """hicann/hixl examples/python/transfer_cache_async_sample.py calls
    ``transfer_cache_async(blocks_cache, sync, [TransferWithCacheKeyConfig(BlocksCacheKey(
    decoder, 0), range(0, 1), range(0, 1))])``: no block indices. The original checks indices
    only when given (llm_utils.transfer_cache_async); its native side then copies cache to
    cache with a blocks cache's batch being one block (layer_wise_transfer_job.cc,
    GenerateCacheToCacheTask; cache_manager.cc, CreateCacheEntry: batch_size 1, stride one
    block): block 0 of each tensor of the layer lands at block 0 of the destination."""

    def test_the_sample_call_moves_block_0_of_each_tensor_of_the_layer(self, ra_pair):
        p, d = ra_pair
        src, a = p.register(4, [3, 40], blocks=True, model_id=0, seed=11)  # 2 layers
        _, b = d.register(4, [3, 40], blocks=True, model_id=0)
        cfg = llm.TransferWithCacheKeyConfig(llm.BlocksCacheKey(DECODER_ID, 0), range(0, 1),
                                             range(0, 1))
        task = p.cm.transfer_cache_async(src, Sync(), [cfg])
        assert task.get_results(WAIT) == [S.LLM_SUCCESS]
        want = np.zeros_like(b)
        units(want, 3)[0:2, 0] = units(a, 3)[0:2, 0]  # layer 0 = tensors 0, 1; block 0
        np.testing.assert_array_equal(b, want)

    def test_to_a_slot_by_cache_id(self, ra_pair):
        p, d = ra_pair
        src, a = p.register(2, [4, 16], blocks=True, seed=12)
        dst, b = d.register(2, [3, 16])  # contiguous, 3 slots
        key = llm.CacheKeyByIdAndIndex(DECODER_ID, dst.cache_id, 2)
        task = p.cm.transfer_cache_async(src, Sync(), [llm.TransferWithCacheKeyConfig(
            key, range(0, 1), range(0, 1))])
        assert task.get_results(WAIT) == [S.LLM_SUCCESS]
        want = np.zeros_like(b)
        units(want, 3)[:, 2] = units(a, 4)[:, 0]
        np.testing.assert_array_equal(b, want)

    def test_into_destination_blocks_the_whole_tensor_is_cut(self, ra_pair):
        """GenerateCacheToBlocksTask: chunk k of the source tensor -> destination block k."""
        p, d = ra_pair
        src, a = p.register(2, [4, 16], blocks=True, seed=13)  # 64-byte tensors
        _, b = d.register(2, [8, 16], blocks=True, model_id=0)
        cfg = llm.TransferWithCacheKeyConfig(llm.BlocksCacheKey(DECODER_ID, 0), range(0, 1),
                                             range(0, 1))
        task = p.cm.transfer_cache_async(src, Sync(), [cfg], None, [7, 1, 4], 16)
        assert task.get_results(WAIT) == [S.LLM_SUCCESS]
        want = np.zeros_like(b)
        units(want, 8)[:, [7, 1, 4]] = units(a, 4)[:, [0, 1, 2]]
        np.testing.assert_array_equal(b, want)

    def test_a_contiguous_slot_into_a_blocks_key_without_indices(self, ra_pair):
        """A BlocksCacheKey destination takes source slot 0 (llm_utils.TransferCacheJob.
        transfer_layer passes batch index 0 for it; TransferWithCacheKeyConfig refuses any
        other src_batch_index with a BlocksCacheKey at construction)."""
        p, d = ra_pair
        src, a = p.register(2, [2, 16], seed=14)
        _, b = d.register(2, [4, 16], blocks=True, model_id=0)
        with code(S.LLM_PARAM_INVALID):
            llm.TransferWithCacheKeyConfig(llm.BlocksCacheKey(DECODER_ID, 0), range(0, 1),
                                           range(0, 1), 1)
        cfg = llm.TransferWithCacheKeyConfig(llm.BlocksCacheKey(DECODER_ID, 0), range(0, 1),
                                             range(0, 1))
        task = p.cm.transfer_cache_async(src, Sync(), [cfg])
        assert task.get_results(WAIT) == [S.LLM_SUCCESS]
        want = np.zeros_like(b)
        units(want, 4)[:, 0] = units(a, 2)[:, 0]
        np.testing.assert_array_equal(b, want)

    def test_param_invalid(self, ra_pair):
        p, _ = ra_pair
        blocks, _ = p.register(2, [4, 16], blocks=True)
        src, _ = p.register(2, [4, 16])
        key = llm.BlocksCacheKey(DECODER_ID, 0)
        for call in [  # a blocks cache is one batch slot: src_batch_index 0 only
            lambda: p.cm.transfer_cache_async(blocks, Sync(), [llm.TransferWithCacheKeyConfig(
                llm.CacheKeyByIdAndIndex(DECODER_ID, 1), range(1), range(1), 1)]),
            lambda: p.cm.transfer_cache_async(src, Sync(), [llm.TransferWithCacheKeyConfig(
                key, range(1), range(1))], [0], [0]),  # src indices need a blocks source
        ]:
            with code(S.LLM_PARAM_INVALID):
                call()

    def test_to_our_own_cluster_id_is_a_transfer_result_not_a_refusal(self, ra_pair):
        """No 'own cluster' rule in the original (llm_utils.transfer_cache_async checks no
        cluster id); with no link to that id the task reports LLM_NOT_YET_LINK."""
        p, _ = ra_pair
        src, _ = p.register(2, [2, 16], seed=1)
        task = p.cm.transfer_cache_async(src, Sync(), [llm.TransferWithCacheKeyConfig(
            llm.CacheKeyByIdAndIndex(PROMPT_ID, 1), range(1), range(1))])
        assert task.get_results(WAIT) == [S.LLM_NOT_YET_LINK]


