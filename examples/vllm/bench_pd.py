"""Decode time-to-first-token and KV transfer time: DatadistConnector vs NixlConnector.

    python examples/vllm/bench_pd.py --connector datadist --tokens 1000 --requests 5
    python examples/vllm/bench_pd.py --connector datadist-layerwise --tokens 1000 --requests 5
    python examples/vllm/bench_pd.py --connector nixl     --tokens 1000 --requests 5
    python examples/vllm/bench_pd.py --connector nixl-tuned --tokens 1000 --requests 5

Starts a prefill and a decode vLLM engine (offline ``LLM`` API, each in its own process) with
the chosen connector on a locally made random-weight Llama (8 layers, 8 KV heads x 64, fp32:
32 KiB of KV per token), then, one request at a time: prefill with ``max_tokens=1``, decode
with ``max_tokens=1`` and the prefill's ``kv_transfer_params``. Reports per request the
decode call's wall time (TTFT on the decode instance, transfer included) and, for datadist,
the pull time its worker logs, and where the time between the pull's end and the decode's
first token goes (the worker's log timestamps against the engine call's return).

``datadist-layerwise`` runs the connectors with ``mode="layerwise"`` and routes as a
layer-wise router does: each request goes to both engines at once (one tag), the decoder
pulls each layer as the prefill says it saved it. Its figure to compare is the decode's
first token *after the prefill's* (``after prefill``): for the pull modes that is the decode
call's time (it starts when the prefill's answer is in), for the layer-wise mode the decode's
end minus the prefill's end; and ``last layer written to all in``: the prefill's log line
saying its last layer is written to the decoder's saying every layer is in (wall clocks, one
host). NIXL needs ``nixl`` (``pip install nixl nixl-cu12``, torch
first) and runs with ``kv_buffer_device="cpu"``, UCX backend; ``nixl-tuned`` removes the two
things that slow it on a CPU host, from outside vLLM (``nixl_tuned/sitecustomize.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
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

LAYERS, HIDDEN, HEADS = 8, 512, 8


def node(model: str, role: str, connector: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    if connector.startswith("nixl"):
        ktc = KVTransferConfig(kv_connector="NixlConnector", kv_role=role,
                               kv_buffer_device="cpu")
    else:
        ktc = KVTransferConfig(kv_connector="DatadistConnector",
                               kv_connector_module_path="datadist.integrations.vllm",
                               kv_role=role, kv_connector_extra_config={
                                   **json.loads(os.environ.get("BENCH_PD_EXTRA", "{}")),
                                   "mode": "layerwise" if connector.endswith("layerwise")
                                   else "pull"})
    llm = LLM(model=model, load_format="dummy", dtype="float32", block_size=32,
              max_model_len=int(os.environ.get("BENCH_PD_MAX_LEN", "2048")), max_num_seqs=4,
              enforce_eager=True, seed=0,
              kv_transfer_config=ktc,
              # the decode engine's "local" figure is a prefix hit (--local); the prompts are
              # random, so no connector run hits its cache
              enable_prefix_caching=role == "kv_consumer")
    print("READY", flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True,
                            extra_args={"kv_transfer_params": req["params"]})
        start = time.time()
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=req["prompt"])], [sp],
                           use_tqdm=False)[0]
        dt = time.perf_counter() - t0
        print("@@" + json.dumps({"params": out.kv_transfer_params, "seconds": dt,
                                 "start": start, "end": time.time(),
                                 "tokens": list(out.outputs[0].token_ids)}), flush=True)


def _stamp(text: str) -> float:
    """A log record's asctime ("2026-12-06 23:52:09,464", local time) as epoch seconds."""
    day, _, ms = text.partition(",")
    return time.mktime(time.strptime(day, "%Y-%m-%d %H:%M:%S")) + int(ms) / 1e3


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

    def send(self, prompt: list[int], params: dict | None) -> None:
        self.p.stdin.write((json.dumps({"prompt": prompt, "params": params}) + "\n").encode())
        self.p.stdin.flush()

    def answer(self) -> dict:
        return json.loads(self.line()[2:])

    def ask(self, prompt: list[int], params: dict | None) -> dict:
        self.send(prompt, params)
        return self.answer()

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.p.pid, signal.SIGKILL)
        self.p.wait(30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--connector", choices=("datadist", "datadist-layerwise", "nixl",
                                            "nixl-tuned"),
                    default="datadist")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1000],
                    help="prompt lengths (one engine pair runs each in turn)")
    ap.add_argument("--requests", type=int, default=5)
    ap.add_argument("--local", action="store_true",
                    help="also time each length with the prompt's KV already local")
    ap.add_argument("--extra", default="{}", help="datadist's kv_connector_extra_config "
                    "(JSON), e.g. '{\"idle_wait_ms\": 0}'")
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
    # Log records with milliseconds (the connector's lines are timestamps of the transfer).
    (work / "logging.json").write_text(json.dumps({
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"f": {"format": "%(asctime)s %(process)d %(name)s %(levelname)s "
                                       "%(message)s"}},
        "handlers": {"h": {"class": "logging.StreamHandler", "formatter": "f",
                           "stream": "ext://sys.stderr"}},
        "loggers": {"vllm": {"handlers": ["h"], "level": "INFO", "propagate": False}}}))
    base = dict(os.environ, VLLM_LOGGING_CONFIG_PATH=str(work / "logging.json"),
                BENCH_PD_EXTRA=json.dumps(json.loads(args.extra)),
                BENCH_PD_MAX_LEN=str(max(2048, -(-(max(args.tokens) + 64) // 1024) * 1024)),
                # the tiny model says 2048 positions; random weights do not mind longer prompts
                VLLM_ALLOW_LONG_MAX_MODEL_LEN="1",
                VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"))
    cpus = sorted(os.sched_getaffinity(0))
    procs = {}
    for i, (name, role) in enumerate((("prefill", "kv_producer"), ("decode", "kv_consumer"))):
        bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND") or (
            str(cpus[i]) if len(cpus) >= 2 else "nobind")
        env = dict(base, VLLM_NIXL_SIDE_CHANNEL_PORT=str(25600 + 10 * i),
                   VLLM_CPU_OMP_THREADS_BIND=bind)
        if args.connector == "nixl-tuned":  # every process of the engine runs it at start
            tuned = str(Path(__file__).resolve().parent / "nixl_tuned")
            env.update(BENCH_PD_NIXL_TUNED="1", PYTHONPATH=os.pathsep.join(
                [tuned, *filter(None, [os.environ.get("PYTHONPATH")])]))
        procs[name] = Proc([sys.executable, __file__, "--node", str(model), role,
                            args.connector], env, work / f"{name}.log")
    try:
        for p in procs.values():
            assert p.line() == "READY"
        import random

        rnd = random.Random(0)
        layerwise = args.connector == "datadist-layerwise"
        workers = None
        if layerwise:  # a layer-wise router learns the prefill's workers from any answer
            hello = procs["prefill"].ask([5, 6, 7], {"do_remote_decode": True,
                                                     "datadist": {"mode": "layerwise"}})
            workers = hello["params"]["datadist"]
        seen = 0  # decode log characters of earlier lengths
        for tokens in args.tokens:
            ttft, after, total, ends, same = [], [], [], [], 0
            for r in range(args.requests + 1):  # the first one warms up (links, handshakes)
                prompt = [rnd.randrange(3, 259) for _ in range(tokens)]
                if layerwise:
                    assert workers is not None
                    tag = secrets.token_hex(16)
                    procs["decode"].send(prompt, {"do_remote_prefill": True, "datadist": {
                        "mode": "layerwise", "tag": tag, "workers": workers["workers"],
                        "block_size": workers["block_size"]}})
                    procs["prefill"].send(prompt, {"do_remote_decode": True, "datadist": {
                        "mode": "layerwise", "tag": tag}})
                    pre, dec = procs["prefill"].answer(), procs["decode"].answer()
                    first = min(pre["start"], dec["start"])
                    row = (dec["end"] - first, dec["end"] - pre["end"], dec["end"] - first)
                else:
                    pre = procs["prefill"].ask(prompt, {"do_remote_decode": True})
                    dec = procs["decode"].ask(prompt, pre["params"])
                    row = (dec["seconds"], dec["seconds"], dec["end"] - pre["start"])
                if r:
                    ttft.append(row[0])
                    after.append(row[1])
                    total.append(row[2])
                    ends.append(dec["end"])
                    same += dec["tokens"] == pre["tokens"]
            log = (work / "decode.log").read_text()[seen:]
            seen += len(log)
            pattern = (r"([\d.]+) ms after its record was first read" if layerwise else
                       r"datadist: pulled request .* in ([\d.]+) ms")
            pulls = [float(m) for m in re.findall(pattern, log)][1:]
            # The transfer's end (the worker's log line) to the engine call's return: the step
            # that learns of it, the scheduler's hand-off, the last token's forward, the output.
            stamps = [_stamp(m) for m in re.findall(
                r"^(\S+ \S+) .*datadist: (?:pulled|received) request", log, re.M)][1:]
            tail = [(e - s) * 1e3 for e, s in zip(ends, stamps, strict=False)]
            exposed: list[float] = []
            if layerwise:  # the last layer written (prefill log) to all in (decode log)
                pre_log = (work / "prefill.log").read_text()
                written = dict(re.findall(r"\(tag ([0-9a-f]+)\): every layer of \d+ blocks "
                                          r"written at ([\d.]+)", pre_log))
                for tag, seen_at in re.findall(r"\(tag:([0-9a-f]+)\): .* seen at ([\d.]+)",
                                               log)[1:]:
                    if tag in written:
                        exposed.append((float(seen_at) - float(written[tag])) * 1e3)
            kib = tokens * LAYERS * 2 * HIDDEN * 4 / 1024

            def med(xs: list[float], scale: float = 1e3) -> str:
                if not xs:
                    return "-"
                return (f"{statistics.median(xs) * scale:.1f} ms "
                        f"[{min(xs) * scale:.1f}-{max(xs) * scale:.1f}]")

            print(f"{args.connector}: {args.requests} requests of {tokens} tokens "
                  f"({kib:.0f} KiB of KV each); median [min-max]: decode TTFT {med(ttft)}; "
                  f"first token after the prefill's {med(after)}; prefill start to decode "
                  f"token {med(total)}"
                  + (f"; datadist transfer {med(pulls, 1)}" if pulls else "")
                  + (f"; transfer's end to the decode's return {med(tail, 1)}" if tail else "")
                  + (f"; last layer written to all in {med(exposed, 1)}" if exposed
                     else "")
                  + f"; first token equal to the prefill's in {same}/{args.requests}")
        if args.local:  # the same decode engine, each prompt's KV already local
            for tokens in args.tokens:
                hit = []
                for r in range(args.requests + 1):
                    prompt = [rnd.randrange(3, 259) for _ in range(tokens)]
                    procs["decode"].ask(prompt, None)  # computes it: its blocks stay cached
                    again = procs["decode"].ask(prompt, None)
                    if r:
                        hit.append(again["seconds"])
                print(f"local: {args.requests} requests of {tokens} tokens, the prompt's KV "
                      f"already in the decode engine (prefix hit): TTFT median "
                      f"{statistics.median(hit) * 1e3:.1f} ms [{min(hit) * 1e3:.1f}-"
                      f"{max(hit) * 1e3:.1f}]")
        print(f"logs: {work}")
    finally:
        for p in procs.values():
            p.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
