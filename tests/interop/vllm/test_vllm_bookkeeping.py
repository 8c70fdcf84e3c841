"""The datadist vLLM connector's scheduler-side bookkeeping, settings and mailbox records.

No vLLM and no engine: these run everywhere (the parts under test import neither).
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from datadist.integrations.vllm import mailbox
from datadist.integrations.vllm.scheduler import SchedulerSide
from datadist.integrations.vllm.settings import PARAMS_KEY, RemoteRequest, Settings, WorkerAddress

BS = 32


def producer(**kw) -> SchedulerSide:
    s = SchedulerSide(Settings(**kw), engine_id="P", block_size=BS, producer=True,
                      consumer=False)
    s.set_workers([WorkerAddress("10.0.0.1", 4000, 77)])
    return s


def consumer() -> SchedulerSide:
    return SchedulerSide(Settings(), engine_id="D", block_size=BS, producer=False,
                         consumer=True)


def finish(s: SchedulerSide, rid: str = "r1", blocks=(4, 9, 2), tokens: int = 75,
           ok: bool = True, params: dict | None = None):
    params = {"do_remote_decode": True} if params is None else params
    return s.finished(rid, params, finished_ok=ok, block_ids=list(blocks),
                      num_computed_tokens=tokens)


# ---------------------------------------------------------------------- prefill side


def test_finished_request_is_held_with_nixl_style_params():
    s = producer()
    delay, params = finish(s)
    assert delay is True
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_block_ids"] == [4, 9, 2]
    assert params["remote_request_id"] == "r1" and params["remote_engine_id"] == "P"
    assert (params["remote_host"], params["remote_port"]) == ("10.0.0.1", 4000)
    assert params["remote_num_tokens"] == 75
    dd = params[PARAMS_KEY]
    assert dd["workers"] == [["10.0.0.1", 4000, 77]] and dd["block_size"] == BS
    meta = s.build_meta()
    assert [(t.request_id, t.slot, t.tag) for t in meta.send] == [("r1", dd["slot"], dd["tag"])]
    assert s.build_meta().send == []  # handed over once
    assert s.held == 1


@pytest.mark.parametrize("kw", [
    {"ok": False},                                  # aborted: nobody will pull
    {"params": {}},                                 # not a disaggregated request
    {"params": {"do_remote_decode": False}},
    {"blocks": ()},                                 # nothing computed
])
def test_requests_not_to_hold_are_freed_at_once(kw):
    s = producer()
    assert finish(s, **kw) == (False, None)
    assert s.build_meta().send == [] and s.held == 0


def test_consumer_only_instance_never_holds():
    assert finish(consumer()) == (False, None)


def test_without_worker_address_nothing_is_held():
    s = SchedulerSide(Settings(), engine_id="P", block_size=BS, producer=True, consumer=False)
    assert finish(s) == (False, None)


def test_slots_are_unique_while_held_and_reused_after_sent():
    s = producer(mailbox_slots=2)
    _, a = finish(s, "a")
    _, b = finish(s, "b")
    assert a[PARAMS_KEY]["slot"] != b[PARAMS_KEY]["slot"]
    assert a[PARAMS_KEY]["tag"] != b[PARAMS_KEY]["tag"]
    assert finish(s, "c") == (False, None)  # all slots held: the decoder recomputes
    s.sent({"a", "unknown"})
    delay, c = finish(s, "c")
    assert delay and c[PARAMS_KEY]["slot"] == a[PARAMS_KEY]["slot"]
    assert c[PARAMS_KEY]["tag"] != a[PARAMS_KEY]["tag"]  # a late DONE for "a" cannot free "c"
    assert s.held == 2


# ---------------------------------------------------------------------- decode side


def test_decode_matches_the_prompt_asynchronously_and_pulls_once():
    p = producer()
    _, params = finish(p, blocks=(4, 9, 2, 11), tokens=75)  # a block beyond the prompt
    d = consumer()
    assert d.matched_tokens(75, 0, params) == (75, True)
    assert d.matched_tokens(75, 0, params) == (75, True)  # side-effect free
    assert d.matched_tokens(75, 64, params) == (11, True)
    d.after_alloc("d1", params, [20, 21, 22], 75)
    assert params["do_remote_prefill"] is False
    meta = d.build_meta()
    assert len(meta.recv) == 1
    task = meta.recv[0]
    assert task.request_id == "d1" and task.local_block_ids == [20, 21, 22]
    assert task.remote.blocks_for(3) == [4, 9, 2]
    # A second allocation after the load, and later steps, pull nothing more.
    d.after_alloc("d1", params, [23], 0)
    assert d.matched_tokens(76, 75, params) == (0, False)
    assert d.build_meta().recv == []


def test_prefix_hit_pulls_only_the_missing_tail():
    _, params = finish(producer(), blocks=(4, 9, 2), tokens=75)
    remote = RemoteRequest.parse(params)
    assert remote.blocks_for(1) == [2]
    assert remote.blocks_for(0) == []
    with pytest.raises(ValueError, match="holds only 3"):
        remote.blocks_for(4)


def test_no_external_tokens_means_no_pull():
    _, params = finish(producer())
    d = consumer()
    d.after_alloc("d1", params, [], 0)
    assert d.build_meta().recv == [] and params["do_remote_prefill"] is False


@pytest.mark.parametrize("params", [
    None, {}, {"do_remote_prefill": False},
    {"do_remote_prefill": True, "remote_block_ids": [1]},           # a NIXL prefill's params
    {"do_remote_prefill": True, "remote_block_ids": [1],
     PARAMS_KEY: {"workers": [], "block_size": BS, "slot": 0, "tag": "00" * 16}},
    {"do_remote_prefill": True, "remote_block_ids": [1],
     PARAMS_KEY: {"workers": [["h", 1, 2]], "block_size": BS, "slot": 0, "tag": "zz"}},
])
def test_unusable_params_fall_back_to_recompute(params):
    assert consumer().matched_tokens(75, 0, params) == (0, False)


def test_block_size_mismatch_falls_back_to_recompute():
    _, params = finish(producer())
    d = SchedulerSide(Settings(), engine_id="D", block_size=16, producer=False, consumer=True)
    assert d.matched_tokens(75, 0, params) == (0, False)


def test_params_survive_a_json_router():
    import json

    _, params = finish(producer())
    again = json.loads(json.dumps(params))
    assert RemoteRequest.parse(again) == RemoteRequest.parse(params)
    assert consumer().matched_tokens(75, 0, again) == (75, True)


def test_per_group_block_ids_are_accepted():
    _, params = finish(producer())
    params["remote_block_ids"] = [params["remote_block_ids"]]  # vLLM's tuple-of-groups form
    assert RemoteRequest.parse(params).block_ids == [4, 9, 2]


# ---------------------------------------------------------------------- settings, mailbox


def test_settings_from_extra_config_and_env():
    s = Settings.from_extra_config({"port": "5000", "sync_kv_timeout_ms": 250, "other": 1},
                                   env={"VLLM_DATADIST_ABORT_TIMEOUT": "7.5"})
    assert (s.port, s.sync_kv_timeout_ms, s.abort_timeout_s) == (5000, 250, 7.5)
    s = Settings.from_extra_config({"abort_timeout_s": 1},
                                   env={"VLLM_DATADIST_ABORT_TIMEOUT": "7.5"})
    assert s.abort_timeout_s == 1.0  # the explicit config wins
    assert Settings.from_extra_config(None, env={}) == Settings()


@pytest.mark.parametrize("extra", [{"port": 70000}, {"port": "x"}, {"mailbox_slots": 0},
                                   {"sync_kv_timeout_ms": -1}, {"abort_timeout_s": -2},
                                   {"mode": "push"}, {"layerwise_timeout_s": 0},
                                   {"idle_wait_ms": -1}, {"transfer_cpus": "some"},
                                   {"transfer_cpus": "3-1"}, {"transfer_cpus": ""},
                                   {"transfer_cpus": "1024"}])
def test_bad_settings_raise(extra):
    with pytest.raises(ValueError):
        Settings.from_extra_config(extra, env={})


def test_transfer_cpus_leave_a_compute_thread_s_one_core():
    """``transfer_cpus``: "auto" moves datadist's threads off a thread pinned to one CPU (an
    OpenMP-bound compute thread) onto the CPUs the process may use, and leaves a thread that
    may use several alone; "inherit" never moves them; a list names them."""
    import os

    from datadist.core.threads import cgroup_cpus, node_cpus

    auto = Settings.from_extra_config({}, env={})
    assert auto.transfer_cpus == "auto"
    cpu = min(os.sched_getaffinity(0))
    near = set(node_cpus(cpu) or cgroup_cpus()) & set(cgroup_cpus())
    assert auto.thread_cpus(pinned={cpu}) == sorted(near)
    assert cpu in near
    assert auto.thread_cpus(pinned={0, 1}) is None
    inherit = Settings.from_extra_config({"transfer_cpus": "inherit"}, env={})
    assert inherit.thread_cpus(pinned={1}) is None
    listed = Settings.from_extra_config({"transfer_cpus": "0, 2-3"}, env={})
    assert listed.thread_cpus(pinned={1}) == [0, 2, 3]


def test_mailbox_records():
    tag, other = bytes(range(16)), bytes(16 * [9])
    box = mailbox.Mailbox(4)
    box.hold(2, tag)
    assert mailbox.decode(box.buf[2]) == (tag, mailbox.HELD)
    assert not box.is_done(2, tag)
    box.buf[2] = mailbox.encode(other, mailbox.DONE)  # a stale DONE of another request
    assert not box.is_done(2, tag)
    box.buf[2] = mailbox.encode(tag, mailbox.DONE)
    assert box.is_done(2, tag)
    box.clear(2)
    assert not box.buf.any()
    with pytest.raises(ValueError):
        mailbox.encode(b"short", mailbox.HELD)
    assert mailbox.encode(tag, mailbox.HELD).dtype == np.uint8


def test_importing_datadist_and_the_bookkeeping_does_not_import_vllm():
    code = ("import sys, datadist, datadist.integrations.vllm, "
            "datadist.integrations.vllm.scheduler, datadist.integrations.vllm.worker; "
            "assert 'vllm' not in sys.modules, 'vllm imported'; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_the_removed_engine_keys_of_old_configs_are_ignored():
    """``yield_us`` and ``engine`` configured the removed Python engine (and its patch of
    vLLM's spin loop): an old kv_connector_extra_config that still has them parses, as any
    unknown key does, and nothing of vLLM is patched any more (no spin module)."""
    import importlib.util

    s = Settings.from_extra_config({"yield_us": 500, "engine": "python", "port": 7})
    assert s.port == 7 and not hasattr(s, "yield_us") and not hasattr(s, "engine")
    assert importlib.util.find_spec("datadist.integrations.vllm.spin") is None


# ---------------------------------------------------------------------- layer-wise mode

TAG = "ab" * 16


def lw_decode_params(tag: str = TAG) -> dict:
    return {"do_remote_prefill": True,
            PARAMS_KEY: {"mode": "layerwise", "tag": tag, "block_size": BS,
                         "workers": [["10.0.0.1", 4000, 77]]}}


def test_layerwise_settings():
    s = Settings.from_extra_config({"mode": "layerwise", "layerwise_timeout_s": "2.5",
                                    "idle_wait_ms": 0}, env={})
    assert (s.mode, s.layerwise_timeout_s, s.idle_wait_ms) == ("layerwise", 2.5, 0)
    assert Settings().mode == "pull"  # pull stays the default


def test_layerwise_decoder_loads_the_whole_prompt_asynchronously_once():
    s = SchedulerSide(Settings(mode="layerwise"), engine_id="D", block_size=BS,
                      producer=False, consumer=True)
    params = lw_decode_params()
    assert s.matched_tokens(75, 0, params) == (75, True)
    assert s.matched_tokens(75, 32, params) == (43, True)  # a local prefix hit
    s.after_alloc("d1", params, [7, 8], 43, 75)
    s.after_alloc("d1", params, [7, 8], 43, 75)  # vLLM calls again after the load
    meta = s.build_meta()
    assert [(t.request_id, t.local_block_ids, t.remote.tag) for t in meta.lw_recv] == \
        [("d1", [7, 8], TAG)]
    assert meta.recv == [] and s.build_meta().lw_recv == []


@pytest.mark.parametrize("mode", ["pull", "layerwise"])
def test_layerwise_params_a_decoder_cannot_use_are_recomputed(mode):
    s = SchedulerSide(Settings(mode=mode), engine_id="D", block_size=BS, producer=False,
                      consumer=True)
    bad = lw_decode_params()
    if mode == "layerwise":
        bad[PARAMS_KEY]["block_size"] = 16
    assert s.matched_tokens(75, 0, bad) == (0, False)
    assert s.matched_tokens(75, 0, {**lw_decode_params(), PARAMS_KEY: {
        "mode": "layerwise", "tag": "xyz"}}) == (0, False)


def lw_prefill() -> SchedulerSide:
    s = SchedulerSide(Settings(mode="layerwise"), engine_id="P", block_size=BS,
                      producer=True, consumer=False)
    s.set_workers([WorkerAddress("10.0.0.1", 4000, 77)])
    return s


def test_layerwise_prefill_hands_each_step_to_the_workers_and_holds_until_pushed():
    s = lw_prefill()
    params = {"do_remote_decode": True, PARAMS_KEY: {"mode": "layerwise", "tag": TAG}}
    s.after_alloc("p1", params, [], 0, 75)
    s.scheduled([("p1", [4, 9], 0), ("other", [1], 0)], [], {"p1": 40, "other": 5})
    s.scheduled([], [("p1", [2], 40, False)], {"p1": 35})  # a second chunk, one more block
    steps = s.build_meta().lw_steps
    assert [(e.request_id, e.block_ids, e.computed_before, e.scheduled, e.prompt_len)
            for e in steps] == [("p1", [4, 9], 0, 40, 75), ("p1", [4, 9, 2], 40, 35, 75)]
    s.scheduled([], [("p1", None, 75, False)], {"p1": 1})  # decoding: nothing to push
    assert s.build_meta().lw_steps == []
    delay, out = s.finished("p1", params, finished_ok=True, block_ids=[4, 9, 2],
                            num_computed_tokens=75)
    assert delay is True
    assert out == {PARAMS_KEY: {"mode": "layerwise", "block_size": BS,
                                "workers": [["10.0.0.1", 4000, 77]]}}
    assert s.build_meta().lw_release == [("p1", True)]


def test_layerwise_prefill_ended_before_its_first_step_refuses_the_plan():
    s = lw_prefill()
    params = {"do_remote_decode": True, PARAMS_KEY: {"mode": "layerwise", "tag": TAG}}
    s.after_alloc("p1", params, [], 0, 75)
    assert s.finished("p1", params, finished_ok=False, block_ids=[],
                      num_computed_tokens=0)[0] is False
    meta = s.build_meta()
    assert meta.lw_refuse == [TAG] and meta.lw_release == []


def test_layerwise_answer_without_a_tag_names_the_workers_and_holds_nothing():
    s = lw_prefill()
    hello = {"do_remote_decode": True, PARAMS_KEY: {"mode": "layerwise"}}
    s.after_alloc("h", hello, [], 0, 3)
    s.scheduled([("h", [0], 0)], [], {"h": 3})
    assert s.build_meta().lw_steps == []
    delay, out = s.finished("h", hello, finished_ok=True, block_ids=[0],
                            num_computed_tokens=3)
    assert delay is False and out is not None
    assert out[PARAMS_KEY]["workers"] == [["10.0.0.1", 4000, 77]]
    assert s.held == 0
