"""A CUDA stand-in for staging.py's CopyEngine: two streams whose work runs late, in order,
with real bytes (CPU tensors stand for GPU memory).

- ``compute``: vLLM's stream. The test queues the model's kernels on it (``launch``: a
  function that writes the "device" tensors, or reads them) and the engine queues waits.
- ``staging``: the engine's copies (``copy`` reads its source when it runs, as a CUDA copy
  does), waits for the compute stream, and markers.

Nothing runs when it is queued. The "GPU" runs ``pace`` ops each time a marker is queried (so
polling a marker is what moves time on), and everything on ``drain``. When both streams
could run, the stream named ``first`` goes first: "staging" runs a copy before the kernel
that writes its source unless a wait orders them (a prefill's missing wait shows up as stale
bytes), "compute" runs the next forward before the copies it reads unless a fence orders
them (a decoder's missing fence). ``log`` records every call, in order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class FakeMarker:
    def __init__(self, gpu: FakeCuda, stream: str) -> None:
        self.gpu, self.stream, self.done = gpu, stream, False

    def query(self) -> bool:
        if not self.done:
            self.gpu.run(self.gpu.pace)
        return self.done


class FakeCuda:
    def __init__(self, pace: int = 1, first: str = "compute") -> None:
        self.pace = pace
        self.order = (first, "staging" if first == "compute" else "compute")
        self.streams: dict[str, list[tuple[Any, ...]]] = {"compute": [], "staging": []}
        self.log: list[tuple[Any, ...]] = []
        self.ran = {"compute": 0, "staging": 0}  # ops run so far per stream

    # ---- the test's side (vLLM's kernels)

    def launch(self, fn: Callable[[], None]) -> None:
        self.streams["compute"].append(("kernel", fn))

    # ---- CopyEngine

    def host_like(self, t: torch.Tensor) -> torch.Tensor:
        return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="cpu")

    def after_compute(self) -> None:
        self.log.append(("after_compute",))
        self.streams["staging"].append(("wait_stream", "compute",
                                        self.ran["compute"] + len(self.streams["compute"])))

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.log.append(("copy", dst.data_ptr(), src.data_ptr(), dst.shape[0]))
        self.streams["staging"].append(("copy", dst, src))

    def record(self) -> FakeMarker:
        m = FakeMarker(self, "staging")
        self.log.append(("record", id(m)))
        self.streams["staging"].append(("mark", m))
        return m

    def record_compute(self) -> FakeMarker:
        m = FakeMarker(self, "compute")
        self.log.append(("record_compute", id(m)))
        self.streams["compute"].append(("mark", m))
        return m

    def compute_waits(self, marker: FakeMarker) -> None:
        self.log.append(("compute_waits", id(marker)))
        self.streams["compute"].append(("wait_marker", marker))

    def read(self, t: torch.Tensor) -> tuple[torch.Tensor, FakeMarker]:
        host = torch.empty_like(t)
        self.streams["compute"].append(("copy", host, t))
        return host, self.record_compute()

    # ---- the GPU

    def _ready(self, stream: str) -> bool:
        q = self.streams[stream]
        if not q:
            return False
        op = q[0]
        if op[0] == "wait_stream":
            return self.ran[op[1]] >= op[2]
        if op[0] == "wait_marker":
            return bool(op[1].done)
        return True

    def _step(self) -> bool:
        for stream in self.order:
            if self._ready(stream):
                op = self.streams[stream].pop(0)
                if op[0] == "kernel":
                    op[1]()
                elif op[0] == "copy":
                    op[1].copy_(op[2])
                elif op[0] == "mark":
                    op[1].done = True
                self.ran[stream] += 1
                return True
        return False

    def run(self, n: int) -> None:
        for _ in range(n):
            if not self._step():
                return

    def drain(self) -> None:
        while self._step():
            pass
        assert not any(self.streams.values()), f"deadlock: {self.streams}"

    @property
    def pending(self) -> int:
        return sum(len(q) for q in self.streams.values())
