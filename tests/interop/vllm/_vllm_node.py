"""One vLLM engine in its own process, driven by JSON lines on stdin (test helper).

    python _vllm_node.py MODEL_DIR ROLE POLICY EXTRA_JSON [CONNECTOR]

ROLE is kv_producer / kv_consumer / kv_both / none (no connector). Each stdin line is a
request batch ``{"prompts": [[ids...]], "max_tokens": n, "params": [dict|null, ...]}``; each
answer line is ``{"outputs": [{"tokens": [...], "params": ..., "finish": ...}]}``. The line
``READY`` on stdout says the engine is up. vLLM's log (with the connector's) goes to stderr.
``DATADIST_VLLM_DTYPE`` (default float32) is the model's and so the KV cache's dtype.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    model, role, policy, extra = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    connector = sys.argv[5] if len(sys.argv) > 5 else "DatadistConnector"
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    ktc = None
    if role != "none":
        module = ("datadist.integrations.vllm" if connector == "DatadistConnector"
                  else "_vllm_corrupt")
        ktc = KVTransferConfig(kv_connector=connector, kv_connector_module_path=module,
                               kv_role=role, kv_load_failure_policy=policy,
                               kv_connector_extra_config=extra)
    dtype = os.environ.get("DATADIST_VLLM_DTYPE", "float32")
    llm = LLM(model=model, load_format="dummy", dtype=dtype, block_size=32,
              max_model_len=512, max_num_seqs=8, enforce_eager=True, seed=0,
              kv_transfer_config=ktc, enable_prefix_caching=False)
    print("READY", flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        prompts = [TokensPrompt(prompt_token_ids=p) for p in req["prompts"]]
        sps = []
        for params in req["params"]:
            extra_args = {"kv_transfer_params": params} if params is not None else None
            sps.append(SamplingParams(temperature=0.0, max_tokens=req["max_tokens"],
                                      ignore_eos=True, extra_args=extra_args))
        outs = llm.generate(prompts, sps, use_tqdm=False)
        print(json.dumps({"outputs": [
            {"tokens": list(o.outputs[0].token_ids), "params": o.kv_transfer_params,
             "finish": o.outputs[0].finish_reason} for o in outs]}), flush=True)


if __name__ == "__main__":
    main()
