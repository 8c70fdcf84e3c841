"""NixlConnector at its best on a CPU host, without changing vLLM's or NIXL's files.

``examples/vllm/bench_pd.py --connector nixl-tuned`` puts this directory on ``PYTHONPATH``
with ``BENCH_PD_NIXL_TUNED=1``, so every Python process of the engines (front end, engine
core, worker: vLLM spawns some of them, so a patch in the launcher alone would not reach
them) runs it at start-up. It removes the two things that slow NixlConnector on a CPU host:

1. On a CPU host NixlConnector's worker pins its own thread, the one that runs the forward
   pass, to the last core of each NUMA node
   (vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py:
   ``os.sched_setaffinity(0, rsv_cores_for_kv)``): on a one-node host both instances'
   compute then share one core, whatever ``VLLM_CPU_OMP_THREADS_BIND`` said. That call,
   from that file only, is skipped.
2. NIXL's UCX backend runs a progress thread that spins on a core while idle, whatever
   ``UCX_TLS`` says: ``nixl_agent_config`` is made with ``enable_prog_thread=False``
   (NixlConnector's own polls of its transfers and notifications progress them).

Each change prints one line to the process's stderr when it takes effect.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from typing import Any

if os.environ.get("BENCH_PD_NIXL_TUNED") == "1":
    _sched_setaffinity = os.sched_setaffinity

    def _setaffinity(pid: int, cpus: Any) -> None:
        caller = sys._getframe(1).f_code.co_filename
        if caller.endswith(os.path.join("nixl", "base_worker.py")):
            print(f"bench_pd: NixlConnector's pinning to CPUs {sorted(cpus)} skipped",
                  file=sys.stderr, flush=True)
            return
        _sched_setaffinity(pid, cpus)

    os.sched_setaffinity = _setaffinity

    class _NoProgressThread(importlib.abc.MetaPathFinder):
        """Patches ``nixl_agent_config`` when NIXL's API module is first imported."""

        def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
            if not (name.startswith("nixl_cu") and name.endswith("._api")):
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is None or spec.loader is None:
                return spec
            loader = spec.loader
            run = loader.exec_module

            def exec_module(module: Any) -> None:
                run(module)
                cls = module.nixl_agent_config
                init = cls.__init__

                def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
                    kwargs["enable_prog_thread"] = False
                    init(self, *args, **kwargs)
                    print("bench_pd: NIXL agent without a progress thread",
                          file=sys.stderr, flush=True)

                cls.__init__ = __init__

            loader.exec_module = exec_module  # type: ignore[method-assign]
            return spec

    sys.meta_path.insert(0, _NoProgressThread())
