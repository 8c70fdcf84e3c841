"""Every dtype the vLLM connector maps (integrations/vllm/layout.py), at the layout and the
transfer level (issue 25, item 3): vLLM's per-layer KV tensors of that dtype become a blocks
cache of the matching DataType, and a decode worker pulls a prefill worker's blocks bit for
bit; a decode worker whose KV has another dtype of the same size (float16 against bfloat16)
is refused instead of reading bytes as the wrong type. torch only, no vLLM; the end-to-end
run with vLLM is tests/interop/vllm/test_vllm.py."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest

import datadist as llm_datadist

torch = pytest.importorskip("torch")

from datadist.integrations.vllm.layout import _DTYPES, kv_layout  # noqa: E402
from datadist.integrations.vllm.scheduler import RecvTask, SendTask  # noqa: E402
from datadist.integrations.vllm.settings import RemoteRequest, Settings  # noqa: E402
from datadist.integrations.vllm.worker import DatadistWorker  # noqa: E402

pytestmark = pytest.mark.timeout(120)

BLOCKS, SHAPE, LAYERS = 8, (2, 16, 8), 2  # the CPU backend's packed layout, small
TAG = "6b" * 16
MAPPED = {"float16": "DT_FLOAT16", "bfloat16": "DT_BF16", "float32": "DT_FLOAT",
          "int8": "DT_INT8", "uint8": "DT_UINT8"}


def _caches(dtype_name: str, seed: int | None) -> dict[str, object]:
    """vLLM's per-layer KV tensors; with ``seed``, every byte set from it (any bit pattern:
    a bfloat16 NaN moves like any other), else all 0xFF."""
    dtype = getattr(torch, dtype_name)
    out = {}
    for layer in range(LAYERS):
        t = torch.empty((BLOCKS, *SHAPE), dtype=dtype)
        raw = t.view(torch.uint8) if t.element_size() == 1 else t.view(-1).view(torch.uint8)
        if seed is None:
            raw.fill_(0xFF)
        else:
            g = torch.Generator().manual_seed(seed * 100 + layer)
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))
        out[f"model.layers.{layer}.self_attn.attn"] = t
    return out


def _bytes(t) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def test_the_connector_maps_the_dtypes_this_test_covers() -> None:
    assert {str(d).removeprefix("torch."): dt.name for d, dt in _DTYPES.items()} == MAPPED


@pytest.mark.parametrize("dtype_name", sorted(MAPPED))
@pytest.mark.parametrize("k_v_first", [False, True], ids=["packed", "k-v-first"])
def test_layout_of_each_dtype(dtype_name: str, k_v_first: bool) -> None:
    dtype = getattr(torch, dtype_name)
    shape = (2, BLOCKS, 16, 2, 8) if k_v_first else (BLOCKS, *SHAPE)
    kv = {f"l{i}": torch.zeros(shape, dtype=dtype) for i in range(3)}
    layout, parts = kv_layout(kv)
    assert layout.dtype == llm_datadist.DataType[MAPPED[dtype_name]]
    assert layout.dtype.itemsize == torch.empty((), dtype=dtype).element_size()
    assert layout.tensors_per_layer == (2 if k_v_first else 1)
    assert layout.num_blocks == BLOCKS and len(parts) == 3 * layout.tensors_per_layer


def _producer(dtype_name: str, addr_q, cmd_q) -> None:
    layout, _ = kv_layout(caches := _caches(dtype_name, seed=7))
    w = DatadistWorker(Settings(abort_timeout_s=60), producer=True, consumer=False)
    w.start(layout)
    w.hold([SendTask("p1", 3, TAG)])
    addr_q.put((w.address.host, w.address.port, w.cluster_id))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and cmd_q.empty():
        w.poll_sent()
        time.sleep(0.01)
    w.close()
    del caches


def _start_producer(dtype_name: str):
    ctx = mp.get_context("spawn")
    addr_q, cmd_q = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_producer, args=(dtype_name, addr_q, cmd_q), daemon=True)
    proc.start()
    return proc, addr_q.get(timeout=60), cmd_q


def _pull(addr, consumer_dtype: str) -> tuple[set[str], dict[str, object]]:
    host, port, cid = addr
    caches = _caches(consumer_dtype, seed=None)
    layout, _ = kv_layout(caches)
    w = DatadistWorker(Settings(), producer=False, consumer=True)
    try:
        w.start(layout)
        params = {"remote_block_ids": [5, 1, 6], "remote_num_tokens": 40,
                  "remote_request_id": "p1",
                  "datadist": {"workers": [[host, port, cid]], "block_size": 16, "slot": 3,
                               "tag": TAG}}
        w.submit([RecvTask("d1", [0, 2, 4], RemoteRequest.parse(params))])
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            done, failed = w.poll_recv()
            if done or failed:
                return failed, caches
            time.sleep(0.01)
        raise AssertionError("the pull never finished")
    finally:
        w.close()


@pytest.mark.parametrize("dtype_name", sorted(MAPPED))
def test_a_pull_moves_each_dtype_bit_for_bit(dtype_name: str) -> None:
    proc, addr, cmd_q = _start_producer(dtype_name)
    try:
        failed, got = _pull(addr, dtype_name)
        assert failed == set()
        want = _caches(dtype_name, seed=7)
        for name, t in got.items():
            for src, dst in zip((5, 1, 6), (0, 2, 4), strict=True):
                assert _bytes(t[dst]) == _bytes(want[name][src]), (name, src, dst)
            for untouched in (1, 3, 5, 6, 7):
                assert set(_bytes(t[untouched])) == {0xFF}
    finally:
        cmd_q.put("stop")
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def test_a_decode_worker_of_another_dtype_is_refused() -> None:
    """float16 and bfloat16 have the same size: only the dtype check tells them apart."""
    proc, addr, cmd_q = _start_producer("bfloat16")
    try:
        failed, got = _pull(addr, "float16")
        assert failed == {"d1"}
        assert all(set(_bytes(t)) == {0xFF} for t in got.values())  # nothing was written
    finally:
        cmd_q.put("stop")
        proc.join(30)
        if proc.is_alive():
            proc.kill()
