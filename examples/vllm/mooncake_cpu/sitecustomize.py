"""vLLM's MooncakeConnector on a CPU host, without changing vLLM's or Mooncake's files.

``examples/vllm/bench_pd.py --connector mooncake`` puts this directory on ``PYTHONPATH``
with ``BENCH_PD_MOONCAKE_CPU=1``, so every Python process of the engines runs it at start
(vLLM spawns its workers). vLLM 0.32's ``MooncakeConnectorWorker.__init__``
(kv_connector/v1/mooncake/mooncake_connector.py) starts with
``torch.accelerator.current_device_index()``, which raises "Cannot access accelerator device
when none is available." on a host without one, before any Mooncake code runs. When that
module is imported, this makes the call answer device 0 if no accelerator exists (the CPU
platform's ``set_device`` that follows is ``torch.cpu.set_device``, a no-op); the transfer
engine then runs over TCP on host memory. Prints one line per process when it takes effect.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from typing import Any

_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector"

if os.environ.get("BENCH_PD_MOONCAKE_CPU") == "1":

    class _CpuDevice(importlib.abc.MetaPathFinder):
        """Patches ``torch.accelerator.current_device_index`` when the connector loads."""

        def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
            if name != _MODULE:
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is None or spec.loader is None:
                return spec
            loader = spec.loader
            run = loader.exec_module

            def exec_module(module: Any) -> None:
                import torch

                if not torch.accelerator.is_available():
                    torch.accelerator.current_device_index = lambda: 0  # type: ignore[assignment]
                    print("bench_pd: MooncakeConnector on CPU: accelerator index 0",
                          file=sys.stderr, flush=True)
                run(module)

            loader.exec_module = exec_module  # type: ignore[method-assign]
            return spec

    sys.meta_path.insert(0, _CpuDevice())
