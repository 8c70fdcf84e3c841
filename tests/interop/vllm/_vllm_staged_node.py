"""The datadist connector of a CUDA vLLM, on a CPU vLLM (test helper): ``StagedDatadistConnector``
stages vLLM's KV cache through host mirrors exactly as on a GPU (staging.py), with a stand-in
engine whose copies run at once, so a real vLLM drives every hook of the staged path.

    python _vllm_staged_node.py MODEL_DIR ROLE POLICY EXTRA_JSON

runs one engine with it, speaking _vllm_node.py's JSON lines. The host mirrors start as
noise, and a decoder fills the blocks of each request it receives with noise first, so a
byte a copy misses, either way, shows in the tokens. With
``kv_connector_extra_config["test_skip_h2d_file"]`` naming a file that holds ``skip``, a
decoder leaves what it pulled in the mirror (no copy to "the device"): a control whose tokens
must differ.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

from datadist.integrations.vllm import staging
from datadist.integrations.vllm.connector import DatadistConnector


class _Done:
    def query(self) -> bool:
        return True


class HostEngine:
    """CopyEngine over CPU tensors standing in for GPU memory: every copy runs when queued."""

    def host_like(self, t: torch.Tensor) -> torch.Tensor:
        # noise: a block the prefill's copy to the mirror misses shows in the decode tokens
        gen = torch.Generator().manual_seed(2)
        return (torch.randn(t.shape, generator=gen) * 4).to(t.dtype)

    def after_compute(self) -> None:
        pass

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def record(self) -> _Done:
        return _Done()

    def record_compute(self) -> _Done:
        return _Done()

    def compute_waits(self, marker: Any) -> None:
        pass

    def read(self, t: torch.Tensor) -> tuple[torch.Tensor, _Done]:
        return t.clone(), _Done()


class StagedDatadistConnector(DatadistConnector):
    def _setup_staging(self, kv_caches: dict[str, torch.Tensor]) -> Any:
        self._vllm_tensors = list(kv_caches.values())
        return staging.setup(kv_caches, self.settings, self._block_size,
                             engine_factory=lambda device: HostEngine(), device_type="cuda")

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        # Noise in vLLM's own blocks of every request whose KV arrives in this step, before
        # the connector starts the step's pulls (at bind, before the forward): what the
        # decoder reads there is only right if the copy back from the host mirror wrote
        # every byte.
        steps = getattr(connector_metadata, "step", None)
        if steps is not None and getattr(self, "_vllm_tensors", None):
            gen = torch.Generator().manual_seed(1)
            for task in [*steps.recv, *steps.lw_recv]:
                for t in self._vllm_tensors:
                    for b in task.local_block_ids:
                        t[b].copy_(torch.randn(t[b].shape, generator=gen).to(t.dtype) * 4)
        super().bind_connector_metadata(connector_metadata)

    def _pulled(self, task: Any) -> None:
        path = self._kv_transfer_config.kv_connector_extra_config.get("test_skip_h2d_file")
        if path and Path(path).exists() and Path(path).read_text().strip() == "skip":
            self._on_pulled(task)  # the KV stays in the mirror: vLLM never sees it
            return
        super()._pulled(task)


def main() -> None:
    model, role, policy, extra = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    ktc = KVTransferConfig(kv_connector="StagedDatadistConnector",
                           kv_connector_module_path="_vllm_staged_node", kv_role=role,
                           kv_load_failure_policy=policy, kv_connector_extra_config=extra)
    llm = LLM(model=model, load_format="dummy", dtype="float32", block_size=32,
              max_model_len=512, max_num_seqs=8, enforce_eager=True, seed=0,
              kv_transfer_config=ktc, enable_prefix_caching=False)
    print("READY", flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        prompts = [TokensPrompt(prompt_token_ids=p) for p in req["prompts"]]
        sps = [SamplingParams(temperature=0.0, max_tokens=req["max_tokens"], ignore_eos=True,
                              extra_args=None if p is None else {"kv_transfer_params": p})
               for p in req["params"]]
        outs = llm.generate(prompts, sps, use_tqdm=False)
        print(json.dumps({"outputs": [
            {"tokens": list(o.outputs[0].token_ids), "params": o.kv_transfer_params,
             "finish": o.outputs[0].finish_reason} for o in outs]}), flush=True)


if __name__ == "__main__":
    main()
