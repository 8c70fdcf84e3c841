"""The connector's GPU path (staging.py, kv_buffer_device "cpu") between two real processes,
without vLLM or a GPU: each process's "GPU" is the CUDA stand-in of _fake_cuda.py, whose
kernels and copies run late, in stream order, with real bytes.

The prefill process drives its worker and staging the way connector.py does at vLLM's hooks
(begin_step at start_load_kv, the model's KV writes queued as kernels, save_layer per layer,
wait_for_save, hold at the next start_load_kv); this process is the decoder: it pulls into its
host mirror, copies to its "device" and fences before the request counts as received. The
bytes are checked where the decoder's next forward reads them: the device tensors, read by a
kernel queued after the report.
"""

from __future__ import annotations

import multiprocessing as mp
import re
import time
from types import SimpleNamespace

import pytest
import torch

from datadist.integrations.vllm import staging
from datadist.integrations.vllm.layerwise import (
    LayerwiseRecvTask,
    LayerwiseRemote,
    LayerwiseStep,
)
from datadist.integrations.vllm.layout import kv_layout
from datadist.integrations.vllm.scheduler import RecvTask, SendTask
from datadist.integrations.vllm.settings import RemoteRequest, Settings, WorkerAddress
from datadist.integrations.vllm.staging import Staging
from datadist.integrations.vllm.worker import DatadistWorker

from ._fake_cuda import FakeCuda

pytestmark = pytest.mark.timeout(90)

LAYERS, BLOCKS, BS = 3, 16, 4
SHAPE = (2, BLOCKS, BS, 2, 8)  # a CUDA backend's [2, num_blocks, block_size, heads, dim]
TAG = "3e" * 16
PROMPT = 10  # tokens: blocks SRC[0] (full), SRC[1] (full), SRC[2] (half)
SRC = [5, 9, 3]
LOCAL = [0, 7, 2]


def _value(layer: int, token: int) -> float:
    return 1000.0 * layer + 10.0 * token


def _expected_block(layer: int, i: int) -> torch.Tensor:
    """The prefill's device block SRC[i] of ``layer`` once the prompt is computed."""
    blk = torch.full((2, BS, 2, 8), -1.0)
    for t in range(i * BS, min((i + 1) * BS, PROMPT)):
        blk[:, t % BS] = _value(layer, t)
    return blk


def _gpu_worker(settings: Settings, gpu: FakeCuda, *, producer: bool,
                on_pulled=None) -> tuple[DatadistWorker, Staging, list[torch.Tensor]]:
    """A worker of a CUDA vLLM as connector.register_kv_caches sets it up: device tensors
    (initially -1), their host mirror registered with datadist, the staging bound to it."""
    dev = {f"layer.{i}": torch.full(SHAPE, -1.0) for i in range(LAYERS)}
    mirror = {k: gpu.host_like(t).fill_(-2.0) for k, t in dev.items()}
    layout, _ = kv_layout(mirror)
    parts = [p for t in dev.values() for p in staging.split_layer(t)]
    host = [p for t in mirror.values() for p in staging.split_layer(t)]
    st = Staging(parts, host, 2, BS, gpu, "cpu", settings.sync_kv_timeout_ms / 1e3)
    w = DatadistWorker(settings, producer=producer, consumer=not producer,
                       on_pulled=on_pulled)
    w.start(layout)
    st.bind(w)
    return w, st, list(dev.values())


def _kernel(dev: list[torch.Tensor], layers: range, tokens: range):
    """The model writing ``tokens``' KV of ``layers`` (queued on the compute stream)."""
    def run() -> None:
        for layer in layers:
            for t in tokens:
                dev[layer][:, SRC[t // BS], t % BS] = _value(layer, t)
    return run


def _serve(w: DatadistWorker, cmd_q, out_q, rid: str) -> None:
    freed: set[str] = set()
    deadline = time.monotonic() + 40
    while rid not in freed and time.monotonic() < deadline:
        freed |= w.poll_sent()
        if not cmd_q.empty() and cmd_q.get() == "stop":
            break
        time.sleep(0.005)
    out_q.put(sorted(freed))
    w.close()


def _pull_prefill(addr_q, cmd_q, out_q) -> None:
    """Prefill in pull mode: two chunked steps (6 and 4 tokens), then the request is held."""
    gpu = FakeCuda(pace=1, first="staging")
    w, st, dev = _gpu_worker(Settings(), gpu, producer=True)
    assert w.address is not None
    addr_q.put((w.address.host, w.address.port, w.cluster_id))
    for tokens in (range(0, 6), range(6, PROMPT)):
        sm = torch.tensor([SRC[t // BS] * BS + t % BS for t in tokens] + [-1, -1])
        st.begin_step({"layer.0": SimpleNamespace(slot_mapping=sm)})  # start_load_kv
        gpu.launch(_kernel(dev, range(LAYERS), tokens))  # the forward
        st.wait_for_save()
    st.begin_step(None)  # the next step's start_load_kv: the request finished, hold it
    st.hold([SendTask("p1", 3, TAG)])
    _serve(w, cmd_q, out_q, "p1")


def _lw_prefill(addr_q, cmd_q, out_q) -> None:
    """Prefill in layer-wise mode: tokens 0..3 (block SRC[0]) are a prefix-cache hit already
    on the device; two steps compute 4..7 and 8..9, each layer saved as it is queued."""
    gpu = FakeCuda(pace=1, first="staging")
    w, st, dev = _gpu_worker(Settings(mode="layerwise"), gpu, producer=True)
    lw = w.lw_producer
    assert lw is not None and w.address is not None
    _kernel(dev, range(LAYERS), range(0, 4))()  # computed by an earlier request
    addr_q.put((w.address.host, w.address.port, w.cluster_id))
    for tokens in (range(4, 8), range(8, PROMPT)):
        lw.step(st.lw_step([LayerwiseStep("p1", TAG, SRC, tokens.start, len(tokens), PROMPT,
                                          BS)]))
        for layer in range(LAYERS):
            gpu.launch(_kernel(dev, range(layer, layer + 1), tokens))
            ready = st.save_layer(layer)
            if ready >= 0:
                lw.save_layer(ready)
            time.sleep(0.02)  # the next layer's compute: the decoder pulls meanwhile
        last = st.wait_for_save()
        if last >= 0:
            lw.save_layer(last)
        lw.wait_for_save()
        w.poll_sent()
    lw.release("p1", True)
    st.lw_released("p1")
    _serve(w, cmd_q, out_q, "p1")


@pytest.fixture
def prefill():
    ctx = mp.get_context("spawn")
    procs = []

    def start(target):
        addr_q, cmd_q, out_q = ctx.Queue(), ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=target, args=(addr_q, cmd_q, out_q), daemon=True)
        p.start()
        procs.append(p)
        return addr_q.get(timeout=30), cmd_q, out_q

    yield start
    for p in procs:
        p.kill()
        p.join(5)


def _receive(w: DatadistWorker, st: Staging, gpu: FakeCuda,
             dev: list[torch.Tensor]) -> list[torch.Tensor]:
    """connector.get_transfer_results until the request is reported, then the next forward
    (a kernel that reads the KV) runs: what it read."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, failed = w.poll_recv()
        if done:
            assert (done, failed) == ({"d1"}, set())
            st.fence()
            break
        time.sleep(0.002)
    else:
        raise AssertionError("the request never arrived")
    assert gpu.pending > 0  # the copies to the device are queued, not waited for
    seen: list[list[torch.Tensor]] = []
    gpu.launch(lambda: seen.append([t.clone() for t in dev]))
    gpu.drain()
    return seen[0]


def _check(read: list[torch.Tensor]) -> None:
    for layer in range(LAYERS):
        for i, b in enumerate(LOCAL):
            assert torch.equal(read[layer][:, b], _expected_block(layer, i)), (layer, b)
        others = [b for b in range(BLOCKS) if b not in LOCAL]
        assert (read[layer][:, others] == -1.0).all()  # nothing else written


def test_staged_pull_lands_every_byte_on_the_decoders_device(prefill):
    addr, cmd_q, out_q = prefill(_pull_prefill)
    gpu = FakeCuda(pace=1)
    holder: dict[str, Staging] = {}

    def pulled(task: RecvTask) -> None:  # connector._pulled
        holder["st"].received(list(task.local_block_ids), every_layer=True)

    w, st, dev = _gpu_worker(Settings(), gpu, producer=False, on_pulled=pulled)
    holder["st"] = st
    try:
        host, port, cid = addr
        params = {"remote_block_ids": SRC, "remote_num_tokens": PROMPT,
                  "remote_request_id": "p1",
                  "datadist": {"workers": [[host, port, cid]], "block_size": BS, "slot": 3,
                               "tag": TAG}}
        w.submit([RecvTask("d1", LOCAL, RemoteRequest.parse(params))])
        _check(_receive(w, st, gpu, dev))
        assert st.stats == {"d2h_blocks": 0, "h2d_blocks": 3, "fences": 1}
        assert out_q.get(timeout=40) == ["p1"]  # freed by the decoder's DONE
    finally:
        w.close()


def test_staged_layerwise_copies_each_layer_as_it_lands(prefill):
    addr, cmd_q, out_q = prefill(_lw_prefill)
    gpu = FakeCuda(pace=1)
    w, st, dev = _gpu_worker(Settings(mode="layerwise"), gpu, producer=False)
    assert w.lw_consumer is not None and w.lw_consumer.on_layers == st.layers_landed
    landed: list[range] = []
    w.lw_consumer.on_layers = lambda rid, layers, ids: (landed.append(layers),
                                                        st.layers_landed(rid, layers, ids))
    try:
        w.submit_layerwise([LayerwiseRecvTask(
            "d1", LOCAL, LayerwiseRemote(TAG, [WorkerAddress(*addr)], BS))])
        _check(_receive(w, st, gpu, dev))
        # every layer copied to the device as its pull landed, in more than one pull
        assert {i for r in landed for i in r} == set(range(LAYERS)) and len(landed) > 1
        assert out_q.get(timeout=40) == ["p1"]  # freed once the decoder acknowledged
    finally:
        w.close()


def test_a_gpu_memory_decoder_refuses_a_link_that_is_not_nixl(prefill, caplog):
    """kv_buffer_device "cuda": the decoder's link must be NIXL; over any other path (here
    the default one, NIXL not asked for) its requests fail with the link's path, and the
    link is dropped, instead of aiming host-memory reads at GPU addresses."""
    addr, cmd_q, _ = prefill(_pull_prefill)
    w = DatadistWorker(Settings(link_timeout_ms=3000), producer=False, consumer=True)
    w.link_path = "nixl"
    layout, _ = kv_layout({"l": torch.zeros(SHAPE)})
    w.start(layout)
    try:
        host, port, cid = addr
        params = {"remote_block_ids": SRC, "remote_num_tokens": PROMPT,
                  "remote_request_id": "p1",
                  "datadist": {"workers": [[host, port, cid]], "block_size": BS, "slot": 3,
                               "tag": TAG}}
        with caplog.at_level("WARNING", logger="vllm.datadist_connector"):
            w.submit([RecvTask("d1", LOCAL, RemoteRequest.parse(params))])
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                done, failed = w.poll_recv()
                if done:
                    break
                time.sleep(0.01)
        assert (done, failed) == ({"d1"}, {"d1"})
        assert re.search(r"link to \S+ uses (?!nixl)\w+, not nixl .*kv_buffer_device 'cuda' "
                         r"needs NIXL", caplog.text), caplog.text
        assert w.stats.requests_pulled == 0
        cmd_q.put("stop")
    finally:
        w.close()
