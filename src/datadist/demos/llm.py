"""A real disaggregated inference run: prefill in one process, decode in another.

    python -m datadist.demos.llm [--layers N] [--prompts N] [--new-tokens N] [--layerwise]
                                 [--checkpoint DIR] [--dtype float32|bfloat16|float16]

Who calls: ``datadist demo --llm`` and ``python -m``; ``main`` blocks until the run is over
and returns 0 when every request's tokens match ``model.generate()``.

Three processes:

- PROMPT: builds the model, registers a paged KV cache (per layer K and V, each
  [num_blocks, block_size, kv_heads, head_dim]) with datadist under
  ``BlocksCacheKey(prompt_cluster, 0)``, prefills a batch of prompts of different lengths
  into blocks handed out in shuffled order, and sends each request's block table, its first
  token and a digest of its KV bytes to the DECODER over the control channel.
- DECODER: builds the same model, registers its own paged cache, ``link_clusters`` to the
  PROMPT, ``pull_blocks`` each request's blocks into blocks of its own (all layers at once,
  or one layer at a time with ``--layerwise``), rebuilds a transformers cache from them and
  decodes greedily.
- this process: starts the two, relays their progress, runs ``model.generate()`` on the same
  weights as the reference, and prints one row per request.

The control channel is a ``multiprocessing.Pipe`` between PROMPT and DECODER (pickled
dicts); the KV bytes never travel on it, only through datadist. A real deployment sends the
same small message over its own RPC: cluster id and address, cache geometry, block tables.

torch and transformers are imported only when the demo runs (``pip install 'datadist[llm]'``).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, TextIO, cast

import numpy as np

PROMPT_CLUSTER = 1
DECODER_CLUSTER = 2
MODEL_ID = 0
CONTROL_TIMEOUT_S = 300.0  # the longest one side waits for the other's next message
PULL_TIMEOUT_MS = 60_000  # sync_kv_timeout: generous, a loaded CI machine is slow
LINK_TIMEOUT_MS = 10_000


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from datadist.argparsing import OneLineParser

    p = OneLineParser(
        prog="datadist demo --llm",
        description="Prefill a Llama model in one process, move its paged KV cache with "
                    "datadist, decode in another; check the tokens against generate().")
    p.add_argument("--layers", type=int, default=8, help="decoder layers (default 8)")
    p.add_argument("--prompts", type=int, default=4, help="requests in the batch (default 4)")
    p.add_argument("--new-tokens", type=int, default=16,
                   help="tokens to generate per request, the prefill's first one included "
                        "(default 16)")
    p.add_argument("--layerwise", action="store_true",
                   help="pull one layer at a time (src_layer_range / dst_layer_range)")
    p.add_argument("--checkpoint", metavar="DIR",
                   help="a local Hugging Face checkpoint directory to load instead of random "
                        "weights (the model options below are then ignored)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--heads", type=int, default=8, help="attention heads (default 8)")
    p.add_argument("--kv-heads", type=int, default=4, help="key/value heads (default 4)")
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--max-prompt-len", type=int, default=512,
                   help="the longest prompt, in tokens (default 512)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    p.add_argument("--seed", type=int, default=0, help="weights and prompts seed (default 0)")
    p.add_argument("--transport", choices=("auto", "tcp", "cma"), default="auto",
                   help="datadist data path (default auto: same-host copy where it can)")
    args = p.parse_args(argv)
    for name in ("layers", "prompts", "new_tokens", "hidden_size", "heads", "kv_heads",
                 "vocab_size", "max_prompt_len", "block_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.checkpoint and not os.path.isdir(args.checkpoint):
        p.error(f"--checkpoint {args.checkpoint}: not a directory")
    if args.hidden_size % args.heads or args.heads % args.kv_heads:
        p.error("--hidden-size must be a multiple of --heads, and --heads of --kv-heads")
    return args


def make_prompts(count: int, max_len: int, vocab: int, block_size: int,
                 seed: int) -> list[list[int]]:
    """``count`` random prompts of different lengths up to ``max_len``, spread evenly and
    jittered so that most do not end on a block boundary."""
    rng = np.random.default_rng(seed)
    prompts = []
    for i in range(count):
        top = max(1, max_len * (i + 1) // count)
        length = max(1, top - int(rng.integers(0, block_size)))
        prompts.append(rng.integers(0, vocab, size=length).tolist())
    return prompts


# ---------------------------------------------------------------- results


@dataclass
class RequestRow:
    """One request's outcome, as the table prints it."""

    req_id: int
    prompt_len: int
    blocks: int
    kv_bytes: int
    pull_s: float
    kv_identical: bool
    tokens: list[int]
    reference: list[int]

    @property
    def gbps(self) -> float:
        return self.kv_bytes / self.pull_s / 1e9 if self.pull_s > 0 else 0.0

    @property
    def match(self) -> bool:
        return self.tokens == self.reference


@dataclass
class DemoReport:
    rows: list[RequestRow]
    data_path: str

    @property
    def ok(self) -> bool:
        return bool(self.rows) and all(r.match and r.kv_identical for r in self.rows)


# ---------------------------------------------------------------- the two roles


class DemoError(Exception):
    """The demo could not run to the end: the model would not load, or a process failed."""


class _ChildFailed(DemoError):
    """A child process reported an error (its traceback is the message) or died."""


def _spec(cfg: dict[str, Any]) -> Any:
    from datadist.demos._llm_torch import ModelSpec

    return ModelSpec(cfg["layers"], cfg["hidden_size"], cfg["heads"], cfg["kv_heads"],
                     cfg["vocab_size"], cfg["seed"], cfg["dtype"], cfg["checkpoint"])


def _recv(conn: Connection, kind: str) -> dict[str, Any]:
    """The peer's next message, which must be ``kind``; waits at most CONTROL_TIMEOUT_S."""
    if not conn.poll(CONTROL_TIMEOUT_S):
        raise TimeoutError(f"no {kind!r} message within {CONTROL_TIMEOUT_S:.0f} s")
    msg = conn.recv()
    if msg.get("kind") != kind:
        raise RuntimeError(f"expected a {kind!r} message, got {msg!r}")
    return dict(msg)


def _datadist(role: Any, cluster_id: int, cfg: dict[str, Any], listen: str = "") -> Any:
    import datadist as llm_datadist

    config = llm_datadist.LLMConfig()
    config.enable_cache_manager = True
    config.sync_kv_timeout = PULL_TIMEOUT_MS
    if listen:
        config.listen_ip_info = listen
    if cfg["transport"] != "auto":
        config.transport = cfg["transport"]  # a datadist extra: force a data path
    dd = llm_datadist.LLMDataDist(role, cluster_id)
    dd.init(config.generate_options())
    return dd


def _register(dd: Any, blocks: list[Any], geo: Any, cluster_id: int) -> Any:
    import datadist as llm_datadist

    dtype = {"float32": llm_datadist.DataType.DT_FLOAT,
             "bfloat16": llm_datadist.DataType.DT_BF16,
             "float16": llm_datadist.DataType.DT_FLOAT16}[geo.dtype]
    # Host memory: the demo runs the model on the CPU.
    desc = llm_datadist.CacheDesc(num_tensors=geo.num_tensors, shape=geo.shape,
                                  data_type=dtype, placement=llm_datadist.Placement.HOST)
    return dd.cache_manager.register_blocks_cache(
        desc, [t.data_ptr() for t in blocks], llm_datadist.BlocksCacheKey(cluster_id, MODEL_ID))


def _prompt_role(cfg: dict[str, Any], prompts: list[list[int]], ctrl: Connection,
                 report: Connection) -> None:
    """The PROMPT process: prefill, write paged blocks, hand out block tables."""
    say = _Say(report, "prompt")
    try:
        import datadist as llm_datadist
        from datadist.demos import _llm_torch as lt

        t0 = time.perf_counter()
        model = lt.build_model(_spec(cfg))
        say(f"model ready in {time.perf_counter() - t0:.1f} s ({lt.versions()})")
        bs = cfg["block_size"]
        needed = [lt.blocks_needed(len(p), bs) for p in prompts]
        # Spare blocks, and tables drawn from a shuffled free list, as a serving engine's
        # allocator hands them out after some churn: the blocks of a request are scattered.
        geo = lt.kv_geometry(model, sum(needed) + len(prompts), bs, cfg["dtype"])
        free = np.random.default_rng(cfg["seed"] + 1).permutation(geo.num_blocks).tolist()

        dd = _datadist(llm_datadist.LLMRole.PROMPT, PROMPT_CLUSTER, cfg, "127.0.0.1:0")
        blocks = lt.alloc_blocks(geo)
        cache = _register(dd, blocks, geo, PROMPT_CLUSTER)
        host, port = dd.listen_address
        ctrl.send({"kind": "hello", "cluster_id": PROMPT_CLUSTER, "host": host, "port": port,
                   "geometry": geo, "weights": lt.weights_digest(model)})

        requests = []
        for i, prompt in enumerate(prompts):
            t = time.perf_counter()
            first, kv = lt.prefill(model, prompt)
            table = [free.pop() for _ in range(needed[i])]
            lt.write_blocks(blocks, kv, table, bs)
            requests.append({"req_id": i, "prompt_len": len(prompt), "table": table,
                             "first_token": first, "digest": lt.blocks_digest(blocks, table)})
            say(f"prefill {i + 1}/{len(prompts)}: {len(prompt)} tokens -> blocks "
                f"{_short(table)} in {time.perf_counter() - t:.2f} s")
        ctrl.send({"kind": "batch", "requests": requests})

        _recv(ctrl, "pulled")  # the decoder has every block; the memory may go now
        dd.cache_manager.unregister_cache(cache.cache_id)
        dd.finalize()
        report.send({"kind": "finished"})
    except BaseException:
        report.send({"kind": "error", "role": "prompt", "traceback": traceback.format_exc()})
        raise SystemExit(1) from None


def _decoder_role(cfg: dict[str, Any], ctrl: Connection, report: Connection) -> None:
    """The DECODER process: link, pull each request's blocks, rebuild the cache, decode."""
    say = _Say(report, "decoder")
    try:
        import datadist as llm_datadist
        from datadist.demos import _llm_torch as lt

        t0 = time.perf_counter()
        model = lt.build_model(_spec(cfg))
        say(f"model ready in {time.perf_counter() - t0:.1f} s")
        hello = _recv(ctrl, "hello")
        geo = hello["geometry"]
        mine = lt.kv_geometry(model, geo.num_blocks, geo.block_size, cfg["dtype"])
        if mine != geo:
            raise RuntimeError(f"KV geometry differs: prompt {geo}, decoder {mine}")
        if hello["weights"] != lt.weights_digest(model):
            raise RuntimeError("the prompt and decoder processes hold different weights")

        dd = _datadist(llm_datadist.LLMRole.DECODER, DECODER_CLUSTER, cfg)
        blocks = lt.alloc_blocks(geo)
        dst_cache = _register(dd, blocks, geo, DECODER_CLUSTER)
        remote = llm_datadist.LLMClusterInfo()
        remote.remote_cluster_id = hello["cluster_id"]
        remote.append_local_ip_info("127.0.0.1", 0)
        remote.append_remote_ip_info(hello["host"], hello["port"])
        code, _ = dd.link_clusters([remote], LINK_TIMEOUT_MS)
        if code != llm_datadist.LLMStatusCode.LLM_SUCCESS:
            raise RuntimeError(f"link_clusters to the prompt failed: {code}")
        path = dd.engine.get_link(hello["cluster_id"]).path_name  # a datadist extra
        say(f"linked to cluster {hello['cluster_id']} at {hello['host']}:{hello['port']} "
            f"(data path: {path})")

        batch = _recv(ctrl, "batch")["requests"]
        key = llm_datadist.BlocksCacheKey(hello["cluster_id"], MODEL_ID)
        free = np.random.default_rng(cfg["seed"] + 2).permutation(geo.num_blocks).tolist()
        pulled = []
        for n, req in enumerate(batch):
            src = req["table"]
            dst = [free.pop() for _ in src]
            t = time.perf_counter()
            if cfg["layerwise"]:
                for layer in range(geo.layers):
                    one = range(layer, layer + 1)
                    dd.cache_manager.pull_blocks(key, dst_cache, src, dst,
                                                 src_layer_range=one, dst_layer_range=one)
            else:
                dd.cache_manager.pull_blocks(key, dst_cache, src, dst)
            seconds = time.perf_counter() - t
            nbytes = len(src) * geo.block_bytes * geo.num_tensors
            pulled.append((req, dst, seconds, nbytes))
            say(f"pull {n + 1}/{len(batch)}: {len(src)} blocks, {_mib(nbytes)} in "
                f"{seconds * 1e3:.2f} ms")
        ctrl.send({"kind": "pulled"})
        dd.unlink_clusters([remote], LINK_TIMEOUT_MS)

        rows = []
        for n, (req, dst, seconds, nbytes) in enumerate(pulled):
            t = time.perf_counter()
            kv = lt.cache_from_blocks(blocks, dst, req["prompt_len"])
            tokens = lt.decode(model, kv, req["first_token"], req["prompt_len"],
                               cfg["new_tokens"], lt.eos_ids(model))
            rows.append({"req_id": req["req_id"], "prompt_len": req["prompt_len"],
                         "blocks": len(dst), "kv_bytes": nbytes, "pull_s": seconds,
                         "kv_identical": lt.blocks_digest(blocks, dst) == req["digest"],
                         "tokens": tokens})
            say(f"decode {n + 1}/{len(pulled)}: {len(tokens)} tokens in "
                f"{time.perf_counter() - t:.2f} s")
        dd.cache_manager.unregister_cache(dst_cache.cache_id)
        dd.finalize()
        report.send({"kind": "result", "rows": rows, "data_path": path})
        report.send({"kind": "finished"})
    except BaseException:
        report.send({"kind": "error", "role": "decoder", "traceback": traceback.format_exc()})
        raise SystemExit(1) from None


class _Say:
    """Progress lines from a child, relayed by the parent so that lines never interleave."""

    def __init__(self, conn: Connection, role: str) -> None:
        self._conn = conn
        self._role = role

    def __call__(self, text: str) -> None:
        self._conn.send({"kind": "progress", "text": f"[{self._role}] {text}"})


def _short(ids: list[int], n: int = 6) -> str:
    return "[" + ", ".join(map(str, ids[:n])) + (", ...]" if len(ids) > n else "]")


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


# ---------------------------------------------------------------- the parent


def _run_children(cfg: dict[str, Any], prompts: list[list[int]],
                  out: TextIO) -> dict[str, Any]:
    """Start PROMPT and DECODER, relay their progress, return the decoder's result."""
    ctx = mp.get_context("spawn")  # a fresh interpreter: no forked torch or socket state
    ctrl_prompt, ctrl_decoder = ctx.Pipe()
    reports = {role: ctx.Pipe(duplex=False) for role in ("prompt", "decoder")}
    procs = {
        "prompt": ctx.Process(target=_prompt_role, name="datadist-demo-prompt",
                              args=(cfg, prompts, ctrl_prompt, reports["prompt"][1])),
        "decoder": ctx.Process(target=_decoder_role, name="datadist-demo-decoder",
                               args=(cfg, ctrl_decoder, reports["decoder"][1])),
    }
    for proc in procs.values():
        proc.start()
    # Drop our copies of the children's ends, so a dead child reads as EOF, not silence.
    for conn in (ctrl_prompt, ctrl_decoder, reports["prompt"][1], reports["decoder"][1]):
        conn.close()
    readers = {reports[role][0]: role for role in procs}
    result: dict[str, Any] | None = None
    try:
        while readers:
            ready = wait(list(readers), timeout=CONTROL_TIMEOUT_S)
            if not ready:
                raise TimeoutError(f"no word from {sorted(readers.values())} within "
                                   f"{CONTROL_TIMEOUT_S:.0f} s")
            for obj in ready:
                conn = cast(Connection, obj)
                role = readers[conn]
                try:
                    msg = conn.recv()
                except EOFError:
                    raise _ChildFailed(f"the {role} process exited without a report "
                                       f"(exit code {procs[role].exitcode})") from None
                if msg["kind"] == "progress":
                    print(msg["text"], file=out, flush=True)
                elif msg["kind"] == "error":
                    raise _ChildFailed(f"the {msg['role']} process failed:\n{msg['traceback']}")
                elif msg["kind"] == "result":
                    result = msg
                elif msg["kind"] == "finished":
                    del readers[conn]
        for proc in procs.values():
            proc.join(timeout=CONTROL_TIMEOUT_S)
    finally:
        for proc in procs.values():
            if proc.is_alive():
                proc.kill()
                proc.join()
    if result is None:
        raise _ChildFailed("the decoder finished without a result")
    return result


def run(args: argparse.Namespace, out: TextIO | None = None) -> DemoReport:
    """The whole demo; blocks until done. Prints progress and the table to ``out`` (default
    sys.stdout). Raises DemoError if the model will not load or a process fails, TimeoutError
    if a process stops talking."""
    from datadist.demos import _llm_torch as lt

    out = sys.stdout if out is None else out

    cfg = dict(vars(args))
    t0 = time.perf_counter()

    def say(text: str) -> None:
        print(text, file=out, flush=True)

    say(f"[main] building the reference model ({lt.versions()})")
    try:
        model = lt.build_model(_spec(cfg))
    except (OSError, ValueError) as e:  # what transformers raises for a bad checkpoint
        raise DemoError(f"cannot load the model: {e}") from e
    mc = model.config
    prompts = make_prompts(args.prompts, args.max_prompt_len, mc.vocab_size, args.block_size,
                           args.seed)
    what = f"checkpoint {args.checkpoint}" if args.checkpoint else "random Llama, seed " \
        f"{args.seed}"
    geo = lt.kv_geometry(model, 0, args.block_size, args.dtype)
    say(f"[main] model: {what}; {mc.num_hidden_layers} layers, hidden {mc.hidden_size}, "
        f"{geo.kv_heads} kv heads x {geo.head_dim}, {args.dtype}")
    say(f"[main] {len(prompts)} prompts of {[len(p) for p in prompts]} tokens, block size "
        f"{args.block_size}, {'layer-wise' if args.layerwise else 'all layers per'} pull")
    say("[main] block tables travel over a multiprocessing.Pipe (the demo's control "
        "channel); KV bytes travel over datadist")

    result = _run_children(cfg, prompts, out)

    rows = []
    for n, r in enumerate(result["rows"]):
        t = time.perf_counter()
        ref = lt.reference_generate(model, prompts[r["req_id"]], args.new_tokens)
        say(f"[main] reference generate() {n + 1}/{len(result['rows'])} in "
            f"{time.perf_counter() - t:.2f} s")
        rows.append(RequestRow(r["req_id"], r["prompt_len"], r["blocks"], r["kv_bytes"],
                               r["pull_s"], r["kv_identical"], r["tokens"], ref))
    report = DemoReport(rows, result["data_path"])
    print_table(report, out)
    say(f"[main] {'OK' if report.ok else 'MISMATCH'}: "
        f"{sum(r.match for r in rows)}/{len(rows)} requests decode exactly as generate() "
        f"(data path {report.data_path}, {time.perf_counter() - t0:.1f} s in all)")
    return report


def print_table(report: DemoReport, out: TextIO) -> None:
    head = ("req", "prompt tokens", "blocks", "KV bytes", "pull ms", "GB/s", "KV identical",
            "tokens match")
    lines = [head]
    for r in report.rows:
        lines.append((str(r.req_id), str(r.prompt_len), str(r.blocks), f"{r.kv_bytes:,}",
                      f"{r.pull_s * 1e3:.2f}", f"{r.gbps:.2f}", _yes(r.kv_identical),
                      _yes(r.match)))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    print("", file=out)
    for n, line in enumerate(lines):
        print("  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)), file=out)
        if n == 0:
            print("  ".join("-" * w for w in widths), file=out)
    for r in report.rows:
        if not r.match:
            print(f"req {r.req_id}: decoder {r.tokens}\n       generate {r.reference}", file=out)
    if report.rows and report.rows[0].match:
        print(f"\nreq {report.rows[0].req_id} tokens, decoder and generate(): "
              f"{_short(report.rows[0].tokens, 12)}", file=out)
    print("", file=out, flush=True)


def _yes(flag: bool) -> str:
    return "yes" if flag else "NO"


def main(argv: list[str] | None = None) -> int:
    """Run the demo; 0 when every request's tokens match, 1 when not, 2 when it cannot run."""
    args = parse_args(argv)
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        print(f"the LLM demo needs torch and transformers: pip install 'datadist[llm]' ({e})",
              file=sys.stderr)
        return 2
    try:
        report = run(args)
    except (DemoError, TimeoutError) as e:
        # One line: the failure and, for a child's traceback, its last line (the error).
        # DATADIST_DEBUG=1 prints the whole message.
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        text = str(e) if os.environ.get("DATADIST_DEBUG") == "1" else " ".join(
            lines[:1] + lines[-1:] if len(lines) > 1 else lines)
        print(f"datadist demo --llm: error: {text}", file=sys.stderr)
        return 1
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
