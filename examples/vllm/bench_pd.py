"""Decode time-to-first-token and KV transfer time: DatadistConnector vs NixlConnector.

    python examples/vllm/bench_pd.py --connector datadist --tokens 1000 --requests 5
    python examples/vllm/bench_pd.py --connector nixl     --tokens 1000 --requests 5

Starts a prefill and a decode vLLM engine (offline ``LLM`` API, each in its own process) with
the chosen connector on a locally made random-weight Llama (8 layers, 8 KV heads x 64, fp32:
32 KiB of KV per token), then, one request at a time: prefill with ``max_tokens=1``, decode
with ``max_tokens=1`` and the prefill's ``kv_transfer_params``. Reports per request the
decode call's wall time (TTFT on the decode instance, transfer included) and, for datadist,
the pull time its worker logs. NIXL needs ``nixl`` (``pip install nixl nixl-cu12``, torch
first) and runs with ``kv_buffer_device="cpu"``, UCX backend.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LAYERS, HIDDEN, HEADS = 8, 512, 8


def node(model: str, role: str, connector: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    if connector == "nixl":
        ktc = KVTransferConfig(kv_connector="NixlConnector", kv_role=role,
                               kv_buffer_device="cpu")
    else:
        ktc = KVTransferConfig(kv_connector="DatadistConnector",
                               kv_connector_module_path="datadist.integrations.vllm",
                               kv_role=role)
    llm = LLM(model=model, load_format="dummy", dtype="float32", block_size=32,
              max_model_len=2048, max_num_seqs=4, enforce_eager=True, seed=0,
              kv_transfer_config=ktc, enable_prefix_caching=False)
    print("READY", flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True,
                            extra_args={"kv_transfer_params": req["params"]})
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=req["prompt"])], [sp],
                           use_tqdm=False)[0]
        dt = time.perf_counter() - t0
        print("@@" + json.dumps({"params": out.kv_transfer_params, "seconds": dt,
                                 "tokens": list(out.outputs[0].token_ids)}), flush=True)


class Proc:
    def __init__(self, args: list[str], env: dict, log: Path) -> None:
        self.log = log
        self.p = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=open(log, "wb"), env=env,  # noqa: SIM115
                                  start_new_session=True)  # stop() ends the engine's children
        self.buf = b""

    def line(self, timeout: float = 600) -> str:
        end = time.monotonic() + timeout
        while True:
            while b"\n" in self.buf:
                ln, _, self.buf = self.buf.partition(b"\n")
                s = ln.decode(errors="replace")
                if s == "READY" or s.startswith("@@"):
                    return s
            if not select.select([self.p.stdout], [], [], max(0.0, end - time.monotonic()))[0]:
                raise TimeoutError(f"no answer; see {self.log}")
            chunk = os.read(self.p.stdout.fileno(), 65536)
            if not chunk:
                raise RuntimeError(f"engine exited; see {self.log}")
            self.buf += chunk

    def ask(self, prompt: list[int], params: dict | None) -> dict:
        self.p.stdin.write((json.dumps({"prompt": prompt, "params": params}) + "\n").encode())
        self.p.stdin.flush()
        return json.loads(self.line()[2:])

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.p.pid, signal.SIGKILL)
        self.p.wait(30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--connector", choices=("datadist", "nixl"), default="datadist")
    ap.add_argument("--tokens", type=int, default=1000, help="prompt length")
    ap.add_argument("--requests", type=int, default=5)
    ap.add_argument("--node", nargs=3, metavar=("MODEL", "ROLE", "CONNECTOR"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.node:
        node(*args.node)
        return 0
    from datadist.integrations.vllm.tiny_model import make_tiny_llama

    work = Path(tempfile.mkdtemp(prefix="bench_pd_"))
    model = make_tiny_llama(work / "model", layers=LAYERS, hidden=HIDDEN, heads=HEADS,
                            kv_heads=HEADS)
    # Two instances on one host: vLLM's CPU binding would put both workers on the same cores,
    # where one's sched_yield loop starves the other (docs/vllm.md, "Two instances on one
    # host"); each gets its own CPU here (CPU i of ours), unless the caller binds them.
    base = dict(os.environ, VLLM_LOGGING_STREAM="ext://sys.stderr",
                VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"))
    cpus = sorted(os.sched_getaffinity(0))
    procs = {}
    for i, (name, role) in enumerate((("prefill", "kv_producer"), ("decode", "kv_consumer"))):
        bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND") or (
            str(cpus[i]) if len(cpus) >= 2 else "nobind")
        env = dict(base, VLLM_NIXL_SIDE_CHANNEL_PORT=str(25600 + 10 * i),
                   VLLM_CPU_OMP_THREADS_BIND=bind)
        procs[name] = Proc([sys.executable, __file__, "--node", str(model), role,
                            args.connector], env, work / f"{name}.log")
    try:
        for p in procs.values():
            assert p.line() == "READY"
        import random

        rnd = random.Random(0)
        ttft, same = [], 0
        for r in range(args.requests + 1):  # the first request warms up (links, handshakes)
            prompt = [rnd.randrange(3, 259) for _ in range(args.tokens)]
            pre = procs["prefill"].ask(prompt, {"do_remote_decode": True})
            dec = procs["decode"].ask(prompt, pre["params"])
            if r:
                ttft.append(dec["seconds"])
                same += dec["tokens"] == pre["tokens"]
        pulls = [float(m) for m in re.findall(r"datadist: pulled request .* in ([\d.]+) ms",
                                                (work / "decode.log").read_text())][1:]
        kib = args.tokens * LAYERS * 2 * HIDDEN * 4 / 1024
        print(f"{args.connector}: {args.requests} requests of {args.tokens} tokens "
              f"({kib:.0f} KiB of KV each); decode TTFT median "
              f"{statistics.median(ttft) * 1e3:.1f} ms (min {min(ttft) * 1e3:.1f})"
              + (f"; datadist pull median {statistics.median(pulls):.1f} ms" if pulls else "")
              + f"; first token equal to the prefill's in {same}/{args.requests}")
        print(f"logs: {work}")
    finally:
        for p in procs.values():
            p.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
