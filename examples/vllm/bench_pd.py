"""Decode time-to-first-token and exposed KV transfer: DatadistConnector against the peers.

    python examples/vllm/bench_pd.py --connector datadist --tokens 257 993 4001 --requests 4 \
        --local --rate 1.5 0.4 0.08 --rate-requests 5
    # --connector datadist | datadist-layerwise | nixl | nixl-tuned | mooncake

Starts a prefill and a decode vLLM engine (``AsyncLLM``, as a server runs it, each in its
own process tree) with the chosen connector on a locally made random-weight Llama (8 layers,
8 KV heads x 64, fp32: 32 KiB of KV per token), prefill on CPU 0 and decode on CPU 1, and
routes each request as a P/D router does: prefill with ``max_tokens=1``, then decode with
``max_tokens=1`` and the prefill's ``kv_transfer_params`` (layer-wise: both at once, one
tag; Mooncake: the router names the prefill's bootstrap server and a ``transfer_id``).

Passes, per prompt length: ``--local`` first (the decode engine with the prompt's KV already
local, a prefix hit, sent as the prefill engine answers a short request, so both engines are
as busy as in a P/D request); then one request at a time (the first of each length warms
up); then, with ``--rate``, requests arriving at that steady rate (``--arrivals poisson`` or
``fixed``), several in flight. Reported per pass: the decode's first token after the
prefill's answer (the decode call; layer-wise: the decode's end minus the prefill's), minus
the local hit's median: the *exposed transfer*; arrival to first token; and, for datadist,
the connector's trace (``kv_connector_extra_config["trace"]``, wall clocks in both engines'
logs): decode call -> allocated (scheduler) -> pulled (worker: the KV is in and checked) ->
reported (the worker's ``get_finished`` returns it) -> learned (the scheduler's
``update_connector_output``) -> scheduled (the request's computing step) -> answer (the
front end's output), the pull's stages allocated -> linked (its link up, first mailbox read
issued) -> held (the mailbox said HELD, KV pull issued) -> pulled; layer-wise also the
prefill's last layer written -> all in. Every pass also gives the prefill's own time (its
call to its answer). The first request of each length (the warm-up; for the first length,
the pair's first transfer) is printed beside the next one.

``--sched`` adds, per request, the prefill worker's compute thread during the prefill (run,
run-queue wait, the rest; ``/proc/<tid>/schedstat``) and the CPU time of each engine's
process tree meanwhile, with its busiest threads: where a slow prefill's time went.
``--plain N`` first times N plain requests on the prefill engine alone (no transfer): a
single engine's prefill of the same prompt. ``--bind-all`` binds each engine's every process
to its CPU (vLLM's CPU backend binds only the worker's compute threads).

NIXL needs ``nixl`` (``pip install nixl nixl-cu12``, torch first) and runs with
``kv_buffer_device="cpu"``, UCX backend; ``nixl-tuned`` removes the two things that slow it
on a CPU host, from outside vLLM (``nixl_tuned/sitecustomize.py``). ``mooncake`` runs vLLM's
MooncakeConnector over TCP (``mooncake-transfer-engine-non-cuda``); vLLM 0.32's worker
asks torch for an accelerator at start, which ``mooncake_cpu/sitecustomize.py`` answers on a
CPU host (docs/vllm.md, "Speed").
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
from typing import Any

LAYERS, HIDDEN, HEADS = 8, 512, 8


def _ktc(role: str, connector: str) -> Any:
    from vllm.config import KVTransferConfig

    if connector.startswith("nixl"):
        return KVTransferConfig(kv_connector="NixlConnector", kv_role=role,
                                kv_buffer_device="cpu")
    if connector == "mooncake":  # TCP: no RDMA device here
        return KVTransferConfig(kv_connector="MooncakeConnector", kv_role=role,
                                engine_id=f"bench-{role}",
                                kv_connector_extra_config={"mooncake_protocol": "tcp"})
    return KVTransferConfig(kv_connector="DatadistConnector",
                            kv_connector_module_path="datadist.integrations.vllm",
                            kv_role=role, kv_connector_extra_config={
                                "trace": True,  # the per-request timestamps read below
                                **json.loads(os.environ.get("BENCH_PD_EXTRA", "{}")),
                                "mode": "layerwise" if connector.endswith("layerwise")
                                else "pull"})


def node(model: str, role: str, connector: str) -> None:
    """One engine (vLLM's AsyncLLM, as a server runs it): each stdin line is a request
    (``id``, ``prompt``, ``params``), answered on stdout (``@@`` + JSON) when its one token is
    out; requests run concurrently (the rate mode)."""
    import asyncio
    import threading

    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.async_llm import AsyncLLM

    if os.environ.get("BENCH_PD_CPUS"):  # --bind-all: the engine's every process
        os.sched_setaffinity(0, {int(c) for c in os.environ["BENCH_PD_CPUS"].split(",")})

    async def serve() -> None:
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
            model=model, load_format="dummy", dtype="float32", block_size=32,
            max_model_len=int(os.environ.get("BENCH_PD_MAX_LEN", "2048")), max_num_seqs=8,
            enforce_eager=True, seed=0, kv_transfer_config=_ktc(role, connector),
            # the decode engine's "local" figure is a prefix hit (--local); the prompts are
            # random, so no connector run hits its cache
            enable_prefix_caching=role == "kv_consumer"))
        loop = asyncio.get_running_loop()
        lines: asyncio.Queue[str | None] = asyncio.Queue()

        def read() -> None:
            for ln in sys.stdin:
                loop.call_soon_threadsafe(lines.put_nowait, ln)
            loop.call_soon_threadsafe(lines.put_nowait, None)

        threading.Thread(target=read, daemon=True).start()

        async def one(req: dict) -> None:
            sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True,
                                extra_args={"kv_transfer_params": req["params"]})
            start = time.time()
            t0 = time.perf_counter()
            out = None
            async for o in engine.generate(TokensPrompt(prompt_token_ids=req["prompt"]),
                                           sp, request_id=req["id"]):
                out = o
            dt = time.perf_counter() - t0
            assert out is not None
            print("@@" + json.dumps({"id": req["id"], "params": out.kv_transfer_params,
                                     "seconds": dt, "start": start, "end": time.time(),
                                     "tokens": list(out.outputs[0].token_ids)}), flush=True)

        running = set()
        print("READY", flush=True)
        while (ln := await lines.get()) is not None:
            task = asyncio.create_task(one(json.loads(ln)))
            running.add(task)
            task.add_done_callback(running.discard)
        engine.shutdown()

    asyncio.run(serve())


class Proc:
    def __init__(self, args: list[str], env: dict, log: Path) -> None:
        self.log = log
        self.p = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=open(log, "wb"), env=env,  # noqa: SIM115
                                  start_new_session=True)  # stop() ends the engine's children
        self.buf = b""

    def take(self) -> str | None:
        """A complete READY or answer line already read, else None."""
        while b"\n" in self.buf:
            ln, _, self.buf = self.buf.partition(b"\n")
            s = ln.decode(errors="replace")
            if s == "READY" or s.startswith("@@"):
                return s
        return None

    def fill(self) -> None:
        chunk = os.read(self.p.stdout.fileno(), 65536)
        if not chunk:
            raise RuntimeError(f"engine exited; see {self.log}")
        self.buf += chunk

    def line(self, timeout: float = 900) -> str:
        end = time.monotonic() + timeout
        while (s := self.take()) is None:
            if not select.select([self.p.stdout], [], [], max(0.0, end - time.monotonic()))[0]:
                raise TimeoutError(f"no answer; see {self.log}")
            self.fill()
        return s

    def send(self, rid: str, prompt: list[int], params: dict | None) -> None:
        self.p.stdin.write((json.dumps({"id": rid, "prompt": prompt, "params": params})
                            + "\n").encode())
        self.p.stdin.flush()

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.p.pid, signal.SIGKILL)
        self.p.wait(30)


def threads(pgid: int) -> dict[int, tuple[str, int, int, int, int]]:
    """Every thread of the process group ``pgid`` (one engine's process tree, as ``Proc``
    starts it): tid -> (process name, run ns, run-queue wait ns, voluntary and involuntary
    switches), from ``/proc`` (``--sched``)."""
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            name = stat[stat.index("(") + 1:stat.rindex(")")]
            for tid in os.listdir(f"/proc/{pid}/task"):
                run, wait, _ = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()
                st = Path(f"/proc/{pid}/task/{tid}/status").read_text()
                sw = [int(x) for x in re.findall(r"ctxt_switches:\s+(\d+)", st)]
                comm = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
                out[int(tid)] = (f"{name}/{comm}", int(run), int(wait), sw[0], sw[1])
        except (OSError, ValueError, IndexError):
            continue
    return out


def sched_delta(a: dict, b: dict, wall: float) -> dict[str, float]:
    """From two ``threads`` snapshots ``wall`` seconds apart: the busiest thread (the
    worker's compute thread) -- its run, run-queue wait and the rest (blocked or sleeping),
    seconds, and its switches -- and the whole tree's run time."""
    zero = ("", 0, 0, 0, 0)
    d = {t: tuple(b[t][i] - a.get(t, zero)[i] for i in range(1, 5)) for t in b}
    if not d:
        return {}
    busiest = sorted(d, key=lambda t: -d[t][0])[:4]
    top = max(d.values(), key=lambda v: v[0])
    return {"run": top[0] / 1e9, "runq": top[1] / 1e9,
            "blocked": wall - (top[0] + top[1]) / 1e9, "vcsw": top[2], "ivcsw": top[3],
            "tree_run": sum(v[0] for v in d.values()) / 1e9,
            "busiest": [[b[t][0], t, d[t][0] / 1e9] for t in busiest]}


def drain(p: Proc) -> list[str]:
    out = []
    while (s := p.take()) is not None:
        out.append(s)
    return out


def answers(procs: dict[str, Proc], timeout: float) -> list[tuple[str, dict]]:
    """The engines' answers read within ``timeout`` seconds: (engine name, answer)."""
    out = [(n, json.loads(s[2:])) for n, p in procs.items() for s in drain(p)]
    if out:
        return out
    ready = select.select([p.p.stdout for p in procs.values()], [], [], max(0.0, timeout))[0]
    for p in procs.values():
        if p.p.stdout in ready:
            p.fill()
    return [(n, json.loads(s[2:])) for n, p in procs.items() for s in drain(p)]


def drive(procs: dict[str, Proc], connector: str, prompts: list[list[int]],
          arrivals: list[float] | None, prefix: str, workers: dict | None,
          sched: bool = False) -> list[dict]:
    """Run ``prompts`` through the pair, as a router would: one at a time (``arrivals``
    None: each request starts when the previous one's decode answered) or at the given
    offsets (seconds from the start; the rate mode). Pull modes (datadist, NIXL, Mooncake):
    the prefill first, the decode once the prefill's answer is in; layer-wise: both at
    once, one tag. Returns per request its arrival and both engines' answers."""
    n = len(prompts)
    rows: dict[str, dict] = {}
    t0 = time.time()
    nxt = 0
    deadline = time.monotonic() + 900 + 60 * n
    layerwise = connector == "datadist-layerwise"
    def done(r: dict) -> bool:  # layer-wise: the decode may answer before the prefill
        return "dec" in r and "pre" in r

    while sum(map(done, rows.values())) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{n - len(rows)} requests unanswered")
        now = time.time()
        due = nxt < n and (now >= t0 + arrivals[nxt] if arrivals is not None
                           else all(map(done, rows.values())))
        if due:
            rid = f"{prefix}{nxt}"
            prompt = prompts[nxt]
            rows[rid] = {"arrival": now, "prompt": prompt}
            if sched:  # both engines' threads as the prefill starts (--sched)
                rows[rid]["sched0"] = {k: threads(p.p.pid) for k, p in procs.items()}
            if layerwise:
                assert workers is not None
                tag = secrets.token_hex(16)
                procs["decode"].send(rid, prompt, {"do_remote_prefill": True, "datadist": {
                    "mode": "layerwise", "tag": tag, "workers": workers["workers"],
                    "block_size": workers["block_size"]}})
                procs["prefill"].send(rid, prompt, {"do_remote_decode": True, "datadist": {
                    "mode": "layerwise", "tag": tag}})
            else:
                params: dict[str, Any] = {"do_remote_decode": True}
                if connector == "mooncake":
                    params["transfer_id"] = rid
                procs["prefill"].send(rid, prompt, params)
            nxt += 1
            continue
        wait = (t0 + arrivals[nxt] - now) if arrivals is not None and nxt < n else 1.0
        for name, a in answers(procs, wait):
            row = rows[a["id"]]
            if name == "prefill":
                row["pre"] = a
                if sched:
                    wall = time.time() - row["arrival"]
                    row["sched"] = {k: sched_delta(row["sched0"][k], threads(p.p.pid), wall)
                                    for k, p in procs.items()}
                if layerwise:
                    continue
                params = a["params"]
                if connector == "mooncake":  # the router names the prefill's bootstrap
                    params = {"do_remote_prefill": True, "transfer_id": a["id"],
                              "remote_engine_id": "bench-kv_producer",
                              "remote_bootstrap_addr": "http://127.0.0.1:"
                              + os.environ["BENCH_PD_MOONCAKE_PORT"]}
                procs["decode"].send(a["id"], row["prompt"], params)
            else:
                row["dec"] = a
    return [rows[f"{prefix}{i}"] for i in range(n)]


def traces(log: str) -> dict[str, dict[str, float]]:
    """The connector's trace lines (connector.py ``_trace``): request id -> event -> time.
    vLLM may suffix the id it was given; the bench's ids are ``<letter><digits>x<digits>``."""
    out: dict[str, dict[str, float]] = {}
    for rid, event, at in re.findall(
            r"datadist trace: ([a-z]\d+x\d+)\S* (\w+)[^\n]* at ([\d.]+)", log):
        out.setdefault(rid, {}).setdefault(event, float(at))
    return out


def med(xs: list[float], scale: float = 1e3) -> str:
    """median [min-max] in ms."""
    if not xs:
        return "-"
    return (f"{statistics.median(xs) * scale:.1f} [{min(xs) * scale:.1f}-"
            f"{max(xs) * scale:.1f}]")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--connector", choices=("datadist", "datadist-layerwise", "nixl",
                                            "nixl-tuned", "mooncake"),
                    default="datadist")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1000],
                    help="prompt lengths (one engine pair runs each in turn)")
    ap.add_argument("--requests", type=int, default=5)
    ap.add_argument("--rate", type=float, nargs="+", default=[],
                    help="also run each length at a steady rate, requests/s (one value, or "
                    "one per --tokens)")
    ap.add_argument("--rate-requests", type=int, default=0,
                    help="requests per length at --rate (default: --requests)")
    ap.add_argument("--arrivals", choices=("poisson", "fixed"), default="poisson")
    ap.add_argument("--local", action="store_true",
                    help="also time each length with the prompt's KV already local")
    ap.add_argument("--extra", default="{}", help="datadist's kv_connector_extra_config "
                    "(JSON), e.g. '{\"idle_wait_ms\": 0}'")
    ap.add_argument("--json", help="append one JSON line per pass to this file")
    ap.add_argument("--bind-all", action="store_true",
                    help="bind each engine's every process (front end, engine core, worker) "
                    "to its CPU, not only the worker's compute threads")
    ap.add_argument("--sched", action="store_true",
                    help="also report, per request, the prefill engine's compute thread "
                    "during the prefill (run, run-queue wait, blocked; /proc schedstat) and "
                    "the CPU time of each engine's process tree meanwhile")
    ap.add_argument("--plain", type=int, default=0, metavar="N",
                    help="per length, first time N plain requests (no KV transfer) on the "
                    "prefill engine alone: a single engine's prefill of the same prompt")
    ap.add_argument("--node", nargs=3, metavar=("MODEL", "ROLE", "CONNECTOR"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.node:
        node(*args.node)
        return 0
    if args.rate and len(args.rate) not in (1, len(args.tokens)):
        ap.error("--rate takes one value or one per --tokens")
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
                VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
                VLLM_MOONCAKE_BOOTSTRAP_PORT="25700", BENCH_PD_MOONCAKE_PORT="25700")
    os.environ["BENCH_PD_MOONCAKE_PORT"] = "25700"
    cpus = sorted(os.sched_getaffinity(0))
    procs = {}
    for i, (name, role) in enumerate((("prefill", "kv_producer"), ("decode", "kv_consumer"))):
        bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND") or (
            str(cpus[i]) if len(cpus) >= 2 else "nobind")
        env = dict(base, VLLM_NIXL_SIDE_CHANNEL_PORT=str(25600 + 10 * i),
                   VLLM_CPU_OMP_THREADS_BIND=bind)
        if args.bind_all and bind != "nobind":  # "0", "0-3", "0,2": as vLLM reads it
            env["BENCH_PD_CPUS"] = ",".join(
                str(c) for part in bind.split(",") for c in range(
                    int(part.split("-")[0]), int(part.split("-")[-1]) + 1))
        if args.connector == "nixl-tuned":  # every process of the engine runs it at start
            tuned = str(Path(__file__).resolve().parent / "nixl_tuned")
            env.update(BENCH_PD_NIXL_TUNED="1", PYTHONPATH=os.pathsep.join(
                [tuned, *filter(None, [os.environ.get("PYTHONPATH")])]))
        if args.connector == "mooncake":  # its worker asks for an accelerator
            shim = str(Path(__file__).resolve().parent / "mooncake_cpu")
            env.update(BENCH_PD_MOONCAKE_CPU="1", PYTHONPATH=os.pathsep.join(
                [shim, *filter(None, [os.environ.get("PYTHONPATH")])]))
        procs[name] = Proc([sys.executable, __file__, "--node", str(model), role,
                            args.connector], env, work / f"{name}.log")
    import random

    rnd = random.Random(0)
    report: list[dict] = []

    def emit(rec: dict) -> None:
        report.append(rec)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(rec) + "\n")

    try:
        for p in procs.values():
            assert p.line() == "READY"
        layerwise = args.connector == "datadist-layerwise"
        workers = None
        if layerwise:  # a layer-wise router learns the prefill's workers from any answer
            procs["prefill"].send("h0", [5, 6, 7], {"do_remote_decode": True,
                                                    "datadist": {"mode": "layerwise"}})
            workers = json.loads(procs["prefill"].line()[2:])["params"]["datadist"]
        for tokens in args.tokens if args.plain else []:  # a single engine's prefill
            plain: list[float] = []
            for r in range(args.plain + 1):
                prompt = [rnd.randrange(3, 259) for _ in range(tokens)]
                procs["prefill"].send(f"q{tokens}x{r}", prompt, None)
                a = json.loads(procs["prefill"].line()[2:])
                if r:  # the first warms up
                    plain.append(a["seconds"])
            emit({"pass": "plain", "connector": args.connector, "tokens": tokens,
                  "prefill": plain, "load": os.getloadavg()})
            print(f"plain: {args.plain} requests of {tokens} tokens on the prefill engine "
                  f"alone: prefill {med(plain)} ms; load {os.getloadavg()[0]:.1f}", flush=True)
        local: dict[int, list[float]] = {}
        if args.local:  # the decode engine, each prompt's KV already local: TTFT of a hit
            for tokens in args.tokens:
                hit, sched = [], []
                for r in range(args.requests + 1):
                    prompt = [rnd.randrange(3, 259) for _ in range(tokens)]
                    procs["decode"].send(f"a{tokens}x{r}", prompt, None)  # now it is cached
                    procs["decode"].line()
                    # as in a P/D request, the hit comes as the prefill engine answers (its
                    # processes just active beside the decode's): a short plain request there
                    procs["prefill"].send(f"p{tokens}x{r}", prompt[:16], None)
                    procs["prefill"].line()
                    procs["decode"].send(f"b{tokens}x{r}", prompt, None)
                    a = json.loads(procs["decode"].line()[2:])
                    if r:
                        hit.append(a["seconds"])
                        sched.append(a)
                tr = traces((work / "decode.log").read_text())
                path = [a["end"] - tr[f"b{tokens}x{i + 1}"[:1] + a["id"][1:]]["scheduled"]
                        for i, a in enumerate(sched) if a["id"] in tr
                        and "scheduled" in tr[a["id"]]] if not args.connector.startswith(
                            ("nixl", "mooncake")) else []
                local[tokens] = hit
                emit({"pass": "local", "connector": args.connector, "tokens": tokens,
                      "ttft": hit, "scheduled_to_answer": path, "load": os.getloadavg()})
                print(f"local: {args.requests} requests of {tokens} tokens, the prompt's KV "
                      f"already in the decode engine (prefix hit): TTFT {med(hit)} ms"
                      + (f"; scheduled to answer {med(path)} ms" if path else "")
                      + f"; load {os.getloadavg()[0]:.1f}", flush=True)
        passes = [("one at a time", None)]
        if args.rate:
            passes.append(("rate", args.rate))
        seq = 0
        for label, rates in passes:
            for li, tokens in enumerate(args.tokens):
                n = args.requests if rates is None else (args.rate_requests or args.requests)
                prompts = [[rnd.randrange(3, 259) for _ in range(tokens)]
                           for _ in range(n + 1)]
                arrivals = None
                rate = 0.0
                if rates is not None:
                    rate = rates[li] if len(rates) > 1 else rates[0]
                    t, arrivals = 0.0, []
                    for _ in prompts:
                        arrivals.append(t)
                        t += rnd.expovariate(rate) if args.arrivals == "poisson" else 1 / rate
                load0 = os.getloadavg()[0]
                if rates is not None:  # its warm-up alone, then the rated requests
                    drive(procs, args.connector, prompts[:1], None, f"w{seq}x", workers,
                          args.sched)
                    prompts, arrivals = prompts[1:], [a - arrivals[1] for a in arrivals[1:]]
                rows = drive(procs, args.connector, prompts, arrivals, f"r{seq}x", workers,
                             args.sched)
                seq += 1
                warm = None
                if rates is None:
                    warm, rows = rows[0], rows[1:]  # the first one warmed up (links, ...)
                load1 = os.getloadavg()[0]
                if warm is not None:  # the first request the pair saw of this length
                    t = traces((work / "decode.log").read_text()).get(warm["dec"]["id"], {})
                    second = rows[0] if rows else warm

                    def took(r: dict) -> float:
                        return (r["dec"]["end"] - r["pre"]["end"] if layerwise
                                else r["dec"]["seconds"])

                    pulled = (t["pulled"] - t["allocated"]
                              if "pulled" in t and "allocated" in t else None)
                    stages = "".join(
                        f"; its {a}->{b} {(t[b] - t[a]) * 1e3:.1f} ms"
                        for a, b in (("allocated", "linked"), ("linked", "held"),
                                     ("held", "pulled")) if a in t and b in t)
                    emit({"pass": "first", "connector": args.connector, "tokens": tokens,
                          "first": took(warm), "second": took(second),
                          "first_allocated_to_pulled": pulled, "pair_first": seq == 1,
                          "load": os.getloadavg()})
                    print(f"first request of {tokens} tokens"
                          + (" (the pair's first P/D request)" if seq == 1 else "")
                          + f": decode's first token after the prefill's answer "
                          f"{took(warm) * 1e3:.1f} ms, the next request's "
                          f"{took(second) * 1e3:.1f} ms"
                          + (f"; its allocated->pulled {pulled * 1e3:.1f} ms"
                             if pulled is not None else "") + stages, flush=True)
                after, e2e, same = [], [], 0
                for row in rows:
                    pre, dec = row["pre"], row["dec"]
                    # the decode's first token after the prefill's answer: the decode call
                    # (it starts then) or, layer-wise, the decode's end minus the prefill's
                    after.append(dec["end"] - pre["end"] if layerwise else dec["seconds"])
                    e2e.append(dec["end"] - row["arrival"])
                    same += dec["tokens"] == pre["tokens"]
                tr = traces((work / "decode.log").read_text())
                steps: dict[str, list[float]] = {}

                def gap(name: str, a: float | None, b: float | None,
                        steps: dict[str, list[float]] = steps) -> None:
                    if a is not None and b is not None:
                        steps.setdefault(name, []).append(b - a)

                for row in rows:
                    t = tr.get(row["dec"]["id"], {})
                    gap("decode call->allocated", row["dec"]["start"], t.get("allocated"))
                    gap("pulled->reported", t.get("pulled"), t.get("reported"))
                    gap("reported->learned", t.get("reported"), t.get("learned"))
                    gap("learned->scheduled", t.get("learned"), t.get("scheduled"))
                    gap("pulled->scheduled", t.get("pulled"), t.get("scheduled"))
                    gap("scheduled->answer", t.get("scheduled"), row["dec"]["end"])
                    gap("allocated->pulled", t.get("allocated"), t.get("pulled"))
                    gap("allocated->linked", t.get("allocated"), t.get("linked"))
                    gap("linked->held", t.get("linked"), t.get("held"))
                    gap("held->pulled", t.get("held"), t.get("pulled"))
                    gap("prefill", row["pre"]["start"], row["pre"]["end"])
                    for eng, d in row.get("sched", {}).items():
                        for k in (("run", "runq", "blocked") if eng == "prefill" else ()):
                            steps.setdefault(f"prefill compute thread {k}", []).append(d[k])
                        steps.setdefault(f"{eng} tree CPU during prefill", []).append(
                            d["tree_run"])
                if layerwise:  # the prefill's last layer written to every layer in
                    first = min(r["arrival"] for r in rows)
                    last = max(r["dec"]["end"] for r in rows)
                    written = dict(re.findall(r"\(tag ([0-9a-f]+)\): every layer of \d+ "
                                              r"blocks written at ([\d.]+)",
                                              (work / "prefill.log").read_text()))
                    for tag, at in re.findall(r"\(tag:([0-9a-f]+)\): .* seen at ([\d.]+)",
                                              (work / "decode.log").read_text()):
                        if tag in written and first <= float(at) <= last:
                            gap("last layer written->all in", float(written[tag]), float(at))
                hit = local.get(tokens)
                exposed = (statistics.median(after) - statistics.median(hit)) if hit else None
                rec = {"pass": label, "connector": args.connector, "tokens": tokens,
                       "rate": rate, "arrivals": args.arrivals if rates else None,
                       "after_prefill": after, "e2e": e2e, "steps": steps,
                       "exposed_ms": None if exposed is None else exposed * 1e3,
                       "same": same, "n": len(rows), "load": [load0, load1],
                       "sched": [r.get("sched") for r in rows],
                       "requests": [[r["dec"]["id"], r["dec"]["tokens"] == r["pre"]["tokens"],
                                     r["pre"]["start"], r["pre"]["end"], r["dec"]["start"],
                                     r["dec"]["end"]] for r in rows]}
                emit(rec)
                print(f"{args.connector}, {label}"
                      + (f" ({rate:g}/s, {args.arrivals})" if rates else "")
                      + f": {len(rows)} requests of {tokens} tokens, median [min-max] ms: "
                      f"decode's first token after the prefill's answer {med(after)}"
                      + (f" (exposed, minus the local hit's median: {exposed * 1e3:.1f})"
                         if exposed is not None else "")
                      + f"; arrival to first token {med(e2e)}"
                      + "".join(f"; {k} {med(v)}" for k, v in steps.items())
                      + f"; first token equal to the prefill's in {same}/{len(rows)}"
                      + f"; load {load0:.1f}-{load1:.1f}", flush=True)
                for row in rows if args.sched else []:
                    print(f"  {row['dec']['id']} busiest threads during the prefill (s of "
                          "CPU): " + "; ".join(
                              f"{eng}: " + ", ".join(f"{n} {s:.2f}" for n, _, s in
                                                     d.get("busiest", []))
                              for eng, d in row.get("sched", {}).items()), flush=True)
        print(f"logs: {work}")
    finally:
        for p in procs.values():
            p.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
