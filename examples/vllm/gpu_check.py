"""The datadist vLLM connector on a CUDA GPU, end to end, in a few minutes (docs/vllm.md,
"GPU workers"). NOT RUN where it was written: there was no GPU there.

    python examples/vllm/gpu_check.py                       # every config, one GPU
    python examples/vllm/gpu_check.py --gpus 0 1            # prefill on GPU 0, decode on 1
    python examples/vllm/gpu_check.py --configs staged staged-layerwise --tokens 256 2048

For each config it starts a prefill and a decode vLLM engine (offline ``LLM`` API, each in
its own process; on one GPU each takes ``--mem`` of its memory) on a random-weight Llama made
locally (or ``--model``), and checks, for prompts of each ``--tokens`` length:

- the decode engine's tokens (``--new`` of them, greedy) equal those of one engine alone
  (the reference engine runs first, by itself), also for a prompt whose first half the
  prefill engine holds already (a prefix-cache hit on the prefill side: those blocks were
  computed by an earlier request);
- the decode engine's log says how the KV moved: "staged through ... of host memory
  (pinned)" for the staged configs, and a "pulled request" / "received request" line for
  every request (the KV came over datadist, not recomputed);

and prints the decode engine's time to first token (median of ``--requests``, after one
warm-up request), with the same engine's TTFT for a prompt whose KV is already local (a
prefix hit: the floor a transfer is measured against).

Configs: ``staged`` (kv_buffer_device "cpu": host buffers, the default), ``staged-layerwise``
(the same, layer-wise mode: each request is routed to both engines at once), ``vram`` and
``vram-layerwise`` (kv_buffer_device "cuda": NIXL reads GPU memory; needs
``pip install 'datadist[nixl]'``, skipped without it). Exit status 0 when every check of
every config that ran passed; each check prints one line.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import random
import re
import secrets
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = {  # name: (kv_buffer_device, mode)
    "staged": ("cpu", "pull"),
    "staged-layerwise": ("cpu", "layerwise"),
    "vram": ("cuda", "pull"),
    "vram-layerwise": ("cuda", "layerwise"),
}


def node(model: str, role: str, config: str) -> None:
    """One engine (a child process): JSON requests on stdin, one answer line each."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    ktc = None
    if role != "none":
        device, mode = CONFIGS[config]
        ktc = KVTransferConfig(kv_connector="DatadistConnector",
                               kv_connector_module_path="datadist.integrations.vllm",
                               kv_role=role, kv_load_failure_policy="fail",
                               kv_connector_extra_config={"kv_buffer_device": device,
                                                          "mode": mode})
    llm = LLM(model=model, load_format=os.environ["GPU_CHECK_LOAD"], seed=0,
              dtype=os.environ["GPU_CHECK_DTYPE"],
              gpu_memory_utilization=float(os.environ["GPU_CHECK_MEM"]),
              max_model_len=int(os.environ["GPU_CHECK_MAX_LEN"]), max_num_seqs=4,
              enforce_eager=os.environ.get("GPU_CHECK_EAGER") == "1",
              kv_transfer_config=ktc, enable_prefix_caching=True)
    print("READY", flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        sp = SamplingParams(temperature=0.0, max_tokens=req["max_tokens"], ignore_eos=True,
                            extra_args={"kv_transfer_params": req["params"]}
                            if req["params"] is not None else None)
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=req["prompt"])], [sp],
                           use_tqdm=False)[0]
        print("@@" + json.dumps({"params": out.kv_transfer_params,
                                 "seconds": time.perf_counter() - t0, "end": time.time(),
                                 "tokens": list(out.outputs[0].token_ids)}), flush=True)


class Engine:
    def __init__(self, name: str, model: Path, role: str, config: str, gpu: str,
                 env: dict[str, str], log: Path) -> None:
        self.name, self.log = name, log
        self.p = subprocess.Popen(
            [sys.executable, __file__, "--node", str(model), role, config],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(log, "wb"),  # noqa: SIM115
            env=dict(env, CUDA_VISIBLE_DEVICES=gpu), start_new_session=True)
        self.buf = b""

    def line(self, timeout: float) -> str:
        end = time.monotonic() + timeout
        assert self.p.stdout is not None
        while True:
            while b"\n" in self.buf:
                ln, _, self.buf = self.buf.partition(b"\n")
                s = ln.decode(errors="replace")
                if s == "READY" or s.startswith("@@"):
                    return s
            if not select.select([self.p.stdout], [], [], max(0.0, end - time.monotonic()))[0]:
                raise TimeoutError(f"{self.name}: no answer in {timeout:.0f} s; see {self.log}")
            chunk = os.read(self.p.stdout.fileno(), 65536)
            if not chunk:
                raise RuntimeError(f"{self.name} exited; see {self.log}")
            self.buf += chunk

    def send(self, prompt: list[int], params: dict | None, max_tokens: int) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write((json.dumps({"prompt": prompt, "params": params,
                                        "max_tokens": max_tokens}) + "\n").encode())
        self.p.stdin.flush()

    def answer(self, timeout: float = 300) -> dict:
        return json.loads(self.line(timeout)[2:])

    def ask(self, prompt: list[int], params: dict | None, max_tokens: int) -> dict:
        self.send(prompt, params, max_tokens)
        return self.answer()

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.p.pid, signal.SIGKILL)
        self.p.wait(60)


def check(ok: bool, what: str) -> bool:
    print(f"{'ok  ' if ok else 'FAIL'} {what}", flush=True)
    return ok


def ms(xs: list[float]) -> str:
    return (f"{statistics.median(xs) * 1e3:.1f} ms [{min(xs) * 1e3:.1f}-{max(xs) * 1e3:.1f}]"
            if xs else "-")


def run_config(config: str, model: Path, gpus: list[str], env: dict[str, str], work: Path,
               prompts: dict[int, list[tuple[list[int], list[int]]]],
               hit: list[int], reference: dict[tuple[int, int], list[int]], new: int) -> bool:
    device, mode = CONFIGS[config]
    pre = Engine(f"{config} prefill", model, "kv_producer", config, gpus[0], env,
                 work / f"{config}-prefill.log")
    dec = None
    ok = True
    try:
        pre.line(900)  # one at a time: vLLM's start measures the GPU's free memory
        dec = Engine(f"{config} decode", model, "kv_consumer", config, gpus[-1], env,
                     work / f"{config}-decode.log")
        dec.line(900)
        workers = None
        if mode == "layerwise":  # a layer-wise router learns the prefill's workers
            workers = pre.ask([5, 6, 7], {"do_remote_decode": True,
                                          "datadist": {"mode": "layerwise"}}, 1)["params"]

        def request(prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
            """Prefill, then decode (layer-wise: both at once); (decode TTFT, tokens)."""
            if mode == "layerwise":
                assert workers is not None
                tag = secrets.token_hex(16)
                dd = workers["datadist"]
                dec.send(prompt, {"do_remote_prefill": True, "datadist": {
                    "mode": "layerwise", "tag": tag, "workers": dd["workers"],
                    "block_size": dd["block_size"]}}, max_tokens)
                pre.send(prompt, {"do_remote_decode": True,
                                  "datadist": {"mode": "layerwise", "tag": tag}}, 1)
                p_ans, d_ans = pre.answer(), dec.answer()
                # the decode's first token after the prefill's (both started at once)
                return d_ans["end"] - p_ans["end"], d_ans["tokens"]
            p_ans = pre.ask(prompt, {"do_remote_decode": True}, 1)
            d_ans = dec.ask(prompt, p_ans["params"], max_tokens)
            return d_ans["seconds"], d_ans["tokens"]

        for tokens, batch in prompts.items():
            ttft: list[float] = []
            same = 0
            for i, (first, second) in enumerate(batch):
                # TTFT, then the tokens: two prompts new to both engines (no local hit)
                seconds, _ = request(first, 1)
                if i > 0:  # the first pair warms up (links, CUDA graphs)
                    ttft.append(seconds)
                same += request(second, new)[1] == reference[(tokens, i)]
            ok &= check(same == len(batch), f"{config}: {tokens} tokens: decode tokens equal "
                        f"one engine's in {same}/{len(batch)} requests")
            local = []
            for prompt, _ in batch[1:]:  # the decode engine holds these prompts' KV now
                local.append(dec.ask(prompt, None, 1)["seconds"])
            how = ("its first token after the prefill's" if mode == "layerwise"
                   else "the decode call, transfer included")
            print(f"     {config}: {tokens} tokens: decode TTFT {ms(ttft)} ({how}); KV "
                  f"already local (prefix hit) {ms(local)}", flush=True)
        ok &= check(request(hit, new)[1] == reference[(0, 0)], f"{config}: a prompt whose "
                    f"first {len(hit) // 2} tokens the prefill engine had cached: decode "
                    "tokens equal one engine's")
        log = (work / f"{config}-decode.log").read_text(errors="replace")
        moved = len(re.findall(r"datadist: (?:pulled|received) request", log))
        want = 2 * sum(len(b) for b in prompts.values()) + 1
        ok &= check(moved >= want, f"{config}: the decode engine's log shows {moved} "
                    f"transfers over datadist (want {want})")
        if device == "cpu":
            staged = re.search(r"staged through ([\d.]+) MiB of host memory \((\w+)\)", log)
            ok &= check(staged is not None, f"{config}: the KV cache was staged through "
                        f"host buffers: {staged.group(0) if staged else 'no log line'}")
            if staged and staged.group(2) != "pinned":
                print(f"     {config}: host buffers are pageable (ulimit -l?): copies are "
                      "synchronous", flush=True)
        failed = re.findall(r"datadist: .*(?:failed|refused).*", log)
        ok &= check(not failed, f"{config}: no failed transfer in the decode log"
                    + (f" (first: {failed[0]})" if failed else ""))
    except (TimeoutError, RuntimeError) as e:
        ok = check(False, f"{config}: {e}")
    finally:
        if dec is not None:
            dec.stop()
        pre.stop()
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    ap.add_argument("--gpus", nargs="+", default=["0"],
                    help="CUDA device of the prefill, then of the decode (default: both on 0)")
    ap.add_argument("--model", help="a model directory or name (default: a random-weight "
                    "Llama of 8 layers, made locally, loaded with load_format=dummy)")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 4000])
    ap.add_argument("--requests", type=int, default=3, help="per length, after one warm-up")
    ap.add_argument("--new", type=int, default=16, help="tokens each decode generates")
    ap.add_argument("--mem", type=float, default=0.0,
                    help="gpu_memory_utilization of each engine (default 0.4 on one GPU, "
                         "0.8 on two)")
    ap.add_argument("--eager", action="store_true", help="enforce_eager (no CUDA graphs)")
    ap.add_argument("--node", nargs=3, metavar=("MODEL", "ROLE", "CONFIG"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.node:
        node(*args.node)
        return 0
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: run this on a GPU host", file=sys.stderr)
        return 2
    configs = list(args.configs)
    if any(CONFIGS[c][0] == "cuda" for c in configs) and \
            importlib.util.find_spec("nixl_cu12") is None:
        print("skip vram configs: NIXL is not installed (pip install 'datadist[nixl]')",
              flush=True)
        configs = [c for c in configs if CONFIGS[c][0] != "cuda"]
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    if args.model:
        model, load = Path(args.model), "auto"
    else:
        from datadist.integrations.vllm.tiny_model import make_tiny_llama

        model = make_tiny_llama(work / "model", layers=8, hidden=1024, heads=16, kv_heads=8)
        load = "dummy"
    gpus = args.gpus[:2]
    # vLLM logs to stdout by default, where the engines answer: its log (the connector's
    # lines included) goes to each engine's log file instead.
    (work / "logging.json").write_text(json.dumps({
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"f": {"format": "%(asctime)s %(process)d %(name)s %(levelname)s "
                                       "%(message)s"}},
        "handlers": {"h": {"class": "logging.StreamHandler", "formatter": "f",
                           "stream": "ext://sys.stderr"}},
        "loggers": {"vllm": {"handlers": ["h"], "level": "INFO", "propagate": False}}}))
    env = dict(os.environ, VLLM_LOGGING_CONFIG_PATH=str(work / "logging.json"),
               GPU_CHECK_LOAD=load, GPU_CHECK_DTYPE=args.dtype,
               GPU_CHECK_MEM=str(args.mem or (0.4 if len(set(gpus)) == 1 else 0.8)),
               GPU_CHECK_MAX_LEN=str(-(-(max(args.tokens) + args.new + 64) // 1024) * 1024),
               GPU_CHECK_EAGER="1" if args.eager else "0", VLLM_ALLOW_LONG_MAX_MODEL_LEN="1")
    rnd = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rnd.randrange(3, 259) for _ in range(n)]

    # Per length: (a prompt for the TTFT, another for the tokens), one warm-up pair first.
    prompts = {n: [(prompt(n), prompt(n)) for _ in range(args.requests + 1)]
               for n in args.tokens}
    # Last, one whose first half is an earlier prompt's: a prefix hit on the prefill engine.
    n = args.tokens[-1]
    hit = prompts[n][0][1][:n // 2] + prompt(n - n // 2)
    print(f"GPU: {torch.cuda.get_device_name(0)}; engines on CUDA devices {gpus}; "
          f"model {model} ({args.dtype}); logs in {work}", flush=True)
    ref = Engine("reference", model, "none", "staged", gpus[0], env, work / "reference.log")
    reference: dict[tuple[int, int], list[int]] = {}
    try:
        ref.line(900)
        for n, batch in prompts.items():
            for i, (_, second) in enumerate(batch):
                reference[(n, i)] = ref.ask(second, None, args.new)["tokens"]
        reference[(0, 0)] = ref.ask(hit, None, args.new)["tokens"]
    finally:
        ref.stop()
    ok = True
    for config in configs:
        ok &= run_config(config, model, gpus, env, work, prompts, hit, reference, args.new)
    print("all checks passed" if ok else "SOME CHECKS FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
