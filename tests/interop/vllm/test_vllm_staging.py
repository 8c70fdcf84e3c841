"""staging.py against a CUDA stand-in (_fake_cuda.py): copies queued on streams that run late,
real bytes. Every check is on the bytes where they land at the moment the connector would act
on them (a hold, a layer announced, the next forward)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from datadist.integrations.vllm import staging
from datadist.integrations.vllm.layerwise import LayerwiseStep
from datadist.integrations.vllm.scheduler import SendTask
from datadist.integrations.vllm.settings import Settings
from datadist.integrations.vllm.staging import Staging, runs, slot_mappings

from ._fake_cuda import FakeCuda

LAYERS, BLOCKS, BS = 3, 8, 4
SHAPE = (2, BLOCKS, BS, 2, 8)  # a CUDA backend's [2, num_blocks, block_size, heads, dim]


def _device() -> list[torch.Tensor]:
    return [torch.full(SHAPE, -1.0) for _ in range(LAYERS)]


def _stage(gpu: FakeCuda, mode: str = "cpu", timeout_s: float = 5.0,
           dev: list[torch.Tensor] | None = None) -> tuple[Staging, list[torch.Tensor]]:
    dev = dev if dev is not None else _device()
    parts = [p for t in dev for p in staging.split_layer(t)]
    host = [torch.full_like(p, -2.0) for p in parts] if mode == "cpu" else []
    return Staging(parts, host, 2, BS, gpu, mode, timeout_s), dev


class _Worker:
    """What Staging asks of a DatadistWorker: hold (snapshots the mirror when called)."""

    def __init__(self, st: Staging, producer: bool = True) -> None:
        self.producer, self.lw_consumer, self.st = producer, None, st
        self.held: list[tuple[list[str], list[torch.Tensor]]] = []

    def hold(self, tasks: list[SendTask]) -> None:
        self.held.append(([t.request_id for t in tasks], [h.clone() for h in self.st.host]))


def _write(dev: list[torch.Tensor], blocks: list[int], layers: range, base: float) -> None:
    for layer in layers:
        for b in blocks:
            dev[layer][:, b] = base + 100 * layer + b


def _block(parts: list[torch.Tensor], layer: int, b: int) -> list[torch.Tensor]:
    return [parts[2 * layer][b], parts[2 * layer + 1][b]]


def test_runs_group_consecutive_blocks() -> None:
    assert runs([9, 5, 1, 2, 3, 10, 2]) == [(1, 4), (5, 6), (9, 11)]
    assert runs([]) == []


def test_slot_mappings_of_every_metadata_form_without_duplicates() -> None:
    a, b = torch.tensor([0, 1]), torch.tensor([5])
    md = SimpleNamespace(slot_mapping=a)
    assert [t is a for t in slot_mappings({"l0": md, "l1": md})] == [True]
    found = slot_mappings([{"l0": md}, {"l0": SimpleNamespace(slot_mapping=b)}])
    assert len(found) == 2 and found[1] is b
    assert slot_mappings(None) == [] and slot_mappings(SimpleNamespace()) == []
    # vLLM 0.32's forward context: slot mappings by layer beside the attention metadata
    ctx = SimpleNamespace(slot_mapping={"l0": a, "l1": a}, attn_metadata={"l0": md})
    assert [t is a for t in slot_mappings(ctx)] == [True]
    old = SimpleNamespace(slot_mapping={}, attn_metadata={"l0": SimpleNamespace(slot_mapping=b)})
    assert [t is b for t in slot_mappings(old)] == [True]


def test_pull_prefill_holds_only_once_the_step_is_copied_to_host() -> None:
    gpu = FakeCuda(pace=1, first="staging")
    st, dev = _stage(gpu)
    w = _Worker(st)
    st.bind(w)  # type: ignore[arg-type]
    # The step: slot mapping queued (by prepare_inputs) before the forward's KV writes.
    sm = torch.tensor([3 * BS, 3 * BS + 1, 4 * BS + 3, 6 * BS, -1, -1])  # blocks 3, 4, 6
    st.begin_step({"layer.0": SimpleNamespace(slot_mapping=sm)})
    gpu.launch(lambda: _write(dev, [3, 4, 6], range(LAYERS), 1000.0))
    st.wait_for_save()
    assert gpu.pending > 0  # the copies are queued, not run: wait_for_save did not wait them
    st.hold([SendTask("r1", 0, "ab" * 16)])
    (rids, mirror), = w.held
    assert rids == ["r1"]
    for layer in range(LAYERS):
        for b in range(BLOCKS):
            got = _block(mirror, layer, b)
            want = 1000.0 + 100 * layer + b if b in (3, 4, 6) else -2.0
            assert all((g == want).all() for g in got), (layer, b)
    # one copy per run of blocks ([3, 5) and [6, 7)) and tensor, after the compute stream
    copies = [e for e in gpu.log if e[0] == "copy"]
    assert len(copies) == 2 * 2 * LAYERS
    assert gpu.log.index(("after_compute",)) < gpu.log.index(copies[0])


def test_a_decoder_mirrors_nothing_of_its_own_steps() -> None:
    gpu = FakeCuda()
    st, _ = _stage(gpu)
    st.bind(_Worker(st, producer=False))  # type: ignore[arg-type]
    st.begin_step({"l": SimpleNamespace(slot_mapping=torch.tensor([0, 1]))})
    st.wait_for_save()
    assert gpu.log == [] and gpu.pending == 0


def test_hold_gives_up_after_the_deadline_when_the_gpu_is_stuck() -> None:
    gpu = FakeCuda(pace=0)  # nothing ever runs
    st, _ = _stage(gpu, timeout_s=0.2)
    w = _Worker(st)
    st.bind(w)  # type: ignore[arg-type]
    st.begin_step({"l": SimpleNamespace(slot_mapping=torch.tensor([0]))})
    with pytest.raises(TimeoutError, match="slot mapping did not end within 200 ms"):
        st.wait_for_save()
    gpu.pace = 1
    st.begin_step({"l": SimpleNamespace(slot_mapping=torch.tensor([0]))})
    st.wait_for_save()
    gpu.pace = 0
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="copy of the KV cache to host memory"):
        st.hold([SendTask("r", 0, "ab" * 16)])
    assert 0.15 < time.monotonic() - t0 < 2
    assert w.held == []  # never held: no decoder reads what was not copied


def _lw_entry(computed: int, scheduled: int, blocks: list[int], rid: str = "p1",
              prompt: int = 22) -> LayerwiseStep:
    return LayerwiseStep(rid, "cd" * 16, blocks, computed, scheduled, prompt, BS)


@pytest.mark.parametrize("mode", ["cpu", "cuda"])
def test_layerwise_prefill_announces_a_layer_only_once_it_is_copied(mode: str) -> None:
    gpu = FakeCuda(pace=1, first="staging")
    st, dev = _stage(gpu, mode)
    st.bind(_Worker(st))  # type: ignore[arg-type]
    blocks = [7, 2, 5, 0, 3, 6]  # prompt of 22 tokens: 6 blocks
    # First step: 8 tokens were a prefix-cache hit (blocks 7, 2: written by an earlier
    # request, already on the device), this step computes tokens 8..15 (blocks 5, 0).
    _write(dev, [7, 2], range(LAYERS), 500.0)
    entries = st.lw_step([_lw_entry(8, 8, blocks)])
    if mode == "cpu":  # the hit's blocks are copied (and announced) with the step's
        assert (entries[0].computed_before, entries[0].scheduled) == (0, 16)
    else:  # read in GPU memory: nothing to copy, the hit is announced as computed
        assert (entries[0].computed_before, entries[0].scheduled) == (8, 8)
    copied = [7, 2, 5, 0] if mode == "cpu" else [5, 0]
    mirror = st.host if mode == "cpu" else st.dev
    seen = []
    for layer in range(LAYERS):
        gpu.launch(lambda layer=layer: _write(dev, [5, 0], range(layer, layer + 1), 500.0))
        ready = st.save_layer(layer)
        seen.append(ready)
        for done in range(ready + 1):  # every layer it announces holds the bytes
            for b in copied:
                assert all((g == 500.0 + 100 * done + b).all()
                           for g in _block(mirror, done, b)), (done, b)
    assert seen[0] == -1  # the first layer's copy could not have run yet
    assert st.wait_for_save() == LAYERS - 1
    for layer in range(LAYERS):
        for b in copied:
            assert all((g == 500.0 + 100 * layer + b).all() for g in _block(mirror, layer, b))
    # Second step: tokens 16..21 (blocks 3, 6); block 0 is not written again.
    gpu.log.clear()
    st.lw_step([_lw_entry(16, 6, blocks)])
    for layer in range(LAYERS):
        gpu.launch(lambda layer=layer: _write(dev, [3, 6], range(layer, layer + 1), 900.0))
        st.save_layer(layer)
    assert st.wait_for_save() == LAYERS - 1
    if mode == "cpu":
        for layer in range(LAYERS):
            assert all((g == 900.0 + 100 * layer + 3).all() for g in _block(st.host, layer, 3))
        ranges = {e[3] for e in gpu.log if e[0] == "copy"}
        assert ranges == {1}  # blocks 3 and 6: two runs of one block, per tensor
    else:
        assert not any(e[0] == "copy" for e in gpu.log)


@pytest.mark.parametrize("mode", ["cpu", "cuda"])
def test_layers_vllm_did_not_save_are_copied_before_the_step_is_announced(mode: str) -> None:
    """Inside a full CUDA graph vLLM calls no save_kv_layer: wait_for_save covers those
    layers itself before the producer says the step is written."""
    gpu = FakeCuda(pace=1, first="staging")
    st, dev = _stage(gpu, mode)
    st.bind(_Worker(st))  # type: ignore[arg-type]
    st.lw_step([_lw_entry(0, 8, [4, 1, 6, 2, 3, 5])])  # blocks 4, 1
    gpu.launch(lambda: _write(dev, [4, 1], range(LAYERS), 700.0))
    assert st.save_layer(0) == -1  # only layer 0 seen
    assert st.wait_for_save() == LAYERS - 1
    mirror = st.host if mode == "cpu" else st.dev
    for layer in range(LAYERS):
        for b in (4, 1):
            assert all((g == 700.0 + 100 * layer + b).all() for g in _block(mirror, layer, b))


def test_decoder_fence_orders_the_next_forward_after_the_copies() -> None:
    gpu = FakeCuda(pace=1)
    st, dev = _stage(gpu)
    st.bind(_Worker(st, producer=False))  # type: ignore[arg-type]
    for layer in range(LAYERS):  # a pull landed in the mirror
        for b in (1, 2, 5):
            for p in _block(st.host, layer, b):
                p.fill_(3000.0 + 100 * layer + b)
    st.received([5, 1, 2], every_layer=True)
    st.fence()
    seen: list[list[torch.Tensor]] = []
    gpu.launch(lambda: seen.append([t.clone() for t in dev]))  # the next forward reads KV
    gpu.drain()
    (snap,) = seen
    for layer in range(LAYERS):
        for b in range(BLOCKS):
            want = 3000.0 + 100 * layer + b if b in (1, 2, 5) else -1.0
            assert (snap[layer][:, b] == want).all(), (layer, b)
    assert [e[0] for e in gpu.log][-2:] == ["record", "compute_waits"]
    st.fence()  # nothing queued since: no second fence
    assert st.stats["fences"] == 1


def test_the_stand_in_catches_a_missing_fence() -> None:
    """The check above is only worth something if a forward not ordered after the copies
    sees stale bytes: it does (compute goes first when nothing orders it)."""
    gpu = FakeCuda(pace=1)
    st, dev = _stage(gpu)
    for p in _block(st.host, 0, 1):
        p.fill_(7.0)
    st.received([1], every_layer=True)
    seen: list[torch.Tensor] = []
    gpu.launch(lambda: seen.append(dev[0].clone()))
    gpu.drain()
    assert (seen[0][:, 1] == -1.0).all() and (dev[0][:, 1] == 7.0).all()


def test_layers_landed_copies_only_those_layers() -> None:
    gpu = FakeCuda()
    st, dev = _stage(gpu)
    for p in _block(st.host, 1, 4):
        p.fill_(11.0)
    st.layers_landed("r", range(1, 2), [4])
    st.received([4], every_layer=False)  # layer-wise: nothing left to copy
    st.fence()
    gpu.drain()
    assert (dev[1][:, 4] == 11.0).all()
    assert (dev[0] == -1.0).all() and (dev[2] == -1.0).all()
    assert st.stats["h2d_blocks"] == 1


def test_kv_buffer_device_setting_and_what_each_mode_needs() -> None:
    assert Settings.from_extra_config({}).kv_buffer_device == "cpu"
    assert Settings.from_extra_config({"kv_buffer_device": "cuda"}).kv_buffer_device == "cuda"
    with pytest.raises(ValueError, match="kv_buffer_device must be one of cpu, cuda"):
        Settings.from_extra_config({"kv_buffer_device": "gpu"})
    s = Settings(kv_buffer_device="cuda")
    assert staging.kv_buffer_mode(s, "cpu") is None  # a CPU vLLM: read where it lies
    assert staging.kv_buffer_mode(s, "cuda") == "cuda"
    assert staging.kv_buffer_mode(Settings(), "cuda") == "cpu"
    with pytest.raises(ValueError, match="the KV cache is on xpu"):
        staging.kv_buffer_mode(s, "xpu")
    assert staging.llm_options("cpu", True) == {} and staging.llm_options(None, True) == {}
    assert staging.llm_options("cuda", False) == {
        "transport": "nixl", "nixl_allow_whole_process_access": True}
    assert staging.llm_options("cuda", True)["nixl_serve"] is True


def test_setup_on_a_cpu_vllm_registers_vllms_own_tensors() -> None:
    kv = {"l0": torch.zeros(4, 2, 16, 8)}
    registered, st = staging.setup(kv, Settings(), 16)
    assert registered is kv and st is None


def test_setup_stages_a_device_cache_through_a_mirror_of_the_same_layout() -> None:
    gpu = FakeCuda()
    dev = {f"l{i}": torch.zeros(SHAPE) for i in range(2)}
    # CPU tensors staged as a GPU's (setup otherwise decides by the tensors' device)
    registered, st = staging.setup(dev, Settings(), BS, lambda d: gpu, device_type="cuda")
    assert st is not None and st.mode == "cpu" and set(registered) == {"l0", "l1"}
    assert all(registered[k].shape == dev[k].shape and registered[k].stride() == dev[k].stride()
               and registered[k].data_ptr() != dev[k].data_ptr() for k in dev)
    assert [p.data_ptr() for p in st.host] == [
        p.data_ptr() for t in registered.values() for p in staging.split_layer(t)]
    assert [p.data_ptr() for p in st.dev] == [
        p.data_ptr() for t in dev.values() for p in staging.split_layer(t)]
    registered, st = staging.setup(dev, Settings(kv_buffer_device="cuda"), BS, lambda d: gpu,
                                   device_type="cuda")
    assert registered is dev and st is not None and st.mode == "cuda" and st.host == []
